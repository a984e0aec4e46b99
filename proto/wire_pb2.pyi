from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_UNSPECIFIED: _ClassVar[ErrorCode]
    PROTOCOL_MISMATCH: _ClassVar[ErrorCode]
    WRONG_JOB: _ClassVar[ErrorCode]
    LAYOUT_MISMATCH: _ClassVar[ErrorCode]
    CHECKSUM_MISMATCH: _ClassVar[ErrorCode]
    NON_FINITE: _ClassVar[ErrorCode]
    WRONG_SHAPE: _ClassVar[ErrorCode]
    UNKNOWN_CODEC: _ClassVar[ErrorCode]
    STALE_ROUND: _ClassVar[ErrorCode]
    TOO_LARGE: _ClassVar[ErrorCode]
    STATE_NOT_READY: _ClassVar[ErrorCode]
    STATE_GONE: _ClassVar[ErrorCode]
    ROUND_AHEAD: _ClassVar[ErrorCode]
    TOO_MANY_STREAMS: _ClassVar[ErrorCode]
    REVOKED: _ClassVar[ErrorCode]
ERROR_UNSPECIFIED: ErrorCode
PROTOCOL_MISMATCH: ErrorCode
WRONG_JOB: ErrorCode
LAYOUT_MISMATCH: ErrorCode
CHECKSUM_MISMATCH: ErrorCode
NON_FINITE: ErrorCode
WRONG_SHAPE: ErrorCode
UNKNOWN_CODEC: ErrorCode
STALE_ROUND: ErrorCode
TOO_LARGE: ErrorCode
STATE_NOT_READY: ErrorCode
STATE_GONE: ErrorCode
ROUND_AHEAD: ErrorCode
TOO_MANY_STREAMS: ErrorCode
REVOKED: ErrorCode

class Handshake(_message.Message):
    __slots__ = ("job", "site", "rank", "protocol_version", "layout_fingerprint", "layout")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    job: str
    site: str
    rank: int
    protocol_version: int
    layout_fingerprint: str
    layout: str
    def __init__(self, job: _Optional[str] = ..., site: _Optional[str] = ..., rank: _Optional[int] = ..., protocol_version: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., layout: _Optional[str] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("accepted", "error", "site", "rank", "protocol_version")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: Error
    site: str
    rank: int
    protocol_version: int
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., site: _Optional[str] = ..., rank: _Optional[int] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("round", "shard", "index", "count", "codec", "elements", "dtype", "payload", "checksum", "block_size", "scales_bytes", "values_bytes", "element_bytes", "weight", "offset", "lane")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCALES_BYTES_FIELD_NUMBER: _ClassVar[int]
    VALUES_BYTES_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    round: int
    shard: int
    index: int
    count: int
    codec: str
    elements: int
    dtype: str
    payload: bytes
    checksum: int
    block_size: int
    scales_bytes: int
    values_bytes: int
    element_bytes: int
    weight: float
    offset: int
    lane: int
    def __init__(self, round: _Optional[int] = ..., shard: _Optional[int] = ..., index: _Optional[int] = ..., count: _Optional[int] = ..., codec: _Optional[str] = ..., elements: _Optional[int] = ..., dtype: _Optional[str] = ..., payload: _Optional[bytes] = ..., checksum: _Optional[int] = ..., block_size: _Optional[int] = ..., scales_bytes: _Optional[int] = ..., values_bytes: _Optional[int] = ..., element_bytes: _Optional[int] = ..., weight: _Optional[float] = ..., offset: _Optional[int] = ..., lane: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("round", "shard", "index", "ok", "error", "checksum")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    round: int
    shard: int
    index: int
    ok: bool
    error: Error
    checksum: int
    def __init__(self, round: _Optional[int] = ..., shard: _Optional[int] = ..., index: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., checksum: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("job", "site", "rank", "protocol_version", "layout_fingerprint", "rounds", "offset")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    job: str
    site: str
    rank: int
    protocol_version: int
    layout_fingerprint: str
    rounds: int
    offset: int
    def __init__(self, job: _Optional[str] = ..., site: _Optional[str] = ..., rank: _Optional[int] = ..., protocol_version: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., rounds: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class StatePart(_message.Message):
    __slots__ = ("rounds", "total", "digest", "offset", "payload", "checksum", "error")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    total: int
    digest: str
    offset: int
    payload: bytes
    checksum: int
    error: Error
    def __init__(self, rounds: _Optional[int] = ..., total: _Optional[int] = ..., digest: _Optional[str] = ..., offset: _Optional[int] = ..., payload: _Optional[bytes] = ..., checksum: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

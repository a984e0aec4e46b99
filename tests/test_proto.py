"""The wire schema: generated code current, messages round-trip, imports stay in the namespace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from isthmus.proto import wire_pb2, wire_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_matches_the_proto_files():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_generated_modules_import_within_the_namespace():
    source = (ROOT / "proto" / "wire_pb2_grpc.py").read_text()
    assert "from isthmus.proto import wire_pb2" in source
    assert "\nimport wire_pb2" not in source
    assert hasattr(wire_pb2_grpc, "PeerServiceServicer")


def test_messages_round_trip():
    chunk = wire_pb2.Chunk(
        round=7,
        shard=2,
        index=3,
        count=9,
        codec="int8+zstd",
        elements=4096,
        dtype="float32",
        payload=b"\x01\x02",
        checksum=0xDEADBEEF,
        block_size=256,
        weight=1234.5,
    )
    again = wire_pb2.Chunk.FromString(chunk.SerializeToString())
    assert again == chunk and again.checksum == 0xDEADBEEF
    refusal = wire_pb2.HandshakeReply(
        accepted=False,
        error=wire_pb2.Error(code=wire_pb2.PROTOCOL_MISMATCH, message="peer speaks 2, we speak 1"),
    )
    assert wire_pb2.HandshakeReply.FromString(refusal.SerializeToString()).error.code == 1
    assert wire_pb2.ErrorCode.Name(wire_pb2.CHECKSUM_MISMATCH) == "CHECKSUM_MISMATCH"

"""The wire schema: generated code current, messages round-trip, imports stay in the namespace."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from isthmus.proto import wire_pb2, wire_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def _check(proto_dir: Path = ROOT / "proto") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check",
         "--proto-dir", str(proto_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_generated_code_matches_the_proto_files():
    result = _check()
    assert result.returncode == 0, result.stderr


def _copy_of_proto(tmp_path: Path) -> Path:
    copy = tmp_path / "proto"
    shutil.copytree(ROOT / "proto", copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_code_stamped_by_other_generator_releases_is_still_current(tmp_path):
    """A patch release of grpcio-tools or protobuf rewrites only their version
    stamps: the committed code is still right for the .proto."""
    proto = _copy_of_proto(tmp_path)
    grpc_file = proto / "wire_pb2_grpc.py"
    text = grpc_file.read_text()
    stamped, n = re.subn(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.1.0'", text)
    assert n == 1
    grpc_file.write_text(stamped)
    pb2 = proto / "wire_pb2.py"
    text = pb2.read_text()
    text, n1 = re.subn(r"# Protobuf Python Version: \S+", "# Protobuf Python Version: 99.0.3", text)
    text, n2 = re.subn(
        r"(Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,", r"\1\n    99,\n    0,\n    3,", text
    )
    assert n1 == n2 == 1
    pb2.write_text(text)
    result = _check(proto)
    assert result.returncode == 0, result.stderr


def test_code_that_disagrees_with_the_proto_is_out_of_date(tmp_path):
    proto = _copy_of_proto(tmp_path)
    schema = proto / "wire.proto"
    text = schema.read_text()
    # One more field in the first message: the committed code lacks it.
    first = re.search(r"^message (\w+) \{\n", text, re.M)
    assert first
    schema.write_text(
        text[: first.end()] + "  uint32 added_by_the_test = 999;\n" + text[first.end() :]
    )
    result = _check(proto)
    assert result.returncode == 1
    assert "out of date (wire_pb2.py, wire_pb2.pyi" in result.stderr


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

"""Generate the Python code of proto/*.proto, or check that the committed code is current.

    python scripts/gen_proto.py          # regenerate proto/*_pb2*.py(i)
    python scripts/gen_proto.py --check  # exit 1 if they differ from a fresh generation

The check compares the code, not the generators' version stamps: the
``GRPC_GENERATED_VERSION`` line of grpcio-tools, and protobuf's ``Protobuf Python
Version`` comment and runtime-version check. A patch release of either
rewrites only those, and the committed code stays right for the same .proto
(it still asks for at least the versions it was generated with).

The .proto files are compiled as if they lived in isthmus/proto/, so the
generated modules import each other as ``isthmus.proto.<name>_pb2``, never as
top-level modules.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
VERSION_STAMPS = (
    re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M),
    re.compile(r"^# Protobuf Python Version: \S+$", re.M),
    re.compile(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
        r"\s*\d+,\s*\d+,\s*\d+,\s*'[^']*',"
    ),
)


def without_version_stamps(text: str) -> str:
    """The generated code with each generator's version stamp blanked out."""
    for stamp in VERSION_STAMPS:
        text = stamp.sub("<version stamp>", text)
    return text


def same_code(fresh: Path, committed: Path) -> bool:
    if not committed.exists():
        return False
    return without_version_stamps(fresh.read_text()) == without_version_stamps(
        committed.read_text()
    )


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Compile every .proto of ``proto_dir`` into ``out_dir``; return the generated files."""
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "isthmus" / "proto"
        package.mkdir(parents=True)
        protos = sorted(proto_dir.glob("*.proto"))
        for proto in protos:
            shutil.copy(proto, package / proto.name)
        args = [
            "grpc_tools.protoc",
            f"-I{tmp}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[f"isthmus/proto/{p.name}" for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed; see the message above")
        out_dir.mkdir(parents=True, exist_ok=True)
        made = []
        for path in sorted(package.iterdir()):
            if path.name.endswith(SUFFIXES):
                shutil.copy(path, out_dir / path.name)
                made.append(out_dir / path.name)
        return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    parser.add_argument(
        "--proto-dir", type=Path, default=PROTO_DIR,
        help="the folder of the .proto files and their generated code (default: proto/)",
    )  # fmt: skip
    args = parser.parse_args()
    proto_dir: Path = args.proto_dir
    if not args.check:
        for path in generate(proto_dir, proto_dir):
            print(f"wrote {path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), proto_dir)
        stale = [p.name for p in fresh if not same_code(p, proto_dir / p.name)]
        extra = [
            p.name
            for p in proto_dir.iterdir()
            if p.name.endswith(SUFFIXES) and p.name not in {f.name for f in fresh}
        ]
    if stale or extra:
        print(
            f"generated protocol code is out of date ({', '.join(stale + extra)}); "
            "run: python scripts/gen_proto.py",
            file=sys.stderr,
        )
        return 1
    print("generated protocol code is current")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Generate the Python code of proto/*.proto, or check that the committed code is current.

    python scripts/gen_proto.py          # regenerate proto/*_pb2*.py(i)
    python scripts/gen_proto.py --check  # exit 1 if they differ from a fresh generation

The .proto files are compiled as if they lived in isthmus/proto/, so the
generated modules import each other as ``isthmus.proto.<name>_pb2``, never as
top-level modules.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto into ``out_dir``; return the generated files."""
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "isthmus" / "proto"
        package.mkdir(parents=True)
        protos = sorted(PROTO_DIR.glob("*.proto"))
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
    args = parser.parse_args()
    if not args.check:
        for path in generate(PROTO_DIR):
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            p.name
            for p in fresh
            if not (PROTO_DIR / p.name).exists()
            or not filecmp.cmp(p, PROTO_DIR / p.name, shallow=False)
        ]
        extra = [
            p.name
            for p in PROTO_DIR.iterdir()
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

"""Generates the gRPC stubs in services/api/v1 from proto/, or checks they are current.

    python tools/protogen.py          # regenerate
    python tools/protogen.py --check  # exit 1 when the checked-in stubs drift from proto/

protoc names generated modules after the proto package (``etude.v1``); the
project's import root is ``services``, so imports are rewritten to
``services.api.v1``. Only module references (names ending in ``_pb2``) are
rewritten; service names such as ``/etude.v1.ReconcilerService/...`` stay, they
are the wire contract.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_PACKAGE = PROTO_ROOT / "etude" / "v1"
OUT_PACKAGE = ROOT / "services" / "api" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")

_FROM_IMPORT = re.compile(r"^from etude\.v1 import ", re.MULTILINE)
_MODULE_REF = re.compile(r"\betude\.v1\.(\w+_pb2(?:_grpc)?)\b")


def _rewrite(text: str) -> str:
    text = _FROM_IMPORT.sub("from services.api.v1 import ", text)
    return _MODULE_REF.sub(r"services.api.v1.\1", text)


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc for every .proto in proto/etude/v1 and writes rewritten stubs to out_dir."""
    bin_dir = Path(sys.executable).parent
    protos = sorted(PROTO_PACKAGE.glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_PACKAGE}")
    with tempfile.TemporaryDirectory() as raw:
        command = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={raw}",
            f"--grpc_python_out={raw}",
            f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
            f"--mypy_out={raw}",
            f"--mypy_grpc_out={raw}",
            *[str(p.relative_to(PROTO_ROOT)) for p in protos],
        ]
        done = subprocess.run(command, cwd=PROTO_ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"protoc failed:\n{done.stderr}")
        written = []
        for source in sorted((Path(raw) / "etude" / "v1").iterdir()):
            if source.name.endswith(GENERATED_SUFFIXES):
                target = out_dir / source.name
                target.write_text(_rewrite(source.read_text()))
                written.append(target)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when stubs drift")
    args = parser.parse_args()
    if not args.check:
        for stale in OUT_PACKAGE.glob("*_pb2*"):
            stale.unlink()
        OUT_PACKAGE.mkdir(parents=True, exist_ok=True)
        written = generate(OUT_PACKAGE)
        print(f"wrote {len(written)} files to {OUT_PACKAGE.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as fresh_dir:
        fresh = {p.name: p.read_text() for p in generate(Path(fresh_dir))}
    current = {p.name: p.read_text() for p in OUT_PACKAGE.glob("*_pb2*") if p.is_file()}
    drift = sorted(n for n in fresh.keys() | current.keys() if fresh.get(n) != current.get(n))
    if drift:
        print("generated stubs drift from proto/ (run `make proto`):", file=sys.stderr)
        for name in drift:
            print(f"  services/api/v1/{name}", file=sys.stderr)
        return 1
    print(f"stubs current: {len(fresh)} files match proto/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

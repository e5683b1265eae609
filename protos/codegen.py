"""Regenerate (or check) the Python code generated from ``protos/pstrain.proto``.

``python -m pstrain.protos.codegen`` rewrites the generated modules; ``--check`` exits
non-zero when the committed ones differ from what the pinned grpcio-tools would produce, so a
proto edit without regeneration fails the test suite instead of production.

The repository folder ``protos/`` is installed as ``pstrain.protos``; protoc derives the
generated modules' imports from the .proto's path, so it runs on a copy laid out as
``pstrain/protos/pstrain.proto``.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

PROTOS_DIR = Path(__file__).resolve().parent
PROTO_NAME = "pstrain.proto"
IMPORT_PATH = Path("pstrain/protos")  # where the .proto sits for protoc: its import path
GENERATED = ("pstrain_pb2.py", "pstrain_pb2.pyi", "pstrain_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Write the generated modules into ``out_dir``."""
    from grpc_tools import protoc  # dev-only dependency

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / IMPORT_PATH).mkdir(parents=True)
        shutil.copy(PROTOS_DIR / PROTO_NAME, root / IMPORT_PATH / PROTO_NAME)
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            str(root / IMPORT_PATH / PROTO_NAME),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {PROTO_NAME}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copy(root / IMPORT_PATH / name, out_dir / name)


def stale_files() -> list[str]:
    """Names of generated files whose committed content differs from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        return [
            name
            for name in GENERATED
            if not (PROTOS_DIR / name).exists() or not filecmp.cmp(fresh / name, PROTOS_DIR / name, shallow=False)
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code: {', '.join(stale)}; run `python -m pstrain.protos.codegen`")
            return 1
        print("generated code is up to date")
        return 0
    generate(PROTOS_DIR)
    print(f"regenerated {', '.join(GENERATED)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

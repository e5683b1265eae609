"""Regenerate (or check) the Python code generated from ``protos/pstrain.proto``.

``python -m protos.codegen`` rewrites the generated modules; ``--check`` exits non-zero
when the committed ones differ from what the pinned grpcio-tools would produce, so a
proto edit without regeneration fails the test suite instead of production.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO = Path("protos/pstrain.proto")
GENERATED = ("pstrain_pb2.py", "pstrain_pb2.pyi", "pstrain_pb2_grpc.py")


def generate(out_root: Path) -> None:
    """Run protoc so that the generated modules import each other as ``protos.*``."""
    from grpc_tools import protoc  # dev-only dependency

    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(REPO_ROOT / PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {PROTO}")


def stale_files() -> list[str]:
    """Names of generated files whose committed content differs from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh_dir = Path(tmp) / "protos"
        return [
            name
            for name in GENERATED
            if not (REPO_ROOT / "protos" / name).exists()
            or not filecmp.cmp(fresh_dir / name, REPO_ROOT / "protos" / name, shallow=False)
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code: {', '.join(stale)}; run `python -m protos.codegen`")
            return 1
        print("generated code is up to date")
        return 0
    generate(REPO_ROOT)
    print(f"regenerated {', '.join(GENERATED)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

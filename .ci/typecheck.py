"""Run mypy over the repository folders under the names they are installed as (``pstrain.*``).

Given the folders, mypy would name their modules ``worker.main`` instead of ``pstrain.worker.main``,
and it cannot follow setuptools' editable finder (an import hook) to map them. So this reads the
package-dir mapping from pyproject.toml and hands mypy every file with its installed module name:
imports between the packages resolve to the repository files, and errors name those files.

Usage: ``python .ci/typecheck.py [mypy options]`` (``make lint`` runs it); exit status 1 on errors.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mypy depends on tomli there
    import tomli as tomllib  # type: ignore[no-redef]

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent


def sources() -> list[BuildSource]:
    """One source per module of every mapped package; a ``.pyi`` stub stands in for its ``.py``."""
    mapping: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = []
    for package, folder in sorted(mapping.items()):
        files = {path.stem: path for path in sorted((ROOT / folder).glob("*.py"))}
        files.update({path.stem: path for path in (ROOT / folder).glob("*.pyi")})
        for stem, path in sorted(files.items()):
            module = package if stem == "__init__" else f"{package}.{stem}"
            found.append(BuildSource(str(path.relative_to(ROOT)), module))
    return found


def main(argv: list[str]) -> int:
    os.chdir(ROOT)  # paths in errors are relative to the repository, and pyproject.toml is found
    _, options = process_options(argv, require_targets=False)
    targets = sources()
    try:
        messages = build.build(targets, options).errors
    except CompileError as exc:
        messages = exc.messages
    for line in messages:
        print(line)
    errors = sum(": error:" in line for line in messages)
    if errors:
        print(f"Found {errors} errors in {len(targets)} source files")
        return 1
    print(f"Success: no issues found in {len(targets)} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

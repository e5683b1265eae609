"""The built wheel: one top-level name, ``pstrain``, that imports without the checkout on the path."""

import configparser
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pstrain import __version__
from tests.helpers import REPO_ROOT, build_wheel

PACKAGES = ("protos", "runtime", "ps_server", "worker", "coordinator", "planner", "launcher")
DIST_INFO = f"pstrain-{__version__}.dist-info"
# What the old layout installed at the top, and folders of the checkout that are not installed.
NOT_INSTALLED = ("examples", "tests", "bench", *PACKAGES)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def names(wheel) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel unpacked by pip into a bare folder; torch and grpc still come from this venv."""
    target = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target)]
    result = subprocess.run([*cmd, str(wheel)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return target


def run_in(target: Path, code: str) -> subprocess.CompletedProcess:
    """Python with only ``target`` added to the path: cwd is ``target``, not the checkout."""
    env = {**os.environ, "PYTHONPATH": str(target)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=target, env=env, capture_output=True, text=True, timeout=300
    )


def console_scripts(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(f"{DIST_INFO}/entry_points.txt").decode()
    parser = configparser.ConfigParser()
    parser.read_string(text)
    return dict(parser["console_scripts"])


def test_wheel_has_one_top_level_name(wheel, names):
    assert wheel.name == f"pstrain-{__version__}-py3-none-any.whl"
    assert {name.split("/")[0] for name in names} == {"pstrain", DIST_INFO}
    modules = [name for name in names if name.endswith((".py", ".pyi"))]
    assert modules and all(name.startswith("pstrain/") for name in modules)
    for folder in NOT_INSTALLED:
        assert f"{folder}/__init__.py" not in names
    assert not [name for name in names if "/examples/" in name or "/tests/" in name]
    for package in PACKAGES:
        assert f"pstrain/{package}/__init__.py" in names
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(f"{DIST_INFO}/top_level.txt").decode().split() == ["pstrain"]


def test_wheel_ships_the_wire_contract(wheel, names):
    for generated in ("pstrain.proto", "pstrain_pb2.py", "pstrain_pb2.pyi", "pstrain_pb2_grpc.py", "codec.py"):
        assert f"pstrain/protos/{generated}" in names
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("pstrain/protos/pstrain.proto") == (REPO_ROOT / "protos/pstrain.proto").read_bytes()


def test_console_scripts_point_into_pstrain(wheel):
    scripts = console_scripts(wheel)
    assert sorted(scripts) == ["pstrain", "pstrain-coordinator", "pstrain-ps", "pstrain-worker"]
    assert all(target.startswith("pstrain.") and ":" in target for target in scripts.values()), scripts


def test_installed_wheel_imports_from_its_own_files(wheel, installed):
    """Every ``pstrain`` module comes from the unpacked wheel, so nothing missing is borrowed from the checkout."""
    targets = sorted(console_scripts(wheel).values())
    code = f"""
import importlib, json, sys
import pstrain.worker, pstrain.coordinator, pstrain.ps_server
for target in {targets!r}:
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), target
print(json.dumps({{name: getattr(m, "__file__", None) for name, m in sys.modules.items()
                  if name == "pstrain" or name.startswith("pstrain.")}}))
"""
    result = run_in(installed, code)
    assert result.returncode == 0, result.stderr[-3000:]
    files = json.loads(result.stdout.splitlines()[-1])
    assert {"pstrain.worker", "pstrain.coordinator", "pstrain.ps_server", "pstrain.protos"} <= set(files)
    elsewhere = {name: path for name, path in files.items() if not str(path).startswith(str(installed))}
    assert not elsewhere


def test_installed_wheel_exposes_no_other_top_level_name(installed):
    assert {path.name for path in installed.iterdir()} - {"bin"} == {"pstrain", DIST_INFO}  # bin: the scripts
    code = f"""
import importlib
found = []
for name in {NOT_INSTALLED!r}:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        continue
    found.append(name)
print(found)
"""
    result = run_in(installed, code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"

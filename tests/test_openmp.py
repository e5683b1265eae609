"""Every pstrain service starts with OpenMP's passive wait policy unless the operator set one (``runtime.openmp``).

The services are started the two ways operators start them, ``python -m pstrain.<service>`` (``pstrain local``) and
the console scripts (the systemd units), with ``OMP_DISPLAY_ENV=VERBOSE``: the OpenMP library torch loads prints the
policy it read, so what is checked is what the running process uses, not what a function returned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from pstrain.runtime.openmp import PASSIVE, VARIABLE, prefer_passive_waits
from tests.helpers import REPO_ROOT

SERVICES = ("ps_server", "worker", "coordinator")
SCRIPTS = {"ps_server": "pstrain-ps", "worker": "pstrain-worker", "coordinator": "pstrain-coordinator"}
PASSIVE_SPIN = "GOMP_SPINCOUNT = '0'"  # libgomp's figure once the policy is PASSIVE (its default spins 300000 times)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (VARIABLE, "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return {**env, "OMP_DISPLAY_ENV": "VERBOSE", **extra}


def _openmp_report(cmd: list[str], **extra: str) -> str:
    """What the OpenMP library of the process ``cmd`` starts printed about itself (its stderr)."""
    run = subprocess.run(cmd, env=_env(**extra), capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stderr


@pytest.fixture(scope="module")
def libgomp() -> None:
    """The checks read libgomp's report; another OpenMP library (macOS's libomp) prints another one."""
    report = _openmp_report([sys.executable, "-c", "import torch"])
    if "GOMP_SPINCOUNT" not in report:
        pytest.skip("torch here does not load libgomp, whose OMP_DISPLAY_ENV report these checks read")
    assert PASSIVE_SPIN not in report  # without the policy it spins: the checks below can tell the difference


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_started_with_python_m_waits_passively(libgomp, service):
    # Only the spin count tells: libgomp reports OMP_WAIT_POLICY = 'PASSIVE' for its default too.
    assert PASSIVE_SPIN in _openmp_report([sys.executable, "-m", f"pstrain.{service}", "--help"])


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_started_by_its_console_script_waits_passively(libgomp, service):
    script = Path(sys.executable).parent / SCRIPTS[service]
    if not script.exists():
        pytest.skip(f"{script.name} is not installed next to {sys.executable} (pip install -e . puts it there)")
    assert PASSIVE_SPIN in _openmp_report([str(script), "--help"])


def test_an_operators_policy_is_kept(libgomp):
    report = _openmp_report([sys.executable, "-m", "pstrain.ps_server", "--help"], **{VARIABLE: "ACTIVE"})
    assert f"{VARIABLE} = 'ACTIVE'" in report
    assert PASSIVE_SPIN not in report


def test_too_late_once_torch_is_loaded_says_so(monkeypatch):
    """This test process has imported torch: the policy is set for children, but this process cannot change."""
    assert torch.__name__ in sys.modules
    monkeypatch.delenv(VARIABLE, raising=False)
    with pytest.warns(RuntimeWarning, match="torch was imported before"):
        assert prefer_passive_waits() is False
    assert os.environ[VARIABLE] == PASSIVE
    monkeypatch.setenv(VARIABLE, "ACTIVE")  # the operator's choice: kept, and nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prefer_passive_waits() is False
    assert os.environ[VARIABLE] == "ACTIVE"

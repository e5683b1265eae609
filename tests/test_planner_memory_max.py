"""MemoryMax from the estimate (issue 10): the ``pstrain_memory_max`` Ansible role runs ``pstrain plan``
on the host and renders systemd drop-ins for the worker and PS units; ``systemd-analyze verify`` checks them."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO_ROOT, write_job
from tests.test_ansible import ansible_env

BIN = Path(sys.executable).parent


def run_role(tmp: Path, unit: str, **extra: object) -> subprocess.CompletedProcess:
    root = tmp / "root"
    (root / "etc/pstrain").mkdir(parents=True, exist_ok=True)
    play = [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "vars": {
                "ansible_python_interpreter": sys.executable,
                "pstrain_root": str(root),
                "pstrain_config_dir": "/etc/pstrain",
                "pstrain_unit_dir": "/etc/systemd/system",
                "pstrain_prefix": "/opt/pstrain",
                "pstrain_manage_services": False,
                "pstrain_memory_max_unit": unit,
                **extra,
            },
            "roles": ["pstrain_memory_max"],
        }
    ]
    playbook = tmp / "play.yml"
    playbook.write_text(yaml.safe_dump(play))
    env = ansible_env(tmp) | {"ANSIBLE_ROLES_PATH": str(REPO_ROOT / "ansible/roles")}
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", str(playbook)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO_ROOT,
    )


def test_the_role_applies_the_plans_estimates_as_drop_ins(tmp_path):
    (tmp_path / "root/etc/pstrain").mkdir(parents=True)
    job = write_job(tmp_path / "root/etc/pstrain/job.yaml", batch={"per_device": 8})
    args = ["--device-memory", "1GiB", "--host-memory", "8GiB"]
    for unit, name in (("worker", "pstrain-worker.service"), ("ps", "pstrain-ps@.service")):
        result = run_role(
            tmp_path,
            unit,
            pstrain_memory_max_from_plan=True,
            pstrain_memory_max_pstrain_bin=str(BIN / "pstrain"),
            pstrain_memory_max_plan_args=args,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        figures = json.loads((tmp_path / "root/etc/pstrain/memory-max.json").read_text())
        drop_in = tmp_path / f"root/etc/systemd/system/{name}.d/50-memory-max.conf"
        assert f"MemoryMax={figures[unit + '_bytes']}\n" in drop_in.read_text()
    assert figures["worker_bytes"] > 2 << 30 and figures["ps_bytes"] > 1 << 30  # the runtime's own share is counted
    assert job.exists()


USER_CODE = """import torch


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4))


def data():
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(16, 5, generator=gen), torch.randint(0, 4, (16,), generator=gen))
"""


def test_the_plan_runs_from_the_deployed_venv_and_code_under_pstrain_root(tmp_path):
    """The role's defaults, as a real deployment has them: pstrain from the venv under ``pstrain_root``, and the
    job's factories from the deployed code folder (the units' PYTHONPATH), which is nowhere else on the path."""
    root = tmp_path / "root"
    venv_bin = root / "opt/pstrain/venv/bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "pstrain").symlink_to(BIN / "pstrain")
    code = root / "opt/pstrain/code/deployed_user_code"
    code.mkdir(parents=True)
    (code / "__init__.py").write_text("")
    (code / "models.py").write_text(USER_CODE)
    (root / "etc/pstrain").mkdir(parents=True)
    write_job(
        root / "etc/pstrain/job.yaml",
        model={"factory": "deployed_user_code.models:mlp"},
        data={"factory": "deployed_user_code.models:data", "shard_size": 8},
        batch={"per_device": 8},
    )
    result = run_role(
        tmp_path,
        "worker",
        pstrain_memory_max_from_plan=True,
        pstrain_memory_max_plan_args=["--device-memory", "1GiB", "--host-memory", "8GiB"],
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    figures = json.loads((root / "etc/pstrain/memory-max.json").read_text())
    drop_in = root / "etc/systemd/system/pstrain-worker.service.d/50-memory-max.conf"
    assert f"MemoryMax={figures['worker_bytes']}\n" in drop_in.read_text()


def test_explicit_estimates_and_nothing_when_none_are_given(tmp_path):
    result = run_role(tmp_path, "ps", pstrain_memory_max_estimates={"worker_bytes": 5 << 30, "ps_bytes": 3 << 30})
    assert result.returncode == 0, result.stdout[-3000:]
    drop_in = tmp_path / "root/etc/systemd/system/pstrain-ps@.service.d/50-memory-max.conf"
    assert f"MemoryMax={3 << 30}\n" in drop_in.read_text()
    empty = tmp_path / "empty"
    result = run_role(empty, "worker")
    assert result.returncode == 0, result.stdout[-3000:]
    assert not (empty / "root/etc/systemd/system/pstrain-worker.service.d").exists()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_the_drop_in(tmp_path):
    result = run_role(tmp_path, "worker", pstrain_memory_max_estimates={"worker_bytes": 5 << 30, "ps_bytes": 1})
    assert result.returncode == 0, result.stdout[-3000:]
    units = tmp_path / "root/etc/systemd/system"
    (units / "pstrain-worker.service").write_text("[Unit]\nDescription=test\n[Service]\nExecStart=/bin/true\n")
    verify = subprocess.run(
        ["systemd-analyze", "verify", str(units / "pstrain-worker.service")],
        capture_output=True,
        text=True,
        env={"SYSTEMD_UNIT_PATH": f"{units}:", "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    if "Failed to " in verify.stderr and "bus" in verify.stderr.lower():
        pytest.skip(f"systemd-analyze cannot run here: {verify.stderr.strip()[:200]}")
    assert verify.returncode == 0, verify.stderr
    assert "MemoryMax" not in verify.stderr  # the drop-in's key and value parse

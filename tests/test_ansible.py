"""The Ansible playbook, run for real against localhost into a temporary root (services off)."""

import getpass
import grp
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pstrain.coordinator.config import load_config
from tests.helpers import REPO_ROOT, build_wheel

ANSIBLE = REPO_ROOT / "ansible"
BIN = Path(sys.executable).parent


def ansible_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(ANSIBLE_NOCOLOR="1", ANSIBLE_HOME=str(tmp / ".ansible"), ANSIBLE_LOCAL_TEMP=str(tmp / ".ansible-tmp"))
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def playbook(tmp: Path, inventory: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), str(ANSIBLE / "site.yml"), *extra],
        capture_output=True,
        text=True,
        env=ansible_env(tmp),
        timeout=1200,
    )


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deploy")
    root = tmp / "root"
    wheel = build_wheel(tmp)
    inventory = tmp / "inventory.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "vars": {
                        "ansible_connection": "local",
                        "ansible_python_interpreter": sys.executable,
                        "pstrain_root": str(root),
                        "pstrain_manage_services": False,
                        "pstrain_create_user": False,
                        "pstrain_become": False,
                        "pstrain_user": getpass.getuser(),
                        "pstrain_group": grp.getgrgid(os.getgid()).gr_name,
                        "pstrain_wheel": str(wheel),
                        "pstrain_python": sys.executable,
                        "pstrain_ps_shards_per_host": 2,
                        "pstrain_worker_devices": "cpu,cpu",
                        "pstrain_token_file": "/etc/pstrain/token",
                        "pstrain_worker_memory_max": "16G",
                    },
                    "children": {
                        "coordinator": {"hosts": {"localhost": None}},
                        "ps": {"hosts": {"localhost": None}},
                        "workers": {"hosts": {"localhost": None}},
                    },
                }
            }
        )
    )
    first = playbook(tmp, inventory)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    second = playbook(tmp, inventory)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    return root, first.stdout, second.stdout


def recap(stdout: str) -> dict[str, int]:
    line = next(line for line in stdout.splitlines() if line.startswith("localhost") and "ok=" in line)
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}


def test_syntax_check(tmp_path):
    result = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "--syntax-check",
            "-i",
            str(ANSIBLE / "inventory.example.yml"),
            str(ANSIBLE / "site.yml"),
        ],
        capture_output=True,
        text=True,
        env=ansible_env(tmp_path),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr


def test_ansible_lint_is_clean(tmp_path):
    result = subprocess.run(
        [str(BIN / "ansible-lint"), "--nocolor", "site.yml"],
        cwd=ANSIBLE,
        capture_output=True,
        text=True,
        env=ansible_env(tmp_path),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_playbook_installs_everything(deployed, tmp_path):
    root, first, _ = deployed
    assert recap(first)["changed"] > 0 and recap(first)["failed"] == 0
    units = root / "etc/systemd/system"
    assert sorted(p.name for p in units.iterdir()) == [
        "pstrain-coordinator.service",
        "pstrain-ps@.service",
        "pstrain-worker.service",
    ]
    venv = root / "opt/pstrain/venv"
    worker = (units / "pstrain-worker.service").read_text()
    assert "Type=notify" in worker and "Restart=on-failure" in worker and "MemoryMax=16G" in worker
    assert "RestartPreventExitStatus=2 3" in worker
    assert f"ExecStart={venv}/bin/pstrain-worker --coordinator localhost:7070" in worker
    assert "--devices cpu,cpu" in worker and "--token-file /etc/pstrain/token" in worker
    assert "PrivateDevices=" not in worker and "MemoryDenyWriteExecute=" not in worker
    assert "PrivateDevices=yes" in (units / "pstrain-ps@.service").read_text()
    assert "TimeoutStopSec=30" in (units / "pstrain-coordinator.service").read_text()  # > the 10 s grace
    envs = {p.name: p.read_text() for p in (root / "etc/pstrain").glob("ps-*.env")}
    assert sorted(envs) == ["ps-0.env", "ps-1.env"]
    assert "PSTRAIN_PS_PORT=7101" in envs["ps-1.env"] and "PSTRAIN_PS_METRICS_PORT=9411" in envs["ps-1.env"]
    assert "PSTRAIN_PS_BULK_PORT=7151" in envs["ps-1.env"]  # issue 12: the port to open to remote workers
    assert "--bulk-port ${PSTRAIN_PS_BULK_PORT}" in (units / "pstrain-ps@.service").read_text()
    cfg = load_config(root / "etc/pstrain/job.yaml")
    assert cfg.cluster.ps_shards == 2 and cfg.cluster.workers == 1 and cfg.model.factory == "examples.digits:mlp"
    check = subprocess.run(
        [
            str(venv / "bin/python"),
            "-c",
            "import pstrain.coordinator, pstrain.ps_server, pstrain.worker, torch; print(torch.__version__)",
        ],
        cwd=tmp_path,  # not the checkout, whose bare pstrain/ folder would shadow the installed package
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0 and check.stdout.startswith("2.13.0"), check.stderr
    for tool in ("pstrain", "pstrain-coordinator", "pstrain-ps", "pstrain-worker"):
        assert subprocess.run([str(venv / "bin" / tool), "--help"], capture_output=True, timeout=120).returncode == 0


def test_user_code_is_deployed_on_the_units_path(deployed, tmp_path):
    """The wheel ships pstrain only: the job's factories import from the copied code folder."""
    root, _, _ = deployed
    code = root / "opt/pstrain/code"
    assert (code / "examples/digits.py").read_bytes() == (REPO_ROOT / "examples/digits.py").read_bytes()
    assert not list(code.rglob("*.pyc"))
    units = root / "etc/systemd/system"
    paths = set()
    for unit in units.iterdir():
        (line,) = [line for line in unit.read_text().splitlines() if line.startswith("Environment=PYTHONPATH=")]
        paths.add(line.removeprefix("Environment=PYTHONPATH="))
    assert paths == {str(code)}
    venv_python = str(root / "opt/pstrain/venv/bin/python")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    probe = "import examples.digits, sklearn; print(examples.digits.__file__)"
    bare = subprocess.run(
        [venv_python, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert bare.returncode != 0 and "No module named 'examples'" in bare.stderr, bare.stderr  # not in the wheel
    env["PYTHONPATH"] = paths.pop()
    check = subprocess.run(
        [venv_python, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == str(code / "examples/digits.py")


def test_second_run_changes_nothing(deployed):
    _, _, second = deployed
    counts = recap(second)
    assert counts["changed"] == 0 and counts["failed"] == 0, second[-3000:]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_units_pass_systemd_analyze_verify(deployed, tmp_path):
    root, _, _ = deployed
    units = root / "etc/systemd/system"
    instance = tmp_path / "pstrain-ps@0.service"  # verify needs an instance of the template
    instance.write_text((units / "pstrain-ps@.service").read_text())
    files = [units / "pstrain-coordinator.service", units / "pstrain-worker.service", instance]
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *map(str, files)], capture_output=True, text=True, timeout=120
    )
    problems = [line for line in result.stderr.splitlines() if "pstrain" in line]
    assert result.returncode == 0 and not problems, result.stderr


def test_a_token_is_generated_once_per_cluster_and_installed_0600(deployed, tmp_path):
    """Issue 8: the services refuse a public address without a token, so the playbook always deploys one."""
    root, _, _ = deployed
    installed = root / "etc/pstrain/token"
    token = installed.read_text().strip()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token) and installed.stat().st_mode & 0o777 == 0o600
    (store,) = (root.parent).glob("pstrain-credentials/*-token")  # beside the inventory, on the controller
    assert store.read_text().strip() == token  # the same token for every host and every run
    for unit in (root / "etc/systemd/system").iterdir():
        assert "--token-file /etc/pstrain/token" in unit.read_text() and "--insecure" not in unit.read_text()
        assert token not in unit.read_text()


def test_an_inventory_token_is_used_as_given(tmp_path):
    root = tmp_path / "root"
    (root / "etc/pstrain").mkdir(parents=True)
    inventory = tmp_path / "inventory.yml"
    given = "from-the-vault-0123456789"
    variables = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "pstrain_root": str(root),
        "pstrain_manage_services": False,
        "pstrain_create_user": False,
        "pstrain_become": False,
        "pstrain_user": getpass.getuser(),
        "pstrain_group": grp.getgrgid(os.getgid()).gr_name,
        "pstrain_token": given,
    }
    inventory.write_text(
        yaml.safe_dump(
            {"all": {"vars": variables, "children": {g: {"hosts": {"localhost": None}} for g in ("coordinator",)}}}
        )
    )
    result = playbook(tmp_path, inventory, "--tags", "pstrain_token", "--limit", "coordinator")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert given not in result.stdout  # no_log
    assert (root / "etc/pstrain/token").read_text().strip() == given
    assert (root / "etc/pstrain/token").stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "pstrain-credentials").exists()  # nothing generated

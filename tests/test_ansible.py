"""The Ansible playbook, run for real against localhost into a temporary root (services off)."""

import argparse
import getpass
import grp
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import yaml

from pstrain.coordinator import main as coordinator_main
from pstrain.coordinator.config import TransportConfig, load_config
from pstrain.ps_server import main as ps_main
from pstrain.worker import main as worker_main
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
    assert "TimeoutStopSec=62" in (units / "pstrain-coordinator.service").read_text()  # > its stop path, 10 s grace
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


# ------------------------------------------------------------------ the units' start and stop timeouts
# Rendered in-process (jinja2, with the two Ansible filters the units use) so each check takes milliseconds; the
# playbook tests above render the same templates through Ansible itself.

ROLES = {"coordinator": "pstrain_coordinator", "ps": "pstrain_ps", "worker": "pstrain_worker"}
UNITS = {
    "coordinator": "pstrain-coordinator.service.j2",
    "ps": "pstrain-ps@.service.j2",
    "worker": "pstrain-worker.service.j2",
}
PARSE = {"coordinator": coordinator_main.parse_args, "ps": ps_main.parse_args, "worker": worker_main.parse_args}


def ansible_bool(value: object) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on", "y")


def unit_variables(**overrides: object) -> dict[str, object]:
    """The role defaults (their own templates resolved) with ``overrides``, as one host of a play sees them."""
    variables: dict[str, object] = yaml.safe_load((ANSIBLE / "roles/pstrain/defaults/main.yml").read_text())
    variables.update(overrides)
    variables.update(
        ansible_managed="managed",
        inventory_hostname="host-1",
        groups={"coordinator": ["host-0"]},
        playbook_dir=str(ANSIBLE),
        inventory_dir=str(ANSIBLE),
    )
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    for _ in range(3):  # defaults that name other defaults, e.g. pstrain_token_file
        for key, value in variables.items():
            if isinstance(value, str) and "{{" in value:
                variables[key] = env.from_string(value).render(variables)
    return variables


def render_unit(role: str, **overrides: object) -> dict[str, str]:
    """``role``'s unit rendered with ``overrides``: its [Service] settings, by name (the last one wins)."""
    loader = jinja2.FileSystemLoader([str(ANSIBLE / "roles" / ROLES[role] / "templates"), str(ANSIBLE / "templates")])
    env = jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, trim_blocks=True)
    env.filters.update(bool=ansible_bool, regex_replace=lambda value, pattern, repl: re.sub(pattern, repl, value))
    text = env.get_template(UNITS[role]).render(unit_variables(**overrides))
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))


def exec_args(role: str, unit: dict[str, str]) -> argparse.Namespace:
    """What the service's own parser makes of the unit's ExecStart (a shard's ports come from its env file, its id
    from the instance name)."""
    argv = re.sub(r"\$\{\w+\}", "7100", unit["ExecStart"]).replace("%i", "0").split()[1:]
    return PARSE[role](argv)


START_SETTINGS = [{}, {"pstrain_connect_timeout_s": 30, "pstrain_cluster_timeout_s": 1800, "pstrain_start_work_s": 60}]


@pytest.mark.parametrize("settings", START_SETTINGS, ids=["defaults", "inventory"])
@pytest.mark.parametrize("role", ["ps", "worker"])
def test_a_members_start_timeout_outlasts_its_own_waits_for_the_cluster(role, settings):
    """Type=notify: READY=1 only once the member joined and serves. systemd's default 90 s TimeoutStartSec killed a
    worker still within its --connect-timeout-s (120) and --cluster-timeout-s (600) waits, over and over: the unit's
    timeout must exceed the waits the member's own flags allow, plus the time for its own start-up work."""
    variables = unit_variables(**settings)
    unit = render_unit(role, **settings)
    args = exec_args(role, unit)
    assert args.connect_timeout_s == variables["pstrain_connect_timeout_s"]  # the flags come from the inventory
    if role == "worker":
        assert args.cluster_timeout_s == variables["pstrain_cluster_timeout_s"]
    assert unit["Type"] == "notify"
    waits = (worker_main if role == "worker" else ps_main).start_waits_s(args)
    assert float(unit.get("TimeoutStartSec", 90)) >= waits + variables["pstrain_start_work_s"], unit


def test_the_coordinators_start_timeout_is_its_start_up_work():
    unit = render_unit("coordinator", pstrain_start_work_s=450)
    assert unit["Type"] == "notify" and unit["TimeoutStartSec"] == "450"


@pytest.mark.parametrize("heartbeat_s", [None, 45.5])
@pytest.mark.parametrize("grace_s", [10, 45])
@pytest.mark.parametrize("role", ["coordinator", "ps", "worker"])
def test_a_units_stop_timeout_outlasts_its_members_stop_path(role, grace_s, heartbeat_s):
    """TimeoutStopSec was grace + 20 s while a worker's stop may wait 30 s for its trainer thread, then the grace,
    then 30 s for the heartbeat thread (and a shard waits for its checkpoint writers): systemd SIGKILLed members
    mid-drain. The unit must outlast each member's own bounded stop waits, with time left for the process to exit."""
    job = dict(unit_variables()["pstrain_job"])
    if heartbeat_s is not None:  # the coordinator's liveness slice is the job file's, not the default's
        job["transport"] = {"heartbeat_s": heartbeat_s, "heartbeat_timeout_s": 4 * heartbeat_s}
    unit = render_unit(role, pstrain_grace_s=grace_s, pstrain_job=job)
    args = exec_args(role, unit)
    assert args.grace_s == grace_s
    if role == "coordinator":
        slice_s = TransportConfig(**job.get("transport", {})).heartbeat_s
        bound = coordinator_main.worst_case_stop_s(args.grace_s, args.linger_s, slice_s)
    else:
        bound = (worker_main if role == "worker" else ps_main).worst_case_stop_s(args.grace_s)
    assert float(unit["TimeoutStopSec"]) >= bound + 15, (unit["TimeoutStopSec"], bound)

"""The command lines themselves: flags every service checks while parsing, and ``pstrain``'s own guard rails.

In-process and without a cluster: each test is about what happens before any process is started.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder

import pytest
import yaml

from pstrain.coordinator import main as coordinator_main
from pstrain.coordinator.config import parse_config
from pstrain.launcher import cli, local_cluster
from pstrain.launcher.local_cluster import LocalCluster, user_code_paths
from pstrain.ps_server import main as ps_main
from pstrain.worker import main as worker_main
from tests.helpers import write_job

MEMBER_FLAGS = ["--coordinator", "127.0.0.1:7070"]
PARSERS = {
    "pstrain local": lambda extra: cli.build_parser().parse_args(["local", "--config", "job.yaml", *extra]),
    "pstrain-coordinator": lambda extra: coordinator_main.parse_args(["--config", "job.yaml", *extra]),
    "pstrain-ps": lambda extra: ps_main.parse_args([*MEMBER_FLAGS, "--shard-id", "0", *extra]),
    "pstrain-worker": lambda extra: worker_main.parse_args([*MEMBER_FLAGS, *extra]),
}


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_a_bad_log_level_exits_2_while_parsing_and_any_case_is_taken(command, capsys):
    """Found only when logging is configured, a typo was a traceback and exit 1: a unit (Restart=on-failure)
    or ``pstrain local`` restarted the service for ever. Exit 2 is never restarted."""
    parse = PARSERS[command]
    with pytest.raises(SystemExit) as exit_:
        parse(["--log-level", "verbose"])
    assert exit_.value.code == 2
    assert "unknown log level 'verbose'; use one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in capsys.readouterr().err
    assert parse(["--log-level", "debug"]).log_level == "DEBUG"
    assert parse([]).log_level == "INFO"


# ------------------------------------------------------------------ where the job's factories import from


def test_the_users_modules_come_before_pstrains_folders(tmp_path, monkeypatch):
    """A user's ``runtime.py`` (or ``nn.py``, ``worker/``) in the working directory is the one the job file
    means, in the launcher and in its children alike: pstrain's source root comes after it."""
    (tmp_path / "runtime.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert user_code_paths() == [str(tmp_path), str(local_cluster.SOURCE_ROOT)]  # a checkout: its examples
    assert PathFinder.find_spec("runtime", user_code_paths()).origin == str(tmp_path / "runtime.py")
    cfg = parse_config(yaml.safe_load(write_job(tmp_path / "job.yaml").read_text()))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    children = LocalCluster(tmp_path / "job.yaml", cfg, tmp_path / "out")._env()["PYTHONPATH"].split(os.pathsep)
    assert children == [str(tmp_path), str(local_cluster.SOURCE_ROOT), "/elsewhere"]
    assert PathFinder.find_spec("runtime", children).origin == str(tmp_path / "runtime.py")


def test_an_installed_pstrain_adds_no_folder_of_its_own(tmp_path, monkeypatch):
    """Installed, the source root is ``site-packages/pstrain``: pstrain's subpackages by their bare names
    (``nn``, ``runtime``), nothing a job file needs."""
    installed = tmp_path / "site-packages" / "pstrain"
    installed.mkdir(parents=True)
    monkeypatch.setattr(local_cluster, "SOURCE_ROOT", installed)
    monkeypatch.chdir(tmp_path)
    assert user_code_paths() == [str(tmp_path)]


def test_the_launcher_puts_the_working_directory_first_even_when_it_is_on_the_path_already(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["/some/site-packages", str(tmp_path)])
    cli.import_user_code()
    assert sys.path == [*user_code_paths(), "/some/site-packages"]


# ------------------------------------------------------------------ refusals before anything starts


def test_an_out_that_is_a_file_exits_2_in_one_line(tmp_path, capsys):
    job = write_job(tmp_path / "job.yaml")
    (tmp_path / "out").write_text("not a directory")
    assert cli.main(["local", "--config", str(job), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"pstrain local: --out {tmp_path / 'out'}: a file is there; name a directory"


def test_an_out_below_a_file_exits_2_in_one_line(tmp_path, capsys):
    """``--out a_file/run`` could not be created: it was mkdir's traceback and exit 1."""
    job = write_job(tmp_path / "job.yaml")
    (tmp_path / "a_file").write_text("not a directory")
    out = tmp_path / "a_file" / "run"
    assert cli.main(["local", "--config", str(job), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"pstrain local: --out {out}: cannot create the directory: Not a directory"


def test_a_memory_max_json_in_a_missing_folder_exits_2_before_planning(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "load_config", lambda path: pytest.fail("refused before the job file is read"))
    missing = tmp_path / "missing" / "x.json"
    assert cli.main(["plan", "--config", "job.yaml", "--memory-max-json", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"pstrain plan: --memory-max-json: {missing.parent} is not a directory"


def test_ctrl_c_during_the_preflight_exits_130_without_a_traceback(tmp_path, capsys, monkeypatch):
    def interrupted(cfg: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "preflight", interrupted)
    job = write_job(tmp_path / "job.yaml")
    assert cli.main(["local", "--config", str(job), "--out", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.strip() == "pstrain local: interrupted"

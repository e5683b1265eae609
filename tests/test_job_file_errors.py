"""A careless job file fails before anything starts: exit 2, one line naming the key, the traceback in a log.

The schema refuses numbers out of range (``.inf``, ``.nan``, negative where positive is needed,
clusters too big); the preflight (``coordinator/preflight.py``) builds every factory the job file
names; ``pstrain local`` adds what only a one-host cluster can check (processes, devices).
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from pstrain.coordinator import main as coordinator_main
from pstrain.coordinator.config import MAX_DEVICES_PER_WORKER, MAX_PS_SHARDS, MAX_WORKERS, load_config, parse_config
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.preflight import preflight
from pstrain.launcher import cli
from tests.helpers import REPO_ROOT, child_env, odd_mlp, pids_with_marker, run_local, write_job

BASE = {
    "model": {"factory": "tests.helpers:odd_mlp"},
    "data": {"factory": "tests.helpers:classification_set"},
    "batch": {"per_device": 4},
}


def job(**sections: object) -> dict[str, object]:
    return {**BASE, **sections}


def refused(raw: dict[str, object]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        preflight(parse_config(raw))
    message = str(info.value)
    assert "\n" not in message, "one line"
    return info.value


# --------------------------------------------------------------------------- the preflight, case by case


def test_a_factory_that_raises_is_named_with_its_exception():
    error = refused(job(model={"factory": "tests.helpers:raising_model", "kwargs": {"message": "hidden is odd"}}))
    assert str(error) == "model.factory: tests.helpers:raising_model raised ValueError: hidden is odd"
    assert isinstance(error.__cause__.__cause__, ValueError), "the user's exception stays chained for the log"


def test_wrong_kwargs_name_the_kwargs_key_and_the_signature():
    error = refused(job(model={"factory": "tests.helpers:odd_mlp", "kwargs": {"width": 3}}))
    assert str(error) == (
        "model.kwargs: tests.helpers:odd_mlp(inputs, hidden, classes) cannot be called as (width=3): "
        "got an unexpected keyword argument 'width'"
    )
    error = refused(job(data={"factory": "tests.helpers:classification_set", "kwargs": {"size": 3}}))
    assert str(error).startswith("data.kwargs: tests.helpers:classification_set(n, inputs, classes, seed)")


def test_a_factory_that_is_not_there_is_named():
    assert str(refused(job(data={"factory": "tests.helpers:no_such_set"}))) == (
        "data.factory: module 'tests.helpers' has no attribute 'no_such_set'"
    )
    assert "No module named 'no_such_module'" in str(refused(job(model={"factory": "no_such_module:make"})))


def test_an_unreadable_init_checkpoint(tmp_path):
    missing = tmp_path / "missing.pt"
    assert str(refused(job(model={"factory": "tests.helpers:odd_mlp", "init_checkpoint": str(missing)}))) == (
        f"model.init_checkpoint: cannot load {missing}: No such file or directory"
    )
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    assert str(refused(job(model={"factory": "tests.helpers:odd_mlp", "init_checkpoint": str(garbage)}))) == (
        f"model.init_checkpoint: cannot load {garbage}: not a state_dict torch.load(weights_only=True) can read"
    )
    tensor = tmp_path / "tensor.pt"
    torch.save(torch.ones(3), tensor)
    message = str(refused(job(model={"factory": "tests.helpers:odd_mlp", "init_checkpoint": str(tensor)})))
    assert message.startswith(f"model.init_checkpoint: {tensor} does not fit the model: TypeError")
    other = tmp_path / "other.pt"
    torch.save(odd_mlp(hidden=3).state_dict(), other)
    message = str(refused(job(model={"factory": "tests.helpers:odd_mlp", "init_checkpoint": str(other)})))
    assert message.startswith(f"model.init_checkpoint: {other} does not fit the model: RuntimeError")


def test_a_model_without_parameters():
    assert str(refused(job(model={"factory": "tests.helpers:parameterless_model"}))) == (
        "model.factory: tests.helpers:parameterless_model built a model without parameters: there is nothing to train"
    )


def test_samples_that_are_not_pairs_of_tensors():
    assert str(refused(job(data={"factory": "tests.helpers:text_samples"}))) == (
        "data.factory: sample 0 of tests.helpers:text_samples is (str, int), not an (input, target) pair of tensors"
    )


def test_an_empty_dataset_is_called_empty():
    message = str(refused(job(data={"factory": "tests.helpers:empty_set"})))
    assert message == "data.factory: tests.helpers:empty_set returned an empty dataset (0 samples)"


def test_a_batch_larger_than_the_dataset():
    raw = job(data={"factory": "tests.helpers:classification_set", "kwargs": {"n": 3}})
    assert str(refused(raw)) == "batch.per_device: 4 exceeds the dataset's 3 samples"


def test_an_unknown_loss():
    with pytest.raises(ConfigError, match=r"^loss: unknown loss 'crossentropy': use one of cross_entropy, mse or"):
        parse_config(job(loss="crossentropy"))  # the schema, before any factory
    assert str(refused(job(loss="tests.helpers:no_such_loss"))) == (
        "loss: module 'tests.helpers' has no attribute 'no_such_loss'"
    )


def test_the_eval_factory_is_resolved_and_its_kwargs_checked_before_training():
    assert str(refused(job(eval={"factory": "tests.helpers:no_such_eval"}))) == (
        "eval.factory: module 'tests.helpers' has no attribute 'no_such_eval'"
    )
    message = str(refused(job(eval={"factory": "tests.helpers:mean_output", "kwargs": {"count": 2}})))
    assert message.startswith("eval.kwargs: tests.helpers:mean_output(model, n) cannot be called as (<model>, count=2)")
    preflight(parse_config(job(eval={"factory": "tests.helpers:mean_output", "kwargs": {"n": 2}})))


def test_an_eval_that_raises_after_training_is_named(tmp_path):
    cfg = parse_config(job(eval={"factory": "tests.helpers:raising_model"}))
    torch.save(odd_mlp().state_dict(), tmp_path / "model.pt")
    with pytest.raises(
        ConfigError, match=r"^eval\.factory: tests\.helpers:raising_model raised ValueError: Sequential\("
    ):
        cli.evaluate(cfg, tmp_path)  # raising_model(message=<the model>)
    cfg = parse_config(job(eval={"factory": "tests.helpers:mean_output"}))
    assert set(cli.evaluate(cfg, tmp_path) or {}) == {"mean_output"}


def test_the_coordinator_runs_the_same_preflight_and_logs_the_traceback(tmp_path, caplog):
    path = write_job(tmp_path / "job.yaml", model={"factory": "tests.helpers:raising_model"})
    args = coordinator_main.parse_args(["--config", str(path), "--bind", "127.0.0.1:0"])
    with caplog.at_level(logging.ERROR):
        assert coordinator_main.run(args) == 2
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "model.factory: tests.helpers:raising_model raised ValueError: hidden must be even" in record.getMessage()
    assert record.exc_info is not None, "the traceback goes to the coordinator's log"


# --------------------------------------------------------------------------- numbers: range and finiteness


@pytest.mark.parametrize(
    "raw, match",
    [
        (job(transport={"heartbeat_timeout_s": float("inf")}), r"^transport\.heartbeat_timeout_s: must be a finite"),
        (job(transport={"pull_timeout_s": 1e10}), r"^transport\.pull_timeout_s: must be at most 604800"),
        (job(transport={"push_timeout_s": 0}), r"^transport\.push_timeout_s: must be positive"),
        (job(optimizer={"momentum": 0.9, "dampening": -5}), r"^optimizer\.dampening: must be in \[0, 1\], got -5"),
        (job(optimizer={"momentum": 0.9, "dampening": 2}), r"^optimizer\.dampening: must be in \[0, 1\], got 2"),
        (job(optimizer={"lr": float("nan")}), r"^optimizer\.lr: must be a finite number, got nan"),
        (job(optimizer={"lr": float("inf")}), r"^optimizer\.lr: must be a finite number, got inf"),
        (
            job(optimizer={"name": "adam", "betas": [float("nan"), 0.9]}),
            r"^optimizer\.betas: must be a finite number, got \[nan, 0\.9\]",
        ),
        (job(optimizer={"name": "adam", "eps": float("inf")}), r"^optimizer\.eps: must be a finite number"),
        (job(optimizer={"weight_decay": -0.1}), r"^optimizer\.weight_decay: must be non-negative"),
        (job(memory={"margin": float("nan")}), r"^memory\.margin: must be a finite number"),
        (job(memory={"factor": float("inf")}), r"^memory\.factor: must be a finite number"),
        (job(memory={"device_memory": "0GiB"}), r"^memory\.device_memory: must be in \[1 B, 1 PiB\]"),
        (job(memory={"bandwidth": "1e999GB/s"}), r"^memory\.bandwidth: '1e999GB/s' is too large"),
        (job(memory={"prefetch": 10**6}), r"^memory\.prefetch: must be at most 1024"),
        (job(fault={"restart_backoff_s": float("inf")}), r"^fault\.restart_backoff_s: must be a finite number"),
        (job(fault={"max_restarts": 10**6}), r"^fault\.max_restarts: must be at most 1000"),
        (job(job={"seed": -1}), r"^job\.seed: must be at least 0, got -1"),
        (job(job={"steps": 10**12}), r"^job\.steps: must be at most 1000000000"),
        (job(batch={"per_device": 10**9}), r"^batch\.per_device: must be at most 1048576"),
        (job(batch={"warmup_steps": -1}), r"^batch\.warmup_steps: must be non-negative"),
        (job(checkpoint={"keep": 0}), r"^checkpoint\.keep: must be at least 1"),
    ],
)
def test_numbers_are_finite_and_in_range(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)


def test_yaml_inf_and_nan_are_refused_naming_the_key(tmp_path):
    for text, key in [
        ("transport: {heartbeat_timeout_s: .inf}", "transport.heartbeat_timeout_s"),
        ("optimizer: {lr: .nan}", "optimizer.lr"),
        ("memory: {target_utilization: -.inf}", "memory.target_utilization"),
    ]:
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(BASE) + text + "\n")
        with pytest.raises(ConfigError, match="^" + re.escape(f"{key}: must be a finite number")):
            load_config(path)


# --------------------------------------------------------------------------- bounds on the cluster


@pytest.mark.parametrize(
    "cluster, match",
    [
        ({"workers": MAX_WORKERS + 1}, rf"^cluster\.workers: must be at most {MAX_WORKERS}, got {MAX_WORKERS + 1}$"),
        ({"workers": 1000000}, r"^cluster\.workers: must be at most 1024, got 1000000$"),
        ({"ps_shards": MAX_PS_SHARDS + 1}, rf"^cluster\.ps_shards: must be at most {MAX_PS_SHARDS}"),
        ({"devices_per_worker": MAX_DEVICES_PER_WORKER + 1}, r"^cluster\.devices_per_worker: must be at most 64"),
        ({"devices_per_worker": ["cpu"] * 65}, r"^cluster\.devices_per_worker: lists 65 devices; at most 64$"),
        ({"devices_per_worker": ["cuda:x"]}, r"^cluster\.devices_per_worker: 'cuda:x' is not a device name; use cpu,"),
        ({"devices_per_worker": ["tpu:0"]}, r"^cluster\.devices_per_worker: 'tpu:0' is not a device name"),
        ({"devices_per_worker": ["cuda:0", "cuda: 1"]}, r"^cluster\.devices_per_worker: 'cuda: 1' is not a device"),
    ],
)
def test_cluster_bounds_and_device_names(cluster, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(job(cluster=cluster))


def test_the_largest_cluster_and_every_device_spelling_parse():
    cfg = parse_config(job(cluster={"workers": MAX_WORKERS, "ps_shards": MAX_PS_SHARDS, "devices_per_worker": 64}))
    assert cfg.cluster.workers == MAX_WORKERS and cfg.cluster.device_count == 64
    names = ["cpu", "cuda", "cuda:0", "cuda:12"]
    assert parse_config(job(cluster={"devices_per_worker": names})).cluster.device_list == names


def test_pstrain_local_refuses_more_processes_than_the_host_runs(monkeypatch):
    limit = cli.local_process_limit()
    assert limit >= 8 and limit % 4 == 0
    monkeypatch.setattr(cli, "local_process_limit", lambda: 8)
    cli.check_local_host(parse_config(job(cluster={"ps_shards": 3, "workers": 4})))  # 8 processes: fine
    with pytest.raises(ConfigError) as info:
        cli.check_local_host(parse_config(job(cluster={"ps_shards": 3, "workers": 5})))
    assert str(info.value).startswith(
        "cluster.workers, cluster.ps_shards: this job needs 1 coordinator + 3 PS shard(s) + 5 worker(s) = 9 "
        "processes, more than this host runs (8: 4 per CPU core, at least 8)"
    )


def test_pstrain_local_refuses_gpus_this_host_lacks():
    beyond = f"cuda:{torch.cuda.device_count()}"  # CUDA not available, or one past the last GPU
    with pytest.raises(ConfigError, match=rf"^cluster\.devices_per_worker: {beyond} requested but"):
        cli.check_local_host(parse_config(job(cluster={"devices_per_worker": [beyond]})))


# --------------------------------------------------------------------------- the real command


def assert_refused_before_starting(result, out: Path, marker: str, message: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    logs = out / "logs"
    if logs.exists():
        assert sorted(p.name for p in logs.iterdir()) == ["launcher.log"], "no process was started"
    assert not (out / "coordinator.port").exists()
    assert not pids_with_marker(marker)


def test_pstrain_local_a_raising_factory_exits_2_with_the_traceback_in_the_log(tmp_path):
    path = write_job(tmp_path / "job.yaml", model={"factory": "tests.helpers:raising_model"})
    marker, out = uuid.uuid4().hex, tmp_path / "out"
    result = run_local(path, out, marker, timeout_s=120)
    assert_refused_before_starting(
        result, out, marker, "model.factory: tests.helpers:raising_model raised ValueError: hidden must be even"
    )
    assert f"traceback in {out / 'logs' / 'launcher.log'}" in result.stderr
    log = (out / "logs" / "launcher.log").read_text()
    assert "Traceback (most recent call last)" in log and "ValueError: hidden must be even" in log
    assert "in raising_model" in log, "the user's frame is in the log"


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"data": {"factory": "tests.helpers:empty_set"}}, "data.factory: tests.helpers:empty_set returned an empty"),
        ({"loss": "tests.helpers:no_such_loss"}, "loss: module 'tests.helpers' has no attribute 'no_such_loss'"),
        (
            {"cluster": {"ps_shards": 1, "workers": 1, "devices_per_worker": ["cuda:99"]}},
            "cluster.devices_per_worker: cuda:99 requested but",
        ),
        ({"cluster": {"ps_shards": 1, "workers": 1000}}, "cluster.workers, cluster.ps_shards: this job needs"),
        ({"cluster": {"ps_shards": 1, "workers": 1000000}}, "cluster.workers: must be at most 1024, got 1000000"),
        ({"transport": {"heartbeat_timeout_s": float("inf")}}, "transport.heartbeat_timeout_s: must be a finite"),
    ],
)
def test_pstrain_local_refuses_before_starting_anything(tmp_path, sections, message):
    path = write_job(tmp_path / "job.yaml", **sections)
    marker, out = uuid.uuid4().hex, tmp_path / "out"
    assert_refused_before_starting(run_local(path, out, marker, timeout_s=120), out, marker, message)


def test_eval_factory_imports_from_the_current_directory_like_the_others(tmp_path):
    """The ``pstrain`` console script does not put the current directory on sys.path; the children get
    it on PYTHONPATH, and the launcher, where eval runs, must see it too."""
    (tmp_path / "localeval.py").write_text("def score(model):\n    return {'one': 1.0}\n")
    path = write_job(tmp_path / "job.yaml", eval={"factory": "localeval:score"})
    pstrain = Path(sys.executable).parent / "pstrain"
    cmd = [str(pstrain), "plan", "--config", str(path), "--device-memory", "1GiB", "--bandwidth", "10GB/s"]
    env = {**child_env("plan"), "PYTHONPATH": str(REPO_ROOT)}  # no empty entry: that would mean the cwd
    ok = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    write_job(path, eval={"factory": "localeval:no_such_eval"})
    bad = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "eval.factory: module 'localeval' has no attribute 'no_such_eval'" in bad.stderr


# --------------------------------------------------------------------------- the file itself

FACTORIES = "model: {factory: 'tests.helpers:odd_mlp'}\ndata: {factory: 'tests.helpers:classification_set'}\n"


@pytest.mark.parametrize(
    "text, match",
    [
        ("", r"job\.yaml is empty: a job file needs at least model\.factory and data\.factory$"),
        ("# all commented out\n", r"job\.yaml is empty: a job file needs at least model\.factory"),
        (FACTORIES + "optimizer: {lr: 0.5}\noptimizer: {momentum: 0.9}\n", r"found 'optimizer' twice\s+in \S+, line 4"),
        (FACTORIES + "job: {steps: 5, steps: 7}\n", r"found 'steps' twice\s+in \S+job\.yaml\S*, line 3, column 17$"),
        (FACTORIES + "embeddings: {u: {rows: 2, dim: 1, dim: 3}}\n", r"found 'dim' twice"),
        (FACTORIES + "job: {seed: " + "7" * 5000 + "}\n", r"is not valid YAML: Exceeds the limit \(4300 digits\)"),
        (FACTORIES + "job: {name: 2024-13-45}\n", r"is not valid YAML: month must be in 1\.\.12"),
        (FACTORIES + "optimizer: {lr: " + "9" * 400 + "}\n", r"^optimizer\.lr: must be a finite number, got an int"),
        (FACTORIES + "transport: {pull_timeout_s: " + "9" * 400 + "}\n", r"^transport\.pull_timeout_s: must be a fin"),
        (FACTORIES + "optimizer: {1: 2, lrr: 3}\n", r"^optimizer\.1: unknown key; known keys here are betas,"),
        (FACTORIES + "1: 1\nsteps: 2\n", r"^1: unknown key; known keys here are batch,"),
        (FACTORIES + "embeddings: {user: }\n", r"^embeddings\.user: must be a mapping, got NoneType$"),
        (FACTORIES + "eval: {kwargs: {x: " + "[" * 5000 + "]" * 5000 + "}}\n", r"collections nested too deeply"),
    ],
)
def test_a_job_file_that_does_not_parse_is_named_without_a_traceback(tmp_path, text, match):
    """Each of these was a traceback (a huge int, keys of mixed types, a bad date), a silent choice (a key given
    twice: YAML keeps the last one) or a confusing line ("got NoneType" for an empty file, "embeddings.user.user")."""
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_config(path)
    assert info.value.__cause__ is None, "no user code raised: nothing to log a traceback of"


def test_a_job_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(FACTORIES.encode() + b"job: {name: '\xff\xfe'}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))} is not valid YAML: .*invalid start byte"):
        load_config(path)


def test_yaml_merge_keys_may_still_override_what_they_merge(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(FACTORIES + "embeddings: {a: &t {rows: 4, dim: 2, lr: 0.5}, b: {<<: *t, dim: 3}}\n")
    tables = load_config(path).embeddings
    assert (tables["a"].dim, tables["b"].dim, tables["b"].lr, tables["b"].rows) == (2, 3, 0.5, 4)


def test_a_merged_mapping_that_overrides_its_own_merge_is_no_repeat_wherever_it_is_merged_again(tmp_path):
    """PyYAML flattens a merged node in place: ``b``, merged into ``data.kwargs`` first, was flattened (``width``
    from ``a`` next to its own) before it was built, and the check took that for ``width`` given twice."""
    path = tmp_path / "job.yaml"
    path.write_text(
        "model: {factory: m:f, kwargs: {enc: {base: &a {width: 10, depth: 4}, big: &b {<<: *a, width: 20}}}}\n"
        "data: {factory: d:f, kwargs: {<<: *b, seed: 1}}\n"
    )
    cfg = load_config(path)
    assert cfg.model.kwargs["enc"]["big"] == {"width": 20, "depth": 4}
    assert cfg.data.kwargs == {"width": 20, "depth": 4, "seed": 1}


@pytest.mark.parametrize(
    "text, message",
    [
        ("model: {factory: [unclosed\n", "is not valid YAML: while parsing a flow sequence"),
        (None, "cannot read job file"),
    ],
)
def test_the_coordinator_reports_an_unreadable_job_file_on_one_line(tmp_path, text, message):
    """Not user code: the coordinator's stderr (its journal under systemd) had a 60-line traceback of PyYAML."""
    path = tmp_path / "job.yaml"
    if text is not None:
        path.write_text(text)
    cmd = [sys.executable, "-m", "pstrain.coordinator", "--config", str(path), "--bind", "127.0.0.1:0"]
    result = subprocess.run(cmd, env=child_env("cfg"), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert " ERROR " in line and message in line and str(path) in line, result.stderr[-3000:]


def test_pstrain_local_refuses_a_key_given_twice_on_one_line(tmp_path):
    path = write_job(tmp_path / "job.yaml")
    path.write_text(path.read_text() + "job: {steps: 1}\n")  # a second job section: it used to replace the first
    marker, out = uuid.uuid4().hex, tmp_path / "out"
    result = run_local(path, out, marker, timeout_s=120)
    assert_refused_before_starting(result, out, marker, "found 'job' twice")
    assert "traceback in" not in result.stderr

import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from pstrain.coordinator.config import JobConfig, MemoryConfig, OptimizerConfig, load_config, parse_config
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.plan import make_plan
from pstrain.planner.memory_estimate import EstimateMode
from pstrain.runtime.optimizers import OPTIMIZERS, optimizer_entry

REPO = Path(__file__).resolve().parent.parent
MINIMAL = {"model": {"factory": "m:f"}, "data": {"factory": "d:f"}}


def with_(section, **values):
    raw = {k: dict(v) for k, v in MINIMAL.items()}
    raw.setdefault(section, {}).update(values)
    return raw


def test_example_job_file_loads_with_documented_values():
    cfg = load_config(REPO / "examples" / "digits.yaml")
    assert isinstance(cfg, JobConfig)
    assert cfg.cluster.workers == 2 and cfg.cluster.device_list == ["cpu", "cpu"] and cfg.data.shard_size == 256
    assert cfg.optimizer.name == "sgd" and cfg.optimizer.momentum == 0.9


def test_defaults_fill_missing_sections():
    cfg = parse_config(MINIMAL)
    assert cfg.loss == "cross_entropy" and cfg.optimizer.lr == 0.1 and cfg.batch.per_device == 64
    assert cfg.job.steps == 200 and cfg.cluster.ps_shards == 2 and cfg.transport.chunk_bytes == 512 * 1024


def test_device_list():
    cfg = parse_config(with_("cluster", devices_per_worker=["cuda:0", "cuda:1", "cuda:3"]))
    assert cfg.cluster.device_count == 3 and cfg.cluster.device_list == ["cuda:0", "cuda:1", "cuda:3"]


def test_whole_layer_offload_refuses_a_gpu_listed_twice():
    """Seen on a one-GPU host: two offloaded replicas on cuda:0 waited on each other's gradient turn for good."""
    twice = {**with_("cluster", devices_per_worker=["cuda", "cuda:0"]), "memory": {"offload_params": True}}
    with pytest.raises(ConfigError, match=r"cluster\.devices_per_worker: lists cuda:0 more than once"):
        parse_config(twice)
    assert parse_config({**twice, "memory": {}}).cluster.device_count == 2  # replicas without offload share a GPU
    apart = {**with_("cluster", devices_per_worker=["cuda:0", "cuda:1"]), "memory": {"offload_params": True}}
    assert parse_config(apart).memory.offload_params
    stand_ins = {**with_("cluster", devices_per_worker=["cpu", "cpu"]), "memory": {"offload_params": True}}
    assert parse_config(stand_ins).cluster.device_count == 2  # CPU stand-ins backward in their own threads


@pytest.mark.parametrize(
    "raw, match",
    [
        (with_("optimizer", lr=-1), r"optimizer\.lr: must be positive"),
        (with_("optimizer", name="rmsprop"), r"optimizer\.name: 'rmsprop' is not one of sgd, adam, adamw"),
        (with_("optimizer", lrr=0.1), r"optimizer\.lrr: unknown key; known keys here are"),
        (with_("optimizer", lr="fast"), r"optimizer\.lr: expected float, got 'fast'"),
        (with_("optimizer", nesterov=True), r"optimizer\.nesterov: needs momentum > 0"),
        (with_("optimizer", betas=[0.9]), r"optimizer\.betas"),
        (with_("batch", per_device=0), r"batch\.per_device: must be at least 1"),
        (with_("batch", per_device=True), r"batch\.per_device: expected int \| str, got True"),
        (with_("batch", per_device="max"), r"batch\.per_device: must be a number or .auto."),
        (with_("memory", policy="offload"), r"memory\.policy"),
        (with_("memory", device_memory="lots"), r"memory\.device_memory: cannot read"),
        (with_("memory", blocks=["enc", "enc"]), r"^memory\.blocks: 'enc' given more than once"),
        (with_("memory", blocks=["enc", "enc.1", "head"]), r"^memory\.blocks: 'enc\.1' is inside 'enc'"),
        (with_("memory", blocks=[""]), r"^memory\.blocks: '' names the whole model"),
        (
            with_("memory", estimate="iterative", increment="0"),
            r"^memory\.increment: must be positive with memory\.estimate: iterative",
        ),
        (with_("batch", lr_scaling="cubic"), r"batch\.lr_scaling: 'cubic' is not one of"),
        (with_("cluster", devices_per_worker=[]), r"cluster\.devices_per_worker: the device list is empty"),
        (with_("cluster", ps_shards=0), r"cluster\.ps_shards: must be at least 1"),
        (with_("job", steps=0), r"job\.steps: must be at least 1"),
        (with_("data", shard_size=0), r"data\.shard_size"),
        (with_("transport", heartbeat_s=10, heartbeat_timeout_s=5), r"transport\.heartbeat_timeout_s"),
        (with_("transport", heartbeat_s=1e-300), r"transport\.heartbeat_s: must be at least 0.05 s"),
        (with_("transport", chunk_bytes=10), r"transport\.chunk_bytes"),
        ({"data": {"factory": "d:f"}}, r"model: required key is missing"),
        ({**MINIMAL, "modle": {}}, r"modle: unknown key"),
        ({"model": {"factory": "no_colon"}, "data": {"factory": "d:f"}}, r"model\.factory: 'no_colon' must look like"),
        ({**MINIMAL, "optimizer": [1, 2]}, r"optimizer: must be a mapping"),
        ([1, 2], r"the job file: must be a mapping"),
    ],
)
def test_bad_config_names_the_key(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)


def test_blocks_that_only_share_a_prefix_and_a_zero_increment_outside_iterative_are_accepted():
    blocks = ["enc", "encoder", "enc_head"]
    assert parse_config(with_("memory", blocks=blocks)).memory.blocks == blocks
    assert parse_config(with_("memory", estimate="increment", increment="0")).memory.increment == "0"


def test_malformed_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {factory: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read job file"):
        load_config(tmp_path / "missing.yaml")


def test_steps_override():
    assert parse_config(MINIMAL).with_steps(7).job.steps == 7


@pytest.mark.parametrize("scaling, factor", [("linear", 8.0), ("sqrt", math.sqrt(8)), ("none", 1.0)])
def test_plan_global_batch_and_lr_scaling(scaling, factor):
    raw = with_("batch", per_device=32, lr_scaling=scaling)
    raw["cluster"] = {"workers": 4, "devices_per_worker": 2}
    raw["optimizer"] = {"lr": 0.05}
    plan = make_plan(parse_config(yaml.safe_load(yaml.safe_dump(raw))))
    assert plan.total_devices == 8 and plan.global_batch == 256
    assert plan.scaled_lr == pytest.approx(0.05 * factor)
    assert plan.lr_at(0) == plan.lr_at(1000) == pytest.approx(0.05 * factor)


def test_plan_warmup_is_linear():
    raw = with_("batch", per_device=8, warmup_steps=4)
    raw["cluster"] = {"workers": 1, "devices_per_worker": 2}
    raw["optimizer"] = {"lr": 0.1}
    plan = make_plan(parse_config(raw))
    assert [round(plan.lr_at(s), 6) for s in range(6)] == [0.05, 0.1, 0.15, 0.2, 0.2, 0.2]
    assert "warmup 4 steps" in plan.describe() and "global 16" in plan.describe()


@pytest.mark.parametrize(
    "raw, match",
    [
        (with_("optimizer", name="lbfgs"), r"^optimizer\.name: 'lbfgs' is not one of sgd, adam, adamw, lars, lamb$"),
        (with_("optimizer", name=3), r"^optimizer\.name: 3 is not one of sgd, adam, adamw, lars, lamb$"),
        (with_("batch", lr_scaling="cubic"), r"^batch\.lr_scaling: 'cubic' is not one of linear, sqrt, none, auto$"),
        (with_("memory", policy="offload"), r"^memory\.policy: 'offload' is not one of auto, keep, swap$"),
        (with_("memory", estimate="guess"), r"^memory\.estimate: 'guess' is not one of factor, increment, iterative$"),
        (with_("memory", policy=True), r"^memory\.policy: True is not one of auto, keep, swap$"),
    ],
)
def test_choice_fields_list_the_allowed_values(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)


def test_choice_fields_are_checked_when_built_in_code_too():
    with pytest.raises(ConfigError, match=r"^optimizer\.name: 'lbfgs' is not one of sgd, adam, adamw, lars, lamb$"):
        OptimizerConfig(name="lbfgs")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^memory\.estimate: 'guess' is not one of"):
        MemoryConfig(estimate="guess")  # type: ignore[arg-type]


def test_choice_values_match_what_the_planner_and_registry_take():
    hints = typing.get_type_hints(MemoryConfig)
    assert set(typing.get_args(hints["estimate"])) == {m.value for m in EstimateMode}
    assert typing.get_args(typing.get_type_hints(OptimizerConfig)["name"]) == OPTIMIZERS


@pytest.mark.parametrize(
    "section, match",
    [
        ({"name": "adam", "momentum": 0.9}, r"optimizer\.momentum: adam does not use it; remove it \(it takes betas,"),
        ({"name": "adamw", "nesterov": True}, r"optimizer\.nesterov: adamw does not use it"),
        ({"name": "sgd", "eps": 1e-6}, r"optimizer\.eps: sgd does not use it; remove it \(it takes momentum,"),
        (
            {"name": "adam", "betas": [0.9, 1.5]},
            r"optimizer\.betas: must be two numbers in \[0, 1\), got \[0\.9, 1\.5\]",
        ),
        ({"name": "adam", "eps": 0}, r"optimizer\.eps: must be positive, got 0"),
        ({"name": "sgd", "momentum": -0.5}, r"optimizer\.momentum: must be non-negative, got -0\.5"),
    ],
)
def test_optimizer_options_follow_the_registry(section, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(with_("optimizer", **section))


def test_options_an_optimizer_takes_pass_through():
    cfg = parse_config(with_("optimizer", name="adamw", betas=[0.8, 0.99], eps=1e-6, weight_decay=0.1))
    assert cfg.optimizer.options() == {"betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}
    sgd = parse_config(with_("optimizer", momentum=0.9, nesterov=True, betas=[0.9, 0.999]))  # the default is no change
    assert sgd.optimizer.options() == {"momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 0.0}


def test_per_device_still_takes_a_number_or_auto():
    assert parse_config(with_("batch", per_device="auto")).batch.per_device == "auto"
    assert parse_config(with_("batch", per_device=12)).batch.per_device == 12


@pytest.mark.parametrize("name, scaling", [("sgd", "linear"), ("adam", "sqrt"), ("adamw", "sqrt")])
def test_auto_lr_scaling_comes_from_the_registry(name, scaling):
    raw = with_("batch", per_device=8, lr_scaling="auto")
    raw["optimizer"] = {"name": name}
    assert (
        make_plan(parse_config(raw)).lr_scaling == scaling == ("sqrt" if optimizer_entry(name).adaptive else "linear")
    )


def test_the_job_file_schema_does_not_import_the_planner():
    code = "import sys, pstrain.coordinator.config; print(any(m.startswith('pstrain.planner') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_exponent_notation_reads_as_a_number_where_a_float_is_expected(tmp_path):
    """PyYAML (YAML 1.1) reads ``1e-3`` as a string, so ``lr: 1e-3`` was refused ("expected float, got '1e-3'")
    though the reference writes ``eps`` as ``1e-8``; strings elsewhere stay strings."""
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(with_("job", name="1e3"))
        + "optimizer: {name: adam, lr: 1e-3, eps: 1.0E-6, betas: [0.9, 9.99e-1], weight_decay: 5e-4}\n"
        + "embeddings: {user: {rows: 8, dim: 2, lr: 5e-2, init_scale: .5e-1}}\n"
        + "transport: {heartbeat_s: 2e0, heartbeat_timeout_s: 1e1}\n"
    )
    cfg = load_config(path)
    assert (cfg.optimizer.lr, cfg.optimizer.eps, cfg.optimizer.betas, cfg.optimizer.weight_decay) == (
        1e-3,
        1e-6,
        [0.9, 0.999],
        5e-4,
    )
    assert (cfg.embeddings["user"].lr, cfg.embeddings["user"].init_scale) == (0.05, 0.05)
    assert (cfg.transport.heartbeat_s, cfg.transport.heartbeat_timeout_s) == (2.0, 10.0)
    assert cfg.job.name == "1e3"
    path.write_text(yaml.safe_dump(MINIMAL) + "optimizer: {lr: 1e999}\n")
    with pytest.raises(ConfigError, match=r"^optimizer\.lr: must be a finite number, got inf$"):
        load_config(path)


def test_a_bare_off_or_on_for_shared_memory_reads_as_the_choice(tmp_path):
    """YAML reads a bare ``off`` as false: ``shared_memory: off``, as the reference writes it, was refused."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(MINIMAL) + "transport: {shared_memory: off, bulk_sockets: off}\n")
    assert (load_config(path).transport.shared_memory, load_config(path).transport.bulk_sockets) == ("off", "off")
    path.write_text(yaml.safe_dump(MINIMAL) + "transport: {shared_memory: on}\n")
    assert load_config(path).transport.shared_memory == "auto"
    path.write_text(yaml.safe_dump(MINIMAL) + "transport: {shared_memory: sometimes}\n")
    with pytest.raises(ConfigError, match=r"^transport\.shared_memory: must be one of auto, off$"):
        load_config(path)


def test_a_size_may_be_a_plain_number_of_bytes(tmp_path):
    """``increment: 0`` or ``device_memory: 85899345920`` read as numbers in YAML: they were refused as
    "expected str" though "0" and "1e9" were taken."""
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(MINIMAL)
        + "memory: {device_memory: 85899345920, host_memory: 1.5e+9, increment: 0, estimate: increment}\n"
    )
    memory = load_config(path).memory
    assert (memory.device_memory, memory.host_memory, memory.increment) == ("85899345920", "1500000000.0", "0")
    for text, match in [
        ("{increment: 0, estimate: iterative}", r"^memory\.increment: must be positive with memory\.estimate"),
        ("{device_memory: 0}", r"^memory\.device_memory: must be in \[1 B, 1 PiB\], got '0'$"),
        ("{pinned_limit: -1}", r"^memory\.pinned_limit: cannot read '-1' as a size"),
        ("{bandwidth: .inf}", r"^memory\.bandwidth: must be a finite number"),
        ("{device_memory: true}", r"^memory\.device_memory: expected str \| float \| None, got True$"),
    ]:
        path.write_text(yaml.safe_dump(MINIMAL) + f"memory: {text}\n")
        with pytest.raises(ConfigError, match=match):
            load_config(path)


def test_a_cap_on_the_auto_batch_beside_a_fixed_batch_is_refused():
    """``max_per_device`` bounds only what the plan picks for ``per_device: auto``: next to a number (smaller than
    it, say) it would be ignored without a word, and the job would train at the larger batch."""
    with pytest.raises(ConfigError, match="batch.max_per_device: bounds per_device: auto only; per_device is 512"):
        parse_config(with_("batch", per_device=512, max_per_device=256))
    assert parse_config(with_("batch", per_device="auto", max_per_device=256)).batch.max_per_device == 256

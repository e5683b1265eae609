"""The job file, parsed once into frozen dataclasses.

Every key is checked: unknown keys, wrong types and impossible values raise ConfigError
naming the key (``optimizer.lr``) and what would fix it. Nothing downstream sees YAML. Choice
fields are ``Literal`` types: the schema lists the allowed values when a job file gives another.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pstrain.coordinator.errors import ConfigError
from pstrain.runtime.buckets import DEFAULT_BUCKET_BYTES
from pstrain.runtime.factories import BUILTIN_LOSSES
from pstrain.runtime.optimizers import BadOption, OptimizerName, optimizer_entry
from pstrain.runtime.sparse_rows import Averaging, TableInit, TableOptimizer, TableSpec
from pstrain.runtime.units import parse_bytes

LrScaling = Literal["linear", "sqrt", "none", "auto"]
MemoryPolicy = Literal["auto", "keep", "swap"]
EstimateName = Literal["factor", "increment", "iterative"]
NonFinitePolicy = Literal["stop", "skip"]

MAX_WORKERS = 1024
"""``cluster.workers`` at most: one coordinator tracks every worker's heartbeats and data shards."""
MAX_PS_SHARDS = 1024
"""``cluster.ps_shards`` at most: every worker holds a channel and a push/pull stream to each."""
MAX_DEVICES_PER_WORKER = 64
"""``cluster.devices_per_worker`` at most: more devices than any one host has."""
MAX_BATCH = 2**20
"""``batch.per_device`` (and the memory planner's batch sizes) at most."""
MAX_STEPS = 10**9
"""Steps, warmup steps, checkpoint interval and data-shard size at most."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Every ``*_s`` duration at most: a week (a thread's wait overflows past ~1e9 s)."""
MAX_BYTES = 2**50
"""Memory sizes and bandwidths at most (1 PiB, 1 PiB/s)."""
MAX_WAITING_PULLS = 1 << 20
"""``transport.max_waiting_pulls`` (and ``_per_peer``) at most: each waiting pull holds a little shard memory."""
DEVICE_NAME = re.compile(r"cpu|cuda(:[0-9]+)?")
"""What ``cluster.devices_per_worker`` may list: ``cpu``, ``cuda``, ``cuda:N``."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _bounded(value: float, key: str, low: float, high: float) -> None:
    _require(value >= low, key, f"must be at least {low}, got {value}")
    _require(value <= high, key, f"must be at most {high}, got {value}")


def _check_finite(section: Any, prefix: str) -> None:
    """Every number of a section, lists included, is finite: ``.inf`` and ``.nan`` parse as floats in YAML."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"{prefix}.{f.name}: must be a finite number, got {value}")


def _choice_error(key: str, value: Any, hint: Any) -> ConfigError:
    return ConfigError(f"{key}: {value!r} is not one of {', '.join(str(c) for c in typing.get_args(hint))}")


def _is_choice(value: Any, hint: Any) -> bool:
    return any(value == c and type(value) is type(c) for c in typing.get_args(hint))


def _check_choices(section: Any, prefix: str) -> None:
    """The ``Literal`` fields of a section built in code rather than parsed (parsing checks them first)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        hint, value = hints[f.name], getattr(section, f.name)
        if typing.get_origin(hint) is Literal and not _is_choice(value, hint):
            raise _choice_error(f"{prefix}.{f.name}", value, hint)


@dataclass(frozen=True)
class ModelConfig:
    factory: str
    """``pkg.module:callable`` returning a torch.nn.Module."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    init_checkpoint: str | None = None
    """Path of a state_dict to start from instead of the factory's seeded initialisation."""

    def __post_init__(self) -> None:
        _require(":" in self.factory, "model.factory", f"{self.factory!r} must look like 'pkg.module:callable'")


@dataclass(frozen=True)
class DataConfig:
    factory: str
    """``pkg.module:callable`` returning a map-style Dataset of (input, target)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    shard_size: int = 512
    """Samples per data shard handed to a worker."""
    shuffle: bool = True
    """Shuffle the sample order every epoch (seeded by job.seed and the epoch)."""
    prefetch: bool = True
    """Read and collate the next step's batch in a background thread while this step computes."""

    def __post_init__(self) -> None:
        _require(":" in self.factory, "data.factory", f"{self.factory!r} must look like 'pkg.module:callable'")
        _bounded(self.shard_size, "data.shard_size", 1, MAX_STEPS)


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer every PS shard runs; which options apply and their rules come from its registry entry."""

    name: OptimizerName = "sgd"
    lr: float = 0.1
    """Single-device learning rate; the plan scales it (batch.lr_scaling)."""
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    trust_coefficient: float = 0.001
    """lars: eta in the trust ratio eta ||w|| / (||g|| + weight_decay ||w||) (You et al. 2017)."""
    exclude_1d: bool = True
    """lars, lamb: 1-D tensors (biases, normalisation scales) take a plain momentum-SGD / Adam step, with no
    trust ratio and no weight decay, as LAMB's reference implementation and the LARS follow-ups do."""

    def __post_init__(self) -> None:
        _check_finite(self, "optimizer")
        _check_choices(self, "optimizer")
        _require(self.lr > 0, "optimizer.lr", f"must be positive, got {self.lr}")
        entry = optimizer_entry(self.name)
        for f in dataclasses.fields(self):
            if f.name in ("name", "lr") or f.name in entry.options:
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            _require(
                getattr(self, f.name) == default,
                f"optimizer.{f.name}",
                f"{self.name} does not use it; remove it (it takes {', '.join(entry.options)})",
            )
        try:
            entry.validate(self.options())
        except BadOption as exc:
            raise ConfigError(f"optimizer.{exc.option}: {exc.message}") from None
        # torch takes any dampening; outside [0, 1] it scales the gradient by a negative or >1 factor.
        _require(0 <= self.dampening <= 1, "optimizer.dampening", f"must be in [0, 1], got {self.dampening}")

    def options(self) -> dict[str, Any]:
        """The options this optimizer takes, by job-file key: what its registry entry validates and builds with."""
        return {key: getattr(self, key) for key in optimizer_entry(self.name).options}


@dataclass(frozen=True)
class BatchConfig:
    per_device: int | str = 64
    """Samples per device per step, or "auto": the largest the memory plan allows (S1.5)."""
    max_per_device: int | None = None
    """Upper bound for "auto" (the largest batch that fits is not always the best one)."""
    lr_scaling: LrScaling = "linear"
    """linear: lr x devices (S1.6); sqrt: lr x sqrt(devices); none; auto: sqrt for Adam-type, else linear."""
    warmup_steps: int = 0
    """Linear warmup of the scaled learning rate over this many steps."""
    linear_lr_max_global: int = 8192
    """Global batch past which linear LR scaling is not trusted (Goyal et al.: 8k for ResNet-50 with
    warmup); above it the plan warns and proposes a layer-wise optimizer (lars, lamb)."""

    def __post_init__(self) -> None:
        if isinstance(self.per_device, str):
            _require(
                self.per_device == "auto", "batch.per_device", f"must be a number or 'auto', got {self.per_device!r}"
            )
        else:
            _bounded(self.per_device, "batch.per_device", 1, MAX_BATCH)
        if self.max_per_device is not None:
            _bounded(self.max_per_device, "batch.max_per_device", 1, MAX_BATCH)
            _require(  # it bounds only what the plan picks: beside a number it would be ignored without a word
                self.per_device == "auto",
                "batch.max_per_device",
                f"bounds per_device: auto only; per_device is {self.per_device}: remove one of them",
            )
        _check_choices(self, "batch")
        _require(self.warmup_steps >= 0, "batch.warmup_steps", f"must be non-negative, got {self.warmup_steps}")
        _require(self.warmup_steps <= MAX_STEPS, "batch.warmup_steps", f"must be at most {MAX_STEPS}")
        _bounded(self.linear_lr_max_global, "batch.linear_lr_max_global", 1, MAX_BATCH * MAX_WORKERS)


@dataclass(frozen=True)
class JobSection:
    steps: int = 200
    seed: int = 0
    name: str = "pstrain"

    def __post_init__(self) -> None:
        _bounded(self.steps, "job.steps", 1, MAX_STEPS)
        _bounded(self.seed, "job.seed", 0, 2**63 - 1)


@dataclass(frozen=True)
class ClusterConfig:
    ps_shards: int = 2
    workers: int = 2
    devices_per_worker: int | list[str] = 1
    """A count (GPUs 0..N-1, or CPU stand-ins without CUDA) or an explicit list like [cuda:0, cuda:1]."""
    min_workers: int | None = None
    """Issue 11: a failed worker not replaced within ``fault.replace_timeout_s`` is dropped (the job goes on with
    fewer workers, the global batch and the LR scaled down, S1.6) while at least this many remain; otherwise
    the job rolls back. Default (None): ``workers``, i.e. never shrink."""

    def __post_init__(self) -> None:
        _bounded(self.ps_shards, "cluster.ps_shards", 1, MAX_PS_SHARDS)
        _bounded(self.workers, "cluster.workers", 1, MAX_WORKERS)
        if self.min_workers is not None:
            _bounded(self.min_workers, "cluster.min_workers", 1, self.workers)
        key = "cluster.devices_per_worker"
        if isinstance(self.devices_per_worker, list):
            _require(len(self.devices_per_worker) >= 1, key, "the device list is empty")
            _require(
                len(self.devices_per_worker) <= MAX_DEVICES_PER_WORKER,
                key,
                f"lists {len(self.devices_per_worker)} devices; at most {MAX_DEVICES_PER_WORKER}",
            )
            for name in self.devices_per_worker:
                _require(
                    isinstance(name, str) and DEVICE_NAME.fullmatch(name) is not None,
                    key,
                    f"{name!r} is not a device name; use cpu, cuda or cuda:N",
                )
        else:
            _bounded(self.devices_per_worker, key, 1, MAX_DEVICES_PER_WORKER)

    @property
    def least_workers(self) -> int:
        """The fewest workers the job goes on with (``min_workers``, default ``workers``)."""
        return self.workers if self.min_workers is None else self.min_workers

    @property
    def device_count(self) -> int:
        d = self.devices_per_worker
        return len(d) if isinstance(d, list) else d

    @property
    def device_list(self) -> list[str]:
        d = self.devices_per_worker
        return list(d) if isinstance(d, list) else []


PUSH_DTYPES = ("float32", "bfloat16")
SHARED_MEMORY = ("auto", "off")
BULK_SOCKETS = ("auto", "off")


MIN_HEARTBEAT_S = 0.05


@dataclass(frozen=True)
class TransportConfig:
    chunk_bytes: int = 512 * 1024
    """Bytes per streamed tensor chunk (bench/pushpull.py measured this default)."""
    push_timeout_s: float = 120.0
    pull_timeout_s: float = 600.0
    """A pull waits for the slowest worker of the step, so this bounds a step's duration."""
    heartbeat_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    """A member silent this long is declared failed."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """S4: gradients are pushed in buckets of about this many bytes (whole parameters, backward order) while
    backward runs, and pulled back per bucket before the next forward needs them. 0: one bucket (push after
    backward; a step with a non-finite gradient is then never partly applied)."""
    push_dtype: str = "float32"
    """Issue 12: the dtype gradients are pushed in. ``bfloat16`` halves the push bytes; the shards keep float32
    parameters and optimizer state and sum the pushes in float32 (each worker's sum is rounded once)."""
    shared_memory: str | bool = "auto"
    """Issue 12: ``auto`` moves tensors between a worker and the PS shards on its own host through shared memory
    (/dev/shm; gRPC carries headers only) and streams to the rest; ``off`` always streams. YAML reads a bare ``off``
    as false, which is taken as ``off`` (and true as ``auto``), as for ``bulk_sockets``."""
    bulk_sockets: str | bool = "auto"
    """Issue 12: ``auto`` moves the tensors of a worker and a remote PS shard on a raw TCP socket to the shard's bulk
    port (``pstrain-ps --bulk-port``; gRPC carries headers, checks and errors), except over TLS, and streams them
    inside gRPC where that port is off or cannot be reached; ``off`` always streams inside gRPC. YAML reads a bare
    ``off`` as false, which is taken as ``off`` (and true as ``auto``)."""
    max_waiting_pulls: int = 4096
    """Issue 8: pulls waiting at once for a version a PS shard has not published yet, from all peers together; past
    it a pull is refused at once (RESOURCE_EXHAUSTED, naming this key). Each worker keeps one waiting per bucket
    piece, so this needs at least ``cluster.workers``; it bounds what a pull flood can hold on a shard."""
    max_waiting_pulls_per_peer: int = 256
    """Issue 8: the same limit per peer (a member's credential, else its connection), so one peer's flood is refused
    while the other workers' pulls are still held. At least the bucket pieces a worker pulls from one shard at once."""

    def __post_init__(self) -> None:
        _check_finite(self, "transport")
        _bounded(self.max_waiting_pulls, "transport.max_waiting_pulls", 1, MAX_WAITING_PULLS)
        _require(
            1 <= self.max_waiting_pulls_per_peer <= self.max_waiting_pulls,
            "transport.max_waiting_pulls_per_peer",
            f"must be in [1, transport.max_waiting_pulls = {self.max_waiting_pulls}], "
            f"got {self.max_waiting_pulls_per_peer}",
        )
        _require(self.push_dtype in PUSH_DTYPES, "transport.push_dtype", f"must be one of {', '.join(PUSH_DTYPES)}")
        if isinstance(self.shared_memory, bool):  # YAML 1.1: a bare off is false
            object.__setattr__(self, "shared_memory", "auto" if self.shared_memory else "off")
        _require(
            self.shared_memory in SHARED_MEMORY, "transport.shared_memory", f"must be one of {', '.join(SHARED_MEMORY)}"
        )
        if isinstance(self.bulk_sockets, bool):  # YAML 1.1: a bare off is false
            object.__setattr__(self, "bulk_sockets", "auto" if self.bulk_sockets else "off")
        _require(
            self.bulk_sockets in BULK_SOCKETS, "transport.bulk_sockets", f"must be one of {', '.join(BULK_SOCKETS)}"
        )
        _require(4096 <= self.chunk_bytes <= 64 * 1024 * 1024, "transport.chunk_bytes", "must be in [4 KiB, 64 MiB]")
        _require(
            self.bucket_bytes == 0 or 4096 <= self.bucket_bytes <= 1 << 30,
            "transport.bucket_bytes",
            "must be 0 (one bucket) or in [4 KiB, 1 GiB]",
        )
        for key in ("push_timeout_s", "pull_timeout_s", "heartbeat_s", "heartbeat_timeout_s"):
            _require(getattr(self, key) > 0, f"transport.{key}", "must be positive")
            _require(getattr(self, key) <= MAX_TIMEOUT_S, f"transport.{key}", f"must be at most {MAX_TIMEOUT_S:.0f}")
        _require(  # every member beats this often and the coordinator's liveness loop wakes as often: 1e-9 would spin
            self.heartbeat_s >= MIN_HEARTBEAT_S, "transport.heartbeat_s", f"must be at least {MIN_HEARTBEAT_S} s"
        )
        _require(
            self.heartbeat_timeout_s > 2 * self.heartbeat_s,
            "transport.heartbeat_timeout_s",
            "must exceed twice transport.heartbeat_s",
        )


def _block_problems(blocks: list[str]) -> list[str]:
    """Why ``memory.blocks`` cannot be profiled as one layer each (empty: it can).

    The profiler takes each block with all its parameters and saved tensors, so a name given twice, a
    block inside another one, or "" (the whole model, which holds every layer) would count the same
    parameters twice: resident memory, the plan, the batch and ``MemoryMax`` would all be overstated.
    """
    problems = []
    if "" in blocks:
        problems.append("'' names the whole model, which contains every layer")
    repeated = sorted({b for b in blocks if blocks.count(b) > 1})
    if repeated:
        problems.append(f"{', '.join(map(repr, repeated))} given more than once")
    named = sorted({b for b in blocks if b})
    problems += [
        f"{inner!r} is inside {outer!r}" for outer in named for inner in named if inner.startswith(outer + ".")
    ]
    return problems


@dataclass(frozen=True)
class MemoryConfig:
    device_memory: str | float | None = None
    """Device memory to plan for ("80GiB"); default: this host's GPU. Needed for per_device: auto without one.
    Every size here may also be a plain number of bytes (``0``, ``85899345920``): it is kept as its string."""
    bandwidth: str | float | None = None
    """Device<->host bandwidth ("12GB/s"); default: measured on this host's GPU, else 12GB/s."""
    margin: float = 0.1
    """Fraction of device memory the plan leaves free."""
    policy: MemoryPolicy = "auto"
    """auto: the planner's keep/swap/recompute per layer; keep: no offload; swap: swap every layer."""
    prefetch: int = 2
    """Saved tensors copied back ahead of backward's need."""
    pinned_limit: str | float = "4GiB"
    """Cap of pinned host memory for swapped activations per device; past it, pageable memory."""
    blocks: list[str] = field(default_factory=list)
    """Module names profiled and planned as one layer each (e.g. transformer blocks)."""
    profile_batches: list[int] = field(default_factory=lambda: [4, 8])
    """The two batch sizes whose difference gives the per-sample figures."""
    probe: bool = False
    """Before the other workers start, worker 0 runs one real iteration and reports its peak (S2.1)."""
    estimate: EstimateName = "factor"
    """How the probe's peak becomes every worker's memory (S2.2): factor, increment or iterative."""
    factor: float = 1.25
    increment: str | float = "1GiB"
    target_utilization: float = 0.85
    """Iterative mode: accept a limit once the probe's peak uses at most this fraction of it."""
    max_probe_rounds: int = 4
    """How often the batch may shrink and the master probe again; the overflow after the last shrink fails the
    job (so up to N + 1 probes overflow in all)."""
    offload_params: bool = False
    """S1.4 in full: each layer's parameters come to the device just before its forward and backward and its
    gradient leaves for the host as soon as it is computed, so device memory holds about one layer."""
    host_memory: str | float | None = None
    """Host memory the workers' offload may use per host ("64GiB"); default: the coordinator's host's cgroup
    memory.max when set, else its available memory. That default is right where the workers share the
    coordinator's host (``pstrain local``); on a deployment whose workers run elsewhere it is another machine's
    figure, so set this to the workers'. The largest batch is the smaller of device-fit and host-fit."""

    def __post_init__(self) -> None:
        _check_finite(self, "memory")
        _check_choices(self, "memory")
        _require(0 <= self.margin < 1, "memory.margin", f"must be in [0, 1), got {self.margin}")
        _require(self.prefetch >= 0, "memory.prefetch", "must be non-negative")
        _require(self.prefetch <= 1024, "memory.prefetch", f"must be at most 1024, got {self.prefetch}")
        _bounded(self.factor, "memory.factor", 1, 100)
        _require(0 < self.target_utilization <= 1, "memory.target_utilization", "must be in (0, 1]")
        _bounded(self.max_probe_rounds, "memory.max_probe_rounds", 1, 100)
        b = self.profile_batches
        _require(len(b) == 2 and 0 < b[0] < b[1], "memory.profile_batches", f"must be two sizes b1 < b2, got {b}")
        _require(b[1] <= MAX_BATCH, "memory.profile_batches", f"must be at most {MAX_BATCH}, got {b}")
        problems = _block_problems(self.blocks)
        _require(not problems, "memory.blocks", f"{'; '.join(problems)}: name each block once, the outermost only")
        for key in ("device_memory", "bandwidth", "pinned_limit", "increment", "host_memory"):
            value = getattr(self, key)
            if value is None:
                continue
            if not isinstance(value, str):  # YAML reads a bare 0 or 85899345920 as a number, not a size string
                value = str(value)
                object.__setattr__(self, key, value)
            try:
                size = parse_bytes(value)
            except ValueError as exc:
                raise ConfigError(f"memory.{key}: {exc}") from None
            except OverflowError:
                raise ConfigError(f"memory.{key}: {value!r} is too large") from None
            low = 1 if key in ("device_memory", "bandwidth", "host_memory") else 0
            _require(
                size > 0 or key != "increment" or self.estimate != "iterative",
                "memory.increment",
                f"must be positive with memory.estimate: iterative (each trial raises the limit by it), got {value!r}",
            )
            _require(low <= size <= MAX_BYTES, f"memory.{key}", f"must be in [{low} B, 1 PiB], got {value!r}")


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 50
    """Every PS shard snapshots its range and optimizer state every this many steps and at the end; 0: off."""
    dir: str | None = None
    """Where PS hosts write their shards' files and the coordinator its manifests (the same path on every
    host); default: ``<out>/checkpoints``."""
    keep: int = 2
    """Committed checkpoints kept."""

    def __post_init__(self) -> None:
        _require(self.every_steps >= 0, "checkpoint.every_steps", f"must be non-negative, got {self.every_steps}")
        _require(self.every_steps <= MAX_STEPS, "checkpoint.every_steps", f"must be at most {MAX_STEPS}")
        _bounded(self.keep, "checkpoint.keep", 1, 1000)


@dataclass(frozen=True)
class FaultConfig:
    on_nonfinite: NonFinitePolicy = "stop"
    """A NaN/Inf loss or gradient: ``stop`` fails the job naming the step and worker; ``skip`` skips the step."""
    max_restarts: int = 3
    """``pstrain local``: how often a cluster whose process died is restarted from the last checkpoint."""
    restart_backoff_s: float = 1.0
    """``pstrain local``: wait before the first restart; doubles with each one."""
    coordinator_timeout_s: float = 30.0
    """A PS shard or worker that cannot reach the coordinator this long exits 1 (its unit restarts it)."""
    replace_timeout_s: float = 60.0
    """S2.5: how long a failed worker's step waits for its replacement; then the job rolls back to the last
    checkpoint. 0: no in-place replacement, a failed worker rolls the cluster back at once."""

    def __post_init__(self) -> None:
        _check_finite(self, "fault")
        _check_choices(self, "fault")
        _require(self.max_restarts >= 0, "fault.max_restarts", f"must be non-negative, got {self.max_restarts}")
        _require(self.max_restarts <= 1000, "fault.max_restarts", f"must be at most 1000, got {self.max_restarts}")
        _require(
            0 <= self.replace_timeout_s <= 86400,
            "fault.replace_timeout_s",
            f"must be in [0, 86400], got {self.replace_timeout_s}",
        )
        _require(
            0 < self.coordinator_timeout_s <= 3600,
            "fault.coordinator_timeout_s",
            f"must be in (0, 3600], got {self.coordinator_timeout_s}",
        )
        _require(
            0 <= self.restart_backoff_s <= 600 and math.isfinite(self.restart_backoff_s),
            "fault.restart_backoff_s",
            f"must be in [0, 600], got {self.restart_backoff_s}",
        )


@dataclass(frozen=True)
class SecurityConfig:
    """Paths ``pstrain local`` passes to every process it starts (standalone services take flags)."""

    tls_ca: str | None = None
    """CA certificate (PEM); with it, every channel is mutual TLS."""
    tls_cert: str | None = None
    """Certificate (PEM) each process presents, as server and as client."""
    tls_key: str | None = None
    token_file: str | None = None
    """File holding the shared bearer token every RPC but health must carry."""

    def __post_init__(self) -> None:
        given = [k for k in ("tls_ca", "tls_cert", "tls_key") if getattr(self, k)]
        _require(
            len(given) in (0, 3),
            "security.tls_ca",
            "tls_ca, tls_cert and tls_key go together; "
            f"missing {', '.join(k for k in ('tls_ca', 'tls_cert', 'tls_key') if k not in given)}",
        )
        for key in ("tls_ca", "tls_cert", "tls_key", "token_file"):
            path = getattr(self, key)
            _require(path is None or Path(path).is_file(), f"security.{key}", f"no such file {path}")

    def flags(self) -> list[str]:
        pairs = [("--tls-ca", self.tls_ca), ("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)]
        pairs.append(("--token-file", self.token_file))
        return [item for flag, value in pairs if value for item in (flag, str(Path(value).resolve()))]


@dataclass(frozen=True)
class EvalConfig:
    factory: str | None = None
    """``pkg.module:callable(model) -> dict`` run by ``pstrain local`` on the trained model."""
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(
            self.factory is None or ":" in self.factory,
            "eval.factory",
            f"{self.factory!r} must look like 'pkg.module:callable'",
        )


@dataclass(frozen=True)
class EmbeddingTableConfig:
    """One sparse embedding table (``embeddings.<name>``, issue 9): rows on the PS shards, not in the flat vector.

    A model uses it through ``pstrain.nn.SparseEmbedding(<name>, rows, dim)``.
    """

    rows: int
    """Rows of the table; ids are ``0..rows-1``. Rows are created on the PS when first touched."""
    dim: int
    init: TableInit = "normal"
    """normal | uniform | zeros; a row's initial value depends only on (seed, table name, row id)."""
    init_scale: float = 0.01
    """Standard deviation (normal) or bound (uniform) of the initial values."""
    seed: int | None = None
    """Seed of the initial values; default: job.seed."""
    optimizer: TableOptimizer = "sgd"
    """sgd | adagrad | adam (lazy, row-wise: a row's moments and step count advance only when it is touched)."""
    lr: float = 0.1
    """The table's own learning rate (not scaled with the device count)."""
    lr_schedule: Literal["follow", "constant"] = "follow"
    """follow: ``lr`` times the dense schedule's factor of the step (the warmup of ``batch.warmup_steps``
    ramps the table's rows too, so a table starts as gently as the dense layers); constant: ``lr`` every step."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    averaging: Averaging = "count"
    """count: a row's summed gradient / the devices in which its id occurred (the source's rule, S5.3);
    devices: / all devices of the job (the dense rule)."""

    def __post_init__(self) -> None:
        _check_finite(self, "embeddings")
        _check_choices(self, "embeddings")
        _bounded(self.rows, "embeddings.rows", 1, 2**62)
        _bounded(self.dim, "embeddings.dim", 1, 65536)
        _require(self.init_scale >= 0, "embeddings.init_scale", f"must be non-negative, got {self.init_scale}")
        _require(self.lr > 0, "embeddings.lr", f"must be positive, got {self.lr}")
        _require(self.eps > 0, "embeddings.eps", f"must be positive, got {self.eps}")
        if self.seed is not None:
            _bounded(self.seed, "embeddings.seed", 0, 2**63 - 1)
        b = self.betas
        _require(
            len(b) == 2 and all(0 <= x < 1 for x in b), "embeddings.betas", f"must be two numbers in [0, 1), got {b}"
        )
        if self.optimizer != "adam":  # as for the dense optimizer: a setting that would be silently ignored
            for key in ("betas", "eps"):
                f = next(f for f in dataclasses.fields(self) if f.name == key)
                default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                _require(
                    getattr(self, key) == default,
                    f"embeddings.{key}",
                    f"{self.optimizer} does not use it; remove it (adam only; adagrad's eps is torch's, 1e-10)",
                )

    def spec(self, name: str, job_seed: int) -> TableSpec:
        return TableSpec(
            name=name,
            rows=self.rows,
            dim=self.dim,
            init=self.init,
            init_scale=self.init_scale,
            seed=job_seed if self.seed is None else self.seed,
            optimizer=self.optimizer,
            lr=self.lr,
            beta1=self.betas[0],
            beta2=self.betas[1],
            eps=self.eps,
            averaging=self.averaging,
            lr_schedule=self.lr_schedule,
        )


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig
    data: DataConfig
    loss: str = "cross_entropy"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    job: JobSection = field(default_factory=JobSection)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    embeddings: dict[str, Any] = field(default_factory=dict)
    """Sparse embedding tables by name (issue 9): each an ``EmbeddingTableConfig`` mapping."""

    def __post_init__(self) -> None:
        tables = {}
        for name, raw in self.embeddings.items():
            key = f"embeddings.{name}"
            _require(isinstance(name, str) and name.isidentifier(), key, "a table name must be an identifier")
            try:
                tables[name] = raw if isinstance(raw, EmbeddingTableConfig) else _build(EmbeddingTableConfig, raw, key)
            except ConfigError as exc:  # the table's own checks say "embeddings.<field>": name the table
                message = str(exc)
                if not message.startswith((key + ".", key + ":")):
                    message = message.replace("embeddings.", key + ".", 1)
                raise ConfigError(message) from None
        object.__setattr__(self, "embeddings", tables)
        _require(  # a sparse table's step waits for every worker's rows: it has no way to go on without one
            not (tables and self.cluster.least_workers < self.cluster.workers),
            "cluster.min_workers",
            f"is {self.cluster.min_workers} with {self.cluster.workers} workers, but the sparse tables "
            f"({', '.join(sorted(tables))}) need every worker at every step: leave min_workers out (or set it to "
            f"cluster.workers) for a job with embeddings",
        )
        _require(  # issue 8: every worker keeps a pull waiting on each shard
            self.transport.max_waiting_pulls >= self.cluster.workers,
            "transport.max_waiting_pulls",
            f"must be at least cluster.workers ({self.cluster.workers}), got {self.transport.max_waiting_pulls}",
        )
        gpus = [d if ":" in d else "cuda:0" for d in self.cluster.device_list if d.startswith("cuda")]
        twice = sorted({d for d in gpus if gpus.count(d) > 1})
        _require(  # each GPU has one autograd thread; the offloaded replicas' gradient sum takes turns across them
            not (self.memory.offload_params and twice),
            "cluster.devices_per_worker",
            f"lists {', '.join(twice)} more than once, which memory.offload_params cannot run: the replicas' "
            "backward passes would share that GPU's one autograd thread and wait on each other's gradients",
        )
        _require(
            self.loss in BUILTIN_LOSSES or ":" in self.loss,
            "loss",
            f"unknown loss {self.loss!r}: use one of {', '.join(sorted(BUILTIN_LOSSES))} or 'pkg.module:callable'",
        )

    def table_specs(self) -> list[TableSpec]:
        """The sparse tables as every service sees them, in name order."""
        return [self.embeddings[name].spec(name, self.job.seed) for name in sorted(self.embeddings)]

    def with_steps(self, steps: int) -> JobConfig:
        return dataclasses.replace(self, job=dataclasses.replace(self.job, steps=steps))


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if origin is Literal:
        return _is_choice(value, hint)
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(h) for h in typing.get_args(hint))
    if origin is Literal:
        return " | ".join(repr(c) for c in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


EXPONENT_FLOAT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+")
"""A float in exponent notation that YAML 1.1 (PyYAML) reads as a string, ``1e-3`` or ``1.0e3``: it takes only
``1.0e-3`` (a dot and a signed exponent); YAML 1.2 and most other readers take them all as numbers."""


def _exponent_floats(value: Any, hint: Any) -> Any:
    """``value`` with exponent-notation strings as floats where the field takes floats (``lr: 1e-3``)."""
    if hint is float and isinstance(value, str) and EXPONENT_FLOAT.fullmatch(value):
        return float(value)
    if typing.get_origin(hint) is list and typing.get_args(hint) == (float,) and isinstance(value, list):
        return [_exponent_floats(v, float) for v in value]
    return value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'the job file'}: must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names, key=str)  # YAML keys may be numbers or booleans too: no TypeError
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown key; known keys here are {', '.join(sorted(names))}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{key}: required key is missing")
            continue
        value, hint = raw[f.name], hints[f.name]
        if dataclasses.is_dataclass(hint):
            values[f.name] = _build(typing.cast(type, hint), value if value is not None else {}, key)
            continue
        value = _exponent_floats(value, hint)
        if not _type_ok(value, hint):
            if typing.get_origin(hint) is Literal:
                raise _choice_error(key, value, hint)
            raise ConfigError(f"{key}: expected {_type_name(hint)}, got {value!r}")
        try:
            values[f.name] = float(value) if hint is float else value
        except OverflowError:  # an int past float's range (about 1.8e308)
            raise ConfigError(f"{key}: must be a finite number, got an integer too large for a float") from None
    return cls(**values)


def parse_config(raw: Any) -> JobConfig:
    return typing.cast(JobConfig, _build(JobConfig, raw, ""))


class _JobFileLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: it would keep the last one silently, so a
    second ``optimizer:`` section (or ``steps:`` twice in one) would drop the first without a word.

    The check runs on each mapping as written, before ``<<: *anchor`` merges are flattened into it: PyYAML flattens
    a node in place (an anchored mapping merged elsewhere may be flattened before it is built), and a merged key
    that the mapping overrides is no repeat."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()  # the mapping nodes checked before their flattening

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        if id(node) not in self._checked:
            self._checked.add(id(node))
            self._refuse_repeats(node)
        super().flatten_mapping(node)

    def _refuse_repeats(self, node: yaml.MappingNode) -> None:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor`` may be overridden key by key
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                repeated = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the safe loader's own error names it later
                continue
            if repeated:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"found {key!r} twice", key_node.start_mark
                )


def load_config(path: str | Path) -> JobConfig:
    """The job file at ``path``; a file that cannot be read or parsed is a ConfigError without a cause, since no
    user code raised: the coordinator and ``pstrain local`` then report one line and log no traceback."""
    try:
        with open(path, "rb") as fh:  # a file, not its text: YAML's errors then name it, not "<unicode string>"
            raw = yaml.load(fh, Loader=_JobFileLoader)  # a SafeLoader: no tags that build objects
    except OSError as exc:
        raise ConfigError(f"cannot read job file {path}: {exc.strerror}") from None
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: an int of over 4300 digits, a date like 2024-13-45
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None  # one log line
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"{path} is not valid YAML: collections nested too deeply to read") from None
    if raw is None:
        raise ConfigError(f"{path} is empty: a job file needs at least model.factory and data.factory")
    return parse_config(raw)

"""``pstrain``: the user's command. ``pstrain local`` trains a job on a localhost cluster.

Before it starts any process, ``pstrain local`` checks the job file (the schema), that this host
can run the whole cluster (``check_local_host``) and everything the file names (``preflight``):
a bad job file ends with exit 2 and one line naming the key, the traceback of the user's code
in ``<out>/logs/launcher.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from pstrain.coordinator.config import JobConfig, load_config
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.plan import job_spec, make_plan
from pstrain.coordinator.planning import (
    describe,
    measure_bandwidth,
    measure_host_bandwidth,
    memory_max,
    plan_job,
    planning_gpu,
    profile_job,
)
from pstrain.coordinator.preflight import named, preflight
from pstrain.launcher.local_cluster import (
    LocalCluster,
    RestartPolicy,
    interrupted_exit_code,
    last_metrics,
    run_local,
    user_code_paths,
)
from pstrain.nn import load_sparse_tables, sparse_layers
from pstrain.planner.bucket_plan import NETWORK_BYTES_S, CommModel, choose_bucket_bytes, layers_of, measure_update_rate
from pstrain.planner.bucket_plan import describe as describe_buckets
from pstrain.runtime.atomic_io import atomic_write
from pstrain.runtime.dir_lock import LOCAL_RUN, DirectoryBusy, hold_directory
from pstrain.runtime.factories import FactoryError, build_model, describe_exception, import_callable
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.logs import log_level
from pstrain.runtime.units import parse_bytes
from pstrain.worker.devices import DeviceError, resolve_devices

PROCESSES_PER_CPU = 4
MIN_PROCESS_LIMIT = 8


def local_process_limit() -> int:
    """How many processes ``pstrain local`` starts on this host at most: 4 per usable CPU core, at least 8.

    Each process is a Python interpreter with torch loaded and its own gRPC threads; past a few
    per core the cluster spends its time switching between them and heartbeats time out.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(MIN_PROCESS_LIMIT, PROCESSES_PER_CPU * cpus)


def check_local_host(cfg: JobConfig) -> None:
    """What only ``pstrain local`` can check, because the whole cluster runs on this host."""
    c = cfg.cluster
    needed, limit = 1 + c.ps_shards + c.workers, local_process_limit()
    if needed > limit:
        raise ConfigError(
            f"cluster.workers, cluster.ps_shards: this job needs 1 coordinator + {c.ps_shards} PS shard(s) + "
            f"{c.workers} worker(s) = {needed} processes, more than this host runs ({limit}: "
            f"{PROCESSES_PER_CPU} per CPU core, at least {MIN_PROCESS_LIMIT}); lower them, or run the services "
            "on several hosts (ansible/)"
        )
    try:
        resolve_devices(c.device_list, c.device_count)
    except DeviceError as exc:
        raise ConfigError(f"cluster.devices_per_worker: {exc}") from exc


def import_user_code() -> None:
    """Let this process import the job's factories from where its children do (``eval.factory`` runs here):
    ``user_code_paths`` first, in their order, even where ``sys.path`` held them already further back."""
    paths = user_code_paths()
    sys.path[:] = [*paths, *(path for path in sys.path if path not in paths)]


def log_traceback(out_dir: Path, what: str, exc: BaseException) -> Path:
    """Append ``exc``'s traceback (the user's code, through ``__cause__``) to ``<out>/logs/launcher.log``."""
    path = out_dir / "logs" / "launcher.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as log:
        log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} pstrain[{os.getpid()}] {what}: {exc}\n")
        log.write("".join(traceback.format_exception(exc)))
    return path


def bad_job_file(config: str, out_dir: Path | None, exc: ConfigError) -> int:
    """Report a bad job file on one line (traceback to the launcher's log when user code raised); exit 2."""
    line = f"pstrain: bad job file {config}: {' '.join(str(exc).split())}"
    if exc.__cause__ is not None and out_dir is not None:
        line += f" (traceback in {log_traceback(out_dir, f'bad job file {config}', exc)})"
    print(line, file=sys.stderr)
    return 2


def evaluate(cfg: JobConfig, out_dir: Path) -> dict[str, float] | None:
    """Run the job's eval callable on the exported model; results go to eval.json too."""
    if not cfg.eval.factory:
        return None
    try:
        model = build_model(cfg.model.factory, json.dumps(cfg.model.kwargs))
    except FactoryError as exc:
        raise named("model", exc) from exc
    model.load_state_dict(torch.load(out_dir / "model.pt", map_location="cpu", weights_only=True))
    if any(layer.weight.shape[0] == 0 for _, layer in sparse_layers(model)):  # tables past model.pt's limit
        load_sparse_tables(model, out_dir / "tables")  # this run's: it wrote them with a model.pt without them
    model.eval()
    try:
        fn = import_callable(cfg.eval.factory)
    except FactoryError as exc:
        raise named("eval", exc) from exc
    with torch.no_grad():
        try:
            returned = fn(model, **cfg.eval.kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's code: named here, traceback in the log
            raise ConfigError(f"eval.factory: {cfg.eval.factory} raised {describe_exception(exc)}") from exc
    try:
        results = dict(returned)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"eval.factory: {cfg.eval.factory} returned a {type(returned).__name__}, not a mapping of names to numbers"
        ) from exc
    atomic_write(out_dir / "eval.json", lambda fh: fh.write(json.dumps(results, indent=2).encode()))
    return results


def cmd_local(args: argparse.Namespace) -> int:
    """Train the job on this host, holding ``--out`` for the run's life so a second run cannot interleave its
    journal and checkpoints with ours: it fails at once with exit 2 (``runtime.dir_lock``)."""
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        print(f"pstrain local: --out {out_dir}: a file is there; name a directory", file=sys.stderr)
        return 2
    try:  # a file on the way (``--out a_file/run``) or no permission: one line, not a traceback
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"pstrain local: --out {out_dir}: cannot create the directory: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        with hold_directory(out_dir, LOCAL_RUN, "--out", "pstrain local run"):
            return _train_locally(args, out_dir)
    except DirectoryBusy as exc:
        print(f"pstrain local: {exc}", file=sys.stderr)
        return 2


def _train_locally(args: argparse.Namespace, out_dir: Path) -> int:
    """Check the job file, run the cluster to the end, evaluate: the body of ``cmd_local`` under its lock."""
    try:
        cfg = load_config(args.config)
        if args.steps is not None:
            cfg = cfg.with_steps(args.steps)
        check_local_host(cfg)
        preflight(cfg)
    except ConfigError as exc:
        return bad_job_file(args.config, out_dir, exc)
    summary = (
        make_plan(cfg).describe() if cfg.batch.per_device != "auto" else "per-device batch: auto (see `pstrain plan`)"
    )
    print(f"pstrain local: {summary}; {cfg.cluster.ps_shards} PS shard(s); output in {out_dir}")
    cluster = LocalCluster(Path(args.config).resolve(), cfg, out_dir, args.steps, args.log_level, fresh=args.fresh)
    code = run_local(cluster, RestartPolicy(cfg.fault.max_restarts, cfg.fault.restart_backoff_s))
    if code != 0:
        print(f"pstrain local: logs are in {out_dir / 'logs'}", file=sys.stderr)
        return code
    metrics = last_metrics(out_dir)
    if metrics:
        loss = "skipped (non-finite)" if metrics.get("loss") is None else f"{metrics['loss']:.4f}"
        print(f"final loss {loss}, {metrics['samples_per_s']:.0f} samples/s")
    try:
        results = evaluate(cfg, out_dir)
    except ConfigError as exc:
        return bad_job_file(args.config, out_dir, exc)
    if results:
        print("eval: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in results.items()))
    return 0


def _check_size_flags(args: argparse.Namespace) -> None:
    """``pstrain plan``'s size and rate flags must read as positive sizes: ``ValueError`` naming the flag."""
    for flag in ("device_memory", "bandwidth", "host_memory", "network_bandwidth"):
        value = getattr(args, flag)
        if value is None:
            continue
        name = "--" + flag.replace("_", "-")
        try:
            size = parse_bytes(value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if size <= 0:
            raise ValueError(f"{name}: must be positive, got {value!r}")


def _check_memory_max_json(path: str | None) -> None:
    """``--memory-max-json``'s folder must exist: found only after minutes of planning, it was a traceback."""
    if path and not Path(path).parent.is_dir():
        raise ValueError(f"--memory-max-json: {Path(path).parent} is not a directory")


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan without starting a cluster."""
    try:
        _check_size_flags(args)
        _check_memory_max_json(args.memory_max_json)
        cfg = load_config(args.config)
        checked = preflight(cfg)
        model = checked.model
        bandwidth = args.bandwidth
        if args.measure_bandwidth:
            gpu = planning_gpu(cfg)
            rate = measure_bandwidth(gpu) if gpu is not None else measure_host_bandwidth()
            where = f"pinned host -> GPU {gpu.index}" if gpu is not None else "host memory copy (no GPU)"
            print(f"memory.bandwidth measured: {rate / 1e9:.1f}GB/s ({where}); put it in the job file to reuse it")
            bandwidth = f"{rate / 1e9:.3f}GB/s"
        job_plan = plan_job(
            cfg, model.model, checked.dataset, model.layout.total, args.device_memory, bandwidth, args.host_memory
        )
    except (ConfigError, ValueError) as exc:
        print(f"pstrain plan: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(describe(job_plan))
    print(bucket_plan_text(cfg, model.model, checked.dataset, args.network_bandwidth))  # S4.2
    if args.memory_max_json:  # issue 10: what ansible's pstrain_memory_max role applies as systemd MemoryMax
        estimates = memory_max(cfg, job_plan, model.layout.total)
        try:
            Path(args.memory_max_json).write_text(json.dumps(estimates) + "\n")
        except OSError as exc:
            print(f"pstrain plan: --memory-max-json: {exc}", file=sys.stderr)
            return 1
        print(f"MemoryMax estimates: worker {estimates['worker_bytes']} B, PS {estimates['ps_bytes']} B")
    return 0


def bucket_plan_text(cfg: JobConfig, model: torch.nn.Module, dataset: object, network: str | None) -> str:
    """S4.2: the bucket size that hides the most communication behind backward, from a profile of one step
    (backward time per layer) and a timed step of the shards' optimizer."""
    spec = job_spec(cfg, make_plan(cfg, 1), ParamLayout.of(model), "plan")
    comm = CommModel(
        network_bytes_s=parse_bytes(network) if network else NETWORK_BYTES_S,
        update_bytes_s=measure_update_rate(spec.optimizer),
        workers=cfg.cluster.workers,
        ps_shards=cfg.cluster.ps_shards,
        push_ratio=0.5 if cfg.transport.push_dtype == "bfloat16" else 1.0,
    )
    layers = layers_of(profile_job(cfg, model, dataset))  # type: ignore[arg-type]
    return describe_buckets(choose_bucket_bytes(layers, comm), comm)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pstrain", description="Distributed training with a sharded CPU parameter server."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    local = sub.add_parser("local", help="train a job on a cluster of processes on this machine")
    local.add_argument("--config", required=True, help="job file (YAML)")
    local.add_argument("--out", default="runs/latest", help="output directory (model.pt, metrics.jsonl, logs/)")
    local.add_argument("--steps", type=int, help="override job.steps")
    local.add_argument(
        "--log-level", type=log_level, default="INFO", metavar="LEVEL", help="log level of the cluster's processes"
    )
    local.add_argument(
        "--fresh",
        action="store_true",
        help="discard the committed checkpoints in the output directory instead of resuming from the newest",
    )
    local.set_defaults(func=cmd_local)
    plan = sub.add_parser("plan", help="print the memory plan, batch and learning rate without starting a cluster")
    plan.add_argument("--config", required=True, help="job file (YAML)")
    plan.add_argument("--device-memory", help="plan for this much device memory, e.g. 80GiB (default: the job file)")
    plan.add_argument("--bandwidth", help="device<->host bandwidth, e.g. 25GB/s (default: the job file)")
    plan.add_argument("--host-memory", help="host memory for offload per host, e.g. 64GiB (default: the job file)")
    plan.add_argument(
        "--measure-bandwidth", action="store_true", help="measure memory.bandwidth on this host and plan with it"
    )
    plan.add_argument(
        "--network-bandwidth", help="worker<->PS link for the bucket plan, e.g. 1.25GB/s (default: 10 Gb/s)"
    )
    plan.add_argument("--memory-max-json", help="write the worker and PS MemoryMax estimates (bytes) to this file")
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import_user_code()
    try:
        return int(args.func(args))
    except KeyboardInterrupt as exc:  # Ctrl-C before the cluster starts (the pre-flight check): no traceback
        print(f"pstrain {args.command}: interrupted", file=sys.stderr)
        return interrupted_exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())

"""``pstrain``: the user's command. ``pstrain local`` trains a job on a localhost cluster."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pstrain.coordinator.config import JobConfig, load_config
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import make_plan
from pstrain.coordinator.planning import describe, plan_job
from pstrain.launcher.local_cluster import LocalCluster, RestartPolicy, last_metrics, run_local
from pstrain.runtime.atomic_io import atomic_write
from pstrain.runtime.factories import FactoryError, build_dataset, build_model, import_object


def evaluate(cfg: JobConfig, out_dir: Path) -> dict[str, float] | None:
    """Run the job's eval callable on the exported model; results go to eval.json too."""
    if not cfg.eval.factory:
        return None
    model = build_model(cfg.model.factory, json.dumps(cfg.model.kwargs))
    model.load_state_dict(torch.load(out_dir / "model.pt", map_location="cpu", weights_only=True))
    model.eval()
    with torch.no_grad():
        results = dict(import_object(cfg.eval.factory)(model, **cfg.eval.kwargs))
    atomic_write(out_dir / "eval.json", lambda fh: fh.write(json.dumps(results, indent=2).encode()))
    return results


def cmd_local(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
        if args.steps is not None:
            cfg = cfg.with_steps(args.steps)
    except ConfigError as exc:
        print(f"pstrain: bad job file {args.config}: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
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
    except FactoryError as exc:
        print(f"pstrain: eval.factory: {exc}", file=sys.stderr)
        return 2
    if results:
        print("eval: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in results.items()))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan without starting a cluster."""
    try:
        cfg = load_config(args.config)
        model = ModelState(cfg)
        dataset = build_dataset(cfg.data.factory, json.dumps(cfg.data.kwargs))
        job_plan = plan_job(cfg, model.model, dataset, model.layout.total, args.device_memory, args.bandwidth)
    except (ConfigError, FactoryError, ValueError) as exc:
        print(f"pstrain plan: {exc}", file=sys.stderr)
        return 2
    print(describe(job_plan))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pstrain", description="Distributed training with a sharded CPU parameter server."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    local = sub.add_parser("local", help="train a job on a cluster of processes on this machine")
    local.add_argument("--config", required=True, help="job file (YAML)")
    local.add_argument("--out", default="runs/latest", help="output directory (model.pt, metrics.jsonl, logs/)")
    local.add_argument("--steps", type=int, help="override job.steps")
    local.add_argument("--log-level", default="INFO", help="log level of the cluster's processes")
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
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

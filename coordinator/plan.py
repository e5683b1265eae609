"""The training plan: per-device batch, global batch and the learning rate that goes with it (S1.6)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from pstrain.coordinator.config import JobConfig
from pstrain.coordinator.errors import ConfigError
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.optimizers import optimizer_entry
from pstrain.runtime.schedule import learning_rate
from pstrain.runtime.units import parse_bytes


@dataclass(frozen=True)
class Plan:
    per_device_batch: int
    devices_per_worker: int
    workers: int
    base_lr: float
    lr_scaling: str
    warmup_steps: int
    steps: int

    @property
    def total_devices(self) -> int:
        return self.workers * self.devices_per_worker

    @property
    def global_batch(self) -> int:
        """S1.6: global minibatch = per-device minibatch x number of devices in the cluster."""
        return self.per_device_batch * self.total_devices

    @property
    def lr_factor(self) -> float:
        if self.lr_scaling == "linear":
            return float(self.total_devices)
        if self.lr_scaling == "sqrt":
            return math.sqrt(self.total_devices)
        return 1.0

    @property
    def scaled_lr(self) -> float:
        """S1.6: distributed LR = single-device LR x the factor the global batch grew by."""
        return self.base_lr * self.lr_factor

    def schedule(self) -> pb.LrSchedule:
        return pb.LrSchedule(
            base_lr=self.base_lr, scaled_lr=self.scaled_lr, warmup_steps=self.warmup_steps, scaling=self.lr_scaling
        )

    def lr_at(self, step: int) -> float:
        return learning_rate(self.schedule(), step)

    def describe(self) -> str:
        warm = f", warmup {self.warmup_steps} steps" if self.warmup_steps else ""
        return (
            f"{self.workers} worker(s) x {self.devices_per_worker} device(s) = {self.total_devices} devices; "
            f"batch {self.per_device_batch}/device, global {self.global_batch}; "
            f"lr {self.base_lr:g} x {self.lr_factor:g} ({self.lr_scaling}) = {self.scaled_lr:g}{warm}; "
            f"{self.steps} steps"
        )


def lr_scaling_for(cfg: JobConfig) -> str:
    """``auto``: sqrt for Adam-type optimizers (their step is already normalised), linear otherwise."""
    if cfg.batch.lr_scaling != "auto":
        return cfg.batch.lr_scaling
    return "sqrt" if optimizer_entry(cfg.optimizer.name).adaptive else "linear"


def make_plan(cfg: JobConfig, per_device: int | None = None) -> Plan:
    """The plan; ``per_device`` is the memory planner's batch when the job file says ``auto``."""
    batch = per_device if per_device is not None else cfg.batch.per_device
    if not isinstance(batch, int):
        raise ConfigError("batch.per_device: 'auto' needs the memory planner (coordinator.planning.plan_job)")
    return Plan(
        per_device_batch=batch,
        devices_per_worker=cfg.cluster.device_count,
        workers=cfg.cluster.workers,
        base_lr=cfg.optimizer.lr,
        lr_scaling=lr_scaling_for(cfg),
        warmup_steps=cfg.batch.warmup_steps,
        steps=cfg.job.steps,
    )


def job_spec(
    cfg: JobConfig,
    plan: Plan,
    layout: ParamLayout,
    job_id: str,
    layer_policies: dict[str, str] | None = None,
    checkpoint_dir: str = "",
) -> pb.JobSpec:
    """Everything PS shards and workers need, in wire form: they never read the job file.

    ``checkpoint_dir`` is where the shards write (empty: no checkpoints); the coordinator
    resolves it from ``checkpoint.dir`` or its output directory.
    """
    opt = cfg.optimizer
    return pb.JobSpec(
        job_id=job_id,
        model_factory=cfg.model.factory,
        model_kwargs_json=json.dumps(cfg.model.kwargs),
        data_factory=cfg.data.factory,
        data_kwargs_json=json.dumps(cfg.data.kwargs),
        loss=cfg.loss,
        optimizer=pb.OptimizerSpec(
            name=opt.name,
            momentum=opt.momentum,
            dampening=opt.dampening,
            nesterov=opt.nesterov,
            weight_decay=opt.weight_decay,
            beta1=opt.betas[0],
            beta2=opt.betas[1],
            eps=opt.eps,
            trust_coefficient=opt.trust_coefficient,
            exclude_1d=opt.exclude_1d,
        ),
        lr_schedule=plan.schedule(),
        per_device_batch=plan.per_device_batch,
        global_batch=plan.global_batch,
        total_devices=plan.total_devices,
        workers=plan.workers,
        devices_per_worker=plan.devices_per_worker,
        steps=plan.steps,
        seed=cfg.job.seed,
        ps_shards=cfg.cluster.ps_shards,
        total_params=layout.total,
        params=[pb.ParamSpec(name=n, shape=s) for n, s in zip(layout.names, layout.shapes, strict=True)],
        chunk_bytes=cfg.transport.chunk_bytes,
        bucket_bytes=cfg.transport.bucket_bytes,
        push_dtype=pb.BFLOAT16 if cfg.transport.push_dtype == "bfloat16" else pb.FLOAT32,
        shared_memory_off=cfg.transport.shared_memory == "off",
        bulk_sockets_off=cfg.transport.bulk_sockets == "off",  # issue 12
        push_timeout_s=cfg.transport.push_timeout_s,
        pull_timeout_s=cfg.transport.pull_timeout_s,
        max_waiting_pulls=cfg.transport.max_waiting_pulls,  # issue 8
        max_waiting_pulls_per_peer=cfg.transport.max_waiting_pulls_per_peer,
        heartbeat_s=cfg.transport.heartbeat_s,
        devices=cfg.cluster.device_list,
        layer_policies=layer_policies or {},
        prefetch=cfg.memory.prefetch,
        pinned_limit_bytes=parse_bytes(cfg.memory.pinned_limit),
        offload_params=cfg.memory.offload_params,
        checkpoint_every_steps=cfg.checkpoint.every_steps if checkpoint_dir else 0,
        checkpoint_dir=checkpoint_dir,
        checkpoint_keep=cfg.checkpoint.keep,
        on_nonfinite=cfg.fault.on_nonfinite,
        coordinator_timeout_s=cfg.fault.coordinator_timeout_s,
        embeddings=[t.to_pb() for t in cfg.table_specs()],  # issue 9: sparse tables, not in the flat vector
        profile_blocks=list(cfg.memory.blocks),  # issue 10: the master profiles the layers the plan names
        profile_batches=list(cfg.memory.profile_batches),
        data_prefetch_off=not cfg.data.prefetch,
    )

"""GetJobStatus's figures after a coordinator restart that takes the job back from its journal."""

from pathlib import Path

import yaml

from pstrain.coordinator.config import JobConfig, parse_config
from pstrain.coordinator.job import Job
from pstrain.coordinator.ledger import StepReport
from pstrain.coordinator.main import build_job, job_keys
from pstrain.coordinator.probe import ProbeReport
from pstrain.planner.memory_estimate import Probe
from tests.helpers import write_job

MiB = 1 << 20


def started(cfg: JobConfig, out: Path) -> Job:
    """The coordinator's job for ``cfg`` as ``main`` builds it (with its key, so a restart may take it back),
    one PS shard and two workers registered."""
    job = build_job(cfg, out)
    job_keys(out, False)  # as the coordinator's main keeps it: a job without its key is not taken back
    job.register_ps(0, "127.0.0.1:5000")
    job.ps_ready(0)
    for i in range(2):
        job.register_worker(f"127.0.0.1:{6000 + i}", [], f"h{i}")
    return job


def probed_two_steps(cfg: JobConfig, out: Path) -> Job:
    """``started``, the probe's report accepted (60 MiB device, 500 MiB host peaks), then steps 0 and 1."""
    job = started(cfg, out)
    batch = job.plan.per_device_batch
    assert job.report_probe(ProbeReport(0, Probe(batch, device_peak_bytes=60 * MiB, host_peak_bytes=500 * MiB))).done
    for step in range(2):
        for worker in range(2):
            job.report_step(StepReport(worker_id=worker, step=step, loss=1.0, samples=batch, step_s=0.1))
    return job


def test_the_memory_estimate_survives_a_coordinator_restart(tmp_path):
    path = write_job(
        tmp_path / "job.yaml",
        cluster={"ps_shards": 1, "workers": 2, "devices_per_worker": 1},
        memory={"probe": True},
        job={"steps": 20, "seed": 0},
    )
    cfg = parse_config(yaml.safe_load(path.read_text()))
    out = tmp_path / "out"
    job = probed_two_steps(cfg, out)
    before = job.status()
    assert before.worker_device_memory_bytes > 0 and before.worker_host_memory_bytes > 0
    job.close()

    again = build_job(cfg, out, recover=True)
    try:
        assert again.recovered and again.status().step == 2
        after = again.status()
        assert (after.worker_device_memory_bytes, after.worker_host_memory_bytes) == (
            before.worker_device_memory_bytes,
            before.worker_host_memory_bytes,
        )
        slot = again.worker_slot(1)  # what a replacement of worker 1 is served
        assert slot.device_memory_bytes == before.worker_device_memory_bytes
    finally:
        again.close()


def test_the_memory_estimate_survives_a_resume_from_a_checkpoint(tmp_path):
    """A job resumed from a committed checkpoint runs no probe: its status read 0 B for the estimate, and a
    replacement worker was served 0. Manifests now carry the probe's estimate on."""
    path = write_job(
        tmp_path / "job.yaml",
        cluster={"ps_shards": 1, "workers": 2, "devices_per_worker": 1},
        memory={"probe": True},
        job={"steps": 20, "seed": 0},
        checkpoint={"every_steps": 2},
    )
    cfg = parse_config(yaml.safe_load(path.read_text()))
    out = tmp_path / "out"
    job = probed_two_steps(cfg, out)
    job.checkpoint_written(0, 2)
    before = job.status()
    assert job.checkpoint_step == 2 and before.worker_device_memory_bytes > 0
    job.close()

    resumed = build_job(cfg, out, recover=False)  # a rollback: from the checkpoint, not the journal
    try:
        assert not resumed.recovered and resumed.resume_step == 2
        after = resumed.status()
        assert (after.worker_device_memory_bytes, after.worker_host_memory_bytes) == (
            before.worker_device_memory_bytes,
            before.worker_host_memory_bytes,
        )
    finally:
        resumed.close()

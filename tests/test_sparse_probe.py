"""``memory.probe`` and ``batch.per_device: auto`` with sparse tables (issue 9): the probe and the planner run the
model before any PS shard serves, binding the batch's rows from the seeded init, so the sparse layers' memory is
measured (the probe) or profiled (the planner)."""

from __future__ import annotations

import uuid

import pytest
import torch

from examples import ctr
from pstrain.coordinator.config import parse_config
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.planning import plan_job
from pstrain.nn import seeded_rows, sparse_layers
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.sparse_rows import TableSpec, init_rows
from pstrain.worker.probe import run_probe
from pstrain.worker.replicas import ReplicaSet
from pstrain.worker.row_store import HostRowStore, SeededRows
from tests.helpers import pids_with_marker, run_local, write_job

SIZES = {"users": 400, "items": 200, "contexts": 20}
DIM = 8


def tables() -> list[TableSpec]:
    return [TableSpec(n, r, DIM, seed=5) for n, r in zip(ctr.TABLES, SIZES.values(), strict=True)]


def sections(**overrides: object) -> dict[str, object]:
    job: dict[str, object] = {
        "model": {"factory": "examples.ctr:dlrm", "kwargs": {**SIZES, "dim": DIM, "hidden": 8}},
        "data": {
            "factory": "examples.ctr:train_set",
            "kwargs": {"samples": 800, **SIZES, "seed": 0, "holdout": 0.1},
            "shard_size": 16,
            "shuffle": True,
        },
        "optimizer": {"name": "sgd", "lr": 0.1},
        "batch": {"per_device": 8, "lr_scaling": "none"},
        "cluster": {"ps_shards": 2, "workers": 1, "devices_per_worker": 2},
        "job": {"steps": 4, "seed": 5},
        "embeddings": {n: {"rows": r, "dim": DIM} for n, r in zip(ctr.TABLES, SIZES.values(), strict=True)},
    }
    job.update(overrides)
    return job


def test_the_probe_binds_the_batch_rows_from_the_seeded_init_and_releases_them():
    devices = [torch.device("cpu"), torch.device("cpu")]
    build = lambda: ctr.dlrm(**SIZES, dim=DIM, hidden=8)  # noqa: E731
    replicas = ReplicaSet(build, devices, ParamLayout.of(build()))
    inputs, targets = ctr.train_set(samples=64, **SIZES, seed=0)[:16]
    try:
        with pytest.raises(RuntimeError, match="has no rows here"):  # what the probe did before: no rows bound
            run_probe(replicas, inputs, targets, torch.nn.functional.cross_entropy)
        store = HostRowStore(SeededRows(tables()), 0, tables(), [r.model for r in replicas.replicas], devices)
        bound = []
        original = store.prepare
        store.prepare = lambda step, xs, retrying=None: (original(step, xs, retrying), bound.append(store.rows_held))  # type: ignore[method-assign]
        device_peak, host_peak = run_probe(replicas, inputs, targets, torch.nn.functional.cross_entropy, 0, store)
        assert host_peak > 0 and device_peak >= 0
        assert bound == [sum(int(torch.unique(inputs[:, k]).numel()) for k in range(3))]  # one host copy per id
        assert all(layer.rows is None for r in replicas.replicas for _, layer in sparse_layers(r.model))
    finally:
        replicas.close()


def test_seeded_rows_are_the_tables_initial_values():
    ids = {"user": torch.tensor([3, 1, 399])}
    assert torch.equal(SeededRows(tables()).pull_rows(0, ids)["user"], init_rows(tables()[0], ids["user"]))


def test_the_planner_profiles_the_sparse_layers_rows_and_picks_an_auto_batch():
    raw = sections(batch={"per_device": "auto", "lr_scaling": "none"}, memory={"device_memory": "4MiB"})
    cfg = parse_config(raw)
    state = ModelState(cfg)
    plan = plan_job(cfg, state.model, ctr.train_set(samples=200, **SIZES, seed=0), state.layout.total)
    assert plan.plan.per_device_batch > 0 and plan.profile is not None
    rows = {p.name: p for p in plan.profile.layers if p.name.startswith("tables.")}
    # Each sample looks up one row per table: up to DIM float32 more per sample, held until backward ends.
    assert all(0 < p.saved_bytes_per_sample <= DIM * 4 + 64 for p in rows.values()), rows
    assert all(layer.rows is None for _, layer in sparse_layers(state.model))  # unbound after the profile


def test_the_seeded_binding_is_undone_even_when_the_forward_fails():
    model = ctr.dlrm(**SIZES, dim=DIM, hidden=8)
    with pytest.raises(ValueError, match="must be in"), seeded_rows(model, tables()):
        model(torch.tensor([[1, 2, 20]]))  # user and item are bound, then the ctx id is out of range
    assert all(layer.rows is None for _, layer in sparse_layers(model))


def test_a_job_with_tables_runs_with_the_probe_and_an_auto_batch(tmp_path):
    marker = uuid.uuid4().hex
    raw = sections(
        batch={"per_device": "auto", "max_per_device": 16, "lr_scaling": "none"},
        memory={"probe": True, "device_memory": "1GiB"},
    )
    result = run_local(write_job(tmp_path / "job.yaml", **raw), tmp_path / "out", marker)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "probe at batch 16: device peak" in (tmp_path / "out" / "logs" / "worker-0.log").read_text()
    state = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    seeded = init_rows(tables()[0], torch.arange(SIZES["users"]))
    assert (state["tables.0.weight"] != seeded).any(dim=1).sum() > 0  # trained through the PS after the probe
    assert not pids_with_marker(marker)

"""``model.init_checkpoint`` loads sparse tables (issue 9): a checkpoint's rows become the initial rows of the PS
shards that own them (row i on shard i % ps_shards), rows it does not carry keep the seeded init."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.initial_tables import CheckpointTable, initial_row_blocks, take_tables
from pstrain.nn import SparseEmbedding
from pstrain.ps_server.checkpoint import CheckpointError
from pstrain.ps_server.sparse_checkpoint import load_initial_rows
from pstrain.ps_server.sparse_table import SparseShard
from pstrain.runtime.sparse_rows import TableSpec, encode_block, init_rows
from tests.helpers import pids_with_marker, run_local, write_job

USER = TableSpec("user", 1000, 4, seed=3)
ITEM = TableSpec("item", 50, 4, seed=3, init="uniform")
SHARDS = 3


def shards() -> list[SparseShard]:
    return [SparseShard(k, SHARDS, [USER, ITEM], workers=1, total_devices=1) for k in range(SHARDS)]


def table_of(shard_list: list[SparseShard], spec: TableSpec) -> torch.Tensor:
    """The whole table as the shards would serve it (pulling creates untouched rows with the seeded init)."""
    out = torch.empty(spec.rows, spec.dim)
    for shard in shard_list:
        ids = torch.arange(shard.shard_id, spec.rows, SHARDS)
        out[ids] = shard.pull(0, {spec.name: ids}, 1.0)[1][spec.name]
    return out


def trained(spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
    return init_rows(spec, ids) + 1.0 + ids.to(torch.float32)[:, None]


def test_a_whole_table_becomes_the_shards_initial_rows_and_only_moved_rows_are_held():
    moved = torch.tensor([0, 1, 2, 7, 500, 999])
    table = init_rows(USER, torch.arange(USER.rows))
    table[moved] = trained(USER, moved)
    tables = {"user": CheckpointTable(USER, table)}
    got = shards()
    for shard in got:
        blocks = list(initial_row_blocks(tables, shard.shard_id, SHARDS, rows_per_block=2))
        assert all(len(b.ids) <= 2 * 8 for b in blocks)  # streamed in blocks, never the whole table at once
        assert load_initial_rows(shard, blocks) == int((moved % SHARDS == shard.shard_id).sum())
        assert shard.rows_held()["user"] == int((moved % SHARDS == shard.shard_id).sum())  # rows owned by id % 3
    assert torch.equal(table_of(got, USER), table)
    assert torch.equal(table_of(got, ITEM), init_rows(ITEM, torch.arange(ITEM.rows)))  # not in the checkpoint


def test_the_table_directory_form_loads_its_touched_rows_and_the_rest_keep_the_seeded_init(tmp_path):
    model = nn.Sequential(SparseEmbedding("user", USER.rows, USER.dim), SparseEmbedding("item", ITEM.rows, ITEM.dim))
    ids = torch.tensor([998, 4, 30, 3])
    payload = {"spec": USER.__dict__.copy(), "ids": ids, "rows": trained(USER, ids)}
    (tmp_path / "tables").mkdir()
    torch.save(payload, tmp_path / "tables" / "user.pt")
    tables = take_tables(model, str(tmp_path / "model.pt"), [USER, ITEM])
    assert sorted(tables) == ["user"]
    got = shards()
    for shard in got:
        load_initial_rows(shard, initial_row_blocks(tables, shard.shard_id, SHARDS))
    expected = init_rows(USER, torch.arange(USER.rows))
    expected[ids] = trained(USER, ids)
    assert torch.equal(table_of(got, USER), expected)
    assert torch.equal(table_of(got, ITEM), init_rows(ITEM, torch.arange(ITEM.rows)))
    wrong = TableSpec("user", 999, 4, seed=3)
    with pytest.raises(ConfigError, match=r"model.init_checkpoint: table 'user' .* is 1000 x 4; embeddings.user"):
        take_tables(model, str(tmp_path / "model.pt"), [wrong])


def test_model_pt_weights_are_taken_out_of_the_layers_so_the_export_never_writes_them_back():
    layer = SparseEmbedding("item", ITEM.rows, ITEM.dim)
    full = trained(ITEM, torch.arange(ITEM.rows))
    nn.Sequential(layer).load_state_dict({"0.weight": full})
    tables = take_tables(nn.Sequential(layer), "/nowhere/model.pt", [ITEM])
    assert torch.equal(tables["item"].rows, full) and layer.weight.shape[0] == 0
    assert "0.weight" not in nn.Sequential(layer).state_dict()


def test_rows_another_shard_owns_are_refused_and_leave_the_shard_unchanged():
    shard = shards()[1]
    with pytest.raises(CheckpointError, match="belongs to shard 0"):
        load_initial_rows(shard, [encode_block("user", torch.tensor([3]), torch.ones(1, 4))])
    with pytest.raises(CheckpointError, match="does not declare"):
        load_initial_rows(shard, [encode_block("other", torch.tensor([1]), torch.ones(1, 4))])
    assert shard.rows_held() == {"user": 0, "item": 0}


SIZES = {"users": 400, "items": 200, "contexts": 20}


def ctr_job(path: Path, steps: int, lr: float, init_checkpoint: Path | None = None) -> Path:
    model: dict[str, object] = {"factory": "examples.ctr:dlrm", "kwargs": {**SIZES, "dim": 4, "hidden": 8}}
    if init_checkpoint is not None:
        model["init_checkpoint"] = str(init_checkpoint)
    return write_job(
        path,
        model=model,
        data={
            "factory": "examples.ctr:train_set",
            "kwargs": {"samples": 800, **SIZES, "seed": 0, "holdout": 0.1},
            "shard_size": 16,
            "shuffle": True,
        },
        optimizer={"name": "sgd", "lr": lr},
        batch={"per_device": 8, "lr_scaling": "none"},
        cluster={"ps_shards": 2, "workers": 1, "devices_per_worker": 2},
        job={"steps": steps, "seed": 5},
        embeddings={
            "user": {"rows": SIZES["users"], "dim": 4, "lr": lr},
            "item": {"rows": SIZES["items"], "dim": 4, "optimizer": "adagrad", "lr": lr},
            "ctx": {"rows": SIZES["contexts"], "dim": 4, "lr": lr},
        },
    )


def test_a_job_started_from_a_previous_runs_model_pt_continues_from_its_tables(tmp_path):
    marker = uuid.uuid4().hex
    first = run_local(ctr_job(tmp_path / "a.yaml", 6, 0.5), tmp_path / "a", marker)
    assert first.returncode == 0, first.stderr[-3000:]
    before = torch.load(tmp_path / "a" / "model.pt", weights_only=True)
    # The second run's learning rates are far below float32 resolution: its tables end where they started.
    second = run_local(ctr_job(tmp_path / "b.yaml", 2, 1e-30, tmp_path / "a" / "model.pt"), tmp_path / "b", marker)
    assert second.returncode == 0, second.stderr[-3000:]
    after = torch.load(tmp_path / "b" / "model.pt", weights_only=True)
    for key, name, rows in (("tables.0.weight", "user", 400), ("tables.1.weight", "item", 200)):
        seeded = init_rows(TableSpec(name, rows, 4, seed=5), torch.arange(rows))
        assert (before[key] != seeded).any(dim=1).sum() > 10  # the first run trained these rows
        assert torch.equal(after[key], before[key])  # ... and the second started from them
    assert not pids_with_marker(marker)

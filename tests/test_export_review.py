"""Review of the buffers in checkpoints and the final export (issue 11, issue 9): what a user hits.

Real files and real objects: models are defined here, checkpoints are written by the store itself and
then damaged the way a disk or a copy damages them.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from pstrain.coordinator.buffer_store import BufferStore, buffers_path, slot_names
from pstrain.coordinator.errors import ConfigError
from pstrain.coordinator.export import ModelExport
from pstrain.coordinator.model_state import ModelState
from pstrain.runtime.layout import ParamLayout

WORKERS, REPLICAS = 2, 2


def bn_model() -> nn.Module:
    """BatchNorm: float running statistics and an int64 ``num_batches_tracked``."""
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def uploads(model: nn.Module, value: float) -> dict[str, torch.Tensor]:
    """One slot's upload with recognisable values, every replica's buffers."""
    return {name: torch.full_like(b, value) for name, b in slot_names(model, REPLICAS).items()}


def committed_checkpoint(directory: Path, step: int) -> Path:
    """A checkpoint's buffers file, written by the store as a commit writes it."""
    model = bn_model()
    store = BufferStore(model, WORKERS, REPLICAS)
    for worker_id in range(WORKERS):
        store.put(worker_id, step, uploads(model, 1.0 + worker_id))
    store.write(directory, step)
    return buffers_path(directory, step)


def test_a_truncated_buffers_file_stops_the_resume_with_a_config_error_naming_it_and_the_way_out(tmp_path):
    path = committed_checkpoint(tmp_path, 6)
    path.write_bytes(path.read_bytes()[:300])  # a partial copy of the checkpoint directory
    store = BufferStore(bn_model(), WORKERS, REPLICAS)
    with pytest.raises(ConfigError, match="buffers of checkpoint 6") as caught:
        store.load(tmp_path, 6)
    assert str(path) in str(caught.value) and "manifest-000000006.json" in str(caught.value)
    assert "--fresh" in str(caught.value)
    assert store.newest(0, 6) is None and not store.complete(6)  # nothing was kept


def test_a_buffers_file_of_another_model_stops_the_resume_with_a_config_error_and_keeps_nothing(tmp_path):
    committed_checkpoint(tmp_path, 3)
    other = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5))  # the job file's model changed shape
    store = BufferStore(other, WORKERS, REPLICAS)
    with pytest.raises(ConfigError, match="does not fit this job's model"):
        store.load(tmp_path, 3)
    assert store.newest(0, 3) is None and store.newest(1, 3) is None


# ------------------------------------------------------------------ the export


class Tied(nn.Module):
    """Tied weights (one parameter under two state_dict keys) and BatchNorm buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.emb.weight


def model_state(model: nn.Module) -> ModelState:
    """The coordinator's view of ``model`` (``ModelState`` without a job file)."""
    state = ModelState.__new__(ModelState)
    state.model, state.layout, state.tables = model, ParamLayout.of(model), {}
    state.initial = state.layout.flatten(model)
    return state


def killed_export_leftover(directory: Path, name: str) -> Path:
    """What ``atomic_write`` leaves when its process is SIGKILLed mid-write: its temp file, named as it names it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.write(fd, b"\0" * 4096)
    os.close(fd)
    return Path(tmp)


def test_an_export_removes_the_temp_files_of_exports_killed_before_it_and_writes_a_loadable_model(tmp_path):
    leftovers = [killed_export_leftover(tmp_path, "model.pt") for _ in range(2)]
    table_leftover = killed_export_leftover(tmp_path / "tables", "user.pt")
    unrelated = tmp_path / "tables" / "user.pt"
    unrelated.write_bytes(b"kept")
    model = Tied()
    final = torch.randn(model_state(model).layout.total)
    trained = {name: b + 3 for name, b in model.named_buffers()}
    export = ModelExport(model_state(model), tmp_path, lambda addresses, version: final, 0.0, threading.Condition())
    export.upload_buffers(trained)
    export.run(["127.0.0.1:1"], 4)
    assert not any(p.exists() for p in [*leftovers, table_leftover]) and unrelated.read_bytes() == b"kept"
    fresh = Tied()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    assert torch.equal(ParamLayout.of(fresh).flatten(fresh), final)
    assert fresh.bn.num_batches_tracked.dtype == torch.int64 and int(fresh.bn.num_batches_tracked) == 3
    assert torch.equal(fresh.bn.running_var, trained["bn.running_var"])


def test_a_starting_store_removes_the_temp_files_of_buffer_writes_killed_before_it(tmp_path):
    committed = committed_checkpoint(tmp_path, 3)
    leftovers = [
        killed_export_leftover(tmp_path, "buffers-000000006.pt"),
        killed_export_leftover(tmp_path, "buffers-000000006-w1.part"),
    ]
    shard_file = killed_export_leftover(tmp_path / "shard-0", "step-000000006.pt")  # a PS shard's: not ours
    store = BufferStore(bn_model(), WORKERS, REPLICAS)
    store.load(tmp_path, 3)
    store.spool(tmp_path, None)
    assert not any(p.exists() for p in leftovers) and committed.exists() and shard_file.exists()
    assert store.newest(1, 3) is not None

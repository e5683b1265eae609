"""``pstrain local``'s eval on a model whose sparse tables were exported beside ``model.pt`` (past its 1 GiB limit).

Before, the eval loaded ``model.pt`` only: the tables' layers had no rows, and a job that trained well failed at
its eval with "has no rows here"."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from examples import ctr
from pstrain.coordinator.config import parse_config
from pstrain.coordinator.table_export import table_entries
from pstrain.launcher import cli
from pstrain.nn import sparse_layers
from pstrain.runtime.atomic_io import atomic_write
from tests.helpers import REPO_ROOT


def test_the_eval_loads_the_tables_exported_beside_model_pt(tmp_path: Path) -> None:
    raw = yaml.safe_load((REPO_ROOT / "examples" / "ctr.yaml").read_text())
    raw["eval"] = {**raw["eval"], "kwargs": {**raw["eval"].get("kwargs", {}), "samples": 2000}}
    cfg = parse_config(raw)
    model = ctr.dlrm(**cfg.model.kwargs)
    specs = cfg.table_specs()
    touched = {s.name: (torch.arange(5), torch.full((5, s.dim), 0.25)) for s in specs}
    assert table_entries(model, specs, touched, tmp_path, limit_bytes=0) == {}  # every table to tmp/tables
    atomic_write(tmp_path / "model.pt", lambda fh: torch.save(model.state_dict(), fh))  # dense only
    assert all(layer.weight.shape[0] == 0 for _, layer in sparse_layers(model))

    results = cli.evaluate(cfg, tmp_path)
    assert results is not None and 0.0 <= results["heldout_auc"] <= 1.0

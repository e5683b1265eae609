"""The job file's embeddings section (issue 9): the table LR schedule, the probe and the auto batch."""

from __future__ import annotations

import pytest
import yaml

from pstrain.coordinator.config import parse_config
from pstrain.coordinator.errors import ConfigError
from tests.helpers import REPO_ROOT

RAW = yaml.safe_load((REPO_ROOT / "examples" / "ctr.yaml").read_text())


def test_a_table_follows_the_dense_schedule_by_default_or_keeps_its_lr_constant():
    cfg = parse_config(RAW)
    assert {s.lr_schedule for s in cfg.table_specs()} == {"follow"}
    raw = {**RAW, "embeddings": {**RAW["embeddings"], "ctx": {**RAW["embeddings"]["ctx"], "lr_schedule": "constant"}}}
    specs = {s.name: s for s in parse_config(raw).table_specs()}
    assert specs["ctx"].lr_schedule == "constant" and specs["user"].lr_schedule == "follow"
    assert type(specs["ctx"]).from_pb(specs["ctx"].to_pb()) == specs["ctx"]
    bad = {**RAW, "embeddings": {"ctx": {**RAW["embeddings"]["ctx"], "lr_schedule": "cosine"}}}
    with pytest.raises(ConfigError, match="embeddings.ctx.lr_schedule"):
        parse_config(bad)


@pytest.mark.parametrize("patch", [{"memory": {"probe": True}}, {"batch": {"per_device": "auto"}}])
def test_the_probe_and_auto_batch_are_accepted_with_tables(patch):
    """Both run the model before the PS serves; the rows come from the seeded init (tests/test_sparse_probe.py)."""
    cfg = parse_config({**RAW, **patch})
    assert sorted(cfg.embeddings) == ["ctx", "item", "user"]

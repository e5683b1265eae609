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


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("key, value", [("eps", 1e-6), ("betas", [0.8, 0.99])])
def test_adams_settings_on_a_table_of_another_optimizer_are_refused_by_name(optimizer, key, value):
    """Only the lazy Adam reads a table's betas and eps (adagrad's eps is torch's, 1e-10): elsewhere a value set
    would be ignored without a word, so it is refused, as the dense optimizer's options are."""
    table = {**RAW["embeddings"]["ctx"], "optimizer": optimizer}
    with pytest.raises(ConfigError, match=f"embeddings.ctx.{key}: {optimizer} does not use it"):
        parse_config({**RAW, "embeddings": {"ctx": {**table, key: value}}})
    assert parse_config({**RAW, "embeddings": {"ctx": table}}).embeddings["ctx"].optimizer == optimizer
    adam = parse_config({**RAW, "embeddings": {"ctx": {**table, "optimizer": "adam", key: value}}})
    assert getattr(adam.embeddings["ctx"], key) == value

"""``fault.on_nonfinite: skip`` skips a step's running statistics too, not only its update.

Before, the forward of a batch with a NaN moved BatchNorm's running mean and variance to NaN for good (and counted
the batch): training went on, but every later eval, checkpoint and ``model.pt`` carried NaN statistics.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.nn import functional as F

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.ps_server.pieces import PiecedShard
from pstrain.runtime.buckets import shard_pieces
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.shard_map import shard_ranges
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.replicas import ReplicaSet
from pstrain.worker.trainer import Trainer
from tests.helpers import nan_set
from tests.test_trainer import NO_WAIT, ListSource, Reporter

DEVICES, PER_DEVICE, STEPS = 2, 2, 4


def normalized() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Tanh(), nn.Linear(7, 4))


def test_a_skipped_step_leaves_the_running_statistics_as_they_were() -> None:
    layout = ParamLayout.of(normalized())
    initial = layout.flatten(normalized())
    shards = [
        PiecedShard.build(
            shard_pieces(layout, r, 0),
            initial[r.start : r.end].clone(),
            pb.OptimizerSpec(name="sgd"),
            pb.LrSchedule(scaled_lr=0.1),
            1,
        )
        for r in shard_ranges(layout.total, 2)
    ]
    samples = DEVICES * PER_DEVICE * STEPS
    data = nan_set(samples, nan_at=DEVICES * PER_DEVICE * 1 + 1)  # read at step 1, by device 0
    job = pb.JobSpec(steps=STEPS, per_device_batch=PER_DEVICE, total_params=layout.total, on_nonfinite="skip")
    replicas = ReplicaSet(normalized, [torch.device("cpu")] * DEVICES, layout)
    reporter = Reporter()
    ps = LocalPsClient(shards, pull_timeout_s=30)
    feed = DataFeed(data, ListSource(0, list(range(samples))))
    trainer = Trainer(0, job, replicas, ps, feed, F.cross_entropy, reporter, threading.Event(), NO_WAIT)
    try:
        assert trainer.run() == STEPS
        for replica in replicas.replicas:
            norm = replica.model[1]
            assert torch.isfinite(norm.running_mean).all() and torch.isfinite(norm.running_var).all()
            assert int(norm.num_batches_tracked) == STEPS - 1  # the skipped batch is not counted
    finally:
        ps.close(cancel=True)
        replicas.close()

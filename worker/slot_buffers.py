"""This worker slot's model buffers in the job's checkpoints (issue 11).

Buffers (BatchNorm running statistics and the like) change in forward, on every replica, and
never pass the PS. So that a resumed job ends with the model of a run that never crashed:

* after the step that makes version ``t`` a checkpoint (``checkpoint.every_steps``, and the last
  step; the shards' own rule, ``ps_server.shard.CheckpointPolicy``), the worker uploads every
  replica's buffers of ``t`` before it reports the step; the coordinator commits ``t`` only with
  every slot's (``coordinator/buffer_store.py``);
* a worker that starts at version ``t > 0`` (a resume from checkpoint ``t``, or a replacement
  that redoes step ``t``) fetches its slot's newest buffers at or before ``t`` and loads them
  into its replicas before its first forward. They are exact when they are of ``t`` itself (every
  resume from a checkpoint); a replacement that rejoins past its slot's last checkpoint gets that
  checkpoint's, and says so.

A model without buffers, or a job without checkpoints, does none of this.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import wire_dtype
from pstrain.worker.replicas import ReplicaSet

log = logging.getLogger(__name__)


class BuffersLink(Protocol):
    def upload_slot_buffers(self, step: int, buffers: dict[str, torch.Tensor], chunk_bytes: int) -> None: ...

    def fetch_slot_buffers(
        self, step: int, expected: Mapping[str, tuple[int, tuple[int, ...]]]
    ) -> tuple[int, dict[str, torch.Tensor]]: ...


class SlotBufferCheckpoints:
    def __init__(self, link: BuffersLink, replicas: ReplicaSet, job: pb.JobSpec) -> None:
        self._link = link
        self._replicas = replicas
        self._every = job.checkpoint_every_steps if job.checkpoint_dir else 0
        self._last = job.steps
        self._chunk_bytes = job.chunk_bytes
        self.exact = True  # False once this slot resumed from buffers of another step than its version

    @classmethod
    def of(cls, link: BuffersLink, replicas: ReplicaSet, job: pb.JobSpec) -> SlotBufferCheckpoints | None:
        """The slot's buffer checkpoints, or None when there is nothing to keep (no buffers, no checkpoints)."""
        has_buffers = next(replicas.replicas[0].model.buffers(), None) is not None
        if not has_buffers or job.checkpoint_every_steps <= 0 or not job.checkpoint_dir:
            return None
        return cls(link, replicas, job)

    def due(self, version: int) -> bool:
        return self._every > 0 and (version % self._every == 0 or version == self._last)

    def after_step(self, step: int) -> None:
        """Step ``step`` was pushed: version ``step + 1``'s buffers go up if it is a checkpoint."""
        if self.due(step + 1):
            self._link.upload_slot_buffers(step + 1, self._replicas.slot_buffers(), self._chunk_bytes)

    def restore(self, version: int) -> None:
        """Before the first forward at ``version``: load the slot's buffers back (nothing at version 0)."""
        if version <= 0:
            return
        expected = {name: (wire_dtype(b.dtype), tuple(b.shape)) for name, b in self._replicas.slot_buffers().items()}
        step, buffers = self._link.fetch_slot_buffers(version, expected)
        if step < 0:
            self.exact = False
            log.warning("no buffers of this slot at or before step %d: the replicas keep their initial ones", version)
            return
        if set(buffers) != set(expected):
            raise ValueError(f"the coordinator sent {len(buffers)} of the slot's {len(expected)} buffers")
        self._replicas.load_slot_buffers(buffers)
        self.exact = step == version
        if self.exact:
            log.info("loaded this slot's buffers of checkpoint %d", step)
        else:
            log.warning(
                "resuming at step %d with this slot's buffers of checkpoint %d: the parameters are exact, the "
                "buffers (BatchNorm statistics) miss the steps in between",
                version,
                step,
            )

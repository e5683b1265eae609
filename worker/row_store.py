"""One host's sparse rows for one step: pulled once, shared by every device (S5.1-S5.4).

Per step (``prepare``): every device's batch names its ids per table (the model's
``sparse_ids``); the host takes the union, pulls only those rows (one request per owning PS
shard) into **one** host-memory store per table, rows indexed by slot, with the sorted unique
ids as the id -> slot index (``searchsorted``). Each device then gets its own rows from the store
(gathered by slot, copied to the device) as a leaf tensor the ``SparseEmbedding`` layers of
that device's replica read.

After backward (``gradients``): each device's row gradients are added into one host sum per
table by slot, and each row's count is the number of devices in which the id occurred. That
sum and count per row is what the worker pushes (``push``); the PS divides the sum over all
workers by the total count (or the device count, per the table's ``averaging``).

Memory per host grows with the distinct rows a step touches (rows + gradient sums + counts),
not with the number of devices nor with the table size; the store is dropped after the push.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pstrain.nn import DeviceRows, check_model
from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.factories import FactoryError
from pstrain.runtime.numerics import all_finite
from pstrain.runtime.security import TransportSecurity
from pstrain.runtime.sparse_api import RowGrads, RowsAck, SparseRowsClient
from pstrain.runtime.sparse_rows import RowError, TableSpec, check_ids, init_rows

Retry = Callable[[str, Callable[[], object]], object]


@dataclass
class _TableStep:
    ids: torch.Tensor  # host's unique ids, ascending: the id -> slot index
    rows: torch.Tensor  # float32 [len(ids), dim]: the one host copy
    device_slots: list[torch.Tensor]  # per device: slots of that device's ids
    device_rows: list[DeviceRows | None]


class HostRowStore:
    """The host's rows of the current step; see the module docstring."""

    def __init__(
        self,
        client: SparseRowsClient,
        worker_id: int,
        tables: Sequence[TableSpec],
        models: Sequence[nn.Module],
        devices: Sequence[torch.device],
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.tables = {t.name: t for t in tables}
        self.models = list(models)
        self.devices = list(devices)
        self.layers = [check_model(m, self.tables) for m in self.models]
        self._step: dict[str, _TableStep] = {}
        self.rows_held = 0  # rows in the store this step (for memory figures and tests)
        self.peak_rows_held = 0

    # ------------------------------------------------------------------ before forward

    def prepare(self, step: int, inputs: Sequence[torch.Tensor], retrying: Retry | None = None) -> None:
        """Pull this step's rows for the whole host batch and bind every device's rows to its layers."""
        per_device = [self._ids_of(model, x) for model, x in zip(self.models, inputs, strict=True)]
        host_ids = {}
        for name in self.tables:
            parts = [d[name] for d in per_device if name in d]
            if parts:
                host_ids[name] = torch.unique(torch.cat(parts))
        if retrying is None:
            rows = self.client.pull_rows(step, host_ids)
        else:
            pulled: list[dict[str, torch.Tensor]] = []
            retrying("pull rows", lambda: pulled.append(self.client.pull_rows(step, host_ids)))
            rows = pulled[-1]
        self._step = {}
        for name, ids in host_ids.items():
            slots: list[torch.Tensor] = []
            bound: list[DeviceRows | None] = []
            for d, (device, ids_by_table) in enumerate(zip(self.devices, per_device, strict=True)):
                dev_ids = ids_by_table.get(name, torch.empty(0, dtype=torch.int64))
                dev_slots = torch.searchsorted(ids, dev_ids)  # the id -> slot index
                weight = rows[name][dev_slots].to(device).requires_grad_(True)
                rows_d = DeviceRows(dev_ids.to(device), weight)
                for layer in self.layers[d].get(name, []):
                    layer.rows = rows_d
                slots.append(dev_slots)
                bound.append(rows_d)
            self._step[name] = _TableStep(ids, rows[name], slots, bound)
        self.rows_held = sum(int(s.ids.numel()) for s in self._step.values())
        self.peak_rows_held = max(self.peak_rows_held, self.rows_held)

    def _ids_of(self, model: nn.Module, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """A device's unique ids per table, from the model's ``sparse_ids`` (checked against the tables)."""
        if not any(self.layers[0].values()):
            return {}
        declared = model.sparse_ids(inputs)  # type: ignore[operator]
        out = {}
        for name, ids in declared.items():
            spec = self.tables.get(name)
            if spec is None:
                raise FactoryError(f"sparse_ids() names table {name!r}, which the job file does not declare")
            if (
                not isinstance(ids, torch.Tensor)
                or ids.dtype.is_floating_point
                or ids.dtype.is_complex
                or ids.dtype == torch.bool
            ):
                kind = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
                raise FactoryError(f"sparse_ids() of table {name!r}: row ids must be an integer tensor, got {kind}")
            flat = ids.detach().reshape(-1).to("cpu", torch.int64)
            try:
                check_ids(flat, spec.rows, f"sparse_ids() of table {name!r}")
            except RowError as exc:
                raise FactoryError(str(exc)) from None
            out[name] = torch.unique(flat)
        return out

    # ------------------------------------------------------------------ after backward

    def gradients(self) -> dict[str, RowGrads]:
        """Per table: (ids, per-row gradient sums over this host's devices, devices in which each id occurred)."""
        out = {}
        for name, s in self._step.items():
            dim = self.tables[name].dim
            sums = torch.zeros(int(s.ids.numel()), dim, dtype=torch.float32)
            counts = torch.zeros(int(s.ids.numel()), dtype=torch.int32)
            for slots, rows_d in zip(s.device_slots, s.device_rows, strict=True):
                if rows_d is None or slots.numel() == 0:
                    continue
                grad = rows_d.weight.grad
                if grad is not None:
                    sums.index_put_((slots,), grad.detach().to("cpu", torch.float32), accumulate=True)  # device order
                counts[slots] += 1
            out[name] = (s.ids, sums, counts)
        return out

    def finite(self) -> bool:
        """Whether every device's row gradients are finite (a non-finite step is skipped or stops the job)."""
        return all(
            rows_d.weight.grad is None or all_finite(rows_d.weight.grad.detach().cpu())
            for s in self._step.values()
            for rows_d in s.device_rows
            if rows_d is not None
        )

    def push(self, step: int, skip: bool = False, retrying: Retry | None = None) -> None:
        """Push this host's row gradients of ``step`` to every shard (``skip``: complete it without an update)."""
        grads = None if skip else self.gradients()
        call = lambda: self.client.push_rows(self.worker_id, step, grads, len(self.devices))  # noqa: E731
        if retrying is None:
            call()
        else:
            retrying("push rows", call)
        self.release()

    def release(self) -> None:
        """Drop the step's rows (host and device copies) and unbind the layers."""
        for layers in self.layers:
            for group in layers.values():
                for layer in group:
                    layer.rows = None
        self._step = {}
        self.rows_held = 0


class SeededRows:
    """A ``SparseRowsClient`` with no PS: every row is its seeded initial value (``init_rows``), pushes are dropped.

    The probe (``worker/probe.py``) and the memory planner run the model before any PS shard
    serves; binding the batch's rows from the init, computed here, runs the sparse layers and the
    row store exactly as a training step does, so their memory is measured.
    """

    def __init__(self, tables: Sequence[TableSpec], shards: int = 1) -> None:
        self.tables = {t.name: t for t in tables}
        self.shards = shards

    def pull_rows(self, min_version: int, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: init_rows(self.tables[name], t) for name, t in ids.items()}

    def push_rows(
        self, worker_id: int, step: int, rows: Mapping[str, RowGrads] | None, device_count: int
    ) -> list[RowsAck]:
        return []

    def progress(self, worker_id: int) -> list[tuple[int, int]]:
        return [(0, -1)] * self.shards

    def close(self, cancel: bool = False) -> None:
        return None


def probe_row_store(
    job: pb.JobSpec, models: Sequence[nn.Module], devices: Sequence[torch.device]
) -> HostRowStore | None:
    """The probe's row store (rows from the seeded init, no PS) when the job declares tables; None otherwise."""
    if not job.embeddings:
        return None
    tables = [TableSpec.from_pb(t) for t in job.embeddings]
    return HostRowStore(SeededRows(tables), 0, tables, models, devices)


def rows_behind(client: SparseRowsClient, worker_id: int, dense_version: int) -> str:
    """Why the tables cannot go on at ``dense_version`` with a replacement of ``worker_id`` ("" when they can).

    The trainer pushes a step's dense buckets before its rows, so a worker killed between the two
    leaves the dense range at ``t + 1`` and the shards still missing its rows of ``t``: they stay at
    ``t`` forever (nobody will push them), and the replacement's pull of rows at ``t + 1`` would wait
    for nothing. The replacement reports that as inconsistent, and the coordinator rolls the job back
    to its checkpoint. A shard behind only because a live peer has not pushed its rows of ``t`` yet
    (it holds this worker's) is fine: that peer's push completes it.
    """
    problems = []
    for shard, (version, worker_step) in enumerate(client.progress(worker_id)):
        if version == dense_version or (version == dense_version - 1 and worker_step == version):
            continue
        problems.append(
            f"sparse shard {shard} is at version {version} (worker {worker_id} last pushed rows for step "
            f"{worker_step}) while the dense shards are at {dense_version}"
        )
    if not problems:
        return ""
    return "; ".join(problems) + ": the worker died between its dense and its row push"


def host_row_store(
    job: pb.JobSpec,
    addresses: Sequence[str],
    worker_id: int,
    models: Sequence[nn.Module],
    devices: Sequence[torch.device],
    security: TransportSecurity,
) -> HostRowStore | None:
    """The worker's row store over gRPC when the job declares sparse tables; None otherwise."""
    if not job.embeddings:
        return None
    from pstrain.runtime.sparse_client import SparseClient  # gRPC only where a job has tables

    tables = [TableSpec.from_pb(t) for t in job.embeddings]
    client = SparseClient(list(addresses), tables, job.push_timeout_s, job.pull_timeout_s, security)
    return HostRowStore(client, worker_id, tables, models, devices)


def rejoin_rows_check(
    job: pb.JobSpec, addresses: Sequence[str], worker_id: int, security: TransportSecurity
) -> Callable[[int], str] | None:
    """For a replacement's rejoin (S2.5): ``rows_behind`` over gRPC at a dense version; None without tables."""
    if not job.embeddings:
        return None

    def check(dense_version: int) -> str:
        from pstrain.runtime.sparse_client import SparseClient

        client = SparseClient(list(addresses), [TableSpec.from_pb(t) for t in job.embeddings], security=security)
        try:
            return rows_behind(client, worker_id, dense_version)
        finally:
            client.close()

    return check

"""``SparseEmbedding``: an ``nn.EmbeddingBag``-like layer whose rows live on the PS, not in the model (S5).

A model factory uses it like the torch layer, naming a table the job file declares::

    class Ctr(nn.Module):
        def __init__(self):
            super().__init__()
            self.user = SparseEmbedding("user", 1_000_000, 16)          # sum pooling by default
            self.mlp = nn.Sequential(nn.Linear(16, 1))

        def sparse_ids(self, inputs):              # which ids of the batch each table looks up
            return {"user": inputs[:, 0]}

        def forward(self, inputs):
            return self.mlp(self.user(inputs[:, :1])).squeeze(1)

The layer holds **no parameter** and allocates no table: its rows are not part of the dense flat
vector (``ParamLayout`` only sees parameters), and building the model on every device costs
nothing per table row. During training the worker's row store (``worker/row_store.py``) binds,
before each forward, the rows this device's batch needs (a leaf tensor whose ``.grad`` the store
collects after backward). ``sparse_ids(inputs)`` is how the worker learns those ids before the
forward runs: a model with sparse layers must define it.

Outside training (evaluation, the exported ``model.pt``) the layer reads ``weight``, the whole
table, which ``load_state_dict`` fills from ``<prefix>weight`` (any row count up to the declared
one) or ``load_sparse_tables`` from a table directory.

Modes: ``"sum"`` / ``"mean"`` pool bags (``input`` 2-D: one bag per row; 1-D with ``offsets``),
``None`` is a plain lookup (``nn.Embedding``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pstrain.runtime.factories import FactoryError
from pstrain.runtime.sparse_rows import TableSpec, check_ids, init_rows

Pooling = Literal["sum", "mean"] | None


class SparseModel(Protocol):
    """What a model with ``SparseEmbedding`` layers adds: the ids of a batch, per table, before forward."""

    def sparse_ids(self, inputs: torch.Tensor) -> Mapping[str, torch.Tensor]: ...


@dataclass
class DeviceRows:
    """One device's rows of one table for one step: sorted unique ids and their rows (a grad-requiring leaf)."""

    ids: torch.Tensor  # int64 [n], ascending, on the device
    weight: torch.Tensor  # float32 [n, dim], on the device, requires_grad
    planning: bool = False  # bound by the memory planner: the layer shows its rows as a saved tensor

    def local(self, input: torch.Tensor, table: str) -> torch.Tensor:
        """``input``'s ids as positions in ``weight``; an id the batch did not declare is an error."""
        n = int(self.ids.numel())
        if input.numel() == 0:
            return input.to(torch.int64)
        if n == 0:
            raise RuntimeError(f"SparseEmbedding {table!r}: sparse_ids() declared no ids for this batch")
        pos = torch.searchsorted(self.ids, input.to(torch.int64).contiguous()).clamp_(max=n - 1)
        if not bool((self.ids[pos] == input).all()):
            raise RuntimeError(
                f"SparseEmbedding {table!r} looked up ids that the model's sparse_ids() did not return for this batch"
            )
        return pos


class SparseEmbedding(nn.Module):
    def __init__(self, table: str, num_embeddings: int, embedding_dim: int, mode: Pooling = "sum") -> None:
        super().__init__()
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(f"a table needs rows and a dimension, got {num_embeddings} x {embedding_dim}")
        if mode not in ("sum", "mean", None):
            raise ValueError(f"mode must be 'sum', 'mean' or None, got {mode!r}")
        self.table = table
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.weight = torch.empty(0, embedding_dim)  # the whole table, once loaded (not a parameter)
        self.rows: DeviceRows | None = None  # bound by the worker's row store for one step

    def extra_repr(self) -> str:
        return f"{self.table!r}, {self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}"

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.rows is not None:
            weight, index = self.rows.weight, self.rows.local(input, self.table)
            if self.rows.planning:
                weight = _HeldRows.apply(weight)
        else:
            if self.weight.shape[0] == 0:
                raise RuntimeError(
                    f"SparseEmbedding {self.table!r} has no rows here: train it with pstrain, or load the exported "
                    f"model.pt (load_state_dict) or table directory (load_sparse_tables)"
                )
            weight, index = self.weight.to(input.device), input
        if self.mode is None:
            return F.embedding(index, weight)
        return F.embedding_bag(index, weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights)

    # ------------------------------------------------------------------ state_dict: the table, when loaded

    def _apply(self, fn: Any, recurse: bool = True) -> SparseEmbedding:  # type: ignore[override]
        super()._apply(fn, recurse)
        self.weight = fn(self.weight)
        return self

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight.shape[0]:
            destination[prefix + "weight"] = self.weight if keep_vars else self.weight.detach()

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + "weight"
        if key in state_dict:
            value = state_dict[key]
            if value.dim() != 2 or value.shape[1] != self.embedding_dim or value.shape[0] > self.num_embeddings:
                error_msgs.append(
                    f"{key}: table {self.table!r} is {self.num_embeddings} x {self.embedding_dim}, "
                    f"got {tuple(value.shape)}"
                )
            else:
                self.weight = value.detach().to(torch.float32)  # no copy: a table may take most of the host
        super()._load_from_state_dict(
            {k: v for k, v in state_dict.items() if k != key},
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )


class _HeldRows(torch.autograd.Function):
    """Identity that saves its input for backward, so the planner's saved-tensor profile (``planner/profiler.py``)
    counts a step's device rows in this layer: they live from the bind to the end of backward, growing with the
    batch as activations do (the embedding ops themselves save only indices)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(weight)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def sparse_layers(model: nn.Module) -> Iterator[tuple[str, SparseEmbedding]]:
    """Every ``SparseEmbedding`` of ``model`` with its module path."""
    for name, module in model.named_modules():
        if isinstance(module, SparseEmbedding):
            yield name, module


def load_sparse_tables(model: nn.Module, directory: str | Path) -> None:
    """Fill every ``SparseEmbedding`` of ``model`` from an exported table directory (``tables/<name>.pt``).

    Each file holds a table's spec and the rows training touched; the other rows get their
    initial values (the same function the PS shards use), so the result equals the trained table.
    """
    from pstrain.runtime.sparse_rows import TableSpec, init_rows

    for _, layer in sparse_layers(model):
        payload = torch.load(Path(directory) / f"{layer.table}.pt", map_location="cpu", weights_only=True)
        spec = TableSpec(**payload["spec"])
        if (spec.rows, spec.dim) != (layer.num_embeddings, layer.embedding_dim):
            raise ValueError(f"table {layer.table!r} in {directory} is {spec.rows} x {spec.dim}, the layer's differs")
        weight = init_rows(spec, torch.arange(spec.rows, dtype=torch.int64))
        weight[payload["ids"]] = payload["rows"]
        layer.weight = weight


def check_model(model: nn.Module, tables: Mapping[str, TableSpec]) -> dict[str, list[SparseEmbedding]]:
    """The model's sparse layers by table; ``FactoryError`` when they do not match the job's tables."""
    layers: dict[str, list[SparseEmbedding]] = {}
    for path, layer in sparse_layers(model):
        spec = tables.get(layer.table)
        if spec is None:
            raise FactoryError(
                f"SparseEmbedding {path!r} uses table {layer.table!r}, which the job file's embeddings section "
                f"does not declare ({', '.join(sorted(tables)) or 'none declared'})"
            )
        if (spec.rows, spec.dim) != (layer.num_embeddings, layer.embedding_dim):
            raise FactoryError(
                f"SparseEmbedding {path!r} is {layer.num_embeddings} x {layer.embedding_dim}; embeddings."
                f"{layer.table} declares {spec.rows} x {spec.dim}"
            )
        layers.setdefault(layer.table, []).append(layer)
    if layers and not callable(getattr(model, "sparse_ids", None)):
        raise FactoryError(
            f"{type(model).__name__} has SparseEmbedding layers but no sparse_ids(inputs) method naming each "
            f"table's ids of a batch"
        )
    return layers


@contextmanager
def seeded_rows(model: nn.Module, tables: Sequence[TableSpec]) -> Iterator[None]:
    """While open, every forward of ``model`` first binds its batch's rows from the seeded init (the memory
    planner's profile runs the model on the coordinator, with no PS); the layers show the rows as saved tensors."""
    by_name = {t.name: t for t in tables}
    layers = check_model(model, by_name)
    if not any(layers.values()):
        yield
        return

    def bind(module: nn.Module, args: tuple[object, ...]) -> None:
        inputs = args[0]
        assert isinstance(inputs, torch.Tensor)
        for name, ids in module.sparse_ids(inputs).items():  # type: ignore[operator]
            unique = torch.unique(ids.detach().reshape(-1).to("cpu", torch.int64))
            check_ids(unique, by_name[name].rows, f"sparse_ids() of table {name!r}")
            weight = init_rows(by_name[name], unique).to(inputs.device).requires_grad_(True)
            for layer in layers.get(name, []):
                layer.rows = DeviceRows(unique.to(inputs.device), weight, planning=True)

    handle = model.register_forward_pre_hook(bind)
    try:
        yield
    finally:
        handle.remove()
        for group in layers.values():
            for layer in group:
                layer.rows = None

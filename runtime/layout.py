"""The flat float32 parameter vector: which parameter lives where, in one place.

Every service sees the model as one vector: the PS shards own contiguous ranges of it, the
worker pushes and pulls it, the coordinator seeds and exports it. ``ParamLayout`` is the one
object that maps that vector to the model's parameters (``named_parameters()`` order, shared
parameters once), so flattening, copying back, binding views and slicing per PS shard cannot
drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from pstrain.runtime.factories import FactoryError
from pstrain.runtime.shard_map import ShardRange, shard_ranges


class LayoutError(FactoryError):
    """A model that does not fit the layout: a parameter pstrain cannot train, or a different model.

    A ``FactoryError`` because the cause is always what a model factory built.
    """


@dataclass(frozen=True)
class ParamLayout:
    """Where each named parameter lives in the flat float32 vector (named_parameters order)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    total: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ParamLayout:
        """The layout of ``model``; every parameter must be float32 (the wire and the PS are) and require a gradient
        (a frozen one would be pushed with a zero gradient and still moved by the PS: weight decay, momentum)."""
        names, shapes = [], []
        for name, param in model.named_parameters():
            if param.dtype != torch.float32:
                raise LayoutError(f"parameter {name!r} is {param.dtype}; pstrain trains float32 parameters")
            refuse_frozen(name, param)
            names.append(name)
            shapes.append(tuple(param.shape))
        return cls.from_shapes(names, shapes)

    @classmethod
    def from_shapes(cls, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> ParamLayout:
        """The layout a job spec describes (names and shapes in order), without building the model."""
        if len(names) != len(shapes):
            raise ValueError(f"{len(names)} names but {len(shapes)} shapes")
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += math.prod(shape)
        return cls(tuple(names), tuple(tuple(int(d) for d in s) for s in shapes), tuple(offsets), total)

    # ------------------------------------------------------------------ checks

    def check_matches(self, model: torch.nn.Module) -> None:
        """Raise ``LayoutError`` naming the first parameter where ``model`` differs from this layout.

        A worker calls it on the model its own host's factory builds: a different version of the
        user's code would otherwise train garbage silently.
        """
        self._parameters(model)

    def _parameters(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        named = list(model.named_parameters())
        if len(named) != len(self.names):
            raise LayoutError(f"the model has {len(named)} parameters, the layout {len(self.names)}")
        for i, ((name, param), want_name, want_shape) in enumerate(zip(named, self.names, self.shapes, strict=True)):
            if name != want_name or tuple(param.shape) != want_shape:
                raise LayoutError(
                    f"parameter {i} is {name!r} {tuple(param.shape)}, the layout expects {want_name!r} {want_shape}"
                )
            if param.dtype != torch.float32:
                raise LayoutError(f"parameter {name!r} is {param.dtype}; pstrain trains float32 parameters")
        return [param for _, param in named]

    def _check_flat(self, flat: torch.Tensor, what: str) -> None:
        if flat.dim() != 1 or flat.numel() != self.total:
            raise ValueError(f"{what} has shape {tuple(flat.shape)}, the layout needs ({self.total},)")

    # ------------------------------------------------------------------ model <-> flat

    def _spans(self) -> Iterator[tuple[int, int, tuple[int, ...]]]:
        for offset, shape in zip(self.offsets, self.shapes, strict=True):
            yield offset, math.prod(shape), shape

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's piece of ``flat``, shaped like the parameter; views, not copies."""
        self._check_flat(flat, "flat vector")
        return [flat[offset : offset + n].view(shape) for offset, n, shape in self._spans()]

    def flatten(self, model: torch.nn.Module) -> torch.Tensor:
        """A new CPU vector holding ``model``'s parameters in layout order."""
        params = [p.detach().reshape(-1).cpu() for p in self._parameters(model)]
        return torch.cat(params) if params else torch.empty(0)

    def unflatten_into(self, model: torch.nn.Module, flat: torch.Tensor) -> None:
        """Copy ``flat`` into ``model``'s parameters in place (the inverse of ``flatten``)."""
        params = self._parameters(model)
        with torch.no_grad():
            for param, view in zip(params, self.views(flat), strict=True):
                param.copy_(view)

    def bind(self, model: torch.nn.Module, flat_params: torch.Tensor, flat_grads: torch.Tensor) -> None:
        """Make every parameter and its ``.grad`` views into ``flat_params`` and ``flat_grads``.

        The current values are copied into ``flat_params`` first. Afterwards one copy of a flat
        buffer moves the whole model (load new parameters, ship the gradient), and backward
        accumulates straight into ``flat_grads``. Both buffers must be on the model's device.
        """
        params = self._parameters(model)
        for param, value, grad in zip(params, self.views(flat_params), self.views(flat_grads), strict=True):
            value.copy_(param.detach())
            param.data = value
            param.grad = grad

    def rebind_grads(self, model: torch.nn.Module, flat_grads: torch.Tensor) -> None:
        """Put back any ``.grad`` that is no longer a view into ``flat_grads``, keeping its values.

        Autograd accumulates into the bound views in place; a hook or ``zero_grad(set_to_none)``
        may replace or drop one. Called every step, so it trusts ``bind``'s check of the model.
        """
        base, size = flat_grads.data_ptr(), flat_grads.element_size()
        for param, (offset, n, _) in zip(model.parameters(), self._spans(), strict=True):
            grad = param.grad
            if grad is not None and grad.data_ptr() == base + offset * size:
                continue  # still its view: no view made per parameter and step
            view = flat_grads[offset : offset + n]
            if grad is not None:
                view.copy_(grad.reshape(-1))
            param.grad = view.view(param.shape)

    # ------------------------------------------------------------------ PS shards

    def shard_ranges(self, num_shards: int) -> list[ShardRange]:
        """The PS shards' ranges of this layout's vector (``runtime.shard_map``, the one split)."""
        return shard_ranges(self.total, num_shards)

    def shard_slices(self, flat: torch.Tensor, num_shards: int) -> list[torch.Tensor]:
        """Each PS shard's piece of ``flat``, as views in shard order."""
        self._check_flat(flat, "flat vector")
        return [flat[r.start : r.end] for r in self.shard_ranges(num_shards)]


def refuse_frozen(name: str, param: torch.nn.Parameter) -> None:
    """``LayoutError`` for a parameter with ``requires_grad=False``: pstrain trains every parameter of the model."""
    if not param.requires_grad:
        raise LayoutError(
            f"parameter {name!r} does not require a gradient: pstrain trains every parameter of the model, so a "
            "frozen tensor must be a buffer (register_buffer), not a Parameter"
        )

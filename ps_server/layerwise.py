"""Layer-wise optimizers on a shard's slice: LARS (You et al. 2017) and LAMB (You et al. 2019).

Both scale each parameter tensor's ("layer's") step by a trust ratio of two norms over the WHOLE
tensor. A shard holds a contiguous slice of the flat vector, so it needs two things an
elementwise optimizer does not:

* the parameter boundaries inside its slice (``Segment``s), computed from the job spec's
  parameter shapes and the shard's range (``segments_for``), and
* for a parameter that straddles a shard boundary, the other holders' partial squared norms.

Design of the norm exchange (``NormCombiner``). Each shard computes, per segment, its partial
squared norms (LARS: ||w||^2, ||g||^2; LAMB: ||w||^2, ||r + wd w||^2) in float64 over its own
piece. For a segment that is the whole parameter there is nothing to exchange. For a shared one
the shard posts its partials to every other holder and waits for theirs; every holder then adds
the partials **in shard-id order**, so all holders compute bit-identical totals and apply the
same trust ratio, and the result equals the unsharded optimizer up to the float64 summation
order of the squared norms (~1e-16 relative; the tests hold it to 1e-5 over 5 steps).

Why post-and-wait among holders rather than through the coordinator or the workers: the
exchange is a few doubles per straddling parameter (at most ``ps_shards - 1`` of them), it is
needed in the middle of the update when every holder is already updating the same step (the
workers pushed to all shards), and a post only deposits into the receiver's ``NormBoard`` and
returns, so two shards posting to each other cannot deadlock. The coordinator stays off the data
path and the worker's push/pull protocol is unchanged. Partials are keyed by (step, parameter),
so a shard that updates its slice in several pieces exchanges per piece with no confusion.
In-process (tests, ``LocalPsClient``) the post is a method call (``InProcessExchange``);
between processes it is the ``LayerNorms.PostNorms`` RPC (``pstrain.ps_server.norm_service``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from pstrain.ps_server.errors import InvalidArgument, WaitTimeout
from pstrain.runtime.shard_map import shard_ranges

DEFAULT_EXCHANGE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Segment:
    """One parameter's piece of a shard's slice; ``start``/``end`` are offsets into the slice."""

    index: int  # the parameter's index in the layout (JobSpec.params order)
    start: int
    end: int
    holders: tuple[int, ...] = ()  # shard ids holding a piece of this parameter, ascending
    one_d: bool = False  # a 1-D tensor (bias, norm scale): with ``exclude_1d`` no trust ratio, no weight decay

    @property
    def shared(self) -> bool:
        return len(self.holders) > 1


def segments_for(
    sizes: Sequence[int], num_shards: int, shard_id: int, one_d: Sequence[bool] = ()
) -> tuple[Segment, ...]:
    """The parameter segments of shard ``shard_id``'s range, with every parameter's holders.

    ``sizes`` are the parameters' element counts in layout order; the ranges are the one split
    every service uses (``runtime.shard_map``). ``one_d[i]``: parameter ``i`` is a 1-D tensor.
    """
    ranges = shard_ranges(sum(sizes), num_shards)
    mine = ranges[shard_id]
    segments = []
    offset = 0
    for index, size in enumerate(sizes):
        lo, hi = max(offset, mine.start), min(offset + size, mine.end)
        if lo < hi:
            holders = tuple(r.shard_id for r in ranges if max(offset, r.start) < min(offset + size, r.end))
            flat = bool(one_d[index]) if one_d else False
            segments.append(Segment(index, lo - mine.start, hi - mine.start, holders, flat))
        offset += size
    return tuple(segments)


def restrict(segments: Sequence[Segment], start: int, end: int) -> tuple[Segment, ...]:
    """The segments inside ``[start, end)`` of the slice, re-based to it: for a shard that updates a piece.

    A piece must not cut a parameter (pieces are built from whole parameters); a cut one raises.
    """
    out = []
    for s in segments:
        if s.end <= start or s.start >= end:
            continue
        if s.start < start or s.end > end:
            raise InvalidArgument(f"piece [{start}, {end}) cuts parameter {s.index} at [{s.start}, {s.end})")
        out.append(replace(s, start=s.start - start, end=s.end - start))
    return tuple(out)


class NormCombiner(Protocol):
    """Totals of partial squared norms over every holder of each shared parameter."""

    def combine(self, step: int, partials: dict[int, Sequence[float]], segments: Sequence[Segment]) -> None:
        """Post this shard's ``partials`` (parameter index -> values) of the shared ``segments`` to the other
        holders, wait for theirs, and replace each shared entry of ``partials`` by the total (shard-id order)."""
        ...


@dataclass
class NormBoard:
    """A shard's mailbox of partial norms posted by its peers, keyed by (step, parameter, sender)."""

    timeout_s: float = DEFAULT_EXCHANGE_TIMEOUT_S
    clock: Callable[[], float] = time.monotonic
    _posted: dict[tuple[int, int, int], tuple[float, ...]] = field(default_factory=dict)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def deposit(self, step: int, sender: int, partials: Mapping[int, Sequence[float]]) -> None:
        with self._cond:
            for index, values in partials.items():
                self._posted[(step, index, sender)] = tuple(values)
            self._cond.notify_all()

    def take(self, step: int, wanted: Sequence[tuple[int, int]]) -> dict[tuple[int, int], tuple[float, ...]]:
        """Wait for every (parameter, sender) in ``wanted`` at ``step``; remove and return them."""
        deadline = self.clock() + self.timeout_s
        with self._cond:
            while True:
                missing = [(i, s) for i, s in wanted if (step, i, s) not in self._posted]
                if not missing:
                    return {(i, s): self._posted.pop((step, i, s)) for i, s in wanted}
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise WaitTimeout(
                        f"step {step}: partial norms of (parameter, shard) {missing} did not arrive within "
                        f"{self.timeout_s:.0f}s; is every PS shard of the job running?"
                    )
                self._cond.wait(remaining)


Poster = Callable[[int, int, int, Mapping[int, Sequence[float]]], None]
"""``post(to_shard, from_shard, step, partials)``: deliver partials to a peer's board (must not block on it)."""


@dataclass
class BoardCombiner:
    """The exchange for one shard: post own partials to each peer via ``post``, take theirs from ``board``."""

    shard_id: int
    board: NormBoard
    post: Poster

    def combine(self, step: int, partials: dict[int, Sequence[float]], segments: Sequence[Segment]) -> None:
        shared = [s for s in segments if s.shared]
        if not shared:
            return
        by_peer: dict[int, dict[int, Sequence[float]]] = {}
        for s in shared:
            for peer in s.holders:
                if peer != self.shard_id:
                    by_peer.setdefault(peer, {})[s.index] = partials[s.index]
        for peer, mine in sorted(by_peer.items()):
            self.post(peer, self.shard_id, step, mine)
        wanted = [(s.index, peer) for s in shared for peer in s.holders if peer != self.shard_id]
        theirs = self.board.take(step, wanted)
        for s in shared:
            values = [partials[s.index] if h == self.shard_id else theirs[(s.index, h)] for h in s.holders]
            partials[s.index] = [_ordered_sum(values, k) for k in range(len(values[0]))]


def _ordered_sum(values: Sequence[Sequence[float]], k: int) -> float:
    """Left-to-right in shard-id order: every holder adds the same numbers in the same order."""
    total = 0.0
    for v in values:
        total += float(v[k])
    return total


class SoloCombiner:
    """A shard holding every parameter whole (or a one-shard job): nothing to exchange."""

    def combine(self, step: int, partials: dict[int, Sequence[float]], segments: Sequence[Segment]) -> None:
        shared = [s.index for s in segments if s.shared]
        if shared:
            raise InvalidArgument(f"parameters {shared} are split across shards but this shard has no norm exchange")


class InProcessExchange:
    """Boards of all shards in one process (tests, the in-memory path): a post is a deposit."""

    def __init__(self, num_shards: int, timeout_s: float = DEFAULT_EXCHANGE_TIMEOUT_S) -> None:
        self.boards = [NormBoard(timeout_s) for _ in range(num_shards)]

    def _post(self, to_shard: int, from_shard: int, step: int, partials: Mapping[int, Sequence[float]]) -> None:
        self.boards[to_shard].deposit(step, from_shard, partials)

    def combiner(self, shard_id: int) -> BoardCombiner:
        return BoardCombiner(shard_id, self.boards[shard_id], self._post)


@dataclass(frozen=True)
class Layers:
    """What a shard hands a layer-wise optimizer: its segments and how to complete shared norms."""

    segments: tuple[Segment, ...]
    norms: NormCombiner

    def restrict(self, start: int, end: int) -> Layers:
        return Layers(restrict(self.segments, start, end), self.norms)


def _sq_norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2


def _trust(numerator: float, denominator: float) -> float:
    """numerator / denominator, or 1 when either is zero (a fresh zero tensor, a zero gradient)."""
    return numerator / denominator if numerator > 0 and denominator > 0 else 1.0


class LayerwiseOptimizer(torch.optim.Optimizer):
    """LARS or LAMB over one flat Parameter whose ``segments`` are parameter tensors (or pieces of them).

    Not fused: ``step_on_mean`` divides the device sum before the step. The step count lives in
    the state (``step``) and keys the norm exchange, so shards restored from one checkpoint agree.
    """

    def __init__(self, param: torch.nn.Parameter, lr: float, kind: str, options: Mapping[str, Any], layers: Layers):
        if kind not in ("lars", "lamb"):
            raise InvalidArgument(f"{kind!r} is not a layer-wise optimizer")
        covered = sum(s.end - s.start for s in layers.segments)
        if covered != param.numel():
            raise InvalidArgument(f"segments cover {covered} of the slice's {param.numel()} elements")
        defaults: dict[str, Any] = {
            "lr": lr,
            "weight_decay": float(options["weight_decay"]),
            "exclude_1d": bool(options.get("exclude_1d", True)),
        }
        if kind == "lars":
            defaults |= {
                "momentum": float(options["momentum"]),
                "trust_coefficient": float(options["trust_coefficient"]),
            }
        else:
            beta1, beta2 = options["betas"]
            defaults |= {"betas": (float(beta1), float(beta2)), "eps": float(options["eps"])}
        super().__init__([param], defaults)
        self.kind = kind
        self.layers = layers
        # Entered around the wait for the peers' partial norms. The shard that steps this optimizer sets it to
        # release its lock meanwhile (``ParameterShard._outside_lock``): the peers finish their part only
        # once their own step is complete, which may take a replacement worker's pushes (S2.5).
        self.while_waiting: Callable[[], AbstractContextManager[None]] = nullcontext

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        group = self.param_groups[0]
        (param,) = group["params"]
        if param.grad is None:
            return
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            if self.kind == "lars":
                state["momentum_buffer"] = torch.zeros_like(param)
            else:
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        step = int(state["step"].item())
        if self.kind == "lars":
            self._lars(param, param.grad, state, group, step)
        else:
            self._lamb(param, param.grad, state, group, step)

    @staticmethod
    def _excluded(segment: Segment, group: dict[str, Any]) -> bool:
        return segment.one_d and bool(group["exclude_1d"])

    def _norms(self, step: int, pairs: list[tuple[Segment, torch.Tensor, torch.Tensor]]) -> dict[int, Sequence[float]]:
        partials: dict[int, Sequence[float]] = {s.index: (_sq_norm(a), _sq_norm(b)) for s, a, b in pairs}
        if any(s.shared for s in self.layers.segments):
            with self.while_waiting():
                self.layers.norms.combine(step, partials, self.layers.segments)
        return partials

    def _lars(self, w: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any], step: int) -> None:
        """v = m v + lr * trust * (g + wd w);  w -= v;  trust = eta ||w|| / (||g|| + wd ||w||).

        An excluded (1-D) segment takes v = m v + lr * g: trust 1, no weight decay."""
        wd, momentum, eta, lr = group["weight_decay"], group["momentum"], group["trust_coefficient"], group["lr"]
        norms = self._norms(step, [(s, w[s.start : s.end], g[s.start : s.end]) for s in self.layers.segments])
        direction = g.add(w, alpha=wd) if wd else g.clone()
        for s in self.layers.segments:
            if self._excluded(s, group):
                direction[s.start : s.end].copy_(g[s.start : s.end]).mul_(lr)
                continue
            w_norm, g_norm = math.sqrt(norms[s.index][0]), math.sqrt(norms[s.index][1])
            # A zero gradient takes trust 1 (as a zero tensor does), not eta / wd: the denominator alone is not zero.
            trust = _trust(eta * w_norm, g_norm + wd * w_norm) if g_norm > 0 else 1.0
            direction[s.start : s.end].mul_(lr * trust)
        buf = state["momentum_buffer"]
        if step == 1:
            buf.copy_(direction)
        else:
            buf.mul_(momentum).add_(direction)
        w.sub_(buf)

    def _lamb(self, w: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any], step: int) -> None:
        """m, v as Adam; r = m^ / (sqrt(v^) + eps); u = r + wd w;  w -= lr * ||w|| / ||u|| * u."""
        (beta1, beta2), eps, wd, lr = group["betas"], group["eps"], group["weight_decay"], group["lr"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        m_hat = m / (1 - beta1**step)
        v_hat = v / (1 - beta2**step)
        update = m_hat.div_(v_hat.sqrt_().add_(eps))
        if wd:
            for s in self.layers.segments:
                if not self._excluded(s, group):  # an excluded (1-D) segment: Adam's step, no decay, trust 1
                    update[s.start : s.end].add_(w[s.start : s.end], alpha=wd)
        norms = self._norms(step, [(s, w[s.start : s.end], update[s.start : s.end]) for s in self.layers.segments])
        for s in self.layers.segments:
            if self._excluded(s, group):
                update[s.start : s.end].mul_(lr)
                continue
            trust = _trust(math.sqrt(norms[s.index][0]), math.sqrt(norms[s.index][1]))
            update[s.start : s.end].mul_(lr * trust)
        w.sub_(update)


def build_layerwise(
    param: torch.nn.Parameter, kind: str, lr: float, options: Mapping[str, Any], layers: Layers | None
) -> LayerwiseOptimizer:
    if layers is None:
        raise InvalidArgument(f"{kind} is layer-wise: the shard must be given its parameter segments (Layers)")
    return LayerwiseOptimizer(param, lr, kind, options, layers)

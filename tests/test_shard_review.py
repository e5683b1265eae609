"""Review of the shard's sync protocol (S4): the regressions found there, each against the real objects."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos.codec import EncodedReplies
from pstrain.ps_server import versions
from pstrain.ps_server.shard import ParameterShard

SGD = pb.OptimizerSpec(name="sgd", momentum=0.9)
LR = pb.LrSchedule(base_lr=0.1, scaled_lr=0.1)


class _LateDemand(threading.Event):
    """A follower's demand event whose next idle wait that times out first runs ``on_timeout``.

    The window it opens is microseconds wide in production (between the idle wait timing out and the follower
    looking at its demand again); this holds it open so that a pull lands in it every time."""

    def __init__(self) -> None:
        super().__init__()
        self.on_timeout: Callable[[], None] | None = None

    def wait(self, timeout: float | None = None) -> bool:
        got = super().wait(timeout)
        hook, self.on_timeout = self.on_timeout, None
        if not got and hook is not None:
            hook()
        return got


def test_a_pull_that_comes_as_the_idle_follower_looks_again_gets_the_version_that_is_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, the follower left idling without saying so: the pull waited for a version read after it asked, the
    follower waited for the next version, which the pull's own worker had yet to push. The pull timed out ("version 0
    did not appear") with the shard at version 0, and so did every later pull of the version the shard was at."""
    monkeypatch.setattr(versions, "FOLLOW_POLL_S", 0.05)
    shard = ParameterShard(0, 0, 4, torch.zeros(4), SGD, LR, 1)
    threads_before = set(threading.enumerate())

    async def scenario() -> list[int]:
        loop = asyncio.get_running_loop()
        follower = versions.VersionFollower(shard, 1 << 20, loop)
        assert (await follower.get(0, 5)).version == 0  # then nobody asks: the follower idles
        demand = _LateDemand()
        follower._demand = demand
        late: list[Future[EncodedReplies]] = []

        def pull_as_the_wait_times_out() -> None:  # on the follower's thread, as its idle wait times out
            late.append(asyncio.run_coroutine_threadsafe(follower.get(0, 2), loop))
            assert follower.wait_until_waiting(1, 5), "the late pull never started waiting"

        demand.on_timeout = pull_as_the_wait_times_out
        got = [(await asyncio.wait_for(_first(late), 5)).version]
        got.append((await follower.get(0, 2)).version)  # the next pull of the version the shard is at, too
        return got

    try:
        assert asyncio.run(scenario()) == [0, 0]
    finally:
        shard.close()  # the follower's thread sees it (or the closed loop) and ends
        for thread in set(threading.enumerate()) - threads_before:
            if thread.name == "shard-0-0-versions":
                thread.join(5)
                assert not thread.is_alive(), "the follower's thread outlived its loop and shard"


async def _first(futures: list[Future[EncodedReplies]]) -> EncodedReplies:
    """The first future once another thread has added one, awaited on this loop."""
    while not futures:
        await asyncio.sleep(0.005)
    return await asyncio.wrap_future(futures[0])


ADAM = pb.OptimizerSpec(name="adam", beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def test_concurrent_piece_pushes_skips_and_retries_equal_torch_adam_bit_for_bit() -> None:
    """A guard for the protocol as it stands: three workers push three pieces each step in their own random order
    (payloads adopted, lent, or copied; some retried at once; one worker sometimes skipping) while a reader follows
    the whole shard. The result and Adam's step count are torch.optim's, bit for bit.

    Pieces are cut at multiples of 64 elements: torch's fused kernels round an element in a vector lane and in the
    scalar tail differently, so only pieces cut on lane boundaries step exactly as the whole vector does."""
    from pstrain.ps_server.data_plane import StagingPool
    from pstrain.ps_server.pieces import PiecedShard
    from pstrain.runtime.shard_map import ShardRange

    workers, steps, edges = 3, 30, (0, 64, 192, 256)
    ranges = [ShardRange(0, a, b) for a, b in zip(edges, edges[1:], strict=False)]
    gen = torch.Generator().manual_seed(0)
    initial = torch.randn(edges[-1], generator=gen)
    grads = torch.randn(steps, workers, edges[-1], generator=gen)
    skipper = {t: t % workers for t in range(steps) if t % 7 == 3}  # who skips step t
    shard = PiecedShard.build(ranges, initial, ADAM, pb.LrSchedule(base_lr=0.01, scaled_lr=0.01), workers)
    pool, errors = StagingPool(), []

    def push_piece(w: int, t: int, r: ShardRange, how: int) -> None:
        payload = grads[t, w, r.start : r.end]
        if how == 0:  # received into a staging buffer the shard may adopt
            buf, adopted = pool.acquire(r.end - r.start), []
            buf.copy_(payload)
            shard.push(w, t, buf, 1, piece_start=r.start, recycle=adopted.append)
            pool.release(adopted[0] if adopted else buf)
        elif how == 1:  # a push region lent for the call, written again afterwards
            region = payload.clone()
            shard.push(w, t, region, 1, piece_start=r.start, lent=True)
            region.fill_(float("nan"))
        else:  # copied, then retried: a duplicate
            for _ in range(2):
                shard.push(w, t, payload.clone(), 1, piece_start=r.start)

    def worker(w: int) -> None:
        order = torch.Generator().manual_seed(10 + w)
        try:
            for t in range(steps):
                with shard.read(t, 10):
                    pass
                if skipper.get(t) == w:
                    shard.push(w, t, None, 1, skip=True)
                    continue
                for i in torch.randperm(len(ranges), generator=order).tolist():
                    push_piece(w, t, ranges[i], (t + w + i) % 3)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    def reader() -> None:
        want = 0
        try:
            while want <= steps:
                with shard.read(want, 10) as (version, _):
                    want = version + 1
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)] + [threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors and not any(thread.is_alive() for thread in threads), errors

    param = torch.nn.Parameter(initial.clone())
    reference = torch.optim.Adam([param], lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    for t in range(steps):
        if t not in skipper:
            param.grad = (grads[t, 0] + grads[t, 1] + grads[t, 2]) / workers
            reference.step()
    version, ours = shard.parameters()
    assert version == steps and torch.equal(ours, param.detach())
    assert {float(p._optimizer.state[p._param]["step"]) for p in shard.pieces} == {steps - len(skipper)}
    assert all(not p._held and not p._readers for p in shard.pieces)  # nothing kept past its step


def test_a_bfloat16_shard_restored_from_its_checkpoint_takes_bfloat16_pushes_and_continues_exactly() -> None:
    """Before, ``ParameterShard.restore`` had no ``push_dtype``: the restored shard of a bfloat16 job said "this job
    pushes gradients as FLOAT32" to every push of its workers."""
    spec = pb.OptimizerSpec(name="adam", beta1=0.9, beta2=0.999, eps=1e-8)
    grads = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    live = ParameterShard(0, 0, 8, torch.zeros(8), spec, LR, 1, push_dtype=pb.BFLOAT16)
    for step in range(2):
        live.push(0, step, grads[step].clone(), 1)
    restored = ParameterShard.restore(live.checkpoint_state(), spec, LR, 1, push_dtype=pb.BFLOAT16)
    for step in range(2, 4):
        for shard in (live, restored):
            assert shard.push(0, step, grads[step].clone(), 1).completed
    assert restored.push_dtype == pb.BFLOAT16
    assert torch.equal(restored.parameters()[1], live.parameters()[1])

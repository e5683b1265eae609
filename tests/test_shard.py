"""The synchronous push/pull protocol of one shard, without a network."""

import threading

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.errors import InvalidArgument, NotReady, StepConflict, UnknownWorker, WaitTimeout
from pstrain.ps_server.shard import ParameterShard
from tests.helpers import FullCopies

SGD = pb.OptimizerSpec(name="sgd", momentum=0.9)
ADAM = pb.OptimizerSpec(name="adam", beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
LR = pb.LrSchedule(base_lr=0.1, scaled_lr=0.1)


def make(optimizer=SGD, workers=2, numel=5, schedule=LR):
    return ParameterShard(1, 10, 10 + numel, torch.arange(numel, dtype=torch.float32), optimizer, schedule, workers)


class WatchedCondition(threading.Condition):
    """A shard's condition that reports which threads are blocked in ``wait``.

    A test proves a call blocks by seeing its thread inside the shard's wait, not by a join
    timeout that a slow scheduler satisfies just as well.
    """

    def __init__(self) -> None:
        super().__init__()
        self._blocked: set[int | None] = set()
        self._seen = threading.Condition()

    def wait(self, timeout: float | None = None) -> bool:
        me = threading.get_ident()
        with self._seen:
            self._blocked.add(me)
            self._seen.notify_all()
        try:
            return super().wait(timeout)
        finally:
            with self._seen:
                self._blocked.discard(me)

    def wait_until_blocked(self, thread: threading.Thread, timeout_s: float = 30) -> None:
        with self._seen:
            if not self._seen.wait_for(lambda: thread.ident in self._blocked, timeout_s):
                raise AssertionError(f"{thread.name} never blocked in the shard within {timeout_s:.0f}s")

    def is_blocked(self, thread: threading.Thread) -> bool:
        with self._seen:
            return thread.ident in self._blocked


def watch(shard: ParameterShard) -> WatchedCondition:
    """Swap in a WatchedCondition before the shard is shared with any thread."""
    cond = WatchedCondition()
    shard._cond = cond
    return cond


def state(shard):
    version, params = shard.parameters()
    opt_state = [v.clone() for s in shard._optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return version, params, shard._accum.clone(), dict(shard._pending), opt_state


def assert_same_state(a, b):
    assert a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and a[3] == b[3]
    assert len(a[4]) == len(b[4]) and all(torch.equal(x, y) for x, y in zip(a[4], b[4], strict=True))


@pytest.mark.parametrize(
    "spec, cls, kwargs",
    [
        (SGD, torch.optim.SGD, {"momentum": 0.9}),
        (ADAM, torch.optim.Adam, {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}),
        (
            pb.OptimizerSpec(name="adamw", beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
            torch.optim.AdamW,
            {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
        ),
        (
            pb.OptimizerSpec(name="sgd", momentum=0.5, nesterov=True, weight_decay=0.01),
            torch.optim.SGD,
            {"momentum": 0.5, "nesterov": True, "weight_decay": 0.01},
        ),
    ],
)
def test_update_matches_torch_optim_on_the_device_mean(spec, cls, kwargs):
    shard = make(spec)
    ref = torch.nn.Parameter(torch.arange(5, dtype=torch.float32))
    opt = cls([ref], lr=0.1, **kwargs)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        g0, g1 = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
        first = shard.push(0, step, g0, device_count=2)
        assert not first.completed and first.version == step
        second = shard.push(1, step, g1, device_count=1)
        assert second.completed and second.version == step + 1
        ref.grad = (g0 + g1) / 3  # three devices contributed
        opt.step()
    assert torch.allclose(shard.parameters()[1], ref.detach(), rtol=1e-6, atol=1e-7)


def test_warmup_schedule_is_applied_per_step():
    shard = make(pb.OptimizerSpec(name="sgd"), workers=1, schedule=pb.LrSchedule(scaled_lr=1.0, warmup_steps=4))
    before = shard.parameters()[1]
    for step in range(5):
        shard.push(0, step, torch.ones(5), 1)
    # lr: 0.25, 0.5, 0.75, 1.0, 1.0
    assert torch.allclose(before - shard.parameters()[1], torch.full((5,), 3.5))


def test_duplicate_push_is_idempotent_while_pending_and_after_completion():
    shard = make()
    shard.push(0, 0, torch.ones(5), 1)
    before = state(shard)
    again = shard.push(0, 0, torch.full((5,), 100.0), 1)
    assert again.duplicate and not again.completed
    assert_same_state(before, state(shard))
    shard.push(1, 0, torch.ones(5), 1)
    after_step = state(shard)
    retry = shard.push(1, 0, torch.ones(5), 1)  # the reply was lost, the worker retries
    assert retry.duplicate and retry.version == 1
    assert_same_state(after_step, state(shard))


def run_to_version(shard, version):
    for step in range(version):
        for worker in range(shard.workers):
            shard.push(worker, step, torch.ones(shard.numel), 1)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (dict(step=0), StepConflict, "stale push"),
        (dict(step=5), StepConflict, "ahead of the shard"),
        (dict(worker=7), UnknownWorker, "unknown worker 7"),
        (dict(worker=-1), UnknownWorker, "unknown worker"),
        (dict(grad=torch.ones(4)), InvalidArgument, "owns 5 elements"),
        (dict(grad=torch.ones(5, dtype=torch.float64)), InvalidArgument, "FLOAT32|float32"),
        (dict(devices=0), InvalidArgument, "device_count"),
    ],
)
def test_rejected_pushes_leave_the_shard_unchanged(bad, error, match):
    shard = make()
    run_to_version(shard, 2)
    shard.push(1, 2, torch.ones(5), 1)  # one contribution pending for step 2
    before = state(shard)
    args = dict(worker=0, step=2, grad=torch.ones(5), devices=1) | bad
    with pytest.raises(error, match=match):
        shard.push(args["worker"], args["step"], args["grad"], args["devices"])
    assert_same_state(before, state(shard))


def test_header_checks_name_the_problem():
    shard = make()
    with pytest.raises(InvalidArgument, match="reached shard 1"):
        shard.check_push(0, 0, 0, 1, pb.FLOAT32, 5)
    with pytest.raises(InvalidArgument, match="FLOAT16"):
        shard.check_push(1, 0, 0, 1, pb.FLOAT16, 5)


def test_pull_waits_for_the_version_and_times_out_otherwise():
    shard = make()
    with pytest.raises(WaitTimeout, match="version 1 did not appear"), shard.read(1, timeout_s=0.05):
        pass
    cond = watch(shard)
    got = []

    def reader():
        with shard.read(1, timeout_s=30) as (version, params):
            got.append((version, params.clone()))

    thread = threading.Thread(target=reader, name="reader")
    thread.start()
    cond.wait_until_blocked(thread)  # asked for version 1 while the shard is at 0: it must wait
    shard.push(0, 0, torch.ones(5), 1)
    assert shard.snapshot().pushes_waiting == 1 and shard.version == 0
    assert cond.is_blocked(thread) and not got  # half a step publishes nothing
    shard.push(1, 0, torch.ones(5), 1)
    thread.join(30)
    assert not thread.is_alive()
    assert got and got[0][0] == 1 and torch.equal(got[0][1], shard.parameters()[1])


def test_a_reader_never_holds_up_the_update_and_keeps_its_version():
    """Pulls read the published copy: the update runs under an open read and publishes anew."""
    shard = make(workers=1)
    with shard.read(0, 1) as (version, params):
        seen = params.clone()
        result = shard.push(0, 0, torch.ones(5), 1)  # completes at once, a reader or not
        assert result.completed and shard.version == 1
        assert version == 0 and torch.equal(params, seen)  # the reader's view is untouched
    assert not torch.equal(shard.parameters()[1], seen)
    with shard.read(1, 1) as (version, params):
        assert version == 1 and torch.equal(params, shard.parameters()[1])


def test_a_reader_holding_a_buffer_across_updates_keeps_its_values():
    """Double buffering reuses the previous buffer, but never one a reader still holds."""
    shard = make(workers=1)
    with shard.read(0, 1) as (version, params):
        seen = params.clone()
        for step in range(3):
            shard.push(0, step, torch.ones(5), 1)
        assert version == 0 and torch.equal(params, seen) and shard.version == 3
    for step in range(3, 6):  # buffers are recycled once nobody holds them, and stay correct
        shard.push(0, step, torch.ones(5), 1)
        with shard.read(step + 1, 1) as (version, params):
            assert version == step + 1 and torch.equal(params, shard._param.detach())


def test_non_finite_gradient_is_refused_and_changes_nothing():
    shard = make()
    shard.push(1, 0, torch.ones(5), 1)
    before = state(shard)
    for bad in (float("nan"), float("inf"), float("-inf")):
        grad = torch.ones(5)
        grad[2] = bad
        with pytest.raises(InvalidArgument, match="NaN or Inf"):
            shard.push(0, 0, grad, 1)
        assert_same_state(before, state(shard))


def test_a_skipped_step_completes_without_an_update_on_every_shard():
    shard = make()
    before = shard.parameters()[1]
    assert not shard.push(0, 0, torch.ones(5), 1).completed
    result = shard.push(1, 0, None, 1, skip=True)
    assert result.completed and result.skipped and shard.version == 1
    assert torch.equal(shard.parameters()[1], before) and shard.snapshot().skipped_steps == 1
    shard.push(0, 1, torch.ones(5), 1)
    assert shard.push(1, 1, torch.ones(5), 1).completed  # the next step updates again
    assert not torch.equal(shard.parameters()[1], before) and shard.snapshot().skipped_steps == 1
    with pytest.raises(InvalidArgument, match="unless it skips"):
        shard.push(0, 2, None, 1)


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0), (2, 1, 0)])
def test_contributions_are_summed_in_worker_order_whatever_the_arrival(order):
    """Float addition is not associative: in-order summing makes the result independent of timing."""
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(5, generator=gen) * 10 ** (3 * w) for w in range(3)]
    reference = make(workers=3)
    for worker in (0, 1, 2):
        reference.push(worker, 0, grads[worker], 1)
    shard = make(workers=3)
    for worker in order:
        shard.push(worker, 0, grads[worker].clone(), 1)
    assert torch.equal(shard.parameters()[1], reference.parameters()[1])


@pytest.mark.parametrize("order", [(0, 1, 2), (1, 0, 2), (2, 0, 1), (1, 2, 0)])
def test_a_given_up_buffer_becomes_the_accumulator_and_the_old_one_is_handed_back(order):
    """Issue 12: the step's first contribution (in turn, or the second in order arriving first) is kept, not copied;
    the sums and updates are those of copying, and the buffer handed back is the caller's: reusing it at once (as the
    staging pool does) changes nothing."""
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(5, generator=gen) * 10 ** (3 * w) for w in range(3)]
    reference, shard = make(workers=3), make(workers=3)
    for step in range(3):
        for worker in (0, 1, 2):
            reference.push(worker, step, grads[worker] * (step + 1), 1)
        handed: list[torch.Tensor] = []
        given = []
        for worker in order:
            given.append(grads[worker] * (step + 1))
            shard.push(worker, step, given[-1], 1, recycle=handed.append)
            for spare in handed:
                spare.fill_(float("nan"))
        assert len(handed) == 1 and all(handed[0] is not g for g in given)
        assert torch.equal(shard.parameters()[1], reference.parameters()[1])


def test_only_a_whole_float32_buffer_is_kept():
    handed: list[torch.Tensor] = []
    shard = make(workers=1)
    backing = torch.ones(7)
    shard.push(0, 0, backing[1:6], 2, recycle=handed.append)  # a view: the caller's tensor lives on
    shard.push(0, 1, torch.ones(5), 2)  # nothing to give back to
    # Two devices: the fused step divides the gradient in place, in the accumulator; the caller's tensor keeps its ones.
    assert handed == [] and torch.equal(backing, torch.ones(7))
    shard.push(0, 2, torch.ones(5), 2, recycle=handed.append)
    assert len(handed) == 1 and handed[0].shape == (5,)
    bf16 = ParameterShard(1, 10, 15, torch.zeros(5), SGD, LR, 1, push_dtype=pb.BFLOAT16)
    bf16.push(0, 0, torch.ones(5, dtype=torch.bfloat16), 1, recycle=handed.append)  # widened into the accumulator
    assert len(handed) == 1 and bf16.version == 1


@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd", "adam"])
@pytest.mark.parametrize("devices", [1, 3])
def test_a_lent_lone_contribution_is_read_where_it_lies_and_not_kept(optimizer, devices):
    """Issue 12: a job of one worker lends its push (a shared-memory region) for the call; the update reads it in
    place (one full copy per step, the publishing one, instead of two), with exactly the results of copying it, and
    the shard keeps nothing of it: the lender may scribble on it as soon as the call returns."""
    gen = torch.Generator().manual_seed(3)
    reference, shard = make(optimizer, workers=1, numel=64), make(optimizer, workers=1, numel=64)
    lent = torch.empty(64)
    for step in range(4):
        grad = torch.randn(64, generator=gen) * 5
        reference.push(0, step, grad.clone(), devices)
        lent.copy_(grad)
        with FullCopies(64) as copies:
            assert shard.push(0, step, lent, devices, lent=True).completed
        assert copies.count == 1
        lent.fill_(float("nan"))
        assert torch.equal(shard.parameters()[1], reference.parameters()[1])
    assert shard.push(0, 3, lent, devices, lent=True).duplicate  # a retry's buffer is not even read
    grad = torch.randn(64, generator=gen)
    reference.push(0, 4, grad.clone(), devices)
    shard.push(0, 4, grad, devices)  # not lent: copied, and nothing of the NaN-filled buffer is read
    assert torch.equal(shard.parameters()[1], reference.parameters()[1])
    ours, theirs = shard.checkpoint_state().optimizer["state"][0], reference.checkpoint_state().optimizer["state"][0]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)  # no NaN got in


def test_a_lent_contribution_that_does_not_complete_the_step_is_copied():
    """With two workers the first contribution outlives its push call: a lent one is copied (two full copies in its
    step), so the lender overwriting it before the second worker pushes changes nothing."""
    gen = torch.Generator().manual_seed(4)
    reference, shard = make(workers=2, numel=64), make(workers=2, numel=64)
    for step in range(3):
        grads = [torch.randn(64, generator=gen) for _ in range(2)]
        for worker in (0, 1):
            reference.push(worker, step, grads[worker].clone(), 1)
        with FullCopies(64) as copies:
            for worker in (1, 0):
                lent = grads[worker].clone()
                shard.push(worker, step, lent, 1, lent=True)
                lent.fill_(float("nan"))
        assert copies.count == 2  # the first contribution into the accumulator, and publishing
        assert torch.equal(shard.parameters()[1], reference.parameters()[1])


def test_a_restored_shard_continues_exactly_like_the_original():
    snapshots = []
    from pstrain.ps_server.shard import CheckpointPolicy

    policy = CheckpointPolicy(every_steps=2, final_version=5, on_snapshot=snapshots.append)
    original = ParameterShard(1, 10, 15, torch.arange(5, dtype=torch.float32), ADAM, LR, 1, checkpoints=policy)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(5, generator=gen) for _ in range(5)]
    for step in range(5):
        original.push(0, step, grads[step], 1)
    assert [s.version for s in snapshots] == [2, 4, 5]
    restored = ParameterShard.restore(snapshots[0], ADAM, LR, 1)
    assert restored.version == 2
    for step in range(2, 5):
        restored.push(0, step, grads[step], 1)
    assert torch.equal(restored.parameters()[1], original.parameters()[1])
    assert torch.equal(snapshots[-1].params, original.parameters()[1])


def test_close_wakes_waiting_pulls():
    shard = make()
    cond = watch(shard)
    errors = []

    def reader():
        try:
            with shard.read(5, timeout_s=300):
                pass
        except NotReady as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader, name="reader")
    thread.start()
    cond.wait_until_blocked(thread)  # close must wake a pull that is already waiting
    shard.close()
    thread.join(30)
    assert errors and not thread.is_alive()


def test_constructor_validates():
    with pytest.raises(InvalidArgument, match="1-D float32"):
        ParameterShard(0, 0, 4, torch.zeros(5), SGD, LR, 1)
    with pytest.raises(InvalidArgument, match="unsupported optimizer"):
        ParameterShard(0, 0, 5, torch.zeros(5), pb.OptimizerSpec(name="lbfgs"), LR, 1)
    with pytest.raises(InvalidArgument, match="at least one worker"):
        ParameterShard(0, 0, 5, torch.zeros(5), SGD, LR, 0)


def test_snapshot_counts_parameters_and_optimizer_state():
    shard = make(ADAM, workers=1)
    assert shard.snapshot().bytes_held == 5 * 4 * 3  # parameters, their published copy, accumulator
    shard.push(0, 0, torch.ones(5), 1)
    snap = shard.snapshot()
    assert snap.version == 1 and snap.bytes_held >= 5 * 4 * 5 and snap.optimizer == "adam"

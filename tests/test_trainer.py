"""The worker's training loop without a network: real replicas on CPU, in-memory PS shards."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY
from torch.utils.data import Dataset

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.ps_server.shard import ParameterShard
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.ps_api import (
    ParameterServerClient,
    PsClientError,
    PullHandle,
    PushHandle,
    RetryPolicy,
    StepConflict,
    Unavailable,
    push_then_pull,
)
from pstrain.runtime.shard_map import ShardRange, shard_ranges
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.replicas import ReplicaSet
from pstrain.worker.trainer import Trainer, step_is_finite
from tests.helpers import classification_set, nan_set, odd_mlp

STEPS = 4
DEVICES = 2
PER_DEVICE = 2
PS_SHARDS = 3
SAMPLES_PER_WORKER = STEPS * DEVICES * PER_DEVICE
LR = 0.1
SGD = pb.OptimizerSpec(name="sgd", momentum=0.9)
LAYOUT = ParamLayout.of(odd_mlp())
DATA = classification_set(2 * SAMPLES_PER_WORKER)
NO_WAIT = RetryPolicy(retries=2, first_delay_s=0.0)

Call = tuple[int | str, ...]  # ("push" | "skip", worker, step) or ("pull", version)
MakeTrainer = Callable[..., Trainer]


def seeded_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return odd_mlp()


def build_shards(workers: int) -> list[ParameterShard]:
    initial = LAYOUT.flatten(seeded_model())
    schedule = pb.LrSchedule(scaled_lr=LR)
    return [
        ParameterShard(r.shard_id, r.start, r.end, initial[r.start : r.end].clone(), SGD, schedule, workers)
        for r in shard_ranges(LAYOUT.total, PS_SHARDS)
    ]


def worker_samples(worker_id: int) -> list[int]:
    return list(range(worker_id * SAMPLES_PER_WORKER, (worker_id + 1) * SAMPLES_PER_WORKER))


def reference(workers: int, steps: int = STEPS, skipped: frozenset[int] = frozenset()) -> torch.Tensor:
    """Plain PyTorch on one process: each step's batch is every worker's slice of that step.

    A ``skipped`` step uses up its batch and changes nothing, optimizer state included.
    """
    model = seeded_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    per_step = DEVICES * PER_DEVICE
    for step in range(steps):
        if step in skipped:
            continue
        indices = [i for w in range(workers) for i in worker_samples(w)[step * per_step : (step + 1) * per_step]]
        x, y = DATA[indices]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return LAYOUT.flatten(model)


class ListSource:
    """Data shards handed out from a list (the coordinator's role)."""

    def __init__(self, data_shard_id: int, indices: list[int]) -> None:
        self.shards = [pb.DataShard(data_shard_id=data_shard_id, indices=indices)]

    def request(self) -> pb.DataShard:
        return self.shards.pop(0)

    def complete(self, data_shard_id: int) -> None:
        pass


class Reporter:
    """Records step reports; ``on_report`` plays the coordinator (or a heartbeat thread)."""

    def __init__(self, on_report: Callable[[pb.StepReport], pb.Directive | None] | None = None) -> None:
        self.steps: list[int] = []
        self.on_report = on_report

    def report(self, report: pb.StepReport) -> pb.Directive:
        self.steps.append(report.step)
        directive = self.on_report(report) if self.on_report else None
        return directive or pb.Directive()


def failed(exc: Exception) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future


class Recording:
    """A ParameterServerClient around a LocalPsClient that logs every call and injects faults.

    ``faults`` maps a call (``("push", worker, step)`` or ``("pull", version)``) to the errors
    its next attempts raise, one per attempt. A failed push has still reached every shard
    (its replies were lost), so the retry must be acknowledged as a duplicate, not counted.
    """

    def __init__(self, inner: LocalPsClient, calls: list[Call], faults: dict[Call, list[PsClientError]] | None = None):
        self.inner = inner
        self.ranges = inner.ranges
        self.total = inner.total
        self.calls = calls
        self.faults = faults or {}
        self.pulling: dict[int, threading.Event] = {}

    def push(self, flat: torch.Tensor, worker_id: int, step: int, device_count: int) -> PushHandle:
        key = ("push", worker_id, step)
        self.calls.append(key)
        handle = self.inner.push(flat, worker_id, step, device_count)
        if self.faults.get(key):
            error = self.faults[key].pop(0)
            return PushHandle([handle.futures[0], *(failed(error) for _ in handle.futures[1:])])
        return handle

    def skip_step(self, worker_id: int, step: int, device_count: int) -> PushHandle:
        self.calls.append(("skip", worker_id, step))
        return self.inner.skip_step(worker_id, step, device_count)

    def pull(self, min_version: int, out: torch.Tensor) -> int:
        key = ("pull", min_version)
        self.calls.append(key)
        self.pulling.setdefault(min_version, threading.Event()).set()
        if self.faults.get(key):
            raise self.faults[key].pop(0)
        return self.inner.pull(min_version, out)

    def pull_at(self, version: int, out: torch.Tensor) -> None:
        self.calls.append(("pull_at", version))
        self.inner.pull_at(version, out)

    # S4: the trainer pushes and pulls per bucket; these tests' jobs have one bucket (bucket_bytes 0), so a
    # step is one push_pieces and one pull_pieces, logged and faulted under the same keys as push and pull.

    def push_pieces(
        self, flat: torch.Tensor, pieces: Sequence[ShardRange], worker_id: int, step: int, device_count: int
    ) -> PushHandle:
        key = ("push", worker_id, step)
        self.calls.append(key)
        handle = self.inner.push_pieces(flat, pieces, worker_id, step, device_count)
        if self.faults.get(key):
            error = self.faults[key].pop(0)
            return PushHandle([handle.futures[0], *(failed(error) for _ in handle.futures[1:])])
        return handle

    def push_pull_pieces(
        self,
        flat: torch.Tensor,
        pieces: Sequence[ShardRange],
        worker_id: int,
        step: int,
        device_count: int,
        out: torch.Tensor,
        placed: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[PushHandle, PullHandle]:
        return push_then_pull(self, flat, pieces, worker_id, step, device_count, out, placed)  # faulted as push, pull

    def skip_pieces(self, pieces: Sequence[ShardRange], worker_id: int, step: int, device_count: int) -> PushHandle:
        self.calls.append(("skip", worker_id, step))
        return self.inner.skip_pieces(pieces, worker_id, step, device_count)

    def pull_pieces(self, min_version: int, out: torch.Tensor, pieces: Sequence[ShardRange]) -> PullHandle:
        key = ("pull", min_version)
        self.calls.append(key)
        self.pulling.setdefault(min_version, threading.Event()).set()
        if self.faults.get(key):
            return PullHandle([failed(self.faults[key].pop(0))])
        return self.inner.pull_pieces(min_version, out, pieces)

    def close(self, cancel: bool = False) -> None:
        self.inner.close(cancel)


@pytest.fixture
def make_trainer() -> Iterator[MakeTrainer]:
    built: list[Trainer] = []

    def make(
        worker_id: int,
        ps: ParameterServerClient,
        reporter: Reporter | None = None,
        stop: threading.Event | None = None,
        retry: RetryPolicy = NO_WAIT,
        data: Dataset = DATA,
        on_nonfinite: str = "stop",
        bucket_bytes: int = 0,
        prefetch: bool = False,
    ) -> Trainer:
        job = pb.JobSpec(
            steps=STEPS,
            per_device_batch=PER_DEVICE,
            total_params=LAYOUT.total,
            on_nonfinite=on_nonfinite,
            bucket_bytes=bucket_bytes,
        )
        replicas = ReplicaSet(seeded_model, [torch.device("cpu")] * DEVICES, LAYOUT)
        feed = DataFeed(data, ListSource(worker_id, worker_samples(worker_id)), prefetch)
        loss = torch.nn.functional.cross_entropy
        reporter = reporter or Reporter()
        trainer = Trainer(worker_id, job, replicas, ps, feed, loss, reporter, stop or threading.Event(), retry)
        built.append(trainer)
        return trainer

    yield make
    for trainer in built:
        trainer.ps.close(cancel=True)
        trainer.replicas.close()
        trainer.feed.close()


def start(trainer: Trainer) -> tuple[threading.Thread, dict[str, object]]:
    """Run ``trainer`` in a thread; the dict gets its return value or its error."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["ran"] = trainer.run()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"trainer-{trainer.worker_id}", daemon=True)
    thread.start()
    return thread, outcome


def final_parameters(shards: list[ParameterShard]) -> torch.Tensor:
    return torch.cat([shard.parameters()[1] for shard in shards])


def test_each_step_pushes_then_pulls_the_next_version(make_trainer: MakeTrainer) -> None:
    shards = build_shards(workers=1)
    calls: list[Call] = []
    reporter = Reporter()
    trainer = make_trainer(0, Recording(LocalPsClient(shards), calls), reporter)
    assert trainer.run() == STEPS
    expected: list[Call] = [("pull", 0)]
    for step in range(STEPS):
        expected += [("push", 0, step), ("pull", step + 1)]
    assert calls == expected
    assert reporter.steps == list(range(STEPS))
    assert trainer.progress.state == "finished" and trainer.progress.step == STEPS
    torch.testing.assert_close(final_parameters(shards), reference(workers=1), rtol=1e-5, atol=1e-6)


def test_two_workers_train_like_one_process(make_trainer: MakeTrainer) -> None:
    shards = build_shards(workers=2)
    trainers = [make_trainer(w, LocalPsClient(shards, pull_timeout_s=60)) for w in range(2)]
    runs = [start(t) for t in trainers]
    for thread, _ in runs:
        thread.join(120)
        assert not thread.is_alive(), "a trainer hung"
    assert [outcome for _, outcome in runs] == [{"ran": STEPS}, {"ran": STEPS}]
    expected = reference(workers=2)
    torch.testing.assert_close(final_parameters(shards), expected, rtol=1e-5, atol=1e-6)
    for trainer in trainers:
        assert trainer.progress.state == "finished"
        torch.testing.assert_close(trainer.replicas.host_params, expected, rtol=1e-5, atol=1e-6)


def test_calls_that_find_a_shard_unavailable_are_retried(make_trainer: MakeTrainer) -> None:
    shards = build_shards(workers=1)
    calls: list[Call] = []
    faults: dict[Call, list[PsClientError]] = {
        ("push", 0, 1): [Unavailable("shard 1 restarting")],
        ("pull", 3): [Unavailable("shard 2 restarting")],
    }
    trainer = make_trainer(0, Recording(LocalPsClient(shards), calls, faults))
    assert trainer.run() == STEPS
    assert calls.count(("push", 0, 1)) == 2 and calls.count(("pull", 3)) == 2
    assert calls.index(("push", 0, 1), calls.index(("push", 0, 1)) + 1) < calls.index(("pull", 2))
    # the retried push reached every shard twice and was counted once
    torch.testing.assert_close(final_parameters(shards), reference(workers=1), rtol=1e-5, atol=1e-6)


def test_errors_that_are_not_retryable_or_keep_happening_are_raised(make_trainer: MakeTrainer) -> None:
    calls: list[Call] = []
    conflict: dict[Call, list[PsClientError]] = {("push", 0, 0): [StepConflict("stale push")]}
    trainer = make_trainer(0, Recording(LocalPsClient(build_shards(workers=1)), calls, conflict))
    with pytest.raises(StepConflict):
        trainer.run()
    assert calls.count(("push", 0, 0)) == 1

    calls.clear()
    down: dict[Call, list[PsClientError]] = {("pull", 0): [Unavailable(f"try {i}") for i in range(5)]}
    trainer = make_trainer(0, Recording(LocalPsClient(build_shards(workers=1)), calls, down))
    with pytest.raises(Unavailable, match="try 2"):
        trainer.run()
    assert calls == [("pull", 0)] * (NO_WAIT.retries + 1)


def test_a_stop_during_a_blocked_pull_ends_the_trainer(make_trainer: MakeTrainer) -> None:
    # Two workers are expected but only one trains: its pull of version 1 waits for the other.
    client = Recording(LocalPsClient(build_shards(workers=2), pull_timeout_s=120), [])
    stop = threading.Event()
    trainer = make_trainer(0, client, stop=stop)
    thread, outcome = start(trainer)
    assert client.pulling.setdefault(1, threading.Event()).wait(30), "the trainer never reached the pull"
    started = time.monotonic()
    stop.set()  # what SIGTERM does; worker.main then cancels the client's calls
    client.close(cancel=True)
    thread.join(10)
    assert not thread.is_alive(), "the trainer is still waiting in its pull"
    assert time.monotonic() - started < 5
    assert outcome == {"ran": 0}
    assert trainer.progress.state == "stopped" and trainer.progress.step == 0


def test_a_stop_during_a_retry_backoff_ends_the_trainer(make_trainer: MakeTrainer) -> None:
    stop = threading.Event()

    class StopsOnFailure(Recording):
        def pull(self, min_version: int, out: torch.Tensor) -> int:
            stop.set()  # SIGTERM arrives while the shard is down
            raise Unavailable("shard 0 restarting")

    trainer = make_trainer(0, StopsOnFailure(LocalPsClient(build_shards(workers=1)), []), stop=stop)
    trainer.retry = RetryPolicy(retries=3, first_delay_s=600.0)
    started = time.monotonic()
    assert trainer.run() == 0
    assert time.monotonic() - started < 5 and trainer.progress.state == "stopped"


def test_a_heartbeat_abort_stops_training_before_the_next_step(make_trainer: MakeTrainer) -> None:
    stop = threading.Event()
    calls: list[Call] = []

    def heartbeat_sees_abort(report: pb.StepReport) -> None:
        if report.step == 1:
            stop.set()  # MemberProcess's heartbeat sets the training loop's stop flag

    trainer = make_trainer(
        0, Recording(LocalPsClient(build_shards(workers=1)), calls), Reporter(heartbeat_sees_abort), stop
    )
    assert trainer.run() == 2
    assert calls[-1] == ("pull", 2) and ("push", 0, 2) not in calls
    assert trainer.progress.state == "stopped" and trainer.progress.step == 2


def test_a_coordinator_directive_stops_training(make_trainer: MakeTrainer) -> None:
    reporter = Reporter(lambda report: pb.Directive(stop=True, reason="job failed"))
    shards = build_shards(workers=1)
    trainer = make_trainer(0, LocalPsClient(shards), reporter)
    assert trainer.run() == 1
    assert reporter.steps == [0] and trainer.progress.state == "stopped"
    assert all(s.last_step_of(0) == 0 for s in shards)  # step 1 computed its gradient and pushed none of it


def test_a_steps_pushes_wait_for_the_previous_directive_which_may_come_during_backward(
    make_trainer: MakeTrainer,
) -> None:
    """The coordinator's answer to step s-1's report is not waited for before step s's backward (its round trip
    overlaps it), yet no bucket of step s leaves before that answer is in."""
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    began = {step: threading.Event() for step in range(STEPS + 1)}  # step -> its backward has begun

    def slow_coordinator(report: pb.StepReport) -> None:
        if report.step + 1 < STEPS:  # answers only once the next step's backward has begun (or gives up)
            began[report.step + 1].wait(10)
        with lock:
            events.append(("answered", report.step))

    trainer = make_trainer(0, LocalPsClient(build_shards(workers=1)), Reporter(slow_coordinator))
    start, current = trainer.pusher.start, [0]

    def armed(step: int, held=None) -> None:  # type: ignore[no-untyped-def]
        with lock:
            events.append(("armed", step))
            current[0] = step
        start(step, held)
        began[step].set()

    trainer.pusher.start = armed  # type: ignore[method-assign]
    trainer.pusher.on_push = lambda bucket: events.append(("push", current[0]))
    assert trainer.run() == STEPS
    for step in range(1, STEPS):
        answered = events.index(("answered", step - 1))
        assert events.index(("armed", step)) < answered  # backward began before the answer
        assert all(i > answered for i, e in enumerate(events) if e == ("push", step))  # no push before it


# ---------------------------------------------------------------- non-finite losses and gradients

NAN_AT_STEP_1 = nan_set(len(DATA), nan_at=worker_samples(0)[DEVICES * PER_DEVICE])  # worker 0's step 1, device 0


def skipped_steps_metric() -> float:
    return REGISTRY.get_sample_value("pstrain_worker_skipped_steps_total") or 0.0


def test_step_is_finite_checks_the_losses_and_the_summed_gradient() -> None:
    grads = torch.ones(10)
    assert step_is_finite([0.5, 1.5], grads)
    assert not step_is_finite([0.5, math.nan], grads)
    assert not step_is_finite([0.5, math.inf], grads)
    for bad in (math.nan, math.inf, -math.inf):
        broken = grads.clone()
        broken[7] = bad
        assert not step_is_finite([0.5], broken)
    overflowing_sum = torch.cat([torch.full((2000,), 3e35), torch.full((2000,), -3e35)])
    assert step_is_finite([0.5], overflowing_sum), "finite values whose partial sums overflow are finite"


def test_a_nan_loss_under_skip_skips_the_step_and_the_next_one_trains(make_trainer: MakeTrainer) -> None:
    shards = build_shards(workers=1)
    calls: list[Call] = []
    seen: dict[int, tuple[bool, float, torch.Tensor]] = {}  # step -> (nonfinite, loss, shards' parameters after it)

    def coordinator(report: pb.StepReport) -> None:
        seen[report.step] = (report.nonfinite, report.loss, final_parameters(shards).clone())

    skipped_before = skipped_steps_metric()
    ps = Recording(LocalPsClient(shards), calls)
    trainer = make_trainer(0, ps, Reporter(coordinator), data=NAN_AT_STEP_1, on_nonfinite="skip")
    assert trainer.run() == STEPS and trainer.progress.state == "finished"
    assert calls == [
        ("pull", 0),
        ("push", 0, 0),
        ("pull", 1),
        ("skip", 0, 1),  # never a push of step 1
        ("pull", 2),
        ("push", 0, 2),
        ("pull", 3),
        ("push", 0, 3),
        ("pull", 4),
    ]
    assert [(step, nonfinite) for step, (nonfinite, _, _) in sorted(seen.items())] == [
        (0, False),
        (1, True),
        (2, False),
        (3, False),
    ]
    assert math.isnan(seen[1][1]) and math.isfinite(seen[2][1])
    assert torch.equal(seen[1][2], seen[0][2]), "the skipped step changed the shards' parameters"
    assert not torch.equal(seen[2][2], seen[1][2]), "the step after the skipped one did not train"
    final = final_parameters(shards)
    assert torch.isfinite(final).all() and all(shard.version == STEPS for shard in shards)
    torch.testing.assert_close(final, reference(workers=1, skipped=frozenset({1})), rtol=1e-5, atol=1e-6)
    assert skipped_steps_metric() == skipped_before + 1


def test_a_step_one_worker_skips_is_skipped_for_every_worker(make_trainer: MakeTrainer) -> None:
    shards = build_shards(workers=2)
    data = {0: NAN_AT_STEP_1, 1: DATA}  # only worker 0 sees the NaN
    trainers = [
        make_trainer(w, LocalPsClient(shards, pull_timeout_s=60), data=data[w], on_nonfinite="skip") for w in range(2)
    ]
    runs = [start(t) for t in trainers]
    for thread, _ in runs:
        thread.join(120)
        assert not thread.is_alive(), "a trainer hung"
    assert [outcome for _, outcome in runs] == [{"ran": STEPS}, {"ran": STEPS}]
    expected = reference(workers=2, skipped=frozenset({1}))  # worker 1's finite gradient of step 1 is dropped too
    torch.testing.assert_close(final_parameters(shards), expected, rtol=1e-5, atol=1e-6)
    for trainer in trainers:
        torch.testing.assert_close(trainer.replicas.host_params, expected, rtol=1e-5, atol=1e-6)


def test_a_nan_loss_under_stop_pushes_nothing_and_ends_failed(make_trainer: MakeTrainer) -> None:
    shards = build_shards(workers=1)
    calls: list[Call] = []
    reports: list[pb.StepReport] = []

    def coordinator(report: pb.StepReport) -> pb.Directive | None:
        reports.append(report)
        return None  # the trainer stops on its own, whatever the coordinator answers

    trainer = make_trainer(0, Recording(LocalPsClient(shards), calls), Reporter(coordinator), data=NAN_AT_STEP_1)
    assert trainer.run() == 1
    assert calls == [("pull", 0), ("push", 0, 0), ("pull", 1)], "step 1 reached the parameter server"
    assert [(r.worker_id, r.step, r.nonfinite) for r in reports] == [(0, 0, False), (0, 1, True)]
    assert math.isnan(reports[1].loss)
    assert trainer.progress.state == "failed" and trainer.progress.step == 1
    assert all(shard.version == 1 and shard.snapshot().pushes_waiting == 0 for shard in shards)
    torch.testing.assert_close(final_parameters(shards), reference(workers=1, steps=1), rtol=1e-5, atol=1e-6)


def test_a_failed_directive_ends_the_trainer_failed(make_trainer: MakeTrainer) -> None:
    reporter = Reporter(lambda report: pb.Directive(stop=True, state=pb.FAILED, reason="worker 1 went silent"))
    trainer = make_trainer(0, LocalPsClient(build_shards(workers=1)), reporter)
    assert trainer.run() == 1
    assert trainer.progress.state == "failed"

"""S4 review: the bucket sender and loader against real in-memory shards, real threads, several devices.

Covers what ``tests/test_overlap.py`` does not: equivalence with plain ``torch.optim`` over many steps for several
bucket sizes and 1-3 CPU devices, a bfloat16 push whose float32 gradient rounds to Inf, a bucket whose pull keeps
failing with several devices, and the sender's thread once ``run()`` has returned.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

import pytest
import torch
from torch import nn

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.ps_server.pieces import PiecedShard
from pstrain.runtime.buckets import shard_pieces
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.numerics import all_finite
from pstrain.runtime.ps_api import PullHandle, RetryPolicy, Unavailable, round_push
from pstrain.runtime.shard_map import ShardRange, shard_ranges
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.overlap import BF16_ROUNDS_TO_INF, finite_as_pushed
from pstrain.worker.replicas import ReplicaSet
from pstrain.worker.trainer import Trainer
from tests.helpers import classification_set
from tests.test_trainer import ListSource, Reporter

PER_DEVICE = 2
SHARDS = 3
NO_WAIT = RetryPolicy(retries=2, first_delay_s=0.0)
BF16_OVERFLOW = 3.3999e38  # finite in float32, Inf once rounded to bfloat16 (largest bfloat16: about 3.39e38)


def mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 9), nn.Tanh(), nn.Linear(9, 4))


LAYOUT = ParamLayout.of(mlp())


def optimizer_spec(name: str) -> tuple[pb.OptimizerSpec, float]:
    if name == "sgd":
        return pb.OptimizerSpec(name="sgd", momentum=0.9), 0.1
    return pb.OptimizerSpec(name="adam", beta1=0.9, beta2=0.999, eps=1e-8), 0.01


class Job:
    """One or more trainers on shards cut as a PS process cuts them for ``bucket_bytes``; torn down by ``close``."""

    def __init__(
        self,
        devices: int,
        bucket_bytes: int,
        steps: int,
        workers: int = 1,
        optimizer: str = "sgd",
        on_nonfinite: str = "skip",
        push_dtype: int = pb.FLOAT32,
        client: type[LocalPsClient] = LocalPsClient,
        retry: RetryPolicy = NO_WAIT,
    ) -> None:
        spec, self.lr = optimizer_spec(optimizer)
        initial = LAYOUT.flatten(mlp())
        self.shards = [
            PiecedShard.build(
                shard_pieces(LAYOUT, r, bucket_bytes),
                initial[r.start : r.end].clone(),
                spec,
                pb.LrSchedule(scaled_lr=self.lr),
                workers,
                push_dtype=push_dtype,
            )
            for r in shard_ranges(LAYOUT.total, SHARDS)
        ]
        self.devices, self.steps, self.workers, self.optimizer = devices, steps, workers, optimizer
        self.per_worker = steps * devices * PER_DEVICE
        self.data = classification_set(self.per_worker * workers)
        dtype = torch.bfloat16 if push_dtype == pb.BFLOAT16 else torch.float32
        self.trainers = [
            self._trainer(w, bucket_bytes, on_nonfinite, push_dtype, client(self.shards, 20.0, dtype), retry)
            for w in range(workers)
        ]

    def _trainer(
        self, worker: int, bucket_bytes: int, on_nonfinite: str, push_dtype: int, ps: LocalPsClient, retry: RetryPolicy
    ) -> Trainer:
        job = pb.JobSpec(
            steps=self.steps,
            per_device_batch=PER_DEVICE,
            total_params=LAYOUT.total,
            on_nonfinite=on_nonfinite,
            bucket_bytes=bucket_bytes,
            push_dtype=push_dtype,
        )
        replicas = ReplicaSet(mlp, [torch.device("cpu")] * self.devices, LAYOUT)
        samples = list(range(worker * self.per_worker, (worker + 1) * self.per_worker))
        feed = DataFeed(self.data, ListSource(worker, samples), False)
        return Trainer(
            worker, job, replicas, ps, feed, nn.functional.cross_entropy, Reporter(), threading.Event(), retry
        )

    def run(self) -> dict[int, object]:
        """Every trainer in a thread of its own; worker -> steps run, or the error raised."""
        outcome: dict[int, object] = {}

        def train(trainer: Trainer) -> None:
            try:
                outcome[trainer.worker_id] = trainer.run()
            except BaseException as exc:  # noqa: BLE001 - inspected by the test
                outcome[trainer.worker_id] = exc

        threads = [threading.Thread(target=train, args=(t,), daemon=True) for t in self.trainers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive(), "a trainer hung"
        return outcome

    def reference(self) -> torch.Tensor:
        """Plain torch.optim on one process: each step's batch is every worker's slice of that step."""
        model = mlp()
        if self.optimizer == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=self.lr)
        per_step = self.devices * PER_DEVICE
        for step in range(self.steps):
            indices = [
                i
                for w in range(self.workers)
                for i in range(w * self.per_worker + step * per_step, w * self.per_worker + (step + 1) * per_step)
            ]
            x, y = self.data[indices]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return LAYOUT.flatten(model)

    def final(self) -> torch.Tensor:
        return torch.cat([s.parameters()[1] for s in self.shards])

    def close(self) -> None:
        for trainer in self.trainers:
            trainer.ps.close(cancel=True)
            trainer.replicas.close()
            trainer.feed.close()


@pytest.fixture
def jobs() -> object:
    made: list[Job] = []

    def make(*args: object, **kwargs: object) -> Job:
        made.append(Job(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for job in made:
        job.close()


@pytest.mark.parametrize(
    ("devices", "bucket_bytes", "optimizer", "workers"),
    [(1, 64, "adam", 2), (2, 64, "sgd", 1), (2, 200, "adam", 2), (3, 64, "sgd", 2), (3, 1000, "adam", 1)],
)
def test_buckets_train_like_plain_torch_over_many_steps(
    jobs: object, devices: int, bucket_bytes: int, optimizer: str, workers: int
) -> None:
    job = jobs(devices, bucket_bytes, 12, workers=workers, optimizer=optimizer)  # type: ignore[operator]
    assert job.run() == {w: 12 for w in range(workers)}
    expected = job.reference()
    torch.testing.assert_close(job.final(), expected, rtol=1e-5, atol=1e-6)
    for trainer in job.trainers:
        torch.testing.assert_close(trainer.replicas.host_params, expected, rtol=1e-5, atol=1e-6)


def overflow_bfloat16_at(trainer: Trainer, step: int) -> None:
    """Layout parameter 0's gradient (the last bucket backward completes) gets one float32 value that bfloat16
    cannot hold, on device 0 at ``step``."""
    first = next(trainer.replicas.replicas[0].model.parameters())
    seen = [0]

    def overflow(grad: torch.Tensor) -> torch.Tensor:
        seen[0] += 1
        if seen[0] - 1 != step:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = BF16_OVERFLOW
        return grad

    first.register_hook(overflow)


@pytest.mark.parametrize(("devices", "bucket_bytes"), [(1, 0), (2, 64)])
def test_a_gradient_that_overflows_bfloat16_is_skipped_not_pushed(
    jobs: object, devices: int, bucket_bytes: int
) -> None:
    """Before the fix the float32 check passed, the rounded push carried Inf and the shard refused it: the worker
    failed with InvalidRequest instead of skipping the step (``fault.on_nonfinite: skip``)."""
    job = jobs(devices, bucket_bytes, 4, push_dtype=pb.BFLOAT16)  # type: ignore[operator]
    overflow_bfloat16_at(job.trainers[0], 1)
    assert job.run() == {0: 4}
    assert job.trainers[0].progress.state == "finished"
    assert torch.isfinite(job.final()).all()
    skipped = {p.start: p.snapshot().skipped_steps for s in job.shards for p in s.pieces}
    assert skipped[0] == 1, "the overflowing bucket's pieces skipped step 1"


def test_finite_as_pushed_agrees_with_the_shards_check_on_the_rounded_values() -> None:
    below = torch.nextafter(torch.tensor(BF16_ROUNDS_TO_INF), torch.tensor(0.0)).item()
    for bad in (BF16_ROUNDS_TO_INF, below, 3e38, 3.4e38, float("nan"), float("inf"), 1.0, 0.0):
        for sign in (1.0, -1.0):
            values = torch.tensor([0.5, sign * bad, -2.0])
            for dtype in (torch.bfloat16, torch.float32):
                assert finite_as_pushed(values, dtype) == all_finite(round_push(values, dtype)), (bad, sign, dtype)


def test_a_gradient_that_overflows_bfloat16_under_stop_ends_failed(jobs: object) -> None:
    job = jobs(2, 64, 4, on_nonfinite="stop", push_dtype=pb.BFLOAT16)  # type: ignore[operator]
    overflow_bfloat16_at(job.trainers[0], 1)
    assert job.run() == {0: 1}
    assert job.trainers[0].progress.state == "failed"
    assert torch.isfinite(job.final()).all()


class FailingPull(LocalPsClient):
    """Every pull of the piece at ``FailingPull.start`` for version 2 fails with ``Unavailable``: a shard that
    stays down. Counts those pulls."""

    start = 60  # the second parameter's bucket of ``mlp`` with 64-byte buckets

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.failed_pulls = 0
        self._count = threading.Lock()

    def pull_pieces(self, min_version: int, out: torch.Tensor, pieces: Sequence[ShardRange]) -> PullHandle:
        if min_version == 2 and pieces[0].start == self.start:
            with self._count:
                self.failed_pulls += 1
            failed: Future[int] = Future()
            failed.set_exception(Unavailable(f"shard {pieces[0].shard_id} is down"))
            return PullHandle([failed])
        return super().pull_pieces(min_version, out, pieces)


def test_a_pull_that_keeps_failing_is_repeated_once_not_once_per_device(jobs: object) -> None:
    """Before the fix each device thread repeated the whole retry cycle in turn (3 devices: 3 backoffs)."""
    job = jobs(3, 64, 4, client=FailingPull, retry=NO_WAIT)  # type: ignore[operator]
    assert any(p.start == FailingPull.start for b in job.trainers[0].plan.buckets for p in b.pieces)
    outcome = job.run()
    assert isinstance(outcome[0], Unavailable)
    client = job.trainers[0].ps
    assert client.failed_pulls == 1 + NO_WAIT.retries + 1  # the pull behind the push, then one retry cycle


def bucket_senders() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("bucket-push")}


def assert_ended(threads: set[threading.Thread]) -> None:
    for thread in threads:
        thread.join(2.0)  # a sender that was shut down ends at once; one never shut down idles forever
    assert not [t.name for t in threads if t.is_alive()]


def test_run_leaves_no_bucket_sender_thread_and_a_second_run_still_pushes(jobs: object) -> None:
    before = bucket_senders()
    job = jobs(2, 64, 3)  # type: ignore[operator]
    assert job.run() == {0: 3}
    assert_ended(bucket_senders() - before)
    torch.testing.assert_close(job.final(), job.reference(), rtol=1e-5, atol=1e-6)
    trainer = job.trainers[0]
    trainer.job.steps = 5  # the same trainer goes on: its sender is made again
    trainer.feed.close()
    trainer.feed = DataFeed(classification_set(40), ListSource(0, list(range(40))), False)  # closed by the fixture
    assert trainer.run() == 2
    assert all(p.version == 5 for s in job.shards for p in s.pieces)
    assert_ended(bucket_senders() - before)


def test_a_stop_mid_backward_leaves_no_bucket_sender_thread(jobs: object) -> None:
    """SIGTERM during backward of a two-worker job whose other worker never came: worker.main sets the stop flag
    and cancels the client's calls; run() ends ``stopped`` and its sender thread ends with it."""
    before = bucket_senders()
    job = jobs(2, 64, 4, workers=2)  # type: ignore[operator]
    trainer = job.trainers[0]
    first = next(trainer.replicas.replicas[0].model.parameters())  # its bucket is the last backward completes

    def sigterm(_: torch.Tensor) -> None:
        if not trainer.stop.is_set():
            trainer.stop.set()
            trainer.ps.close(cancel=True)

    first.register_post_accumulate_grad_hook(sigterm)
    outcome: dict[str, object] = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("ran", trainer.run()), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "run() hung after the stop"
    assert outcome == {"ran": 0} and trainer.progress.state == "stopped"
    assert_ended(bucket_senders() - before)


def test_a_closed_replica_set_and_its_trainer_can_be_collected() -> None:
    """The S4 hooks (``ReplicaSet.attach``) held the set, its models and the trainer alive after ``close``: a
    process that builds trainers one after another (the probe's rounds, a test suite) kept every one."""
    import gc
    import weakref

    from torch.nn import functional as F

    from tests import test_trainer as plain

    job = pb.JobSpec(steps=plain.STEPS, per_device_batch=plain.PER_DEVICE, total_params=plain.LAYOUT.total)
    replicas = ReplicaSet(plain.seeded_model, [torch.device("cpu")] * 2, plain.LAYOUT)
    ps = LocalPsClient(plain.build_shards(1))
    feed = DataFeed(plain.DATA, ListSource(0, plain.worker_samples(0)))
    trainer = Trainer(0, job, replicas, ps, feed, F.cross_entropy, Reporter(), threading.Event(), plain.NO_WAIT)
    assert trainer.run() == plain.STEPS
    ps.close(cancel=True)
    replicas.close()
    gone = (weakref.ref(replicas), weakref.ref(trainer))
    del trainer, replicas, ps, feed
    gc.collect()
    assert [ref() is None for ref in gone] == [True, True]

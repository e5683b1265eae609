"""S4 on the worker: buckets leave during backward, forward waits per bucket, results unchanged."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.layerwise import Layers
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.ps_server.pieces import PiecedShard
from pstrain.ps_server.service import ParameterServerServicer, add_parameter_server
from pstrain.runtime.buckets import shard_pieces
from pstrain.runtime.ps_api import PushHandle
from pstrain.runtime.ps_client import PsClient
from pstrain.runtime.shard_map import ShardRange, shard_ranges
from pstrain.runtime.transport import start_server
from tests.test_trainer import (  # noqa: F401 - make_trainer is a fixture
    LAYOUT,
    LR,
    PS_SHARDS,
    SGD,
    STEPS,
    MakeTrainer,
    final_parameters,
    make_trainer,
    reference,
    seeded_model,
    start,
)
from tests.test_trainer import (
    build_shards as whole_shards,
)

SMALL_BUCKETS = 64  # bytes: every parameter of the test model is a bucket of its own


def build_shards(
    workers: int,
    optimizer: pb.OptimizerSpec = SGD,
    lr: float = LR,
    layers: Callable[[int], Layers] | None = None,
) -> list[PiecedShard]:
    """The test_trainer shards, cut into the pieces of ``SMALL_BUCKETS`` as a PS process cuts them; ``layers``
    gives a shard's parameter segments and norm exchange (LARS/LAMB)."""
    initial = LAYOUT.flatten(seeded_model())
    return [
        PiecedShard.build(
            shard_pieces(LAYOUT, r, SMALL_BUCKETS),
            initial[r.start : r.end].clone(),
            optimizer,
            pb.LrSchedule(scaled_lr=lr),
            workers,
            layers=None if layers is None else layers(r.shard_id),
        )
        for r in shard_ranges(LAYOUT.total, PS_SHARDS)
    ]


class Watching(LocalPsClient):
    """Sets ``last_layer_pushed`` once the shards have taken a push of the layout's last parameter."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.last_layer_pushed = threading.Event()

    def push_pieces(
        self, flat: torch.Tensor, pieces: Sequence[ShardRange], worker_id: int, step: int, device_count: int
    ) -> PushHandle:
        handle = super().push_pieces(flat, pieces, worker_id, step, device_count)
        if any(p.end == LAYOUT.total for p in pieces):
            handle.wait()
            self.last_layer_pushed.set()
        return handle


def test_multi_bucket_two_workers_train_like_one_process(make_trainer: MakeTrainer) -> None:  # noqa: F811
    shards = build_shards(workers=2)
    trainers = [make_trainer(w, LocalPsClient(shards, pull_timeout_s=60), bucket_bytes=SMALL_BUCKETS) for w in (0, 1)]
    assert len(trainers[0].plan.buckets) == len(LAYOUT.names) and len(trainers[0].plan.pieces) > len(shards)
    runs = [start(t) for t in trainers]
    for thread, _ in runs:
        thread.join(120)
        assert not thread.is_alive(), "a trainer hung"
    assert [outcome for _, outcome in runs] == [{"ran": STEPS}, {"ran": STEPS}]
    expected = reference(workers=2)
    torch.testing.assert_close(final_parameters(shards), expected, rtol=1e-5, atol=1e-6)
    for trainer in trainers:
        torch.testing.assert_close(trainer.replicas.host_params, expected, rtol=1e-5, atol=1e-6)


def test_the_last_layer_is_pushed_before_backward_reaches_the_first(make_trainer: MakeTrainer) -> None:  # noqa: F811
    shards = build_shards(workers=1)
    client = Watching(shards)
    trainer = make_trainer(0, client, bucket_bytes=SMALL_BUCKETS)
    seen: list[bool] = []
    first = next(trainer.replicas.replicas[0].model.parameters())  # layout parameter 0: backward's last

    def first_layer_done(_: torch.Tensor) -> None:
        if not seen:  # the first step: block backward here until the shard has the last layer (or give up)
            seen.append(client.last_layer_pushed.wait(30))

    first.register_post_accumulate_grad_hook(first_layer_done)
    assert trainer.run() == STEPS
    assert seen == [True], "the last layer's bucket reached the shard only after backward had finished"
    torch.testing.assert_close(final_parameters(shards), reference(workers=1), rtol=1e-5, atol=1e-6)


def test_forward_waits_only_for_the_buckets_it_has_reached(make_trainer: MakeTrainer) -> None:  # noqa: F811
    shards = build_shards(workers=1)
    trainer = make_trainer(0, LocalPsClient(shards), bucket_bytes=SMALL_BUCKETS)
    replica = trainer.replicas.replicas[0]
    modules = [m for m in replica.model.modules() if next(m.parameters(recurse=False), None) is not None]
    assert len(modules) >= 2
    loaded_at_first: list[list[bool]] = []

    def peek(module: torch.nn.Module, args: object) -> None:
        loaded_at_first.append(list(trainer.loader._loaded[0]))

    modules[0].register_forward_pre_hook(peek)  # runs after the loader's own pre-hook of that module
    assert trainer.run() == STEPS
    armed = loaded_at_first[1:]  # step 0 starts from the initial whole pull: everything loaded
    first_buckets = {
        trainer.plan.bucket_of[i]
        for i, p in enumerate(replica.model.parameters())
        if any(p is q for q in modules[0].parameters())
    }
    for row in armed:
        assert all(row[b] for b in first_buckets), "the first module ran before its buckets were loaded"
        assert not all(row), "forward waited for every bucket before its first module"


def _poison_first_parameter_at_step(trainer: object, step: int) -> None:
    """A finite loss whose gradient of layout parameter 0 (the last bucket backward completes) is NaN at ``step``."""
    replica = trainer.replicas.replicas[0]  # type: ignore[attr-defined]
    first = next(replica.model.parameters())
    steps = [0]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        steps[0] += 1
        return grad * float("nan") if steps[0] - 1 == step else grad

    first.register_hook(poison)


def test_a_nonfinite_bucket_is_never_pushed_and_the_rest_of_the_step_is_skipped(make_trainer: MakeTrainer) -> None:  # noqa: F811
    """The decision in ``worker.overlap``: buckets pushed before the NaN apply (a partial step), none after it."""
    shards = build_shards(workers=1)
    client = Watching(shards)
    trainer = make_trainer(0, client, on_nonfinite="skip", bucket_bytes=SMALL_BUCKETS)
    _poison_first_parameter_at_step(trainer, 1)
    assert trainer.run() == STEPS
    final = final_parameters(shards)
    assert torch.isfinite(final).all(), "a NaN reached the shards"
    assert all(p.version == STEPS for s in shards for p in s.pieces)
    skipped = {p.start: p.snapshot().skipped_steps for s in shards for p in s.pieces}
    assert skipped[0] == 1, "the non-finite bucket's pieces skipped the step"
    assert skipped[max(skipped)] == 0, "the last layer's bucket, pushed before the NaN, was applied"
    whole_step_skipped = reference(workers=1, skipped=frozenset({1}))
    assert not torch.allclose(final, whole_step_skipped), "a partial step: the earlier buckets were applied"


def test_one_bucket_skips_a_nonfinite_step_whole(make_trainer: MakeTrainer) -> None:  # noqa: F811
    """``bucket_bytes: 0``: the all-or-nothing step (the knob the overlap's partial skip leaves)."""
    plain = whole_shards(workers=1)  # shards of one piece each: what a one-bucket job's PS builds
    trainer = make_trainer(0, LocalPsClient(plain), on_nonfinite="skip", bucket_bytes=0)
    _poison_first_parameter_at_step(trainer, 1)
    assert trainer.run() == STEPS
    expected = reference(workers=1, skipped=frozenset({1}))
    torch.testing.assert_close(final_parameters(plain), expected, rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]


def test_buckets_over_grpc_train_like_one_process(make_trainer: MakeTrainer) -> None:  # noqa: F811
    """Real gRPC servers on 127.0.0.1, each serving a shard cut into pieces; two workers push and pull per bucket."""
    shards = build_shards(workers=2)
    servers = []
    for shard in shards:
        servicer = ParameterServerServicer()
        server = start_server("127.0.0.1:0", [(add_parameter_server, servicer)], ["ParameterServer"], aio=True)
        servicer.attach(shard, 64)
        server.set_serving(True)
        servers.append(server)
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    try:
        clients = [PsClient(addresses, LAYOUT.total, chunk_bytes=64, pull_timeout_s=60) for _ in range(2)]
        trainers = [make_trainer(w, clients[w], bucket_bytes=SMALL_BUCKETS) for w in range(2)]
        runs = [start(t) for t in trainers]
        for thread, _ in runs:
            thread.join(120)
            assert not thread.is_alive(), "a trainer hung"
        assert [outcome for _, outcome in runs] == [{"ran": STEPS}, {"ran": STEPS}]
        expected = reference(workers=2)
        torch.testing.assert_close(final_parameters(shards), expected, rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]
        for trainer in trainers:
            torch.testing.assert_close(trainer.replicas.host_params, expected, rtol=1e-5, atol=1e-6)
    finally:
        for shard in shards:
            shard.close()
        for server in servers:
            server.stop(0)

"""Models users bring, through the worker's replicas, gradient buckets and memory machinery: tied and unused
parameters, modules called twice, empty parameters, integer and boolean saved tensors, views, and what must be
refused by name (frozen parameters, tied ones under whole-layer offload, a parameter reused across reentrant
checkpoints) instead of failing obscurely, hanging or pushing a partial gradient."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.local_client import LocalPsClient
from pstrain.ps_server.pieces import PiecedShard
from pstrain.runtime.buckets import shard_pieces
from pstrain.runtime.layout import LayoutError, ParamLayout
from pstrain.runtime.model_refusal import ModelUnsupported
from pstrain.runtime.shard_map import shard_ranges
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.replicas import MemoryPolicy, ReplicaSet
from pstrain.worker.trainer import Trainer
from tests.helpers import classification_set
from tests.test_trainer import NO_WAIT, ListSource, Reporter

DEVICES, PER_DEVICE, STEPS, LR = 2, 2, 3, 0.1
SMALL_BUCKETS = 64  # bytes: most parameters are a bucket of their own
DATA = classification_set(DEVICES * PER_DEVICE * STEPS)


class Tied(nn.Module):
    """An embedding whose weight is also the output layer's (a language model's tied embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 10)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x[:, 0].abs() * 3).long().clamp(max=9)
        return self.out(torch.tanh(self.mid(self.emb(ids))))[:, :4]


class SometimesUnused(nn.Module):
    """``extra`` gets no gradient in the steps (and on the devices) whose slice does not take it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.extra = nn.Linear(7, 7)
        self.b = nn.Linear(7, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(self.extra(h) if bool((x[:, 0] > 0).all()) else h)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.empty = nn.Parameter(torch.zeros(0))  # a parameter of no elements
        self.b = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x))))) + self.empty.sum()


class SparseGradient(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, sparse=True)
        self.out = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb((x[:, :2].abs() * 3).long().clamp(max=9)).sum(1)))


class Saves(nn.Module):
    """Saves int64 (max-pool indices, embedding ids) and bool (a mask) tensors, views and non-contiguous ones, with
    an in-place ReLU and a no_grad section."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.emb = nn.Embedding(7, 2)
        self.lin = nn.Linear(12 + 2, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = torch.cat([x, x, x, x[:, :1]], 1).reshape(-1, 1, 4, 4)
        h = self.pool(self.relu(self.conv(image))).flatten(1)
        e = self.emb((x[:, :2].abs() * 3).long().clamp(max=6)).sum(1)
        with torch.no_grad():
            scale = e.abs().mean() + 1
        z = self.lin(torch.cat([h, e], 1)) / scale
        z = z.masked_fill(z < -0.1, 0.0)
        zt = z.t()
        return self.head((zt * zt[:, :1]).t()) + z[:, 1:3].sum(1, keepdim=True) * z[:, :2].mean()


class ParameterContainers(nn.Module):
    """Reads a ``ParameterList`` and a ``ParameterDict``, which are never called: no pre-hook of theirs loads their
    buckets, so their parent (no parameters of its own) must."""

    def __init__(self) -> None:
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(5, 5) * 0.5) for _ in range(2)])
        self.head = nn.Linear(5, 5)
        self.out = nn.ParameterDict({"w": nn.Parameter(torch.randn(5, 4) * 0.5)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.ws:
            x = torch.tanh(x @ w)
        return torch.tanh(self.head(x)) @ self.out["w"]


def seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return factory()

    return build


def every_leaf(factory: Callable[[], nn.Module], policy: str) -> dict[str, str]:
    return {name: policy for name, m in factory().named_modules() if name and not list(m.children())}


def train(
    factory: Callable[[], nn.Module],
    memory: MemoryPolicy | None,
    push_dtype: int = pb.FLOAT32,
    inspect: Callable[[ReplicaSet], None] | None = None,
) -> torch.Tensor:
    """One worker of ``DEVICES`` CPU devices, per-bucket pushes to two in-memory shards (SGD): the final parameters.
    ``push_dtype``: the job's ``transport.push_dtype``; ``inspect`` sees the replicas after training."""
    build = seeded(factory)
    layout = ParamLayout.of(build())
    initial = layout.flatten(build())
    shards = [
        PiecedShard.build(
            shard_pieces(layout, r, SMALL_BUCKETS),
            initial[r.start : r.end].clone(),
            pb.OptimizerSpec(name="sgd"),
            pb.LrSchedule(scaled_lr=LR),
            1,
            push_dtype=push_dtype,
        )
        for r in shard_ranges(layout.total, 2)
    ]
    job = pb.JobSpec(
        steps=STEPS,
        per_device_batch=PER_DEVICE,
        total_params=layout.total,
        bucket_bytes=SMALL_BUCKETS,
        push_dtype=push_dtype,
    )
    replicas = ReplicaSet(build, [torch.device("cpu")] * DEVICES, layout, memory)
    feed = DataFeed(DATA, ListSource(0, list(range(len(DATA)))))
    wire = torch.bfloat16 if push_dtype == pb.BFLOAT16 else torch.float32
    ps = LocalPsClient(shards, pull_timeout_s=30, push_dtype=wire)
    trainer = Trainer(0, job, replicas, ps, feed, F.cross_entropy, Reporter(), threading.Event(), NO_WAIT)
    try:
        assert trainer.run() == STEPS
        if inspect is not None:
            inspect(replicas)
    finally:
        ps.close(cancel=True)
        replicas.close()
    return torch.cat([s.parameters()[1] for s in shards])


def reference(factory: Callable[[], nn.Module]) -> torch.Tensor:
    """Plain PyTorch: each step the mean of the devices' mean losses, one SGD step (grad None: unchanged)."""
    model = seeded(factory)()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per_step = DEVICES * PER_DEVICE
    for step in range(STEPS):
        x, y = DATA[list(range(step * per_step, (step + 1) * per_step))]
        opt.zero_grad()
        losses = [F.cross_entropy(model(xs), ys) for xs, ys in zip(x.chunk(DEVICES), y.chunk(DEVICES), strict=True)]
        (sum(losses) / DEVICES).backward()
        opt.step()
    return ParamLayout.of(model).flatten(model)


@pytest.mark.parametrize(
    ("factory", "policy", "offload"),
    [
        (Tied, None, False),
        (Tied, "swap", False),
        (SometimesUnused, None, False),
        (SometimesUnused, "swap", True),
        (Twice, None, False),
        (Twice, "recompute", False),
        (Twice, "swap", True),
        (Saves, "swap", False),
        (Saves, "swap", True),
        (SparseGradient, None, False),
        (SparseGradient, "swap", True),  # before: whole-layer offload's gradient sum copied the sparse gradient: error
        (ParameterContainers, None, False),  # before: refused as read before its bucket was loaded
        (ParameterContainers, "swap", True),
    ],
)
def test_user_models_train_like_plain_torch(
    factory: Callable[[], nn.Module], policy: str | None, offload: bool
) -> None:
    memory = MemoryPolicy(every_leaf(factory, policy) if policy else {}, offload_params=offload)
    torch.testing.assert_close(train(factory, memory), reference(factory), rtol=1e-5, atol=1e-6)


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 4)
        self.a.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("offload", [False, True])
def test_a_frozen_parameter_is_refused_by_name(offload: bool) -> None:
    """It would be pushed with a zero gradient and changed by the PS (weight decay, momentum); before, the worker
    failed building its trainer with torch's 'cannot register a hook on a tensor that doesn't require gradient'."""
    with pytest.raises(LayoutError, match=r"'a\.weight' does not require a gradient.*register_buffer"):
        ParamLayout.of(Frozen())  # the coordinator's preflight: the job is refused at its start
    layout = ParamLayout.from_shapes(*zip(*[(n, p.shape) for n, p in Frozen().named_parameters()], strict=True))
    with pytest.raises(LayoutError, match=r"'a\.weight' does not require a gradient.*register_buffer"):
        ReplicaSet(Frozen, [torch.device("cpu")], layout, MemoryPolicy({}, offload_params=offload))


def test_whole_layer_offload_refuses_tied_parameters_by_name() -> None:
    """``out``'s forward would compute on the host copy of ``emb.weight`` (a device mismatch on a GPU, found only in
    the first forward); the module docstring promised a refusal."""
    layout = ParamLayout.of(Tied())
    with pytest.raises(ModelUnsupported, match=r"'weight' of module 'out' is also a parameter of module 'emb'"):
        ReplicaSet(Tied, [torch.device("cpu")], layout, MemoryPolicy({}, offload_params=True))


class ReentrantTwice(nn.Module):
    """``a`` runs in two reentrant checkpoints: its gradient is accumulated by two backward passes, so its
    post-accumulate-grad hook fires twice, and the first firing is not the final gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(5, 5)
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def block(t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.a(t))

        h = torch.utils.checkpoint.checkpoint(block, self.pre(x), use_reentrant=True)
        return self.b(torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_parameter_reused_across_reentrant_checkpoints_fails_the_step() -> None:
    """Before, ``a``'s bucket counted as complete at the second checkpoint's backward and was pushed before the
    first one's part was added: on a CPU the sender usually read the buffer late enough, on a GPU the bucket's copy
    to the host starts at once. DDP refuses the same model; so does the pusher now, naming the parameter."""
    with pytest.raises(ModelUnsupported, match=r"parameter a\.(weight|bias) got a gradient twice.*use_reentrant=False"):
        train(ReentrantTwice, None)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_whole_layer_offload_fails_a_reused_reentrant_checkpoint_at_once() -> None:
    """Before, the second firing waited 10 minutes in ``HostGradSum.add`` for a turn its device had already had."""
    build = seeded(ReentrantTwice)
    replicas = ReplicaSet(build, [torch.device("cpu")], ParamLayout.of(build()), MemoryPolicy({}, offload_params=True))
    x, y = DATA[list(range(PER_DEVICE))]
    outcome: list[BaseException] = []

    def step() -> None:
        try:
            replicas.forward_backward([x], [y], F.cross_entropy)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    thread.join(60)
    try:
        assert not thread.is_alive(), "the backward is waiting for its own turn"
        assert len(outcome) == 1 and isinstance(outcome[0], ModelUnsupported)  # the job fails, exit 3
        assert re.search(r"'a\.(weight|bias)' got a gradient twice.*use_reentrant=False", str(outcome[0]))
    finally:
        replicas.close()


class FailsOnCommand(nn.Module):
    """Its backward raises where ``fail`` is set (one device's out-of-memory error, as the probe expects them)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 4)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.fail:
            h.register_hook(self._raise)
        return self.b(h)

    @staticmethod
    def _raise(grad: torch.Tensor) -> None:
        raise RuntimeError("injected: device out of memory")


def in_thread(call: Callable[[], object], limit_s: float = 60) -> list[BaseException]:
    """Run ``call``; fail the test if it has not returned within ``limit_s``; the error it raised, if any."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"{call} still waits after {limit_s} s"
    return errors


def test_offloaded_devices_stop_waiting_for_a_device_that_failed() -> None:
    """With whole-layer offload device 1 adds each gradient after device 0. Before, when device 0's backward raised
    (the probe's out-of-memory on GPU 0), device 1 waited 10 min for turns that never came, and ``close`` (the probe
    closes its replicas before it reports) waited with it."""
    build = seeded(FailsOnCommand)
    layout = ParamLayout.of(build())
    replicas = ReplicaSet(build, [torch.device("cpu")] * 2, layout, MemoryPolicy({}, offload_params=True))
    replicas.replicas[0].model.fail = True
    x, y = DATA[list(range(2 * PER_DEVICE))]
    errors = in_thread(lambda: replicas.forward_backward(list(x.chunk(2)), list(y.chunk(2)), F.cross_entropy))
    assert [str(e) for e in errors] == ["injected: device out of memory"]  # device 0's error, not the others'
    assert in_thread(replicas.close, limit_s=30) == []


def bn_block() -> nn.Module:
    return nn.Sequential(nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU()), nn.Linear(6, 4))


class DataAverage(nn.Module):
    """An exponential average kept in a buffer and written through ``.data``, which moves no version counter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.register_buffer("avg", torch.zeros(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.training:
            self.avg.data.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return torch.tanh(h)


def data_average_block() -> nn.Module:
    return nn.Sequential(DataAverage(), nn.Linear(5, 4))


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize(("factory", "layer"), [(bn_block, "0"), (bn_block, "0.1"), (data_average_block, "0")])
def test_recomputing_a_layer_moves_its_buffers_once_per_step(
    factory: Callable[[], nn.Module], layer: str, offload: bool
) -> None:
    """Before, backward's recomputation ran BatchNorm's forward again and updated its running statistics a second
    time (``num_batches_tracked`` 2 per step): the exported model's statistics differed from plain PyTorch's. A
    buffer written through ``.data`` moves no version counter: the recompute must put it back all the same."""
    build = seeded(factory)
    memory = MemoryPolicy({layer: "recompute"}, offload_params=offload)
    replicas = ReplicaSet(build, [torch.device("cpu")], ParamLayout.of(build()), memory)
    replicas.train()
    plain = build()
    plain.train()
    for step in range(2):
        x, y = DATA[list(range(step * 4, step * 4 + 4))]
        replicas.forward_backward([x], [y], F.cross_entropy)
        F.cross_entropy(plain(x), y).backward()
    replicas.close()
    got, expected = replicas.buffers(), dict(plain.named_buffers())
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)


class ReadsChildWeight(nn.Module):
    """``head`` has no parameters of its own and reads ``head.inner``'s without calling it: no pre-hook loads
    ``inner``'s bucket before it is read."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.head = nn.Module()
        self.head.inner = nn.Linear(7, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.a(x)), self.head.inner.weight, self.head.inner.bias)


def test_a_parameter_read_before_its_bucket_was_loaded_fails_the_step() -> None:
    """Before, the bucket was loaded only after forward: on a GPU forward computed on the previous version, on a CPU
    stand-in on whatever the pull had written of the host buffer by then (seen: 5e-4 off plain PyTorch after 20
    steps, in one run of three). Now the first armed step's backward names the parameter and the way out."""
    with pytest.raises(
        ModelUnsupported, match=r"'head\.inner\.(weight|bias)' was used by forward before.*bucket_bytes: 0"
    ):
        train(ReadsChildWeight, None)


def test_a_root_module_parameter_is_computed_on_its_device_copy_under_whole_layer_offload() -> None:
    """The root is a layer of its own when it holds parameters. Its layer hook ran before the hook that starts a step,
    which put the root's parameters back on the host buffer: its forward computed on the host copy, and the freed
    device copies' addresses, still taken for the parameters', could be reused by an activation that was then saved
    as a parameter (1 run in 4 off plain PyTorch, ParameterContainers above). Now it computes on its device copy."""
    read_at: list[int] = []

    class RootParameter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))
            self.a = nn.Linear(5, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            read_at.append(self.scale.untyped_storage().data_ptr())
            return self.a(torch.tanh(x * self.scale))

    host: list[int] = []
    trained = train(
        RootParameter,
        MemoryPolicy({}, offload_params=True),
        inspect=lambda replicas: host.append(replicas.host_params.untyped_storage().data_ptr()),
    )
    assert len(read_at) == DEVICES * STEPS and host[0] not in read_at
    torch.testing.assert_close(trained, reference(RootParameter), rtol=1e-5, atol=1e-6)


def test_attention_reads_its_out_proj_on_the_device_copy_under_whole_layer_offload() -> None:
    """``nn.MultiheadAttention`` (and every ``nn.Transformer*Layer``) reads ``out_proj.weight`` without calling
    ``out_proj``, so offload never brought it to the device: on a GPU, a device mismatch in the first forward. Its
    parameters are now the attention layer's own, fetched with it."""
    read_at: list[int] = []

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(5, 8)
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
            self.out = nn.Linear(8, 4)
            self.watching = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.watching:  # after offload's own pre-hook, which puts the layer on its device copy
                self.mha.register_forward_pre_hook(
                    lambda m, _: read_at.append(m.out_proj.weight.untyped_storage().data_ptr())
                )
                self.watching = True
            h = torch.tanh(self.inp(x)).unsqueeze(1).expand(-1, 3, -1).contiguous()
            attended, _ = self.mha(h, h, h)
            return self.out(attended.mean(1))

    host: list[int] = []
    trained = train(
        Attention,
        MemoryPolicy({}, offload_params=True),
        inspect=lambda replicas: host.append(replicas.host_params.untyped_storage().data_ptr()),
    )
    assert len(read_at) == DEVICES * STEPS and host[0] not in read_at
    torch.testing.assert_close(trained, reference(Attention), rtol=1e-5, atol=1e-6)


def test_a_model_refusal_on_one_device_is_the_error_the_step_raises() -> None:
    """Devices fail together under whole-layer offload: one device's refusal aborts the gradient sum, and a device
    before it then failed with a plain error that was raised instead (the worker exited 1, restarted in a loop)."""
    replicas = ReplicaSet(seeded(Tied), [torch.device("cpu")] * DEVICES, ParamLayout.of(seeded(Tied)()))
    finished: list[int] = []

    def run(index: int, replica: object) -> None:
        if index == 0:
            raise RuntimeError("device 0 stops summing: device 1 failed")
        time.sleep(0.1)  # the refusal comes after the consequence
        finished.append(index)
        raise ModelUnsupported("parameter 'a.weight' got a gradient twice in one backward")

    try:
        with pytest.raises(ModelUnsupported, match="gradient twice"):
            replicas._each(run)
        assert finished == [1]  # every device was out of the step before the error left it
    finally:
        replicas.close()

"""Host aggregation on CPU "devices" standing in for the GPUs of one host."""

import pytest
import torch

from pstrain.protos import pstrain_pb2 as pb
from pstrain.runtime.layout import ParamLayout
from pstrain.worker.data_feed import DataFeed
from pstrain.worker.devices import DeviceError, resolve_devices
from pstrain.worker.replicas import MemoryPolicy, ReplicaSet
from tests.helpers import bn_mlp, classification_set, odd_mlp


def seeded(factory):
    def build():
        torch.manual_seed(0)
        return factory()

    return build


def test_summed_gradient_equals_full_batch_gradient_times_devices():
    layout = ParamLayout.of(odd_mlp())
    replicas = ReplicaSet(seeded(odd_mlp), [torch.device("cpu")] * 3, layout)
    x, y = classification_set(12).tensors
    losses = replicas.forward_backward(list(x.chunk(3)), list(y.chunk(3)), torch.nn.functional.cross_entropy)
    summed = replicas.sum_gradients()

    reference = seeded(odd_mlp)()
    full = torch.nn.functional.cross_entropy(reference(x), y)
    full.backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(summed / 3, expected, rtol=1e-5, atol=1e-7)
    assert sum(losses) / 3 == pytest.approx(full.item(), rel=1e-5)
    # per-device gradients stay separate until the host sums them
    assert not torch.equal(replicas.replicas[0].flat_grads, replicas.replicas[1].flat_grads)


def test_gradients_do_not_accumulate_across_steps():
    layout = ParamLayout.of(odd_mlp())
    replicas = ReplicaSet(seeded(odd_mlp), [torch.device("cpu")] * 2, layout)
    x, y = classification_set(8).tensors
    loss = torch.nn.functional.cross_entropy
    replicas.forward_backward(list(x.chunk(2)), list(y.chunk(2)), loss)
    first = replicas.sum_gradients().clone()
    replicas.forward_backward(list(x.chunk(2)), list(y.chunk(2)), loss)
    assert torch.equal(replicas.sum_gradients(), first)


def test_loading_parameters_updates_every_replica_model():
    layout = ParamLayout.of(odd_mlp())
    replicas = ReplicaSet(seeded(odd_mlp), [torch.device("cpu")] * 2, layout)
    new = torch.linspace(-1, 1, layout.total)
    replicas.host_params.copy_(new)
    replicas.load_parameters()
    for replica in replicas.replicas:
        assert torch.equal(layout.flatten(replica.model), new)


def test_cpu_replicas_read_the_host_parameter_buffer_itself():
    """A pull writes the new version where a CPU replica reads it: loading a bucket or the model copies nothing."""
    layout = ParamLayout.of(odd_mlp())
    replicas = ReplicaSet(seeded(odd_mlp), [torch.device("cpu")] * 2, layout)
    new = torch.linspace(-1, 1, layout.total)
    replicas.host_params.copy_(new)  # no load_parameters()
    for replica in replicas.replicas:
        assert replica.flat_params.data_ptr() == replicas.host_params.data_ptr()
        assert torch.equal(layout.flatten(replica.model), new)
    x, y = classification_set(8).tensors
    replicas.forward_backward(list(x.chunk(2)), list(y.chunk(2)), torch.nn.functional.cross_entropy)
    assert torch.equal(replicas.host_params, new)  # forward and backward leave the parameters alone
    assert not torch.equal(replicas.replicas[0].flat_grads, replicas.replicas[1].flat_grads)  # grads stay apart


def test_buffers_come_from_the_first_replica():
    layout = ParamLayout.of(bn_mlp())
    replicas = ReplicaSet(seeded(bn_mlp), [torch.device("cpu")] * 2, layout)
    replicas.train()
    x, y = classification_set(8).tensors
    replicas.forward_backward(list(x.chunk(2)), list(y.chunk(2)), torch.nn.functional.cross_entropy)
    assert torch.equal(replicas.buffers()["1.running_mean"], replicas.replicas[0].model[1].running_mean)


def test_whole_layer_offload_refuses_a_gpu_named_twice_before_allocating():
    layout = ParamLayout.of(odd_mlp())
    offload = MemoryPolicy({}, offload_params=True)
    with pytest.raises(ValueError, match=r"name a GPU twice.*autograd thread"):
        ReplicaSet(odd_mlp, [torch.device("cuda", 0), torch.device("cuda")], layout, offload)  # no CUDA needed


def test_device_resolution_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert resolve_devices([], 3) == [torch.device("cpu")] * 3
    assert resolve_devices(["cpu", "cpu"], 9) == [torch.device("cpu")] * 2
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_devices(["cuda:0"], 1)
    with pytest.raises(DeviceError, match="unsupported device"):
        resolve_devices(["meta"], 1)
    with pytest.raises(DeviceError, match="at least 1"):
        resolve_devices([], 0)


class ListSource:
    def __init__(self, shards):
        self.shards = list(shards)
        self.completed = []

    def request(self):
        shard_id, indices = self.shards.pop(0)
        return pb.DataShard(data_shard_id=shard_id, indices=indices)

    def complete(self, shard_id):
        self.completed.append(shard_id)


def test_data_feed_spans_shards_and_reports_them_after_the_step():
    source = ListSource([(0, [0, 1, 2]), (1, [3, 4, 5, 6]), (2, [7, 8])])
    feed = DataFeed(classification_set(16), source)
    assert feed.next_indices(2) == [0, 1]
    feed.commit()
    assert source.completed == []
    assert feed.next_indices(4) == [2, 3, 4, 5]
    assert source.completed == [], "nothing is done before the step that used it is pushed"
    feed.commit()
    assert source.completed == [0]
    x, y = feed.next_batch(3)
    assert x.shape == (3, 5) and y.shape == (3,)
    feed.commit()
    assert source.completed == [0, 1, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_replicas_sum_through_pinned_host_memory():
    count = min(torch.cuda.device_count(), 2)
    layout = ParamLayout.of(odd_mlp())
    replicas = ReplicaSet(seeded(odd_mlp), [torch.device("cuda", i) for i in range(count)], layout)
    assert replicas.host_grads.is_pinned() and replicas.host_params.is_pinned()
    x, y = classification_set(4 * count).tensors
    replicas.forward_backward(list(x.chunk(count)), list(y.chunk(count)), torch.nn.functional.cross_entropy)
    reference = seeded(odd_mlp)()
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(replicas.sum_gradients() / count, expected, rtol=1e-4, atol=1e-6)


class BatchedReads(torch.utils.data.Dataset):
    """A dataset with ``__getitems__``, torch's batched fetch, that counts how it is read."""

    def __init__(self, data: torch.utils.data.TensorDataset) -> None:
        self.data = data
        self.batched: list[list[int]] = []
        self.single = 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        self.single += 1
        return self.data[index]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
        self.batched.append(list(indices))
        return [self.data[i] for i in indices]


def test_a_dataset_with_getitems_is_fetched_one_batch_per_call_as_the_dataloader_does():
    data = classification_set(16)
    dataset = BatchedReads(data)
    feed = DataFeed(dataset, ListSource([(0, [5, 1, 9]), (1, [2, 7])]))
    x, y = feed.next_batch(4)  # spans both shards
    assert dataset.batched == [[5, 1, 9, 2]] and dataset.single == 0
    expected = next(iter(torch.utils.data.DataLoader(data, batch_size=4, sampler=[5, 1, 9, 2])))
    assert torch.equal(x, expected[0]) and torch.equal(y, expected[1])
    plain = DataFeed(data, ListSource([(0, [5, 1, 9, 2])]))
    px, py = plain.next_batch(4)
    assert torch.equal(px, x) and torch.equal(py, y), "a batched fetch makes the same batch"


def test_peeking_reports_nothing_done_and_consumes_nothing():
    source = ListSource([(0, [0, 1]), (1, [2, 3, 4])])
    feed = DataFeed(classification_set(16), source)
    x, _ = feed.peek_batch(3)  # spans both shards
    feed.commit()
    assert x.shape == (3, 5) and source.completed == [], "a peeked shard is not trained on yet"
    assert feed.next_indices(3) == [0, 1, 2]
    feed.commit()
    assert source.completed == [0]

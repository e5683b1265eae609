"""The flat parameter layout: one owner for flatten, unflatten, bound views and PS-shard slices."""

import pytest
import torch
from torch import nn

from pstrain.runtime.factories import FactoryError
from pstrain.runtime.layout import LayoutError, ParamLayout
from tests.helpers import classification_set, odd_mlp


def seeded(seed: int, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return odd_mlp(**kwargs)


class Tied(nn.Module):
    """The same Linear twice: its weight is one parameter, stored once in the vector."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(torch.tanh(self.a(x))))


def test_offsets_follow_named_parameters_order():
    layout = ParamLayout.of(odd_mlp())
    assert layout.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert layout.shapes == ((7, 5), (7,), (4, 7), (4,))
    assert layout.offsets == (0, 35, 42, 70) and layout.total == 74
    assert ParamLayout.from_shapes(layout.names, [list(s) for s in layout.shapes]) == layout


def test_flatten_then_unflatten_round_trips():
    source, target = seeded(0), seeded(1)
    layout = ParamLayout.of(source)
    flat = layout.flatten(source)
    assert flat.dtype == torch.float32 and flat.shape == (74,)
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in source.parameters()]))
    assert not torch.equal(layout.flatten(target), flat)
    layout.unflatten_into(target, flat)
    assert torch.equal(layout.flatten(target), flat)
    for (name, mine), theirs in zip(target.named_parameters(), source.parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    flat[0] += 1  # flatten copies: the model does not see later writes
    assert target[0].weight[0, 0] != flat[0]


def test_views_are_named_pieces_of_the_vector():
    layout = ParamLayout.of(odd_mlp())
    flat = torch.arange(layout.total, dtype=torch.float32)
    views = layout.views(flat)
    assert [tuple(v.shape) for v in views] == list(layout.shapes)
    assert views[2][0, 0] == 42 and views[3][-1] == 73
    views[1][0] = -5
    assert flat[35] == -5


def test_bound_parameters_are_views_into_the_flat_buffer():
    model = seeded(0)
    layout = ParamLayout.of(model)
    before = layout.flatten(model)
    flat_params, flat_grads = torch.empty(layout.total), torch.zeros(layout.total)
    layout.bind(model, flat_params, flat_grads)
    assert torch.equal(flat_params, before), "binding keeps the model's values"
    flat_params.copy_(torch.linspace(-1, 1, layout.total))
    assert torch.equal(layout.flatten(model), flat_params)
    assert model[2].weight[0, 0] == flat_params[42]
    with torch.no_grad():
        model[0].bias.fill_(3.0)
    assert torch.equal(flat_params[35:42], torch.full((7,), 3.0))


def test_backward_accumulates_into_the_flat_grad_buffer():
    model, reference = seeded(0), seeded(0)
    layout = ParamLayout.of(model)
    flat_params, flat_grads = torch.empty(layout.total), torch.zeros(layout.total)
    layout.bind(model, flat_params, flat_grads)
    x, y = classification_set(8).tensors
    nn.functional.cross_entropy(model(x), y).backward()
    nn.functional.cross_entropy(reference(x), y).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    assert flat_grads.abs().sum() > 0
    assert torch.equal(flat_grads, expected)


def test_rebind_puts_replaced_and_dropped_grads_back_into_the_buffer():
    model = seeded(0)
    layout = ParamLayout.of(model)
    flat_grads = torch.zeros(layout.total)
    layout.bind(model, torch.empty(layout.total), flat_grads)
    model[0].weight.grad = torch.ones(7, 5)  # a hook replaced it: its values must reach the buffer
    model[2].bias.grad = None  # dropped (zero_grad(set_to_none=True)): bound again, values as they are
    flat_grads[70:74] = 9.0
    layout.rebind_grads(model, flat_grads)
    assert torch.equal(flat_grads[:35], torch.ones(35))
    assert torch.equal(flat_grads[70:], torch.full((4,), 9.0))
    flat_grads.fill_(2.0)
    for p in model.parameters():
        assert torch.equal(p.grad, torch.full(p.shape, 2.0)), "every .grad is a view again"


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 74, 80])
def test_shard_slices_cover_the_vector_exactly_once(num_shards):
    layout = ParamLayout.of(odd_mlp())
    flat = torch.arange(layout.total, dtype=torch.float32)
    slices = layout.shard_slices(flat, num_shards)
    assert len(slices) == num_shards
    assert torch.equal(torch.cat(slices), flat), "in order, no gap, no overlap"
    assert sum(s.numel() for s in slices) == layout.total
    ranges = layout.shard_ranges(num_shards)
    for r, piece in zip(ranges, slices, strict=True):
        assert piece.numel() == r.numel
        if piece.numel():
            assert piece.data_ptr() == flat[r.start :].data_ptr(), "a view, not a copy"


def test_shared_parameters_are_stored_once():
    model = Tied()
    layout = ParamLayout.of(model)
    assert layout.names == ("a.weight", "a.bias", "head.weight", "head.bias") and layout.total == 20
    flat_params, flat_grads = torch.empty(layout.total), torch.zeros(layout.total)
    layout.bind(model, flat_params, flat_grads)
    assert model.b.weight is model.a.weight and model.b.weight.data_ptr() == flat_params.data_ptr()
    model(torch.randn(4, 3)).sum().backward()
    assert torch.equal(flat_grads[:9], model.a.weight.grad.reshape(-1))


def test_a_parameter_that_is_not_float32_is_named():
    model = odd_mlp()
    model[2].double()
    with pytest.raises(LayoutError, match=r"parameter '2\.weight' is torch\.float64") as info:
        ParamLayout.of(model)
    assert isinstance(info.value, FactoryError), "callers that catch factory errors catch this one too"
    layout = ParamLayout.of(odd_mlp())
    with pytest.raises(LayoutError, match=r"'2\.weight'"):
        layout.check_matches(model)


def test_a_different_model_is_detected():
    layout = ParamLayout.of(odd_mlp())
    layout.check_matches(seeded(3))  # same architecture, other weights: fine
    with pytest.raises(
        LayoutError, match=r"parameter 0 is '0\.weight' \(8, 5\), the layout expects '0\.weight' \(7, 5\)"
    ):
        layout.check_matches(odd_mlp(hidden=8))
    with pytest.raises(LayoutError, match="has 6 parameters, the layout 4"):
        layout.check_matches(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4), nn.Linear(4, 4)))
    renamed = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 4))  # same shapes, names '1.*' instead of '2.*'
    with pytest.raises(LayoutError, match=r"parameter 2 is '1\.weight'"):
        layout.check_matches(renamed)
    for call in (
        lambda: layout.bind(renamed, torch.empty(74), torch.zeros(74)),
        lambda: layout.unflatten_into(renamed, torch.zeros(74)),
        lambda: layout.flatten(renamed),
    ):
        with pytest.raises(LayoutError):
            call()


def test_a_flat_buffer_of_the_wrong_size_is_refused():
    model = odd_mlp()
    layout = ParamLayout.of(model)
    before = layout.flatten(model)
    with pytest.raises(ValueError, match=r"shape \(73,\), the layout needs \(74,\)"):
        layout.unflatten_into(model, torch.zeros(73))
    flat_params = torch.empty(74)
    with pytest.raises(ValueError, match="the layout needs"):
        layout.bind(model, flat_params, torch.zeros(75))
    assert model[0].weight.data_ptr() != flat_params.data_ptr(), "a refused bind leaves the model alone"
    assert model[0].weight.grad is None
    with pytest.raises(ValueError, match="the layout needs"):
        layout.shard_slices(torch.zeros(2, 37), 2)
    assert torch.equal(layout.flatten(model), before)

"""model=[one callable per layer]: each layer seeded on its own (a rank building some layers gets
the weights a full build has), meta-device factories materialised to the eager build's values,
and the driver's meta copy probed and profiled one real layer at a time."""
from __future__ import annotations

import torch
from torch import nn

from sparkdl.model.layer_factories import LayerFactories, on_meta, real_layers


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))


def meta_block() -> nn.Module:
    with torch.device("meta"):
        return block()


FACTORIES = [lambda: nn.Embedding(11, 8), block, block, lambda: nn.Linear(8, 11)]


def test_a_rank_building_some_layers_gets_the_full_builds_weights() -> None:
    factories = LayerFactories.of(FACTORIES)
    assert factories is not None and len(factories) == 4
    full = factories.build(seed=3)
    part = factories.build(seed=3, layers=[1, 2])
    assert isinstance(part[0], nn.Identity) and isinstance(part[3], nn.Identity)
    for i in (1, 2):
        for (name, a), (_, b) in zip(full[i].state_dict().items(), part[i].state_dict().items()):
            assert torch.equal(a, b), (i, name)
    assert not torch.equal(full[1][0].weight, full[2][0].weight)  # each layer has its own seed
    assert not torch.equal(full[1][0].weight, factories.build(seed=4)[1][0].weight)


def test_a_meta_factory_materialises_to_the_eager_build() -> None:
    eager = LayerFactories.of([block, block]).build(seed=0)
    lazy = LayerFactories.of([meta_block, meta_block]).build(seed=0)
    assert not on_meta(lazy)
    for (name, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_building_leaves_the_callers_generator_alone() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    LayerFactories.of(FACTORIES).build(seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_the_driver_copy_is_meta_and_its_layers_real_one_at_a_time() -> None:
    copy = LayerFactories.of(FACTORIES).build(seed=0, device="meta")
    assert on_meta(copy) and sum(p.numel() for p in copy.parameters()) == 11 * 8 + 2 * (8 * 16 + 16 + 32 + 16 * 8 + 8) + 8 * 11 + 11
    x = torch.randint(0, 11, (4,))
    for layer in real_layers(copy):
        assert not on_meta(layer)
        x = layer(x)
    assert x.shape == (4, 11) and on_meta(copy)


def test_lists_of_modules_and_single_factories_are_not_layer_factories() -> None:
    assert LayerFactories.of([nn.Linear(2, 2), nn.ReLU()]) is None
    assert LayerFactories.of(block) is None and LayerFactories.of([]) is None


class Table(nn.Module):
    """Owns a parameter and no reset method: a meta build cannot be made real."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[0]


def test_children_are_reset_before_their_parent_and_ownerless_tensors_are_refused() -> None:
    import pytest

    from sparkdl.errors import ModelError

    def attention() -> nn.Module:
        return nn.MultiheadAttention(8, 2)

    def attention_on_meta() -> nn.Module:
        with torch.device("meta"):
            return attention()

    eager, lazy = LayerFactories.of([attention]).build(0), LayerFactories.of([attention_on_meta]).build(0)
    for (name, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)  # out_proj.bias 0, as __init__ leaves it
    with pytest.raises(ModelError, match="Table was built on the meta device but has no reset_parameters"):
        LayerFactories.of([lambda: Table().to("meta")]).build(0)

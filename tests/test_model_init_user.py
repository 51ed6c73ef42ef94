"""A user's own init entry point, named to ``reset_parameters(model, model_init=...)``: run per block, or refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import packedinit
from packedinit.errors import PackedInitError

E = 32


class Net(nn.Module):
    """A model whose own init (run by its constructor) sets a parameter no torch default covers."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, 4)
        self.scale = nn.Parameter(torch.empty(E))
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.constant_(self.scale, 0.5)
        nn.init.xavier_uniform_(self.attn.in_proj_weight)  # fan-dependent on a packed (3E, E) weight


def _meta_net() -> Net:
    with torch.device("meta"):
        net = Net()
    net.to_empty(device="cpu")
    return net


def test_named_method_runs_after_torch_defaults_with_packed_calls_per_block() -> None:
    net = _meta_net()
    packedinit.reset_parameters(net, model_init="init_weights")
    assert torch.equal(net.scale.detach(), torch.full((E,), 0.5))
    w = net.attn.in_proj_weight.detach()
    assert float(w.abs().max()) <= (6 / (2 * E)) ** 0.5  # per q, k, v block
    assert float(w.abs().max()) > (6 / (4 * E)) ** 0.5  # not the packed (3E, E) bound


def test_a_function_of_the_model_is_run() -> None:
    net = _meta_net()
    packedinit.reset_parameters(net, model_init=lambda m: nn.init.ones_(m.scale))
    assert torch.equal(net.scale.detach(), torch.ones(E))


def test_without_it_the_parameter_is_refused_by_name() -> None:
    net = _meta_net()
    with pytest.raises(PackedInitError, match=r"'scale' \(shape \(32,\), in Net\)"):
        packedinit.reset_parameters(net)


def test_a_missing_method_is_refused_before_any_write() -> None:
    net = _meta_net()
    before = net.attn.in_proj_weight.detach().clone()
    with pytest.raises(PackedInitError, match=r"model_init='init_'\): the model has no method 'init_'"):
        packedinit.reset_parameters(net, model_init="init_")
    assert torch.equal(before.view(torch.int32), net.attn.in_proj_weight.detach().view(torch.int32))


def test_an_entry_point_failing_on_meta_is_refused_by_name_before_any_write() -> None:
    net = _meta_net()
    before = net.attn.in_proj_weight.detach().clone()

    def needs_values(m: nn.Module) -> None:
        m.scale.copy_(m.scale.new_tensor(m.scale.detach().abs().max().item()))  # reads values: fails on meta

    with pytest.raises(PackedInitError, match=r"model_init .*needs_values, fails on meta stand-ins"):
        packedinit.reset_parameters(net, model_init=needs_values)
    assert torch.equal(before.view(torch.int32), net.attn.in_proj_weight.detach().view(torch.int32))


def test_deferred_materialize_takes_it_too() -> None:
    with packedinit.deferred() as construction:
        net = Net()
    construction.materialize(net, device="cpu", model_init="init_weights")
    assert torch.equal(net.scale.detach(), torch.full((E,), 0.5))
    assert float(net.attn.in_proj_weight.detach().abs().max()) <= (6 / (2 * E)) ** 0.5


def test_a_wrong_type_is_refused() -> None:
    with pytest.raises(PackedInitError, match=r"needs a method name or a function of the model, got int"):
        packedinit.reset_parameters(nn.Linear(2, 2), model_init=3)  # type: ignore[arg-type]


def test_generator_is_routed_through_the_entry_point_and_the_global_rng_is_untouched() -> None:
    class Noisy(Net):
        def init_weights(self) -> None:
            nn.init.normal_(self.scale, std=0.1)  # takes no generator: drawn from the routed default RNG
            super().init_weights()
            nn.init.normal_(self.scale, std=0.1)

    def build() -> Noisy:
        with torch.device("meta"):
            net = Noisy()
        net.to_empty(device="cpu")
        return net

    state = torch.get_rng_state()
    a, b = build(), build()
    packedinit.reset_parameters(a, model_init="init_weights", generator=torch.Generator().manual_seed(1))
    packedinit.reset_parameters(b, model_init="init_weights", generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.get_rng_state(), state)
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert 0.05 < float(a.scale.detach().std()) < 0.2

"""Marks survive copies of a sub-module; torch's old weight_norm hook on RNN weights is per gate (issue 28)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.init import orthogonal_, xavier_uniform_

import packedinit
from packedinit import Layout, chunked

E = 8
QKV = Layout(0, [E] * 3)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)


def annotated_block() -> Block:
    return packedinit.annotate(Block(), **{"qkv.weight": QKV})


@pytest.mark.parametrize(
    "copies",
    [
        copy.copy,
        copy.deepcopy,
        lambda m: copy.deepcopy(copy.copy(m)),
        lambda m: copy.deepcopy(copy.deepcopy(copy.copy(m))),
    ],
    ids=["copy", "deepcopy", "deepcopy(copy)", "deepcopy(deepcopy(copy))"],
)
def test_marks_survive_copies_of_a_sub_module(copies: Callable[[nn.Module], nn.Module]) -> None:
    """Before: after deepcopy(copy(...)) layouts() said packed and the bare-parameter idiom ran one block."""
    block = annotated_block()
    qkv = copies(block.qkv)
    assert packedinit.layouts(qkv) == {"weight": QKV}
    chunked(orthogonal_)(qkv.weight)  # the bare-parameter idiom: per q/k/v block
    for part in qkv.weight.detach().split(E):
        assert torch.allclose(part @ part.T, torch.eye(E), atol=1e-5)


def test_a_deep_copy_of_a_shallow_copy_does_not_claim_the_original() -> None:
    block = annotated_block()
    deep = copy.deepcopy(copy.copy(block.qkv))
    assert deep.weight is not block.qkv.weight
    before = block.qkv.weight.detach().clone()
    chunked(xavier_uniform_)(deep.weight)
    assert torch.equal(block.qkv.weight, before)


def hooked_lstm() -> nn.LSTM:
    lstm = nn.LSTM(4, E)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook for the parametrization
        torch.nn.utils.weight_norm(lstm, "weight_hh_l0")
    return lstm


def test_hook_weight_norm_on_an_lstm_weight_is_per_gate() -> None:
    """Before: chunked(f)(lstm) wrote weight_hh_l0_v as one block and left g stale."""
    lstm = hooked_lstm()
    assert packedinit.layouts(lstm)["weight_hh_l0_v"] == Layout(0, [E] * 4, names=("i", "f", "g", "o"))
    chunked(orthogonal_)(lstm)
    v = lstm.weight_hh_l0_v.detach()
    for gate in v.split(E):
        assert torch.allclose(gate @ gate.T, torch.eye(E), atol=1e-5)
    assert torch.allclose(lstm.weight_hh_l0_g.detach(), v.norm(dim=1, keepdim=True))  # g = ||v||: weight = v
    lstm(torch.zeros(2, 1, 4))  # the hook recomputes the weight from g and v
    assert torch.allclose(lstm.weight_hh_l0.detach(), v, atol=1e-6)


def test_hook_and_parametrization_weight_norm_give_the_same_weight() -> None:
    torch.manual_seed(0)
    hooked = hooked_lstm()
    torch.manual_seed(0)
    para = torch.nn.utils.parametrizations.weight_norm(nn.LSTM(4, E), "weight_hh_l0")
    torch.manual_seed(1)
    chunked(orthogonal_)(hooked)
    torch.manual_seed(1)
    chunked(orthogonal_)(para)
    hooked(torch.zeros(2, 1, 4))
    assert torch.allclose(hooked.weight_hh_l0.detach(), para.weight_hh_l0.detach(), atol=1e-6)

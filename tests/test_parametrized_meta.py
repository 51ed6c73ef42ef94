"""Parametrized packed weights built on meta: handled, or refused with a PackedInitError (issue 28).

``parametrizations.orthogonal`` registered on a meta ``nn.MultiheadAttention.in_proj_weight`` leaves
torch's trivialization ``base`` unset, so evaluating the weight raises a bare ``TypeError``; before,
``packedinit.layouts``, ``to_empty`` + ``reset_parameters`` and ``deferred`` all raised it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import packedinit
from packedinit import Layout, PackedInitError

E = 8
QKV = Layout(0, (E, E, E), names=("q", "k", "v"))


def meta_orthogonal_mha() -> nn.MultiheadAttention:
    with torch.device("meta"):
        m = nn.MultiheadAttention(E, 2)
        parametrizations.orthogonal(m, "in_proj_weight")
    return m


def test_layouts_of_a_meta_orthogonal_mha() -> None:
    assert packedinit.layouts(meta_orthogonal_mha()) == {
        "in_proj_bias": QKV,
        "parametrizations.in_proj_weight.original": QKV,
    }


def orthonormal_columns(m: nn.MultiheadAttention) -> bool:
    w = m.in_proj_weight.detach()  # (3E, E): tall, so its columns are orthonormal
    return torch.allclose(w.T @ w, torch.eye(E), atol=1e-5)


def test_to_empty_then_reset_parameters_of_a_meta_orthogonal_mha() -> None:
    m = meta_orthogonal_mha()
    m.to_empty(device="cpu")
    packedinit.reset_parameters(m)
    assert orthonormal_columns(m)
    assert not m.in_proj_bias.detach().any()


def test_deferred_of_an_orthogonal_mha() -> None:
    with packedinit.deferred() as construction:
        m = nn.MultiheadAttention(E, 2)
        parametrizations.orthogonal(m, "in_proj_weight")
    assert construction.materialize(m, device="cpu") == []  # nothing to replay, and no warning
    assert orthonormal_columns(m)


class Broken(nn.Module):
    """A parametrization that cannot be evaluated as it stands (not one packedinit knows how to size)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("needs a calibration step first")


def test_a_parametrization_that_cannot_be_evaluated_is_a_packed_init_error() -> None:
    m = nn.MultiheadAttention(E, 2)
    parametrize.register_parametrization(m, "in_proj_weight", Broken(), unsafe=True)
    before = m.parametrizations.in_proj_weight.original.detach().clone()
    with pytest.raises(PackedInitError, match=r"Broken.*cannot be evaluated.*needs a calibration.*Fix: register") as e:
        packedinit.reset_parameters(m)
    assert isinstance(e.value, RuntimeError)  # the torch error's type is kept
    assert torch.equal(m.parametrizations.in_proj_weight.original, before)

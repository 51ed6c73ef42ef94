"""Explicit chunks that contradict a known layout are refused before any write (issue 28)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn.init import orthogonal_, xavier_uniform_

import packedinit
from packedinit import Layout, PackedInitError, chunked, chunked_init

E = 8
PER_BLOCK = (6 / (2 * E)) ** 0.5
KNOWN = r"known to be packed as Layout\(dim=0, sizes=\(8, 8, 8\), names=\('q', 'k', 'v'\)\)"


def annotated_mha() -> nn.MultiheadAttention:
    return packedinit.annotate(nn.MultiheadAttention(E, 2))


@pytest.mark.parametrize("how", ["chunked_init", "chunked"])
def test_other_chunks_on_an_annotated_in_proj_weight_are_refused(how: str) -> None:
    """Before: four 2-row blocks over a weight packedinit knows to be q/k/v, silently."""
    mha = annotated_mha()
    before = mha.in_proj_weight.detach().clone()
    call = (
        (lambda: chunked_init(mha.in_proj_weight, 4, 0, xavier_uniform_))
        if how == "chunked_init"
        else (lambda: chunked(xavier_uniform_, 4)(mha.in_proj_weight))
    )
    with pytest.raises(PackedInitError, match=KNOWN + r".*sizes=\(6, 6, 6, 6\).*Nothing was written.*annotate"):
        call()
    assert torch.equal(mha.in_proj_weight, before)


@pytest.mark.parametrize(
    "chunks", [3, [E, E, E], (E, E, E), Layout(0, (E, E, E)), Layout(0, (E, E, E), names=("a", "b", "c"))]
)
def test_the_known_blocks_given_explicitly_still_work(chunks: object) -> None:
    mha = annotated_mha()
    chunked_init(mha.in_proj_weight, chunks, None if isinstance(chunks, Layout) else 0, xavier_uniform_)  # type: ignore[arg-type]
    assert float(mha.in_proj_weight.detach().abs().max()) > (6 / (4 * E)) ** 0.5


def test_an_explicit_one_block_and_the_documented_overrides_still_work() -> None:
    mha = annotated_mha()
    chunked_init(mha.in_proj_weight, 1, 0, xavier_uniform_)  # the whole tensor, on purpose
    assert float(mha.in_proj_weight.detach().abs().max()) <= (6 / (4 * E)) ** 0.5
    chunked_init(mha.in_proj_weight.data, 4, 0, orthogonal_)  # .data carries no layout
    block = mha.in_proj_weight.detach()[:6]
    assert torch.allclose(block @ block.T, torch.eye(6), atol=1e-5)
    packedinit.annotate(mha, in_proj_weight=Layout(0, [6] * 4))  # or annotate the blocks you mean
    chunked_init(mha.in_proj_weight, 4, 0, xavier_uniform_)
    assert float(mha.in_proj_weight.detach().abs().max()) <= (6 / (6 + E)) ** 0.5


def test_an_unannotated_parameter_takes_any_chunks() -> None:
    mha = nn.MultiheadAttention(E, 2)  # nothing known about the bare Parameter
    chunked_init(mha.in_proj_weight, 4, 0, xavier_uniform_)
    assert float(mha.in_proj_weight.detach().abs().max()) <= (6 / (6 + E)) ** 0.5


def test_an_annotated_lstm_gate_weight_refuses_two_chunks() -> None:
    lstm = packedinit.annotate(nn.LSTM(4, 4))
    before = lstm.weight_hh_l0.detach().clone()
    with pytest.raises(PackedInitError, match=r"known to be packed as Layout\(dim=0, sizes=\(4, 4, 4, 4\)"):
        chunked_init(lstm.weight_hh_l0, 2, 0, orthogonal_)
    assert torch.equal(lstm.weight_hh_l0, before)


@given(n=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 24]))
def test_property_explicit_chunks_on_a_known_layout(n: int) -> None:
    mha = annotated_mha()
    before = mha.in_proj_weight.detach().clone()
    if n in (1, 3):
        chunked_init(mha.in_proj_weight, n, 0, xavier_uniform_)
        assert not torch.equal(mha.in_proj_weight, before)
    else:
        with pytest.raises(PackedInitError, match=KNOWN):
            chunked_init(mha.in_proj_weight, n, 0, xavier_uniform_)
        assert torch.equal(mha.in_proj_weight, before)

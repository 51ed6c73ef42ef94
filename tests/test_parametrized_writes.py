"""A packed tensor under a parametrization gets the per-block init in the tensor the module computes.

``weight_norm`` keeps the blocks in ``original1`` (``v``) and the norm in ``original0`` (``g``):
writing ``v`` per block and leaving ``g`` stale gave ``weight = g * v / ||v||`` a wrong scale,
silently, on every idiom but ``reset_parameters``. Now each idiom initialises a stand-in of the
weight per block and writes it through ``right_inverse`` (``g = ||w||``, ``v = w``), as
``module.weight = w`` does; ``spectral_norm`` redraws its power-iteration vectors.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.init import ones_, orthogonal_, xavier_uniform_
from torch.nn.utils import parametrizations

import packedinit
from packedinit import Layout, PackedInitError

E = 16
BLOCK = (6 / (2 * E)) ** 0.5  # xavier per (E, E) block
WHOLE = (6 / (4 * E)) ** 0.5  # xavier on the packed (3E, E) tensor


def _mha() -> nn.MultiheadAttention:
    return parametrizations.weight_norm(nn.MultiheadAttention(E, 2), "in_proj_weight")


def _per_block(mha: nn.MultiheadAttention) -> None:
    w = mha.in_proj_weight.detach()
    for b in range(3):
        top = w[b * E : (b + 1) * E].abs().max().item()
        assert WHOLE * 1.05 < top <= BLOCK + 1e-6, (b, top)
    g, v = mha.parametrizations.in_proj_weight.original0, mha.parametrizations.in_proj_weight.original1
    assert torch.allclose(g, v.norm(dim=1, keepdim=True))  # g = ||w||: the weight is v itself


def test_whole_model_call_on_weight_normed_mha_is_per_block() -> None:
    torch.manual_seed(0)
    mha = _mha()
    packedinit.chunked(xavier_uniform_)(mha)
    _per_block(mha)


def test_apply_idiom_on_weight_normed_mha_is_per_block() -> None:
    torch.manual_seed(0)
    mha = _mha()
    mha.apply(packedinit.chunked(xavier_uniform_))
    _per_block(mha)


def test_init_model_on_weight_normed_mha_is_per_block_and_keeps_the_parameters() -> None:
    mha = _mha()
    before = [id(p) for p in mha.parameters()]
    packedinit.init_model(mha, xavier_uniform_, generator=torch.Generator().manual_seed(0))
    _per_block(mha)
    assert [id(p) for p in mha.parameters()] == before


def _linears(seed: int) -> tuple[nn.Linear, nn.Linear]:
    """An annotated plain Linear and the same one weight-normed (annotated through the parametrization)."""
    torch.manual_seed(seed)
    plain = packedinit.annotate(nn.Linear(8, 24), weight=Layout(0, [8, 8, 8]))
    normed = parametrizations.weight_norm(nn.Linear(8, 24))
    packedinit.annotate(normed, weight=Layout(0, [8, 8, 8]))
    return plain, normed


def test_bare_parameter_loop_on_weight_normed_linear_matches_the_plain_module() -> None:
    """The loop reaches g (24, 1) and v (24, 8): g is left (v's write sets it), so the draws are the plain loop's."""
    plain, normed = _linears(0)
    for order in (1, -1):  # g before v (parameters() order), and v before g
        torch.manual_seed(1)
        for p in plain.parameters():
            if p.dim() > 1:
                packedinit.chunked(xavier_uniform_)(p)
        torch.manual_seed(1)
        for p in list(normed.parameters())[::order]:
            if p.dim() > 1:
                packedinit.chunked(xavier_uniform_)(p)
        assert torch.allclose(normed.weight, plain.weight, atol=1e-6), order


def test_chunked_init_on_the_annotated_original_matches_the_plain_module() -> None:
    plain, normed = _linears(0)
    torch.manual_seed(2)
    packedinit.chunked_init(plain.weight, init_fn=xavier_uniform_)
    torch.manual_seed(2)
    packedinit.chunked_init(normed.parametrizations.weight.original1, init_fn=xavier_uniform_)
    assert torch.allclose(normed.weight, plain.weight, atol=1e-6)


def test_whole_model_on_weight_normed_linear_matches_the_plain_module() -> None:
    plain, normed = _linears(0)
    packedinit.init_model(plain, xavier_uniform_, generator=torch.Generator().manual_seed(3))
    packedinit.init_model(normed, xavier_uniform_, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(normed.weight, plain.weight, atol=1e-6)


def test_a_partial_init_keeps_the_other_blocks_of_the_weight() -> None:
    _, normed = _linears(0)
    before = normed.weight.detach().clone()
    blocks = {1: ones_}
    packedinit.chunked_init(normed.parametrizations.weight.original1, init_fn=blocks)
    w = normed.weight.detach()
    assert torch.allclose(w[8:16], torch.ones(8, 8), atol=1e-6)
    assert torch.allclose(w[:8], before[:8], atol=1e-6)
    assert torch.allclose(w[16:], before[16:], atol=1e-6)


def test_a_rejected_call_writes_nothing() -> None:
    mha = _mha()
    held = mha.parametrizations.in_proj_weight
    before = [t.detach().clone() for t in (held.original0, held.original1)]
    state = torch.get_rng_state()
    with pytest.raises(PackedInitError, match="nonlinearity"):
        packedinit.chunked(torch.nn.init.kaiming_uniform_)(mha, nonlinearity="bogus")
    assert all(torch.equal(a, b) for a, b in zip(before, (held.original0, held.original1), strict=True))
    assert torch.equal(state, torch.get_rng_state())


def test_spectral_norm_redraws_its_vectors_for_the_new_weight() -> None:
    """weight = original / sigma: with the old vectors sigma was the old weight's; now the new one's (in eval)."""
    torch.manual_seed(0)
    lin = parametrizations.spectral_norm(nn.Linear(8, 24))
    packedinit.annotate(lin, weight=Layout(0, [8, 8, 8]))
    with torch.no_grad():
        lin.parametrizations.weight.original.mul_(50)  # far from what the vectors were drawn for
    packedinit.chunked(xavier_uniform_)(lin)
    lin.eval()
    assert abs(torch.linalg.matrix_norm(lin.weight.detach(), 2).item() - 1) < 1e-2
    original = lin.parametrizations.weight.original.detach()
    assert original[:8].abs().max() <= (6 / 16) ** 0.5  # the unnormalised weight is per block


def test_orthogonal_is_written_as_module_weight_assignment() -> None:
    """orthogonal's original is not the weight: the per-block stand-in is written as ``module.weight = w``."""
    torch.manual_seed(0)
    plain = packedinit.annotate(nn.Linear(8, 8), weight=Layout(0, [4, 4]))
    lin = parametrizations.orthogonal(nn.Linear(8, 8))
    packedinit.annotate(lin, weight=Layout(0, [4, 4]))
    ref = copy.deepcopy(lin)
    torch.manual_seed(1)
    packedinit.chunked(orthogonal_)(plain)
    torch.manual_seed(1)
    packedinit.chunked(orthogonal_)(lin)
    with torch.no_grad():
        ref.weight = plain.weight.detach().clone()
    assert torch.allclose(lin.weight, ref.weight, atol=1e-5)


def test_explicit_chunks_on_an_annotated_original_are_refused_naming_the_fix() -> None:
    """chunks given by hand on v would write v per block and leave g stale: loud, nothing written."""
    _, normed = _linears(0)
    held = normed.parametrizations.weight
    before = [t.detach().clone() for t in (held.original0, held.original1)]
    with pytest.raises(PackedInitError, match=r"init the module instead: packedinit.chunked\(xavier_uniform_\)"):
        packedinit.chunked(xavier_uniform_, 3)(held.original1)
    with pytest.raises(PackedInitError, match="original of a packed parametrized tensor"):
        packedinit.chunked_init(held.original1, Layout(0, [8, 8, 8]), None, xavier_uniform_)
    assert all(torch.equal(a, b) for a, b in zip(before, (held.original0, held.original1), strict=True))


def test_torch_init_calls_under_fix_torch_defaults_go_through_the_parametrization() -> None:
    """``torch.nn.init.xavier_uniform_(p)`` in a loop while the fix is on: per block in the weight, both ways."""
    plain, normed = _linears(0)
    for model in (plain, normed):
        torch.manual_seed(4)
        with packedinit.fix_torch_defaults():
            for p in model.parameters():
                if p.dim() > 1:
                    torch.nn.init.xavier_uniform_(p)
    assert torch.allclose(normed.weight, plain.weight, atol=1e-6)
    torch.manual_seed(0)
    mha = _mha()  # known through its adapter: the model handed to the fix
    with packedinit.fix_torch_defaults(mha):
        for p in mha.parameters():
            if p.dim() > 1:
                torch.nn.init.xavier_uniform_(p)
    _per_block(mha)


class Doubled(nn.Module):
    """A user parametrization keeping the shape: ``weight = 2 * original``, with its right inverse."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        return w / 2


def test_a_user_parametrization_with_a_right_inverse_gets_the_blocks_in_its_weight() -> None:
    torch.manual_seed(0)
    plain = packedinit.annotate(nn.Linear(8, 24), weight=Layout(0, [8, 8, 8]))
    lin = nn.Linear(8, 24)
    torch.nn.utils.parametrize.register_parametrization(lin, "weight", Doubled())
    packedinit.annotate(lin, weight=Layout(0, [8, 8, 8]))
    packedinit.init_model(plain, xavier_uniform_, generator=torch.Generator().manual_seed(5))
    packedinit.init_model(lin, xavier_uniform_, generator=torch.Generator().manual_seed(5))
    assert torch.equal(lin.weight, plain.weight)

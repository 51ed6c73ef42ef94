"""Issue 18's measured cases on plain torch modules: the coverage check sees every write, parametrized
and tied models materialise, and adapters claim only what they know."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize

import packedinit
from packedinit import PackedInitError, reset_parameters
from packedinit.engine.distributed import global_params


def on_meta(make: Callable[[], nn.Module], *, keep_ties: bool = False) -> nn.Module:
    with torch.device("meta"):
        model = make()
    if keep_ties:
        packedinit.to_empty(model, device="cpu")
    else:
        model.to_empty(device="cpu")
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point():
                t.fill_(math.nan)
    return model


def state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


# -- 1. the coverage check sees every write ------------------------------------------------------
class Orthogonal(nn.Module):
    """A reset_parameters() that uses orthogonal_, a no-op on meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(6, 6))
        self.k = nn.Parameter(torch.empty(4, 4, 3))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.orthogonal_(self.w)
        nn.init.dirac_(self.k)


class Rope(nn.Module):
    """litgpt-style: reset_parameters() assigns the rotary buffers (``self.cos, self.sin = self.rope_cache()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("cos", torch.empty(4, 8), persistent=False)
        self.register_buffer("sin", torch.empty(4, 8), persistent=False)
        self.reset_parameters()

    def rope_cache(self) -> tuple[Tensor, Tensor]:
        t = torch.arange(4.0)[:, None] * torch.arange(8.0)[None]
        return t.cos(), t.sin()

    def reset_parameters(self) -> None:
        self.cos, self.sin = self.rope_cache()


@pytest.mark.parametrize("meta", [False, True])
def test_init_functions_that_are_no_ops_on_meta_count_as_writes(meta: bool) -> None:
    # Before: strict refused 'w' and 'k' (orthogonal_/dirac_ return early on the meta stand-ins).
    model = on_meta(Orthogonal) if meta else Orthogonal()
    reset_parameters(model)
    assert torch.allclose(model.w @ model.w.T, torch.eye(6), atol=1e-5)
    assert torch.equal(model.k, nn.init.dirac_(torch.empty(4, 4, 3)))


def test_a_litgpt_style_reset_that_assigns_buffers_is_covered_and_bit_identical() -> None:
    # Before: 'cos' and 'sin' were reported uncovered, with a fix telling Rope to get a reset_parameters().
    torch.manual_seed(0)
    normal = Rope()
    torch.manual_seed(0)
    flow = on_meta(Rope)
    reset_parameters(flow)
    assert torch.equal(flow.cos, normal.cos)
    assert torch.equal(flow.sin, normal.sin)
    assert torch.equal(flow.proj.weight, normal.proj.weight)


class Forgets(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(3))
        self.b = nn.Parameter(torch.ones(3))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.a)


def test_the_message_never_asks_for_a_method_the_module_has() -> None:
    with pytest.raises(PackedInitError, match=r"'b' .*make the reset_parameters\(\) of Forgets fill them") as e:
        reset_parameters(Forgets())
    assert "give Forgets a reset_parameters" not in str(e.value)
    assert "'a'" not in str(e.value)


# -- 2. parametrizations ---------------------------------------------------------------------------
def test_weight_norm_conv_materialises_with_the_normal_builds_originals() -> None:
    # Before: strict refused parametrizations.weight.original0/1; strict=False left them NaN.
    def make() -> nn.Module:
        return parametrizations.weight_norm(nn.Conv1d(4, 6, 3), dim=2)

    torch.manual_seed(0)
    normal = make()
    torch.manual_seed(0)
    flow = on_meta(make)
    reset_parameters(flow)
    assert all(torch.equal(a, b) for a, b in zip(state(normal).values(), state(flow).values(), strict=True))


def test_spectral_norm_redraws_its_vectors_as_registration_did() -> None:
    def make() -> nn.Module:
        return parametrizations.spectral_norm(nn.Linear(6, 5))

    torch.manual_seed(0)
    normal = make()
    torch.manual_seed(0)
    flow = on_meta(make)
    reset_parameters(flow)
    assert state(normal).keys() == state(flow).keys()
    assert all(torch.allclose(a, b) for a, b in zip(state(normal).values(), state(flow).values(), strict=True))


def test_orthogonal_parametrization_resets_a_normally_built_module() -> None:
    lin = parametrizations.orthogonal(nn.Linear(5, 5))
    reset_parameters(lin)
    assert torch.allclose(lin.weight @ lin.weight.T, torch.eye(5), atol=1e-5)


def test_old_weight_norm_hooks_still_work() -> None:
    def make() -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook-based weight_norm
            return torch.nn.utils.weight_norm(nn.Linear(5, 4))

    torch.manual_seed(0)
    normal = make()
    torch.manual_seed(0)
    flow = on_meta(make)
    reset_parameters(flow)
    assert torch.equal(flow.weight_v, normal.weight_v)
    assert torch.equal(flow.weight_g, normal.weight_g)


class Identity(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


def test_a_packed_layout_survives_a_parametrization() -> None:
    # Before: the LSTM adapter's 'weight_hh_l0' claim raised (no such parameter) or the original was one block.
    lstm = nn.LSTM(4, 8)
    parametrize.register_parametrization(lstm, "weight_hh_l0", Identity())
    assert packedinit.layouts(lstm)["parametrizations.weight_hh_l0.original"].sizes == (8, 8, 8, 8)
    packedinit.chunked(nn.init.orthogonal_)(lstm)
    w = lstm.parametrizations.weight_hh_l0.original
    for g in range(4):
        block = w[8 * g : 8 * (g + 1)]
        assert torch.allclose(block @ block.T, torch.eye(8), atol=1e-5)


def test_audit_of_a_weight_normed_mha_works() -> None:
    # Before: audit raised "fix the adapter's names" (in_proj_weight is no Parameter any more).
    mha = parametrizations.weight_norm(nn.MultiheadAttention(16, 2), "in_proj_weight")
    report = packedinit.audit(mha)
    assert "parametrizations.in_proj_weight.original1" in report
    bad = parametrizations.weight_norm(nn.Linear(4, 4), dim=None)  # g is a scalar, v the matrix
    packedinit.annotate(bad.parametrizations.weight, original1=packedinit.Layout(0, (2, 2)))
    assert "parametrizations.weight.original1" in packedinit.layouts(bad)


# -- 3. ties ----------------------------------------------------------------------------------------
class NanoGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 16)
        self.h = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.wte.weight  # nanoGPT's plain tie


def test_a_plain_tie_is_kept_through_packedinit_to_empty() -> None:
    # Before: no way to keep it (model.to_empty unties it silently).
    assert on_meta(NanoGPT).lm_head.weight is not on_meta(NanoGPT).wte.weight  # what torch does
    model = on_meta(NanoGPT, keep_ties=True)
    assert model.lm_head.weight is model.wte.weight
    reset_parameters(model)
    assert model.lm_head.weight is model.wte.weight
    assert bool(model.wte.weight.isfinite().all())
    assert abs(float(model.wte.weight.detach().std()) - 1.0) < 0.15


# -- 5. adapters claim only what they know ----------------------------------------------------------
class LearnedH0(nn.GRU):
    def __init__(self) -> None:
        super().__init__(4, 8)
        self.h0 = nn.Parameter(torch.zeros(1, 1, 8))


class GainCell(nn.GRUCell):
    def __init__(self) -> None:
        super().__init__(4, 8)
        self.gain = nn.Parameter(torch.ones(1))


@pytest.mark.parametrize("make", [LearnedH0, GainCell])
def test_extra_parameters_of_rnn_subclasses_are_one_block(make: Callable[[], nn.Module]) -> None:
    # Before: layouts / chunked / audit raised "dim 0 has length 1 ... fix sizes/groups or dim".
    model = make()
    extra = "h0" if make is LearnedH0 else "gain"
    assert extra not in packedinit.layouts(model)
    assert len(packedinit.layouts(model)) == 4
    packedinit.chunked(nn.init.ones_)(model)
    assert bool(getattr(model, extra).eq(1).all())
    assert extra not in packedinit.audit(model)


def test_audit_skips_lazy_modules_with_a_line() -> None:
    # Before: torch's "uninitialized parameter" error.
    report = packedinit.audit(nn.Sequential(nn.MultiheadAttention(64, 4), nn.LazyLinear(4)))
    assert "0.in_proj_weight" in report
    assert "2 lazy parameter(s) skipped (not materialised yet: 1.weight, 1.bias)" in report.summary()


def test_the_distributed_pages_loop_runs_as_written() -> None:
    # Before (the page's loop without the check): AttributeError on nn.Sequential.
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.LayerNorm(4))
    for m in model.modules():
        if callable(getattr(m, "reset_parameters", None)):  # as docs/pages/distributed.md writes it
            with global_params(m):
                m.reset_parameters()
    assert bool(model[2].weight.eq(1).all())


# -- 4. construction-time init outside reset methods ---------------------------------------------------
class TokenEmbedding(nn.Module):
    """x-transformers style: the embedding's init runs in __init__, outside any reset method."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        nn.init.kaiming_normal_(self.emb.weight)
        self.norm = nn.LayerNorm(32)  # draws nothing: the replay (after reset_parameters) keeps the draw order


class NanoGPTInit(NanoGPT):
    """nanoGPT: ``self.apply(self._init_weights)`` in __init__, normal(0, 0.02) on Linear and Embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)


def test_construction_time_init_is_replayed_bit_identically_under_the_fix() -> None:
    # Before: reset_parameters gave nn.Embedding's N(0, 1) instead of kaiming_normal_'s std 0.18, silently.
    with packedinit.fix_torch_defaults():
        torch.manual_seed(0)
        normal = TokenEmbedding()
    with packedinit.deferred() as construction:
        flow = TokenEmbedding()
    torch.manual_seed(0)
    assert construction.materialize(flow, device="cpu") == ["emb.weight"]
    assert abs(float(flow.emb.weight.detach().std()) - math.sqrt(2 / 32)) < 0.02
    assert all(torch.equal(a, b) for a, b in zip(state(normal).values(), state(flow).values(), strict=True))


def test_nanogpt_init_and_tie_through_deferred() -> None:
    torch.manual_seed(0)
    normal = NanoGPTInit()
    with packedinit.deferred() as construction:
        flow = NanoGPTInit()
    construction.materialize(flow, device="cpu")
    assert flow.lm_head.weight is flow.wte.weight
    packed = packedinit.layouts(flow)  # per block on purpose (in_proj_weight): only finite
    for n, p in normal.named_parameters():
        q = flow.get_parameter(n)
        assert bool(q.isfinite().all())
        if n not in packed and p.numel() >= 32 and float(p.detach().std()) > 0:
            assert abs(float(q.detach().std()) / float(p.detach().std()) - 1) < 0.15, n


def test_nanogpt_is_bit_identical_to_a_cpu_build_under_the_fix() -> None:
    with packedinit.fix_torch_defaults():
        torch.manual_seed(0)
        normal = NanoGPTInit()
    with packedinit.deferred() as construction:
        flow = NanoGPTInit()
    torch.manual_seed(0)
    construction.materialize(flow, device="cpu")
    assert state(normal).keys() == state(flow).keys()
    assert all(torch.equal(a, b) for a, b in zip(state(normal).values(), state(flow).values(), strict=True))


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.mul_(0.1)  # an in-place write that is no init call: cannot be replayed


def test_construction_writes_that_cannot_be_replayed_are_named() -> None:
    with packedinit.deferred() as construction:
        model = Scaled()
    with pytest.warns(UserWarning, match=r"cannot be replayed: 'proj.weight' \(mul_\).*reset_parameters\(\)"):
        construction.materialize(model, device="cpu")


def test_a_tie_to_empty_cannot_keep_is_named() -> None:
    class Alias(nn.Module):  # a buffer that aliases another module's Parameter: a Parameter and a tensor after
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Module()
            self.b.register_buffer("w", self.a.weight)

    with torch.device("meta"):
        model = Alias()
    with pytest.warns(UserWarning, match=r"1 tie\(s\) could not be kept: 'b.w' from 'a.weight'"):
        packedinit.to_empty(model, device="cpu")


def test_a_parametrized_weight_keeps_requires_grad_and_garbage_is_never_evaluated() -> None:
    lin = parametrizations.orthogonal(nn.Linear(5, 5))
    with torch.no_grad():
        lin.parametrizations.weight.original.fill_(math.nan)  # what to_empty may leave
    reset_parameters(lin)
    assert torch.allclose(lin.weight @ lin.weight.T, torch.eye(5), atol=1e-5)
    assert lin.parametrizations.weight.original.requires_grad

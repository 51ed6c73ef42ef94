"""Materialising never leaves garbage: reset_parameters after meta -> to_empty initialises every
parameter construction initialised (torch defaults, a transformers model's own _init_weights,
rotary buffers, ties), or names what it cannot cover before writing anything."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from packedinit import PackedInitError
from packedinit.recipes.reset import reset_parameters

transformers = pytest.importorskip("transformers", reason="needs the test extras: pip install -e '.[test]'")


def materialize(make: Callable[[], nn.Module]) -> nn.Module:
    """Build on the meta device, ``to_empty``, and fill every tensor with NaN (garbage, deterministically)."""
    with torch.device("meta"):
        model = make()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point():
                t.fill_(math.nan)
    return model


def snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}


def same(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].nan_to_num(7.0), b[k].nan_to_num(7.0)) for k in a)


def all_finite(model: nn.Module) -> list[str]:
    """Names of parameters/buffers that are not all finite (empty: all good)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [n for n, t in named if t.is_floating_point() and not bool(t.isfinite().all())]


# -- tiny models -----------------------------------------------------------------------------------
def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_embd=64, n_layer=3, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg)


def llama_gqa() -> nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


def mixtral() -> nn.Module:
    cfg = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.MixtralForCausalLM(cfg)


def loss_of(model: nn.Module) -> float:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return float(model(ids, labels=ids).loss)


# -- transformers models ---------------------------------------------------------------------------
@pytest.mark.parametrize("make", [gpt2, llama_gqa, mixtral], ids=["gpt2", "llama_gqa", "mixtral"])
def test_meta_to_empty_reset_leaves_nothing_uninitialised(make: Callable[[], nn.Module]) -> None:
    model = materialize(make)
    reset_parameters(model, generator=torch.Generator().manual_seed(0))
    assert all_finite(model) == []
    assert math.isfinite(loss_of(model))


def test_gpt2_gets_its_own_init_scaled_c_proj_and_tie() -> None:
    model = materialize(gpt2)
    assert model.lm_head.weight is not model.transformer.wte.weight  # to_empty untied them
    torch.manual_seed(0)
    reset_parameters(model)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied again
    cfg = model.config
    std = cfg.initializer_range
    block = model.transformer.h[0]
    # HF's defaults (normal(0, initializer_range)), not torch's Conv1D/Linear defaults
    assert float(block.attn.c_attn.weight.detach().std()) == pytest.approx(std, rel=0.05)
    assert float(block.mlp.c_fc.weight.detach().std()) == pytest.approx(std, rel=0.05)
    assert float(model.transformer.wte.weight.detach().std()) == pytest.approx(std, rel=0.1)
    # GPT-2's residual scaling: c_proj ~ N(0, std / sqrt(2 n_layer))
    scaled = std / math.sqrt(2 * cfg.n_layer)
    assert float(block.attn.c_proj.weight.detach().std()) == pytest.approx(scaled, rel=0.1)
    assert float(block.mlp.c_proj.weight.detach().std()) == pytest.approx(scaled, rel=0.05)
    assert bool((block.attn.c_attn.bias == 0).all())
    assert bool((block.ln_1.weight == 1).all())
    assert bool((block.ln_1.bias == 0).all())


def test_llama_rotary_inv_freq_is_recomputed_exactly() -> None:
    reference = llama_gqa()  # built on the CPU: the buffers construction computes
    model = materialize(llama_gqa)
    reset_parameters(model)
    for name, buf in reference.named_buffers():
        assert torch.equal(model.get_buffer(name), buf), name
    assert bool((model.model.norm.weight == 1).all())


def test_hf_loaded_flags_do_not_stop_a_reset() -> None:
    """transformers' init functions skip tensors flagged as loaded; reset_parameters re-initialises them."""
    model = gpt2()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
            p._is_hf_initialized = True  # type: ignore[attr-defined]  # what from_pretrained marks loaded tensors with
    reset_parameters(model)
    w = model.transformer.h[0].attn.c_attn.weight
    assert float(w.detach().std()) == pytest.approx(model.config.initializer_range, rel=0.05)
    assert getattr(w, "_is_hf_initialized", False) is True  # the flag is put back


def test_hf_reset_with_generator_is_deterministic_and_leaves_global_rng_alone() -> None:
    a, b = gpt2(), gpt2()
    before = torch.get_rng_state()
    reset_parameters(a, generator=torch.Generator().manual_seed(3))
    reset_parameters(b, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.get_rng_state(), before)
    assert same(snapshot(a), snapshot(b))


def test_hf_lstm_default_is_per_gate() -> None:
    """transformers' default for an nn.LSTM is xavier_uniform_ on each weight: packedinit runs it per gate."""

    class Config(transformers.PretrainedConfig):
        model_type = "tiny-lstm"

    class TinyLSTM(transformers.PreTrainedModel):
        config_class = Config

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.lstm = nn.LSTM(64, 256)
            self.post_init()

    model = TinyLSTM(Config())
    reset_parameters(model)
    w = model.lstm.weight_hh_l0  # (4H, H): per gate bound sqrt(6 / 2H), packed sqrt(6 / 5H)
    per_gate, packed = math.sqrt(6 / (2 * 256)), math.sqrt(6 / (5 * 256))
    assert float(w.detach().abs().max()) > packed * 1.05
    assert float(w.detach().abs().max()) <= per_gate
    assert bool((model.lstm.bias_ih_l0 == 0).all())


# -- coverage: named before anything is written ----------------------------------------------------
class Scale(nn.Module):
    """A parameter and no reset_parameters: nothing knows its default."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))
        self.shift = nn.Parameter(torch.zeros(n))


class Forgetful(nn.Module):
    """A reset_parameters that initialises one of its two parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(3))
        self.b = nn.Parameter(torch.ones(3))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.a)


class Rotary(nn.Module):
    """A non-persistent buffer with no way to recompute it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)


def custom_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(Scale(4), nn.LayerNorm(4)), Forgetful(), Rotary())


def test_uncovered_parameters_and_buffers_are_all_named_before_any_write() -> None:
    model = materialize(custom_model)
    before = snapshot(model)
    with pytest.raises(PackedInitError, match=r"no known init covers 3 parameter\(s\) and 1 buffer\(s\)") as info:
        reset_parameters(model)
    msg = str(info.value)
    assert "'1.0.gain' (shape (4,), in Scale)" in msg
    assert "'1.0.shift' (shape (4,), in Scale)" in msg
    assert "'2.b' (shape (3,), in Forgetful)" in msg
    assert "'2.a'" not in msg
    assert "buffer '3.inv_freq' (shape (4,), non-persistent, in Rotary)" in msg
    assert "reset_parameters() method" in msg
    assert "strict=False" in msg
    assert same(snapshot(model), before)  # nothing written
    assert all_finite(model[0]) == ["weight", "bias"]


def test_strict_false_warns_once_and_initialises_the_rest() -> None:
    model = materialize(custom_model)
    with pytest.warns(UserWarning, match=r"no known init covers 3 parameter\(s\).*'1\.0\.gain'") as record:
        reset_parameters(model, strict=False)
    assert len(record) == 1
    assert sorted(all_finite(model)) == ["1.0.gain", "1.0.shift", "2.b", "3.inv_freq"]


def test_a_covered_model_raises_nothing() -> None:
    model = materialize(lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2))
    reset_parameters(model)
    assert all_finite(model) == []
    with torch.no_grad():
        out = model(torch.randn(2, 5, 16))
    assert bool(out.isfinite().all())


def test_dry_run_draws_nothing_from_the_global_rng() -> None:
    class DrawsOnCpu(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.w.copy_(torch.randn(3))

    torch.manual_seed(1)
    a = DrawsOnCpu()
    reset_parameters(a)
    torch.manual_seed(1)
    expected = torch.randn(3)
    assert torch.equal(a.w.detach(), expected)

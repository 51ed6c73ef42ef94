"""Wrappers keep the wrapped module's layout: peft, torch.compile, DataParallel, checkpointing, parametrizations.

Also the other silent cases of issue 19: GPT-OSS stacked biases in the documented loop and
``packedinit.adapters.hf`` in a fresh interpreter.
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.init import xavier_uniform_
from torch.nn.utils import parametrizations

import packedinit
from packedinit import Layout, PackedInitError

E = 64
PER_BLOCK = math.sqrt(6 / (E + E))  # 0.2165: xavier bound of one (E, E) block of c_attn
PACKED = math.sqrt(6 / (E + 3 * E))  # 0.153: the bound of the whole (E, 3E) weight


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_embd=E, n_layer=1, n_head=4, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2Model(cfg)


def _lora(model: nn.Module) -> nn.Module:
    import peft

    cfg = peft.LoraConfig(target_modules=["c_attn"], r=4, fan_in_fan_out=True)
    with warnings.catch_warnings():  # peft reads a property transformers 5.24 deprecates
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return peft.get_peft_model(model, cfg)


def _c_attn_weight(model: nn.Module) -> tuple[str, torch.Tensor]:
    for name, p in model.named_parameters():
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.base_layer.weight"):
            return name, p
    raise AssertionError("no c_attn weight")


def test_peft_lora_keeps_gpt2_c_attn_layout() -> None:
    """Before: 'c_attn.weight' no longer resolved, was dropped, and the base weight got 0.153, not 0.2165."""
    model = _lora(gpt2())
    name, w = _c_attn_weight(model)
    assert name.endswith("c_attn.base_layer.weight")
    found = packedinit.layouts(model)
    assert found[name] == Layout(1, [E, E, E], transposed=True, names=("q", "k", "v"))
    assert found[name.replace("weight", "bias")] == Layout(0, [E, E, E], names=("q", "k", "v"))
    packedinit.chunked(xavier_uniform_)(model, generator=torch.Generator().manual_seed(0))
    top = float(w.detach().abs().max())
    assert PACKED * 1.05 < top <= PER_BLOCK


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(
            lambda m: torch.compile(m),
            id="compile",  # importing torch.compile's machinery warns about torch.jit in torch 2.13
            marks=pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
        ),
        pytest.param(lambda m: nn.DataParallel(m), id="dataparallel"),
    ],
)
def test_annotate_names_pass_through_model_wrappers(wrap: object) -> None:
    """Names written for the plain model resolve on the compiled / DataParallel one (prefix `_orig_mod.`, `module.`)."""
    inner = nn.Sequential(nn.Linear(8, 24))
    wrapped = wrap(inner)  # type: ignore[operator]
    layout = Layout(0, [8, 8, 8])
    packedinit.annotate(wrapped, **{"0.weight": layout})
    assert list(packedinit.layouts(wrapped).values()) == [layout]
    assert packedinit.layouts(inner) == {"0.weight": layout}


def test_checkpoint_wrapper_keeps_the_adapter_layout() -> None:
    enc = nn.TransformerEncoderLayer(16, 2)
    enc.self_attn = checkpoint_wrapper(enc.self_attn)  # type: ignore[assignment]
    found = packedinit.layouts(enc)
    assert found == {
        "self_attn._checkpoint_wrapped_module.in_proj_weight": Layout(0, [16, 16, 16], names=("q", "k", "v")),
        "self_attn._checkpoint_wrapped_module.in_proj_bias": Layout(0, [16, 16, 16], names=("q", "k", "v")),
    }


def test_parametrized_weight_resolves_to_its_original() -> None:
    seq = nn.Sequential(nn.Linear(8, 24))
    parametrizations.orthogonal(seq[0])
    layout = Layout(0, [8, 8, 8])
    packedinit.annotate(seq, **{"0.weight": layout})
    assert packedinit.layouts(seq) == {"0.parametrizations.weight.original": layout}


def test_weight_norm_parametrization_resolves_to_the_original_of_the_weights_shape() -> None:
    """weight_norm stores g (24, 1) and v (24, 8): the blocks are in v (original1), as reset_parameters and
    the adapters' claims read them (packedinit.parametrized); two originals of the weight's shape are refused."""
    seq = nn.Sequential(nn.Linear(8, 24))
    parametrizations.weight_norm(seq[0])
    packedinit.annotate(seq, **{"0.weight": Layout(0, [8, 8, 8])})
    assert "0.parametrizations.weight.original1" in packedinit.layouts(seq)
    square = nn.Sequential(nn.Linear(24, 24))
    parametrizations.weight_norm(square[0], dim=None)  # g is a scalar: still one original of the weight's shape
    packedinit.annotate(square, **{"0.weight": Layout(0, [8, 8, 8])})
    assert "0.parametrizations.weight.original1" in packedinit.layouts(square)


class Hidden(nn.Module):
    """A wrapper packedinit does not know: keeps the wrapped Conv1D as ``inner``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # type: ignore[no-any-return]


def test_unknown_wrapper_is_an_error_naming_it() -> None:
    """Before: the adapter's 'c_attn.weight' was dropped without a word."""
    model = gpt2()
    attn = model.h[0].attn
    attn.c_attn = Hidden(attn.c_attn)
    with pytest.raises(PackedInitError, match=r"claims parameter 'c_attn.weight'.*stops at 'c_attn', a .*Hidden"):
        packedinit.layouts(model)


def test_bias_false_is_still_dropped_quietly() -> None:
    """A parameter registered as None (bias=False) is not an error: the layout just has nothing to describe."""
    cfg = transformers.CodeGenConfig(n_embd=32, n_layer=1, n_head=4, rotary_dim=4, vocab_size=32, n_positions=16)
    model = transformers.CodeGenModel(cfg)
    assert [n for n in packedinit.layouts(model) if "qkv_proj" in n] == ["h.0.attn.qkv_proj.weight"]


# -- GPT-OSS: stacked 2-D expert biases in the documented loop ---------------------------------


def gpt_oss() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=32,
    )  # fmt: skip
    return transformers.GptOssForCausalLM(cfg)


def test_gpt_oss_documented_loop_leaves_stacked_biases() -> None:
    """Before: the loop raised on gate_up_proj_bias (4, 32), whose blocks are 1-D (a bias per expert)."""
    model = gpt_oss()
    packedinit.annotate(model)
    experts = model.model.layers[0].mlp.experts
    bias = experts.gate_up_proj_bias.detach().clone()
    for p in model.parameters():
        if p.dim() > 1:
            packedinit.chunked(xavier_uniform_)(p)
    assert torch.equal(experts.gate_up_proj_bias, bias)  # as the loop leaves each separate 1-D bias
    gate_up = experts.gate_up_proj  # (n, hidden, 2I) transposed: each block (16, 32)
    assert float(gate_up.detach().abs().max()) <= math.sqrt(6 / (16 + 32))
    packedinit.chunked(torch.nn.init.zeros_)(experts.gate_up_proj_bias)  # a function for 1-D blocks still runs
    assert not experts.gate_up_proj_bias.any()


def test_adapters_hf_attribute_in_a_fresh_interpreter() -> None:
    """Before: AttributeError: module 'packedinit.adapters' has no attribute 'hf' (nothing had imported it)."""
    code = (
        "import packedinit\n"
        "packedinit.register('my_project.MyExperts')"
        "(packedinit.adapters.hf.experts_layouts)\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env={"PYTHONPATH": str(root)}, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

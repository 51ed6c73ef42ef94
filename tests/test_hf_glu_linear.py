"""The ``Linear`` layers cut in two halves by transformers forwards (packedinit/adapters/hf_glu_linear.py).

The oracle is the model's own forward: ``packedinit.infer_layouts`` on ``example_inputs`` sees the forward
split the output features in two halves (``chunk(2, -1)``, ``glu(h, -1)``). The adapters must claim the
same blocks, under the names the forward gives them, and ``chunked(xavier_uniform_)`` must then draw each
half with the std of xavier on a ``(half, in)`` matrix, which is not the std of the whole ``(2 * half, in)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import packedinit
from packedinit.trace.compare import disagreements, same_blocks
from packedinit.trace.inputs import example_inputs

transformers = pytest.importorskip("transformers", reason="the split Linear layers are in transformers models")

VG = ("value", "gate")
GU = ("gate", "up")


def _moonshine() -> nn.Module:
    # moonshine/modeling_moonshine.py:89,93-95: hidden_states, gate = fc1(h).chunk(2, -1); act(gate) * hidden_states
    cfg = transformers.MoonshineConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=1, encoder_num_attention_heads=2, decoder_num_attention_heads=2,
    )  # fmt: skip
    return transformers.MoonshineModel(cfg)


def _jetmoe() -> nn.Module:
    # jetmoe/modeling_jetmoe.py:449,464: key_states, value_states = kv_proj(h).chunk(2, -1);
    # :225,253-255: act(chunk[0]) * chunk[1] on each expert's input_linear output
    cfg = transformers.JetMoeConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=1, num_key_value_heads=4, kv_channels=32,
        num_local_experts=2, num_experts_per_tok=1, intermediate_size=128,
    )  # fmt: skip
    return transformers.JetMoeModel(cfg)


def _zamba2() -> nn.Module:
    # zamba2/modeling_zamba2.py:884,891-893,903-908: chunk(gate_up_proj(h) + adapter(h), 2, -1); act(g) * u
    cfg = transformers.Zamba2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8,
        layers_block_type=["mamba", "hybrid"], adapter_rank=8, num_mem_blocks=1,
    )  # fmt: skip
    return transformers.Zamba2Model(cfg)


def _clvp() -> nn.Module:
    # clvp/modeling_clvp.py:396,399-400: hidden_states, gate = proj(h).chunk(2, -1); hidden_states * act(gate)
    cfg = transformers.ClvpEncoderConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, projection_dim=32, num_hidden_layers=1,
        num_attention_heads=2, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.ClvpEncoder(cfg)


def _gemma3n_audio() -> nn.Module:
    # gemma3n/modeling_gemma3n.py:842,862-863: glu(linear_start(h), dim=-1)
    cfg = transformers.Gemma3nAudioConfig(
        hidden_size=64, conf_num_attention_heads=2, conf_num_hidden_layers=1, sscp_conv_channel_size=(16, 16),
        input_feat_size=32,
    )  # fmt: skip
    return transformers.Gemma3nAudioEncoder(cfg)


CASES: list[tuple[str, Callable[[], nn.Module], dict[str, tuple[str, str]]]] = [
    ("moonshine", _moonshine, {"decoder.layers.0.mlp.fc1.weight": VG, "decoder.layers.0.mlp.fc1.bias": VG}),
    ("jetmoe", _jetmoe, {"layers.0.self_attention.kv_proj.weight": ("k", "v"), "layers.0.mlp.input_linear.weight": GU}),
    (
        "zamba2",
        _zamba2,
        {
            "layers.1.shared_transformer.feed_forward.gate_up_proj.weight": GU,
            "layers.1.shared_transformer.feed_forward.gate_up_proj_adapter_list.0.1.weight": GU,
        },
    ),
    ("clvp", _clvp, {"layers.0.mlp.fc1.proj.weight": VG, "layers.0.mlp.fc1.proj.bias": VG}),
    ("gemma3n_audio", _gemma3n_audio, {"conformer.0.lconv1d.linear_start.weight": VG}),
]


def _build(build: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return build().eval()


@pytest.mark.parametrize(("build", "expected"), [(b, e) for _, b, e in CASES], ids=[n for n, _, _ in CASES])
def test_split_linears_are_named_and_agree_with_the_forward(
    build: Callable[[], nn.Module], expected: dict[str, tuple[str, str]]
) -> None:
    model = _build(build)
    claimed = packedinit.layouts(model)
    built = example_inputs(model)
    assert built is not None
    args, kwargs = built
    found = packedinit.infer_layouts(model, *args, **kwargs)
    assert disagreements(found, claimed) == []
    for name, names in expected.items():
        p = model.get_parameter(name)
        batch = p.dim() - 2 if name.endswith(".weight") else 0
        half = p.shape[batch] // 2
        layout = claimed[name]
        assert (layout.dim, layout.sizes, layout.names, layout.batch_dims) == (batch, (half, half), names, batch)
        if name.endswith(".weight"):
            inferred = found[name]
            assert inferred.verdict == "packed", (name, inferred)
            assert same_blocks(inferred.layout, layout)


@pytest.mark.parametrize(("build", "expected"), [(b, e) for _, b, e in CASES], ids=[n for n, _, _ in CASES])
def test_chunked_xavier_gives_each_half_its_own_fans(
    build: Callable[[], nn.Module], expected: dict[str, tuple[str, str]]
) -> None:
    model = _build(build)
    packedinit.chunked(torch.nn.init.xavier_uniform_)(model)
    weights = [n for n in expected if n.endswith(".weight")]
    assert weights
    for name in weights:
        w = model.get_parameter(name).detach()
        matrices = list(w) if w.dim() == 3 else [w]  # a stack holds one (2 * half, in) matrix per expert
        for m in matrices:
            out, fan_in = m.shape
            half = out // 2
            oracle = math.sqrt(2.0 / (half + fan_in))  # xavier_uniform_ on (half, in): a / sqrt(3), gain 1
            whole = math.sqrt(2.0 / (out + fan_in))
            assert abs(whole / oracle - 1) > 0.15  # the widths tell per-half fans from the packed ones
            for block in m.split(half, dim=0):
                assert float(block.std()) == pytest.approx(oracle, rel=0.12), name


def test_moshi_codebook_stack_is_cut_per_codebook_as_its_forward_reads_it() -> None:
    # moshi/modeling_moshi.py:359,363-367: a MoshiFlexibleLinear fc1 (codebooks, 2I, E), one matrix per codebook;
    # h.view(b, s, 2, -1): act(h[..., 0, :]) * h[..., 1, :]. The tracer cannot see through its matmul (opaque),
    # so the forward is read directly: doubling the "up" block of codebook 0 doubles that codebook's output only
    # (act(gate) * up is linear in up, not in gate; fc2 has no bias).
    from transformers.models.moshi.modeling_moshi import MoshiGatingMLP

    cfg = transformers.MoshiConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, ffn_dim=256, num_codebooks=2,
        audio_vocab_size=32,
    )  # fmt: skip
    torch.manual_seed(0)
    mlp = MoshiGatingMLP(cfg, use_flexible_linear=True)
    layout = packedinit.layouts(mlp)["fc1.weight"]
    assert (layout.dim, layout.sizes, layout.batch_dims, layout.names) == (1, (128, 128), 1, GU)
    with pytest.warns(packedinit.LayoutWarning, match="'fc2.weight'"):  # the fc2 stack: one block per codebook
        packedinit.chunked(torch.nn.init.xavier_uniform_)(mlp)
    w = mlp.fc1.weight.detach()
    for codebook in w:
        for block in codebook.split(128, dim=0):
            assert float(block.std()) == pytest.approx(math.sqrt(2.0 / (128 + 64)), rel=0.12)
    x = torch.randn(3, 2, 64)
    with torch.no_grad():
        before = mlp(x)
        mlp.fc1.weight[0, layout.sizes[0] :] *= 2.0  # the second block of codebook 0: "up"
        after = mlp(x)
    torch.testing.assert_close(after[:, 0], 2.0 * before[:, 0])
    torch.testing.assert_close(after[:, 1], before[:, 1])

"""The forward tracer on the forms issue 26 found it misread, and example inputs for every modality.

Each module below is a hand-written replica of the form as the library writes it (the source is named
beside it); each is checked against the layout its blocks really have.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  # the usual alias
import transformers
from torch import Tensor, nn

from packedinit import Layout
from packedinit.trace.forward import infer_layouts
from packedinit.trace.inputs import example_inputs

E = 8
X = torch.randn(2, 3, E, generator=torch.Generator().manual_seed(0))


class TransposedMatmul(nn.Module):  # x @ W.t() on a (3E, E) weight: the rows of W are the output features
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.qkv = nn.Parameter(torch.randn(3 * E, E))

    def forward(self, x: Tensor) -> Tensor:
        if self.how == "data":
            return sum(part.sum() for part in F.linear(x, self.qkv.data).chunk(3, dim=-1))
        w = self.qkv.t() if self.how == "t" else self.qkv.transpose(0, 1) if self.how == "transpose" else self.qkv.T
        q, k, v = (x @ w).chunk(3, dim=-1)
        return (q * k).sum() + v.sum()


class ColumnSplit(nn.Module):  # a (E, 2E) weight stored (out, in)... used as x @ W.t() after a split of its rows
    def __init__(self) -> None:
        super().__init__()
        self.kv = nn.Parameter(torch.randn(2 * E, E))

    def forward(self, x: Tensor) -> Tensor:
        wk, wv = self.kv.t().split(E, dim=1)  # a split of W.t()'s columns: W's rows
        return (x @ wk).sum() * (x @ wv).sum()


class LastDimExperts(nn.Module):  # (n, E, 2I) stored (in, out); per expert W[e][..., :I] and W[e][..., I:]
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(4, E, 12))

    def forward(self, x: Tensor) -> Tensor:
        out = x.new_zeros(())
        for e in range(4):
            gate, up = x @ self.gate_up[e][..., :6], x @ self.gate_up[e][..., 6:]
            out = out + (F.silu(gate) * up).sum()
        return out


class StackedMatmul(nn.Module):  # (n, E, 2I) stacks applied to every expert at once: bmm / matmul / grouped_mm
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.gate_up_proj = nn.Parameter(torch.randn(4, E, 12))
        self.down_proj = nn.Parameter(torch.randn(4, 6, E))

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(1, -1, E).expand(4, -1, -1)  # every expert sees every token
        mm = torch.bmm if self.how == "bmm" else torch.matmul
        gate, up = mm(tokens, self.gate_up_proj).chunk(2, dim=-1)
        return mm(F.silu(gate) * up, self.down_proj).sum()


class SummedGates(nn.Module):  # torchrl LSTM (torchrl/modules/tensordict_module/rnn.py): W_ih x + W_hh h, chunked
    def __init__(self) -> None:
        super().__init__()
        self.weight_ih = nn.Parameter(torch.randn(4 * E, E))
        self.weight_hh = nn.Parameter(torch.randn(4 * E, E))

    def forward(self, x: Tensor) -> Tensor:
        h = x.new_zeros(x.shape[1], E)
        c = x.new_zeros(x.shape[1], E)
        for t in range(x.shape[0]):
            gates = F.linear(x[t], self.weight_ih) + F.linear(h, self.weight_hh)
            i, f, g, o = gates.chunk(4, dim=-1)
            c = f.sigmoid() * c + i.sigmoid() * g.tanh()
            h = o.sigmoid() * c.tanh()
        return h.sum()


@pytest.mark.parametrize(
    ("module", "name", "expected"),
    [
        (lambda: TransposedMatmul("t"), "qkv", Layout(0, [E] * 3)),
        (lambda: TransposedMatmul("transpose"), "qkv", Layout(0, [E] * 3)),
        (lambda: TransposedMatmul("T"), "qkv", Layout(0, [E] * 3)),
        (lambda: TransposedMatmul("data"), "qkv", Layout(0, [E] * 3)),
        (ColumnSplit, "kv", Layout(0, [E, E])),
        (LastDimExperts, "gate_up", Layout(2, [6, 6], transposed=True, batch_dims=1)),
        (lambda: StackedMatmul("bmm"), "gate_up_proj", Layout(2, [6, 6], transposed=True, batch_dims=1)),
        (lambda: StackedMatmul("matmul"), "gate_up_proj", Layout(2, [6, 6], transposed=True, batch_dims=1)),
        (SummedGates, "weight_ih", Layout(0, [E] * 4)),
        (SummedGates, "weight_hh", Layout(0, [E] * 4)),
    ],
    ids=["t", "transpose", "T", ".data", "column split", "last-dim experts", "bmm", "matmul", "sum ih", "sum hh"],
)
def test_forms_the_tracer_misread(module: type[nn.Module], name: str, expected: Layout) -> None:
    found = infer_layouts(module(), X.transpose(0, 1) if module is SummedGates else X)[name]
    assert found.verdict == "packed", found
    assert found.layout == expected


def test_glu_halves_are_two_blocks() -> None:  # ported from main's forward.py (F.glu / nn.GLU)
    model = nn.Sequential(nn.Linear(E, 2 * E), nn.GLU(dim=-1))
    assert infer_layouts(model, X)["0.weight"].layout == Layout(0, [E, E])


def test_a_stacked_down_projection_is_one_block_per_expert() -> None:
    found = infer_layouts(StackedMatmul("bmm"), X)["down_proj"]
    assert (found.verdict, found.batch_dims) == ("packed", 1), found
    assert found.layout is not None
    assert (found.layout.num_parts, found.layout.batch_dims) == (1, 1), found  # each expert whole, its own fans


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is in torch >= 2.8")
def test_grouped_mm_on_a_stack_has_the_expert_batch_dim() -> None:
    class Grouped(nn.Module):  # transformers' "grouped_mm" experts: one call for all experts, tokens sorted
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(4, E, 16))

        def forward(self, x: Tensor) -> Tensor:
            offs = torch.tensor([2, 3, 5, 6], dtype=torch.int32)
            gate, up = torch._grouped_mm(x.reshape(-1, E), self.gate_up_proj, offs=offs).chunk(2, dim=-1)
            return (gate * up).sum()

    found = infer_layouts(Grouped(), X)["gate_up_proj"]
    assert found.layout == Layout(2, [8, 8], transposed=True, batch_dims=1), found


@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_attention_in_proj_is_packed_and_out_proj_is_not(batch_first: bool) -> None:
    mha = nn.MultiheadAttention(E, 2, batch_first=batch_first)
    args, kwargs = example_inputs(mha) or ((), {})
    found = infer_layouts(mha, *args, **kwargs)
    assert found["in_proj_weight"].layout == Layout(0, [E] * 3), found["in_proj_weight"]
    assert found["out_proj.weight"].verdict == "not packed"


def test_functional_multi_head_attention_forward_is_followed() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.in_proj = nn.Parameter(torch.randn(3 * E, E))
            self.out = nn.Linear(E, E)

        def forward(self, x: Tensor) -> Tensor:
            y, _ = F.multi_head_attention_forward(
                x, x, x, E, 2, self.in_proj, None, None, None, False, 0.0, self.out.weight, self.out.bias,
                need_weights=False,
            )
            return y.sum()

    found = infer_layouts(Functional(), X.transpose(0, 1))
    assert found["in_proj"].layout == Layout(0, [E] * 3)


def test_transformer_and_recurrent_modules_trace_from_their_own_inputs() -> None:
    model = nn.Transformer(E, 2, 1, 1, 16, dropout=0.0, batch_first=True)
    args, kwargs = example_inputs(model) or ((), {})
    found = infer_layouts(model, *args, **kwargs)
    assert found["encoder.layers.0.self_attn.in_proj_weight"].layout == Layout(0, [E] * 3)
    for rnn in (nn.LSTM(E, 4), nn.GRU(E, 4, batch_first=True), nn.LSTMCell(E, 4)):
        args, _ = example_inputs(rnn) or ((), {})
        assert args[0].shape[-1] == E
        assert infer_layouts(rnn, *args)  # the fused kernel is opaque; the forward runs


def test_transformers_default_experts_are_traced() -> None:
    cfg = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=32, max_position_embeddings=16,
    )  # fmt: skip
    model = transformers.MixtralModel(cfg).eval()
    args, kwargs = example_inputs(model) or ((), {})
    found = infer_layouts(model, *args, **kwargs)
    gate_up = found["layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.layout == Layout(1, [12, 12], batch_dims=1), gate_up
    down = found["layers.0.mlp.experts.down_proj"]  # each expert's matrix whole: one block per expert
    assert (down.verdict, down.layout) == ("packed", Layout(1, [down.layout.sizes[0]], batch_dims=1)), down


def _tiny(config: transformers.PretrainedConfig) -> nn.Module:
    return transformers.AutoModel.from_config(config).eval()


@pytest.mark.parametrize(
    ("config", "inputs"),
    [
        (lambda: transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=16, image_size=16, patch_size=8), {"pixel_values"}),
        (lambda: transformers.WhisperConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                            decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
                                            num_mel_bins=8, max_source_positions=8, vocab_size=40, pad_token_id=1,
                                            bos_token_id=2, eos_token_id=2, decoder_start_token_id=3),
         {"input_features", "decoder_input_ids"}),
        (lambda: transformers.Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=16, conv_dim=(8, 8), conv_stride=(5, 2),
                                             conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                                             num_conv_pos_embedding_groups=2), {"input_values"}),
        (lambda: transformers.VideoMAEConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=16, image_size=16, patch_size=8, num_frames=2,
                                             tubelet_size=2), {"pixel_values"}),
        (lambda: transformers.CLIPConfig(text_config={"hidden_size": 16, "num_hidden_layers": 1,
                                                      "intermediate_size": 16, "num_attention_heads": 2,
                                                      "vocab_size": 40},
                                         vision_config={"hidden_size": 16, "num_hidden_layers": 1, "image_size": 16,
                                                        "patch_size": 8, "num_attention_heads": 2,
                                                        "intermediate_size": 16}, projection_dim=8),
         {"input_ids", "pixel_values"}),
        (lambda: transformers.BartConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                         decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
                                         vocab_size=40), {"input_ids", "decoder_input_ids"}),
        (lambda: transformers.ParakeetEncoderConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                    intermediate_size=16, num_mel_bins=8,
                                                    subsampling_conv_channels=8), {"input_features"}),
    ],
    ids=["image", "audio features + decoder", "raw audio", "video", "two towers", "encoder-decoder",
         "frames-first features"],
)  # fmt: skip
def test_example_inputs_for_every_modality_run_the_forward(config: object, inputs: set[str]) -> None:
    model = _tiny(config())  # type: ignore[operator]  # a config factory
    built = example_inputs(model)
    assert built is not None
    args, kwargs = built
    assert set(kwargs) - {"use_cache"} == inputs
    assert infer_layouts(model, *args, **kwargs)
    if "input_features" in kwargs:  # Whisper: (batch, mel, frames) through a Conv1d; a conformer: (batch, frames, mel)
        mel = 8
        assert kwargs["input_features"].shape[1 if isinstance(model, transformers.WhisperModel) else 2] == mel


def test_example_inputs_for_a_vision_tower_fed_patches_and_a_grid() -> None:
    cfg = transformers.Qwen2VLConfig(
        vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2, "patch_size": 2,
                       "temporal_patch_size": 1, "spatial_merge_size": 2, "in_channels": 3},
    )  # fmt: skip
    tower = transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel(cfg.vision_config)
    args, kwargs = example_inputs(tower.eval()) or ((), {})
    assert set(kwargs) == {"hidden_states", "grid_thw"}
    found = infer_layouts(tower, *args, **kwargs)
    assert found["blocks.0.attn.qkv.weight"].layout == Layout(0, [16] * 3)


def test_example_inputs_says_none_where_it_cannot_build_one() -> None:
    assert example_inputs(nn.Identity()) is None
    assert example_inputs(nn.Sequential(nn.Linear(2, 2))) is None

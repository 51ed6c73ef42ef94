"""The GLU-fed ``Conv1d`` of transformers speech models (packedinit/adapters/hf_glu.py), checked against the forward.

The oracle is the model's own forward: ``packedinit.infer_layouts`` on ``example_inputs`` sees
``glu(conv(h), dim=1)`` split the conv's output channels in two halves. The adapters must claim the same
blocks for every such conv, and the forward must find no packed weight the adapters do not describe.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import packedinit
from packedinit.trace.compare import disagreements, same_blocks
from packedinit.trace.inputs import example_inputs

transformers = pytest.importorskip("transformers", reason="the GLU convolutions are in transformers models")

SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}


def _parakeet() -> nn.Module:
    # parakeet/modeling_parakeet.py:130,165: glu(pointwise_conv1(h), dim=1), bias=config.convolution_bias
    return transformers.ParakeetEncoder(transformers.ParakeetEncoderConfig(**SMALL, conv_kernel_size=3))


def _wav2vec2_conformer() -> nn.Module:
    # wav2vec2_conformer/modeling_wav2vec2_conformer.py:375,414: self.glu = nn.GLU(dim=1) after pointwise_conv1
    cfg = transformers.Wav2Vec2ConformerConfig(
        **SMALL, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        conformer_conv_kernel_size=3, vocab_size=16,
    )  # fmt: skip
    return transformers.Wav2Vec2ConformerModel(cfg)


def _wav2vec2_conformer_adapter() -> nn.Module:
    # wav2vec2_conformer/modeling_wav2vec2_conformer.py:839,849: glu(adapter conv(h), dim=1), and the conv module
    cfg = transformers.Wav2Vec2ConformerConfig(
        **SMALL, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        conformer_conv_kernel_size=3, vocab_size=16, add_adapter=True, num_adapter_layers=1, adapter_kernel_size=3,
        adapter_stride=2,
    )  # fmt: skip
    return transformers.Wav2Vec2ConformerModel(cfg)


def _wav2vec2_bert_adapter() -> nn.Module:
    # wav2vec2_bert/modeling_wav2vec2_bert.py:171,217 (pointwise_conv1), :649-660,687,697 (residual_conv and
    # self_attn_conv, each followed by GLU(dim=1))
    cfg = transformers.Wav2Vec2BertConfig(
        **SMALL, conv_depthwise_kernel_size=3, vocab_size=16, add_adapter=True, num_adapter_layers=1,
        adapter_kernel_size=3, adapter_stride=2, output_hidden_size=32,
    )  # fmt: skip
    return transformers.Wav2Vec2BertModel(cfg)


def _speech_to_text() -> nn.Module:
    # speech_to_text/modeling_speech_to_text.py:84-99: glu(conv(h), dim=1) for every conv_layers.i
    cfg = transformers.Speech2TextConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, conv_channels=32,
        input_feat_per_channel=16, max_source_positions=64, max_target_positions=64,
    )  # fmt: skip
    return transformers.Speech2TextModel(cfg)


@pytest.mark.parametrize(
    ("build", "convs"),
    [
        (_parakeet, 1),
        (_wav2vec2_conformer, 1),
        (_wav2vec2_conformer_adapter, 2),
        (_wav2vec2_bert_adapter, 3),
        (_speech_to_text, 2),
    ],
    ids=["parakeet", "wav2vec2_conformer", "wav2vec2_conformer_adapter", "wav2vec2_bert_adapter", "speech_to_text"],
)
def test_glu_conv_adapters_agree_with_the_forward(build: Callable[[], nn.Module], convs: int) -> None:
    torch.manual_seed(0)
    model = build().eval()
    built = example_inputs(model)
    assert built is not None
    args, kwargs = built
    found = packedinit.infer_layouts(model, *args, **kwargs)
    claimed = packedinit.layouts(model)
    assert disagreements(found, claimed) == []
    glu = {n: f for n, f in found.items() if f.verdict == "packed" and f.layout is not None and f.layout.dim == 0
           and len(f.layout.sizes) == 2 and f.layout.sizes[0] == f.layout.sizes[1]}  # fmt: skip
    assert len(glu) == convs, sorted(found)
    for name, inferred in glu.items():
        half = model.get_parameter(name).shape[0] // 2
        assert claimed[name].sizes == (half, half)
        assert claimed[name].names == ("value", "gate")
        assert same_blocks(inferred.layout, claimed[name])

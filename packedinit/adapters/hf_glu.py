"""Adapters for the ``Conv1d`` layers of transformers speech models whose output feeds a GLU (sweep, issue 26).

``nn.functional.glu(h, dim=1)`` / ``nn.GLU(dim=1)`` computes ``a * sigmoid(b)`` on ``[a | b] = h.chunk(2, 1)``:
on a ``Conv1d`` output ``(batch, 2C, time)`` that is the first and second half of the output channels, so
the weight ``(2C, C_in, k)`` and its bias ``(2C,)`` hold two blocks ``[value | gate]`` along dim 0.
Matched by class path like :mod:`packedinit.adapters.hf` (which imports this module); transformers 5.24:

* the Conformer convolution module, ``glu(pointwise_conv1(h), dim=1)``: parakeet/modeling_parakeet.py:130,165
  (also the encoder of canary, cohere_asr), lasr/modeling_lasr.py:271,306,
  nemotron_asr_streaming/modeling_nemotron_asr_streaming.py:400,440 (also nemotron3_5_asr's encoder),
  fastspeech2_conformer/modeling_fastspeech2_conformer.py:484,519,
  wav2vec2_bert/modeling_wav2vec2_bert.py:171,217, wav2vec2_conformer/modeling_wav2vec2_conformer.py:375,414;
* the adapter layers, ``GLU(dim=1)`` after each conv: wav2vec2_bert/modeling_wav2vec2_bert.py:649-660,687,697
  (``residual_conv``, ``self_attn_conv``), wav2vec2_conformer/modeling_wav2vec2_conformer.py:839,849 (``conv``);
* speech_to_text's ``Conv1dSubsampler``: ``glu(conv(h), dim=1)`` for every ``conv_layers.i``
  (speech_to_text/modeling_speech_to_text.py:84-99).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

from packedinit.adapters.hf_common import M, fit, tensor
from packedinit.layout import Layout
from packedinit.model.registry import register

__all__ = ["glu_conv_layouts"]

#: The value and gate halves of a GLU, in storage order (as for x_transformers' ``nn.GLU`` output projection).
NAMES = ("value", "gate")


def glu_conv_layouts(module: nn.Module, convs: Iterable[str]) -> dict[str, Layout]:
    """``[value | gate]`` along dim 0 for the weight and bias of each named ``Conv1d`` (whose output has 2C channels).

    A conv that is missing or not a 3-D ``Conv1d`` weight is left out; a bias registered as ``None`` is dropped.

    Examples:
        >>> import torch
        >>> class ConvModule(torch.nn.Module):  # a Conformer convolution module, 32 channels
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.pointwise_conv1 = torch.nn.Conv1d(32, 64, kernel_size=1, bias=False)
        >>> glu_conv_layouts(ConvModule(), ["pointwise_conv1"])
        {'pointwise_conv1.weight': Layout(dim=0, sizes=(32, 32), names=('value', 'gate'))}
    """
    out: dict[str, Layout] = {}
    for conv in convs:
        w = tensor(module, f"{conv}.weight")
        if w is None or w.dim() != 3 or int(w.shape[0]) % 2:
            continue
        half = int(w.shape[0]) // 2
        layout = Layout(0, [half, half], names=NAMES)
        out[f"{conv}.weight"] = layout
        out[f"{conv}.bias"] = layout
    return fit(module, out)


@register(f"{M}.parakeet.modeling_parakeet.ParakeetEncoderConvolutionModule")
@register(f"{M}.lasr.modeling_lasr.LasrEncoderConvolutionModule")
@register(f"{M}.nemotron_asr_streaming.modeling_nemotron_asr_streaming.NemotronAsrStreamingEncoderConvolutionModule")
@register(f"{M}.fastspeech2_conformer.modeling_fastspeech2_conformer.FastSpeech2ConformerConvolutionModule")
@register(f"{M}.wav2vec2_bert.modeling_wav2vec2_bert.Wav2Vec2BertConvolutionModule")
@register(f"{M}.wav2vec2_conformer.modeling_wav2vec2_conformer.Wav2Vec2ConformerConvolutionModule")
def _conformer_conv(module: nn.Module) -> Mapping[str, Layout]:
    """``glu(pointwise_conv1(h), dim=1)``: ``[value | gate]`` output channels."""
    return glu_conv_layouts(module, ["pointwise_conv1"])


@register(f"{M}.wav2vec2_bert.modeling_wav2vec2_bert.Wav2Vec2BertAdapterLayer")
def _wav2vec2_bert_adapter(module: nn.Module) -> Mapping[str, Layout]:
    """``activation = GLU(dim=1)`` after ``residual_conv`` and after ``self_attn_conv``."""
    return glu_conv_layouts(module, ["residual_conv", "self_attn_conv"])


@register(f"{M}.wav2vec2_conformer.modeling_wav2vec2_conformer.Wav2Vec2ConformerAdapterLayer")
def _wav2vec2_conformer_adapter(module: nn.Module) -> Mapping[str, Layout]:
    """``glu(conv(h), dim=1)``."""
    return glu_conv_layouts(module, ["conv"])


@register(f"{M}.speech_to_text.modeling_speech_to_text.Conv1dSubsampler")
def _speech_to_text_subsampler(module: nn.Module) -> Mapping[str, Layout]:
    """``glu(conv(h), dim=1)`` for every ``conv`` in ``conv_layers``."""
    layers = getattr(module, "conv_layers", None)
    n = len(layers) if isinstance(layers, nn.ModuleList) else 0
    return glu_conv_layouts(module, [f"conv_layers.{i}" for i in range(n)])

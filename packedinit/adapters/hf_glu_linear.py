"""Adapters for the ``Linear`` layers of transformers models whose output the forward cuts in two halves (sweep).

Each weight ``(2I, in)`` (and its bias ``(2I,)``) is read by a forward that splits the output features
``h.chunk(2, -1)`` (or ``glu(h, dim=-1)``, or ``h.view(..., 2, -1)``) into two logical matrices, so it holds
two blocks along dim 0, named in storage order. Found by the forward tracer in the transformers sweep
(issue 26) and matched by class path like :mod:`packedinit.adapters.hf` (which imports this module);
transformers 5.24:

* ``[value | gate]``, ``value * act(gate)`` (``glu`` is ``value * sigmoid(gate)``):
  gemma3n/modeling_gemma3n.py:842,862-863 (``linear_start``, then ``glu(h, dim=-1)``),
  gemma4/modeling_gemma4.py:485,505-506 (the same through ``Gemma4ClippableLinear.linear``, :176,188),
  granite_speech5/modeling_granite_speech5.py:179,193-194 (``pointwise_lin1``, then ``glu(h, dim=-1)``),
  clvp/modeling_clvp.py:396,399-400 (``hidden_states, gate = proj(h).chunk(2, -1)``),
  moonshine/modeling_moonshine.py:89,93-95 and moonshine_streaming/modeling_moonshine_streaming.py:457,461-463
  (``hidden_states, gate = fc1(h).chunk(2, -1)``; ``act(gate) * hidden_states``);
* ``[gate | up]``, ``act(gate) * up``:
  moshi/modeling_moshi.py:356-360,363-367 (``fc1(h).view(b, s, 2, -1)``; ``act(h[..., 0, :]) * h[..., 1, :]``;
  a ``MoshiFlexibleLinear`` fc1 stacks one ``(2I, in)`` matrix per codebook, :213),
  zamba2/modeling_zamba2.py:884,891-893,903-908 (``gate_up_proj`` plus the LoRA-like
  ``gate_up_proj_adapter_list.K`` whose second Linear adds to the same ``2I`` features before the chunk),
  granitemoehybrid/modeling_granitemoehybrid.py:762,766-768 and granitemoeshared/modeling_granitemoeshared.py:85,89-91
  (``input_linear``), minimax_m3_vl/modeling_minimax_m3_vl.py:181,185-186 (``gate_up_proj`` of the dense MLP and
  of the shared experts; the clamps and ``(up + 1) * glu`` act on each half alone);
  jetmoe/modeling_jetmoe.py:225,253-255 (``JetMoeMoE.input_linear``, a ``JetMoeParallelExperts`` stacking one
  ``(2I, in)`` matrix per expert, :134,155; its ``bias`` is the output's, one block);
* ``[k | v]``: jetmoe/modeling_jetmoe.py:449,464 (``key_states, value_states = kv_proj(h).chunk(2, -1)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from torch import nn

from packedinit.adapters.hf_common import M, fit, tensor
from packedinit.layout import Layout
from packedinit.model.registry import register

__all__ = ["halves_layouts"]

VALUE_GATE = ("value", "gate")
GATE_UP = ("gate", "up")


def halves_layouts(module: nn.Module, linears: Iterable[str], names: Sequence[str]) -> dict[str, Layout]:
    """Two equal blocks ``names`` along the output features of each named ``Linear``'s weight and bias.

    A 2-D weight ``(2I, in)`` is cut along dim 0; a 3-D one ``(n, 2I, in)`` is a stack of such matrices
    (one per codebook or expert) cut along dim 1, each matrix its own fans. A linear that is missing, of
    another rank, or of an odd number of output features is left out; a bias registered as ``None`` is dropped.

    Examples:
        >>> import torch
        >>> class GatedLinearUnit(torch.nn.Module):  # CLVP's fc1: hidden, gate = proj(x).chunk(2, -1)
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.proj = torch.nn.Linear(16, 64)
        >>> halves_layouts(GatedLinearUnit(), ["proj"], ("value", "gate"))["proj.weight"]
        Layout(dim=0, sizes=(32, 32), names=('value', 'gate'))
    """
    out: dict[str, Layout] = {}
    for linear in linears:
        w = tensor(module, f"{linear}.weight")
        if w is None or w.dim() not in (2, 3):
            continue
        batch = w.dim() - 2
        if int(w.shape[batch]) % 2:
            continue
        half = int(w.shape[batch]) // 2
        out[f"{linear}.weight"] = Layout(batch, [half, half], batch_dims=batch, names=names)
        if not batch:  # a stack (MoshiFlexibleLinear) has no bias at all
            out[f"{linear}.bias"] = Layout(0, [half, half], names=names)
    return fit(module, out)


@register(f"{M}.gemma3n.modeling_gemma3n.Gemma3nAudioConformerLightConv1d")
def _gemma3n_light_conv(module: nn.Module) -> Mapping[str, Layout]:
    """``glu(linear_start(h), dim=-1)``: ``[value | gate]``."""
    return halves_layouts(module, ["linear_start"], VALUE_GATE)


@register(f"{M}.gemma4.modeling_gemma4.Gemma4AudioLightConv1d")
def _gemma4_light_conv(module: nn.Module) -> Mapping[str, Layout]:
    """``glu(linear_start(h), dim=-1)`` through ``Gemma4ClippableLinear``: ``[value | gate]``."""
    return halves_layouts(module, ["linear_start.linear"], VALUE_GATE)


@register(f"{M}.granite_speech5.modeling_granite_speech5.GraniteSpeech5EncoderConvolutionModule")
def _granite_speech5_conv(module: nn.Module) -> Mapping[str, Layout]:
    """``glu(pointwise_lin1(h), dim=-1)``: ``[value | gate]``."""
    return halves_layouts(module, ["pointwise_lin1"], VALUE_GATE)


@register(f"{M}.clvp.modeling_clvp.ClvpGatedLinearUnit")
def _clvp_glu(module: nn.Module) -> Mapping[str, Layout]:
    """``hidden_states, gate = proj(h).chunk(2, -1)``; ``hidden_states * act(gate)``: ``[value | gate]``."""
    return halves_layouts(module, ["proj"], VALUE_GATE)


@register(f"{M}.moonshine.modeling_moonshine.MoonshineDecoderMLP")
@register(f"{M}.moonshine_streaming.modeling_moonshine_streaming.MoonshineStreamingDecoderMLP")
def _moonshine_mlp(module: nn.Module) -> Mapping[str, Layout]:
    """``hidden_states, gate = fc1(h).chunk(2, -1)``; ``act(gate) * hidden_states``: ``[value | gate]``."""
    return halves_layouts(module, ["fc1"], VALUE_GATE)


@register(f"{M}.moshi.modeling_moshi.MoshiGatingMLP")
def _moshi_mlp(module: nn.Module) -> Mapping[str, Layout]:
    """``fc1(h).view(b, s, 2, -1)``; ``act(h[..., 0, :]) * h[..., 1, :]``: ``[gate | up]`` (per codebook if stacked)."""
    return halves_layouts(module, ["fc1"], GATE_UP)


@register(f"{M}.zamba2.modeling_zamba2.Zamba2MLP")
def _zamba2_mlp(module: nn.Module) -> Mapping[str, Layout]:
    """``chunk(gate_up_proj(h) + gate_up_proj_adapter_list[i](h), 2, -1)``: ``[gate | up]`` for both.

    Each adapter is ``Sequential(Linear(E, r), Linear(r, 2I))`` or ``Identity``; its first Linear is one block.
    """
    adapters = getattr(module, "gate_up_proj_adapter_list", None)
    listed = list(adapters) if isinstance(adapters, nn.ModuleList) else []
    ups = [f"gate_up_proj_adapter_list.{k}.1" for k, a in enumerate(listed) if isinstance(a, nn.Sequential)]
    return halves_layouts(module, ["gate_up_proj", *ups], GATE_UP)


@register(f"{M}.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMLP")
@register(f"{M}.granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedMLP")
def _granite_shared_mlp(module: nn.Module) -> Mapping[str, Layout]:
    """``chunked = input_linear(h).chunk(2, -1)``; ``act(chunked[0]) * chunked[1]``: ``[gate | up]``."""
    return halves_layouts(module, ["input_linear"], GATE_UP)


@register(f"{M}.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLDenseMLP")
def _minimax_m3_dense_mlp(module: nn.Module) -> Mapping[str, Layout]:
    """``gate, up = gate_up_proj(h).chunk(2, -1)``: ``[gate | up]``."""
    return halves_layouts(module, ["gate_up_proj"], GATE_UP)


@register(f"{M}.jetmoe.modeling_jetmoe.JetMoeAttention")
def _jetmoe_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``key_states, value_states = kv_proj(h).chunk(2, -1)``: ``[k | v]``."""
    return halves_layouts(module, ["kv_proj"], ("k", "v"))


@register(f"{M}.jetmoe.modeling_jetmoe.JetMoeMoE")
def _jetmoe_moe(module: nn.Module) -> Mapping[str, Layout]:
    """``chunked = input_linear(x, sizes).chunk(2, -1)``; ``act(chunked[0]) * chunked[1]``: ``[gate | up]``."""
    return halves_layouts(module, ["input_linear"], GATE_UP)

"""Adapters for fused projections of transformers the forward tracer found without one (the sweep, issue 26).

Matched by class path like :mod:`packedinit.adapters.hf` (which imports this module). Each layout was
shown by :func:`packedinit.infer_layouts` on the model's own forward (``docs/pages/sweep.md``) and is
checked again by ``tests/test_sweep.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from packedinit.adapters.fused import fused_qkv
from packedinit.adapters.hf_common import M, fit, int_attr, qkv, tensor
from packedinit.layout import Layout
from packedinit.model.registry import register

__all__ = ["gated_query_layouts", "vision_qkv_layouts"]

#: Vision-tower attention with ``self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim)``, used as
#: ``qkv(x).reshape(seq, 3, heads, -1).unbind`` (Qwen-VL family) or split ``[q_dim, kv_dim, kv_dim]`` (EXAONE).
_VISION_QKV = (
    "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLVisionAttention",
    "qwen2_vl.modeling_qwen2_vl.VisionAttention",
    "qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionAttention",
    "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeVisionAttention",
    "qwen3_5.modeling_qwen3_5.Qwen3_5VisionAttention",
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeVisionAttention",
    "qwen4_exp.modeling_qwen4_exp.Qwen4ExpVisionAttention",
    "glm4v.modeling_glm4v.Glm4vVisionAttention",
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeVisionAttention",
    "glm5_next.modeling_glm5_next.Glm5NextVisionAttention",
    "glm_image.modeling_glm_image.GlmImageVisionAttention",
    "glm_ocr.modeling_glm_ocr.GlmOcrVisionAttention",
    "cohere_compass.modeling_cohere_compass.CohereCompassVisionAttention",
    "exaone4_5.modeling_exaone4_5.Exaone4_5_VisionAttention",
    "blip.modeling_blip.BlipAttention",
    "blip_2.modeling_blip_2.Blip2Attention",
    "instructblip.modeling_instructblip.InstructBlipAttention",
    "instructblipvideo.modeling_instructblipvideo.InstructBlipVideoAttention",
    "mgp_str.modeling_mgp_str.MgpstrAttention",
    "seggpt.modeling_seggpt.SegGptAttention",
    "hiera.modeling_hiera.HieraMaskUnitAttention",
    "sam.modeling_sam.SamVisionAttention",  # and its SDPA subclass
    "sam_hq.modeling_sam_hq.SamHQVisionAttention",
    "sam2.modeling_sam2.Sam2MultiScaleAttention",
    "timesformer.modeling_timesformer.TimesformerSelfAttention",
    "vitdet.modeling_vitdet.VitDetAttention",
)


def vision_qkv_layouts(module: nn.Module) -> Mapping[str, Layout]:
    """``qkv``: ``[q: heads * head_dim | k: kv_heads * head_dim | v: kv_heads * head_dim]`` of a vision attention.

    ``kv_heads`` is ``num_key_value_heads`` where the module has it, else ``num_heads``; the head size is
    read from the weight, so a module that keeps only ``num_heads`` works too.

    Examples:
        >>> import torch
        >>> class Attn(torch.nn.Module):  # Qwen2-VL's vision attention: 4 heads of 16
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.num_heads = 4
        ...         self.qkv = torch.nn.Linear(64, 192)
        >>> vision_qkv_layouts(Attn())["qkv.weight"]
        Layout(dim=0, sizes=(64, 64, 64), names=('q', 'k', 'v'))
    """
    weight = tensor(module, "qkv.weight")
    if weight is None or weight.dim() != 2:
        return {}
    heads = int_attr(module, "num_heads", "num_attention_heads")
    kv = getattr(module, "num_key_value_heads", heads)
    kv = kv if isinstance(kv, int) and not isinstance(kv, bool) and kv > 0 else heads
    head_dim, rest = divmod(int(weight.shape[0]), heads + 2 * kv)
    if rest or head_dim == 0:
        return {}  # not [q | k | v] of these heads: leave it to the forward
    return fit(module, qkv("qkv", fused_qkv(heads, head_dim, kv), fused_qkv(heads, head_dim, kv, bias=True)))


def _gated_delta_net(module: nn.Module) -> Mapping[str, Layout]:
    """``in_proj_qkv``: ``[q: key_dim | k: key_dim | v: value_dim]``, split after the causal conv
    (``torch.split(mixed_qkv, [key_dim, key_dim, value_dim], dim=-1)``)."""
    key, value = int_attr(module, "key_dim"), int_attr(module, "value_dim")
    return fit(module, {"in_proj_qkv.weight": Layout(0, [key, key, value], names=("q", "k", "v"))})


def gated_query_layouts(module: nn.Module) -> Mapping[str, Layout]:
    """``q_proj`` holds ``[q | gate]`` in every head: ``q_proj(x).view(..., heads, 2 * head_dim).chunk(2, -1)``.

    Examples:
        >>> import torch
        >>> class Attn(torch.nn.Module):  # 4 heads of 16, each [q | gate]
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.head_dim = 16
        ...         self.q_proj = torch.nn.Linear(64, 128)
        >>> gated_query_layouts(Attn())["q_proj.weight"]
        Layout(dim=0, sizes=(16, 16), groups=4, names=('q', 'gate'))
    """
    weight = tensor(module, "q_proj.weight")
    d = int_attr(module, "head_dim")
    if weight is None or int(weight.shape[0]) % (2 * d):
        return {}
    heads = int(weight.shape[0]) // (2 * d)
    return fit(module, {"q_proj.weight": Layout(0, [d, d], groups=heads, names=("q", "gate"))})


# registered last: registering loads the built-in tables, which import this module's names
for _path in _VISION_QKV:
    register(f"{M}.{_path}")(vision_qkv_layouts)
for _path in (
    "qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet",
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet",
    "lara_mini.modeling_lara_mini.LaraMiniGatedDeltaNet",
):
    register(f"{M}.{_path}")(_gated_delta_net)
for _path in ("qwen3_5.modeling_qwen3_5.Qwen3_5Attention", "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeAttention"):
    register(f"{M}.{_path}")(gated_query_layouts)

"""Adapters for the stacked MoE experts of transformers (3-D ``(n_experts, ...)`` parameters) and DBRX's.

Matched by class path, like :mod:`packedinit.adapters.hf` (which imports this module, so
``packedinit.adapters.hf.experts_layouts`` is the documented path). Each was proven against the
family's forward in ``tests/test_hf_adapters.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from packedinit.adapters.fused import fused_gate_up
from packedinit.adapters.hf_common import M, fit, int_attr, tensor
from packedinit.layout import Layout
from packedinit.model.registry import register

__all__ = ["experts_layouts"]


# -- stacked MoE experts ------------------------------------------------------------------------------


def experts_layouts(module: nn.Module) -> Mapping[str, Layout]:
    """The layouts of a stack of MoE experts stored as 3-D ``(n_experts, ...)`` parameters.

    This is the adapter of the transformers experts classes decorated with
    ``use_experts_implementation`` (Mixtral, Qwen-MoE, DeepSeek-V3, GPT-OSS, ...). It
    reads the module's own flags: ``is_transposed`` (each expert computes ``x @ W``, so
    storage is ``(n, in, out)``), ``is_concatenated`` (``[gate | up]``; otherwise gate and
    up alternate, ``gate_up[..., ::2]`` being the gate) and ``has_gate`` (``up_proj``
    only). Every expert's gate, up and down projection is its own block, and fans
    exclude the expert dim. Stacked biases ``(n_experts, out)`` get one 1-D block per
    expert and part (whole-model init skips them, as it skips every bias). Register it for
    an experts class packedinit does not list yet::

        packedinit.register("transformers.models.aria.modeling_aria.AriaExperts")(experts_layouts)

    Args:
        module: the experts module (needs ``down_proj``; ``gate_up_proj`` or ``up_proj``).

    Returns:
        ``{"gate_up_proj" | "up_proj": Layout, "down_proj": Layout}``; empty when the
        module has no 3-D ``down_proj``.

    Examples:
        >>> import torch
        >>> class Experts(nn.Module):  # Mixtral's storage: 4 experts, hidden 8, intermediate 16
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.gate_up_proj = nn.Parameter(torch.empty(4, 2 * 16, 8))
        ...         self.down_proj = nn.Parameter(torch.empty(4, 8, 16))
        >>> for name, layout in experts_layouts(Experts()).items():
        ...     print(name, layout)
        down_proj Layout(dim=1, sizes=(8,), batch_dims=1)
        gate_up_proj Layout(dim=1, sizes=(16, 16), batch_dims=1, names=('gate', 'up'))
    """
    down = tensor(module, "down_proj")
    if down is None or down.dim() != 3:
        return {}
    transposed = bool(getattr(module, "is_transposed", False))
    interleaved = not bool(getattr(module, "is_concatenated", True))
    hidden, inter = (int(down.shape[2]), int(down.shape[1])) if transposed else (int(down.shape[1]), int(down.shape[2]))
    out_dim = 2 if transposed else 1
    layouts: dict[str, Layout] = {"down_proj": Layout(dim=out_dim, sizes=[hidden], transposed=transposed, batch_dims=1)}
    if getattr(module, "has_gate", True):
        layouts["gate_up_proj"] = fused_gate_up(inter, interleaved=interleaved, transposed=transposed, stacked=True)
    else:
        layouts["up_proj"] = Layout(dim=out_dim, sizes=[inter], transposed=transposed, batch_dims=1)
    # Stacked biases (n_experts, out) (GPT-OSS): one 1-D block per expert and part. Whole-model
    # init counts dims after the batch dims, so it skips them like any bias.
    for name, layout in (
        ("gate_up_proj_bias", fused_gate_up(inter, interleaved=interleaved, bias=True, stacked=True)),
        ("up_proj_bias", Layout(dim=1, sizes=[inter], batch_dims=1)),
        ("down_proj_bias", Layout(dim=1, sizes=[hidden], batch_dims=1)),
    ):
        b = tensor(module, name)
        if b is not None and b.dim() == 2:
            layouts[name] = layout
    return fit(module, layouts)


#: Experts classes whose forward was checked against ``experts_layouts`` (tests/test_hf_adapters.py).
_EXPERTS = (
    "mixtral.modeling_mixtral.MixtralExperts",
    "qwen2_moe.modeling_qwen2_moe.Qwen2MoeExperts",
    "qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts",
    "olmoe.modeling_olmoe.OlmoeExperts",
    "gpt_oss.modeling_gpt_oss.GptOssExperts",
    "phimoe.modeling_phimoe.PhimoeExperts",
    "glm4_moe.modeling_glm4_moe.Glm4MoeExperts",
    "granitemoe.modeling_granitemoe.GraniteMoeExperts",
    "deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts",
    "minimax.modeling_minimax.MiniMaxExperts",
    "ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeExperts",
    "deepseek_v2.modeling_deepseek_v2.DeepseekV2Experts",
    "jamba.modeling_jamba.JambaExperts",
    "qwen3_next.modeling_qwen3_next.Qwen3NextExperts",
    # every other class transformers 5.24 decorates with ``use_experts_implementation``: the decorator sets
    # the flags experts_layouts reads, and its grouped_mm / batched_mm forwards honour them (the sweep traces them)
    "afmoe.modeling_afmoe.AfmoeExperts",
    "aria.modeling_aria.AriaExperts",
    "axk1.modeling_axk1.AXK1Experts",
    "axk2.modeling_axk2.AXK2Experts",
    "bailing_hybrid.modeling_bailing_hybrid.BailingHybridExperts",
    "beam.modeling_beam.BeamExperts",
    "cohere2_moe.modeling_cohere2_moe.Cohere2MoeExperts",
    "deepseek_ocr2.modeling_deepseek_ocr2.DeepseekOcr2TextExperts",
    "deepseek_v32.modeling_deepseek_v32.DeepseekV32Experts",
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts",
    "diffusion_gemma.modeling_diffusion_gemma.DiffusionGemmaTextExperts",
    "dots1.modeling_dots1.Dots1Experts",
    "dots3_note.modeling_dots3_note.Dots3NoteExperts",
    "ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeMoeExperts",
    "exaone_moe.modeling_exaone_moe.ExaoneMoeExperts",
    "flex_olmo.modeling_flex_olmo.FlexOlmoExperts",
    "flint.modeling_flint.FlintExperts",
    "gemma4.modeling_gemma4.Gemma4TextExperts",
    "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteExperts",
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeTextExperts",
    "glm5_next.modeling_glm5_next.Glm5NextTextExperts",
    "glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaExperts",
    "granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWAExperts",
    "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridExperts",
    "granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedExperts",
    "hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1Experts",
    "hy_v3.modeling_hy_v3.HYV3Experts",
    "hy_v4.modeling_hy_v4.HYV4Experts",
    "hy_v4_vl.modeling_hy_v4_vl.HYV4VLExperts",
    "inkling.modeling_inkling.InklingExperts",
    "inkling2.modeling_inkling2.Inkling2Experts",
    "inkling2_loop.modeling_inkling2_loop.Inkling2LoopExperts",
    "kimi_linear.modeling_kimi_linear.KimiLinearExperts",
    "kolibri1.modeling_kolibri1.Kolibri1Experts",
    "laguna.modeling_laguna.LagunaExperts",
    "lara_mini.modeling_lara_mini.LaraMiniExperts",
    "lfm2_moe.modeling_lfm2_moe.Lfm2MoeExperts",
    "mellum.modeling_mellum.MellumExperts",
    "mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashExperts",
    "minimax_m2.modeling_minimax_m2.MiniMaxM2Experts",
    "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLExperts",
    "mistral4.modeling_mistral4.Mistral4Experts",
    "mistral_large4.modeling_mistral_large4.MistralLarge4TextExperts",
    "muse_spark.modeling_muse_spark.MuseSparkExperts",
    "nemotron_h.modeling_nemotron_h.NemotronHExperts",
    "openai_privacy_filter.modeling_openai_privacy_filter.OpenAIPrivacyFilterExperts",
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeExperts",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeTalkerTextExperts",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextExperts",
    "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextExperts",
    "qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextExperts",
    "solar_open.modeling_solar_open.SolarOpenExperts",
    "unlimited_ocr.modeling_unlimited_ocr.UnlimitedOcrTextExperts",
    "zaya.modeling_zaya.ZayaExperts",
)
for _path in _EXPERTS:
    register(f"{M}.{_path}")(experts_layouts)


@register(f"{M}.dbrx.modeling_dbrx.DbrxExpertGLU")
def _dbrx_experts(module: nn.Module) -> Mapping[str, Layout]:
    """``w1``, ``v1``, ``w2`` are ``(n_experts * ffn, hidden)``, viewed ``(-1, ffn, hidden)[expert]``.

    ``w1`` (gate) and ``v1`` (up) are used as ``x @ w.T``: per expert an ``(ffn, hidden)``
    block. ``w2`` is used as ``h @ w2``: per expert an ``(ffn, hidden)`` block stored
    ``(in, out)``, i.e. transposed.
    """
    ffn, n = int_attr(module, "ffn_hidden_size"), int_attr(module, "moe_num_experts")
    return fit(
        module,
        {
            "w1": Layout(dim=0, sizes=[ffn] * n),
            "v1": Layout(dim=0, sizes=[ffn] * n),
            "w2": Layout(dim=0, sizes=[ffn] * n, transposed=True),
        },
    )


@register(f"{M}.llama4.modeling_llama4.Llama4TextExperts")
def _llama4_experts(module: nn.Module) -> Mapping[str, Layout]:
    """``gate_up_proj`` ``(n, hidden, 2I)`` and ``down_proj`` ``(n, I, hidden)``, both used as ``bmm(x, W)``
    (stored ``(in, out)``); ``gate, up = gate_up.chunk(2, dim=-1)`` (transformers/models/llama4/modeling_llama4.py,
    ``Llama4TextExperts.forward``)."""
    down = tensor(module, "down_proj")
    if down is None or down.dim() != 3:
        return {}
    inter, hidden = int(down.shape[1]), int(down.shape[2])
    return fit(
        module,
        {
            "gate_up_proj": fused_gate_up(inter, transposed=True, stacked=True),
            "down_proj": Layout(dim=2, sizes=[hidden], transposed=True, batch_dims=1),
        },
    )

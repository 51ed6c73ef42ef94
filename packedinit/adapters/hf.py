"""Adapters for the fused layers of Hugging Face ``transformers`` model families.

Matched by class path (``"transformers.models.gpt2.modeling_gpt2.GPT2Attention"``),
so importing this module never imports ``transformers``: every number an adapter
needs is read from the module instance (its attributes, its ``config`` and the
stored shapes). Each adapter was proven against the family's own forward in
``tests/test_hf_adapters.py`` (transformers 5.24.0): setting one logical block
through packedinit's view of the layout changes exactly that projection.

A layout that does not fit the stored shape (a transformers version that packs
the layer differently) is refused by the registry with a
:class:`~packedinit.PackedInitError` naming the adapter, the module and the
parameter, before anything is written; an adapter never guesses.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from packedinit.adapters.fused import fused_gate_up, fused_qkv
from packedinit.adapters.hf_common import M, fit, int_attr, qkv, tensor
from packedinit.adapters.hf_experts import experts_layouts  # registers the experts classes too
from packedinit.adapters.hf_fused_qkv import gated_query_layouts, vision_qkv_layouts  # and these fused layers
from packedinit.adapters.hf_glu import glu_conv_layouts  # and the GLU-fed convolutions
from packedinit.adapters.hf_glu_linear import halves_layouts  # and the Linear layers cut in two halves
from packedinit.errors import PackedInitError
from packedinit.layout import Layout
from packedinit.model.registry import register

__all__ = ["experts_layouts", "gated_query_layouts", "glu_conv_layouts", "halves_layouts", "vision_qkv_layouts"]

# -- GPT-2, OpenAI GPT, ImageGPT, Decision Transformer: Conv1D stores (in, out) ----------------------------
#
# ``Conv1D(nf, nx)`` holds ``weight`` of shape ``(nx, nf)`` and computes ``x @ weight``: every Conv1D
# weight is stored transposed, packed or not, so even the unpacked ones (``c_proj``, ``q_attn``,
# the MLP's ``c_fc``/``c_proj``) get a one-block transposed Layout; otherwise fan_in and fan_out swap.
# The family adapters name every Conv1D weight they own: a generic ``Conv1D`` adapter would give
# ``c_attn.weight`` a second, one-block layout that the registry refuses as a disagreement.


def _conv1d(w: Tensor | None) -> Layout | None:
    return None if w is None or w.dim() != 2 else Layout(dim=1, sizes=[int(w.shape[1])], transposed=True)


@register(f"{M}.gpt2.modeling_gpt2.GPT2Attention")
@register(f"{M}.openai.modeling_openai.Attention")
@register(f"{M}.imagegpt.modeling_imagegpt.ImageGPTAttention")
@register(f"{M}.decision_transformer.modeling_decision_transformer.DecisionTransformerGPT2Attention")
def _gpt2_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``c_attn(x).split(self.split_size, dim=2)``: ``[q | k | v]`` (self) or ``[k | v]`` (cross), transposed."""
    e = int_attr(module, "split_size")
    names = ("k", "v") if getattr(module, "is_cross_attention", False) else ("q", "k", "v")
    sizes = [e] * len(names)
    out = {
        "c_attn.weight": Layout(dim=1, sizes=sizes, transposed=True, names=names),
        "c_attn.bias": Layout(dim=0, sizes=sizes, names=names),
    }
    for single in ("q_attn", "c_proj"):
        layout = _conv1d(tensor(module, f"{single}.weight"))
        if layout is not None:
            out[f"{single}.weight"] = layout
    return fit(module, out)


@register(f"{M}.gpt2.modeling_gpt2.GPT2MLP")
@register(f"{M}.openai.modeling_openai.MLP")
@register(f"{M}.imagegpt.modeling_imagegpt.ImageGPTMLP")
@register(f"{M}.decision_transformer.modeling_decision_transformer.DecisionTransformerGPT2MLP")
def _gpt2_mlp(module: nn.Module) -> Mapping[str, Layout]:
    """``c_proj(act(c_fc(x)))`` with two Conv1D: each weight one block, stored ``(in, out)``."""
    out: dict[str, Layout] = {}
    for single in ("c_fc", "c_proj"):
        layout = _conv1d(tensor(module, f"{single}.weight"))
        if layout is not None:
            out[f"{single}.weight"] = layout
    return out


# -- per-head interleaved [q k v]: GPT-NeoX, Bloom, Persimmon ----------------------------------------


def _per_head(module: nn.Module, heads: int, head_dim: int) -> Mapping[str, Layout]:
    return fit(
        module,
        qkv(
            "query_key_value",
            fused_qkv(heads, head_dim, interleaved=True),
            fused_qkv(heads, head_dim, interleaved=True, bias=True),
        ),
    )


@register(f"{M}.gpt_neox.modeling_gpt_neox.GPTNeoXAttention")
@register(f"{M}.gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention")
def _gpt_neox_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``qkv.view(..., -1, 3 * head_size).chunk(3, dim=-1)``: per head ``[q k v]``."""
    return _per_head(module, int_attr(module, "num_attention_heads"), int_attr(module, "head_size"))


@register(f"{M}.bloom.modeling_bloom.BloomAttention")
@register(f"{M}.persimmon.modeling_persimmon.PersimmonAttention")
def _bloom_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``fused_qkv.view(b, s, num_heads, 3, head_dim)``: per head ``[q k v]``."""
    return _per_head(module, int_attr(module, "num_heads"), int_attr(module, "head_dim"))


# -- Falcon: three layouts ----------------------------------------------------------------------------


@register(f"{M}.falcon.modeling_falcon.FalconAttention")
def _falcon_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``FalconAttention._split_heads``.

    * new decoder architecture: ``view(b, s, -1, nh // nkv + 2, d)``: per kv head ``[q_1..q_g k v]``;
    * multi-query: ``view(b, s, nh + 2, d)``: ``[q | k | v]`` with one k and one v head;
    * otherwise: ``view(b, s, nh, 3, d)``: per head ``[q k v]``.
    """
    nh, d = int_attr(module, "num_heads"), int_attr(module, "head_dim")
    if getattr(module, "new_decoder_architecture", False):
        nkv, interleaved = int_attr(module, "num_kv_heads"), True
    elif getattr(module, "multi_query", False):
        nkv, interleaved = 1, False
    else:
        nkv, interleaved = nh, True
    return fit(
        module,
        qkv(
            "query_key_value",
            fused_qkv(nh, d, nkv, interleaved=interleaved),
            fused_qkv(nh, d, nkv, interleaved=interleaved, bias=True),
        ),
    )


# -- [q | k | v] with GQA/MQA: Phi-3, DBRX, MPT, GPT-BigCode ----------------------------------------


@register(f"{M}.phi3.modeling_phi3.Phi3Attention")
@register(f"{M}.phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalAttention")
def _phi3_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``qkv[..., :query_pos]``, then ``num_key_value_heads * head_dim`` for k, the rest for v."""
    nh = int_attr(module, "num_attention_heads")
    d, nkv = int_attr(module, "head_dim"), int_attr(module, "num_key_value_heads")
    return fit(module, qkv("qkv_proj", fused_qkv(nh, d, nkv), fused_qkv(nh, d, nkv, bias=True)))


@register(f"{M}.phi3.modeling_phi3.Phi3MLP")
@register(f"{M}.phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalMLP")
@register(f"{M}.glm.modeling_glm.GlmMLP")
@register(f"{M}.glm4.modeling_glm4.Glm4MLP")
@register(f"{M}.glm4v.modeling_glm4v.Glm4vTextMLP")
@register(f"{M}.glm_image.modeling_glm_image.GlmImageTextMLP")
@register(f"{M}.glm_ocr.modeling_glm_ocr.GlmOcrTextMLP")
@register(f"{M}.dia.modeling_dia.DiaMLP")
@register(f"{M}.dots3_note.modeling_dots3_note.Dots3NoteAudioMLP")
@register(f"{M}.esmfold2.modeling_esmfold2.EsmFold2SwiGLU")
def _phi3_mlp(module: nn.Module) -> Mapping[str, Layout]:
    """``gate, up_states = gate_up_proj(x).chunk(2, dim=-1)``."""
    w = tensor(module, "gate_up_proj.weight")
    if w is None:
        return {}
    i = int(w.shape[0]) // 2
    return fit(module, {"gate_up_proj.weight": fused_gate_up(i), "gate_up_proj.bias": fused_gate_up(i, bias=True)})


@register(f"{M}.dbrx.modeling_dbrx.DbrxAttention")
def _dbrx_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``Wqkv(x).split([hidden_size, nkv * head_dim, nkv * head_dim], dim=2)``."""
    nh, d = int_attr(module, "num_heads"), int_attr(module, "head_dim")
    nkv = int_attr(module, "num_key_value_heads")
    return fit(module, qkv("Wqkv", fused_qkv(nh, d, nkv), fused_qkv(nh, d, nkv, bias=True)))


@register(f"{M}.modernbert.modeling_modernbert.ModernBertAttention")
def _modernbert_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``Wqkv(x).view(..., 3, -1, head_dim).unbind(dim=-3)``: ``[q | k | v]``."""
    d = int_attr(module, "head_dim")
    nh = int_attr(module, "num_attention_heads")
    return fit(module, qkv("Wqkv", fused_qkv(nh, d), fused_qkv(nh, d, bias=True)))


@register(f"{M}.modernbert.modeling_modernbert.ModernBertMLP")
@register(f"{M}.modernbert_decoder.modeling_modernbert_decoder.ModernBertDecoderMLP")
def _modernbert_mlp(module: nn.Module) -> Mapping[str, Layout]:
    """``input, gate = self.Wi(hidden_states).chunk(2, dim=-1)``: ``[input | gate]``."""
    w = tensor(module, "Wi.weight")
    if w is None:
        return {}
    i = int(w.shape[0]) // 2
    layout = Layout(0, [i, i], names=("input", "gate"))
    return fit(module, {"Wi.weight": layout, "Wi.bias": layout})


@register(f"{M}.mpt.modeling_mpt.MptAttention")
def _mpt_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``Wqkv(x).chunk(3, dim=2)``: ``[q | k | v]``."""
    nh, d = int_attr(module, "n_heads"), int_attr(module, "head_dim")
    return fit(module, qkv("Wqkv", fused_qkv(nh, d), fused_qkv(nh, d, bias=True)))


@register(f"{M}.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeAttention")
def _gpt_bigcode_attention(module: nn.Module) -> Mapping[str, Layout]:
    """Multi-query: ``split((embed_dim, kv_dim, kv_dim), dim=3)``; multi-head: ``view(.., nh, 3 * d)``.

    Cross-attention gets no layout: its forward splits ``c_attn`` into two
    ``head_dim`` pieces, which only runs with one head.
    """
    if getattr(module, "is_cross_attention", False):
        return {}
    nh, d = int_attr(module, "num_heads"), int_attr(module, "head_dim")
    if getattr(module, "multi_query", False):
        return fit(module, qkv("c_attn", fused_qkv(nh, d, 1), fused_qkv(nh, d, 1, bias=True)))
    return fit(
        module, qkv("c_attn", fused_qkv(nh, d, interleaved=True), fused_qkv(nh, d, interleaved=True, bias=True))
    )


# -- CodeGen: [q v k] inside each of mp_num = 4 model-parallel shards ---------------------------------


@register(f"{M}.codegen.modeling_codegen.CodeGenAttention")
def _codegen_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``qkv.view(..., mp_num, 3 * local_dim)``, then ``query, value, key = qkv.split(local_dim, -1)``."""
    # transformers 5.20 and older (checked 5.20.2, the newest on Python 3.10) hard-code ``mp_num = 4`` in
    # the forward, with the same split; later versions keep it as ``self.mp_num``.
    e, mp = int_attr(module, "embed_dim"), (int_attr(module, "mp_num") if hasattr(module, "mp_num") else 4)
    if e % mp:
        raise PackedInitError(f"CodeGenAttention: embed_dim={e} is not a multiple of mp_num={mp}.")
    local = e // mp
    return fit(module, {"qkv_proj.weight": Layout(0, [local] * 3, groups=mp, names=("q", "v", "k"))})


# -- Mamba: [x | z] input projection, [dt | B | C] selective projection ---------------------------------


@register(f"{M}.mamba.modeling_mamba.MambaMixer")
@register(f"{M}.falcon_mamba.modeling_falcon_mamba.FalconMambaMixer")
@register(f"{M}.jamba.modeling_jamba.JambaMambaMixer")
def _mamba_mixer(module: nn.Module) -> Mapping[str, Layout]:
    """``hidden_states_B_C, gate = in_proj(x).transpose(1, 2).chunk(2, dim=1)`` and
    ``time_step, B, C = torch.split(x_proj(h), [time_step_rank, ssm_state_size, ssm_state_size], dim=-1)``."""
    i = int_attr(module, "intermediate_size")
    r, n = int_attr(module, "time_step_rank"), int_attr(module, "ssm_state_size")
    xz = Layout(0, [i, i], names=("x", "z"))
    return fit(
        module,
        {"in_proj.weight": xz, "in_proj.bias": xz, "x_proj.weight": Layout(0, [r, n, n], names=("dt", "B", "C"))},
    )


# -- Mamba-2 mixers: in_proj = [z | x | B | C | dt] ----------------------------------------------------------


@register(f"{M}.mamba2.modeling_mamba2.Mamba2Mixer")
@register(f"{M}.zamba2.modeling_zamba2.Zamba2MambaMixer")
@register(f"{M}.bamba.modeling_bamba.BambaMixer")
@register(f"{M}.falcon_h1.modeling_falcon_h1.FalconH1Mixer")
@register(f"{M}.nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer")
@register(f"{M}.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMambaLayer")
def _mamba2_mixer(module: nn.Module) -> Mapping[str, Layout]:
    """``gate, xBC, dt = in_proj(x).split([I, conv_dim, H])``, then ``x, B, C = split(xBC, [I, G * N, G * N])``.

    B and C hold one ``(N, hidden)`` row block per group, as q holds one per head: each is one
    block. The depthwise ``conv1d`` over ``[x | B | C]`` is per channel and not split.
    """
    i, h = int_attr(module, "intermediate_size"), int_attr(module, "num_heads")
    gn = int_attr(module, "n_groups") * int_attr(module, "ssm_state_size")
    layout = Layout(0, [i, i, gn, gn, h], names=("z", "x", "B", "C", "dt"))
    return fit(module, {"in_proj.weight": layout, "in_proj.bias": layout})


# -- multi-head latent attention (DeepSeek-V2/V3 and the families that copy it) ------------------------------

_MLA = (
    "deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention",
    "deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention",
    "deepseek_v32.modeling_deepseek_v32.DeepseekV32Attention",
    "axk1.modeling_axk1.AXK1Attention",
    "axk2.modeling_axk2.AXK2Attention",
    "bailing_hybrid.modeling_bailing_hybrid.BailingHybridAttention",
    "dots3_note.modeling_dots3_note.Dots3NoteTextAttention",
    "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteAttention",
    "glm5_next.modeling_glm5_next.Glm5NextTextAttention",
    "glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaAttention",
    "hy_v4.modeling_hy_v4.HYV4Attention",
    "hy_v4_vl.modeling_hy_v4_vl.HYV4VLAttention",
    "kimi_linear.modeling_kimi_linear.KimiLinearAttention",
    "longcat_flash.modeling_longcat_flash.LongcatFlashMLA",
    "minicpm3.modeling_minicpm3.MiniCPM3Attention",
    "mistral4.modeling_mistral4.Mistral4Attention",
    "mistral_large4.modeling_mistral_large4.MistralLarge4TextAttention",
    "youtu.modeling_youtu.YoutuAttention",
)


def _mla_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``kv_latent, k_rot = split(kv_a_proj_with_mqa(x), [kv_lora_rank, rope])``; ``kv_b_proj(latent)``
    viewed ``(..., heads, nope + v)`` and split ``[k_nope, v]``: per head ``[k_nope | v]``.

    The query (``q_proj`` or ``q_b_proj``) is split into ``[q_nope | q_rot]`` per head and
    concatenated back into one query: one block, not packed.
    """
    r, rope = int_attr(module, "kv_lora_rank"), int_attr(module, "qk_rope_head_dim")
    nope, v = int_attr(module, "qk_nope_head_dim"), int_attr(module, "v_head_dim")
    out: dict[str, Layout] = {}
    if r > 0 and rope > 0:  # a config without the rotary part (GLM-5-Next: rope 0) splits off nothing
        kv_a = Layout(0, [r, rope], names=("kv_latent", "k_rot"))
        out = {"kv_a_proj_with_mqa.weight": kv_a, "kv_a_proj_with_mqa.bias": kv_a}
    kv_b = tensor(module, "kv_b_proj.weight")
    if kv_b is not None and kv_b.dim() == 2 and nope > 0 and v > 0 and int(kv_b.shape[0]) % (nope + v) == 0:
        out["kv_b_proj.weight"] = Layout(0, [nope, v], groups=int(kv_b.shape[0]) // (nope + v), names=("k_nope", "v"))
    return fit(module, out)


for _path in _MLA:
    register(f"{M}.{_path}")(_mla_attention)


# -- Qwen3-Next: gated attention, gated delta net -----------------------------------------------------------


@register(f"{M}.qwen3_next.modeling_qwen3_next.Qwen3NextAttention")
def _qwen3_next_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``query, gate = chunk(q_proj(x).view(..., -1, 2 * head_dim), 2, dim=-1)``: per head ``[q | gate]``."""
    d = int_attr(module, "head_dim")
    w = tensor(module, "q_proj.weight")
    if w is None or int(w.shape[0]) % (2 * d):
        return {}
    layout = Layout(0, [d, d], groups=int(w.shape[0]) // (2 * d), names=("q", "gate"))
    return fit(module, {"q_proj.weight": layout, "q_proj.bias": layout})


@register(f"{M}.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet")
def _qwen3_next_delta_net(module: nn.Module) -> Mapping[str, Layout]:
    """``fix_query_key_value_ordering``: per key head ``[q | k | v | z]`` (``v``, ``z``: ``nv / nk`` value
    heads each) in ``in_proj_qkvz``, and ``[b | a]`` (``nv / nk`` each) in ``in_proj_ba``."""
    nk, nv = int_attr(module, "num_k_heads"), int_attr(module, "num_v_heads")
    dk, dv = int_attr(module, "head_k_dim"), int_attr(module, "head_v_dim")
    if nv % nk:
        raise PackedInitError(f"Qwen3NextGatedDeltaNet: num_v_heads={nv} is not a multiple of num_k_heads={nk}.")
    g = nv // nk
    return fit(
        module,
        {
            "in_proj_qkvz.weight": Layout(0, [dk, dk, g * dv, g * dv], groups=nk, names=("q", "k", "v", "z")),
            "in_proj_ba.weight": Layout(0, [g, g], groups=nk, names=("b", "a")),
        },
    )

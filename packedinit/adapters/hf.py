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
from packedinit.errors import PackedInitError
from packedinit.layout import Layout
from packedinit.model.registry import register
from packedinit.model.wrappers import find

__all__ = ["experts_layouts"]

_M = "transformers.models"


def _tensor(module: nn.Module, name: str) -> Tensor | None:
    """The parameter ``name`` (dotted, relative to ``module``, through wrappers), or ``None``; buffers never count."""
    found = find(module, name)
    return None if found is None else found.param


def _fit(module: nn.Module, layouts: Mapping[str, Layout]) -> dict[str, Layout]:
    """Drop the layouts of tensors the module registers as ``None`` (``bias=False``); keep the rest.

    A name that does not resolve at all (a wrapper packedinit does not know moved the
    parameter) is kept, so that the registry refuses it loudly, naming the module the
    path stopped at; it is never dropped in silence. The registry also checks every
    kept layout against its parameter's shape and names this adapter when one does not
    fit (a transformers version that packs the layer differently).
    """
    out: dict[str, Layout] = {}
    for name, layout in layouts.items():
        found = find(module, name)
        if found is None or found.param is not None:
            out[name] = layout
    return out


def _int(module: nn.Module, *names: str) -> int:
    """The first of ``names`` found as an int on ``module`` or on ``module.config``."""
    config = getattr(module, "config", None)
    for owner in (module, config):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    raise PackedInitError(
        f"{type(module).__qualname__} has none of {list(names)} (as an int on the module or its config), which "
        f"this adapter reads to lay out the packed projection; give the layout yourself with "
        f"packedinit.annotate(module, ...)."
    )


def _qkv(prefix: str, layout: Layout, bias: Layout) -> dict[str, Layout]:
    return {f"{prefix}.weight": layout, f"{prefix}.bias": bias}


# -- GPT-2, OpenAI GPT, ImageGPT, Decision Transformer: Conv1D stores (in, out) ----------------------------
#
# ``Conv1D(nf, nx)`` holds ``weight`` of shape ``(nx, nf)`` and computes ``x @ weight``: every Conv1D
# weight is stored transposed, packed or not, so even the unpacked ones (``c_proj``, ``q_attn``,
# the MLP's ``c_fc``/``c_proj``) get a one-block transposed Layout; otherwise fan_in and fan_out swap.
# The family adapters name every Conv1D weight they own: a generic ``Conv1D`` adapter would give
# ``c_attn.weight`` a second, one-block layout that the registry refuses as a disagreement.


def _conv1d(w: Tensor | None) -> Layout | None:
    return None if w is None or w.dim() != 2 else Layout(dim=1, sizes=[int(w.shape[1])], transposed=True)


@register(f"{_M}.gpt2.modeling_gpt2.GPT2Attention")
@register(f"{_M}.openai.modeling_openai.Attention")
@register(f"{_M}.imagegpt.modeling_imagegpt.ImageGPTAttention")
@register(f"{_M}.decision_transformer.modeling_decision_transformer.DecisionTransformerGPT2Attention")
def _gpt2_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``c_attn(x).split(self.split_size, dim=2)``: ``[q | k | v]`` (self) or ``[k | v]`` (cross), transposed."""
    e = _int(module, "split_size")
    names = ("k", "v") if getattr(module, "is_cross_attention", False) else ("q", "k", "v")
    sizes = [e] * len(names)
    out = {
        "c_attn.weight": Layout(dim=1, sizes=sizes, transposed=True, names=names),
        "c_attn.bias": Layout(dim=0, sizes=sizes, names=names),
    }
    for single in ("q_attn", "c_proj"):
        layout = _conv1d(_tensor(module, f"{single}.weight"))
        if layout is not None:
            out[f"{single}.weight"] = layout
    return _fit(module, out)


@register(f"{_M}.gpt2.modeling_gpt2.GPT2MLP")
@register(f"{_M}.openai.modeling_openai.MLP")
@register(f"{_M}.imagegpt.modeling_imagegpt.ImageGPTMLP")
@register(f"{_M}.decision_transformer.modeling_decision_transformer.DecisionTransformerGPT2MLP")
def _gpt2_mlp(module: nn.Module) -> Mapping[str, Layout]:
    """``c_proj(act(c_fc(x)))`` with two Conv1D: each weight one block, stored ``(in, out)``."""
    out: dict[str, Layout] = {}
    for single in ("c_fc", "c_proj"):
        layout = _conv1d(_tensor(module, f"{single}.weight"))
        if layout is not None:
            out[f"{single}.weight"] = layout
    return out


# -- per-head interleaved [q k v]: GPT-NeoX, Bloom, Persimmon ----------------------------------------


def _per_head(module: nn.Module, heads: int, head_dim: int) -> Mapping[str, Layout]:
    return _fit(
        module,
        _qkv(
            "query_key_value",
            fused_qkv(heads, head_dim, interleaved=True),
            fused_qkv(heads, head_dim, interleaved=True, bias=True),
        ),
    )


@register(f"{_M}.gpt_neox.modeling_gpt_neox.GPTNeoXAttention")
@register(f"{_M}.gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention")
def _gpt_neox_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``qkv.view(..., -1, 3 * head_size).chunk(3, dim=-1)``: per head ``[q k v]``."""
    return _per_head(module, _int(module, "num_attention_heads"), _int(module, "head_size"))


@register(f"{_M}.bloom.modeling_bloom.BloomAttention")
@register(f"{_M}.persimmon.modeling_persimmon.PersimmonAttention")
def _bloom_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``fused_qkv.view(b, s, num_heads, 3, head_dim)``: per head ``[q k v]``."""
    return _per_head(module, _int(module, "num_heads"), _int(module, "head_dim"))


# -- Falcon: three layouts ----------------------------------------------------------------------------


@register(f"{_M}.falcon.modeling_falcon.FalconAttention")
def _falcon_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``FalconAttention._split_heads``.

    * new decoder architecture: ``view(b, s, -1, nh // nkv + 2, d)``: per kv head ``[q_1..q_g k v]``;
    * multi-query: ``view(b, s, nh + 2, d)``: ``[q | k | v]`` with one k and one v head;
    * otherwise: ``view(b, s, nh, 3, d)``: per head ``[q k v]``.
    """
    nh, d = _int(module, "num_heads"), _int(module, "head_dim")
    if getattr(module, "new_decoder_architecture", False):
        nkv, interleaved = _int(module, "num_kv_heads"), True
    elif getattr(module, "multi_query", False):
        nkv, interleaved = 1, False
    else:
        nkv, interleaved = nh, True
    return _fit(
        module,
        _qkv(
            "query_key_value",
            fused_qkv(nh, d, nkv, interleaved=interleaved),
            fused_qkv(nh, d, nkv, interleaved=interleaved, bias=True),
        ),
    )


# -- [q | k | v] with GQA/MQA: Phi-3, DBRX, MPT, GPT-BigCode ----------------------------------------


@register(f"{_M}.phi3.modeling_phi3.Phi3Attention")
@register(f"{_M}.phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalAttention")
def _phi3_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``qkv[..., :query_pos]``, then ``num_key_value_heads * head_dim`` for k, the rest for v."""
    nh = _int(module, "num_attention_heads")
    d, nkv = _int(module, "head_dim"), _int(module, "num_key_value_heads")
    return _fit(module, _qkv("qkv_proj", fused_qkv(nh, d, nkv), fused_qkv(nh, d, nkv, bias=True)))


@register(f"{_M}.phi3.modeling_phi3.Phi3MLP")
@register(f"{_M}.phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalMLP")
@register(f"{_M}.glm.modeling_glm.GlmMLP")
@register(f"{_M}.glm4.modeling_glm4.Glm4MLP")
@register(f"{_M}.glm4v.modeling_glm4v.Glm4vTextMLP")
@register(f"{_M}.glm_image.modeling_glm_image.GlmImageTextMLP")
@register(f"{_M}.glm_ocr.modeling_glm_ocr.GlmOcrTextMLP")
@register(f"{_M}.dia.modeling_dia.DiaMLP")
@register(f"{_M}.dots3_note.modeling_dots3_note.Dots3NoteAudioMLP")
@register(f"{_M}.esmfold2.modeling_esmfold2.EsmFold2SwiGLU")
def _phi3_mlp(module: nn.Module) -> Mapping[str, Layout]:
    """``gate, up_states = gate_up_proj(x).chunk(2, dim=-1)``."""
    w = _tensor(module, "gate_up_proj.weight")
    if w is None:
        return {}
    i = int(w.shape[0]) // 2
    return _fit(module, {"gate_up_proj.weight": fused_gate_up(i), "gate_up_proj.bias": fused_gate_up(i, bias=True)})


@register(f"{_M}.dbrx.modeling_dbrx.DbrxAttention")
def _dbrx_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``Wqkv(x).split([hidden_size, nkv * head_dim, nkv * head_dim], dim=2)``."""
    nh, d = _int(module, "num_heads"), _int(module, "head_dim")
    nkv = _int(module, "num_key_value_heads")
    return _fit(module, _qkv("Wqkv", fused_qkv(nh, d, nkv), fused_qkv(nh, d, nkv, bias=True)))


@register(f"{_M}.modernbert.modeling_modernbert.ModernBertAttention")
def _modernbert_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``Wqkv(x).view(..., 3, -1, head_dim).unbind(dim=-3)``: ``[q | k | v]``."""
    d = _int(module, "head_dim")
    nh = _int(module, "num_attention_heads")
    return _fit(module, _qkv("Wqkv", fused_qkv(nh, d), fused_qkv(nh, d, bias=True)))


@register(f"{_M}.modernbert.modeling_modernbert.ModernBertMLP")
@register(f"{_M}.modernbert_decoder.modeling_modernbert_decoder.ModernBertDecoderMLP")
def _modernbert_mlp(module: nn.Module) -> Mapping[str, Layout]:
    """``input, gate = self.Wi(hidden_states).chunk(2, dim=-1)``: ``[input | gate]``."""
    w = _tensor(module, "Wi.weight")
    if w is None:
        return {}
    i = int(w.shape[0]) // 2
    layout = Layout(0, [i, i], names=("input", "gate"))
    return _fit(module, {"Wi.weight": layout, "Wi.bias": layout})


@register(f"{_M}.mpt.modeling_mpt.MptAttention")
def _mpt_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``Wqkv(x).chunk(3, dim=2)``: ``[q | k | v]``."""
    nh, d = _int(module, "n_heads"), _int(module, "head_dim")
    return _fit(module, _qkv("Wqkv", fused_qkv(nh, d), fused_qkv(nh, d, bias=True)))


@register(f"{_M}.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeAttention")
def _gpt_bigcode_attention(module: nn.Module) -> Mapping[str, Layout]:
    """Multi-query: ``split((embed_dim, kv_dim, kv_dim), dim=3)``; multi-head: ``view(.., nh, 3 * d)``.

    Cross-attention gets no layout: its forward splits ``c_attn`` into two
    ``head_dim`` pieces, which only runs with one head.
    """
    if getattr(module, "is_cross_attention", False):
        return {}
    nh, d = _int(module, "num_heads"), _int(module, "head_dim")
    if getattr(module, "multi_query", False):
        return _fit(module, _qkv("c_attn", fused_qkv(nh, d, 1), fused_qkv(nh, d, 1, bias=True)))
    return _fit(
        module, _qkv("c_attn", fused_qkv(nh, d, interleaved=True), fused_qkv(nh, d, interleaved=True, bias=True))
    )


# -- CodeGen: [q v k] inside each of mp_num = 4 model-parallel shards ---------------------------------


@register(f"{_M}.codegen.modeling_codegen.CodeGenAttention")
def _codegen_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``qkv.view(..., mp_num, 3 * local_dim)``, then ``query, value, key = qkv.split(local_dim, -1)``."""
    # transformers 5.20 and older (checked 5.20.2, the newest on Python 3.10) hard-code ``mp_num = 4`` in
    # the forward, with the same split; later versions keep it as ``self.mp_num``.
    e, mp = _int(module, "embed_dim"), (_int(module, "mp_num") if hasattr(module, "mp_num") else 4)
    if e % mp:
        raise PackedInitError(f"CodeGenAttention: embed_dim={e} is not a multiple of mp_num={mp}.")
    local = e // mp
    return _fit(module, {"qkv_proj.weight": Layout(0, [local] * 3, groups=mp, names=("q", "v", "k"))})


# -- Mamba: [x | z] input projection, [dt | B | C] selective projection ---------------------------------


@register(f"{_M}.mamba.modeling_mamba.MambaMixer")
@register(f"{_M}.falcon_mamba.modeling_falcon_mamba.FalconMambaMixer")
@register(f"{_M}.jamba.modeling_jamba.JambaMambaMixer")
def _mamba_mixer(module: nn.Module) -> Mapping[str, Layout]:
    """``hidden_states_B_C, gate = in_proj(x).transpose(1, 2).chunk(2, dim=1)`` and
    ``time_step, B, C = torch.split(x_proj(h), [time_step_rank, ssm_state_size, ssm_state_size], dim=-1)``."""
    i = _int(module, "intermediate_size")
    r, n = _int(module, "time_step_rank"), _int(module, "ssm_state_size")
    xz = Layout(0, [i, i], names=("x", "z"))
    return _fit(
        module,
        {"in_proj.weight": xz, "in_proj.bias": xz, "x_proj.weight": Layout(0, [r, n, n], names=("dt", "B", "C"))},
    )


# -- Mamba-2 mixers: in_proj = [z | x | B | C | dt] ----------------------------------------------------------


@register(f"{_M}.mamba2.modeling_mamba2.Mamba2Mixer")
@register(f"{_M}.zamba2.modeling_zamba2.Zamba2MambaMixer")
@register(f"{_M}.bamba.modeling_bamba.BambaMixer")
@register(f"{_M}.falcon_h1.modeling_falcon_h1.FalconH1Mixer")
@register(f"{_M}.nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer")
@register(f"{_M}.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMambaLayer")
def _mamba2_mixer(module: nn.Module) -> Mapping[str, Layout]:
    """``gate, xBC, dt = in_proj(x).split([I, conv_dim, H])``, then ``x, B, C = split(xBC, [I, G * N, G * N])``.

    B and C hold one ``(N, hidden)`` row block per group, as q holds one per head: each is one
    block. The depthwise ``conv1d`` over ``[x | B | C]`` is per channel and not split.
    """
    i, h = _int(module, "intermediate_size"), _int(module, "num_heads")
    gn = _int(module, "n_groups") * _int(module, "ssm_state_size")
    layout = Layout(0, [i, i, gn, gn, h], names=("z", "x", "B", "C", "dt"))
    return _fit(module, {"in_proj.weight": layout, "in_proj.bias": layout})


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
    r, rope = _int(module, "kv_lora_rank"), _int(module, "qk_rope_head_dim")
    nope, v = _int(module, "qk_nope_head_dim"), _int(module, "v_head_dim")
    out: dict[str, Layout] = {}
    if r > 0 and rope > 0:  # a config without the rotary part (GLM-5-Next: rope 0) splits off nothing
        kv_a = Layout(0, [r, rope], names=("kv_latent", "k_rot"))
        out = {"kv_a_proj_with_mqa.weight": kv_a, "kv_a_proj_with_mqa.bias": kv_a}
    kv_b = _tensor(module, "kv_b_proj.weight")
    if kv_b is not None and kv_b.dim() == 2 and nope > 0 and v > 0 and int(kv_b.shape[0]) % (nope + v) == 0:
        out["kv_b_proj.weight"] = Layout(0, [nope, v], groups=int(kv_b.shape[0]) // (nope + v), names=("k_nope", "v"))
    return _fit(module, out)


for _path in _MLA:
    register(f"{_M}.{_path}")(_mla_attention)


# -- Qwen3-Next: gated attention, gated delta net -----------------------------------------------------------


@register(f"{_M}.qwen3_next.modeling_qwen3_next.Qwen3NextAttention")
def _qwen3_next_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``query, gate = chunk(q_proj(x).view(..., -1, 2 * head_dim), 2, dim=-1)``: per head ``[q | gate]``."""
    d = _int(module, "head_dim")
    w = _tensor(module, "q_proj.weight")
    if w is None or int(w.shape[0]) % (2 * d):
        return {}
    layout = Layout(0, [d, d], groups=int(w.shape[0]) // (2 * d), names=("q", "gate"))
    return _fit(module, {"q_proj.weight": layout, "q_proj.bias": layout})


@register(f"{_M}.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet")
def _qwen3_next_delta_net(module: nn.Module) -> Mapping[str, Layout]:
    """``fix_query_key_value_ordering``: per key head ``[q | k | v | z]`` (``v``, ``z``: ``nv / nk`` value
    heads each) in ``in_proj_qkvz``, and ``[b | a]`` (``nv / nk`` each) in ``in_proj_ba``."""
    nk, nv = _int(module, "num_k_heads"), _int(module, "num_v_heads")
    dk, dv = _int(module, "head_k_dim"), _int(module, "head_v_dim")
    if nv % nk:
        raise PackedInitError(f"Qwen3NextGatedDeltaNet: num_v_heads={nv} is not a multiple of num_k_heads={nk}.")
    g = nv // nk
    return _fit(
        module,
        {
            "in_proj_qkvz.weight": Layout(0, [dk, dk, g * dv, g * dv], groups=nk, names=("q", "k", "v", "z")),
            "in_proj_ba.weight": Layout(0, [g, g], groups=nk, names=("b", "a")),
        },
    )


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
    down = _tensor(module, "down_proj")
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
        b = _tensor(module, name)
        if b is not None and b.dim() == 2:
            layouts[name] = layout
    return _fit(module, layouts)


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
)
for _path in _EXPERTS:
    register(f"{_M}.{_path}")(experts_layouts)


@register(f"{_M}.dbrx.modeling_dbrx.DbrxExpertGLU")
def _dbrx_experts(module: nn.Module) -> Mapping[str, Layout]:
    """``w1``, ``v1``, ``w2`` are ``(n_experts * ffn, hidden)``, viewed ``(-1, ffn, hidden)[expert]``.

    ``w1`` (gate) and ``v1`` (up) are used as ``x @ w.T``: per expert an ``(ffn, hidden)``
    block. ``w2`` is used as ``h @ w2``: per expert an ``(ffn, hidden)`` block stored
    ``(in, out)``, i.e. transposed.
    """
    ffn, n = _int(module, "ffn_hidden_size"), _int(module, "moe_num_experts")
    return _fit(
        module,
        {
            "w1": Layout(dim=0, sizes=[ffn] * n),
            "v1": Layout(dim=0, sizes=[ffn] * n),
            "w2": Layout(dim=0, sizes=[ffn] * n, transposed=True),
        },
    )

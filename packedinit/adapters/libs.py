"""Adapters for the fused layers of timm, open_clip, diffusers, x-transformers and torchrl.

Matched by class path, so importing this module never imports any of those libraries:
every number an adapter needs is read from the module instance. Each layout is the one the
library's own forward splits the projection by (the forward line is quoted on each adapter),
and each was checked against that forward in ``tests/test_libs_<library>.py`` with the real
package (timm 1.0.31, open_clip 3.3.0, diffusers 0.42.1, x-transformers 2.31.10, torchrl 0.14.1).

open_clip's default ``ResidualAttentionBlock`` holds an ``nn.MultiheadAttention``, which the
torch.nn adapter already covers; torchrl's ``LSTM`` / ``GRU`` subclass ``nn.RNNBase`` and are
covered by it too (their ``mode`` names the gates). What is listed here has no torch.nn base
that says how it is packed.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from packedinit.adapters.fused import fused_gate_up, fused_qkv
from packedinit.adapters.hf_common import fit, int_attr, qkv, tensor
from packedinit.layout import Layout
from packedinit.model.registry import register

__all__ = ["TIMM", "OPEN_CLIP", "DIFFUSERS", "TORCHRL", "X_TRANSFORMERS"]

TIMM = "timm"
OPEN_CLIP = "open_clip"
DIFFUSERS = "diffusers.models"
TORCHRL = "torchrl.modules.tensordict_module.rnn"
X_TRANSFORMERS = "x_transformers.x_transformers"


# -- timm ---------------------------------------------------------------------------------------------


@register(f"{TIMM}.layers.attention.Attention")
def _timm_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``qkv(x).reshape(B, N, 3, num_heads, head_dim)``: ``[q | k | v]`` (timm/layers/attention.py)."""
    nh, d = int_attr(module, "num_heads"), int_attr(module, "head_dim")
    return fit(module, qkv("qkv", fused_qkv(nh, d), fused_qkv(nh, d, bias=True)))


@register(f"{TIMM}.models.maxxvit.Attention2d")
@register(f"{TIMM}.models.maxxvit.AttentionCl")
def _maxxvit_attention(module: nn.Module) -> Mapping[str, Layout]:
    """MaxViT / CoAtNet attention, ``qkv`` a 1x1 ``Conv2d`` (``Attention2d``) or a ``Linear`` (``AttentionCl``).

    * ``head_first`` (the default): ``qkv(x).view(B, num_heads, dim_head * 3, -1).chunk(3, dim=2)``:
      per head ``[q k v]``;
    * otherwise ``qkv(x).reshape(B, 3, num_heads, dim_head, -1)``: ``[q | k | v]``.
    """
    nh, d = int_attr(module, "num_heads"), int_attr(module, "dim_head")
    interleaved = bool(getattr(module, "head_first", True))
    return fit(
        module,
        qkv("qkv", fused_qkv(nh, d, interleaved=interleaved), fused_qkv(nh, d, interleaved=interleaved, bias=True)),
    )


@register(f"{TIMM}.models.gcvit.WindowAttentionGlobal")
def _gcvit_attention(module: nn.Module) -> Mapping[str, Layout]:
    """GC ViT window attention.

    With ``use_global`` the query comes from the global token generator and
    ``qkv`` is ``Linear(dim, 2 * dim)``: ``kv.reshape(B, N, 2, num_heads, head_dim)``, ``[k | v]``;
    otherwise ``reshape(B, N, 3, num_heads, head_dim)``, ``[q | k | v]``.
    """
    nh, d = int_attr(module, "num_heads"), int_attr(module, "head_dim")
    if getattr(module, "use_global", False):
        e = nh * d
        kv = Layout(0, [e, e], names=("k", "v"))
        return fit(module, qkv("qkv", kv, kv))
    return fit(module, qkv("qkv", fused_qkv(nh, d), fused_qkv(nh, d, bias=True)))


@register(f"{TIMM}.models.swin_transformer_v2_cr.WindowMultiHeadAttention")
def _swin_v2_cr_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``qkv(x).view(Bw, L, 3, num_heads, C // num_heads)``: ``[q | k | v]``."""
    w = tensor(module, "qkv.weight")
    if w is None:
        return {}
    nh = int_attr(module, "num_heads")
    d = int(w.shape[0]) // (3 * nh)
    return fit(module, qkv("qkv", fused_qkv(nh, d), fused_qkv(nh, d, bias=True)))


# -- open_clip ----------------------------------------------------------------------------------------


@register(f"{OPEN_CLIP}.transformer.Attention")
def _open_clip_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``F.linear(x, in_proj_weight, in_proj_bias).chunk(3, dim=-1)``: ``[q | k | v]``."""
    w = tensor(module, "in_proj_weight")
    if w is None or w.dim() != 2:
        return {}
    e = int(w.shape[0]) // 3
    layout = Layout(0, [e, e, e], names=("q", "k", "v"))
    return fit(module, {"in_proj_weight": layout, "in_proj_bias": layout})


# -- diffusers ----------------------------------------------------------------------------------------


@register(f"{DIFFUSERS}.attention_processor.Attention")
@register(f"{DIFFUSERS}.attention.AttentionModuleMixin")
def _diffusers_attention(module: nn.Module) -> Mapping[str, Layout]:
    """The projections ``fuse_projections()`` adds, split by the fused processors.

    ``to_qkv`` / ``to_added_qkv``: ``torch.split(qkv, qkv.shape[-1] // 3, dim=-1)``, ``[q | k | v]``;
    ``to_kv`` (cross-attention): ``torch.split(kv, kv.shape[-1] // 2, dim=-1)``, ``[k | v]``.
    Before fusing there is nothing packed.
    """
    out: dict[str, Layout] = {}
    for prefix, names in (("to_qkv", ("q", "k", "v")), ("to_added_qkv", ("q", "k", "v")), ("to_kv", ("k", "v"))):
        w = tensor(module, f"{prefix}.weight")
        if w is None or w.dim() != 2:
            continue
        size = int(w.shape[0]) // len(names)
        layout = Layout(0, [size] * len(names), names=names)
        out.update(qkv(prefix, layout, layout))
    return fit(module, out)


@register(f"{DIFFUSERS}.transformers.transformer_flux2.Flux2ParallelSelfAttention")
def _flux2_parallel_attention(module: nn.Module) -> Mapping[str, Layout]:
    """Flux 2's single-stream block, fused at construction: ``to_qkv_mlp_proj`` is split
    ``[3 * inner_dim, mlp_hidden_dim * mlp_mult_factor]``, then ``qkv.chunk(3)`` and ``Flux2SwiGLU``'s
    ``x[..., :half]`` (gate) / ``x[..., half:]`` (up): ``[q | k | v | gate | up]``."""
    inner, hidden = int_attr(module, "inner_dim"), int_attr(module, "mlp_hidden_dim")
    mult = int_attr(module, "mlp_mult_factor")
    names = ("q", "k", "v", "gate", "up") if mult == 2 else ("q", "k", "v", *(f"mlp{i}" for i in range(mult)))
    layout = Layout(0, [inner] * 3 + [hidden] * mult, names=names)
    return fit(module, qkv("to_qkv_mlp_proj", layout, layout))


@register(f"{DIFFUSERS}.transformers.transformer_flux2.Flux2FeedForward")
def _flux2_feed_forward(module: nn.Module) -> Mapping[str, Layout]:
    """``act_fn(linear_in(x))`` with ``Flux2SwiGLU``: ``x[..., :half]`` (gate), ``x[..., half:]`` (up)."""
    w = tensor(module, "linear_in.weight")
    if w is None or w.dim() != 2:
        return {}
    layout = fused_gate_up(int(w.shape[0]) // 2)
    return fit(module, {"linear_in.weight": layout, "linear_in.bias": fused_gate_up(int(w.shape[0]) // 2, bias=True)})


# -- x-transformers ---------------------------------------------------------------------------------


@register(f"{X_TRANSFORMERS}.GLU")
def _x_transformers_glu(module: nn.Module) -> Mapping[str, Layout]:
    """``up, gate = self.proj(x).chunk(2, dim = -1)``: ``[up | gate]``."""
    w = tensor(module, "proj.weight")
    if w is None or w.dim() != 2:
        return {}
    i = int(w.shape[0]) // 2
    return fit(module, {"proj.weight": fused_gate_up(i, names=("up", "gate")),
                        "proj.bias": fused_gate_up(i, names=("up", "gate"), bias=True)})  # fmt: skip


@register(f"{X_TRANSFORMERS}.Attention")
def _x_transformers_attention(module: nn.Module) -> Mapping[str, Layout]:
    """``on_attn`` ("attention on attention"): ``to_out = Sequential(Linear(out_dim, 2 * dim_out), nn.GLU())``;
    ``nn.GLU`` is ``a * sigmoid(b)`` on ``[a | b]``. Otherwise nothing is packed (q, k, v are separate)."""
    to_out = getattr(module, "to_out", None)
    if not (isinstance(to_out, nn.Sequential) and len(to_out) == 2 and isinstance(to_out[1], nn.GLU)):
        return {}
    w = tensor(module, "to_out.0.weight")
    if w is None or w.dim() != 2 or to_out[1].dim not in (-1, 1):
        return {}
    i = int(w.shape[0]) // 2
    return fit(module, {"to_out.0.weight": Layout(0, [i, i], names=("value", "gate"))})


# -- torchrl ------------------------------------------------------------------------------------------


def _cell(module: nn.Module, names: tuple[str, ...]) -> dict[str, Layout]:
    h = int_attr(module, "hidden_size")
    gates = Layout(0, [h] * len(names), names=names)
    return fit(module, {n: gates for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")})


@register(f"{TORCHRL}.LSTMCell")
def _torchrl_lstm_cell(module: nn.Module) -> Mapping[str, Layout]:
    """``i_gate, f_gate, g_gate, o_gate = gates.chunk(4, 1)`` (an ``RNNCellBase``, not an ``nn.LSTMCell``)."""
    return _cell(module, ("i", "f", "g", "o"))


@register(f"{TORCHRL}.GRUCell")
def _torchrl_gru_cell(module: nn.Module) -> Mapping[str, Layout]:
    """``i_r, i_i, i_n = gate_x.chunk(3, 1)`` (an ``RNNCellBase``, not an ``nn.GRUCell``)."""
    return _cell(module, ("r", "z", "n"))

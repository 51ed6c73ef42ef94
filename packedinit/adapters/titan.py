"""Adapters for torchtitan's fused and stacked layers (torchtitan 0.3.0).

Matched by class path, so importing this module never imports ``torchtitan``. Each layout is
the one the module's own forward splits the weight by (quoted on each adapter) and was checked
against that forward in ``tests/test_libs_torchtitan.py``; the fused QKV layout also draws bit
for bit what torchtitan's own ``_fused_qkv_param_init`` draws (the same test file).

Not listed: the ``overrides.fused_swiglu`` modules (``FusedSwiGLU.w13`` of shape
``(hidden, 2, dim)``, ``FusedGroupedExperts.w13`` of shape ``(experts, hidden, 2, dim)``).
Their gate and up matrices are ``w13[:, 0]`` and ``w13[:, 1]``, selections along a dim that is
not the output-feature dim, which a :class:`~packedinit.Layout` of the stored shape does not
express. Every whole-model idiom warns naming them (:func:`packedinit.model.looks.axis_fix`) and
prints the per-block line: ``chunked_init`` through the row-interleaved view ``(..., 2 * hidden,
dim)`` with ``Layout(..., [1, 1], groups=hidden)``, which draws what torchtitan's own
``_make_fused_gate_up_init`` draws for the uniform family and orthogonal_.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from packedinit.adapters.fused import fused_gate_up, fused_qkv
from packedinit.adapters.hf_common import fit, int_attr, qkv, tensor
from packedinit.layout import Layout
from packedinit.model.registry import register

__all__ = ["TITAN"]

TITAN = "torchtitan.models"


@register(f"{TITAN}.common.attention.FusedQKVLinear")
def _fused_qkv_linear(module: nn.Module) -> Mapping[str, Layout]:
    """``wqkv(x).view(bs, seqlen, -1, r_dim, head_dim)`` split ``[heads_per_kv, 1, 1]`` on the ``r_dim`` axis.

    Per key/value head ``[q_1 .. q_g k v]`` (``g = heads_per_kv``): Falcon's new decoder layout,
    ``fused_qkv(n_heads, head_dim, n_kv_heads, interleaved=True)``.
    """
    w = tensor(module, "wqkv.weight")
    if w is None or w.dim() != 2:
        return {}
    d, g, r = int_attr(module, "head_dim"), int_attr(module, "heads_per_kv"), int_attr(module, "r_dim")
    nkv = int(w.shape[0]) // (r * d)
    nh = nkv * g
    return fit(
        module,
        qkv(
            "wqkv",
            fused_qkv(nh, d, nkv, interleaved=True),
            fused_qkv(nh, d, nkv, interleaved=True, bias=True),
        ),
    )


def _stacked(w_dim: int) -> Layout:
    """One ``(out, in)`` matrix per expert of a ``(num_experts, out, in)`` parameter."""
    return Layout(dim=1, sizes=[w_dim], batch_dims=1)


@register(f"{TITAN}.common.moe.GroupedExperts")
def _grouped_experts(module: nn.Module) -> Mapping[str, Layout]:
    """``_grouped_mm(A=x, B_t=w.transpose(-2, -1))`` per expert: ``w1_EFD``, ``w3_EFD`` are ``(E, F, D)``
    and ``w2_EDF`` is ``(E, D, F)``, each expert's matrix stored ``(out, in)``."""
    out: dict[str, Layout] = {}
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        w = tensor(module, name)
        if w is not None and w.dim() == 3:
            out[name] = _stacked(int(w.shape[1]))
    return out


@register(f"{TITAN}.gpt_oss.moe.GptOssGroupedExperts")
def _gpt_oss_grouped_experts(module: nn.Module) -> Mapping[str, Layout]:
    """``mlp1_weight_EGD`` ``(E, 2F, D)``: ``swiglu`` takes ``x[..., ::2]`` (gate) and ``x[..., 1::2]`` (up);
    ``mlp2_weight_EDF`` ``(E, D, F)`` is one matrix per expert."""
    w1, w2 = tensor(module, "mlp1_weight_EGD"), tensor(module, "mlp2_weight_EDF")
    out: dict[str, Layout] = {}
    if w1 is not None and w1.dim() == 3:
        f = int(w1.shape[1]) // 2
        out["mlp1_weight_EGD"] = fused_gate_up(f, interleaved=True, stacked=True)
        out["mlp1_bias_EG"] = fused_gate_up(f, interleaved=True, bias=True, stacked=True)
    if w2 is not None and w2.dim() == 3:
        out["mlp2_weight_EDF"] = _stacked(int(w2.shape[1]))
        out["mlp2_bias_ED"] = Layout(dim=1, sizes=[int(w2.shape[1])], batch_dims=1)
    return fit(module, out)

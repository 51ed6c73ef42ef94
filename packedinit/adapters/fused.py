r"""Layouts of fused linears that packedinit cannot recognise by class.

A timm ``Attention.qkv``, a user's own fused QKV or SwiGLU ``gate_up`` projection
is an ordinary ``nn.Linear`` (or a bare ``nn.Parameter``): nothing in its class
says how the output features are packed. These helpers build the
:class:`~packedinit.Layout` from the numbers the model's forward uses to split
the projection, ready for :func:`packedinit.annotate` or
:func:`packedinit.chunked_init`.

Every layout covered, for ``nh`` query heads, ``nkv`` key/value heads, head size
``d``, ``g = nh / nkv`` and intermediate size ``I`` (the model line that splits it, then the call):

* ``[q | k | v]`` (MHA, GQA, MQA): ``qkv.split([nh*d, nkv*d, nkv*d], -1)``;
  ``fused_qkv(nh, d, nkv)``.
* per head ``[q k v]`` (GPT-NeoX, Bloom): ``qkv.view(..., nh, 3*d).chunk(3, -1)``;
  ``fused_qkv(nh, d, interleaved=True)``.
* per kv head ``[q_1 .. q_g k v]`` (Falcon new decoder architecture): ``qkv.view(..., nkv, g + 2, d)``;
  ``fused_qkv(nh, d, nkv, interleaved=True)``.
* stored ``(in, out)`` (GPT-2 ``Conv1D``, ``x @ W``): add ``transposed=True``.
* ``[gate | up]`` (Phi-3, Mixtral experts): ``gate, up = h.chunk(2, -1)``; ``fused_gate_up(I)``.
* ``[g0 u0 g1 u1 ...]`` (GPT-OSS experts): ``h[..., ::2], h[..., 1::2]``;
  ``fused_gate_up(I, interleaved=True)``.
* a stack of experts ``(n_experts, out, in)``: add ``stacked=True``.
"""

from __future__ import annotations

from collections.abc import Sequence

from packedinit.errors import PackedInitError
from packedinit.layout import Layout

__all__ = ["fused_qkv", "fused_gate_up"]


def _positive(name: str, value: object, call: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PackedInitError(f"{call}: {name} must be a positive int, got {value!r}.")
    return value


def _three_names(names: Sequence[str], call: str) -> tuple[str, str, str]:
    if isinstance(names, str) or len(names) != 3 or not all(isinstance(n, str) and n for n in names):
        raise PackedInitError(
            f"{call}: names must be three non-empty strings for (query, key, value), got {names!r}; "
            f"e.g. names=('q', 'k', 'v')."
        )
    return (names[0], names[1], names[2])


def fused_qkv(
    num_heads: int,
    head_dim: int,
    num_kv_heads: int | None = None,
    *,
    interleaved: bool = False,
    transposed: bool = False,
    order: str = "qkv",
    names: Sequence[str] = ("q", "k", "v"),
    bias: bool = False,
    stacked: bool = False,
) -> Layout:
    r"""The Layout of a fused query/key/value projection.

    The projection has :math:`(n_h + 2 n_{kv})\,d` output features. Its logical
    blocks are :math:`W_q` of shape :math:`(n_h d, E)` and :math:`W_k, W_v` of shape
    :math:`(n_{kv} d, E)`, each handed to the init function on its own: with
    ``xavier_uniform_`` each block draws from :math:`\mathcal{U}(-a, a)`,
    :math:`a = \sqrt{6 / (E + n_h d)}` for ``q`` and :math:`\sqrt{6 / (E + n_{kv} d)}`
    for ``k``/``v``, instead of one bound :math:`\sqrt{6 / (E + (n_h + 2 n_{kv}) d)}`.

    Storage orders:

    * ``interleaved=False``: ``[q | k | v]``, the three projections one after the
      other (``nn.MultiheadAttention``, Phi-3, DBRX, timm, GPT-2's ``Conv1D``).
    * ``interleaved=True``: grouped per key/value head; each of the
      :math:`n_{kv}` groups holds the :math:`g = n_h / n_{kv}` query heads that
      share it, then its key head, then its value head. With
      :math:`n_{kv} = n_h` this is GPT-NeoX/Bloom's per-head ``[q k v]``; with
      :math:`n_{kv} < n_h` it is Falcon's new decoder architecture (and
      Megatron's GQA layout); with :math:`n_{kv} = 1` it equals ``[q | k | v]``.

    Args:
        num_heads: number of query heads :math:`n_h`.
        head_dim: size :math:`d` of one head.
        num_kv_heads: number of key/value heads :math:`n_{kv}` (GQA/MQA); defaults
            to ``num_heads``. Must divide ``num_heads``.
        interleaved: grouped per key/value head (see above) instead of ``[q | k | v]``.
        transposed: the weight is stored ``(in, out)`` (GPT-2's ``Conv1D``, JAX/Flax
            kernels, ``x @ W`` in the forward); the packed dim is then dim 1.
        order: the storage order of the three parts, a permutation of ``"qkv"``
            (CodeGen stores ``"qvk"``).
        names: the block names of query, key and value (in that meaning, whatever
            ``order`` is).
        bias: give the layout of the 1-D bias instead of the weight.
        stacked: the weight is a stack of such projections along one leading
            dim (MoE experts, scanned layers): each index of that dim holds its own
            blocks and fans exclude it.

    Returns:
        The :class:`~packedinit.Layout`, blocks in storage order.

    Raises:
        PackedInitError: non-positive sizes, ``num_kv_heads`` not dividing
            ``num_heads``, a bad ``order`` or ``names``, or ``transposed`` with ``bias``.

    Examples:
        >>> fused_qkv(8, 16)  # [q | k | v], E = 128
        Layout(dim=0, sizes=(128, 128, 128), names=('q', 'k', 'v'))
        >>> fused_qkv(8, 16, num_kv_heads=2)  # GQA: k, v smaller than q
        Layout(dim=0, sizes=(128, 32, 32), names=('q', 'k', 'v'))
        >>> fused_qkv(8, 16, interleaved=True)  # GPT-NeoX / Bloom: [q k v] in every head
        Layout(dim=0, sizes=(16, 16, 16), groups=8, names=('q', 'k', 'v'))
        >>> fused_qkv(8, 16, num_kv_heads=2, interleaved=True)  # Falcon new decoder architecture
        Layout(dim=0, sizes=(64, 16, 16), groups=2, names=('q', 'k', 'v'))
        >>> fused_qkv(8, 16, transposed=True)  # GPT-2 Conv1D c_attn, stored (in, 3 * out)
        Layout(dim=1, sizes=(128, 128, 128), transposed=True, names=('q', 'k', 'v'))
        >>> import torch
        >>> from packedinit import chunked_init
        >>> qkv = torch.nn.Linear(128, 128 + 2 * 32)
        >>> _ = chunked_init(qkv.weight, fused_qkv(8, 16, 2), init_fn=torch.nn.init.xavier_uniform_)
        >>> _ = chunked_init(qkv.bias, fused_qkv(8, 16, 2, bias=True), init_fn={"k": torch.nn.init.zeros_})
        >>> bool(qkv.bias[128:160].eq(0).all())
        True
    """
    call = f"fused_qkv({num_heads!r}, {head_dim!r}, num_kv_heads={num_kv_heads!r})"
    nh = _positive("num_heads", num_heads, call)
    d = _positive("head_dim", head_dim, call)
    nkv = nh if num_kv_heads is None else _positive("num_kv_heads", num_kv_heads, call)
    if nh % nkv:
        raise PackedInitError(
            f"{call}: num_kv_heads={nkv} does not divide num_heads={nh}; every key/value head serves "
            f"num_heads / num_kv_heads query heads."
        )
    if not isinstance(order, str) or sorted(order) != ["k", "q", "v"]:
        raise PackedInitError(f"{call}: order must be a permutation of 'qkv' (storage order), got {order!r}.")
    qn, kn, vn = _three_names(names, call)
    if bias and transposed:
        raise PackedInitError(f"{call}: a bias is 1-D and cannot be transposed; pass transposed=False with bias=True.")
    if interleaved:
        groups, per = nkv, {"q": (nh // nkv) * d, "k": d, "v": d}
    else:
        groups, per = 1, {"q": nh * d, "k": nkv * d, "v": nkv * d}
    label = {"q": qn, "k": kn, "v": vn}
    return _layout(
        sizes=[per[c] for c in order],
        groups=groups,
        names=[label[c] for c in order],
        transposed=transposed,
        bias=bias,
        stacked=stacked,
        call=call,
    )


def fused_gate_up(
    intermediate_size: int,
    *,
    interleaved: bool = False,
    transposed: bool = False,
    names: Sequence[str] = ("gate", "up"),
    bias: bool = False,
    stacked: bool = False,
) -> Layout:
    r"""The Layout of a fused gate/up projection of a gated MLP (SwiGLU, GeGLU).

    The projection has :math:`2I` output features holding the gate projection
    :math:`W_g` and the up projection :math:`W_u`, each of shape :math:`(I, E)`.

    Args:
        intermediate_size: :math:`I`, the size of each of the two projections.
        interleaved: gate and up alternate feature by feature (``h[..., ::2]`` is
            the gate, ``h[..., 1::2]`` the up projection, as in GPT-OSS) instead
            of ``[gate | up]`` (``h.chunk(2, -1)``).
        transposed: the weight is stored ``(in, out)`` (``x @ W`` in the forward).
        names: the block names, in storage order: ``("up", "gate")`` for a
            projection that stores the up half first.
        bias: give the layout of the bias instead of the weight.
        stacked: the weight is a stack of projections along one leading dim, e.g.
            MoE experts ``(n_experts, 2I, E)``: each expert's gate and up are
            separate blocks and fans exclude the expert dim.

    Returns:
        The :class:`~packedinit.Layout`.

    Raises:
        PackedInitError: a non-positive size, bad ``names``, or ``transposed``
            with ``bias``.

    Examples:
        >>> fused_gate_up(64)  # Phi-3 gate_up_proj (128, E)
        Layout(dim=0, sizes=(64, 64), names=('gate', 'up'))
        >>> fused_gate_up(64, stacked=True)  # Mixtral experts gate_up_proj (8, 128, E)
        Layout(dim=1, sizes=(64, 64), batch_dims=1, names=('gate', 'up'))
        >>> fused_gate_up(64, interleaved=True, transposed=True, stacked=True)  # GPT-OSS (8, E, 128)
        Layout(dim=2, sizes=(1, 1), groups=64, transposed=True, batch_dims=1, names=('gate', 'up'))
    """
    call = f"fused_gate_up({intermediate_size!r})"
    size = _positive("intermediate_size", intermediate_size, call)
    if isinstance(names, str) or len(names) != 2 or not all(isinstance(n, str) and n for n in names):
        raise PackedInitError(f"{call}: names must be two non-empty strings, got {names!r}; e.g. ('gate', 'up').")
    if bias and transposed:
        raise PackedInitError(f"{call}: a bias is 1-D and cannot be transposed; pass transposed=False with bias=True.")
    groups, sizes = (size, [1, 1]) if interleaved else (1, [size, size])
    return _layout(
        sizes=sizes,
        groups=groups,
        names=list(names),
        transposed=transposed,
        bias=bias,
        stacked=stacked,
        call=call,
    )


def _layout(
    *,
    sizes: list[int],
    groups: int,
    names: list[str],
    transposed: bool,
    bias: bool,
    stacked: bool,
    call: str,
) -> Layout:
    if not isinstance(stacked, bool) or not isinstance(transposed, bool) or not isinstance(bias, bool):
        raise PackedInitError(f"{call}: transposed, bias and stacked must be bools.")
    batch = 1 if stacked else 0
    # Output features are dim 0 of an (out, in) matrix and dim 1 of an (in, out) one.
    dim = batch + (1 if transposed else 0)
    return Layout(dim=dim, sizes=sizes, groups=groups, transposed=transposed, batch_dims=batch, names=names)

r"""Which weights look packed by their name or shape alone, and the ``annotate`` line that describes them.

Used where no layout describes a weight: by the whole-model idioms (a warning naming the weight,
see :mod:`packedinit.model.found`) and by the audit's "looks packed" list
(:mod:`packedinit.auditing.suspects`). The rules:

- **Name.** The module's attribute name or the parameter's own name contains a fused-projection
  word: ``qkv`` / ``wqkv`` / ``c_attn`` / ``in_proj`` / ``query_key_value`` (3 blocks),
  ``gate_up`` / ``up_gate`` / ``w13`` / ``w1_3`` (2 blocks), ``kv`` as a word, ``kv_proj``,
  ``to_kv`` (2 blocks). The packed dim must divide evenly.
- **Stack.** A 3-D parameter outside a conv layer, with 2 or more matrices and a projection or
  expert word in its name (``experts``, ``proj``, ``linear``, ``gate``, ``up``, ``down``, ``w1``,
  ``fc``) is a stack of matrices (MoE experts): dim 0 indexes independent matrices (a batch dim,
  never split). A name word alone decides the blocks within each matrix.
- **Blocks on their own axis.** A name-matched weight of 3+ dims whose dim -2 has length k (torchtitan's
  ``FusedSwiGLU.w13`` ``(hidden, 2, dim)``, ``FusedGroupedExperts.w13`` ``(E, hidden, 2, dim)``): block j is
  ``w[..., j, :]``, which no Layout of the stored shape describes; :func:`axis_fix` gives the
  ``chunked_init`` line that initialises it per block through the row-interleaved view
  ``(..., k * hidden, dim)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import Tensor, nn

from packedinit.layout import Layout

__all__ = ["by_name", "parts", "layout_repr", "annotate_line", "may_look_packed", "name_guess", "axis_fix", "axis_view"]

_QKV = re.compile(r"qkv|c_attn|in_proj|query_key_value")
_GATE_UP = re.compile(r"gate_up|up_gate|w13|w1_3|fc13")
_KV = re.compile(r"(^|_)w?kv($|_)|kv_proj|to_kv")
#: words in the name of an expert stack's weight (or of its modules)
_STACK = re.compile(r"expert|moe|proj|linear|gate|(^|[._])(up|down|w[123]|fc[12]?)($|[._])")


def _any_word(fqn: str) -> bool:
    """Any of the words above, anywhere in a qualified name, in any case: the cheap first test, run on every
    parameter, as plain substring tests ("kv" covers "qkv"), about three times faster than one regex search."""
    low = fqn.lower()
    return (
        "kv" in low or "c_attn" in low or "in_proj" in low or "query_key_value" in low or "gate_up" in low
        or "up_gate" in low or "w13" in low or "w1_3" in low or "fc13" in low
    )  # fmt: skip


def by_name(word: str) -> tuple[int, tuple[str, ...] | None, str] | None:
    """``(blocks, names, why)`` when ``word`` contains a fused-projection word, else None.

    Examples:
        >>> by_name("in_proj_qkv")
        (3, ('q', 'k', 'v'), "name 'in_proj_qkv' (in_proj)")
        >>> by_name("fc1") is None
        True
    """
    w = word.lower()
    for pattern, k, names in ((_QKV, 3, ("q", "k", "v")), (_GATE_UP, 2, ("gate", "up")), (_KV, 2, ("k", "v"))):
        m = pattern.search(w)
        if m is not None:
            return k, names, f"name {word!r} ({m.group(0).strip('_')})"
    return None


def parts(
    k: int, names: tuple[str, ...] | None, p: Tensor, dim: int, transposed: bool
) -> tuple[int, tuple[str, ...] | None]:
    """``(k, names)``, except that a ``qkv`` twice as long as its input holds two blocks, ``[k | v]`` (gcvit).

    Examples:
        >>> import torch
        >>> parts(3, ("q", "k", "v"), torch.empty(96, 48), 0, False)
        (2, ('k', 'v'))
    """
    other = dim - 1 if transposed else dim + 1
    if k == 3 and 0 <= other < p.dim() and int(p.shape[dim]) == 2 * int(p.shape[other]):
        return 2, ("k", "v")
    return k, names


def layout_repr(layout: Layout) -> str:
    """``packedinit.Layout(...)`` as code (default arguments left out).

    Examples:
        >>> layout_repr(Layout(1, [4], batch_dims=1))
        'packedinit.Layout(1, [4], batch_dims=1)'
    """
    args = [str(layout.dim), repr(list(layout.sizes))]
    if layout.groups != 1:
        args.append(f"groups={layout.groups}")
    if layout.batch_dims:
        args.append(f"batch_dims={layout.batch_dims}")
    if layout.transposed:
        args.append("transposed=True")
    if layout.names is not None:
        args.append(f"names={tuple(layout.names)!r}")
    return f"packedinit.Layout({', '.join(args)})"


def annotate_line(entries: list[tuple[str, Layout]]) -> str:
    """A ready-to-paste ``packedinit.annotate(model, ...)`` call for ``(dotted name, layout)`` pairs.

    Examples:
        >>> print(annotate_line([("blk.qkv.weight", Layout(0, [8, 8, 8], names=("q", "k", "v")))]))
        packedinit.annotate(model, **{'blk.qkv.weight': packedinit.Layout(0, [8, 8, 8], names=('q', 'k', 'v'))})
    """
    if all("." not in n for n, _ in entries):
        body = ", ".join(f"{n}={layout_repr(lay)}" for n, lay in entries)
    else:
        body = "**{" + ", ".join(f"{n!r}: {layout_repr(lay)}" for n, lay in entries) + "}"
    return f"packedinit.annotate(model, {body})"


def may_look_packed(fqn: str, p: Tensor) -> bool:
    """The cheap first test of :func:`name_guess`: False means it returns None.

    Examples:
        >>> import torch
        >>> may_look_packed("0.weight", torch.empty(4, 4)), may_look_packed("attn.qkv.weight", torch.empty(6, 2))
        (False, True)
    """
    ndim = p.dim()
    return ndim >= 3 or (ndim == 2 and _any_word(fqn))


def name_guess(
    fqn: str, p: Tensor, module_of: Callable[[], nn.Module | None]
) -> tuple[Layout, str] | None:
    """The layout a weight ``fqn`` of ``module`` looks packed with by name or as a stack, and why; else None.

    Examples:
        >>> import torch
        >>> lin = torch.nn.Linear(4, 12)
        >>> name_guess("attn.qkv.weight", lin.weight, lambda: lin)
        (Layout(dim=0, sizes=(4, 4, 4), names=('q', 'k', 'v')), "name 'qkv' (qkv)")
        >>> name_guess("experts.down", torch.empty(8, 4, 6), lambda: None)[0]
        Layout(dim=1, sizes=(4,), batch_dims=1)
    """
    ndim = p.dim()
    if ndim < 2 or (ndim == 2 and not _any_word(fqn)) or "parametrizations." in fqn:
        return None  # (an original of a parametrization: its parametrized weight is what is packed)
    module = module_of()
    leaf = fqn.rpartition(".")[2]
    attr = fqn.rpartition(".")[0].rpartition(".")[2]
    transposed = module is not None and isinstance(getattr(module, "nf", None), int) and p.shape[-1] == module.nf
    conv = module is not None and isinstance(getattr(module, "in_channels", None), int)
    batch = 1 if p.dim() >= 3 and not conv else 0
    dim = (1 if transposed else 0) + batch
    found = by_name(leaf) or (by_name(attr) if attr else None)
    size = int(p.shape[dim])
    k, names = parts(found[0], found[1], p, dim, transposed) if found is not None else (0, None)
    if found is not None and size % k == 0 and size >= k:
        why = found[2]
        if axis_fix(fqn, p) is not None:
            why += f"; its blocks are w[..., j, :] on dim -2 (length {k})"
        elif batch:
            why += f"; dim 0 ({int(p.shape[0])}) indexes stacked matrices and is not split"
        return Layout(dim, [size // k] * k, transposed=transposed, batch_dims=batch, names=names), why
    if batch and p.dim() == 3 and int(p.shape[0]) > 1 and _STACK.search(fqn.lower()):
        why = f"a stack of {int(p.shape[0])} matrices {tuple(p.shape[1:])} (dim 0 indexes them)"
        return Layout(dim, [size], batch_dims=batch), why
    return None


def axis_fix(fqn: str, p: Tensor) -> str | None:
    """The ``chunked_init`` line for a weight whose k blocks lie on a length-k dim -2, else None.

    ``w[..., j, :]`` of a ``(..., out, k, in)`` weight is block j; flattened to ``(..., k * out, in)`` the blocks are
    row-interleaved, a Layout with ``groups=out``. The line initialises the weight per block with ``init``.

    Examples:
        >>> import torch
        >>> print(axis_fix("mlp.w13", torch.empty(48, 2, 64)).replace(", packedinit", ",\\n  packedinit"))
        packedinit.chunked_init(model.get_parameter('mlp.w13').view(96, 64),
          packedinit.Layout(0, [1, 1], groups=48, names=('gate', 'up')), None, init)
        >>> axis_fix("mlp.w13", torch.empty(96, 64)) is None
        True
    """
    got = axis_view(fqn, p)
    if got is None:
        return None
    view = ", ".join(str(n) for n in got[0])
    return f"packedinit.chunked_init(model.get_parameter({fqn!r}).view({view}), {layout_repr(got[1])}, None, init)"


def axis_view(fqn: str, p: Tensor) -> tuple[tuple[int, ...], Layout] | None:
    """``(view shape, layout of the view)`` for a weight :func:`axis_fix` describes, else None.

    Examples:
        >>> import torch
        >>> axis_view("w13", torch.empty(3, 4, 2, 8))
        ((3, 8, 8), Layout(dim=1, sizes=(1, 1), groups=4, batch_dims=1, names=('gate', 'up')))
    """
    found = by_name(fqn.rpartition(".")[2])
    if found is None or p.dim() < 3 or int(p.shape[-2]) != found[0]:
        return None
    k, names = found[0], found[1]
    shape = (*(int(n) for n in p.shape[:-3]), int(p.shape[-3]) * k, int(p.shape[-1]))
    return shape, Layout(p.dim() - 3, [1] * k, groups=int(p.shape[-3]), batch_dims=p.dim() - 3, names=names)

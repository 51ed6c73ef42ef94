"""Quick meta answers: the result of a few common operations on meta tensors, from their shapes alone.

torch computes many meta results through its Python reference implementations (``torch._refs``): an
``add`` of two meta tensors costs about as much as a thousand real additions of small tensors, and a
``layer_norm`` or ``scaled_dot_product_attention`` a few milliseconds each, which is most of a meta forward.
:func:`quick_meta` gives the same result (an empty meta tensor of the shape, dtype and contiguous strides
torch gives) for the cases where it is plain to see: contiguous inputs of one dtype with shapes that fit.
Everything else returns None and runs as usual; a shape that does not fit is left to torch to refuse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["quick_meta"]

_META = torch.device("meta")
_PLAIN = (Tensor, nn.Parameter)
_BINARY = frozenset({
    "add", "sub", "mul", "div", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
})  # fmt: skip
_UNARY = frozenset({"tanh", "gelu", "relu", "silu", "sigmoid", "neg", "__neg__", "exp", "rsqrt", "sqrt", "erf"})
_POW = frozenset({"pow", "__pow__"})
_SDPA_ARGS = frozenset({"attn_mask", "dropout_p", "is_causal", "scale"})
_LN_ARGS = frozenset({"input", "normalized_shape", "weight", "bias", "eps"})


def _on_meta(t: object) -> bool:
    """A plain (not a subclass) tensor on the meta device."""
    return type(t) in _PLAIN and t.device == _META  # type: ignore[attr-defined]  # a Tensor


def _meta(t: object) -> bool:
    """A plain contiguous tensor on the meta device (the result of an elementwise op on it is contiguous too)."""
    return _on_meta(t) and t.is_contiguous()  # type: ignore[attr-defined]  # a Tensor


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """The broadcast of two shapes (None: they do not broadcast)."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b, strict=True):
        if x != y and x != 1 and y != 1:
            return None
        out.append(y if x == 1 else x)
    return tuple(out)


def _empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=_META)


def _elementwise(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    if len(args) != 2 or not _meta(args[0]) or not args[0].dtype.is_floating_point:
        return None
    a, b = args
    if name in _BINARY and set(kwargs) <= {"alpha"}:
        if isinstance(b, Tensor):
            if not _meta(b):
                return None
            shape = _broadcast(a.shape, b.shape)
            if shape is None:
                return None  # torch says what does not fit
        elif isinstance(b, (int, float)) and not isinstance(b, bool):
            shape = a.shape
        else:
            return None
        dtype = torch.result_type(a, b)
        if name in ("div", "__truediv__") and not dtype.is_floating_point and not dtype.is_complex:
            dtype = torch.get_default_dtype()
        return _empty(shape, dtype)
    if name in _POW and not kwargs and isinstance(b, (int, float)) and not isinstance(b, bool):
        return _empty(a.shape, torch.result_type(a, b))
    return None


def _layer_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    given = dict(zip(("input", "normalized_shape", "weight", "bias", "eps"), args, strict=False), **kwargs)
    x, shape = given.get("input"), given.get("normalized_shape")
    if not _meta(x) or not isinstance(shape, (tuple, list, torch.Size)) or set(given) - _LN_ARGS:
        return None
    assert isinstance(x, Tensor)
    n = len(shape)
    if n == 0 or n > x.dim() or tuple(x.shape[-n:]) != tuple(shape):
        return None
    for key in ("weight", "bias"):
        p = given.get(key)
        if p is not None and (not _meta(p) or p.dtype != x.dtype or tuple(p.shape) != tuple(shape)):
            return None
    return _empty(x.shape, x.dtype)


def _sdpa(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    q, k, v = (*args, None, None, None)[:3]
    rest = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:], strict=False), **kwargs)
    # torch's meta result is contiguous whatever the strides of q, k, v (the CPU kernels' may be transposed)
    if not (_on_meta(q) and _on_meta(k) and _on_meta(v)) or set(rest) - _SDPA_ARGS:
        return None
    assert isinstance(q, Tensor)
    assert isinstance(k, Tensor)
    assert isinstance(v, Tensor)
    mask = rest.get("attn_mask")
    if mask is not None and not _on_meta(mask):
        return None
    if not (q.dtype == k.dtype == v.dtype) or not (q.dim() == k.dim() == v.dim() >= 2) or q.shape[:-2] != k.shape[:-2]:
        return None
    if k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        return None
    return _empty((*q.shape[:-1], v.shape[-1]), q.dtype)


def _matmul(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    if kwargs:
        return None
    if name == "addmm" and len(args) == 3 and all(_meta(a) for a in args):
        bias, m1, m2 = args
        if m1.dim() == 2 and m2.dim() == 2 and m1.shape[1] == m2.shape[0] and m1.dtype == m2.dtype == bias.dtype:
            shape = (m1.shape[0], m2.shape[1])
            if _broadcast(bias.shape, shape) == shape:
                return _empty(shape, m1.dtype)
        return None
    if name == "linear" and 2 <= len(args) <= 3 and _meta(args[0]) and _meta(args[1]):
        x, w = args[0], args[1]
        b = args[2] if len(args) == 3 else None
        if b is not None and (not _meta(b) or b.dtype != x.dtype or tuple(b.shape) != (w.shape[0],)):
            return None
        if w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[1] and x.dtype == w.dtype:
            return _empty((*x.shape[:-1], w.shape[0]), x.dtype)
    return None


def quick_meta(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """``func(*args, **kwargs)`` on meta tensors answered from shapes alone; None: ask torch.

    Examples:
        >>> import torch
        >>> x = torch.empty(2, 3, 8, device="meta")
        >>> quick_meta(torch.nn.functional.layer_norm, (x, (8,)), {}).shape
        torch.Size([2, 3, 8])
        >>> quick_meta(torch.add, (x, torch.empty(8, device="meta")), {}).shape
        torch.Size([2, 3, 8])
        >>> quick_meta(torch.add, (x, torch.empty(5, device="meta")), {}) is None  # torch says what is wrong
        True
    """
    name = getattr(func, "__name__", "")
    if name in _BINARY or name in _POW:
        return _elementwise(name, args, kwargs)
    if name in _UNARY:
        if len(args) == 1 and _meta(args[0]) and args[0].dtype.is_floating_point and set(kwargs) <= {"approximate"}:
            return _empty(args[0].shape, args[0].dtype)
        return None
    if name == "layer_norm":
        return _layer_norm(args, kwargs)
    if name == "scaled_dot_product_attention":
        return _sdpa(args, kwargs)
    if name in ("addmm", "linear"):
        return _matmul(name, args, kwargs)
    return None

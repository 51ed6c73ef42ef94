"""The lean path: one block that is the whole tensor, and the init function called on it as it is.

:func:`route` is the one place that decides whether a call takes the lean path. Every entry
point asks it (``chunked_init``, the function ``chunked`` returns, :func:`packedinit.engine.run.run`
and the whole-model walk), so a tensor gets the same numbers whichever way it is reached.
:func:`call` then makes the call, with torch's errors turned into PackedInitError.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import torch
from torch import Tensor, nn

from packedinit.engine.chunks import Chunks, as_layout
from packedinit.engine.dryrun import rejected
from packedinit.engine.plan import INFERENCE_FIX, Request, Where, check_tensor, inference_refused
from packedinit.engine.traits import (
    GENERATOR_OK,
    LEAN,
    LOW_PRECISION,
    REJECTIONS,
    TORCH_FNS,
    TORCH_INIT,
    check_fn_dtype,
    check_values,
    convertible,
    fn_name,
)
from packedinit.layout import Layout
from packedinit.shapes import fmt_shape

__all__ = ["GENERAL", "SKIP", "TORCH", "USER", "PLAIN_TYPES", "route", "call", "whole", "lean_call", "lean_calls"]

_init = TORCH_INIT  # torch's own functions, also while fix_torch_defaults replaces torch.nn.init's names
#: Tensor types the lean path (and the local engine's geometry) takes as they are.
PLAIN_TYPES = (Tensor, nn.Parameter)

#: What :func:`route` decides: the general path (plan + execute), nothing to do (a zero-element
#: tensor), a ``torch.nn.init`` function called on the tensor, or a function of the user's called on it.
GENERAL: Final = 0
SKIP: Final = 1
TORCH: Final = 2
USER: Final = 3

_SAFE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_CONSTANTS = (_init.constant_, _init.ones_, _init.zeros_)


def whole(tensor: Tensor, chunks: Chunks | None, dim: int | None, param: str | None = None) -> bool:
    """Whether ``chunks``/``dim`` make one block that is the tensor as stored (raises if they don't fit).

    ``None`` and ``1`` always do (the call is then exactly ``init_fn(tensor)``); an explicit
    one-part Layout or ``[n]`` only for a contiguous tensor (a separate tensor is contiguous).
    """
    if chunks is None or (type(chunks) is int and chunks == 1):
        nd = tensor.dim()
        return (dim is None or (type(dim) is int and -nd <= dim < nd)) and (chunks is None or nd > 0)
    # one explicit part: the whole tensor; the same draws as a separate tensor only when contiguous
    if isinstance(chunks, Layout):
        if chunks.num_parts != 1 or chunks.transposed or chunks.batch_dims:
            return False
    elif not (type(chunks) in (list, tuple) and len(chunks) == 1):  # type: ignore[arg-type]  # a list or tuple
        return False
    return as_layout(chunks, dim, tensor.shape, param=param) is not None and tensor.is_contiguous()


def route(
    tensor: Tensor,
    fn: object,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    param: str | None = None,
    *,
    first: bool = False,
) -> int:
    """The lean path's one decision, for a plain tensor that is one whole block: GENERAL, SKIP, TORCH or USER.

    TORCH where torch's own checks come before its first write and the call is exactly the
    plain one (raises PackedInitError for an argument torch checks only after writing); GENERAL
    where the general path must check or prepare first (orthogonal_ on fp16 or a non-contiguous
    tensor, complex input, a dtype torch cannot draw, generator= that a function cannot take, a
    user function on meta or with generator=).

    ``first``: the public functions' first look (``chunked_init``, ``chunked(f)``), before any
    request is built. A function of :data:`~packedinit.engine.traits.LEAN` that may take the call's
    ``generator=`` is then called at once and torch's own checks (all made before its first
    write) stand for packedinit's, so a rejection keeps torch's words; whatever else ``first``
    would send to the general path reaches this function again from :func:`packedinit.engine.run.run`.
    A call that succeeds writes the same numbers either way. ``first`` decides only TORCH or GENERAL.
    """
    try:
        flags: tuple[bool, bool] | None = LEAN.get(fn)  # type: ignore[call-overload]  # any hashable object
    except TypeError:  # an unhashable callable
        flags = None
    if first:
        if flags is None or (not flags[1] and kwargs and "generator" in kwargs) or (flags[0] and not tensor.numel()):
            return GENERAL
        return TORCH
    if flags is not None or (type(fn) is types.FunctionType and fn in TORCH_FNS):
        dtype = tensor.dtype
        if not (dtype in _SAFE_DTYPES or flags is None or fn in _CONSTANTS):
            return GENERAL  # float8, complex, integers: the general path refuses or handles them up front
        if dtype in LOW_PRECISION and fn is _init.orthogonal_:
            return GENERAL
        if args or kwargs:  # torch checks some arguments only after it has drawn or written
            check_values(fn, args, kwargs, Where(param, tensor.shape))  # type: ignore[arg-type]  # a torch function
        generator = bool(kwargs) and "generator" in kwargs
        if flags is not None and (flags[1] or not generator):
            return SKIP if flags[0] and tensor.numel() == 0 else TORCH
        if (fn is _init.orthogonal_ or fn is _init.trunc_normal_) and (
            dtype.is_complex or (fn is _init.orthogonal_ and not tensor.is_contiguous())
        ):
            return GENERAL
        if generator and fn not in GENERATOR_OK:
            return GENERAL
        return SKIP if tensor.numel() == 0 else TORCH
    if not callable(fn) or tensor.is_meta or (kwargs and "generator" in kwargs):
        return GENERAL
    return SKIP if tensor.numel() == 0 else USER


def call(
    how: int,
    tensor: Tensor,
    fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    param: str | None = None,
) -> None:
    """Make the call :func:`route` decided (``how`` is not GENERAL)."""
    if how == TORCH:
        lean_call(tensor, fn, args, kwargs, param)
    elif how == USER:
        _user_call(tensor, fn, args, kwargs, param)


def lean_call(
    tensor: Tensor,
    fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    param: str | None = None,
) -> None:
    """Call a torch.nn.init function on the whole tensor as it is.

    Those functions check their input before they write and use no_grad themselves; a
    rejection becomes PackedInitError (also an instance of the error torch raised). An
    inference tensor outside inference mode is refused first: torch would write it (and
    draw) before it refuses.
    """
    # (torch.compile cannot trace is_inference(), nor take an inference tensor into a graph: skipped there)
    if not torch.compiler.is_compiling() and tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise inference_refused(tensor, param)
    _lean_write(tensor, fn, args, kwargs, param)


def lean_calls(
    todo: Sequence[tuple[Tensor, str | None]],
    fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> None:
    """:func:`lean_call` on each tensor, for a caller that checked what it checks first.

    The caller has made sure that ``torch.compile`` is not tracing and that no tensor is an
    inference tensor outside inference mode (:mod:`packedinit.model.kept` compares both before
    it re-uses a decision); rejections become PackedInitError as in :func:`lean_call`.
    """
    for tensor, param in todo:
        _lean_write(tensor, fn, args, kwargs, param)


def _lean_write(
    tensor: Tensor, fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any], param: str | None
) -> None:
    try:
        fn(tensor, *args, **kwargs)
    except Exception as e:
        if not _lean_failed(Request(tensor, None, None, fn, args, kwargs, param), fn, e):
            raise


def _user_call(
    tensor: Tensor, fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any], param: str | None
) -> None:
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise inference_refused(tensor, param)
    try:
        with torch.no_grad():
            out = fn(tensor, *args, **kwargs)
            if out is not tensor and isinstance(out, Tensor):
                if out.shape != tensor.shape:
                    raise ValueError(
                        f"{fn_name(fn)} returned a tensor of shape {fmt_shape(out.shape)}; an init function "
                        f"must fill its argument in place or return a tensor of the same shape"
                    )
                tensor.copy_(out)
    except REJECTIONS as e:
        where = str(Where(param, tensor.shape))
        raise rejected(where, None, fn, e, wrote_nothing=False) from e


def _lean_failed(req: Request, fn: Callable[..., Tensor], e: Exception) -> bool:
    """A torch.nn.init function raised on the lean path: raise PackedInitError when it means bad input.

    Returns True when the error is to be ignored (a zero-element tensor: nothing to fill),
    False when the caller re-raises the original (e.g. out of memory, or an inference
    tensor outside inference mode: torch writes it before it refuses).
    """
    tensor = req.tensor
    if tensor.numel() == 0:
        return True
    if not convertible(e, True):
        return False
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note(f"packedinit: {INFERENCE_FIX}")
        return False
    where = str(Where(req.param, tensor.shape))
    gen = req.kwargs.get("generator")
    check_tensor(tensor, gen if isinstance(gen, torch.Generator) else None, where)
    check_fn_dtype(tensor.dtype, fn, where)
    raise rejected(where, None, fn, e, wrote_nothing=True) from e

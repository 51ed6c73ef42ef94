"""Whole-model init: resolve every parameter to its Layout once, then init a model.

Two entry points share one planner:

- ``chunked(f)(model)`` / :func:`init_model` own the whole tree: every distinct
  parameter with ``dim >= 2``, in ``model.named_parameters()`` order.
- ``model.apply(chunked(f))`` calls ``chunked(f)`` once per submodule (children
  first). Each call owns only that module's own parameters (``recurse=False``),
  with layouts from the module's annotations, its adapter and the adapters of the
  modules ``apply`` is visiting it from (its ancestors up to the module ``apply``
  was called on). So every parameter is initialised once, packed ones per block.

Everything is validated before the first write of a call: layouts against shapes,
the init function against every distinct block shape (a dry run on meta tensors).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn

from .engine import Plan, _fn_name, _is_dtensor, _run, _run_single, _Scratch, execute, make_plan
from .errors import PackedInitError
from .layout import Chunks, Layout
from .registry import _own_layouts, _resolve

__all__ = ["init_model"]

_APPLY_CODE = nn.Module.apply.__code__

#: (init fn, shape, dtype, device) that passed validation with no extra arguments, so that
#: ``model.apply(chunked(f))`` (one call per module, never with arguments) validates each
#: distinct shape once. The outcome depends only on the key; bounded, so it cannot grow.
_GOOD: dict[tuple[object, ...], None] = {}
_GOOD_MAX = 1024


def _good_key(fn: Callable[..., Tensor], p: Tensor) -> tuple[object, ...] | None:
    if p.is_inference():  # whether it may be written depends on the inference mode of the call
        return None
    key = (fn, p.shape, p.dtype, p.device)
    try:
        hash(key)
    except TypeError:  # an unhashable callable object
        return None
    return key


def _known_good(fn: Callable[..., Tensor], p: Tensor) -> bool:
    key = _good_key(fn, p)
    return key is not None and key in _GOOD


def _remember_good(fn: Callable[..., Tensor], p: Tensor) -> None:
    key = _good_key(fn, p)
    if key is not None:
        if len(_GOOD) >= _GOOD_MAX:
            _GOOD.clear()  # simple and safe under threads; refilled on the next calls
        _GOOD[key] = None


#: What distributed.plan_dtensor returns for a DTensor: (plan, local shard, global ranges).
_DTensorPlan = tuple[Plan | None, Tensor, list[range] | None]
#: One write: (qualified name, tensor, its layout or None, a validated plan for packed plain tensors,
#: whether it is a plain unpacked tensor that init_fn may be called on directly, a DTensor's plan).
_Step = tuple[str, Tensor, Layout | None, Plan | None, bool, _DTensorPlan | None]


def _plan_steps(
    entries: Iterable[tuple[str, Tensor, Layout | None]],
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    min_dim: int = 2,
) -> list[_Step]:
    """Validate every entry with ``dim >= min_dim`` before anything is written; return what to write, in order.

    A packed tensor gets its own plan. Unpacked tensors are checked once per distinct
    (shape, dtype[, device when a generator is given]): the tensor checks on the real
    tensor, and a dry run of ``init_fn`` on a meta tensor of that shape, so that a
    rejection comes before any write.
    """
    steps: list[_Step] = []
    seen: set[tuple[object, ...]] = set()
    by_device = "generator" in kwargs
    cacheable = not args and not kwargs
    for name, p, layout in entries:
        # A layout's batch dims index independent blocks: a stacked (n_experts, 2I) bias holds
        # 1-D blocks and is skipped like any bias, although its stored ndim is 2.
        if p.dim() - (layout.batch_dims if layout is not None else 0) < min_dim:
            continue
        tp = type(p)
        if tp is not nn.Parameter and tp is not Tensor and _is_dtensor(p):
            from .distributed import plan_dtensor

            # every check now, so that the whole model stays all-or-nothing; written by the distributed path
            dtensor_plan = plan_dtensor(p, layout, None, init_fn, args, kwargs, param=name)
            steps.append((name, p, layout, None, False, dtensor_plan))
        elif layout is not None:
            plan = make_plan(p, layout, None, init_fn, args, kwargs, param=name)
            if plan is not None and not p.is_meta and p.numel():
                steps.append((name, p, layout, plan, False, None))
        else:
            key = (p.shape, p.dtype, p.device) if by_device else (p.shape, p.dtype)
            if key not in seen:
                seen.add(key)
                if not (cacheable and _known_good(init_fn, p)):
                    make_plan(p, None, None, init_fn, args, kwargs, param=name)
                    if not p.is_meta:
                        meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
                        make_plan(meta, None, None, init_fn, args, kwargs, param=name)
                    if cacheable:
                        _remember_good(init_fn, p)
            steps.append((name, p, None, None, True, None))
    return steps


def _run_steps(
    steps: Sequence[_Step],
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> None:
    scratch = _Scratch()
    for name, p, layout, plan, plain, dtensor_plan in steps:
        if plan is not None:
            execute(plan, p, scratch)
        elif dtensor_plan is not None:
            from .distributed import write_planned

            write_planned(*dtensor_plan, scratch)
        elif not (plain and _run_single(p, init_fn, args, kwargs, name)):
            # an unpacked tensor the engine's lean path (exactly init_fn(p, ...)) declines
            _run(p, layout, None, init_fn, args, kwargs, param=name, scratch=scratch)


def _init_tree(
    model: nn.Module,
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> None:
    _run_steps(_plan_steps(_resolve(model), init_fn, args, kwargs), init_fn, args, kwargs)


def _apply_ancestors(module: nn.Module) -> list[nn.Module]:
    """The modules ``nn.Module.apply`` is visiting ``module`` from, nearest first (read from the call stack)."""
    f: FrameType | None = sys._getframe(2)
    for _ in range(16):  # find the apply frame that is calling fn(module)
        if f is None:
            return []
        if f.f_code is _APPLY_CODE and f.f_locals.get("self") is module:
            break
        f = f.f_back
    else:
        return []
    out: list[nn.Module] = []
    f = f.f_back if f is not None else None
    while f is not None and f.f_code is _APPLY_CODE:
        parent = f.f_locals.get("self")
        if isinstance(parent, nn.Module):
            out.append(parent)
        f = f.f_back
    return out


def _init_own(
    module: nn.Module,
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> None:
    own = [(n, p) for n, p in module._parameters.items() if p is not None and p.dim() >= 2]
    if not own:
        return
    lays = _own_layouts(module, _apply_ancestors(module))
    prefix = type(module).__name__
    entries = [(f"{prefix}.{n}", p, lays.get(id(p))) for n, p in own]
    _run_steps(_plan_steps(entries, init_fn, args, kwargs), init_fn, args, kwargs)


def _module_call(
    module: nn.Module,
    init_fn: Callable[..., Tensor],
    chunks: Chunks | None,
    dim: int | None,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    from_apply: bool,
) -> None:
    """``chunked(f)(module)``: the whole tree, or (from ``nn.Module.apply``) the module's own parameters."""
    if chunks is not None or dim is not None:
        raise PackedInitError(
            f"chunked({_fn_name(init_fn)}, chunks={chunks!r}, dim={dim!r}) was called on a "
            f"{type(module).__name__}; chunks/dim describe one tensor. For a module, layouts come from "
            f"adapters and annotations: use chunked({_fn_name(init_fn)})(module) and "
            f"packedinit.annotate(module, name=Layout(...)) for parameters no adapter knows."
        )
    if from_apply:
        _init_own(module, init_fn, args, kwargs)
    else:
        _init_tree(module, init_fn, args, kwargs)


def init_model(model: nn.Module, init_fn: Callable[..., Tensor], *args: Any, **kwargs: Any) -> nn.Module:
    r"""Initialise every parameter with ``dim >= 2`` of ``model``, packed ones per logical block.

    This is the ``for p in model.parameters(): if p.dim() > 1: init_fn(p)`` idiom
    done right: a parameter that :func:`~packedinit.layouts` knows to be packed
    (through a registered adapter or an annotation) gets ``init_fn`` once per
    logical block; every other parameter gets ``init_fn`` on the whole tensor,
    exactly as the plain loop would. 1-D parameters (biases, norms) are left alone.
    Tied parameters are initialised once. ``chunked(init_fn)(model, ...)`` is the
    same call.

    Order: parameters in ``model.named_parameters()`` order, blocks in block order,
    all from one RNG stream. On CPU the result is bit-identical to the plain loop
    run on the separate logical tensors.

    Args:
        model: the module.
        init_fn: a ``torch.nn.init``-style function ``fn(tensor, *args, **kwargs)``.
        *args: forwarded to ``init_fn``.
        **kwargs: forwarded to ``init_fn``; ``generator=`` is used for every draw.

    Returns:
        ``model`` itself.

    Raises:
        PackedInitError: a bad adapter/annotation, or ``init_fn`` rejecting some
            parameter or block; raised before anything is written.

    Examples:
        >>> from torch.nn.init import xavier_uniform_
        >>> model = torch.nn.TransformerEncoderLayer(d_model=16, nhead=4)
        >>> _ = init_model(model, xavier_uniform_, generator=torch.Generator().manual_seed(0))
        >>> bound = (6 / (16 + 16)) ** 0.5  # per q/k/v block, not sqrt(6 / (48 + 16))
        >>> w = model.self_attn.in_proj_weight
        >>> bool(w.abs().max() <= bound), bool(w.abs().max() > (6 / 64) ** 0.5)
        (True, True)
    """
    if not isinstance(model, nn.Module):
        raise PackedInitError(f"init_model(model, ...) needs an nn.Module, got {type(model).__name__}.")
    if not callable(init_fn):
        raise PackedInitError(f"init_model(model, init_fn): init_fn must be callable, got {type(init_fn).__name__}.")
    _init_tree(model, init_fn, args, kwargs)
    return model

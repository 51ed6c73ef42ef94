"""Checked steps of a whole-model init, and their all-or-nothing run.

:func:`plan_steps` / :func:`plan_requests` validate every request before anything is written (a
parameter whose checks an equal one passed is not planned again); :func:`run_steps` writes them in
order and, where a function could not be tried on meta, restores every tensor and the RNG on failure.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import Tensor

from packedinit.engine.distributed import DTensorPlan, plan_dtensor, write_planned
from packedinit.engine.execute import LocalSink, RngState, Scratch, execute
from packedinit.engine.lean import GENERAL, PLAIN_TYPES, call, route
from packedinit.engine.plan import Plan, Request, make_plan
from packedinit.engine.traits import TORCH_FNS, is_dtensor
from packedinit.errors import PackedInitError, packed_error
from packedinit.layout import Layout

__all__ = ["Step", "LeanStep", "plan_steps", "plan_requests", "run_steps", "call_key", "tensor_key", "CHECKED"]

@dataclass(frozen=True)
class Step:
    """One validated write of a whole-model call: a local plan, or a DTensor's plan and shard."""

    req: Request
    plan: Plan | None = None
    dtensor: DTensorPlan | None = None
    lean: int = GENERAL  # an unpacked plain tensor: what packedinit.engine.lean.route decided for it


#: A write of an unpacked tensor whose checks an equal one passed: ``lean.call``'s arguments
#: (route, tensor, fn, args, kwargs, name).
LeanStep: TypeAlias = tuple[int, Tensor, Callable[..., Tensor], tuple[Any, ...], Mapping[str, Any], str | None]


def plan_steps(
    entries: Iterable[tuple[str, Tensor, Layout | None]],
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    min_dim: int = 2,
) -> list[Step | LeanStep]:
    """Validate every entry with ``dim >= min_dim`` before anything is written; return what to write, in order.

    Every tensor gets every check of its own (its memory, dtype, generator device); the
    dry run of ``init_fn`` on each distinct block shape is cached, so validating a large
    model costs little more than one check per parameter. An unpacked tensor whose checks an
    equal one passed (see :func:`_checked_key`) is not planned again.
    """
    head = call_key(init_fn, args, kwargs)
    mode = torch.is_inference_mode_enabled()
    steps: list[Step | LeanStep] = []
    for name, p, layout in entries:
        # A layout's batch dims index independent blocks: a stacked (n_experts, 2I) bias holds
        # 1-D blocks and is skipped like any bias, although its stored ndim is 2.
        if p.dim() - (layout.batch_dims if layout is not None else 0) < min_dim:
            continue
        if head is not None and layout is None:
            key = tensor_key(p, head, mode)
            how = CHECKED.get(key) if key is not None else None
            if how is not None:
                steps.append((how, p, init_fn, args, kwargs, name))
                continue
        steps.extend(plan_requests((Request(p, layout, None, init_fn, args, kwargs, name),)))
    return steps


#: Unpacked plain tensors whose every check passed, by everything those checks read (see _checked_key),
#: with what packedinit.engine.lean.route decided for them. Only torch.nn.init functions with plain-valued
#: arguments: the key keeps no caller's object alive. Bounded; cleared when full.
CHECKED: dict[tuple[object, ...], int] = {}
_CHECKED_MAX = 4096
_PLAIN_VALUES = (int, float, str, bool, type(None))


def _checked_key(req: Request) -> tuple[object, ...] | None:
    """For an unpacked plain tensor and a torch.nn.init function with plain-valued arguments: everything
    ``make_plan(req, full=True)`` and ``route`` read (the name only goes into messages); else None."""
    if req.chunks is not None or req.dim is not None:
        return None
    head = call_key(req.init_fn, req.args, req.kwargs)
    return tensor_key(req.tensor, head, torch.is_inference_mode_enabled()) if head is not None else None


def tensor_key(p: Tensor, head: tuple[object, ...], mode: bool) -> tuple[object, ...] | None:
    """:func:`_checked_key` from its two parts: the call's (:func:`call_key`) and the tensor's."""
    if type(p) not in PLAIN_TYPES or p.layout != torch.strided:
        return None
    return (head, type(p), p.shape, p.stride(), p.dtype, p.device, p.is_inference(), mode)


def call_key(fn: object, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[object, ...] | None:
    """The function and its arguments with their types, for :func:`_checked_key`; None unless a torch.nn.init
    function with plain-valued arguments."""
    if type(fn) is not types.FunctionType or fn not in TORCH_FNS:
        return None
    if not args and not kwargs:
        return (fn,)
    if not all(type(v) in _PLAIN_VALUES for v in (*args, *kwargs.values())):
        return None
    return (fn, tuple((type(v), v) for v in args), tuple((k, type(v), v) for k, v in kwargs.items()))


def plan_requests(reqs: Iterable[Request]) -> list[Step]:
    """Validate every request before anything is written; return the steps that write, in order.

    An unpacked tensor whose checks an equal one already passed (same shape, strides, dtype,
    device, function and arguments) is not checked again: the checks read nothing else.
    """
    steps: list[Step] = []
    for req in reqs:
        p, layout = req.tensor, req.chunks
        if is_dtensor(p):
            # every check now, so that the whole model stays all-or-nothing; written by the distributed path
            steps.append(Step(req, dtensor=plan_dtensor(req)))
            continue
        key = _checked_key(req)
        how = CHECKED.get(key) if key is not None else None
        if how is not None:  # an equal tensor passed every check (only written ones are kept)
            steps.append(Step(req, lean=how))
            continue
        plan = make_plan(req, full=True)
        if plan is not None and not p.is_meta and p.numel():
            unpacked = layout is None and req.dim is None and callable(req.init_fn)
            how = route(p, req.init_fn, req.args, req.kwargs, req.param) if unpacked else GENERAL
            steps.append(Step(req, plan=plan, lean=how))
            if key is not None and how != GENERAL:
                if len(CHECKED) >= _CHECKED_MAX:
                    CHECKED.clear()
                CHECKED[key] = how
    return steps


def run_steps(steps: Sequence[Step | LeanStep], scratch: Scratch | None = None) -> None:
    """Write what :func:`plan_steps` validated, in order, sharing one scratch buffer.

    When some function could not be tried on meta (it reads values: the dry run proved
    nothing about it) and more than one tensor is written, every tensor is copied first, so
    that a failure on a later tensor puts back the earlier ones and the RNG state: the call
    stays all-or-nothing.
    """
    scratch = scratch or Scratch()
    if len(steps) > 1 and any(not isinstance(s, tuple) and s.plan is not None and not s.plan.verified for s in steps):
        _run_undoable(steps, scratch)
        return
    _run(steps, scratch)


def _run(steps: Sequence[Step | LeanStep], scratch: Scratch) -> None:
    for step in steps:
        if isinstance(step, tuple):
            call(*step)
            continue
        req = step.req
        if step.dtensor is not None:
            write_planned(step.dtensor, scratch)
        elif step.lean != GENERAL:
            call(step.lean, req.tensor, req.init_fn, req.args, req.kwargs, req.param)  # type: ignore[arg-type]
        elif step.plan is not None:
            execute(step.plan, LocalSink(req.tensor, step.plan.layout), scratch)


def _run_undoable(steps: Sequence[Step | LeanStep], scratch: Scratch) -> None:
    tensors = [s[1] if isinstance(s, tuple) else s.req.tensor for s in steps]
    backups = [t.detach().clone() for t in tensors]
    plan = next(s.plan for s in steps if not isinstance(s, tuple) and s.plan is not None)
    rng = RngState(tensors[0].device, plan.generator)
    try:
        _run(steps, scratch)
    except Exception as e:
        with torch.no_grad():
            for t, b in zip(tensors, backups, strict=True):
                t.copy_(b)
        rng.restore()
        if isinstance(e, PackedInitError):
            msg = _AS_LEFT.sub("Nothing was written", str(e))
            cause = e.__cause__
            msg += " (packedinit restored every tensor it had written and the RNG state)"
            raise packed_error(msg, cause) from cause
        if hasattr(e, "add_note"):
            e.add_note("packedinit: restored every tensor it had written and the RNG state; nothing was written.")
        raise


_AS_LEFT = re.compile(r"packedinit wrote nothing; the tensor is as \S+ left it")

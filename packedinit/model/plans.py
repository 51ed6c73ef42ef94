"""Whole ``model.apply(chunked(f))`` traversals kept: every check made once, before the first visit writes.

A ``model.apply`` visit re-uses the decision :mod:`packedinit.model.kept` kept for its module after
comparing what it was read from, one module at a time, and :mod:`packedinit.model.visits` works out
which shared parameters a later visit writes. On a tree of many small modules those per-visit
looks cost as much as the writes. Where two traversals in a row of the same root, with the same
call, re-used a kept decision at every visit that writes (the second one builds the plan), the
third and later ones check the **whole** traversal at its first visit instead:

- the call, inference mode and what is known about layouts (:func:`packedinit.model.kept.world`);
- every module of the tree, in the order ``apply`` visits them: the same object, type, children
  and parameters, and none with an ``apply`` of its own;
- every parameter written: the same object, shape, strides, dtype, device and inference flag.

Then each visit only compares itself with the next one expected (same root, same module) and
writes what its module's kept decision writes, a shared parameter at its last visit only (as
:mod:`.visits` does). A visit that is not the one expected ends the plan for that traversal: it and
the rest go the per-visit way. Nothing is written by a traversal whose checks fail. Plans hold
modules and parameters weakly; state is per thread.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from packedinit.engine.direct import DirectDraw, direct_draw
from packedinit.engine.lean import TORCH, lean_calls
from packedinit.model import found
from packedinit.model.changes import NOW
from packedinit.model.kept import changed, kept_writes, node, same_node, world
from packedinit.model.steps import call_key
from packedinit.model.visits import visit_order
from packedinit.shapes import fans
from packedinit.torch_compat import param_dict, set_grad_enabled

__all__ = ["plan_visit", "end_plan", "keep_plan"]

_MAX = 1 << 10  # kept plans; all dropped when full
_APPLY = nn.Module.apply

#: a write of a plan: (parameter, meta, label, the draw torch's function makes on it, or None: call the function)
_Write = tuple["weakref.ref[Tensor]", tuple[object, ...], str, DirectDraw | None]


class _Plan:
    __slots__ = ("head", "kinds", "metas", "mode", "nodes", "order", "root", "was", "writes")

    def __init__(
        self,
        root: nn.Module,
        head: tuple[object, ...],
        mode: bool,
        was: int,
        order: Sequence[nn.Module],
        writes: tuple[tuple[_Write, ...], ...],
        metas: Mapping[int, tuple[weakref.ref[Tensor], tuple[object, ...]]],
    ) -> None:
        self.root = weakref.ref(root)
        self.head, self.mode, self.was = head, mode, was
        self.order = tuple(weakref.ref(m) for m in order)
        self.nodes = tuple(map(node, order))
        self.metas = tuple(metas.values())  # every weight a kept decision writes, and what it read of it
        self.kinds = tuple({type(m): None for m in order})  # each class once: its apply still nn.Module's own
        self.writes = writes

    def holds(self, init_fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        """Every check of the traversal (no write made)."""
        if (
            NOW[0] != self.was
            or torch.is_inference_mode_enabled() is not self.mode
            or torch.compiler.is_compiling()
            or call_key(init_fn, args, kwargs) != self.head
            or any(kind.apply is not _APPLY for kind in self.kinds)
        ):
            return False
        if not all(map(same_node, self.nodes)):
            return False
        for ref in self.order:  # (same_node compared each type; each class's apply is compared above)
            m = ref()
            if m is None or "apply" in m.__dict__:
                return False
        for kref, meta in self.metas:
            p = kref()
            if p is None or changed(p, meta):
                return False
        return True


_PLANS: dict[int, _Plan] = {}
#: (root, call key, world) of the last traversal that re-used a kept decision at every visit that writes
_TRIED: dict[int, tuple[weakref.ref[nn.Module], tuple[object, ...], int]] = {}


class _Local(threading.local):
    plan: _Plan | None = None
    pos: int = 0


_RUN = _Local()


def end_plan() -> None:
    """Forget the plan this thread's traversal follows (an error stopped it)."""
    _RUN.plan = None


def _write(plan: _Plan, pos: int, init_fn: Callable[..., Tensor], args: tuple[Any, ...], kw: Mapping[str, Any]) -> None:
    """Visit ``pos``'s writes, in order: torch's draw made here where :func:`direct_draw` knows it (the same numbers,
    bit for bit, without the function's per-call cost), else the function itself."""
    writes = plan.writes[pos]
    if not writes:
        return
    grad = torch.is_grad_enabled()
    set_grad_enabled(False)  # torch.no_grad() without the context manager's cost, as the function itself has it
    try:
        for kref, _, label, d in writes:
            p = kref()
            if p is None:  # (not reached: its module holds it, compared at the first visit)
                continue
            if d is None:
                set_grad_enabled(grad)
                lean_calls(((p, label),), init_fn, args, kw)
                set_grad_enabled(False)
            elif d[0] == "uniform":
                p.uniform_(d[1], d[2])
            else:
                p.normal_(d[1], d[2])
    finally:
        set_grad_enabled(grad)


def plan_visit(
    module: nn.Module,
    ancestors: Sequence[nn.Module],
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> bool:
    """Make this ``apply`` visit as the kept plan of its traversal says; False: nothing done (go the per-visit way)."""
    root = ancestors[-1] if ancestors else module
    run = _RUN
    plan = run.plan
    if plan is not None:
        pos = run.pos
        if pos < len(plan.order) and plan.order[pos]() is module and plan.root() is root:
            run.pos = pos + 1
            if not ancestors:  # the root: the last visit
                run.plan = None
                found.end_pass(module)
            _write(plan, pos, init_fn, args, kwargs)
            return True
        run.plan = None  # not the visit expected: another traversal, or this one changed course
    if not ancestors:
        return False
    plan = _PLANS.get(id(root))
    if plan is None:
        return False
    if plan.root() is not root or plan.order[0]() is not module or not plan.holds(init_fn, args, kwargs):
        _PLANS.pop(id(root), None)  # another root, a changed tree, another call: kept again after two traversals
        return False
    run.plan, run.pos = plan, 1
    _write(plan, 0, init_fn, args, kwargs)
    return True


def keep_plan(
    root: nn.Module, init_fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> None:
    """After ``root``'s visit (the last of its traversal) on the per-visit way: keep the traversal as a plan on the
    second one in a row with the same call, where every module that writes has a kept decision for it."""
    head = call_key(init_fn, args, kwargs)
    if head is None:
        return
    was, tried = world(), _TRIED.get(id(root))
    if tried is None or tried[0]() is not root or tried[1] != head or tried[2] != was:
        if len(_TRIED) >= _MAX:
            _TRIED.clear()
        _TRIED[id(root)] = (weakref.ref(root), head, was)  # the first: marked only (a call made once pays nothing)
        return
    order = visit_order(root)
    if order is None or not found.quiet(root):
        return
    mode = torch.is_inference_mode_enabled()
    last: dict[int, int] = {}  # each parameter that may be written: its last visit, the one that writes it
    for i, m in enumerate(order):
        for p in param_dict(m).values():
            if p is not None and p.dim() >= 2:
                last[id(p)] = i
    writes: list[tuple[_Write, ...]] = []
    metas: dict[int, tuple[weakref.ref[Tensor], tuple[object, ...]]] = {}
    for i, m in enumerate(order):
        got: tuple[tuple[Any, ...], ...] = ()
        if any(p is not None and p.dim() >= 2 and last[id(p)] == i for p in param_dict(m).values()):
            kept = kept_writes(m, root, head, was, mode)  # (a visit that leaves every one to a later one has none)
            if kept is None:
                return
            got = kept
        mine: list[_Write] = []
        for kref, meta, how, label in got:
            p = kref()
            metas[id(p)] = (kref, meta)
            if how == TORCH and last[id(p)] == i:
                mine.append((kref, meta, label, direct_draw(init_fn, args, kwargs, *fans(p.shape))))
        writes.append(tuple(mine))
    if len(metas) != len(last):  # (every one is written by its last visit's kept decision)
        return
    if len(_PLANS) >= _MAX:
        _PLANS.clear()
    _PLANS[id(root)] = _Plan(root, head, mode, was, order, tuple(writes), metas)

"""One ``model.apply(chunked(f))`` traversal: which of a module's parameters a later visit of the same traversal writes.

``nn.Module.apply(fn)`` calls ``fn`` on every module, children first, and a parameter shared by
two modules (GPT-2's tied ``wte`` / ``lm_head`` weight) is visited by each of them. Written at
each visit, the last write wins and the earlier ones are draws thrown away (12.6M of 98M on a
GPT-2). Here a visit leaves out a shared parameter that a later visit **of the same traversal**
writes with the same function: the parameter keeps the value of the same (last) visit as before,
with the layout that visit resolves, and is drawn once.

"Later in the same traversal" is known exactly, never guessed: from the visit's ancestors (the
``apply`` frames above it, :func:`packedinit.torch_compat.apply_ancestors`) the visits still to come
are the rest of each ancestor's children, in ``children()`` order, each subtree children first, then
the ancestor itself; that holds only where every one of those modules runs ``nn.Module.apply``
itself (a module that overrides ``apply`` turns this off for the traversal: every visit writes).
The next visit is checked against that sequence (same root, the module expected next), so a new
traversal, or one that stopped on an error, never re-uses what an earlier one computed.

Only a parameter that something besides its module holds can be shared; the reference count tells
that at no cost, so a traversal of a tree with no shared parameter computes nothing here. A
parameter held elsewhere for another reason (an optimizer) costs one look at the visits to come and
is written as before. State is per thread and holds modules weakly.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from packedinit.torch_compat import module_dict, param_dict

__all__ = ["later_writes", "end_traversal", "visit_order"]

_APPLY = nn.Module.apply
_NONE: frozenset[int] = frozenset()


_refcount = sys.getrefcount  # CPython's reference count


def _held(params: Iterable[Tensor | None], solo: int) -> bool:
    """Whether something besides their dict may hold one of ``params`` (a count above ``solo``, as seen here)."""
    for p in params:  # noqa: SIM110 (a loop, not any(): cheaper per visit, and its own references are calibrated)
        if p is not None and _refcount(p) > solo:
            return True
    return False


#: What :func:`_held` reads for a tensor that one ``_parameters`` dict alone holds: calibrated here, through
#: the same code, so the interpreter's own references are counted the same way on every version.
_SOLO = next(n for n in range(1, 64) if not _held({"w": torch.empty(0)}.values(), n))


class _Pass:
    """The visits still to come in one traversal, and where each shared parameter is written last."""

    __slots__ = ("last", "pos", "rest", "root")

    def __init__(self, root: nn.Module, first: nn.Module, rest: list[nn.Module]) -> None:
        self.root = weakref.ref(root)
        self.rest = [weakref.ref(m) for m in rest]
        self.pos = 0  # the index in ``rest`` of the visit expected next
        #: the last visit of each parameter that more than one visit holds (``first``'s: before every one)
        last: dict[int, int] = {}
        seen = {id(p) for p in param_dict(first).values() if p is not None}
        for i, m in enumerate(rest):
            for p in param_dict(m).values():
                if p is not None:  # (a shared one under two dims only costs _after a look: it is never written)
                    k = id(p)
                    if k in seen:
                        last[k] = i
                    else:
                        seen.add(k)
        self.last = last


class _Local(threading.local):
    now: _Pass | None = None


_STATE = _Local()


def _plain(m: nn.Module) -> bool:
    return type(m).apply is _APPLY and "apply" not in m.__dict__


def _subtree(m: nn.Module, out: list[nn.Module]) -> bool:
    """Append ``m``'s visits (children first) to ``out``; False where a module there overrides ``apply``."""
    if not _plain(m):
        return False
    if module_dict(m):  # (a leaf has no children to ask for: nn.Module.children() walks only this dict)
        for child in m.children():
            if not _subtree(child, out):
                return False
    out.append(m)
    return True


def visit_order(root: nn.Module) -> list[nn.Module] | None:
    """Every module ``root.apply(fn)`` calls ``fn`` on, in that order; None where one of them overrides ``apply``."""
    out: list[nn.Module] = []
    return out if _subtree(root, out) else None


def _rest(module: nn.Module, ancestors: Sequence[nn.Module]) -> list[nn.Module] | None:
    """The visits after ``module``'s, in order, or ``None`` where they cannot be known."""
    out: list[nn.Module] = []
    child = module
    for parent in ancestors:
        kids = list(parent.children())
        at = next((i for i, k in enumerate(kids) if k is child), None)
        if at is None:
            return None
        for k in kids[at + 1 :]:
            if not _subtree(k, out):
                return None
        out.append(parent)
        child = parent
    return out


def later_writes(module: nn.Module, ancestors: Sequence[nn.Module]) -> frozenset[int]:
    """The ``id`` of each of ``module``'s own parameters that a later visit of this ``apply`` traversal writes.

    ``ancestors``: the modules ``apply`` visits ``module`` from, nearest first (the root last).
    """
    st, at = _STATE.now, -1
    if st is not None:  # (None, the common case: no traversal with a shared parameter under way)
        root = ancestors[-1] if ancestors else module
        if st.root() is root and st.pos < len(st.rest) and st.rest[st.pos]() is module:
            at = st.pos
            st.pos += 1
        else:
            st = _STATE.now = None  # another traversal, or one that stopped early
    if not ancestors:  # the root: the last visit of its traversal
        _STATE.now = None
        return _NONE
    if st is not None and not st.last:  # a traversal in which no parameter is held by two visits
        return _NONE
    if not _held(param_dict(module).values(), _SOLO) or torch.compiler.is_compiling():
        return _NONE
    return _start(module, ancestors) if st is None else _after(st, module, at)


def _start(module: nn.Module, ancestors: Sequence[nn.Module]) -> frozenset[int]:
    """The first visit of a traversal with a parameter that may be shared: the visits to come, computed once."""
    rest = _rest(module, ancestors)
    if rest is None:
        return _NONE
    st = _STATE.now = _Pass(ancestors[-1], module, rest)
    return _after(st, module, -1)


def _after(st: _Pass, module: nn.Module, at: int) -> frozenset[int]:
    """``module``'s parameters that a visit after position ``at`` (-1: before every one of ``st``) writes."""
    own = [p for p in param_dict(module).values() if p is not None and p.dim() >= 2]
    return frozenset(id(p) for p in own if st.last.get(id(p), -1) > at)


def end_traversal() -> None:
    """Forget the traversal this thread is in (an error stopped it: the next visit starts afresh)."""
    _STATE.now = None

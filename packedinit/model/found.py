"""What the forward shows about a model's weights, merged with what adapters and annotations say.

The model room never traces: ``packedinit`` installs the tracer (:mod:`packedinit.trace.auto`)
with :func:`set_tracer`, as it installs the built-in adapters. :func:`findings` traces a model
once on inputs built from it (``None`` where none can be built, or the forward fails) and keeps
the result weakly per model, so a second whole-model call costs nothing.

:func:`merge` is the one place that decides, for the whole-model idioms, which layout a weight
gets: an annotation first, then an adapter (the fast path; a forward that disagrees is named in
a :class:`~packedinit.errors.LayoutWarning`), then the forward. A weight that looks packed
(:mod:`packedinit.model.looks`) and that nothing describes is named in one warning with the
``packedinit.annotate(model, ...)`` line that fixes it.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from torch import Tensor, nn

from packedinit.errors import LayoutWarning
from packedinit.layout import Layout
from packedinit.model.changes import bump
from packedinit.model.looks import annotate_line, axis_fix, may_look_packed, name_guess
from packedinit.model.marks import annotations_of
from packedinit.shapes import fmt_shape

__all__ = [
    "Finding",
    "Tracer",
    "set_tracer",
    "findings",
    "trace",
    "remember",
    "own_forward",
    "end_pass",
    "merge",
    "same",
    "quiet",
]


class Finding(Protocol):
    """One weight as the forward showed it (:class:`packedinit.Inferred` is one)."""

    @property
    def verdict(self) -> str: ...

    @property
    def layout(self) -> Layout | None: ...

    @property
    def why(self) -> str: ...


#: ``tracer(model, args, kwargs)``: trace on these inputs (``args=None``: inputs built from the model;
#: returns None where none can be built). Read-only.
Tracer: TypeAlias = Callable[[nn.Module, "tuple[Any, ...] | None", Mapping[str, Any]], "Mapping[str, Finding] | None"]
#: ``same(a, b)``: whether two layouts (None: one block) cut the same blocks.
Same: TypeAlias = Callable[[Layout | None, Layout | None], bool]

_tracer: Tracer | None = None
_same: Same | None = None
_lock = threading.Lock()


#: one parameter in the ``model.apply`` index: (weakref to it, name, finding, name guess); only the
#: weights the forward shows packed or cannot follow, or that look packed, carry a name
_Entry: TypeAlias = "tuple[weakref.ref[Tensor], str | None, Finding | None, tuple[Layout, str] | None]"


@dataclass
class _Seen:
    found: Mapping[str, Finding] | None
    # the model.apply path: {id(param): _Entry} for every parameter, built once (again when a parameter
    # is another object than the one indexed: to_empty, load_state_dict(assign=True))
    index: dict[int, _Entry] | None = None
    named: bool = False  # some entry of the index carries a name
    # the parameter names that may look packed (looks.may_look_packed), for this many parameters
    maybe: tuple[int, frozenset[str]] | None = None
    warned: bool = False  # in this model.apply pass


_cache: weakref.WeakKeyDictionary[nn.Module, _Seen] = weakref.WeakKeyDictionary()
#: what was last remembered per model (kept after forget): a trace that shows the same is no change
_shown: weakref.WeakKeyDictionary[nn.Module, dict[str, Finding] | None] = weakref.WeakKeyDictionary()
_NOTHING: Any = object()


def quiet(root: nn.Module) -> bool:
    """Whether nothing in ``root``'s tree needs the forward on the ``model.apply`` path (no weight the forward
    shows packed or cannot follow, none that looks packed): what :func:`own_forward` then adds is nothing."""
    with _lock:
        seen = _cache.get(root)
    return seen is not None and seen.index is not None and not seen.named


def set_tracer(tracer: Tracer, same_blocks: Same) -> None:
    """Install the forward tracer and the layout comparison (``packedinit`` does this on import)."""
    global _tracer, _same
    _tracer, _same = tracer, same_blocks


def same(a: Layout | None, b: Layout | None) -> bool:
    """Whether ``a`` and ``b`` cut the same blocks (exact equality before the tracer is installed)."""
    return _same(a, b) if _same is not None else a == b


def trace(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Mapping[str, Finding]:
    """Trace ``model`` on the given inputs now (and remember the result for ``model``)."""
    if _tracer is None:
        raise RuntimeError("packedinit's forward tracer is not installed (import packedinit)")
    found = _tracer(model, args, kwargs)
    assert found is not None  # the inputs were given
    remember(model, found)
    return found


def remember(model: nn.Module, found: Mapping[str, Finding] | None) -> None:
    """Keep ``found`` as what the forward shows about ``model`` (weakly: the model's lifetime).

    A decision kept from an earlier call (:mod:`packedinit.model.kept`) stays valid only when what the
    forward shows is equal, value for value, to what it showed before (a model traced again after
    :func:`forget`): any other record is a change.
    """
    with _lock:
        _cache[model] = _Seen(found)
        _last.clear()
        was = _shown.get(model, _NOTHING)
        _shown[model] = dict(found) if found is not None else None
        if was is _NOTHING or was != _shown[model]:
            bump()


def forget(model: nn.Module) -> None:
    """Drop what was kept of ``model``'s forward: the next whole-model call traces it again.

    Nothing kept from it is used before that trace (:mod:`packedinit.model.kept` asks :func:`findings`
    first), and a different result is a change (:func:`remember`).
    """
    with _lock:
        _cache.pop(model, None)
        _last.clear()


def findings(model: nn.Module) -> Mapping[str, Finding] | None:
    """What the forward shows about ``model``'s weights, traced once on inputs built from it; None: no trace."""
    with _lock:
        seen = _cache.get(model)
    if seen is not None:
        return seen.found
    found = _tracer(model, None, {}) if _tracer is not None else None
    remember(model, found)
    return found


def _index(root: nn.Module, seen: _Seen) -> dict[int, _Entry]:
    found = seen.found or {}
    modules = dict(root.named_modules())
    index: dict[int, _Entry] = {}
    for name, p in root.named_parameters():
        hit = found.get(name)
        guess = None
        if (hit is None or hit.verdict == "opaque") and may_look_packed(name, p):
            guess = name_guess(name, p, functools.partial(modules.get, name.rpartition(".")[0]))
        keep = (hit is not None and hit.verdict == "packed") or guess is not None
        index[id(p)] = (weakref.ref(p), name, hit, guess) if keep else (weakref.ref(p), None, None, None)
    seen.index, seen.named = index, any(e[1] is not None for e in index.values())
    with _lock:
        bump()
    return index


_last: list[tuple[weakref.ref[nn.Module], _Seen]] = []  # the model last asked for: apply asks once per module


def _seen(model: nn.Module) -> _Seen:
    last = _last[0] if _last else None
    if last is not None and last[0]() is model:
        return last[1]
    with _lock:
        seen = _cache.get(model)
    if seen is None:
        findings(model)  # remembers what it found (a change where it differs)
        with _lock:
            seen = _cache.setdefault(model, _Seen(None))
    _last[:] = [(weakref.ref(model), seen)]
    return seen


def maybe_packed(model: nn.Module, params: Collection[tuple[str, Tensor]]) -> frozenset[str]:
    """The names among ``params`` (all of ``model``'s) that :func:`~packedinit.model.looks.may_look_packed`; kept."""
    seen = _seen(model)
    kept = seen.maybe
    if kept is not None and kept[0] == len(params):
        return kept[1]
    names = frozenset(n for n, p in params if may_look_packed(n, p))
    seen.maybe = (len(params), names)
    return names


def own_forward(
    root: nn.Module,
    own: Sequence[tuple[str, Tensor]],
    lays: dict[int, Layout | None],
    module: nn.Module,
    fn: object,
    say: Callable[[nn.Module, object, bool], tuple[str, bool]],
) -> dict[int, Layout | None]:
    """``lays`` (``module``'s own claimed layouts, the ``model.apply`` path) with the forward's filled in.

    ``root`` is the module ``apply`` was called on: it is traced (once, kept) and its names are
    the ones the warnings give. ``say(root, fn, whole)`` gives the idiom's name and whether the
    init function ``fn`` reads fans (asked only where some weight needs it); with ``whole`` it
    first warns for the whole tree, once per ``apply`` pass.
    """
    last = _last[0] if _last else None
    seen = last[1] if last is not None and last[0]() is root else _seen(root)
    if module is not root:
        if seen.index is not None and not seen.named:
            return lays  # the common case: nothing in the tree needs the forward
        return _own(root, own, lays, module, fn, say, seen)
    try:
        return _own(root, own, lays, module, fn, say, seen)
    finally:
        seen.warned = False  # apply visits the root last: the next pass warns again


def _own(
    root: nn.Module,
    own: Sequence[tuple[str, Tensor]],
    lays: dict[int, Layout | None],
    module: nn.Module,
    fn: object,
    say: Callable[[nn.Module, object, bool], tuple[str, bool]],
    seen: _Seen,
) -> dict[int, Layout | None]:
    index = seen.index if seen.index is not None else _index(root, seen)
    if not seen.named:  # nothing in the tree is packed by the forward or looks packed
        return lays
    entries: list[tuple[str, Tensor, Layout | None, str | None]] = []
    notes: Collection[str] | None = None
    rebuilt = False
    for leaf, p in own:
        hit = index.get(id(p))
        if (hit is None or hit[0]() is not p) and not rebuilt:  # a parameter replaced since the index was built
            index, rebuilt = _index(root, seen), True
            hit = index.get(id(p))
        if hit is None or hit[1] is None or hit[0]() is not p:
            continue
        kind = None
        if id(p) in lays:
            notes = annotations_of(module) if notes is None else notes
            kind = "annotation" if leaf in notes else "adapter"
        entries.append((hit[1], p, lays.get(id(p)), kind))
    if not entries:
        return lays
    idiom, loud = say(root, fn, False)
    try:
        merged = merge(root, entries, seen.found, idiom=idiom, loud=loud, warn=False)
    except _LoudError:
        if not seen.warned:  # once per apply pass, for the whole tree: one warning, one line
            say(root, fn, True)
            seen.warned = True
        merged = merge(root, entries, seen.found, idiom=idiom, loud=loud, only=(), warn=False)
    out = dict(lays)
    out.update({id(p): lay for _, p, lay in merged if lay is not None or id(p) in lays})
    return out


def end_pass(root: nn.Module) -> None:
    """``model.apply`` reached ``root`` (it visits the root last): the next pass warns again."""
    with _lock:
        seen = _cache.get(root)
    if seen is not None:
        seen.warned = False


class _LoudError(Exception):
    """merge(warn=False) found something to say."""


def _module_of(model: nn.Module, fqn: str) -> nn.Module | None:
    path = fqn.rpartition(".")[0]
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        return None


def merge(
    model: nn.Module,
    entries: Sequence[tuple[str, Tensor, Layout | None, str | None]],
    found: Mapping[str, Finding] | None,
    *,
    idiom: str,
    loud: bool = True,
    only: Collection[int] | None = None,
    stacklevel: int = 4,
    warn: bool = True,
) -> list[tuple[str, Tensor, Layout | None]]:
    """One layout per weight from ``(name, param, claimed layout, "annotation" | "adapter" | None)``.

    Annotations and adapters win; the forward fills in what they leave undescribed. Where an
    adapter and the forward cut other blocks, and where a weight looks packed and nothing shows
    its layout, one :class:`~packedinit.errors.LayoutWarning` names the weights (``idiom`` says
    which call warned) and gives the ``annotate`` line that fixes them. No warning with
    ``loud=False`` (an init function whose values do not depend on the shape: ``zeros_``,
    ``normal_``), nor for a parameter outside ``only`` (ids; the ones a filter keeps).
    """
    out: list[tuple[str, Tensor, Layout | None]] = []
    disagree: list[str] = []
    unlaid: list[tuple[str, Layout, str]] = []
    for name, p, layout, kind in entries:
        seen = found.get(name) if found is not None else None
        quiet = not loud or (only is not None and id(p) not in only)
        if kind is not None:
            traced = seen is not None and seen.verdict != "opaque"
            if kind == "adapter" and not quiet and traced and seen is not None and not same(layout, seen.layout):
                disagree.append(f"{name!r} {fmt_shape(p.shape)}: the adapter says {layout!r}, the forward shows "
                                f"{seen.layout!r}")  # fmt: skip
            out.append((name, p, layout))
            continue
        if seen is not None and seen.verdict == "packed" and seen.layout is not None:
            try:
                seen.layout.check(p.shape, param=name)
            except ValueError:
                seen = None  # traced on other shapes (the model changed since): guess again below
            else:
                out.append((name, p, seen.layout))
                continue
        if not quiet and may_look_packed(name, p) and (seen is None or seen.verdict == "opaque"):
            guess = name_guess(name, p, functools.partial(_module_of, model, name))
            if guess is not None:
                unlaid.append((name, *guess))
        out.append((name, p, None))
    if not warn:
        if disagree or unlaid:
            raise _LoudError
        return out
    if disagree or unlaid:
        with _lock:
            bump()  # a decision kept from this call would not warn again (see packedinit.model.kept)
    if disagree:
        warnings.warn(
            f"{idiom}: the adapters and the forward disagree on {len(disagree)} weight(s): {'; '.join(disagree)}. "
            f"The adapter's layout is used; if the forward is right, annotate the weight "
            f"(packedinit.annotate(model, **{{name: Layout(...)}})).",
            LayoutWarning,
            stacklevel=stacklevel,
        )
    if unlaid:
        paired = _with(unlaid, entries)
        named = "; ".join(f"{n!r} {fmt_shape(p.shape)} ({why})" for (n, _, why), (_, p, _, _) in paired)
        views = {n: line for (n, _, _), (_, p, _, _) in paired if (line := axis_fix(n, p)) is not None}
        rest = [(n, lay) for n, lay, _ in unlaid if n not in views]
        by_trace = "or trace the forward: packedinit.annotate(model, *example_inputs)"
        fixes = [f"{annotate_line(rest)}; {by_trace}"] if rest else []
        if views:
            fixes.append(
                f"{', '.join(map(repr, views))} hold their blocks on dim -2 (w[..., 0, :], w[..., 1, :]), which no "
                f"Layout of the stored shape describes: after the call, re-initialise each per block through its "
                f"row-interleaved view, with init your init function: {'; '.join(views.values())}"
            )
        warnings.warn(
            f"{idiom}: {len(unlaid)} weight(s) look packed and no adapter, annotation or trace of the forward gives "
            f"their layout, so each is initialised as one tensor: {named}. Fix (check the sizes against the "
            f"forward): {'. Also: '.join(fixes)}.",
            LayoutWarning,
            stacklevel=stacklevel,
        )
    return out


def _with(
    unlaid: list[tuple[str, Layout, str]], entries: Sequence[tuple[str, Tensor, Layout | None, str | None]]
) -> list[tuple[tuple[str, Layout, str], tuple[str, Tensor, Layout | None, str | None]]]:
    by_name = {e[0]: e for e in entries}
    return [(u, by_name[u[0]]) for u in unlaid]

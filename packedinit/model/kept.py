"""Decisions of the lean path kept for the next equal call: ``model.apply`` visits, and whole models nothing describes.

A whole-model call resolves every parameter (adapters, annotations, the forward, what looks
packed) and checks every tensor before it writes; ``model.apply(chunked(f))`` does it once per
module. Where the answer was "nothing here is packed, and every tensor passed the checks an equal
one passed" (the lean path: torch's own function on each whole tensor), it is kept, and the next
call with the same function and arguments on the same modules re-uses it after comparing, before
the first write, everything the answer was read from:

- what is known about layouts anywhere: the adapter registry, the annotations, what the forward
  showed (one register/unregister, ``annotate``, or a trace that shows something else than the last
  one anywhere makes every kept decision stale; after ``forget`` the model is traced again first);
- the call: the init function and its plain-valued arguments, inference mode;
- every module (held weakly: a kept decision keeps nothing alive): the same object and type, the
  same children (names and objects) and parameters (names and objects); for ``model.apply`` the
  same root and the same types above the module;
- every parameter written: the same type, layout, shape, strides, dtype, device and inference
  flag; every other one still under two dims.

Only decisions in which no adapter and no annotation took part are kept (an adapter may read
module attributes that nothing here compares), and none whose resolution warned (the next call
warns again). The tensors are then handed to torch's function exactly as the full path hands them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, TypeAlias, TypeVar

import torch
from torch import Tensor, nn

from packedinit.engine.lean import TORCH, lean_calls
from packedinit.model import found, marks, registry
from packedinit.model.changes import NOW
from packedinit.model.steps import call_key
from packedinit.torch_compat import module_dict, param_dict

__all__ = ["world", "apply_kept", "keep_apply", "kept_writes", "tree_kept", "keep_tree", "node", "same_node", "changed"]

_T = TypeVar("_T")
_MAX = 1 << 16  # kept module decisions; all dropped when full
_Meta: TypeAlias = tuple[object, ...]
#: a parameter of a kept module: (weakref or None, meta or None, route, label); meta None: not written
_Own: TypeAlias = "tuple[weakref.ref[Tensor] | None, _Meta | None, int, str]"
#: a kept module decision: (module, type, ancestors' types, root, call key, inference mode, world, parameter
#: names, parameters)
_Visit: TypeAlias = "tuple[weakref.ref[nn.Module], type, tuple[type, ...], weakref.ref[nn.Module], tuple[object, ...], bool, int, tuple[str, ...], tuple[_Own, ...]]"  # noqa: E501
#: a module of a kept tree: (module, type, child names, child ids, parameter names, parameter refs, low-dim flags)
_Node: TypeAlias = "tuple[weakref.ref[nn.Module], type, tuple[str, ...], tuple[int, ...], tuple[str, ...], tuple[weakref.ref[Tensor] | None, ...], tuple[bool, ...]]"  # noqa: E501
#: a write of a kept tree: (parameter, meta, route, name)
_Write: TypeAlias = "tuple[weakref.ref[Tensor], _Meta, int, str | None]"

_APPLY: dict[int, _Visit] = {}
#: One object for each equal part of the kept decisions (their names, types, calls, shapes): 2,000 equal layers
#: read the same few objects on every visit, not 2,000 copies scattered in memory. All dropped when full.
_SHARED: dict[object, Any] = {}
_NOT_WRITTEN: _Own = (None, None, 0, "")
_TRIED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[object, ...], int]] = weakref.WeakKeyDictionary()
_TREE: weakref.WeakKeyDictionary[
    nn.Module, tuple[tuple[object, ...], bool, int, tuple[_Node, ...], tuple[_Write, ...]]
] = weakref.WeakKeyDictionary()


def world() -> int:
    """What every kept decision was read from beyond its modules: the registry, the annotations, the forward
    (:data:`packedinit.model.changes.NOW`, which each of them moves)."""
    return NOW[0]


def _meta(p: Tensor) -> _Meta:
    # (the object is compared first, so its type; a Parameter's data cannot become sparse)
    return (p.size(), p.stride(), p.dtype, p.device, p.is_inference())


def changed(p: Tensor, meta: _Meta) -> bool:
    """Whether ``p`` is no longer as :func:`_meta` read it (each part read only while the ones before agree)."""
    size, stride, dtype, device, inference = meta
    return (
        p.size() != size
        or p.stride() != stride
        or p.dtype is not dtype
        or p.device != device
        or p.is_inference() is not inference
    )


def _one(value: _T) -> _T:
    """The object kept for values equal to ``value`` (``value`` itself the first time, or where unhashable)."""
    if len(_SHARED) >= _MAX:
        _SHARED.clear()
    try:
        return _SHARED.setdefault(value, value)  # type: ignore[no-any-return]
    except TypeError:
        return value


def _refused(p: Tensor, mode: bool) -> bool:
    """An inference tensor outside inference mode: lean_call refuses it on every call (never kept)."""
    return p.is_inference() and not mode


def _undescribed(modules: Iterable[nn.Module]) -> bool:
    """No adapter for any of ``modules``' types and no annotation on any of them."""
    return all(registry.lookup(type(m)) is None and not marks.has_annotations(m) for m in modules)


def apply_kept(
    module: nn.Module,
    ancestors: Sequence[nn.Module],
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    later: AbstractSet[int] = frozenset(),
) -> bool:
    """Write ``module``'s own parameters as the kept decision says, if it still holds; False: nothing done.

    ``later``: the ``id`` of each parameter a later visit of the same traversal writes (left out here).
    """
    kept = _APPLY.get(id(module))
    if kept is None:
        return False
    ref, cls, kinds, root, head, mode, was, names, params = kept
    own: dict[str, Tensor | None] = param_dict(module)
    if (
        ref() is not module
        or type(module) is not cls
        or NOW[0] != was
        or root() is not (ancestors[-1] if ancestors else module)
        or (head != (init_fn,) if not args and not kwargs else call_key(init_fn, args, kwargs) != head)
        or (type(ancestors[0]) is not kinds[0] if len(ancestors) == 1 else tuple(map(type, ancestors)) != kinds)
        or torch.is_inference_mode_enabled() is not mode
        or torch.compiler.is_compiling()
    ):
        return False
    held = _still_held(own, names, params)
    if held is None:
        return False
    writes = [(p, label) for p, (_, _, how, label) in held if how == TORCH and id(p) not in later]  # (else SKIP:
    lean_calls(writes, init_fn, args, kwargs)  # a zero-element tensor, nothing to write)
    return True


def _still_held(
    own: Mapping[str, Tensor | None], names: tuple[str, ...], params: tuple[_Own, ...]
) -> list[tuple[Tensor, _Own]] | None:
    """Each written parameter of a kept decision with what was kept of it, where ``own`` (the module's parameters
    now) still has the same names, the same objects as they were (each part read only while the ones before
    agree) and every other one under two dims; None: something changed."""
    if len(own) != len(names):
        return None
    held: list[tuple[Tensor, _Own]] = []
    for (name, p), kname, kept in zip(own.items(), names, params, strict=True):
        kref, meta = kept[0], kept[1]
        if name != kname:
            return None
        if meta is None:  # not written: still None or under two dims
            if p is not None and p.dim() >= 2:
                return None
            continue
        if p is None or kref is None or changed(p, meta) or p is not kref():
            return None
        held.append((p, kept))
    return held


def kept_writes(
    module: nn.Module, root: nn.Module, head: tuple[object, ...], was: int, mode: bool
) -> tuple[_Own, ...] | None:
    """What the decision kept for ``module`` under ``root`` writes, where it was kept for this call, world and
    inference mode and its parameters are still those it read; None: no such decision."""
    kept = _APPLY.get(id(module))
    if kept is None:
        return None
    ref, cls, _, kroot, khead, kmode, kwas, names, params = kept
    if ref() is not module or type(module) is not cls or kroot() is not root or kwas != was or kmode is not mode:
        return None
    if khead != head:
        return None
    held = _still_held(param_dict(module), names, params)
    return None if held is None else tuple(kept for _, kept in held)


def keep_apply(
    module: nn.Module,
    ancestors: Sequence[nn.Module],
    head: tuple[object, ...],
    was: int,
    hows: Mapping[int, int],
    labels: Mapping[int, str],
) -> None:
    """Keep the lean decision just made for ``module`` (``hows``: route by ``id`` of each parameter written),
    where no adapter or annotation took part, nothing in the tree needs the forward and nothing changed meanwhile."""
    root = ancestors[-1] if ancestors else module
    if world() != was or not found.quiet(root) or not _undescribed((module, *ancestors)):
        return
    mode = torch.is_inference_mode_enabled()
    params: list[_Own] = []
    own = param_dict(module)
    for p in own.values():
        if p is not None and id(p) in hows:
            if _refused(p, mode):
                return
            params.append((weakref.ref(p), _one(_meta(p)), hows[id(p)], _one(labels[id(p)])))
        elif p is None or p.dim() < 2:
            params.append(_NOT_WRITTEN)
        else:
            return
    if len(_APPLY) >= _MAX:
        _APPLY.clear()
    _APPLY[id(module)] = (
        weakref.ref(module),
        type(module),
        _one(tuple(map(type, ancestors))),
        weakref.ref(root),
        _one(head),
        mode,
        was,
        _one(tuple(own)),
        tuple(params),
    )


def node(m: nn.Module) -> _Node:
    """What :func:`same_node` compares of ``m`` (held weakly): its type, children and parameters."""
    kids, own = module_dict(m), param_dict(m)
    return (
        weakref.ref(m),
        type(m),
        tuple(kids),
        tuple(map(id, kids.values())),
        tuple(own),
        tuple(None if p is None else weakref.ref(p) for p in own.values()),
        tuple(p is None or p.dim() < 2 for p in own.values()),
    )


def same_node(kept: _Node) -> bool:
    """Whether the module ``kept`` was read from (:func:`node`) is as it was then: type, children, parameters."""
    ref, cls, names, ids, pnames, prefs, low = kept
    m = ref()
    if m is None or type(m) is not cls:
        return False
    kids, own = module_dict(m), param_dict(m)
    if names:
        if tuple(kids) != names or tuple(map(id, kids.values())) != ids:
            return False
    elif kids:  # (a leaf: nothing to build tuples of)
        return False
    if tuple(own) != pnames:
        return False
    for p, r, small in zip(own.values(), prefs, low, strict=True):
        if (p is not None if r is None else r() is not p) or (small and p is not None and p.dim() >= 2):
            return False
    return True


def tree_kept(
    model: nn.Module, init_fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> bool:
    """Initialise ``model`` as the kept decision says, if it still holds (every check first); False: nothing done."""
    kept = _TREE.get(model)
    if kept is None or torch.compiler.is_compiling():
        return False
    found.findings(model)  # traced again first where the record was dropped (found.forget): a new result is a change
    head, mode, was, nodes, writes = kept
    if world() != was or torch.is_inference_mode_enabled() is not mode or call_key(init_fn, args, kwargs) != head:
        return False
    if not all(map(same_node, nodes)):
        return False
    todo: list[tuple[Tensor, str | None]] = []
    for ref, meta, how, name in writes:
        p = ref()
        if p is None or _meta(p) != meta:
            return False
        if how == TORCH:  # (else SKIP: a zero-element tensor, nothing to write)
            todo.append((p, name))
    lean_calls(todo, init_fn, args, kwargs)
    return True


def keep_tree(
    model: nn.Module,
    head: tuple[object, ...] | None,
    was: int,
    entries: Sequence[tuple[str, Tensor, object]],
    steps: Sequence[object],
) -> None:
    """Keep a whole-model decision: ``entries`` as resolved (every one without a layout), ``steps`` as planned
    (every one a lean step whose checks an equal tensor passed), where nothing describes any module."""
    if head is None or world() != was or any(lay is not None for _, _, lay in entries):
        return
    if _TRIED.get(model) != (head, was):  # kept on the second equal call in a row: a model traced again
        _TRIED[model] = (head, was)  # before every call (forget) never pays for keeping what it cannot use
        return
    mode = torch.is_inference_mode_enabled()
    writes: list[_Write] = []
    for step in steps:
        if not isinstance(step, tuple):
            return  # checked on its own this time: kept only once an equal tensor's checks are reused
        how, p, _, _, _, name = step
        if _refused(p, mode):
            return
        writes.append((weakref.ref(p), _meta(p), how, name))
    modules = list(model.modules())
    if not _undescribed(modules):
        return
    _TREE[model] = (head, mode, was, tuple(map(node, modules)), tuple(writes))

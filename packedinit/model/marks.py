"""Where annotations live: on the owning module, found from a bare Parameter through the annotated modules.

:func:`packedinit.annotate` stores ``{leaf name: Layout | None}`` in the owning module's
``__dict__`` and registers the module (held weakly) as an owner. The record survives
``.to(...)``, ``to_empty``, ``copy.deepcopy``, ``load_state_dict`` (``assign=True`` too),
pickling and ``torch.save``/``torch.load`` (a copied or loaded module is registered as it is
made) and FSDP2 ``fully_shard``. :func:`param_layout` answers for a bare Parameter from what
the annotated modules hold *now*: nothing is cached on the Parameter, so a Parameter
assigned to an annotated module later, moved out of one, or replaced, gets the answer the
module-level idioms give; a Parameter that two annotated modules hold under different
layouts is refused, as :func:`packedinit.layouts` refuses it.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn
from torch.nn.utils.parametrize import ParametrizationList

from packedinit.errors import PackedInitError
from packedinit.layout import Layout, fmt_shape
from packedinit.model.changes import bump
from packedinit.torch_compat import param_dict

__all__ = ["ANNOTATIONS", "MARK", "stamp", "annotations_of", "param_layout", "param_claim", "has_annotations"]

#: Where an instance's annotations live in ``module.__dict__``: ``{leaf param name: Layout | None}``.
ANNOTATIONS = "_packedinit_layouts"
#: Where older versions kept a Parameter's own mark (``param.__dict__``); no longer written or read.
MARK = "_packedinit_layout"

#: The annotated modules, by id (weakly: an entry goes when its module goes). A plain dict of weak
#: references, not a WeakSet: a lookup walks it, and iterating a WeakSet costs several times more.
_owners: dict[int, weakref.ref[nn.Module]] = {}
_lock = threading.Lock()


class _Annotations(dict[str, Layout | None]):
    """The annotations of one module; a deep copy or an unpickled copy of the module registers itself too."""

    __slots__ = ("owner", "owner_id")

    def __init__(self, items: Mapping[str, Layout | None], owner: nn.Module) -> None:
        super().__init__(items)
        self.owner_id = id(owner)
        self.owner = weakref.ref(owner)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Annotations | dict[str, Layout | None]:
        new_owner = memo.get(self.owner_id)
        if not isinstance(new_owner, nn.Module):  # a shallow copy of the owner (copy.copy) shares this record
            new_owner = _being_copied(memo)
        if new_owner is None:  # copied on its own, not as part of its module
            return dict(self)
        copied = _Annotations(self, new_owner)
        _register(new_owner)
        return copied

    def __reduce__(self) -> tuple[Any, ...]:
        # The owner is pickled before its state (pickle memoizes an object before its __dict__), so the
        # reference resolves to the loaded module: it is registered as an owner when it is loaded.
        owner = self.owner()
        if owner is None:
            return (dict, (dict(self),))
        return (_revive, (dict(self), owner))


def _being_copied(memo: dict[int, Any]) -> nn.Module | None:
    """The module whose state ``copy.deepcopy`` is copying now, or None.

    ``deepcopy`` puts a module's new, empty instance in ``memo`` before it copies the state (the
    ``__dict__`` holding this record), and a module's children come before the record in its
    ``__dict__``; so it is the latest module in ``memo`` that has no state yet.
    """
    for value in reversed(memo.values()):
        if isinstance(value, nn.Module) and not value.__dict__:
            return value
    return None


def _revive(items: Mapping[str, Layout | None], owner: nn.Module) -> _Annotations:
    """Unpickling: the annotations of a loaded module, which becomes an owner."""
    revived = _Annotations(items, owner)
    _register(owner)
    return revived


def _register(owner: nn.Module) -> None:
    key = id(owner)
    with _lock:
        ref = _owners.get(key)
        if ref is None or ref() is not owner:
            _owners[key] = weakref.ref(owner, functools.partial(_forget, key))


def _forget(key: int, ref: weakref.ref[nn.Module]) -> None:
    with _lock:
        if _owners.get(key) is ref:
            del _owners[key]


def has_annotations(module: nn.Module) -> bool:
    """Whether :func:`packedinit.annotate` stored anything on ``module`` itself."""
    return ANNOTATIONS in module.__dict__


def stamp(owner: nn.Module, new: Mapping[str, Layout | None]) -> None:
    """Record ``new`` (leaf names of ``owner``'s own parameters) on ``owner``, an owner from now on."""
    old: Mapping[str, Layout | None] = owner.__dict__.get(ANNOTATIONS) or {}
    _register(owner)  # first: a lookup that sees the new record also finds its owner
    owner.__dict__[ANNOTATIONS] = _Annotations({**old, **new}, owner)
    bump()  # a decision kept by packedinit.model.kept may have read the old record


def annotations_of(module: nn.Module) -> Mapping[str, Layout | None]:
    """The annotations stored on ``module`` itself (leaf names), or an empty mapping."""
    anns: Mapping[str, Layout | None] | None = module.__dict__.get(ANNOTATIONS)
    return anns or {}


def param_layout(p: Tensor) -> Layout | None:
    """The Layout :func:`packedinit.annotate` gave Parameter ``p`` where an annotated module holds it now, else None.

    Looks among the annotated modules (a few dict lookups per annotated parameter; none at
    all before the first :func:`packedinit.annotate`). Raises :class:`PackedInitError` when
    two annotated modules hold ``p`` (a tied weight) under different layouts.
    """
    return param_claim(p)[0]


def param_claim(p: Tensor) -> tuple[Layout | None, nn.Module | None]:
    """:func:`param_layout` of ``p``, and the annotated ``ParametrizationList`` holding ``p`` (None if none).

    A ``ParametrizationList`` is returned when it holds ``p`` among its originals and an annotation
    on it gives one of them a Layout: ``p`` is then the packed original, or a sibling of it (the
    norm ``g`` of a ``weight_norm``), and the blocks are initialised through the parametrization.
    """
    if not _owners:
        return None, None
    with _lock:
        refs = list(_owners.values())
    found: list[tuple[nn.Module, str, Layout | None]] = []
    holder: nn.Module | None = None
    for ref in refs:
        m = ref()
        anns = m.__dict__.get(ANNOTATIONS) if m is not None else None
        if not anns:
            continue
        params = param_dict(m)  # type: ignore[arg-type]  # m is not None where anns is set
        for leaf in tuple(anns):
            if params.get(leaf) is p:
                found.append((m, leaf, anns.get(leaf)))  # type: ignore[arg-type]  # as above
        packed = holder is None and isinstance(m, ParametrizationList) and any(v is not None for v in anns.values())
        if packed and any(t is p for t in params.values()):
            holder = m
    if not found:
        return None, holder
    first = found[0]
    for other in found[1:]:
        if other[2] != first[2]:
            raise PackedInitError(
                f"parameter of shape {fmt_shape(p.shape)} is held (tied) by two annotated modules with different "
                f"layouts: {first[2]!r} as {type(first[0]).__name__}.{first[1]} and {other[2]!r} as "
                f"{type(other[0]).__name__}.{other[1]}; annotate both holders alike "
                f"(packedinit.annotate(module, name=Layout(...)))."
            )
    return first[2], holder

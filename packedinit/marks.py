"""Where annotations live: on the module (survives everything) and on the parameter (found from a bare tensor).

:func:`packedinit.annotate` stores ``{leaf name: Layout | None}`` in the owning module's
``__dict__`` and marks each annotated Parameter. A module-level record survives
``.to(...)``, ``to_empty``, ``copy.deepcopy``, ``load_state_dict`` and FSDP2
``fully_shard``; a Parameter-level mark does not survive the three that replace Parameter
objects (``to_empty`` from meta, ``deepcopy``, ``fully_shard``). So :func:`param_layout`
re-finds the layout of an unmarked Parameter from the annotated modules (held weakly;
a deep copy of an annotated module is registered as it is made) and marks it again.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from .layout import Layout
from .torch_compat import param_dict

__all__ = ["ANNOTATIONS", "MARK", "stamp", "annotations_of", "param_layout", "has_annotations"]

#: Where an instance's annotations live in ``module.__dict__``: ``{leaf param name: Layout | None}``.
ANNOTATIONS = "_packedinit_layouts"
#: Where a Parameter's own mark lives in ``param.__dict__``: its Layout, or False (looked up: not packed).
MARK = "_packedinit_layout"

_owners: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_lock = threading.Lock()


class _Annotations(dict[str, Layout | None]):
    """The annotations of one module; a deep copy of the module registers the copy as an owner too."""

    __slots__ = ("owner_id",)

    def __init__(self, items: Mapping[str, Layout | None], owner: nn.Module) -> None:
        super().__init__(items)
        self.owner_id = id(owner)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Annotations | dict[str, Layout | None]:
        new_owner = memo.get(self.owner_id)
        if not isinstance(new_owner, nn.Module):  # copied on its own, not as part of its module
            return dict(self)
        copied = _Annotations(self, new_owner)
        _register(new_owner)
        return copied

    def __reduce__(self) -> tuple[Any, ...]:  # pickled as a plain dict: weak ownership is per process
        return (dict, (dict(self),))


def _register(owner: nn.Module) -> None:
    with _lock:
        _owners.add(owner)


def has_annotations(module: nn.Module) -> bool:
    """Whether :func:`packedinit.annotate` stored anything on ``module`` itself."""
    return ANNOTATIONS in module.__dict__


def stamp(owner: nn.Module, new: Mapping[str, Layout | None]) -> None:
    """Record ``new`` (leaf names of ``owner``'s own parameters) on ``owner`` and mark those Parameters."""
    old: Mapping[str, Layout | None] = owner.__dict__.get(ANNOTATIONS) or {}
    owner.__dict__[ANNOTATIONS] = _Annotations({**old, **new}, owner)
    _register(owner)
    for leaf, layout in new.items():
        p = param_dict(owner).get(leaf)
        if p is not None:
            p.__dict__[MARK] = layout if layout is not None else False


def annotations_of(module: nn.Module) -> Mapping[str, Layout | None]:
    """The annotations stored on ``module`` itself (leaf names), or an empty mapping."""
    anns: Mapping[str, Layout | None] | None = module.__dict__.get(ANNOTATIONS)
    return anns or {}


def param_layout(p: Tensor) -> Layout | None:
    """The Layout :func:`packedinit.annotate` gave Parameter ``p`` (also after it was replaced), else None.

    Unmarked Parameters are looked up once among the annotated modules and marked with the
    answer (False: not packed), so a loop over ``model.parameters()`` pays the lookup once.
    """
    d = getattr(p, "__dict__", None)
    if d is None:
        return None
    mark = d.get(MARK)
    if mark is None:
        if not _owners:
            return None
        mark = False
        with _lock:
            owners = list(_owners)
        for m in owners:
            for leaf, layout in annotations_of(m).items():
                if param_dict(m).get(leaf) is p:
                    mark = layout if layout is not None else False
                    break
            if mark is not False:
                break
        d[MARK] = mark
    return mark if isinstance(mark, Layout) else None

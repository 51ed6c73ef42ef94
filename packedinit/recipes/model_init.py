"""The model library's own init entry point, found by class path or named by the user.

A model built on the meta device comes out of ``to_empty`` with uninitialised memory;
``reset_parameters`` re-runs torch's defaults, but a library's model also runs its own init
at (or right after) construction: timm's ``VisionTransformer.init_weights()``, torchtitan's
``init_weights(buffer_device=...)`` / ``init_states``, open_clip's ``init_parameters()``,
x-transformers' ``init_()`` (transformers' ``_init_weights`` is handled in
:mod:`packedinit.recipes.reset`). :func:`entry_points` says which of them to run, on which
module, after torch's defaults of that module's subtree (the order construction ran them in).
No library is imported: modules are recognised by class path and only their own methods run.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import types
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass

from torch import nn

from packedinit.errors import PackedInitError

__all__ = ["EntryPoint", "ModelInit", "entry_points", "in_entry_point"]

#: What a user may name: a method name of the model (``"init_weights"``) or a function of the model.
ModelInit = str | Callable[[nn.Module], object] | None


@dataclass(frozen=True)
class EntryPoint:
    """One init entry point: ``run()`` calls it on ``module``; ``name`` is how messages name it."""

    module: nn.Module
    name: str
    run: Callable[[], object]


@dataclass(frozen=True)
class _Library:
    """A library's entry point: classes whose module starts with ``prefix``, method one of ``methods``."""

    library: str
    prefix: str
    methods: tuple[str, ...]  # the first one the module has is run
    #: True: run on every module whose constructor calls it (as construction did), children first;
    #: False: the library's flow calls it after construction, on the model: run on the outermost holder
    by_constructor: bool


_LIBRARIES = (
    _Library("torchtitan", "torchtitan.", ("init_states", "init_weights"), False),
    _Library("timm", "timm.", ("init_weights",), True),
    _Library("open_clip", "open_clip.", ("init_parameters",), True),
    _Library("x-transformers", "x_transformers.", ("init_",), True),
)
#: Method names of the entry points, for the construction recorder (:func:`in_entry_point`).
_METHODS = frozenset(m for lib in _LIBRARIES for m in lib.methods)


#: class -> {pattern: whether its constructor's source has it}; weak, so that no class is kept alive
_CALLS: weakref.WeakKeyDictionary[type, dict[str, bool]] = weakref.WeakKeyDictionary()


def _constructor_calls(cls: type, method: str) -> bool:
    """Does an ``__init__`` in ``cls``'s MRO call (or hand on) ``self.<method>``? (No source: assume it does.)"""
    return _constructor_has(cls, rf"\bself\.{method}\b")  # called, or handed on (named_apply(partial(self.m)))


def _constructor_has(cls: type, pattern: str) -> bool:
    known = _CALLS.setdefault(cls, {})
    if pattern not in known:
        known[pattern] = _search(cls, pattern)
    return known[pattern]


def _search(cls: type, pattern: str) -> bool:
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or klass is nn.Module or klass is object:
            continue
        try:
            source = inspect.getsource(init)
        except (OSError, TypeError):
            return True
        if re.search(pattern, source):
            return True
    return False


def _bare(fn: Callable[..., object]) -> bool:
    """Callable without arguments (``init_(self, m)`` of x-transformers' up-wrapper is no entry point)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _entry_method(m: nn.Module) -> tuple[_Library, str] | None:
    """The library and method of ``m``'s entry point (whatever its position in the model), or None."""
    path = type(m).__module__ + "."
    for lib in _LIBRARIES:
        if not path.startswith(lib.prefix):
            continue
        for name in lib.methods:
            fn = getattr(m, name, None)
            if callable(fn) and _bare(fn):
                if lib.by_constructor and not _constructor_calls(type(m), name):
                    return None
                return lib, name
    return None


def _call(m: nn.Module, method: str) -> Callable[[], object]:
    """The bound call with the arguments the library's own flow passes (after torch's defaults ran)."""
    fn = getattr(m, method)
    try:
        params: Collection[str] = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): called bare
        params = ()
    kwargs: dict[str, object] = {}
    if "buffer_device" in params:  # torchtitan: buffers (RoPE caches) on the parameters' device
        kwargs["buffer_device"] = None
    if "needs_reset" in params:  # timm ViT: modules' own reset_parameters() already ran
        kwargs["needs_reset"] = False
    return functools.partial(fn, **kwargs)


def _known(model: nn.Module, filled: Collection[int]) -> list[EntryPoint]:
    found: list[EntryPoint] = []

    def visit(m: nn.Module, outer: frozenset[str]) -> None:
        hit = _entry_method(m)
        if hit is not None and hit[0].library not in outer:
            lib, method = hit
            found.append(EntryPoint(m, f"{lib.library}'s {type(m).__name__}.{method}()", _call(m, method)))
            if not lib.by_constructor:
                outer = outer | {lib.library}  # it recurses into the descendants itself
        for child in m.children():
            visit(child, outer)

    visit(model, frozenset())
    _refuse_unkept_scheme(model, found, filled)
    return [*found, *_clip_text_towers(model)]


def _clip_text_towers(model: nn.Module) -> list[EntryPoint]:
    """open_clip's ``CLIP`` keeps the parts of the ``TextTransformer`` it builds, not the tower itself.

    That tower's ``init_parameters()`` initialised them at construction (``token_embedding``
    std 0.02, the blocks' scaled normals, ``text_projection``); it is run on the parts
    (``cls_emb``, which ``CLIP`` does not keep, as None). Runs last, as construction did
    (the towers are built before the rest of ``CLIP``'s own modules are assigned).
    """
    tower = getattr(sys.modules.get("open_clip.transformer"), "TextTransformer", None)
    init = getattr(tower, "init_parameters", None)
    found: list[EntryPoint] = []
    if not callable(init):
        return found
    for m in model.modules():
        if not type(m).__module__.startswith("open_clip.") or callable(getattr(m, "init_parameters", None)):
            continue
        parts = ("token_embedding", "positional_embedding", "transformer", "text_projection")
        if not all(hasattr(m, p) for p in parts) or not _constructor_has(type(m), r"\btext\.token_embedding\b"):
            continue
        text = types.SimpleNamespace(cls_emb=None, **{p: getattr(m, p) for p in parts})
        found.append(EntryPoint(m, "open_clip's TextTransformer.init_parameters() on CLIP's text parts",
                                functools.partial(init, text)))
    return found


def _refuse_unkept_scheme(model: nn.Module, found: list[EntryPoint], filled: Collection[int]) -> None:
    """timm models that init their blocks with a scheme they do not keep (maxxvit): refused by name.

    Unless the construction's own calls were recorded (``deferred()``): they fill those blocks.
    """
    for m in model.modules():
        if not type(m).__module__.startswith("timm.") or callable(getattr(m, "init_weights", None)):
            continue
        if not callable(getattr(m, "_init_weights", None)) or not _constructor_calls(type(m), "_init_weights"):
            continue
        blocks = [(n, c) for n, c in m.named_modules() if c is not m and callable(getattr(c, "init_weights", None))]
        if any(id(p) in filled for _, c in blocks for p in c.parameters()):
            continue
        if blocks and not any(e.module is m for e in found):
            names = [n for n, _ in blocks]
            raise PackedInitError(
                f"reset_parameters({type(model).__name__}): timm's {type(m).__name__} initialises its blocks at "
                f"construction by named_apply(partial(self._init_weights, scheme=cfg.weight_init), self), and the "
                f"scheme is not kept on the model, so packedinit cannot run that init; {len(names)} block(s) "
                f"({', '.join(map(repr, names[:3]))}{', ...' if len(names) > 3 else ''}) would keep torch's "
                f"defaults instead. Nothing was written. Fix: name it, e.g. reset_parameters(model, model_init="
                f"lambda m: timm.models.named_apply(functools.partial(m._init_weights, scheme='normal'), m)) with "
                f"your config's weight_init, or build the model inside packedinit.deferred()."
            )


def entry_points(
    model: nn.Module, model_init: ModelInit = None, *, where: str = "reset_parameters", filled: Collection[int] = ()
) -> list[EntryPoint]:
    """The entry points to run, each after torch's defaults of its module's subtree.

    ``model_init``: ``None`` finds the libraries' entry points (see the module docstring); a
    method name runs ``model.<name>()``; a callable runs ``model_init(model)``; ``""`` runs
    none. Refuses (before any write) a named method the model does not have.
    ``filled``: ids of the tensors the construction's recorded calls fill (``deferred()``).
    """
    if model_init is None:
        return _known(model, set(filled))
    if isinstance(model_init, str):
        if not model_init:
            return []
        fn = getattr(model, model_init, None)
        if not callable(fn):
            raise PackedInitError(
                f"{where}({type(model).__name__}, model_init={model_init!r}): the model has no method "
                f"{model_init!r}, so its own init cannot run; nothing was written. Fix: name a method of "
                f"{type(model).__name__}, or pass a function of the model (model_init=lambda m: ...)."
            )
        return [EntryPoint(model, f"{type(model).__name__}.{model_init}()", _call(model, model_init))]
    if not callable(model_init):
        raise PackedInitError(
            f"{where}(model_init=...): needs a method name or a function of the model, got "
            f"{type(model_init).__name__}."
        )
    name = getattr(model_init, "__qualname__", None) or type(model_init).__name__
    return [EntryPoint(model, f"model_init {name}", functools.partial(model_init, model))]


def in_entry_point(frame: types.FrameType | None) -> bool:
    """Is ``frame`` (or a caller of it) a known library entry point running on its own module?

    The construction recorder (``deferred()``) leaves their calls out: ``reset_parameters``
    runs the entry point itself.
    """
    f = frame
    while f is not None:
        if f.f_code.co_name in _METHODS:
            owner = f.f_locals.get("self")
            hit = _entry_method(owner) if isinstance(owner, nn.Module) else None
            if hit is not None and hit[1] == f.f_code.co_name:
                return True
        f = f.f_back
    return False

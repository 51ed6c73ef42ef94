"""Adapters: which parameters of a module are packed, and how.

An *adapter* is a function ``fn(module) -> {parameter name: Layout}`` registered for a
module type (or for a class path string, so that third-party classes are matched without
importing their package). Lookup follows the MRO, so subclasses, and FSDP2's dynamically
created ``FSDP<Name>`` classes, are covered. :func:`annotate` marks a single instance and
beats any adapter. :func:`layouts` resolves a whole model once.

What adapters and annotations say about a given model (``layouts``, ``annotate``) is
:mod:`packedinit.model.claims`. Built-in adapters (:mod:`packedinit.adapters`) are registered
lazily, on the first lookup, registration or listing, through the loader the package installs with
:func:`set_builtin_loader` (the registry never imports the adapters: they import it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeAlias, TypeVar, overload

from torch import nn

from packedinit.errors import PackedInitError
from packedinit.layout import Layout
from packedinit.model.changes import bump

__all__ = [
    "Adapter",
    "Key",
    "register",
    "unregister",
    "registered",
    "lookup",
    "class_path",
    "key_name",
    "adapter_name",
    "ensure_builtins",
    "set_builtin_loader",
]

#: An adapter: ``fn(module) -> {param name relative to module: Layout}``.
Adapter: TypeAlias = Callable[[nn.Module], Mapping[str, Layout]]
A = TypeVar("A", bound=Adapter)
#: What an adapter is registered for: a module type, or a class path ``"pkg.mod.Class"``.
Key: TypeAlias = type[nn.Module] | str
Mod = TypeVar("Mod", bound=nn.Module)


# -- the table ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Table:
    """An immutable snapshot of the registry; every change builds a new one (copy on write)."""

    types: Mapping[type[nn.Module], Adapter]
    paths: Mapping[str, Adapter]
    view: Mapping[Key, Adapter]
    # Per-class lookup results for this snapshot only; a new snapshot starts empty, so it never goes stale.
    cache: dict[type, tuple[Key, Adapter] | None] = field(default_factory=dict, compare=False)


def _table_of(types: Mapping[type[nn.Module], Adapter], paths: Mapping[str, Adapter]) -> _Table:
    view: dict[Key, Adapter] = {k: v for k, v in types.items()}  # a comprehension widens the key type
    view.update(paths.items())
    return _Table(MappingProxyType(dict(types)), MappingProxyType(dict(paths)), MappingProxyType(view))


_lock = threading.RLock()
_table = _table_of({}, {})


def _install(table: _Table) -> None:
    """Make ``table`` the registry, then say so (:mod:`packedinit.model.changes`: kept decisions read it)."""
    global _table
    _table = table
    bump()


_builtins_loaded = False
_builtins_loader: int | None = None  # thread id while the built-ins are being registered
_builtin_loader: Callable[[], None] | None = None


def set_builtin_loader(loader: Callable[[], None]) -> None:
    """Install the function that registers the built-in adapters on first use (``packedinit`` does this)."""
    global _builtin_loader
    _builtin_loader = loader


def ensure_builtins() -> None:
    """Register :mod:`packedinit.adapters` once (re-entrant for the loading thread)."""
    global _builtins_loaded, _builtins_loader
    loader = _builtin_loader
    if _builtins_loaded or _builtins_loader == threading.get_ident() or loader is None:
        return
    with _lock:
        if _builtins_loaded:
            return
        _builtins_loader = threading.get_ident()
        before = _table
        try:
            loader()
            _builtins_loaded = True
        except BaseException:
            _install(before)  # all or nothing: a failed load leaves no half-registered built-ins
            raise
        finally:
            _builtins_loader = None


def class_path(cls: type) -> str:
    """``"module.QualName"``: what a string key of :func:`register` is matched against."""
    return f"{cls.__module__}.{cls.__qualname__}"


def key_name(key: Key) -> str:
    """A key as text: the class path, or the string itself."""
    return key if isinstance(key, str) else class_path(key)


def _check_key(key: object) -> Key:
    if isinstance(key, str):
        if "." not in key or key.startswith(".") or key.endswith(".") or " " in key:
            raise PackedInitError(
                f"register({key!r}): a string key must be a full class path 'package.module.ClassName', "
                f"e.g. 'transformers.models.gpt2.modeling_gpt2.GPT2Attention'."
            )
        return key
    if isinstance(key, type) and issubclass(key, nn.Module):
        return key
    raise PackedInitError(
        f"register({key!r}): the key must be an nn.Module subclass or a class path string, "
        f"got {type(key).__name__}."
    )


def adapter_name(fn: object) -> str:
    """``module.QualName`` of an adapter, for messages."""
    mod = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}.{name}" if mod else str(name)


@overload
def register(
    key: type[Mod], *, replace: bool = False
) -> Callable[[Callable[[Mod], Mapping[str, Layout]]], Callable[[Mod], Mapping[str, Layout]]]: ...


@overload
def register(key: str, *, replace: bool = False) -> Callable[[A], A]: ...


def register(key: Key, *, replace: bool = False) -> Callable[[Any], Any]:
    """Register an adapter for a module type or a class path; use as a decorator.

    The adapter is called with a module instance and returns ``{name: Layout}`` for
    the packed parameters it knows, names relative to that module (``"weight"``, or a
    descendant's ``"qkv.weight"``). Parameters it does not name are not packed.

    Lookup walks the module's MRO, most derived class first; at each class an entry
    for the type itself is tried before one for its class path string
    ``f"{cls.__module__}.{cls.__qualname__}"``. A string key lets you describe a
    third-party class (a transformers attention, a timm block) without importing it.

    Args:
        key: an ``nn.Module`` subclass, or a class path ``"package.module.ClassName"``.
        replace: allow replacing an adapter already registered for ``key``.

    Returns:
        A decorator that registers its argument and returns it unchanged.

    Raises:
        PackedInitError: ``key`` is neither a Module subclass nor a class path, the
            adapter is not callable, or ``key`` already has an adapter and
            ``replace`` is False.

    Examples:
        >>> import torch
        >>> from packedinit import layouts
        >>> class FusedQKV(torch.nn.Module):
        ...     def __init__(self, d: int) -> None:
        ...         super().__init__()
        ...         self.d = d
        ...         self.qkv = torch.nn.Linear(d, 3 * d)
        >>> @register(FusedQKV)
        ... def _fused_qkv(m: FusedQKV) -> dict[str, Layout]:
        ...     qkv = Layout(0, [m.d] * 3, names=("q", "k", "v"))
        ...     return {"qkv.weight": qkv, "qkv.bias": qkv}
        >>> layouts(FusedQKV(4))["qkv.weight"]
        Layout(dim=0, sizes=(4, 4, 4), names=('q', 'k', 'v'))
        >>> unregister(FusedQKV) is _fused_qkv
        True
    """
    checked = _check_key(key)
    if not isinstance(replace, bool):
        raise PackedInitError(f"register({key_name(checked)!r}, replace={replace!r}): replace must be a bool.")

    def decorator(adapter: Any) -> Any:
        if not callable(adapter):
            raise PackedInitError(
                f"register({key_name(checked)!r}) decorates {adapter!r}, which is not callable; "
                f"an adapter is fn(module) -> {{param name: Layout}}."
            )
        ensure_builtins()
        with _lock:
            t = _table
            old = t.paths.get(checked) if isinstance(checked, str) else t.types.get(checked)
            if old is not None and not replace:
                raise PackedInitError(
                    f"register({key_name(checked)!r}): {adapter_name(old)} is already registered for it; "
                    f"pass replace=True to replace it, or unregister({key_name(checked)!r}) first."
                )
            if isinstance(checked, str):
                _install(_table_of(t.types, {**t.paths, checked: adapter}))
            else:
                _install(_table_of({**t.types, checked: adapter}, t.paths))
        return adapter

    return decorator


def unregister(key: Key) -> Adapter | None:
    """Remove the adapter registered for exactly ``key``; return it (``None`` if there was none).

    Subclasses and other keys are not affected; a built-in adapter can be removed too.

    Examples:
        >>> import torch
        >>> from packedinit import layouts
        >>> mha = unregister(torch.nn.MultiheadAttention)
        >>> layouts(torch.nn.MultiheadAttention(8, 2))
        {}
        >>> _ = register(torch.nn.MultiheadAttention)(mha)
    """
    checked = _check_key(key)
    ensure_builtins()
    with _lock:
        t = _table
        if isinstance(checked, str):
            if checked not in t.paths:
                return None
            paths = dict(t.paths)
            removed = paths.pop(checked)
            _install(_table_of(t.types, paths))
        else:
            if checked not in t.types:
                return None
            types = dict(t.types)
            removed = types.pop(checked)
            _install(_table_of(types, t.paths))
        return removed


def registered() -> Mapping[Key, Adapter]:
    """A read-only snapshot of every registered adapter (built-ins included), by key.

    Examples:
        >>> import torch
        >>> from packedinit.adapters import torch_nn
        >>> registered()[torch.nn.LSTM] is torch_nn.rnn_layouts
        True
    """
    ensure_builtins()
    return _table.view


def lookup(cls: type[nn.Module]) -> tuple[Key, Adapter] | None:
    """The ``(key, adapter)`` that applies to module class ``cls`` (MRO order), or ``None``.

    Examples:
        >>> import torch
        >>> class MyLSTM(torch.nn.LSTM):
        ...     pass
        >>> lookup(MyLSTM)[0]
        <class 'torch.nn.modules.rnn.LSTM'>
    """
    ensure_builtins()
    t = _table
    try:
        return t.cache[cls]
    except KeyError:
        pass
    found: tuple[Key, Adapter] | None = None
    if t.types or t.paths:
        for c in cls.__mro__:
            ad = t.types.get(c)
            if ad is not None:
                found = (c, ad)
                break
            if t.paths:
                path = class_path(c)
                ad = t.paths.get(path)
                if ad is not None:
                    found = (path, ad)
                    break
    t.cache[cls] = found
    return found

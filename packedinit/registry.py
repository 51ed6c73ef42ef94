"""Adapters: which parameters of a module are packed, and how.

An *adapter* is a function ``fn(module) -> {parameter name: Layout}`` registered for a
module type (or for a class path string, so that third-party classes are matched without
importing their package). Lookup follows the MRO, so subclasses, and FSDP2's dynamically
created ``FSDP<Name>`` classes, are covered. :func:`annotate` marks a single instance and
beats any adapter. :func:`layouts` resolves a whole model once.

Built-in adapters (:mod:`packedinit.adapters`) are registered lazily, on the first lookup,
registration or listing, through the loader the package installs with
:func:`set_builtin_loader` (the registry never imports the adapters: they import it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeAlias, TypeVar, overload

from torch import Tensor, nn

from .errors import PackedInitError
from .layout import Layout, fmt_shape
from .marks import ANNOTATIONS, has_annotations, stamp
from .marks import annotations_of as stored_annotations

__all__ = [
    "Adapter",
    "register",
    "unregister",
    "registered",
    "annotate",
    "layouts",
    "lookup",
    "class_path",
    "annotations_of",
    "resolve",
    "own_layouts",
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
_builtins_loaded = False
_builtins_loader: int | None = None  # thread id while the built-ins are being registered
_builtin_loader: Callable[[], None] | None = None


def set_builtin_loader(loader: Callable[[], None]) -> None:
    """Install the function that registers the built-in adapters on first use (``packedinit`` does this)."""
    global _builtin_loader
    _builtin_loader = loader


def _ensure_builtins() -> None:
    """Register :mod:`packedinit.adapters` once (re-entrant for the loading thread)."""
    global _builtins_loaded, _builtins_loader, _table
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
            _table = before  # all or nothing: a failed load leaves no half-registered built-ins
            raise
        finally:
            _builtins_loader = None


def class_path(cls: type) -> str:
    """``"module.QualName"``: what a string key of :func:`register` is matched against."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _key_name(key: Key) -> str:
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


def _adapter_name(fn: object) -> str:
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
        raise PackedInitError(f"register({_key_name(checked)!r}, replace={replace!r}): replace must be a bool.")

    def decorator(adapter: Any) -> Any:
        global _table
        if not callable(adapter):
            raise PackedInitError(
                f"register({_key_name(checked)!r}) decorates {adapter!r}, which is not callable; "
                f"an adapter is fn(module) -> {{param name: Layout}}."
            )
        _ensure_builtins()
        with _lock:
            t = _table
            old = t.paths.get(checked) if isinstance(checked, str) else t.types.get(checked)
            if old is not None and not replace:
                raise PackedInitError(
                    f"register({_key_name(checked)!r}): {_adapter_name(old)} is already registered for it; "
                    f"pass replace=True to replace it, or unregister({_key_name(checked)!r}) first."
                )
            if isinstance(checked, str):
                _table = _table_of(t.types, {**t.paths, checked: adapter})
            else:
                _table = _table_of({**t.types, checked: adapter}, t.paths)
        return adapter

    return decorator


def unregister(key: Key) -> Adapter | None:
    """Remove the adapter registered for exactly ``key``; return it (``None`` if there was none).

    Subclasses and other keys are not affected; a built-in adapter can be removed too.

    Examples:
        >>> import torch
        >>> mha = unregister(torch.nn.MultiheadAttention)
        >>> layouts(torch.nn.MultiheadAttention(8, 2))
        {}
        >>> _ = register(torch.nn.MultiheadAttention)(mha)
    """
    global _table
    checked = _check_key(key)
    _ensure_builtins()
    with _lock:
        t = _table
        if isinstance(checked, str):
            if checked not in t.paths:
                return None
            paths = dict(t.paths)
            removed = paths.pop(checked)
            _table = _table_of(t.types, paths)
        else:
            if checked not in t.types:
                return None
            types = dict(t.types)
            removed = types.pop(checked)
            _table = _table_of(types, t.paths)
        return removed


def registered() -> Mapping[Key, Adapter]:
    """A read-only snapshot of every registered adapter (built-ins included), by key.

    Examples:
        >>> import torch
        >>> from packedinit.adapters import torch_nn
        >>> registered()[torch.nn.LSTM] is torch_nn.rnn_layouts
        True
    """
    _ensure_builtins()
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
    _ensure_builtins()
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


# -- claims: what adapters and annotations say about parameters --------------------------------
@dataclass(frozen=True)
class _Claim:
    param: Tensor
    layout: Layout | None  # None: an annotation saying "not packed"
    annotation: bool
    source: str  # for messages: "adapter X for T at module 'a.b'" / "annotation on module 'a.b'"


def _where_module(path: str) -> str:
    return f"module {path!r}" if path else "the root module"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _own_param(module: nn.Module, name: str) -> Tensor | None:
    """``module.get_parameter(name)`` for dotted names, or ``None`` when there is no such parameter."""
    owner = module
    *mods, leaf = name.split(".")
    for m in mods:
        sub = owner._modules.get(m)
        if sub is None:
            return None
        owner = sub
    return owner._parameters.get(leaf)


def _param_names(module: nn.Module) -> str:
    names = [n for n, _ in module.named_parameters()]
    shown = ", ".join(repr(n) for n in names[:12]) + (", ..." if len(names) > 12 else "")
    return f"[{shown}]"


def _checked(
    module: nn.Module, path: str, name: object, layout: object, source: str, *, allow_none: bool
) -> tuple[Tensor, Layout | None]:
    cls = type(module).__name__
    if not isinstance(name, str):
        raise PackedInitError(f"{source} returned the key {name!r}; parameter names must be strings.")
    p = _own_param(module, name)
    fqn = _join(path, name)
    if p is None:
        raise PackedInitError(
            f"{source} claims parameter {name!r} ({fqn!r}), which {cls} does not have "
            f"(its parameters: {_param_names(module)}); fix the adapter's names or its registered class."
        )
    if layout is None and allow_none:
        return p, None
    if not isinstance(layout, Layout):
        raise PackedInitError(
            f"{source} gives {type(layout).__name__} {layout!r} for parameter {fqn!r} of shape "
            f"{fmt_shape(p.shape)}; give a packedinit.Layout, e.g. Layout(0, [E, E, E])."
        )
    try:
        layout.check(p.shape, param=fqn)
    except PackedInitError as e:
        raise PackedInitError(f"{source}: {e}") from None
    return p, layout


def _claims(module: nn.Module, path: str, where: str | None = None, *, annotations: bool = True) -> Iterator[_Claim]:
    """Annotations on ``module``, then its adapter's claims, each checked against the parameter.

    ``path`` prefixes parameter names in messages; ``where`` describes the module
    (default: its path).
    """
    where = where or _where_module(path)
    anns: Mapping[str, Layout | None] | None = module.__dict__.get(ANNOTATIONS) if annotations else None
    if anns:
        source = f"annotation on {where} ({type(module).__name__})"
        for name, layout in anns.items():
            p, lay = _checked(module, path, name, layout, source, allow_none=True)
            yield _Claim(p, lay, True, source)
    found = lookup(type(module))
    if found is None:
        return
    key, adapter = found
    source = f"adapter {_adapter_name(adapter)} (registered for {_key_name(key)}) at {where}"
    try:
        mapping = adapter(module)
    except PackedInitError as e:
        raise PackedInitError(f"{source}: {e}") from None
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(f"raised by {source}")
        raise
    if not isinstance(mapping, Mapping):
        raise PackedInitError(f"{source} returned {type(mapping).__name__}; an adapter returns {{name: Layout}}.")
    for name, layout in mapping.items():
        p, lay = _checked(module, path, name, layout, source, allow_none=False)
        yield _Claim(p, lay, False, source)


def _decide(claims: list[_Claim], fqn: str) -> Layout | None:
    """One layout per parameter: annotations beat adapters; disagreement within a kind is an error."""
    anns = [c for c in claims if c.annotation]
    pool = anns or claims
    first = pool[0]
    for other in pool[1:]:
        if other.layout != first.layout:
            raise PackedInitError(
                f"parameter {fqn!r} of shape {fmt_shape(first.param.shape)} gets two different layouts: "
                f"{first.layout!r} from {first.source} and {other.layout!r} from {other.source}; "
                f"annotate the instance to choose (packedinit.annotate(module, name=Layout(...)))."
            )
    return first.layout


def resolve(model: nn.Module) -> list[tuple[str, Tensor, Layout | None]]:
    """Every distinct parameter of ``model`` in ``named_parameters()`` order, with its layout or None."""
    _ensure_builtins()
    cache = _table.cache
    order: dict[int, tuple[str, Tensor]] = {}
    claimed: dict[int, list[_Claim]] = {}
    for prefix, m in model.named_modules():
        params = m._parameters
        if params:
            dot = prefix + "." if prefix else ""
            for name, p in params.items():
                if p is not None and id(p) not in order:
                    order[id(p)] = (dot + name, p)
        cls = type(m)
        has_adapter = cache[cls] is not None if cls in cache else lookup(cls) is not None
        if has_adapter or has_annotations(m):
            for c in _claims(m, prefix):
                claimed.setdefault(id(c.param), []).append(c)
    if not claimed:
        return [(n, p, None) for n, p in order.values()]
    return [(n, p, _decide(claimed[k], n) if k in claimed else None) for k, (n, p) in order.items()]


def layouts(model: nn.Module) -> dict[str, Layout]:
    """Every packed parameter of ``model`` by fully qualified name, resolved once.

    Each module's adapter (found by MRO) and annotations are read; an adapter may
    describe its descendants' parameters (``"attn.qkv.weight"``). An instance
    annotation beats every adapter (``annotate(m, weight=None)`` marks a parameter
    as not packed). Tied parameters appear once, under the name
    ``model.named_parameters()`` gives them first; the dict is in that order.

    Args:
        model: any module.

    Returns:
        ``{qualified name: Layout}`` of the packed parameters only.

    Raises:
        PackedInitError: an adapter or annotation names a parameter that does not
            exist, gives something that is not a Layout, or a Layout that does not
            fit the parameter's shape (the message names the adapter, the module
            path, the parameter and its shape); or two adapters disagree.

    Examples:
        >>> import torch
        >>> enc = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2)
        >>> for name, layout in layouts(enc).items():
        ...     print(name, layout)
        self_attn.in_proj_weight Layout(dim=0, sizes=(8, 8, 8), names=('q', 'k', 'v'))
        self_attn.in_proj_bias Layout(dim=0, sizes=(8, 8, 8), names=('q', 'k', 'v'))
    """
    if not isinstance(model, nn.Module):
        raise PackedInitError(f"layouts(model) needs an nn.Module, got {type(model).__name__}.")
    return {name: layout for name, _, layout in resolve(model) if layout is not None}


def annotate(module: Mod, **param_layouts: Layout | None) -> Mod:
    """Mark packed parameters of one module instance; with no keywords, stamp every known one.

    ``annotate(m, weight=Layout(...))`` records that ``m.weight`` is packed. The
    annotation is stored on the module object, so it survives ``m.to(...)``,
    ``m.to_empty(...)``, ``copy.deepcopy``, ``load_state_dict`` and FSDP2 ``fully_shard``,
    and each annotated Parameter is marked: afterwards ``chunked(f)(m.weight)`` on the
    bare parameter is per block, as are the idioms that hand parameters one at a time
    (a ``for p in model.parameters()`` loop, an ``_init_weights(module)`` run through
    ``model.apply``). A Parameter replaced later (``to_empty`` from meta, a deep copy,
    ``fully_shard``) is found again through its module. Without any annotation a bare
    tensor is one block, exactly as ``torch.nn.init`` sees it.
    It beats any registered adapter; ``None`` marks a parameter as *not* packed.
    A dotted name (``**{"qkv.weight": layout}``) is stored on the submodule that
    owns the parameter. Every layout is checked against the parameter's shape
    before anything is recorded.

    With no keywords, every packed parameter :func:`layouts` finds is stamped on the
    module that owns it. Then ``model.apply(chunked(f))`` and any code that looks
    at one module at a time see layouts that an ancestor's adapter describes.

    Args:
        module: the module instance.
        **param_layouts: ``name=Layout`` (or ``None``) per parameter, relative to ``module``.

    Returns:
        ``module`` itself.

    Raises:
        PackedInitError: a parameter does not exist, or a Layout does not fit its shape.

    Examples:
        >>> import torch
        >>> from packedinit import chunked
        >>> qkv = torch.nn.Linear(16, 48)  # a timm-style fused qkv projection
        >>> _ = annotate(qkv, weight=Layout(0, [16, 16, 16]), bias=Layout(0, [16, 16, 16]))
        >>> chunked(torch.nn.init.xavier_uniform_)(qkv)
        >>> bool(qkv.weight.abs().max() <= (6 / 32) ** 0.5)
        True
        >>> annotate(qkv, weight=Layout(0, [16, 16]))
        Traceback (most recent call last):
        ...
        packedinit.errors.PackedInitError: annotate(Linear, ...): parameter 'weight' of shape (48, 16) with ...
    """
    if not isinstance(module, nn.Module):
        raise PackedInitError(f"annotate(module, ...) needs an nn.Module, got {type(module).__name__}.")
    stamps: dict[int, tuple[nn.Module, dict[str, Layout | None]]] = {}
    if param_layouts:
        source = f"annotate({type(module).__name__}, ...)"
        for name, layout in param_layouts.items():
            _checked(module, "", name, layout, source, allow_none=True)
            *mods, leaf = name.split(".")
            owner = module.get_submodule(".".join(mods)) if mods else module
            stamps.setdefault(id(owner), (owner, {}))[1][leaf] = layout
    else:
        owners = {id(p): (m, n) for m in module.modules() for n, p in m._parameters.items() if p is not None}
        for _, p, layout in resolve(module):
            if layout is not None:
                owner, leaf = owners[id(p)]
                stamps.setdefault(id(owner), (owner, {}))[1][leaf] = layout
    for owner, new in stamps.values():
        stamp(owner, new)
    return module


def annotations_of(module: nn.Module) -> Mapping[str, Layout | None]:
    """The annotations :func:`annotate` stored on ``module`` itself (read-only, leaf names)."""
    return MappingProxyType(dict(stored_annotations(module)))


def own_layouts(module: nn.Module, ancestors: Sequence[nn.Module]) -> dict[int, Layout | None]:
    """Layouts of ``module``'s own parameters (``recurse=False``), keyed by ``id(param)``.

    Sources: ``module``'s annotations and adapter, and the adapters of ``ancestors``
    (which may describe a descendant's parameters). Only claimed parameters appear.
    """
    _ensure_builtins()
    cache = _table.cache
    sources = [
        (i, m)
        for i, m in enumerate((module, *ancestors))
        if (i == 0 and has_annotations(m))
        or (cache[type(m)] is not None if type(m) in cache else lookup(type(m)) is not None)
    ]
    if not sources:
        return {}
    own = {id(p): n for n, p in module._parameters.items() if p is not None}
    claimed: dict[int, list[_Claim]] = {}
    for i, m in sources:
        where = f"{'the' if i == 0 else 'an ancestor'} {type(m).__name__} module"
        for c in _claims(m, "", where, annotations=i == 0):
            if id(c.param) in own:
                claimed.setdefault(id(c.param), []).append(c)
    return {k: _decide(v, own[k]) for k, v in claimed.items()}

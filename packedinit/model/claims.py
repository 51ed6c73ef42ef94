"""Claims: what adapters and annotations say about a model's parameters, resolved once.

:func:`resolve` gives every distinct parameter of a model with its Layout (or None);
:func:`layouts` the packed ones by name; :func:`annotate` marks one instance (and its
Parameters, see :mod:`packedinit.model.marks`). Adapters come from :mod:`packedinit.model.registry`.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from torch import Tensor, nn

from packedinit.errors import LayoutWarning, PackedInitError
from packedinit.layout import Layout
from packedinit.model.found import findings, maybe_packed, merge, same, trace
from packedinit.model.marks import ANNOTATIONS, has_annotations, stamp
from packedinit.model.marks import annotations_of as stored_annotations
from packedinit.model.registry import adapter_name, ensure_builtins, key_name, lookup
from packedinit.model.wrappers import find, missing
from packedinit.shapes import fmt_shape
from packedinit.torch_compat import param_dict

__all__ = ["layouts", "annotate", "annotations_of", "resolve", "own_layouts"]

Mod = TypeVar("Mod", bound=nn.Module)


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
    """The parameter ``name`` (dotted) of ``module``, through wrappers (:mod:`~packedinit.model.wrappers`), or None."""
    found = find(module, name)
    return None if found is None else found.param


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
            f"(its parameters: {_param_names(module)}): {missing(module, name)}; fix the adapter's names "
            f"or its registered class."
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
    source = f"adapter {adapter_name(adapter)} (registered for {key_name(key)}) at {where}"
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


def resolve(
    model: nn.Module, forward: str | None = None, *, loud: bool = True, only: Collection[int] | None = None
) -> list[tuple[str, Tensor, Layout | None]]:
    """Every distinct parameter of ``model`` in ``named_parameters()`` order, with its layout or None.

    With ``forward`` (the idiom's name, for warnings), the forward's layouts fill in what no
    adapter or annotation describes (:func:`packedinit.model.found.merge`: ``loud``
    whether the init function reads fans, ``only`` the ids of the parameters it will write).
    """
    ensure_builtins()
    order: dict[int, tuple[str, Tensor]] = {}
    claimed: dict[int, list[_Claim]] = {}
    for prefix, m in model.named_modules():
        params = param_dict(m)
        if params:
            dot = prefix + "." if prefix else ""
            for name, p in params.items():
                if p is not None and id(p) not in order:
                    order[id(p)] = (dot + name, p)
        cls = type(m)
        has_adapter = lookup(cls) is not None
        if has_adapter or has_annotations(m):
            for c in _claims(m, prefix):
                claimed.setdefault(id(c.param), []).append(c)
    if forward is not None:
        found = findings(model)
        names = maybe_packed(model, order.values())
        out: list[tuple[str, Tensor, Layout | None]] = []
        todo: list[tuple[int, tuple[str, Tensor, Layout | None, str | None]]] = []
        for k, (n, p) in order.items():
            cs = claimed.get(k)
            lay = _decide(cs, n) if cs else None
            if (found is not None and n in found) or (cs is None and n in names):
                todo.append((len(out), (n, p, lay, _kind(cs) if cs else None)))
            out.append((n, p, lay))
        if todo:  # only what the forward saw or what looks packed: the rest passes as it is
            merged = merge(model, [e for _, e in todo], found, idiom=forward, loud=loud, only=only)
            for (i, _), entry in zip(todo, merged, strict=True):
                out[i] = entry
        return out
    if not claimed:
        return [(n, p, None) for n, p in order.values()]
    return [(n, p, _decide(claimed[k], n) if k in claimed else None) for k, (n, p) in order.items()]


def _kind(claims: list[_Claim]) -> str:
    return "annotation" if any(c.annotation for c in claims) else "adapter"


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


def annotate(module: Mod, *example_inputs: Any, **param_layouts: Any) -> Mod:
    """Mark packed parameters of one module instance; with example inputs, every one its forward splits.

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

    With example inputs (``annotate(model, *inputs, **input_kwargs)``: positional inputs, or
    keywords whose values are tensors), the forward runs once under the tracer
    (:func:`packedinit.infer_layouts`, read-only) and every weight it shows packed is stamped,
    except where an adapter says otherwise (a :class:`~packedinit.LayoutWarning` names it); the
    trace is kept, so the whole-model idioms do not trace again.

    With no keywords, every packed parameter :func:`layouts` finds is stamped on the
    module that owns it. Then ``model.apply(chunked(f))`` and any code that looks
    at one module at a time see layouts that an ancestor's adapter describes.

    Args:
        module: the module instance.
        *example_inputs: positional inputs of ``module(...)``: trace the forward.
        **param_layouts: ``name=Layout`` (or ``None``) per parameter, relative to ``module``;
            with positional example inputs (or tensor values), keyword inputs of ``module(...)``.

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
        >>> class Attn(torch.nn.Module):  # [q: 8 | k: 4 | v: 4], split in the forward
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.qkv = torch.nn.Linear(8, 16)
        ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
        ...         q, k, v = self.qkv(x).split([8, 4, 4], dim=-1)
        ...         return q.sum() + k.sum() * v.sum()
        >>> attn = annotate(Attn(), torch.randn(2, 3, 8))
        >>> layouts(attn)["qkv.weight"]
        Layout(dim=0, sizes=(8, 4, 4))
        >>> annotate(qkv, weight=Layout(0, [16, 16]))
        Traceback (most recent call last):
        ...
        packedinit.errors.PackedInitError: annotate(Linear, ...): parameter 'weight' of shape (48, 16) with ...
    """
    if not isinstance(module, nn.Module):
        raise PackedInitError(f"annotate(module, ...) needs an nn.Module, got {type(module).__name__}.")
    traced = bool(example_inputs) or any(isinstance(v, Tensor) for v in param_layouts.values())
    if traced:
        return _annotate_traced(module, example_inputs, param_layouts)
    stamps: dict[int, tuple[nn.Module, dict[str, Layout | None]]] = {}
    if param_layouts:
        source = f"annotate({type(module).__name__}, ...)"
        for name, layout in param_layouts.items():
            _checked(module, "", name, layout, source, allow_none=True)
            found = find(module, name)
            assert found is not None  # _checked resolved it
            stamps.setdefault(id(found.owner), (found.owner, {}))[1][found.leaf] = layout
    else:
        owners = {id(p): (m, n) for m in module.modules() for n, p in param_dict(m).items() if p is not None}
        for _, p, layout in resolve(module):
            if layout is not None:
                owner, leaf = owners[id(p)]
                stamps.setdefault(id(owner), (owner, {}))[1][leaf] = layout
    for owner, new in stamps.values():
        stamp(owner, new)
    return module


def _annotate_traced(module: Mod, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Mod:
    """``annotate(module, *inputs, **input_kwargs)``: stamp what the forward shows packed."""
    cls = type(module).__name__
    layouts_given = [k for k, v in kwargs.items() if isinstance(v, Layout)]
    if layouts_given:
        raise PackedInitError(
            f"annotate({cls}, ...) got example inputs and Layouts ({layouts_given}) in one call; annotate the "
            f"layouts in a call of their own: packedinit.annotate(module, name=Layout(...))."
        )
    found = trace(module, args, kwargs)
    claimed = {n: lay for n, _, lay in resolve(module)}
    owners = {id(p): (m, n) for m in module.modules() for n, p in param_dict(m).items() if p is not None}
    stamps: dict[int, tuple[nn.Module, dict[str, Layout | None]]] = {}
    by_name = dict(module.named_parameters())
    other: list[str] = []
    for name, seen in found.items():
        if seen.verdict != "packed" or seen.layout is None or name not in by_name:
            continue
        mine = claimed.get(name)
        if mine is not None and not same(mine, seen.layout):
            other.append(f"{name!r}: the adapter says {mine!r}, the forward shows {seen.layout!r}")
            continue
        owner, leaf = owners[id(by_name[name])]
        stamps.setdefault(id(owner), (owner, {}))[1][leaf] = seen.layout
    if other:
        warnings.warn(
            f"annotate({cls}, *example_inputs): the adapters and the forward disagree on {'; '.join(other)}; "
            f"the adapter's layout stays. If the forward is right: "
            f"packedinit.annotate(model, **{{name: Layout(...)}}).",
            LayoutWarning,
            stacklevel=3,
        )
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
    ensure_builtins()
    if not has_annotations(module) and lookup(type(module)) is None:  # the common case, without building lists
        for m in ancestors:
            if lookup(type(m)) is not None:
                break
        else:
            return {}
    sources = [
        (i, m)
        for i, m in enumerate((module, *ancestors))
        if (i == 0 and has_annotations(m))
        or lookup(type(m)) is not None
    ]
    if not sources:
        return {}
    own = {id(p): n for n, p in param_dict(module).items() if p is not None}
    claimed: dict[int, list[_Claim]] = {}
    for i, m in sources:
        where = f"{'the' if i == 0 else 'an ancestor'} {type(m).__name__} module"
        for c in _claims(m, "", where, annotations=i == 0):
            if id(c.param) in own:
                claimed.setdefault(id(c.param), []).append(c)
    return {k: _decide(v, own[k]) for k, v in claimed.items()}

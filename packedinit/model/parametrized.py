"""Parametrized tensors (``torch.nn.utils.parametrize``): where their values live and how to write them.

``weight_norm``, ``spectral_norm``, ``orthogonal`` and user parametrizations replace a
module's ``weight`` by a property computed from ``parametrizations.weight.original`` (or
``original0``, ``original1``, ...). Writing the computed tensor writes nothing that stays, so
a module's own init (``Conv1d.reset_parameters``, which construction ran *before* the
parametrization was registered) is run on a plain stand-in of the unparametrised weight,
and the originals are then written through ``right_inverse``, as torch documents for
``module.weight = value``; a ``spectral_norm``'s power-iteration vectors are drawn again,
as its registration drew them. torch's deprecated hook-based ``weight_norm``
(``weight_g``/``weight_v``) is handled the same way.

The other idioms on a *packed* parametrized tensor (see ``packedinit.walk.through_parametrizations``)
do the same with :func:`stand_in` and :func:`write_through`: the per-block init is meant for the
tensor the module computes (``g * v / ||v||``), so a plain stand-in of it is initialised per
block and written through ``right_inverse``; writing ``v`` per block would leave ``g`` stale.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from packedinit.errors import PackedInitError, packed_error
from packedinit.torch_compat import (
    WEIGHT_NORM_G,
    WEIGHT_NORM_V,
    buffer_dict,
    forward_pre_hooks,
    module_dict,
    orthogonal_without_base,
    param_dict,
    spectral_norm_vectors,
    spectral_power_method,
)

__all__ = [
    "check_writable",
    "is_holder",
    "originals_of",
    "stand_in",
    "write_through",
    "is_parametrized",
    "parametrized_original",
    "run_unparametrized",
    "unparametrized",
    "weight_norm_hooks",
]


def is_parametrized(m: nn.Module) -> bool:
    """Has ``m`` a tensor parametrized with ``torch.nn.utils.parametrize`` or torch's old ``weight_norm`` hook?"""
    return isinstance(module_dict(m).get("parametrizations"), nn.ModuleDict) or bool(weight_norm_hooks(m))


def weight_norm_hooks(m: nn.Module) -> list[Any]:
    """The deprecated ``torch.nn.utils.weight_norm`` hooks on ``m`` (each holds ``name`` and ``dim``)."""
    return [h for h in forward_pre_hooks(m).values() if type(h).__name__ == "WeightNorm" and hasattr(h, "name")]


def hook_v_g(m: nn.Module, name: str) -> tuple[Tensor, Tensor, Any] | None:
    """``(v, g, hook)`` when ``m.<name>`` is computed by a ``torch.nn.utils.weight_norm`` hook, else None."""
    for h in weight_norm_hooks(m):
        if h.name == name:
            v, g = param_dict(m).get(name + WEIGHT_NORM_V), param_dict(m).get(name + WEIGHT_NORM_G)
            if isinstance(v, Tensor) and isinstance(g, Tensor):
                return v, g, h
    return None


def renorm_hooked(m: nn.Module, v: Tensor) -> None:
    """After ``v`` of a ``weight_norm`` hook on ``m`` was written: ``g = ||v||``, so ``m.<name>`` is ``v`` (as
    ``unparametrized`` and the parametrization's ``right_inverse`` leave it); the cached weight too."""
    for h in weight_norm_hooks(m):
        found = hook_v_g(m, h.name)
        if found is None or found[0] is not v or v.is_meta:
            continue
        with torch.no_grad():
            found[1].copy_(torch.norm_except_dim(v, 2, h.dim))
            if isinstance(m.__dict__.get(h.name), Tensor):
                m.__dict__[h.name] = h.compute_weight(m)


def _originals(plist: Any) -> list[Tensor]:
    if getattr(plist, "is_tensor", False):
        return [plist.original]
    out: list[Tensor] = []
    while f"original{len(out)}" in param_dict(plist) or f"original{len(out)}" in buffer_dict(plist):
        out.append(getattr(plist, f"original{len(out)}"))
    return out


def parametrized_original(owner: nn.Module, name: str, fqn: str, sizes: object = None) -> Tensor | None:
    """The original that holds ``owner.<name>`` per element, for a claim on a parametrized ``name``; else None.

    A parametrization that keeps the shape (``orthogonal``, ``spectral_norm``, a user one
    without ``right_inverse``) has one original of the same shape: it is the packed tensor.
    ``weight_norm`` keeps it in ``original1`` (the direction ``v``; ``original0`` is the norm).

    Raises:
        PackedInitError: ``name`` is parametrized and no original has its shape.
    """
    holder = module_dict(owner).get("parametrizations")
    if not isinstance(holder, nn.ModuleDict) or name not in holder:
        return None
    with torch.no_grad():
        shape = tuple(getattr(owner, name).shape)
    plist: Any = holder[name]
    same = [t for t in _originals(plist) if tuple(t.shape) == shape]
    if len(same) != 1:
        raise PackedInitError(
            f"parameter {fqn!r} of shape {shape} is packed and parametrized "
            f"({', '.join(type(p).__name__ for p in plist)}), and {len(same)} of its originals have that "
            f"shape, so packedinit cannot tell which one holds the blocks; annotate the original "
            f"(packedinit.annotate(module.parametrizations.{name}, original0=Layout(...)))."
        )
    return same[0]


def _write_through(plist: Any, value: Tensor) -> None:
    """``module.<name> = value`` as torch does it (``right_inverse`` last to first), but copying into the originals.

    Copying keeps the original Parameter objects and their storage (optimizers, FSDP keep
    their references); torch's own path swaps the storage.
    """
    out: Any = value
    for p in reversed(list(plist)):
        inverse = getattr(p, "right_inverse", None)
        if callable(inverse):
            out = inverse(out)
    originals = _originals(plist)
    values = [out] if getattr(plist, "is_tensor", False) else list(out)
    for original, v in zip(originals, values, strict=True):
        original.copy_(v)
    for p in plist:
        vectors = spectral_norm_vectors(p)  # None for a vector weight (no u, v) and other parametrizations
        if vectors is not None:
            _redraw_spectral(p, vectors, originals[0])
    plist()  # registration evaluates the parametrization once (a spectral_norm in training mode iterates)


def _redraw_spectral(p: Any, vectors: tuple[Tensor, Tensor], weight: Tensor) -> None:
    """The power-iteration vectors ``u``, ``v`` as spectral_norm's ``__init__`` draws them (same calls, same order)."""
    pu, pv = vectors
    u = torch.empty_like(pu).normal_(0, 1)
    v = torch.empty_like(pv).normal_(0, 1)
    pu.copy_(nn.functional.normalize(u, dim=0, eps=p.eps))
    pv.copy_(nn.functional.normalize(v, dim=0, eps=p.eps))
    spectral_power_method(p, weight, 15)


def _plain_kind(m: nn.Module, plist: nn.Module, name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of ``m.<name>``, found by evaluating the parametrization on meta copies."""
    return _meta_kind(plist, lambda: getattr(m, name))


def _meta_kind(plist: nn.Module, compute: Callable[[], Tensor]) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of ``compute()`` (the parametrized tensor), evaluated on meta copies of ``plist``'s tensors.

    The real originals may hold garbage (after ``to_empty``), which some parametrizations
    reject; meta copies cost nothing, and a spectral norm's iteration writes nothing real.
    """
    swapped: list[tuple[dict[str, Any], str, Tensor]] = []
    for sub in plist.modules():
        stores: tuple[dict[str, Any], ...] = (param_dict(sub), buffer_dict(sub))
        for store in stores:
            for n, t in list(store.items()):
                if t is not None and not t.is_meta:
                    meta = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                    is_param = isinstance(t, nn.Parameter)
                    store[n] = nn.Parameter(meta, requires_grad=t.requires_grad) if is_param else meta
                    swapped.append((store, n, t))
    try:
        try:
            value = compute()
        except PackedInitError:
            raise
        except Exception as e:  # a parametrization that cannot be evaluated as it stands
            known = _untrivialized_orthogonal(plist)
            if known is not None:
                return known
            names = " -> ".join(type(p).__name__ for p in plist.children())
            raise packed_error(
                f"a parametrized tensor ({names}, originals of shapes "
                f"{[tuple(o.shape) for o in _originals(plist)]}) cannot be evaluated to find its shape: "
                f"{type(e).__name__}: {e}. Fix: register the parametrization after the module is materialised and "
                f"initialised (torch.nn.utils.parametrize.register_parametrization on real tensors), or make it "
                f"evaluable on meta tensors.",
                e,
            ) from e
        return tuple(value.shape), value.dtype
    finally:
        for store, n, t in swapped:
            store[n] = t


def _untrivialized_orthogonal(plist: nn.Module) -> tuple[tuple[int, ...], torch.dtype] | None:
    """Shape and dtype of an ``orthogonal`` parametrization registered on meta (its ``base`` is ``None``).

    ``parametrizations.orthogonal`` on a meta tensor leaves the trivialization's ``base`` unset,
    so the forward fails until ``right_inverse`` sets it; the tensor has the original's shape
    and dtype (checked on torch 2.13.0), and writing through ``right_inverse`` sets ``base``.
    """
    layers = list(plist.children())
    originals = _originals(plist)
    if len(layers) != 1 or len(originals) != 1 or not orthogonal_without_base(layers[0]):
        return None
    return tuple(originals[0].shape), originals[0].dtype


@contextlib.contextmanager
def unparametrized(m: nn.Module) -> Iterator[None]:
    """Within the block ``m`` is as before its parametrizations, each parametrized tensor a plain Parameter.

    On a clean exit what was written to the plain tensors goes to the originals (through
    ``right_inverse``; for the old ``weight_norm`` hook, ``g = ||v||`` and ``v``), so code that
    initialises ``m.weight`` initialises what the parametrization reads. On an error the
    originals are untouched. Modules without parametrizations are left as they are.
    """
    holder = module_dict(m).get("parametrizations")
    hooks = weight_norm_hooks(m)
    if not isinstance(holder, nn.ModuleDict) and not hooks:
        yield
        return
    cls = m.__class__
    plain: dict[str, Tensor] = {}
    with torch.no_grad():
        if isinstance(holder, nn.ModuleDict):
            for name in holder:
                shape, dtype = _plain_kind(m, holder[name], name)
                originals = _originals(holder[name])
                device, grad = originals[0].device, any(o.requires_grad for o in originals)
                plain[name] = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=grad)
        for h in hooks:
            v = getattr(m, h.name + WEIGHT_NORM_V)
            plain[h.name] = nn.Parameter(torch.empty_like(v), requires_grad=v.requires_grad)
    computed = {h.name: m.__dict__.pop(h.name, None) for h in hooks}
    if isinstance(holder, nn.ModuleDict):
        m.__class__ = torch.nn.utils.parametrize.type_before_parametrizations(m)
        del module_dict(m)["parametrizations"]
    params: dict[str, Any] = param_dict(m)
    params.update(plain)
    try:
        yield
    finally:
        for name in plain:
            del param_dict(m)[name]
        if isinstance(holder, nn.ModuleDict):
            module_dict(m)["parametrizations"] = holder
            m.__class__ = cls
        for name, t in computed.items():
            if t is not None:
                m.__dict__[name] = t
    with torch.no_grad():
        if isinstance(holder, nn.ModuleDict):
            for name in holder:
                _write_through(holder[name], plain[name])
        for h in hooks:
            getattr(m, h.name + WEIGHT_NORM_G).copy_(torch.norm_except_dim(plain[h.name], 2, h.dim))
            getattr(m, h.name + WEIGHT_NORM_V).copy_(plain[h.name])
            if computed.get(h.name) is not None:
                m.__dict__[h.name] = h.compute_weight(m)


def check_writable(m: nn.Module) -> None:
    """Raise before any write when ``m``'s originals cannot be written through (sharded DTensors).

    Raises:
        PackedInitError: an original of a parametrized tensor of ``m`` is a DTensor.
    """
    holder = module_dict(m).get("parametrizations")
    if not isinstance(holder, nn.ModuleDict):
        return
    for name in holder:
        if any(type(t).__name__ == "DTensor" for t in _originals(holder[name])):
            raise PackedInitError(
                f"reset_parameters: {name!r} of {type(m).__name__} is parametrized and sharded (DTensor "
                f"originals); writing it through right_inverse per shard is not supported. Fix: materialise and "
                f"initialise before fully_shard, or register the parametrization after initialising."
            )


def run_unparametrized(m: nn.Module, step: Callable[[], object]) -> None:
    """``step()`` inside :func:`unparametrized` ``(m)``: an init written against the plain module, written through."""
    with unparametrized(m):
        step()


# -- packed parametrized tensors: initialised as a plain stand-in, written through right_inverse ------
def is_holder(m: nn.Module) -> bool:
    """Is ``m`` the ``ParametrizationList`` that holds a parametrized tensor's originals?"""
    return isinstance(m, torch.nn.utils.parametrize.ParametrizationList)


def originals_of(plist: nn.Module) -> list[Tensor]:
    """The originals ``plist`` (a ``ParametrizationList``) holds: ``[original]`` or ``[original0, original1, ...]``."""
    return _originals(plist)


def stand_in(plist: nn.Module, fqn: str, *, current: bool) -> Tensor:
    """A plain tensor of the parametrized tensor's shape and dtype, on the originals' device, to initialise per block.

    ``current``: it holds the parametrized tensor's present value (for an init that leaves some
    blocks as they are), evaluated on an eval-mode copy of ``plist``, so that a
    ``spectral_norm`` iterates nothing (nothing is written before every check has passed).

    Raises:
        PackedInitError: an original is a DTensor (writing through ``right_inverse`` per shard is not supported).
    """
    found = _originals(plist)
    if any(type(t).__name__ == "DTensor" for t in found):
        raise PackedInitError(
            f"parameter {fqn!r} is packed, parametrized and sharded (DTensor originals); writing it through "
            f"right_inverse per shard is not supported. Fix: initialise before fully_shard, or register the "
            f"parametrization after initialising."
        )
    shape, dtype = _meta_kind(plist, plist)
    device = found[0].device
    if not current or device.type == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    with torch.no_grad():
        copied = copy.deepcopy(plist).eval()  # a copy: no other thread sees a mode change, nothing is written
        value: Tensor = copied().detach()
    return value


def write_through(plist: nn.Module, value: Tensor) -> None:
    """``module.<name> = value`` into ``plist``'s originals (kept as objects), as :func:`unparametrized` writes them."""
    if value.is_meta or any(t.is_meta for t in _originals(plist)):
        return
    with torch.no_grad():
        _write_through(plist, value)

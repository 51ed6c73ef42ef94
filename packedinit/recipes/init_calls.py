r"""Per block, whoever calls: ``torch.nn.init`` calls on known packed Parameters, routed through the engine.

While :func:`acquire` holds (``packedinit.fix_torch_defaults()`` and
``packedinit.reset_parameters`` take it), every fan-dependent ``torch.nn.init`` function
(``xavier_*``, ``kaiming_*``, ``orthogonal_``, ``eye_``, ``dirac_``, ``sparse_``) reached
through one of these names runs per block when it is handed a Parameter packedinit knows to
be packed, and is torch's own function, called as it was called, otherwise:

- ``torch.nn.init.<name>`` (what ``torch.nn.init.xavier_uniform_(p)``, ``from torch.nn import
  init; init.xavier_uniform_(p)`` and torch's own ``Linear``/``Conv`` defaults look up at call
  time);
- the same name bound in ``torch.nn.modules.*`` (``from torch.nn.init import ...`` in torch's
  own files) when the global still holds torch's function;
- transformers' ``transformers.initialization`` wrappers (``init.xavier_uniform_`` in every
  ``_init_weights`` of transformers 5.x): they call ``TORCH_INIT_FUNCTIONS[name]``, whose
  entries are replaced while the fix is on; transformers' ``guard_torch_init_functions``
  patches over ours and calls through that table, so it is covered too.

Handed a local shard instead (the local tensor of a DTensor parameter the fix knows, a
Megatron-style shard: :mod:`packedinit.model.shards`), a fan-dependent function draws with the
fans of the logical (global) weight, per logical block where it is packed
(:func:`packedinit.engine.shards.init_shard`): the gathered weight is the single-process init at
every tensor-parallel degree. A DTensor parameter is known when a module registers it while the
fix is on (``parallelize_module``) or when its model is handed to :func:`acquire`.

Not covered (nothing can see the call): a function object bound before the fix in a module
packedinit does not know (``from torch.nn.init import xavier_uniform_`` at the top of your or a
third-party file, a ``functools.partial`` or a list made before); a call on a tensor that is
not the Parameter itself (``p.data``, ``p[:]``, a float32 copy such as transformers' own
``orthogonal_`` makes for half precision); and a call while no handle holds the fix.

"Known to be packed" means one of:

- a Parameter registered while the fix was on on a module with an adapter (torch's
  ``MultiheadAttention``, ``LSTM``/``GRU`` and cells, every registered adapter), or inside
  a child registered on such a module (an adapter that describes its descendants);
- a Parameter :func:`packedinit.annotate` marked (also one replaced later, see
  :mod:`packedinit.model.marks`);
- a packed parameter of a model handed to :func:`acquire` (``fix_torch_defaults(model)``,
  ``reset_parameters(model)``), for as long as that handle holds.

The records hold Parameters and modules weakly: nothing is kept alive. Two global module
registration hooks (torch's ``register_module_parameter_registration_hook`` and
``register_module_module_registration_hook``) are installed on the first use and kept, doing
nothing while no handle holds the interception: adding or removing a global hook while another
thread constructs a module could break that thread's construction.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from packedinit.engine.distributed import local_ranges
from packedinit.engine.plan import Request, Where
from packedinit.engine.run import run
from packedinit.engine.shards import init_shard
from packedinit.layout import Layout
from packedinit.model.claims import resolve
from packedinit.model.held import init_held
from packedinit.model.marks import param_claim, param_layout
from packedinit.model.parametrized import is_holder, originals_of
from packedinit.model.registry import lookup
from packedinit.model.shards import dtensor_of, megatron_shard, note

__all__ = ["FAN_FNS", "Interception", "acquire", "intercepting", "packed_layout", "original"]

#: The fan-dependent ``torch.nn.init`` functions that run per block on known packed Parameters.
FAN_FNS = (
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "eye_",
    "dirac_",
    "sparse_",
)
#: torch's own functions, read when packedinit is imported.
_TORCH: dict[str, Callable[..., Tensor]] = {name: getattr(torch.nn.init, name) for name in FAN_FNS}
#: Modules whose globals may hold torch's functions bound by ``from torch.nn.init import ...``.
_MODULES = (
    "torch.nn.init",
    "torch.nn.modules.activation",
    "torch.nn.modules.transformer",
    "torch.nn.modules.linear",
    "torch.nn.modules.conv",
    "torch.nn.modules.rnn",
    "torch.nn.modules.sparse",
)
#: transformers 5.x: the table its ``transformers.initialization`` wrappers call.
_HF_MODULE, _HF_TABLE = "transformers.initialization", "TORCH_INIT_FUNCTIONS"

_lock = threading.RLock()
_active = 0
#: (container, key, torch's function, our wrapper): what _install replaced, restored by _restore.
_patched: list[tuple[MutableMapping[str, Any], str, Callable[..., Tensor], Callable[..., Tensor]]] = []
_hooks: list[Any] = []
#: Parameters registered under the fix on (or below) a module with an adapter: (module, dotted name).
_built: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: Models handed to acquire(): one {Parameter: (name, Layout)} per live handle.
_scopes: list[WeakIdKeyDictionary] = []
#: The same models' originals of packed parametrized tensors: {original: (ref to its
#: ParametrizationList, {id(original): Layout | None})} per live handle.
_held_scopes: list[WeakIdKeyDictionary] = []


def original(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """torch's own function behind one of the wrappers (``fn`` itself for anything else)."""
    inner: Callable[..., Tensor] | None = getattr(fn, "__packedinit_torch__", None)
    return inner if inner is not None else fn


def packed_layout(t: object) -> tuple[str, Layout] | None:
    """``(name, Layout)`` when ``t`` is a Parameter known to be packed (more than one block), else None."""
    if not isinstance(t, nn.Parameter):
        return None
    with _lock:
        scopes = list(_scopes)
        built = _built.get(t)  # type: ignore[no-untyped-call]  # torch leaves WeakIdKeyDictionary untyped
    for scope in reversed(scopes):
        hit: tuple[str, Layout] | None = scope.get(t)  # type: ignore[no-untyped-call]  # same
        if hit is not None:
            return hit
    if built is not None:
        ref, name = built
        owner = ref()
        if owner is not None:
            for _n, p, layout in resolve(owner):
                if p is t:
                    return (name, layout) if layout is not None and layout.num_parts > 1 else None
    layout = param_layout(t)
    if layout is not None and layout.num_parts > 1:
        return ("parameter", layout)
    return None


def _held(t: object) -> tuple[nn.Module, dict[int, Layout | None] | None] | None:
    """The packed ``ParametrizationList`` holding Parameter ``t`` among its originals, with their layouts."""
    if not isinstance(t, nn.Parameter):
        return None
    with _lock:
        scopes = list(_held_scopes)
    for scope in reversed(scopes):
        hit = scope.get(t)  # type: ignore[no-untyped-call]  # torch leaves WeakIdKeyDictionary untyped
        holder = hit[0]() if hit is not None else None
        if holder is not None:
            return holder, hit[1]
    annotated = param_claim(t)[1]
    return (annotated, None) if annotated is not None else None


def _wrapper(name: str, torch_fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def per_block_if_packed(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        held = _held(tensor) if _active > 0 else None
        if held is not None and init_held(held[0], tensor, torch_fn, args, kwargs, held[1]):
            return tensor  # an original of a packed parametrized tensor: written through the parametrization
        if _active > 0 and _on_local_shard(tensor, torch_fn, args, kwargs):
            return tensor  # a local shard: the global logical blocks' fans
        found = packed_layout(tensor) if _active > 0 else None
        if found is None:
            return torch_fn(tensor, *args, **kwargs)
        param, layout = found
        run(Request(tensor, layout, None, torch_fn, args, kwargs, param))
        return tensor

    functools.update_wrapper(per_block_if_packed, torch_fn)
    per_block_if_packed.__packedinit_torch__ = torch_fn  # type: ignore[attr-defined]  # read by original()
    return per_block_if_packed


def _on_local_shard(tensor: Tensor, torch_fn: Callable[..., Tensor], args: Any, kwargs: Any) -> bool:
    """Fill ``tensor`` per global logical block when it is a local shard (see :mod:`packedinit.model.shards`)."""
    owner = dtensor_of(tensor)
    if owner is not None:
        shape = tuple(owner.shape)
        found = packed_layout(owner)
        ranges = local_ranges(owner, str(Where(found[0] if found else None, shape)))
        pieces = [] if ranges is None else [(tensor, ranges)]
    else:
        geo = megatron_shard(tensor)
        if geo is None:
            return False
        shape, found = geo.global_shape, packed_layout(tensor)
        pieces = list(geo.pieces(tensor))
    if found is None and pieces and tuple(tensor.shape) == shape:
        return False  # the whole parameter (Replicate, one rank): torch's own call
    name, layout = found if found is not None else (None, None)
    init_shard(Request(tensor, layout, None, torch_fn, tuple(args), kwargs, name), shape, pieces)
    return True


#: One wrapper per function, made once: code that bound a wrapper keeps a working (pass-through) one.
_WRAPPERS: dict[str, Callable[..., Tensor]] = {name: _wrapper(name, fn) for name, fn in _TORCH.items()}


def _on_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if _active > 0:
        note(param)  # a DTensor parameter (parallelize_module): its local tensor is a shard
    if _active > 0 and param is not None and lookup(type(module)) is not None:
        with _lock:
            _built[param] = (weakref.ref(module), name)


def _on_module(module: nn.Module, name: str, child: nn.Module | None) -> None:
    if _active > 0 and child is not None and lookup(type(module)) is not None:
        ref = weakref.ref(module)
        with _lock:
            for pname, p in child.named_parameters():
                _built[p] = (ref, f"{name}.{pname}")


def _replace(container: MutableMapping[str, Any]) -> None:
    for name, torch_fn in _TORCH.items():
        if container.get(name) is torch_fn:
            container[name] = _WRAPPERS[name]
            _patched.append((container, name, torch_fn, _WRAPPERS[name]))


def _install() -> None:
    for mod_name in _MODULES:
        mod = sys.modules.get(mod_name)
        if mod is not None:
            _replace(vars(mod))
    hf = sys.modules.get(_HF_MODULE)
    table = getattr(hf, _HF_TABLE, None) if hf is not None else None
    if isinstance(table, dict):
        _replace(table)
    if not _hooks:  # installed once and kept (inert while off): adding or removing a global hook while
        # another thread registers a parameter would change the dict torch is iterating over
        mm = torch.nn.modules.module
        _hooks.append(mm.register_module_parameter_registration_hook(_on_parameter))
        _hooks.append(mm.register_module_module_registration_hook(_on_module))


def _restore() -> None:
    for container, name, torch_fn, wrapper in reversed(_patched):
        if container.get(name) is wrapper:  # another patcher on top keeps its own; ours then passes through
            container[name] = torch_fn
    _patched.clear()


class Interception:
    """One reference to the interception (see the module docstring); ``release()`` gives it back."""

    __slots__ = ("_held", "_on", "_scope")

    def __init__(self, *models: nn.Module, forward: str | None = None) -> None:
        global _active
        scope: WeakIdKeyDictionary | None = None
        held: WeakIdKeyDictionary | None = None
        if models:
            scope, held = WeakIdKeyDictionary(), WeakIdKeyDictionary()
            for model in models:
                lays: dict[int, Layout | None] = {}
                for q in model.parameters():
                    note(q)
                for n, p, layout in resolve(model, forward):
                    lays[id(p)] = layout
                    if layout is not None and layout.num_parts > 1:
                        scope[p] = (n, layout)
                for m in model.modules():
                    originals = originals_of(m) if is_holder(m) else []
                    if any(lays.get(id(o)) is not None for o in originals):
                        for o in originals:
                            held[o] = (weakref.ref(m), {id(t): lays.get(id(t)) for t in originals})
        with _lock:
            if _active == 0:
                _install()
            _active += 1
            if scope is not None:
                _scopes.append(scope)
            if held is not None:
                _held_scopes.append(held)
        self._on, self._scope, self._held = True, scope, held

    def release(self) -> None:
        """Give this reference back; the last one restores torch's functions. Idempotent."""
        global _active
        with _lock:
            if not self._on:
                return
            self._on = False
            if self._scope is not None:
                _scopes[:] = [s for s in _scopes if s is not self._scope]
            if self._held is not None:
                _held_scopes[:] = [s for s in _held_scopes if s is not self._held]
            _active -= 1
            if _active == 0:
                _restore()

    def __enter__(self) -> Interception:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(*models: nn.Module, forward: str | None = None) -> Interception:
    """Turn the interception on (one reference), knowing also the packed parameters of ``models``.

    ``forward`` (the idiom's name): layouts from the forward too (see :func:`packedinit.model.claims.resolve`).
    """
    return Interception(*models, forward=forward)


def intercepting() -> bool:
    """Whether some reference holds the interception now."""
    return _active > 0

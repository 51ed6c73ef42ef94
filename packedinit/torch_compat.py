"""Every use packedinit makes of torch's private surface, in one place.

Each entry names the private thing it reads, the torch versions it was checked on (the
suite's tests of that entry ran green on them: ``tests/test_torch_compat.py`` and the
tests of its callers, run by ``.ci/run``'s compat step on the oldest and newest supported
torch), and the public fallback where one exists. No other packedinit module touches a
torch-private name (``tests/test_torch_compat.py`` reads the source to keep it so); when a
new torch moves one of these, this module is the one to change.

Checked on: torch 2.6.0 (Python 3.10), 2.13.0 (Python 3.11) and 2.15.0 (Python 3.13).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

# torch.utils._python_dispatch.TorchDispatchMode: checked on 2.6.0, 2.13.0, 2.15.0. No public
# fallback (torch.overrides.TorchFunctionMode sees Python-level calls, not the aten ops an
# in-place write reaches, so it cannot stand in); materialize's write recorder needs it.
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "GROUPED_MM_NAMES",
    "TORCH_VERSION",
    "RESET_METHOD",
    "orthogonal_without_base",
    "TORCH_WRAPPER_CHILDREN",
    "WEIGHT_NORM_G",
    "WEIGHT_NORM_V",
    "ConvNd",
    "TorchDispatchMode",
    "apply_ancestors",
    "buffer_dict",
    "caller_frame",
    "compile_safe_cache",
    "custom_shard_order",
    "fill_padding_idx",
    "forward_pre_hooks",
    "is_lazy",
    "mha_in_proj_packed",
    "module_dict",
    "non_persistent_buffers",
    "param_dict",
    "private_reset",
    "rnn_weight_names",
    "set_grad_enabled",
    "spectral_norm_vectors",
    "spectral_power_method",
    "torch_function_off",
    "storage_id",
    "written_args",
]


# -- caches under torch.compile ---------------------------------------------------------------------
# torch.compiler.is_compiling (public since 2.3; checked on 2.6.0, 2.13.0, 2.15.0). Dynamo warns on every
# call to an lru_cache-wrapped function it traces (and ignores the cache); an error under -W error.

_F = TypeVar("_F", bound=Callable[..., Any])


def compile_safe_cache(maxsize: int) -> Callable[[_F], _F]:
    """``functools.lru_cache(maxsize)`` in eager code; the plain function while torch.compile traces.

    Dynamo traces the function itself either way (it ignores an lru_cache and warns that it
    does); calling the uncached function there keeps the trace free of that warning.
    """

    def wrap(fn: _F) -> _F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            if torch.compiler.is_compiling():
                return fn(*args)
            return cached(*args)

        return call  # type: ignore[return-value]  # same signature as fn

    return wrap


# -- grad mode -------------------------------------------------------------------------------------
def _public_set_grad_enabled(enabled: bool) -> None:  # pragma: no cover - a torch without the private setter
    torch.set_grad_enabled(enabled)


#: Turn autograd recording on or off for this thread (the state ``torch.no_grad()`` sets).
#: ``torch._C._set_grad_enabled``: checked on 2.6.0, 2.13.0, 2.15.0; used for speed (no
#: context-manager object per call, no extra Python frame). Public fallback:
#: ``torch.set_grad_enabled(enabled)`` called as a function, which sets the mode at construction.
set_grad_enabled: Callable[[bool], None] = getattr(
    getattr(torch, "_C", None), "_set_grad_enabled", _public_set_grad_enabled
)


# -- storages and ops (materialize's write recorder) ------------------------------------------------
def storage_id(t: Tensor) -> int:
    """One key per storage: a tensor, its views and its ``.data`` share it (meta tensors included).

    ``untyped_storage()._cdata`` (the address of the C++ StorageImpl): checked on 2.6.0, 2.13.0,
    2.15.0. No public fallback for meta tensors: ``untyped_storage().data_ptr()`` is 0 for
    every meta storage, so it cannot tell two of them apart.
    """
    return int(t.untyped_storage()._cdata)


def written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    """The arguments an aten op (as a dispatch mode receives it) writes in place, by its schema.

    ``OpOverload._schema.arguments[i].alias_info.is_write``: checked on 2.6.0, 2.13.0, 2.15.0.
    No public fallback (``torch.Tag.inplace_view`` marks only view-changing ops).
    """
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            yield args[i] if i < len(args) else kwargs.get(arg.name)


# -- DTensor ----------------------------------------------------------------------------------------
def custom_shard_order(tensor: Any, placements: Any) -> Any | None:
    """A DTensor's shard order when it is not the default left-to-right one, else ``None``.

    ``DTensor._spec.shard_order`` and ``DTensorSpec.compute_default_shard_order``: present on
    2.13.0 and 2.15.0; torch 2.6.0 has neither and only the default order, which is what ``None``
    says there. Checked on 2.6.0, 2.13.0, 2.15.0. No public fallback.
    """
    spec = getattr(tensor, "_spec", None)
    order = getattr(spec, "shard_order", None)
    if spec is None or order is None:
        return None
    default = type(spec).compute_default_shard_order(placements)
    return order if tuple(order) != tuple(default) else None


# -- nn.Module internals ----------------------------------------------------------------------------
# ``Module._parameters`` / ``_buffers`` / ``_modules`` / ``_non_persistent_buffers_set``: the live
# dicts nn.Module keeps (unchanged since torch 1.x; checked on 2.6.0, 2.13.0, 2.15.0). Public
# fallbacks: ``named_parameters(recurse=False)`` / ``named_buffers(recurse=False)`` /
# ``named_children()`` to read (copies, slower per call) and ``register_parameter`` /
# ``register_buffer`` to write (which refuse the meta and DTensor stand-ins packedinit swaps in
# and out, hence the dicts).
def param_dict(m: nn.Module) -> dict[str, Any]:
    """``m``'s own parameters, the live dict (values may be ``None``)."""
    return m._parameters


def buffer_dict(m: nn.Module) -> dict[str, Any]:
    """``m``'s own buffers, the live dict (values may be ``None``)."""
    return m._buffers


def module_dict(m: nn.Module) -> dict[str, Any]:
    """``m``'s direct children, the live dict (values may be ``None``)."""
    return m._modules


def non_persistent_buffers(m: nn.Module) -> set[str]:
    """Names of ``m``'s own buffers left out of its ``state_dict``."""
    return m._non_persistent_buffers_set


def forward_pre_hooks(m: nn.Module) -> dict[int, Any]:
    """``m``'s forward pre-hooks, the live dict (handle id -> hook), where the old ``weight_norm`` keeps its hook.

    ``Module._forward_pre_hooks``: checked on 2.6.0, 2.13.0, 2.15.0. No public fallback (torch
    lists a module's registered hooks nowhere else).
    """
    return m._forward_pre_hooks


def is_lazy(m: nn.Module) -> bool:
    """Whether ``m`` is a lazy module (``nn.LazyLinear`` ...), whose parameters exist only after a forward.

    ``torch.nn.modules.lazy.LazyModuleMixin`` (documented, not exported from ``torch.nn``): checked
    on 2.6.0, 2.13.0, 2.15.0. Fallback when it moves: the public ``has_uninitialized_params``
    method every lazy module has.
    """
    lazy = getattr(getattr(nn.modules, "lazy", None), "LazyModuleMixin", None)
    if lazy is not None:
        return isinstance(m, lazy)
    return callable(getattr(m, "has_uninitialized_params", None))  # pragma: no cover - a torch without it


def mha_in_proj_packed(m: nn.MultiheadAttention) -> bool:
    """Whether ``m`` stores q, k, v in one ``in_proj_weight`` (kdim == vdim == embed_dim).

    ``MultiheadAttention._qkv_same_embed_dim``: checked on 2.6.0, 2.13.0, 2.15.0. Public
    fallback: ``m.in_proj_weight is not None`` (torch registers it as ``None`` otherwise).
    """
    same = getattr(m, "_qkv_same_embed_dim", None)
    if same is None:  # pragma: no cover - a torch without the private flag
        return m.in_proj_weight is not None
    return bool(same)


def rnn_weight_names(m: nn.RNNBase) -> list[str]:
    """The names of ``m``'s weights and biases in torch's flat order (``weight_ih_l0``, ``weight_hh_l0``, ...).

    ``RNNBase._flat_weights_names``: checked on 2.6.0, 2.13.0, 2.15.0. Public fallback: the same
    names built from ``num_layers``, ``bidirectional``, ``bias`` and ``proj_size``.
    """
    names: list[str] | None = getattr(m, "_flat_weights_names", None)
    if names is None:  # pragma: no cover - a torch without the private list
        kinds = ["weight_ih", "weight_hh", *(["bias_ih", "bias_hh"] if m.bias else [])]
        kinds += ["weight_hr"] if m.proj_size > 0 else []
        suffixes = ["", "_reverse"] if m.bidirectional else [""]
        names = [f"{k}_l{layer}{s}" for layer in range(m.num_layers) for s in suffixes for k in kinds]
    return names


#: The base class of every ``nn.ConvNd`` / ``nn.ConvTransposeNd`` (``torch.nn.modules.conv._ConvNd``),
#: whose ``reset_parameters`` packedinit replays. Checked on 2.6.0, 2.13.0, 2.15.0. Public fallback:
#: the tuple of the six public conv classes (which misses user subclasses of the base).
ConvNd = nn.modules.conv._ConvNd


#: The name of the private default-init method of ``nn.MultiheadAttention`` and ``nn.Transformer``
#: (called by their ``__init__``); ``fix_torch_defaults`` replaces it. Checked on 2.6.0, 2.13.0,
#: 2.15.0. No public fallback (torch calls it from ``__init__``; their public ``reset_parameters``
#: does not exist).
RESET_METHOD = "_reset_parameters"


def private_reset(m: nn.Module) -> Any:
    """``m._reset_parameters`` (bound), the default init ``MultiheadAttention`` / ``Transformer`` run."""
    return getattr(m, RESET_METHOD)


def fill_padding_idx(m: nn.Embedding) -> None:
    """``nn.Embedding._fill_padding_idx_with_zero()``: zero row ``padding_idx`` under no_grad, as torch's reset does.

    Checked on 2.6.0, 2.13.0, 2.15.0. Public fallback when it moves: the same under ``torch.no_grad()``.
    """
    fill = getattr(m, "_fill_padding_idx_with_zero", None)
    if fill is not None:
        fill()
    elif m.padding_idx is not None:  # pragma: no cover - a torch without the private method
        with torch.no_grad():
            m.weight[m.padding_idx].fill_(0)


# -- parametrizations: spectral_norm's power iteration, the deprecated hook-based weight_norm ---------------
def spectral_norm_vectors(p: Any) -> tuple[Tensor, Tensor] | None:
    """``(u, v)`` of a ``torch.nn.utils.parametrizations.spectral_norm`` parametrization ``p``, else ``None``.

    The class ``_SpectralNorm`` (by name) and its power-iteration buffers ``_u``, ``_v`` (absent for
    a vector weight, which needs no iteration): checked on 2.6.0, 2.13.0, 2.15.0. No public
    fallback (torch documents the parametrization, not its state).
    """
    if type(p).__name__ != "_SpectralNorm" or "_u" not in p._buffers:
        return None
    return p._u, p._v


def spectral_power_method(p: Any, weight: Tensor, n_power_iterations: int) -> None:
    """``n_power_iterations`` steps of ``p``'s power iteration on ``weight`` (updates ``u``, ``v`` in place).

    ``_SpectralNorm._power_method(_reshape_weight_to_matrix(weight), n)``, as its ``__init__`` runs
    it: checked on 2.6.0, 2.13.0, 2.15.0. No public fallback.
    """
    p._power_method(p._reshape_weight_to_matrix(weight), n_power_iterations)


#: Suffixes of the two Parameters ``torch.nn.utils.weight_norm`` (the deprecated hook) registers for
#: ``name``: ``name + "_g"`` (the norm) and ``name + "_v"`` (the direction). Documented names, kept
#: here because they read as private ones. Checked on 2.6.0, 2.13.0, 2.15.0. No fallback needed
#: (the parametrization-based ``weight_norm`` uses ``original0`` / ``original1``).
WEIGHT_NORM_G, WEIGHT_NORM_V = "_g", "_v"


# -- interpreter frames: who called an init function from nn.Module.apply ------------------------------
def caller_frame() -> FrameType:
    """The frame of the function that calls this one.

    ``sys._getframe(1)`` (CPython): checked on CPython 3.10, 3.11, 3.13 (torch 2.6.0, 2.13.0,
    2.15.0). Public fallback: ``inspect.currentframe().f_back`` (slower, same frame).
    """
    return sys._getframe(1)


_APPLY_CODE = nn.Module.apply.__code__


def apply_ancestors(module: nn.Module, depth: int = 1) -> list[nn.Module] | None:
    """The modules ``nn.Module.apply`` is visiting ``module`` from, nearest first; ``None`` if not from apply.

    ``nn.Module.apply(fn)`` calls ``fn(module)`` children first and passes nothing else, so an
    init function called from it cannot otherwise know that it owns only ``module``'s own
    parameters, nor which ancestors' adapters describe them. ``depth`` is how many frames above
    this function's caller the call from ``apply`` is (1: the caller itself was called by
    ``apply``). ``sys._getframe`` (CPython) on ``nn.Module.apply.__code__``, whose body is
    ``for m in self.children(): m.apply(fn)`` then ``fn(self)``: checked on 2.6.0, 2.13.0,
    2.15.0 (CPython 3.10, 3.11, 3.13). Public fallback: ``inspect.currentframe()`` (slower, same frames).
    """
    f: FrameType | None = sys._getframe(depth + 1)
    if f is None or f.f_code is not _APPLY_CODE:  # its one call of fn is fn(self): that is ``module``
        return None
    out: list[nn.Module] = []
    f = f.f_back
    while f is not None and f.f_code is _APPLY_CODE:
        parent = f.f_locals.get("self")
        if isinstance(parent, nn.Module):
            out.append(parent)
        f = f.f_back
    return out


#: Child names under which torch's own wrappers keep the module they wrap: ``torch.compile``'s
#: ``OptimizedModule`` (``_orig_mod``), FSDP1's ``FullyShardedDataParallel`` (``_fsdp_wrapped_module``)
#: and activation checkpointing's ``CheckpointWrapper`` (``_checkpoint_wrapped_module``). Checked on
#: torch 2.6.0, 2.13.0 and 2.15.0. No public fallback: the wrappers expose no accessor for the child.
TORCH_WRAPPER_CHILDREN = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


# -- parametrizations.orthogonal on meta ------------------------------------------------------------
def orthogonal_without_base(p: object) -> bool:
    """Whether ``p`` is torch's ``_Orthogonal`` parametrization whose trivialization ``base`` is unset (``None``).

    ``parametrizations.orthogonal`` registered on a meta tensor leaves ``base`` as ``None`` until
    ``right_inverse`` sets it: checked on 2.13.0 (the class name ``_Orthogonal`` and the ``base``
    buffer exist since torch 1.10). No public fallback: torch exposes no other way to tell.
    """
    if type(p).__name__ != "_Orthogonal" or not isinstance(p, nn.Module):
        return False
    return "base" in p._buffers and p._buffers["base"] is None


#: The names the tracer sees for a grouped matmul over a stack of experts: torch's private
#: ``torch._grouped_mm`` (torch >= 2.8; checked on 2.8-2.15), its public ``grouped_mm`` spelling, and
#: transformers' ``grouped_mm_fallback`` (5.x) where torch has neither.
GROUPED_MM_NAMES = ("_grouped_mm", "grouped_mm", "grouped_mm_fallback")

#: torch's (major, minor) version, for the behaviour that differs by version (``2.13.0+cpu`` -> ``(2, 13)``).
TORCH_VERSION: tuple[int, int] = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]  # two parts


# torch._C.DisableTorchFunction: checked on 2.6.0, 2.13.0, 2.15.0. No public fallback (a mode's own
# operations otherwise pass through every mode below it on the stack). The tracer's bookkeeping on its
# CPU labels runs under it, so the modes under the tracer (trace/known) see only the forward's operations.
def torch_function_off() -> Any:
    """A context in which no ``__torch_function__`` (mode or subclass) is called: plain torch."""
    return torch._C.DisableTorchFunction()

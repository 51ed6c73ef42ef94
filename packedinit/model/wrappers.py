"""Names through wrappers: where an adapter's ``"c_attn.weight"`` lives once a module is wrapped.

A wrapper moves the wrapped module's parameters one level down without changing what they are:

* peft (LoRA and its relatives) replaces ``c_attn`` by a layer holding the original as
  ``c_attn.base_layer``;
* ``torch.compile`` keeps the model as ``_orig_mod``, DDP and ``DataParallel`` as ``module``,
  FSDP1 as ``_fsdp_wrapped_module``, activation checkpointing as ``_checkpoint_wrapped_module``;
* a parametrization (``torch.nn.utils.parametrize``) keeps ``weight`` as
  ``parametrizations.weight.original``.

:func:`find` follows a dotted name through these, so an adapter written for the plain module
keeps describing the wrapped one; :func:`missing` says, for a name that does not resolve, which
module the path stopped at (naming its class, so that an unknown wrapper is named in the error).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from packedinit.model.parametrized import hook_v_g, parametrized_original
from packedinit.torch_compat import TORCH_WRAPPER_CHILDREN, WEIGHT_NORM_V, module_dict, param_dict

__all__ = ["Found", "find", "missing", "WRAPPER_CHILDREN"]

#: Child names under which a wrapper keeps the module it wraps (``module`` only for DDP/DataParallel).
WRAPPER_CHILDREN = ("base_layer", *TORCH_WRAPPER_CHILDREN)
_PARALLEL = ("DistributedDataParallel", "DataParallel")


@dataclass(frozen=True)
class Found:
    """Where a dotted name led: the owning module, the leaf name on it, the tensor (``None``: registered as None)."""

    owner: nn.Module
    leaf: str
    param: Tensor | None
    path: str  # the resolved name relative to the start, e.g. "c_attn.base_layer.weight"
    via: tuple[str, ...]  # the wrappers passed, in words, e.g. ("peft Linear 'c_attn' (base_layer)",)


def _inner(owner: nn.Module) -> tuple[str, nn.Module] | None:
    """The module ``owner`` wraps and the child name it keeps it under, or ``None``."""
    kids = module_dict(owner)
    for name in WRAPPER_CHILDREN:
        inner = kids.get(name)
        if inner is not None:
            return name, inner
    if any(c.__name__ in _PARALLEL for c in type(owner).__mro__):
        inner = kids.get("module")
        if inner is not None:
            return "module", inner
    return None


def _describe(owner: nn.Module, path: str, child: str) -> str:
    kind = "peft " if type(owner).__module__.startswith("peft.") else ""
    where = repr(path) if path else "the root"
    return f"{kind}{type(owner).__name__} at {where} (wrapped module kept as {child!r})"


def find(module: nn.Module, name: str) -> Found | None:
    """Follow ``name`` (dotted, relative to ``module``) through wrappers; ``None`` when it does not resolve.

    A step that the current module does not have is looked for in the module it wraps;
    a leaf that is parametrized resolves to its ``original`` tensor.

    Examples:
        >>> import torch
        >>> from torch.nn.utils import parametrizations
        >>> seq = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> _ = parametrizations.orthogonal(seq[0])
        >>> find(seq, "0.weight").path
        '0.parametrizations.weight.original'
    """
    *mods, leaf = name.split(".")
    owner = module
    done: list[str] = []
    via: list[str] = []

    def step_in() -> bool:
        inner = _inner(owner)
        if inner is None:
            return False
        via.append(_describe(owner, ".".join(done), inner[0]))
        done.append(inner[0])
        return True

    for part in mods:
        while part not in module_dict(owner):
            if not step_in():
                return None
            owner = module_dict(owner)[done[-1]]
        sub = module_dict(owner)[part]
        if sub is None:
            return None
        owner = sub
        done.append(part)
    while leaf not in param_dict(owner):
        hooked = hook_v_g(owner, leaf)
        if hooked is not None:  # torch's old weight_norm hook: the blocks are v's (g is one norm per row)
            path = ".".join([*done, leaf + WEIGHT_NORM_V])
            return Found(owner, leaf + WEIGHT_NORM_V, hooked[0], path, (*via, f"weight_norm hook of {leaf!r}"))
        plist = module_dict(owner).get("parametrizations")
        if plist is not None and leaf in module_dict(plist):
            held = module_dict(plist)[leaf]
            assert held is not None
            key = "original"
            if "original" not in param_dict(held):  # weight_norm: g and v; v has the weight's shape
                one = parametrized_original(owner, leaf, ".".join([*done, leaf]))
                key = next(k for k, t in param_dict(held).items() if t is one)
            original = param_dict(held)[key]
            assert original is not None
            path = ".".join([*done, "parametrizations", leaf, key])
            return Found(held, key, original, path, (*via, f"parametrization of {leaf!r}"))
        if not step_in():
            return None
        owner = module_dict(owner)[done[-1]]
    return Found(owner, leaf, param_dict(owner)[leaf], ".".join([*done, leaf]), tuple(via))


def missing(module: nn.Module, name: str) -> str:
    """Why ``name`` does not resolve on ``module``: the module the path stopped at, its class and parameters."""
    mods = name.split(".")[:-1]
    owner = module
    done: list[str] = []
    for part in mods:
        nxt = module_dict(owner).get(part)
        inner = _inner(owner)
        while nxt is None and inner is not None:
            done.append(inner[0])
            owner = inner[1]
            nxt, inner = module_dict(owner).get(part), _inner(owner)
        if nxt is None:
            break
        owner = nxt
        done.append(part)
    at = repr(".".join(done)) if done else "the module itself"
    params = [n for n in param_dict(owner) if param_dict(owner)[n] is not None]
    kids = list(module_dict(owner))
    return (
        f"the name stops at {at}, a {type(owner).__module__}.{type(owner).__qualname__} with parameters "
        f"{params} and children {kids[:8]}{' ...' if len(kids) > 8 else ''}; if that module wraps the one "
        f"the adapter was written for, its wrapped module is not under a name packedinit knows "
        f"({', '.join(WRAPPER_CHILDREN)}, DDP's 'module', parametrizations)"
    )

"""Ties survive materialising: ``to_empty`` that keeps shared Parameters shared.

``nn.Module.to_empty`` gives every module's parameters new tensors one module at a time, so
a Parameter two modules hold (nanoGPT's ``lm_head.weight = transformer.wte.weight``) comes
out as two unrelated tensors, and nothing says so. :func:`to_empty` records which modules
share each tensor before the move and shares the new tensor again after it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from packedinit.errors import PackedInitError
from packedinit.torch_compat import buffer_dict, param_dict

__all__ = ["later_holders", "shared_tensors", "to_empty", "without_later_ties"]

M = TypeVar("M", bound=nn.Module)


def shared_tensors(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter or buffer held in more than one place, as ``[(module, name), ...]`` (the first holder first)."""
    held: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for store in (param_dict(m), buffer_dict(m)):
            for name, t in store.items():
                if t is not None:
                    held.setdefault(id(t), []).append((m, name))
    return [h for h in held.values() if len(h) > 1]


def _store(m: nn.Module, name: str) -> dict[str, Any]:
    return param_dict(m) if name in param_dict(m) else buffer_dict(m)


def to_empty(module: M, *, device: torch.device | str | int | None, recurse: bool = True) -> M:
    """``module.to_empty(device=device)``, with every tie of the module kept.

    The first step of materialising a model built on the meta device
    (``meta -> [fully_shard] -> to_empty -> reset_parameters``). torch's own ``to_empty``
    unties shared Parameters (each module gets its own new tensor); this one records the
    modules that share each tensor before the move and makes them share the new one after.
    A tie it cannot keep (the holders now have tensors of different kinds, one sharded and
    one not) is named in a warning.

    Args:
        module: the model.
        device: where the new (uninitialised) tensors go.
        recurse: as for ``nn.Module.to_empty``.

    Returns:
        ``module`` itself.

    Examples:
        >>> class LM(torch.nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.wte = torch.nn.Embedding(16, 8)
        ...         self.lm_head = torch.nn.Linear(8, 16, bias=False)
        ...         self.lm_head.weight = self.wte.weight  # nanoGPT's tie
        >>> with torch.device("meta"):
        ...     lm = LM()
        >>> lm.to_empty(device="cpu").lm_head.weight is lm.wte.weight  # torch's: untied
        False
        >>> with torch.device("meta"):
        ...     lm = LM()
        >>> to_empty(lm, device="cpu").lm_head.weight is lm.wte.weight
        True
    """
    if not isinstance(module, nn.Module):
        raise PackedInitError(f"to_empty(module) needs an nn.Module, got {type(module).__name__}.")
    ties = shared_tensors(module)
    module.to_empty(device=device, recurse=recurse)
    paths = {id(m): p for p, m in module.named_modules(remove_duplicate=False)}
    lost: list[str] = []
    for held in ties:
        first, name = held[0]
        shared: Any = _store(first, name)[name]
        for m, n in held[1:]:
            new = _store(m, n)[n]
            if new is shared:
                continue  # kept by whoever moved it (FSDP2 keeps its ties)
            if type(new) is not type(shared) or new.shape != shared.shape:
                lost.append(f"{_qualified(paths, m, n)!r} from {_qualified(paths, first, name)!r}")
                continue  # different kinds now (one side sharded): sharing one would be wrong
            _store(m, n)[n] = shared
    if lost:
        warnings.warn(
            f"to_empty({type(module).__name__}): {len(lost)} tie(s) could not be kept: {', '.join(lost)} (the "
            f"holders got tensors of different kinds, e.g. one sharded and one not); tie them again after "
            f"materialising, or shard both holders together.",
            stacklevel=2,
        )
    return module


def _qualified(paths: dict[int, str], m: nn.Module, name: str) -> str:
    prefix = paths.get(id(m), "")
    return f"{prefix}.{name}" if prefix else name


def later_holders(module: nn.Module) -> set[tuple[int, str]]:
    """``(id(module), name)`` of every holder of a shared tensor but the first (in module order).

    The first holder created the tensor; a later one (nanoGPT's ``lm_head``) ran its own init on
    its own tensor at construction, before the tie replaced it, so it must not init the shared one.
    """
    return {(id(m), n) for held in shared_tensors(module) for m, n in held[1:]}


@contextlib.contextmanager
def without_later_ties(m: nn.Module, later: set[tuple[int, str]]) -> Iterator[None]:
    """Meanwhile the tensors ``m`` holds only as a later holder are scratch tensors of the same kind.

    Its init draws what construction drew into its own tensor (so the random stream stays the
    construction's), and the shared tensor keeps what its first holder wrote.
    """
    swapped: list[tuple[dict[str, Any], str, Tensor]] = []
    stores: tuple[dict[str, Any], ...] = (param_dict(m), buffer_dict(m))
    for store in stores:
        for name, t in list(store.items()):
            if t is not None and (id(m), name) in later:
                scratch = torch.empty_like(t)
                is_param = isinstance(t, nn.Parameter)
                store[name] = nn.Parameter(scratch, requires_grad=t.requires_grad) if is_param else scratch
                swapped.append((store, name, t))
    try:
        yield
    finally:
        for store, name, t in swapped:
            store[name] = t

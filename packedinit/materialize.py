"""What a materialising init writes, found before it writes; the transformers hooks it needs.

``reset_parameters`` (in :mod:`packedinit.recipes`) must initialise every parameter that
construction initialised, or name the ones it cannot, *before* writing anything. The init
code of third-party modules (a ``reset_parameters()`` method, a transformers model's
``_init_weights``) is arbitrary Python, so what it covers is found by running it once on
meta stand-ins of the model's tensors (no memory, no random numbers) and recording every
tensor an in-place op writes. transformers is never imported: its classes are recognised
by class path, and only the model's own methods are called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .torch_compat import TorchDispatchMode, buffer_dict, non_persistent_buffers, param_dict, storage_id, written_args

__all__ = [
    "WriteRecorder",
    "dry_run",
    "globalize",
    "hf_flags_cleared",
    "hf_owners",
    "is_hf_pretrained",
    "meta_stand_ins",
    "retie",
    "storage_key",
    "tensor_holders",
    "uncovered_message",
]


def storage_key(t: Tensor) -> int:
    """One key per storage: a tensor, its views and its ``.data`` share it (meta tensors included)."""
    return storage_id(t)


class WriteRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves __init_subclass__ untyped
    """Records the storage of every tensor an op writes in place (``normal_``, ``copy_``, ``w[0].zero_()``)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves __init__ untyped
        self.written: set[int] = set()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for value in written_args(func, args, kwargs):
            if isinstance(value, Tensor):
                self.written.add(storage_key(value))
        return func(*args, **kwargs)


def _stand_in(t: Tensor) -> Tensor:
    meta = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(meta, requires_grad=t.requires_grad)
    return meta


@contextlib.contextmanager
def meta_stand_ins(model: nn.Module) -> Iterator[dict[int, Tensor]]:
    """Within the block every parameter and buffer of ``model`` is a meta tensor of its (global) shape.

    Tied tensors share one stand-in. Yields ``{storage_key(stand_in): original}``; the
    original tensor objects are put back on exit, whatever happened inside.
    """
    memo: dict[int, Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    keys: dict[int, Tensor] = {}
    try:
        for m in model.modules():
            stores: tuple[dict[str, Any], ...] = (param_dict(m), buffer_dict(m))
            for store in stores:
                for name, t in list(store.items()):
                    if t is None:
                        continue
                    s = memo.get(id(t))
                    if s is None:
                        s = memo[id(t)] = _stand_in(t)
                        keys[storage_key(s)] = t
                    swapped.append((store, name, t))
                    store[name] = s
        yield keys
    finally:
        for store, name, t in reversed(swapped):
            store[name] = t


def dry_run(step: Callable[[], object], keys: dict[int, Tensor]) -> list[Tensor] | None:
    """Run ``step`` inside :func:`meta_stand_ins`; the original tensors it writes, or None if it raised.

    The random number generators are restored afterwards, so code that draws on the CPU
    (rather than into the meta stand-ins) changes nothing either.
    """
    recorder = WriteRecorder()
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.no_grad(), recorder:
                step()
        except Exception:  # arbitrary third-party init code on meta tensors: any failure means "unknown"
            return None
    return [keys[k] for k in recorder.written if k in keys]


# -- transformers, by class path -------------------------------------------------------------------
def is_hf_pretrained(m: nn.Module) -> bool:
    """Is ``m`` a transformers ``PreTrainedModel`` (found by class path: transformers is not imported)?"""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__ == "transformers.modeling_utils" for c in type(m).__mro__
    )


def hf_owners(model: nn.Module) -> dict[int, nn.Module]:
    """``id(module) -> the PreTrainedModel whose _init_weights initialises it`` (the nearest, itself included).

    This is the dispatch transformers' ``initialize_weights`` makes (its ``smart_apply``):
    a sub-model that is itself a ``PreTrainedModel`` uses its own ``_init_weights``.
    """
    owners: dict[int, nn.Module] = {}

    def visit(m: nn.Module, owner: nn.Module | None) -> None:
        if is_hf_pretrained(m):
            owner = m
        if owner is not None:
            owners.setdefault(id(m), owner)
        for child in m.children():
            visit(child, owner)

    visit(model, None)
    return owners


def retie(model: nn.Module) -> None:
    """Tie again what the model ties (``tie_weights()`` of the outermost ``PreTrainedModel``s).

    ``Module.to_empty`` replaces every parameter by a new one, so GPT-2's ``lm_head.weight``
    and ``transformer.wte.weight`` come out as two tensors; construction had tied them.
    """

    def visit(m: nn.Module) -> None:
        if is_hf_pretrained(m):
            tie = getattr(m, "tie_weights", None)
            if callable(tie):
                tie()
            return
        for child in m.children():
            visit(child)

    visit(model)


@contextlib.contextmanager
def hf_flags_cleared(model: nn.Module) -> Iterator[None]:
    """transformers' init functions skip tensors flagged ``_is_hf_initialized`` (loaded ones); unflag them meanwhile."""
    flagged = [t for t in (*model.parameters(), *model.buffers()) if getattr(t, "_is_hf_initialized", False)]
    for t in flagged:
        t._is_hf_initialized = False  # type: ignore[attr-defined]  # transformers' own flag on a tensor
    try:
        yield
    finally:
        for t in flagged:
            t._is_hf_initialized = True  # type: ignore[attr-defined]  # put back as found


# -- coverage report and DTensor stand-ins ---------------------------------------------------------
def uncovered_message(module: nn.Module, covered: set[int]) -> str | None:
    """The error/warning text naming every parameter and buffer not in ``covered`` (ids), or None."""
    params = [(n, p) for n, p in module.named_parameters() if id(p) not in covered]
    buffers = [(n, b) for n, b in module.named_buffers() if id(b) not in covered]
    if not params and not buffers:
        return None

    def owner(name: str) -> str:
        return type(module.get_submodule(name.rpartition(".")[0])).__name__

    def shape(t: Tensor) -> str:
        return "(" + ", ".join(str(d) for d in t.shape) + (",)" if t.dim() == 1 else ")")

    parts = [f"{n!r} (shape {shape(p)}, in {owner(n)})" for n, p in params]
    persistent: set[str] = set()
    for prefix, m in module.named_modules():
        kept = (b for b in buffer_dict(m) if b not in non_persistent_buffers(m))
        persistent.update(f"{prefix}.{b}" if prefix else b for b in kept)
    parts += [
        f"buffer {n!r} (shape {shape(b)}, {'persistent' if n in persistent else 'non-persistent'}, in {owner(n)})"
        for n, b in buffers
    ]
    return (
        f"reset_parameters({type(module).__name__}): no known init covers {len(params)} parameter(s) and "
        f"{len(buffers)} buffer(s): {', '.join(parts)}. Their values come from code packedinit cannot see "
        f"(after to_empty they are uninitialised memory). Fix: give the module a reset_parameters() method that "
        f"fills them (torch's convention), or pass strict=False to initialise everything else and fill these "
        f"yourself."
    )


def tensor_holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """``id(tensor) -> [(module, name), ...]``: every module that holds it (a tied tensor has several)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for n, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)):
            holders.setdefault(id(t), []).append((m, n))
    return holders


def globalize(
    stack: contextlib.ExitStack[Any], written: list[Tensor], holders: dict[int, list[tuple[nn.Module, str]]]
) -> None:
    """The DTensors in ``written`` become global-shape tensors until ``stack`` closes (see ``global_params``).

    A tied DTensor (GPT-2's ``wte.weight`` is ``lm_head.weight``) gets one stand-in shared by
    every module that holds it, so whichever module the init code writes through, all agree.
    """
    if not written:
        return
    from .distributed import global_params

    seen: set[int] = set()
    for t in written:
        for m, _ in holders.get(id(t), []):
            if id(m) not in seen:
                seen.add(id(m))
                stack.enter_context(global_params(m))
    for t in written:
        held = holders.get(id(t), [])
        if len(held) > 1:
            first, name = held[0]
            shared = param_dict(first).get(name, buffer_dict(first).get(name))
            for m, n in held[1:]:
                store: dict[str, Any] = param_dict(m) if n in param_dict(m) else buffer_dict(m)
                store[n] = shared  # the global stand-in of the same tensor

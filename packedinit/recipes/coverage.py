"""What a materialising init writes, found before it writes; the transformers hooks it needs.

``reset_parameters`` (in :mod:`packedinit.recipes.reset`) must initialise every parameter that
construction initialised, or name the ones it cannot, *before* writing anything. The init
code of third-party modules (a ``reset_parameters()`` method, a transformers model's
``_init_weights``) is arbitrary Python, so what it covers is found by running it once on
meta stand-ins of the model's tensors (no memory, no random numbers) and recording every
tensor an in-place op writes. transformers is never imported: its classes are recognised
by class path, and only the model's own methods are called.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from packedinit.engine.rng import global_restored
from packedinit.engine.traits import TORCH_INIT  # torch's own functions, also while fix_torch_defaults() replaces them
from packedinit.torch_compat import (
    RESET_METHOD,
    TorchDispatchMode,
    buffer_dict,
    non_persistent_buffers,
    param_dict,
    storage_id,
    written_args,
)

__all__ = [
    "StandIns",
    "WriteRecorder",
    "dry_run",
    "globalize",
    "hf_flags_cleared",
    "hf_owners",
    "is_hf_pretrained",
    "meta_noop_inits",
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


def meta_noop_inits() -> dict[types.CodeType, str]:
    """The ``torch.nn.init`` functions that return early on meta tensors, by code object.

    torch 2.13's ``trunc_normal_``, ``orthogonal_``, ``dirac_`` and ``sparse_`` test
    ``tensor.is_meta`` and return before any op, so no dispatch mode sees their write.
    Found by what the functions read (``is_meta``), so the set follows the installed torch.

    Examples:
        >>> found = sorted(set(meta_noop_inits().values()) & {"orthogonal_", "dirac_", "sparse_"})
        >>> found == (["dirac_", "orthogonal_", "sparse_"] if torch.__version__ >= "2.7" else [])  # 2.6: none
        True
    """
    found: dict[types.CodeType, str] = {}
    for name, f in vars(TORCH_INIT).items():
        code = getattr(f, "__code__", None)
        if not isinstance(f, types.FunctionType) or not isinstance(code, types.CodeType):
            continue
        if "is_meta" in code.co_names and code.co_varnames[:1] == ("tensor",):
            found[code] = name
    return found


@contextlib.contextmanager
def _calls_recorded(written: set[int], codes: dict[types.CodeType, str]) -> Iterator[None]:
    """Meanwhile every call of a function in ``codes`` adds its ``tensor``'s storage to ``written``.

    A profile hook sees the call whoever makes it and under whatever name the function was
    imported (``from torch.nn.init import trunc_normal_``, transformers' wrappers); a profiler
    already installed keeps being called.
    """
    before = sys.getprofile()

    def hook(frame: types.FrameType, event: Any, arg: object) -> object:
        if event == "call" and frame.f_code in codes:
            t = frame.f_locals.get("tensor")
            if isinstance(t, Tensor) and t.is_meta:
                written.add(storage_key(t))
        if before is not None:
            before(frame, event, arg)
        return None

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(before)


def _stand_in(t: Tensor) -> Tensor:
    meta = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(meta, requires_grad=t.requires_grad)
    return meta


@dataclass
class StandIns:
    """The meta stand-ins of a model: ``keys`` maps ``storage_key(stand_in)`` to the original tensor.

    ``slots`` are ``(store, name, stand_in, original)``: where each stand-in sits, so that a
    step that *assigns* a new tensor to a slot (litgpt's ``self.cos, self.sin = self.rope_cache()``)
    is seen to fill it.
    """

    keys: dict[int, Tensor] = field(default_factory=dict)
    slots: list[tuple[dict[str, Any], str, Tensor, Tensor]] = field(default_factory=list)

    def originals(self, tensors: list[Tensor]) -> list[Tensor]:
        """The original tensors of these stand-ins (tensors that are no stand-in are left out)."""
        return [self.keys[k] for k in (storage_key(t) for t in tensors) if k in self.keys]


@contextlib.contextmanager
def meta_stand_ins(model: nn.Module) -> Iterator[StandIns]:
    """Within the block every parameter and buffer of ``model`` is a meta tensor of its (global) shape.

    Tied tensors share one stand-in. Yields the :class:`StandIns`; the original tensor
    objects are put back on exit, whatever happened inside (assigned ones included).
    """
    memo: dict[int, Tensor] = {}
    found = StandIns()
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
                        found.keys[storage_key(s)] = t
                    found.slots.append((store, name, s, t))
                    store[name] = s
        yield found
    finally:
        for store, name, _, t in reversed(found.slots):
            store[name] = t


def dry_run(step: Callable[[], object], stand_ins: StandIns) -> list[Tensor] | None:
    """Run ``step`` inside :func:`meta_stand_ins`; the original tensors it fills, or None if it raised.

    Filled means written in place by an op (``normal_``, ``copy_``, ``w[0].zero_()``), handed
    to an init function that is a no-op on meta (:func:`meta_noop_inits`), or replaced by
    assignment (``self.cos = ...``; the stand-in is put back for the next step). The random
    number generators are restored afterwards, so code that draws on the CPU (rather than
    into the meta stand-ins) changes nothing either.
    """
    recorder = WriteRecorder()
    codes = meta_noop_inits()
    with global_restored():  # under packedinit.engine.rng.LOCK; a state nobody changed is not written back
        try:
            with torch.no_grad(), _calls_recorded(recorder.written, codes), recorder:
                step()
        except Exception:  # arbitrary third-party init code on meta tensors: any failure means "unknown"
            return None
        finally:
            assigned = [(store, name, s, t) for store, name, s, t in stand_ins.slots if store.get(name) is not s]
            for store, name, s, _ in assigned:
                store[name] = s
    filled = [stand_ins.keys[k] for k in recorder.written if k in stand_ins.keys]
    seen = {id(t) for t in filled}
    for *_, t in assigned:
        if id(t) not in seen:
            seen.add(id(t))
            filled.append(t)
    return filled


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
    """transformers skips what is flagged ``_is_hf_initialized`` (loaded tensors, initialised modules): unflag it.

    The flag sits on tensors (``transformers.initialization``'s functions test it) and on
    modules (``_initialize_weights`` skips a flagged module; ViTMAE's sin-cos position
    embedding tests it on ``patch_embeddings.projection``).
    """
    things: list[object] = [*model.parameters(), *model.buffers(), *model.modules()]
    flagged = [t for t in things if getattr(t, "_is_hf_initialized", False)]
    for t in flagged:
        t._is_hf_initialized = False  # type: ignore[attr-defined]  # transformers' own flag
    try:
        yield
    finally:
        for t in flagged:
            t._is_hf_initialized = True  # type: ignore[attr-defined]  # put back as found


# -- coverage report and DTensor stand-ins ---------------------------------------------------------
def _has_own_init(m: nn.Module) -> bool:
    return any(callable(getattr(m, name, None)) for name in ("reset_parameters", RESET_METHOD))


def uncovered_message(module: nn.Module, covered: set[int]) -> str | None:
    """The error/warning text naming every parameter and buffer not in ``covered`` (ids), or None.

    The fix it names follows the owner: a module without an init method is told to get a
    ``reset_parameters()``; one whose method ran and left them is told that method misses them.
    """
    params = [(n, p) for n, p in module.named_parameters() if id(p) not in covered]
    buffers = [(n, b) for n, b in module.named_buffers() if id(b) not in covered]
    if not params and not buffers:
        return None

    def owner_of(name: str) -> nn.Module:
        return module.get_submodule(name.rpartition(".")[0])

    def shape(t: Tensor) -> str:
        return "(" + ", ".join(str(d) for d in t.shape) + (",)" if t.dim() == 1 else ")")

    parts = [f"{n!r} (shape {shape(p)}, in {type(owner_of(n)).__name__})" for n, p in params]
    persistent: set[str] = set()
    for prefix, m in module.named_modules():
        kept = (b for b in buffer_dict(m) if b not in non_persistent_buffers(m))
        persistent.update(f"{prefix}.{b}" if prefix else b for b in kept)
    parts += [
        f"buffer {n!r} (shape {shape(b)}, {'persistent' if n in persistent else 'non-persistent'}, "
        f"in {type(owner_of(n)).__name__})"
        for n, b in buffers
    ]
    owners = {id(o): o for o in (owner_of(n) for n, _ in (*params, *buffers))}
    with_method = sorted({type(o).__name__ for o in owners.values() if _has_own_init(o)})
    without = sorted({type(o).__name__ for o in owners.values() if not _has_own_init(o)})
    fixes = []
    if without:
        fixes.append(f"give {', '.join(without)} a reset_parameters() method that fills them (torch's convention)")
    if with_method:
        fixes.append(
            f"make the reset_parameters() of {', '.join(with_method)} fill them too (it ran on meta stand-ins "
            f"and wrote none of them)"
        )
    return (
        f"reset_parameters({type(module).__name__}): no known init covers {len(params)} parameter(s) and "
        f"{len(buffers)} buffer(s): {', '.join(parts)}. Their values come from code packedinit cannot see "
        f"(after to_empty they are uninitialised memory). Fix: {'; '.join(fixes)}, or pass strict=False to "
        f"initialise everything else and fill these yourself."
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
    from packedinit.engine.distributed import global_params

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

"""Plans: a request (tensor, layout, functions, arguments, generator, name) -> a validated Plan.

Every check that can fail runs here, before any write: the layout against the shape, the
functions against the layout, dtypes, arguments torch checks only late, the tensor's memory
(stride-0 and overlapping rows), the generator's device, and a dry run of every distinct
(function, block shape) on meta tensors. A plan made only of ``torch.nn.init`` functions is
cached under a key that holds everything the checks read, so a repeated call (same shape,
strides, dtype, device, layout, functions and arguments) reuses it and no check is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, TypeAlias

import torch
from torch import Tensor

from packedinit.engine.chunks import Chunks, as_layout
from packedinit.engine.direct import DirectDraw, direct_draw
from packedinit.engine.dryrun import dry_run
from packedinit.engine.keys import request_key
from packedinit.engine.traits import (
    DETERMINISTIC_FNS,
    TORCH_FNS,
    accepts_generator,
    base,
    check_fn_dtype,
    check_values,
    compute_dtype,
    fn_name,
    hashable_in,
    substitute,
    who,
)
from packedinit.errors import PackedInitError, packed_error
from packedinit.layout import Layout, LogicalBlock
from packedinit.shapes import fmt_shape, is_int

__all__ = [
    "InitFn",
    "InitSpec",
    "Request",
    "Plan",
    "make_plan",
    "cacheable",
    "Where",
    "check_tensor",
    "INFERENCE_FIX",
    "inference_refused",
]

#: An init function: ``fn(tensor, *args, **kwargs) -> tensor``, filling ``tensor`` in place.
InitFn: TypeAlias = Callable[..., Tensor]
#: One init fn for every block, one per part (``None`` skips a part), or a mapping by part name/index.
InitSpec: TypeAlias = InitFn | Sequence[InitFn | None] | Mapping[str | int, InitFn]


@dataclass(frozen=True)
class Request:
    """One init call: what :func:`packedinit.chunked_init` was asked, as one value.

    ``chunks``/``dim`` describe the layout (``None`` for one block), ``init_fn`` the
    function(s), ``args``/``kwargs`` their arguments (``generator=`` included) and
    ``param`` the tensor's name for messages.
    """

    tensor: Tensor = field(metadata={"key": "facts"})  # cache keys hold its facts, never the tensor
    chunks: Chunks | None = None
    dim: int | None = None
    init_fn: InitSpec | None = None
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    param: str | None = None


class Where:
    """``"parameter 'w' of shape (...)[ with Layout(...)]"``, built only when an error message needs it."""

    __slots__ = ("layout", "param", "shape")

    def __init__(self, param: str | None, shape: Sequence[int], layout: Layout | None = None) -> None:
        self.param, self.shape, self.layout = param, shape, layout

    def __str__(self) -> str:
        tail = f" with {self.layout!r}" if self.layout is not None else ""
        return f"{who(self.param)} of shape {fmt_shape(self.shape)}{tail}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


@dataclass(frozen=True)
class Plan:
    """A validated plan: which function fills which block, with which arguments.

    Built by :func:`make_plan` before anything is written; consumed by
    :func:`packedinit.engine.execute.execute` (the one block loop) for local tensors and DTensor shards.

    ``verified`` is False when some init function could not be tried on meta
    tensors (it reads values, or does not support meta); the executor then keeps
    a copy of the tensor so that a failing block can be undone.

    A Plan is a pure value: nothing in it changes after it is made. The plan cache keeps
    plans without a generator; :meth:`bind` gives a cached plan the caller's generator
    for one call, so no cache keeps a caller's generator alive.
    """

    layout: Layout
    blocks: tuple[LogicalBlock, ...]
    fns: tuple[Callable[..., Tensor] | None, ...]  # one per block (None: skip)
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    generator: torch.Generator | None
    shape: torch.Size
    dtype: torch.dtype
    param: str | None
    verified: bool = True
    #: Per block, the one ``uniform_``/``normal_`` call its function makes, where known exactly (else None);
    #: computed when the plan is made (a generator does not change it: see :func:`~packedinit.engine.traits.draw`).
    direct: tuple[DirectDraw | None, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.direct and self.blocks:
            object.__setattr__(self, "direct", self._direct())

    def bind(self, generator: torch.Generator | None) -> Plan:
        """This plan for a call with ``generator`` (itself when it already has it)."""
        return self if generator is self.generator else replace(self, generator=generator)

    def _direct(self) -> tuple[DirectDraw | None, ...]:
        out: list[DirectDraw | None] = []
        known: dict[tuple[int, int | None, int | None], DirectDraw | None] = {}
        for b in self.blocks:
            fn = self.fns[b.index]
            if fn is None:
                out.append(None)
                continue
            key = (id(fn), b.fan_in, b.fan_out)
            if key not in known:
                known[key] = direct_draw(fn, self.args, self.kwargs, b.fan_in, b.fan_out)
            out.append(known[key])
        return tuple(out)

    def where(self) -> str:
        """``"parameter 'w' of shape (...) with Layout(...)"``, for messages."""
        return str(Where(self.param, self.shape, self.layout))

    def compute_dtype(self, fn: Callable[..., Tensor]) -> torch.dtype:
        """The dtype a block is computed in: float32 for orthogonal_ on fp16/bf16."""
        return compute_dtype(fn, self.dtype)

    def todo(self) -> list[LogicalBlock]:
        """The blocks that are written: a function and at least one element."""
        return [b for b in self.blocks if self.fns[b.index] is not None and b.numel]

    def draws(self, fn: Callable[..., Tensor]) -> bool:
        """Whether ``fn`` may draw random numbers (so it must run even where its values are not kept)."""
        return not hashable_in(base(fn), DETERMINISTIC_FNS)

    def _prepare(self, fn: Callable[..., Tensor]) -> tuple[Callable[..., Tensor], Mapping[str, Any]]:
        run = substitute(fn)
        if self.generator is not None and accepts_generator(run) is not False:
            return run, {**self.kwargs, "generator": self.generator}
        return run, self.kwargs

    def call(self, fn: Callable[..., Tensor], block_tensor: Tensor) -> Tensor:
        """Run ``fn`` on a tensor of a block's logical shape; return what holds the values.

        ``fn`` may fill ``block_tensor`` in place (and return it or ``None``) or return
        a new tensor of the block's shape; any other shape raises ``ValueError``.
        """
        run, kwargs = self._prepare(fn)
        out = run(block_tensor, *self.args, **kwargs)
        if out is block_tensor or not isinstance(out, Tensor):
            return block_tensor
        if out.shape != block_tensor.shape:
            raise ValueError(
                f"{fn_name(fn)} returned a tensor of shape {fmt_shape(out.shape)} for a block of shape "
                f"{fmt_shape(block_tensor.shape)}; an init function must fill its argument in place or "
                f"return a tensor of the same shape"
            )
        return out


def _resolve_fns(
    init_fn: InitSpec | None,
    layout: Layout,
    blocks: tuple[LogicalBlock, ...],
    where: object,
) -> tuple[Callable[..., Tensor] | None, ...]:
    if init_fn is None:
        raise PackedInitError(f"{where}: no init_fn given; pass e.g. init_fn=torch.nn.init.xavier_uniform_.")
    per_part: list[Callable[..., Tensor] | None]
    if isinstance(init_fn, Mapping):
        per_part = [None] * layout.num_parts
        for key, item in init_fn.items():
            if isinstance(key, str) and (layout.names is None or key not in layout.names):
                known = list(layout.names) if layout.names else "none: give the Layout names=(...)"
                raise PackedInitError(
                    f"{where}: init_fn names block {key!r}, which the layout does not have; known names: {known}."
                )
            if not isinstance(key, str) and (not is_int(key) or not -layout.num_parts <= int(key) < layout.num_parts):
                raise PackedInitError(
                    f"{where}: init_fn key {key!r} is neither a block name nor a part index "
                    f"in 0..{layout.num_parts - 1}."
                )
            j = layout.part_index(key if isinstance(key, str) else int(key))
            if per_part[j] is not None:
                raise PackedInitError(f"{where}: init_fn gives part {j} twice (as {key!r}); give each block once.")
            if not callable(item):
                raise PackedInitError(f"{where}: init_fn[{key!r}] = {item!r} is not callable.")
            per_part[j] = item
    elif callable(init_fn):
        per_part = [init_fn] * layout.num_parts
    elif isinstance(init_fn, Sequence) and not isinstance(init_fn, (str, bytes)):
        per_part = list(init_fn)
        if len(per_part) != layout.num_parts:
            raise PackedInitError(
                f"{where}: {len(per_part)} init functions for {layout.num_parts} blocks; "
                f"give one per block (None leaves a block untouched)."
            )
        for k, fn in enumerate(per_part):
            if fn is not None and not callable(fn):
                raise PackedInitError(f"{where}: init_fn[{k}] = {fn!r} is not callable.")
    else:
        raise PackedInitError(
            f"{where}: init_fn must be a function, a list of functions (one per block) or a mapping "
            f"by block name, got {type(init_fn).__name__}."
        )
    return tuple(per_part[b.part] for b in blocks)


INFERENCE_FIX = (
    "the tensor was created under torch.inference_mode() and cannot be written outside it; "
    "init it inside `with torch.inference_mode():` or create it outside inference mode."
)


def inference_refused(tensor: Tensor, param: str | None) -> PackedInitError:
    """The error for an inference tensor outside inference mode (a RuntimeError, as torch's own)."""
    where = Where(param, tensor.shape)
    what = "Inplace update to inference tensor outside InferenceMode"
    return packed_error(f"{where}: {what}: {INFERENCE_FIX} Nothing was written.", RuntimeError(what))


def _may_overlap(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether two elements of a strided tensor may share memory (False is proof they don't)."""
    dims = sorted((st, n) for n, st in zip(shape, stride, strict=True) if n > 1)
    extent = 1  # one past the largest offset the smaller-stride dims reach
    for st, n in dims:
        if st < extent:
            return True
        extent += st * (n - 1)
    return False


def check_tensor(tensor: Tensor, generator: torch.Generator | None, where: object) -> None:
    """Checks of the tensor itself: writable here, owns each element once, generator on its device."""
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise PackedInitError(f"{where}: {INFERENCE_FIX}")
    if not tensor.is_meta and tensor.layout == torch.strided:
        shared = [d for d, (n, st) in enumerate(zip(tensor.shape, tensor.stride(), strict=True)) if n > 1 and st == 0]
        if shared:
            raise PackedInitError(
                f"{where}: dim {shared[0]} has stride 0 (an expanded tensor): its rows share memory, so blocks "
                f"would overwrite each other; init a tensor that owns its memory (e.g. .clone() it)."
            )
        if _may_overlap(tensor.shape, tensor.stride()):
            raise PackedInitError(
                f"{where}: strides {tuple(tensor.stride())} make elements share memory (an overlapping view, "
                f"e.g. from as_strided), so blocks would overwrite each other; init a tensor that owns its "
                f"memory (e.g. .clone() it). Nothing was written."
            )
    if generator is not None and not tensor.is_meta and generator.device.type != tensor.device.type:
        raise PackedInitError(
            f"{where}: generator is on {generator.device} but the tensor is on {tensor.device}; "
            f"pass torch.Generator(device={tensor.device.type!r})."
        )


def _check_fn(tensor: Tensor, fn: Callable[..., Tensor], generator: torch.Generator | None, where: object) -> None:
    """Checks of one function on this tensor that need no call: dtype, generator."""
    check_fn_dtype(tensor.dtype, fn, where)
    if generator is not None and not hashable_in(base(fn), DETERMINISTIC_FNS) and accepts_generator(fn) is False:
        raise PackedInitError(
            f"{where}: generator= was given but {fn_name(fn)} takes no generator and would draw from "
            f"the global RNG; give it a `generator` parameter or drop generator=."
        )


#: Validated plans of torch.nn.init functions, by everything their checks read. Bounded; cleared when full.
_PLANS: dict[tuple[object, ...], Plan | None] = {}
_PLANS_MAX = 4096


def make_plan(req: Request, *, full: bool = False) -> Plan | None:
    """Validate everything and build a :class:`Plan`; ``None`` when nothing is to be written.

    Runs every check (layout against shape, functions, dtypes, arguments, the tensor's
    memory, generator) and, when more than one block is written (or the tensor is on
    meta, or ``full``), a dry run of every distinct (function, block shape) on meta tensors, so
    that an init function that rejects a block does so before the first write. A whole-model
    caller passes ``full=True``: one parameter's rejection must come before any other is written.
    """
    tensor = req.tensor
    if not isinstance(tensor, Tensor):
        raise PackedInitError(f"expected a torch.Tensor (or nn.Module with chunked), got {type(tensor).__name__}.")
    shape = tensor.shape
    layout = as_layout(req.chunks, req.dim, shape, param=req.param)
    if layout is None:
        if req.init_fn is None:
            raise PackedInitError(f"no init_fn given for {who(req.param)} of shape {fmt_shape(shape)}.")
        return None
    key = request_key(req, full)
    if key is not None:
        try:
            cached = _PLANS[key]
        except KeyError:
            pass
        else:
            return cached.bind(_generator(req)) if cached is not None else None
    plan = _make_plan(req, layout, full)
    if key is not None and cacheable(plan):
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()  # simple and safe under threads; refilled by the next calls
        _PLANS[key] = plan.bind(None)  # the cache keeps no generator alive
    return plan


def _generator(req: Request) -> torch.Generator | None:
    gen = req.kwargs.get("generator")
    return gen if isinstance(gen, torch.Generator) else None


def cacheable(plan: Plan) -> bool:
    """Whether ``plan`` may be reused for an equal request: verified, and only torch.nn.init functions.

    Only torch's own functions themselves: a plan holding a caller's ``functools.partial``
    would keep it alive in the cache.
    """
    return plan.verified and all(f is None or hashable_in(f, TORCH_FNS) for f in plan.fns)


def _make_plan(req: Request, layout: Layout, full: bool) -> Plan:
    tensor = req.tensor
    shape = tensor.shape
    blocks = layout.blocks(shape, param=req.param)
    kwargs = dict(req.kwargs)
    generator = kwargs.pop("generator", None)
    where: Any = Where(req.param, shape, layout)  # formatted only when a message is
    if generator is not None and not isinstance(generator, torch.Generator):
        raise PackedInitError(f"{where}: generator must be a torch.Generator, got {type(generator).__name__}.")
    fns = _resolve_fns(req.init_fn, layout, blocks, where)
    check_tensor(tensor, generator, where)
    args = tuple(req.args)
    for fn in {id(fn): fn for fn in fns if fn is not None}.values():
        _check_fn(tensor, fn, generator, where)
        check_values(fn, args, kwargs, where)
    frozen = MappingProxyType(kwargs)
    plan = Plan(layout, blocks, fns, args, frozen, generator, shape, tensor.dtype, req.param)
    if (full or tensor.is_meta or len(plan.todo()) > 1) and not dry_run(plan):
        plan = replace(plan, verified=False)
    return plan

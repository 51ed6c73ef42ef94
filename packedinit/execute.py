"""The executor: one block loop, one scratch buffer, one rollback, one error, for every kind of target.

:func:`execute` owns the loop over a :class:`~packedinit.plan.Plan`'s blocks, the RNG
bookkeeping, the rollback of a failed unverified plan and the error. Where a block lands is
a small :class:`Sink`: :class:`LocalSink` writes a plain tensor (in place where the block's
logical view is contiguous, through the scratch buffer and a tiled transposing copy
otherwise); :mod:`packedinit.distributed` adds a sink that keeps one rank's shard.

:func:`run_whole` is the lean path for an unpacked tensor: the init function is called on
the tensor itself, exactly as a plain call would, with errors turned into PackedInitError.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from .layout import Layout, LogicalBlock, fmt_shape
from .plan import INFERENCE_FIX, Plan, Request, Where, check_tensor, rejected
from .torch_compat import set_grad_enabled
from .traits import (
    GENERATOR_OK,
    LEAN,
    LOW_PRECISION,
    REJECTIONS,
    TORCH_FNS,
    UNIFORM_FNS,
    DirectDraw,
    base,
    check_fn_dtype,
    check_values,
    compute_dtype,
    convertible,
    draw,
    fn_name,
    hashable_in,
    joins,
)

__all__ = [
    "Scratch",
    "RngState",
    "Sink",
    "LocalSink",
    "execute",
    "fill_block",
    "run_whole",
    "lean_call",
    "lean_flags",
    "lean_ok",
    "PLAIN_TYPES",
]

_init = torch.nn.init
PLAIN_TYPES = (Tensor, nn.Parameter)


class Scratch:
    """One flat contiguous buffer per (dtype, device, inference mode), grown on demand and reused."""

    __slots__ = ("_bufs",)

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.dtype, torch.device, bool, int], Tensor] = {}

    def flat(self, n: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> Tensor:
        """The shared flat buffer number ``slot``, at least ``n`` elements long."""
        key = (dtype, device, torch.is_inference_mode_enabled(), slot)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf

    def get(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A contiguous tensor of ``shape`` (uninitialised), a view of the shared buffer."""
        n = math.prod(shape)
        return self.flat(n, dtype, device)[:n].view(shape)


class RngState:
    """The random state a failed, undone init restores: CPU, the tensor's CUDA device, the generator."""

    def __init__(self, device: torch.device, generator: torch.Generator | None) -> None:
        self.cpu = torch.get_rng_state()
        self.device = device if device.type == "cuda" else None
        self.cuda = torch.cuda.get_rng_state(device) if self.device is not None else None
        self.generator = generator
        self.gen = generator.get_state() if generator is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        if self.generator is not None and self.gen is not None:
            self.generator.set_state(self.gen)


def fill_block(plan: Plan, block: LogicalBlock, fn: Callable[..., Tensor], out: Tensor) -> None:
    """Fill ``out`` (contiguous, ``block.shape``, any dtype) with the block's init."""
    cdt = plan.compute_dtype(fn)
    if cdt != out.dtype:
        tmp = torch.empty(block.shape, dtype=cdt, device=out.device)
        out.copy_(plan.call(fn, tmp))
        return
    res = plan.call(fn, out)
    if res is not out:
        out.copy_(res)


class Sink(Protocol):
    """Where the blocks of a plan land. :func:`execute` drives it block by block."""

    #: The device blocks are generated on (for the RNG state a rollback restores).
    device: torch.device
    #: Set by :meth:`write` before it calls the init function: whether that call writes the target's memory.
    direct: bool

    def write(self, plan: Plan, block: LogicalBlock, fn: Callable[..., Tensor], scratch: Scratch) -> None:
        """Generate ``block`` with ``fn`` and put (its part of) it in place."""

    def runs(self, plan: Plan, todo: list[LogicalBlock]) -> list[tuple[LogicalBlock, ...]]:
        """``todo`` in order, cut into runs that one write fills (a run of one block: :meth:`write`)."""

    def write_run(self, plan: Plan, run: tuple[LogicalBlock, ...]) -> None:
        """Fill a run of several blocks that :meth:`runs` made, with one draw."""

    def backup(self) -> Tensor:
        """A copy of everything :meth:`write` may change."""

    def restore(self, backup: Tensor) -> None:
        """Put back what :meth:`backup` returned."""


class _Where(NamedTuple):
    """Where one block lives in a tensor of given shape and strides (all as_strided arguments).

    ``inplace``: the block's logical view is contiguous: ``as_strided(block.shape, *view)``.
    ``ordered``: the logical view exists, is not contiguous, but its memory order is its
    row-major order (a dim-1 split): ``view`` holds it too. Otherwise ``storage`` is (shape,
    stride, offset) of the block's storage view and ``from_logical`` the (shape, stride)
    that views a contiguous logical tensor the same way.
    """

    inplace: bool
    ordered: bool
    view: tuple[tuple[int, ...], int]
    contiguous: tuple[int, ...]
    storage: tuple[tuple[int, ...], tuple[int, ...], int]
    from_logical: tuple[tuple[int, ...], tuple[int, ...]]


#: Elements per band of a banded transposed draw: a (band, in) slab and its transpose stay in L2.
_BAND = 1 << 18


def _copy_transposed(dst: Tensor, logical: Tensor, scratch: Scratch) -> None:
    """``dst.copy_(logical.t())`` for a strided ``(in, out)`` destination.

    Two passes, each one torch's fast kind of copy: ``logical.t()`` into a contiguous
    ``(in, out)`` buffer (ATen's blocked 2-D transpose, taken when the target is
    contiguous), then row by row into ``dst``. About three times faster on CPU than one
    strided copy, tiled or not (measured at E = 1024: 1.0 ms against 3.2 ms per block).
    """
    if dst.is_contiguous() and dst.dtype == logical.dtype:  # one pass: ATen's blocked transpose straight in
        dst.copy_(logical.t())
        return
    rows, cols = logical.shape
    tmp = scratch.flat(rows * cols, logical.dtype, logical.device, slot=1)[: rows * cols].view(cols, rows)
    tmp.copy_(logical.t())
    dst.copy_(tmp)


def _draw_banded(dst: Tensor, block: LogicalBlock, d: DirectDraw, plan: Plan, scratch: Scratch) -> bool:
    """Draw a block in bands of logical rows and write each band transposed while in cache; False: not possible.

    ``dst`` is the ``(in, out)`` storage view whose column ``r`` is logical row ``r``. Bands
    drawn in row order hold exactly what one draw of the whole block would where
    :func:`~packedinit.traits.joins` allows it: always for ``uniform_``; for ``normal_`` when
    every band but the last is a multiple of 16 elements (the engine tests check it bit for bit).
    """
    rows, cols = block.shape
    step = max(1, min(rows, _BAND // max(cols, 1)))
    if d[0] == "normal":
        while step < rows and (step * cols) % 16:
            step += 1
        if step < rows and (step * cols) % 16:
            return False
    band = scratch.flat(step * cols, dst.dtype, dst.device)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        b = band[: n * cols].view(n, cols)
        draw(b, d, plan.generator)
        _copy_transposed(dst[:, r : r + n], b, scratch)
    return True


def _row_major(t: Tensor) -> bool:
    """Whether walking ``t`` in memory order visits its elements in row-major order (no overlap)."""
    extent = 1
    for size, stride in reversed(list(zip(t.shape, t.stride(), strict=True))):
        if size == 1:
            continue
        if stride < extent:
            return False
        extent = stride * size
    return True


@functools.lru_cache(maxsize=4096)
def _geometry(layout: Layout, shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[_Where, ...]:
    """Per block, where it lives, computed once on meta tensors (pure, cached)."""
    meta = torch.empty_strided(shape, stride, device="meta")
    out: list[_Where] = []
    for block in layout.blocks(shape):
        logical = torch.empty(block.shape, device="meta")
        lv = layout.logical_view(meta, block)
        inplace = lv is not None and lv.is_contiguous()
        ordered = lv is not None and not inplace and not layout.transposed and _row_major(lv)
        sv = layout.storage_view(meta, block)
        ts = layout.to_storage(logical, block, len(shape))
        out.append(
            _Where(
                inplace,
                ordered,
                (tuple(lv.stride()), int(lv.storage_offset())) if lv is not None and (inplace or ordered) else ((), 0),
                tuple(logical.stride()),
                (tuple(sv.shape), tuple(sv.stride()), int(sv.storage_offset())),
                (tuple(ts.shape), tuple(ts.stride())),
            )
        )
    return tuple(out)


class LocalSink:
    """A plain (non-meta) local tensor: blocks land in place or through the scratch buffer."""

    __slots__ = ("cpu", "device", "direct", "geometry", "layout", "ndim", "offset", "tensor", "tiled")

    def __init__(self, tensor: Tensor, layout: Layout) -> None:
        self.tensor = tensor
        self.layout = layout
        self.device = tensor.device
        self.cpu = tensor.device.type == "cpu"
        self.ndim = tensor.dim()
        self.tiled = layout.transposed and layout.normalized_dim(self.ndim) - layout.batch_dims == 1
        plain = type(tensor) in PLAIN_TYPES
        self.geometry = _geometry(layout, tuple(tensor.shape), tuple(tensor.stride())) if plain else None
        self.offset = tensor.storage_offset()
        self.direct = False

    def backup(self) -> Tensor:
        return self.tensor.detach().clone()

    def restore(self, backup: Tensor) -> None:
        self.tensor.copy_(backup)

    def runs(self, plan: Plan, todo: list[LogicalBlock]) -> list[tuple[LogicalBlock, ...]]:
        """Adjacent in-place blocks that make the same direct draw, merged where that draws the same numbers.

        On CPU one ``uniform_``/``normal_`` call over blocks that follow each other in memory
        draws exactly what one call per block draws, under the rule of
        :func:`~packedinit.traits.joins` (the engine tests check it bit for bit). CUDA draws
        per launch: never merged there.
        """
        geometry = self.geometry
        if not self.cpu or geometry is None or len(todo) < 2:
            return [(b,) for b in todo]
        direct = plan.direct
        out: list[tuple[LogicalBlock, ...]] = []
        run: list[LogicalBlock] = []
        end = -1
        for b in todo:
            g, d = geometry[b.index], direct[b.index]
            fits = d is not None and g.inplace  # direct draws are made in the tensor's dtype
            prev = run[-1] if run else None
            same_draw = d is not None and d == direct[prev.index] if prev is not None else False
            if prev is not None and d is not None and fits and same_draw and g.view[1] == end and joins(d, prev.numel):
                run.append(b)
            else:
                if run:
                    out.append(tuple(run))
                run = [b] if fits else []
                if not fits:
                    out.append((b,))
            end = g.view[1] + b.numel if fits else -1
        if run:
            out.append(tuple(run))
        return out

    def write_run(self, plan: Plan, run: tuple[LogicalBlock, ...]) -> None:
        assert self.geometry is not None  # runs() merges only with a geometry
        d = plan.direct[run[0].index]
        assert d is not None  # runs() merges only blocks with a direct draw
        start = self.geometry[run[0].index].view[1]
        n = sum(b.numel for b in run)
        self.direct = True
        draw(self.tensor.as_strided((n,), (1,), self.offset + start), d, plan.generator)

    def write(self, plan: Plan, block: LogicalBlock, fn: Callable[..., Tensor], scratch: Scratch) -> None:
        tensor, layout = self.tensor, self.layout
        cdt = compute_dtype(fn, tensor.dtype)
        same = cdt == tensor.dtype
        self.direct = False
        g = self.geometry[block.index] if self.geometry is not None else None
        if g is not None:
            if same and (g.inplace or (g.ordered and self.cpu and hashable_in(base(fn), UNIFORM_FNS))):
                lv = tensor.as_strided(block.shape, g.view[0], self.offset + g.view[1])
                d = plan.direct[block.index]
                self.direct = True
                if d is not None:  # exactly the call the torch.nn.init function would make
                    draw(lv, d, plan.generator)
                else:
                    self._fill_view(plan, fn, lv)
                return
            sshape, sstride, soff = g.storage
            dst = tensor.as_strided(sshape, sstride, self.offset + soff)
            # storage (in, groups, size) with one of groups/size 1: logical row r is column r
            columns = self.tiled and len(block.shape) == 2 and (layout.groups == 1 or sshape[2] == 1)
            d = plan.direct[block.index]
            target = (dst[:, 0, :] if layout.groups == 1 else dst[:, :, 0]) if columns else dst
            if columns and self.cpu and d is not None and same and not target.is_contiguous():
                # a column slab: draw in bands that stay in cache (a whole contiguous target takes one
                # transposing copy below, which is cheaper)
                self.direct = True
                if _draw_banded(target, block, d, plan, scratch):
                    return
                self.direct = False
            buf = scratch.flat(block.numel, cdt, tensor.device).as_strided(block.shape, g.contiguous)
            res = plan.call(fn, buf)
            if columns and res.dim() == 2:
                _copy_transposed(target, res, scratch)
            elif res is buf:
                dst.copy_(res.as_strided(*g.from_logical))
            else:
                dst.copy_(layout.to_storage(res, block, self.ndim))
            return
        view = layout.logical_view(tensor, block) if same else None
        if view is not None and view.is_contiguous():
            self._fill_view(plan, fn, view)
            return
        buf = scratch.get(block.shape, cdt, tensor.device)
        res = plan.call(fn, buf)
        layout.storage_view(tensor, block).copy_(layout.to_storage(res, block, self.ndim))

    def _fill_view(self, plan: Plan, fn: Callable[..., Tensor], lv: Tensor) -> None:
        self.direct = True
        res = plan.call(fn, lv)
        if res is not lv:
            lv.copy_(res)


def execute(plan: Plan, sink: Sink, scratch: Scratch | None = None) -> None:
    """Write every block of ``plan`` through ``sink``, under no_grad, in block order.

    If ``plan.verified`` is False (some function could not be tried on meta) a copy of
    the target is kept so that a failing block can be undone, RNG state included.
    """
    todo = plan.todo()
    if not todo:
        return
    scratch = scratch or Scratch()
    grad = torch.is_grad_enabled()
    set_grad_enabled(False)  # torch.no_grad() without the context-manager overhead
    try:
        backup = sink.backup() if not plan.verified and len(todo) > 1 else None
        rng = RngState(sink.device, plan.generator) if backup is not None else None
        written = False
        for run in sink.runs(plan, todo):
            block = run[0]
            fn = plan.fns[block.index]
            assert fn is not None  # todo holds only blocks with a function
            try:
                if len(run) == 1:
                    sink.write(plan, block, fn, scratch)
                else:
                    sink.write_run(plan, run)
            except Exception as e:
                restored = backup is not None
                if backup is not None and rng is not None:
                    sink.restore(backup)
                    rng.restore()
                torch_fn = hashable_in(base(fn), TORCH_FNS)
                if (restored or not written) and convertible(e, torch_fn):
                    nothing = restored or not sink.direct or torch_fn
                    raise rejected(plan.where(), block, fn, e, wrote_nothing=nothing) from e
                if hasattr(e, "add_note"):
                    if restored:
                        e.add_note(f"packedinit: {plan.where()} was restored to its values before the call.")
                    elif written:
                        e.add_note(f"packedinit: blocks before {block.label!r} of {plan.where()} were already written.")
                raise
            written = True
    finally:
        set_grad_enabled(grad)


# -- the lean path: one block that is the whole tensor ---------------------------------------------------
def lean_call(
    tensor: Tensor,
    fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    param: str | None = None,
) -> None:
    """Call a torch.nn.init function on the whole tensor as it is (the lean path).

    Those functions check their input before they write and use no_grad themselves; a
    rejection becomes PackedInitError (also an instance of the error torch raised).
    """
    try:
        fn(tensor, *args, **kwargs)
    except Exception as e:
        if not _lean_failed(Request(tensor, None, None, fn, args, kwargs, param), fn, e):
            raise


def _lean_failed(req: Request, fn: Callable[..., Tensor], e: Exception) -> bool:
    """A torch.nn.init function raised on the lean path: raise PackedInitError when it means bad input.

    Returns True when the error is to be ignored (a zero-element tensor: nothing to fill),
    False when the caller re-raises the original (e.g. out of memory, or an inference
    tensor outside inference mode: torch writes it before it refuses).
    """
    tensor = req.tensor
    if tensor.numel() == 0:
        return True
    if not convertible(e, True):
        return False
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note(f"packedinit: {INFERENCE_FIX}")
        return False
    where = str(Where(req.param, tensor.shape))
    gen = req.kwargs.get("generator")
    check_tensor(tensor, gen if isinstance(gen, torch.Generator) else None, where)
    check_fn_dtype(tensor.dtype, fn, where)
    raise rejected(where, None, fn, e, wrote_nothing=True) from e


def lean_flags(fn: object) -> tuple[bool, bool] | None:
    """For a torch.nn.init function the lean path calls as it is: (skip zero-element tensors, takes generator=)."""
    try:
        flags: tuple[bool, bool] | None = LEAN.get(fn)  # type: ignore[call-overload]  # any hashable object
    except TypeError:  # an unhashable callable
        return None
    return flags


def lean_ok(fn: object, kwargs: Mapping[str, Any], tensor: Tensor) -> bool:
    """Whether ``fn(tensor, **kwargs)`` on a whole unpacked tensor may be exactly the plain call."""
    flags = lean_flags(fn)
    if flags is None or (flags[0] and tensor.numel() == 0):
        return False
    return flags[1] or "generator" not in kwargs


def run_whole(req: Request, fn: Callable[..., Tensor]) -> bool:
    """The lean path for one block that is the whole tensor: call ``fn`` on it directly.

    Returns False when the general path must handle it (orthogonal_ that needs a
    float32/contiguous scratch, generator= that needs care, a user function on meta,
    a dtype or argument the general checks must refuse before any write).
    """
    tensor, kwargs = req.tensor, req.kwargs
    is_torch = type(fn) is types.FunctionType and fn in TORCH_FNS
    if is_torch:
        if not _lean_safe(tensor, fn):
            return False
        if req.args or kwargs:  # torch checks some arguments only after it has drawn or written
            check_values(fn, req.args, kwargs, Where(req.param, tensor.shape))
    lean = lean_flags(fn)
    if lean is not None and (lean[1] or not kwargs or "generator" not in kwargs):
        if lean[0] and tensor.numel() == 0:
            return True
        lean_call(tensor, fn, req.args, kwargs, req.param)
        return True
    if is_torch:
        if fn is _init.orthogonal_ or fn is _init.trunc_normal_:
            dtype = tensor.dtype
            if dtype.is_complex or (fn is _init.orthogonal_ and not tensor.is_contiguous()):
                return False
        if kwargs and "generator" in kwargs and fn not in GENERATOR_OK:
            return False
        if tensor.numel() == 0:
            return True
        lean_call(tensor, fn, req.args, kwargs, req.param)
        return True
    if tensor.is_meta or (kwargs and "generator" in kwargs):
        return False
    if tensor.numel() == 0:
        return True
    try:
        with torch.no_grad():
            out = fn(tensor, *req.args, **kwargs)
            if out is not tensor and isinstance(out, Tensor):
                if out.shape != tensor.shape:
                    raise ValueError(
                        f"{fn_name(fn)} returned a tensor of shape {fmt_shape(out.shape)}; an init function "
                        f"must fill its argument in place or return a tensor of the same shape"
                    )
                tensor.copy_(out)
    except REJECTIONS as e:
        where = str(Where(req.param, tensor.shape))
        raise rejected(where, None, fn, e, wrote_nothing=False) from e
    return True


_SAFE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _lean_safe(tensor: Tensor, fn: Callable[..., Tensor]) -> bool:
    """Whether torch's own checks cover this call before it writes (else the general path checks first)."""
    if tensor.dtype in LOW_PRECISION and fn is _init.orthogonal_:
        return False
    # float8, complex, integers: the general path refuses or handles them up front
    return tensor.dtype in _SAFE_DTYPES or fn not in LEAN or fn in (_init.constant_, _init.ones_, _init.zeros_)

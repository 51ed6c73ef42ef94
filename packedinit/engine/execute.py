"""The executor: one block loop, one scratch buffer, one rollback, one error, for every kind of target.

:func:`execute` owns the loop over a :class:`~packedinit.engine.plan.Plan`'s blocks, the RNG
bookkeeping, the rollback of a failed unverified plan and the error. Where a block lands is
a small :class:`Sink`: :class:`LocalSink` writes a plain tensor (in place where the block's
logical view is contiguous, through the scratch buffer and a tiled transposing copy
otherwise); :mod:`packedinit.engine.distributed` adds a sink that keeps one rank's shard.

:mod:`packedinit.engine.lean` holds the lean path for an unpacked tensor (the init function called on
the tensor itself, exactly as a plain call would).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from packedinit.engine.direct import draw, joins
from packedinit.engine.dryrun import rejected
from packedinit.engine.lean import PLAIN_TYPES
from packedinit.engine.orient import draws_in_place, row_major, stored_order, write_stored
from packedinit.engine.plan import Plan
from packedinit.engine.traits import TORCH_FNS, TORCH_INIT, UNIFORM_FNS, base, compute_dtype, convertible, hashable_in
from packedinit.layout import Layout, LogicalBlock
from packedinit.torch_compat import compile_safe_cache, set_grad_enabled

__all__ = [
    "Scratch",
    "RngState",
    "Sink",
    "LocalSink",
    "execute",
    "fill_block",
    "PLAIN_TYPES",
]

_init = TORCH_INIT  # torch's own functions, also while fix_torch_defaults replaces torch.nn.init's names


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
    """The random state a failed, undone init restores: the generator, else the CPU (and CUDA device) RNG.

    With a generator the global RNGs are not the call's to restore (other threads may be
    drawing from them): only the generator is put back.
    """

    def __init__(self, device: torch.device, generator: torch.Generator | None) -> None:
        own = generator is None
        self.cpu = torch.get_rng_state() if own else None
        self.device = device if device.type == "cuda" and own else None
        self.cuda = torch.cuda.get_rng_state(device) if self.device is not None else None
        self.generator = generator
        self.gen = generator.get_state() if generator is not None else None

    def restore(self) -> None:
        if self.cpu is not None:
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

    def write(self, plan: Plan, block: LogicalBlock, fn: Callable[..., Tensor], scratch: Scratch) -> None:
        """Generate ``block`` with ``fn`` and put (its part of) it in place."""

    def touches(self, plan: Plan, block: LogicalBlock, fn: Callable[..., Tensor]) -> bool:
        """Whether :meth:`write` hands ``fn`` the target's own memory (so a failing ``fn`` may have written it)."""

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


@compile_safe_cache(maxsize=4096)
def _geometry(layout: Layout, shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[_Where, ...]:
    """Per block, where it lives, computed once on meta tensors (pure, cached)."""
    meta = torch.empty_strided(shape, stride, device="meta")
    out: list[_Where] = []
    for block in layout.blocks(shape):
        logical = torch.empty(block.shape, device="meta")
        lv = layout.logical_view(meta, block)
        inplace = lv is not None and lv.is_contiguous()
        ordered = lv is not None and not inplace and not layout.transposed and row_major(lv)
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

    __slots__ = ("cpu", "device", "geometry", "layout", "ndim", "offset", "tensor", "tiled")

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

    def backup(self) -> Tensor:
        return self.tensor.detach().clone()

    def restore(self, backup: Tensor) -> None:
        self.tensor.copy_(backup)

    def runs(self, plan: Plan, todo: list[LogicalBlock]) -> list[tuple[LogicalBlock, ...]]:
        """Adjacent in-place blocks that make the same direct draw, merged where that draws the same numbers.

        On CPU one ``uniform_``/``normal_`` call over blocks that follow each other in memory
        draws exactly what one call per block draws, under the rule of
        :func:`~packedinit.engine.direct.joins` (the engine tests check it bit for bit). CUDA draws
        per launch: never merged there.
        """
        geometry = self.geometry
        if not self.cpu or geometry is None or len(todo) < 2:
            return [(b,) for b in todo]
        direct = plan.direct
        out: list[tuple[LogicalBlock, ...]] = []
        run: list[LogicalBlock] = []
        end = -1
        total, aligned = 0, True  # elements in `run`; whether each of its blocks is a multiple of 16
        for b in todo:
            g, d = geometry[b.index], direct[b.index]
            fits = d is not None and g.inplace  # direct draws are made in the tensor's dtype
            prev = run[-1] if run else None
            same_draw = d is not None and d == direct[prev.index] if prev is not None else False
            if (
                prev is not None
                and d is not None
                and fits
                and same_draw
                and g.view[1] == end
                and joins(d, total, aligned, b.numel)
            ):
                run.append(b)
            else:
                if run:
                    out.append(tuple(run))
                run = [b] if fits else []
                if not fits:
                    out.append((b,))
                total, aligned = 0, True
            total, aligned = total + b.numel, aligned and b.numel % 16 == 0
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
        draw(self.tensor.as_strided((n,), (1,), self.offset + start), d, plan.generator)

    def _in_place(self, block: LogicalBlock, fn: Callable[..., Tensor]) -> bool:
        """Whether ``fn`` fills the block's own memory (a view of logical shape), not a scratch buffer."""
        if compute_dtype(fn, self.tensor.dtype) != self.tensor.dtype:
            return False
        g = self.geometry[block.index] if self.geometry is not None else None
        if g is not None:
            return g.inplace or (g.ordered and self.cpu and hashable_in(base(fn), UNIFORM_FNS))
        view = self.layout.logical_view(self.tensor, block)
        return view is not None and view.is_contiguous()

    def touches(self, plan: Plan, block: LogicalBlock, fn: Callable[..., Tensor]) -> bool:
        if compute_dtype(fn, self.tensor.dtype) == self.tensor.dtype and stored_order(
            self.layout, fn, plan.direct[block.index]
        ):
            return draws_in_place(plan, block, self._storage(block), self.cpu)
        return self._in_place(block, fn)

    def _storage(self, block: LogicalBlock) -> Tensor:
        """The block's storage view in the tensor."""
        g = self.geometry[block.index] if self.geometry is not None else None
        if g is None:
            return self.layout.storage_view(self.tensor, block)
        sshape, sstride, soff = g.storage
        return self.tensor.as_strided(sshape, sstride, self.offset + soff)

    def write(self, plan: Plan, block: LogicalBlock, fn: Callable[..., Tensor], scratch: Scratch) -> None:
        tensor, layout = self.tensor, self.layout
        cdt = compute_dtype(fn, tensor.dtype)
        same = cdt == tensor.dtype
        g = self.geometry[block.index] if self.geometry is not None else None
        if g is not None:
            if same and (g.inplace or (g.ordered and self.cpu and hashable_in(base(fn), UNIFORM_FNS))):
                lv = tensor.as_strided(block.shape, g.view[0], self.offset + g.view[1])
                d = plan.direct[block.index]
                if d is not None:  # exactly the call the torch.nn.init function would make
                    draw(lv, d, plan.generator)
                else:
                    self._fill_view(plan, fn, lv)
                return
            sshape, sstride, soff = g.storage
            dst = tensor.as_strided(sshape, sstride, self.offset + soff)
            if same and stored_order(layout, fn, plan.direct[block.index]):  # no transposing copy
                write_stored(plan, block, fn, dst, scratch, self.cpu)
                return
            # storage (in, groups, size) with one of groups/size 1: logical row r is column r
            columns = self.tiled and len(block.shape) == 2 and (layout.groups == 1 or sshape[2] == 1)
            target = (dst[:, 0, :] if layout.groups == 1 else dst[:, :, 0]) if columns else dst
            buf = scratch.flat(block.numel, cdt, tensor.device).as_strided(block.shape, g.contiguous)
            res = plan.call(fn, buf)
            if columns and res.dim() == 2:
                _copy_transposed(target, res, scratch)
            elif res is buf:
                dst.copy_(res.as_strided(*g.from_logical))
            else:
                dst.copy_(layout.to_storage(res, block, self.ndim))
            return
        if same and stored_order(layout, fn, plan.direct[block.index]):
            write_stored(plan, block, fn, layout.storage_view(tensor, block), scratch, self.cpu)
            return
        view = layout.logical_view(tensor, block) if same else None
        if view is not None and view.is_contiguous():
            self._fill_view(plan, fn, view)
            return
        buf = scratch.get(block.shape, cdt, tensor.device)
        res = plan.call(fn, buf)
        layout.storage_view(tensor, block).copy_(layout.to_storage(res, block, self.ndim))

    def _fill_view(self, plan: Plan, fn: Callable[..., Tensor], lv: Tensor) -> None:
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
                    nothing = restored or torch_fn or not sink.touches(plan, block, fn)
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

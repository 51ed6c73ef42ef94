"""Transposed storage: which blocks are drawn in stored orientation, and drawing them there.

A transposed layout (GPT-2 ``Conv1D`` ``(in, 3*out)``, GPT-OSS experts ``(n, E, 2I)``) stores
each block as ``(in, out)``. Its logical block is ``(out, in)``: that is the shape whose fans
an init function reads. Where the values are independent and identically distributed per
element given the fans (the uniform and normal families with their fans, ``trunc_normal_``,
``constant_``, ``ones_``, ``zeros_``), the block is drawn directly in stored order, with the
logical block's fans: bit for bit what the same function gives on a *separate* tensor in the
stored orientation (three separate ``Conv1D`` weights for GPT-2, what transformers builds
unfused) with the block's own fans. No transposing copy is needed. Functions whose result
depends on the orientation (``orthogonal_``, ``sparse_``, ``eye_``, ``dirac_``, any function
packedinit does not know) keep the logical orientation: the block is made as an ``(out, in)``
tensor and copied transposed into place.

:func:`stored_order` is the one decision; :func:`fill_stored` makes a block in a contiguous
buffer of the stored orientation (the DTensor path and the buffered local path);
:func:`write_stored` puts a block straight into its storage view of a local tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from packedinit.engine.direct import DirectDraw, draw
from packedinit.engine.plan import Plan
from packedinit.engine.traits import TORCH_INIT, base, hashable_in
from packedinit.layout import Layout, LogicalBlock

__all__ = ["stored_order", "stored_shape", "fill_stored", "write_stored", "draws_in_place", "row_major", "STORED_FNS"]

_init = TORCH_INIT  # torch's own functions, also while fix_torch_defaults replaces torch.nn.init's names
#: Functions whose values do not depend on the shape at all: called on the stored-orientation block.
_FAN_FREE: frozenset[Callable[..., Tensor]] = frozenset(
    {_init.uniform_, _init.normal_, _init.trunc_normal_, _init.constant_, _init.ones_, _init.zeros_}
)
#: Fan-dependent functions whose only draw is one ``uniform_``: called on the logical ``(out, in)``
#: view of a stored-orientation buffer, they read the block's fans and (CPU ``uniform_`` fills in
#: memory order) draw in stored order.
_UNIFORM_FANS: frozenset[Callable[..., Tensor]] = frozenset({_init.xavier_uniform_, _init.kaiming_uniform_})
#: Every torch.nn.init function drawn in stored orientation on transposed storage (the normal family
#: with fans, ``xavier_normal_``/``kaiming_normal_``, when its arguments are plain numbers).
STORED_FNS: frozenset[Callable[..., Tensor]] = _FAN_FREE | _UNIFORM_FANS | {_init.xavier_normal_, _init.kaiming_normal_}


def stored_order(layout: Layout, fn: Callable[..., Tensor], direct: DirectDraw | None) -> bool:
    """Whether a block of ``layout`` filled by ``fn`` is drawn in stored orientation (see the module doc).

    ``direct`` is the block's direct draw (:attr:`~packedinit.engine.plan.Plan.direct`): every
    ``uniform_``/``normal_``/``xavier_*``/``kaiming_*`` call with plain number arguments has one.
    """
    if not layout.transposed:
        return False
    if direct is not None:
        return True
    b = base(fn)
    return hashable_in(b, _FAN_FREE) or hashable_in(b, _UNIFORM_FANS)


def stored_shape(block: LogicalBlock) -> torch.Size:
    """The block's shape in stored orientation: ``(in, out, *rest)`` for a logical ``(out, in, *rest)``."""
    s = block.shape
    return torch.Size((s[1], s[0], *s[2:]))


def fill_stored(plan: Plan, block: LogicalBlock, fn: Callable[..., Tensor], buf: Tensor) -> None:
    """Fill ``buf`` (contiguous, :func:`stored_shape`, the tensor's dtype) with the block in stored order."""
    d = plan.direct[block.index]
    if d is not None:
        draw(buf, d, plan.generator)
        return
    target = buf if hashable_in(base(fn), _FAN_FREE) else buf.transpose(0, 1)
    res = plan.call(fn, target)
    if res is not target:
        target.copy_(res)


def row_major(t: Tensor) -> bool:
    """Whether walking ``t`` in memory order visits its elements in row-major order (no overlap)."""
    extent = 1
    for size, stride in reversed(list(zip(t.shape, t.stride(), strict=True))):
        if size == 1:
            continue
        if stride < extent:
            return False
        extent = stride * size
    return True


#: Elements per band of a banded ``normal_`` draw on CPU: the band and its copy stay in cache.
BAND = 1 << 16


def _bands(rows: int, row_len: int) -> Sequence[tuple[int, int]]:
    """Row ranges whose draws, one after another, give what one ``normal_`` over all rows gives.

    Every band but the last has a multiple of 16 elements and the last has at least 16 (torch's
    CPU ``normal_`` transforms in groups of 16, and draws fewer than 16 elements another way).
    """
    step = max(1, min(rows, BAND // max(row_len, 1)))
    while step < rows and (step * row_len) % 16:
        step += 1
    if step >= rows:
        return [(0, rows)]
    out = [(r, min(r + step, rows)) for r in range(0, rows, step)]
    if len(out) > 1 and (out[-1][1] - out[-1][0]) * row_len < 16:
        out[-2:] = [(out[-2][0], rows)]
    return out


def write_stored(
    plan: Plan, block: LogicalBlock, fn: Callable[..., Tensor], dst: Tensor, scratch: _Flat, cpu: bool
) -> None:
    """Put the block into ``dst`` (its storage view in a local tensor) in stored order.

    ``cpu``: whether to take the CPU paths (the sink says; ``dst.device.type == "cpu"`` in use).

    A direct draw goes straight into ``dst`` where it is contiguous, or (CPU ``uniform_``, which
    fills in memory order) where its memory order is its row-major order: one op. On CPU a
    ``normal_`` draw into a strided ``dst`` goes through cache-sized bands (the same numbers as one
    draw, see :func:`_bands`); elsewhere the block is made in one contiguous buffer and copied:
    two ops per block.
    """
    d = plan.direct[block.index]
    if d is not None and draws_in_place(plan, block, dst, cpu):
        draw(dst, d, plan.generator)
        return
    n = block.numel
    if d is not None and cpu and dst.dim() >= 2 and row_major(dst):
        rows = dst.shape[0]
        row_len = n // max(rows, 1)
        bands = _bands(rows, row_len)
        if len(bands) > 1:
            width = max(b - a for a, b in bands)
            flat = scratch.flat(width * row_len, dst.dtype, dst.device)
            for a, b in bands:
                band = flat[: (b - a) * row_len].view(b - a, *dst.shape[1:])
                draw(band, d, plan.generator)
                dst[a:b].copy_(band)
            return
    buf = scratch.flat(n, dst.dtype, dst.device)[:n].view(stored_shape(block))
    fill_stored(plan, block, fn, buf)
    dst.copy_(buf.view(dst.shape))


def draws_in_place(plan: Plan, block: LogicalBlock, dst: Tensor, cpu: bool) -> bool:
    """Whether :func:`write_stored` draws straight into ``dst`` (one op, no scratch): a direct draw
    into a contiguous ``dst``, or a CPU ``uniform_`` into one whose memory order is its row-major order."""
    d = plan.direct[block.index]
    return d is not None and (dst.is_contiguous() or (cpu and d[0] == "uniform" and row_major(dst)))


class _Flat(Protocol):
    """What :func:`write_stored` needs of a scratch buffer (``packedinit.engine.execute.Scratch`` is one)."""

    def flat(self, n: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> Tensor: ...

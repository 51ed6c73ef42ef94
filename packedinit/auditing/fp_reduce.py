"""Where a logical block lies in a (local) tensor, and the one collective that adds the ranks' sums.

:func:`block_sums` reads the part of one logical block that a tensor holds: the whole tensor, or
the local shard of a DTensor / FSDP2 parameter given its global index ranges
(:func:`shard_ranges`). The block's rows along the packed dim are ``g * total + offset + j``; a
contiguous range of rows meets at most a partial first group, a run of whole groups and a partial
last group, so the part is at most three strided boxes (:func:`packedinit.auditing.blockhash.box_sums`),
each mapped to global logical coordinates: no copy, no gather. :func:`all_ranks` then adds every
rank's sums with one ``all_gather`` of a few int64 numbers per block.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from packedinit.auditing.blockhash import CHUNK, Box, Sums, many_box_sums
from packedinit.errors import PackedInitError
from packedinit.layout import Layout, LogicalBlock
from packedinit.shapes import fmt_shape

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["all_ranks", "block_boxes", "block_sums", "is_dtensor", "shard_ranges"]


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2 parameters are)."""
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def shard_ranges(t: DTensor, name: str) -> list[range] | None:
    """Global index range per dim of this rank's local shard; ``None`` when this rank adds nothing.

    ``Shard(d)`` follows ``torch.chunk`` (chunks of ``ceil(n / k)``, the last ones shorter or
    empty), mesh dims left to right. On a ``Replicate()`` mesh dim only coordinate 0 counts, so
    each element is read once over the world; a rank off the mesh reads nothing.
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh
    shape = tuple(int(s) for s in t.shape)
    placements = tuple(t.placements)
    for p in placements:
        if type(p) not in (Shard, Replicate):
            raise PackedInitError(
                f"parameter {name!r} of shape {fmt_shape(shape)}: placement {p!r} (placements {placements}) "
                f"does not map to the elements a rank holds; fingerprint it with Shard(d)/Replicate() placements "
                f"(redistribute(...) first)."
            )
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    ranges = [range(n) for n in shape]
    for mesh_dim, p in enumerate(placements):
        if type(p) is Replicate:
            if int(coord[mesh_dim]) != 0:
                return None
            continue
        assert isinstance(p, Shard)
        d = p.dim % len(shape)
        r = ranges[d]
        n, k, c = len(r), mesh.size(mesh_dim), int(coord[mesh_dim])
        full = -(-n // k)
        start = min(c * full, n)
        ranges[d] = range(r.start + start, r.start + min(start + full, n))
    return ranges


def _logical_strides(layout: Layout, block: LogicalBlock, inner: int) -> list[int]:
    """Row-major logical stride of each stored inner dim (the transposed pair swapped back)."""
    order = list(range(inner))
    if layout.transposed:
        order[0], order[1] = order[1], order[0]
    lshape = [int(s) for s in block.shape]  # logical dim k is stored inner dim order[k]
    strides = [0] * inner
    acc = 1
    for k in reversed(range(inner)):
        strides[order[k]] = acc
        acc *= lshape[k]
    return strides


def _segments(r: range, groups: int, size: int, total: int, off: int) -> list[tuple[int, int, int, int]]:
    """``(g0, g1, j0, j1)`` boxes of the block rows ``g * total + off + j`` inside positions ``r``."""
    first = max(0, (r.start - off - size) // total + 1)
    last = min(groups - 1, -(-(r.stop - off) // total) - 1)
    out: list[tuple[int, int, int, int]] = []
    for g in sorted({first, last}) if first <= last else []:
        j0 = max(0, r.start - g * total - off)
        j1 = min(size, r.stop - g * total - off)
        if j0 < j1:
            out.append((g, g + 1, j0, j1))
    if last - first > 1:
        out.insert(1, (first + 1, last, 0, size))
    merged: list[tuple[int, int, int, int]] = []
    for s in out:  # whole first/last groups join the run of whole groups
        if merged and merged[-1][1] == s[0] and merged[-1][2:] == s[2:]:
            merged[-1] = (merged[-1][0], s[1], *s[2:])
        else:
            merged.append(s)
    return merged


def block_boxes(
    local: Tensor, ranges: Sequence[range], shape: Sequence[int], layout: Layout, block: LogicalBlock
) -> list[Box]:
    """The boxes (strided views with logical coordinates) of the part of ``block`` that ``local`` holds.

    Args:
        local: a tensor holding global elements ``[ranges[0][i0], ranges[1][i1], ...]`` of a
            tensor of global ``shape`` (the whole tensor: ``ranges = [range(n) for n in shape]``).
        ranges: the global index range of each dim of ``local``.
        shape: the global (stored) shape.
        layout: the layout of the global tensor.
        block: one of ``layout.blocks(shape)``.
    """
    nb = layout.batch_dims
    st = local.stride()
    base = local.storage_offset()
    for k, i in enumerate(block.batch_index):
        if i not in ranges[k]:
            return []
        base += (i - ranges[k].start) * st[k]
    inner = len(shape) - nb
    d = layout.normalized_dim(len(shape)) - nb
    lstride = _logical_strides(layout, block, inner)
    size = layout.sizes[block.part]
    total = layout.packed_size // layout.groups
    off = layout.offset(block.part)
    out: list[Box] = []
    for g0, g1, j0, j1 in _segments(ranges[nb + d], layout.groups, size, total, off):
        sizes: list[int] = []
        strides: list[int] = []
        dims: list[tuple[int, int]] = []
        offset = base
        for k in range(inner):
            r, s = ranges[nb + k], st[nb + k]
            if k == d:
                sizes += [g1 - g0, j1 - j0]
                strides += [total * s, s]
                dims += [(g0, size * lstride[k]), (j0, lstride[k])]
                offset += (g0 * total + off + j0 - r.start) * s
            else:
                sizes.append(len(r))
                strides.append(s)
                dims.append((r.start, lstride[k]))
        if 0 not in sizes:
            out.append((local.as_strided(sizes, strides, offset), tuple(dims)))
    return out


def block_sums(
    local: Tensor,
    ranges: Sequence[range],
    shape: Sequence[int],
    layout: Layout,
    block: LogicalBlock,
    chunk: int = CHUNK,
) -> Sums:
    """The sums of the part of ``block`` that ``local`` holds (its :func:`block_boxes` added up).

    Examples:
        >>> from packedinit.layout import Layout
        >>> w = torch.arange(12.0).reshape(6, 2)
        >>> lay = Layout(0, [1, 1], groups=3)  # rows interleaved a b a b a b
        >>> a = lay.blocks(w.shape)[0]
        >>> whole = block_sums(w, [range(6), range(2)], w.shape, lay, a)
        >>> top = block_sums(w[:3], [range(0, 3), range(2)], w.shape, lay, a)
        >>> bottom = block_sums(w[3:], [range(3, 6), range(2)], w.shape, lay, a)
        >>> (top.raw + bottom.raw) % 2**64 == whole.raw, whole.s1
        (True, 27.0)
    """
    acc = Sums()
    for s in many_box_sums(block_boxes(local, ranges, shape, layout, block), chunk):
        acc.add(s)
    return acc


def _f2i(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def _i2f(x: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", x))[0])


def all_ranks(sums: Sequence[Sums], device: torch.device) -> list[Sums]:
    """Every rank's ``sums`` added, in rank order (the same floats on every rank): one ``all_gather``.

    A collective: every rank of the default process group calls it with the same number of sums.
    """
    import torch.distributed as dist

    rows = [
        [s.raw - (1 << 64) if s.raw >> 63 else s.raw, s.count, s.finite, *map(_f2i, (s.s1, s.s2, s.lo, s.hi))]
        for s in sums
    ]
    mine = torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(sums), 7)
    world = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(world, mine)
    out = [Sums() for _ in sums]
    for part in world:
        for acc, row in zip(out, part.cpu().tolist(), strict=True):
            raw, count, finite, s1, s2, lo, hi = row
            acc.add(Sums(raw % (1 << 64), count, finite, _i2f(s1), _i2f(s2), _i2f(lo), _i2f(hi)))
    return out

r"""``packedinit.fingerprint``: did two runs start from the same weights? Block by block, at any world size.

Read-only, one read pass (see :mod:`packedinit.auditing.blockhash`): each logical block's logical
shape, dtype, fans, count, float64 mean / std / min / max of its finite values, the count of nan/inf
values, and a 64-bit hash of the logical block's values that storage (contiguous, transposed,
interleaved, strided), fusion (a fused q/k/v block or a separate ``Linear``) and sharding (DTensor,
FSDP2) do not change. Blocks come from the layouts the audit uses (adapters, annotations:
:func:`packedinit.layouts`); an unpacked parameter is one block.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from packedinit.auditing.blockhash import CHUNK, DEVICE_CHUNK, Box, Sums, block_hash, hashable, many_box_sums
from packedinit.auditing.fp_records import BlockRecord, Fingerprint, FingerprintDiff
from packedinit.auditing.fp_reduce import all_ranks, block_boxes, is_dtensor, shard_ranges
from packedinit.errors import PackedInitError
from packedinit.layout import Layout, LogicalBlock
from packedinit.shapes import fans, fmt_shape

__all__ = ["BlockRecord", "Fingerprint", "FingerprintDiff", "fingerprint"]

_Item = tuple[str, Tensor, Layout | None]


@dataclass(frozen=True)
class _Measured:
    key: str
    param: str
    label: str | None
    shape: tuple[int, ...]
    sums: Sums | None
    sharded: bool


def _record(m: _Measured, t: Tensor) -> BlockRecord:
    fan_in, fan_out = fans(m.shape)
    head = (m.key, m.param, m.label, m.shape, _dtype(t), fan_in, fan_out, math.prod(m.shape))
    s = m.sums
    if s is None:
        return BlockRecord(*head, None, None, None, None, 0, None)
    mean = std = lo = hi = None
    if s.finite:
        mean = s.s1 / s.finite
        var = s.s2 / s.finite - mean * mean
        std = 0.0 if s.lo == s.hi else math.sqrt(max(var, 0.0)) if math.isfinite(var) else var
        lo, hi = s.lo, s.hi
    return BlockRecord(*head, mean, std, lo, hi, s.count - s.finite, block_hash(s.raw, s.count))


def _dtype(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


_Keyed = tuple[str, str | None, LogicalBlock | None]


def _blocks(name: str, shape: tuple[int, ...], layout: Layout | None) -> list[_Keyed]:
    if layout is None:
        return [(name, None, None)]
    blocks = layout.blocks(shape, param=name)
    if len(blocks) == 1:
        return [(name, None, blocks[0])]
    out: list[_Keyed] = []
    for b in blocks:
        parts = [*map(str, b.batch_index)]
        if layout.num_parts > 1:
            parts.append(b.name if b.name is not None else str(b.part))
        out.append((f"{name}[{','.join(parts)}]", b.label, b))
    return out


@functools.lru_cache(maxsize=1024)
def _row_major(shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append((0, acc))
        acc *= n
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=1024)
def _whole(shape: tuple[int, ...]) -> tuple[Layout, LogicalBlock]:
    lay = Layout(0, [shape[0]])
    return lay, lay.blocks(shape)[0]


def _measure(name: str, t: Tensor, layout: Layout | None, boxes: list[Box]) -> list[tuple[_Measured, int, int]]:
    """The blocks of one parameter, each with the range of its boxes in ``boxes`` (appended to)."""
    shape = tuple(int(s) for s in t.shape)
    if layout is not None:
        layout.check(shape, param=name)
    sharded = is_dtensor(t)
    local: Tensor = t.to_local() if sharded else t  # type: ignore[attr-defined]
    read = hashable(local)
    ranges: list[range] | None = [range(n) for n in shape]
    if sharded and read:
        ranges = shard_ranges(t, name)  # type: ignore[arg-type]
        if ranges is not None and tuple(len(r) for r in ranges) != tuple(local.shape):
            raise PackedInitError(
                f"parameter {name!r} of shape {fmt_shape(shape)}: the local shard has shape {fmt_shape(local.shape)} "
                f"but placements {tuple(t.placements)} give {fmt_shape([len(r) for r in ranges])}; "  # type: ignore[attr-defined]
                f"fingerprint a DTensor made by distribute_tensor / fully_shard (torch.chunk shards)."
            )
    out: list[tuple[_Measured, int, int]] = []
    for key, label, block in _blocks(name, shape, layout):
        b_shape = shape if block is None else tuple(int(s) for s in block.shape)
        start = len(boxes)
        if read and ranges is not None and math.prod(shape) > 0:
            if not shape:  # a 0-d tensor: one element
                boxes.append((local.reshape(1), ((0, 1),)))
            elif block is None and not sharded:  # the whole tensor, row-major: one box, no views to make
                boxes.append((local, _row_major(shape)))
            elif block is None:
                boxes += block_boxes(local, ranges, shape, *_whole(shape))
            else:
                assert layout is not None
                boxes += block_boxes(local, ranges, shape, layout, block)
        out.append(
            (_Measured(key, name, label, b_shape, Sums() if read else None, sharded and read), start, len(boxes))
        )
    return out


def _items(model: nn.Module, layouts: Mapping[str, Layout] | None) -> list[_Item]:
    if layouts is None:
        from packedinit.model.claims import layouts as _layouts

        layouts = _layouts(model)
    params = dict(model.named_parameters())
    for n in layouts:
        if n not in params:
            names = list(params)
            raise PackedInitError(
                f"layouts names {n!r}, which is not a parameter of {type(model).__name__}; "
                f"parameters: {names[:12]}{' ...' if len(names) > 12 else ''}."
            )
    return [(n, p, layouts.get(n)) for n, p in params.items()]


def fingerprint(
    model_or_tensor: nn.Module | Tensor,
    *,
    layouts: Mapping[str, Layout] | None = None,
    layout: Layout | None = None,
    name: str = "tensor",
    chunk: int | None = None,
) -> Fingerprint:
    r"""Fingerprint a model's (or one tensor's) values, block by block.

    One read pass over every parameter (tied ones once), under ``no_grad``, in chunks of
    ``chunk`` elements: no copy of a parameter, no RNG draw, nothing written. For each logical
    block (the layouts :func:`packedinit.layouts` gives; an unpacked parameter is one block) the
    :class:`~packedinit.auditing.fp_records.BlockRecord` holds the logical shape, dtype, fans,
    count, mean, std (population), min and max of the finite values (float64 sums), the nan/inf
    count, and a 64-bit hash of the logical block's values:

    .. math::
        \mathrm{fmix64}\Big(\sum_i A^{i}\, \big(b_i \oplus (b_i \gg w/2)\big) \bmod 2^{64}\Big)

    over logical flat indices :math:`i` and :math:`w`-bit value patterns :math:`b_i` (see
    :mod:`packedinit.auditing.blockhash`).
    It does not depend on how the block is stored (contiguous, transposed, interleaved, strided),
    on fusion (a fused q/k/v block hashes like a separate ``Linear`` holding the same matrix) or on
    sharding; any single changed value changes it.

    DTensor / FSDP2 parameters make the call a **collective**: call it on every rank. Each rank
    reads only its local shard (with global logical indices) and one ``all_gather`` of a few
    numbers per block adds them: no gather of values, memory O(``chunk``). The result equals the
    single-process fingerprint at every world size and placement (mean and std up to float64
    rounding, see :data:`~packedinit.auditing.fp_records.REL_TOL`). Meta tensors give shapes and
    fans only (``hash=None``).

    Args:
        model_or_tensor: an ``nn.Module`` or a tensor.
        layouts: ``{parameter name: Layout}`` instead of :func:`packedinit.layouts` ``(model)``.
        layout: for a tensor: its layout (default: one block).
        name: for a tensor: the name its keys start with.
        chunk: elements read per step (memory bound of the pass); default 65,536 on CPU,
            16,777,216 when a parameter is on an accelerator.

    Returns:
        A :class:`~packedinit.auditing.fp_records.Fingerprint`: ``fp.blocks[key]``, ``fp.diff(other)``
        (the keys that differ, in model order; ``str()`` names the first and its std ratio),
        ``fp.to_json()`` / ``Fingerprint.from_json(text)``.

    Raises:
        PackedInitError: a name in ``layouts`` that is not a parameter, a layout that does not fit,
            or a DTensor placement that does not map to the elements a rank holds (``Partial``).

    Examples:
        >>> import torch
        >>> from packedinit import fingerprint
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> mha = torch.nn.MultiheadAttention(8, 2)
        >>> fp = fingerprint(mha)
        >>> list(fp)[:4], len(fp)
        (['in_proj_weight[q]', 'in_proj_weight[k]', 'in_proj_weight[v]', 'in_proj_bias[q]'], 8)
        >>> q = torch.nn.Linear(8, 8, bias=False)
        >>> with torch.no_grad():
        ...     _ = q.weight.copy_(mha.in_proj_weight[:8])
        >>> fingerprint(q)["weight"].hash == fp["in_proj_weight[q]"].hash  # fused or not: the same matrix
        True
        >>> with torch.no_grad():
        ...     mha.in_proj_weight[12, 3] += 1.0  # one value of k
        >>> fp.diff(fingerprint(mha))
        ['in_proj_weight[k]']
    """
    if isinstance(model_or_tensor, nn.Module):
        if layout is not None:
            raise PackedInitError("fingerprint(model, layout=...): give a model's layouts as layouts={name: Layout}.")
        items = _items(model_or_tensor, layouts)
        title = type(model_or_tensor).__name__
    elif isinstance(model_or_tensor, Tensor):
        if layouts is not None:
            raise PackedInitError("fingerprint(tensor, layouts=...): give a tensor's layout as layout=Layout(...).")
        items = [(name, model_or_tensor, layout)]
        title = ""
    else:
        raise PackedInitError(f"fingerprint() needs an nn.Module or a tensor, got {type(model_or_tensor).__name__}.")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise PackedInitError(f"fingerprint(chunk={chunk!r}): chunk is a number of elements, an int >= 1.")
    measured: list[tuple[Tensor, _Measured]] = []
    boxes: list[Box] = []
    spans: list[tuple[int, int]] = []
    with torch.no_grad():
        for n, t, lay in items:
            for m, a, b in _measure(n, t, lay, boxes):
                measured.append((t, m))
                spans.append((a, b))
        on_cpu = all(v.device.type == "cpu" for v, _ in boxes)
        sums = many_box_sums(boxes, chunk or (CHUNK if on_cpu else DEVICE_CHUNK))  # small boxes read together
    for (_, m), (a, b) in zip(measured, spans, strict=True):
        if m.sums is not None:
            for s in sums[a:b]:
                m.sums.add(s)
    del boxes, sums
    shared = [i for i, (_, m) in enumerate(measured) if m.sharded]
    if shared:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            device = measured[shared[0]][0].to_local().device  # type: ignore[attr-defined]
            added = all_ranks([measured[i][1].sums or Sums() for i in shared], device)
            for i, s in zip(shared, added, strict=True):
                t, m = measured[i]
                measured[i] = (t, dataclasses.replace(m, sums=s))
    records = {m.key: _record(m, t) for t, m in measured}
    return Fingerprint(records, title)

"""DTensor / FSDP2 parameters: each rank fills only its local shard, the same numbers at every world size.

Splitting a DTensor along a sharded dim returns a *Replicate copy*, so per-block
init through ``split``/``chunk``/slices of a sharded parameter writes nothing; and
random init on a CPU mesh draws the same numbers on every rank. This module never
splits a DTensor. It reads the DTensor's global shape and placements, plans the
init on a meta tensor of the global shape (so every check and every fan is the
global logical block's), and then, on every rank:

1. generates each logical block, in block order, into one contiguous scratch
   buffer, exactly as the single-process engine draws it (same RNG stream: the
   caller's ``generator=`` or the global RNG of the local shard's device);
2. copies the part of that block which lies inside this rank's local shard
   (``DTensor.to_local()``, a view of the rank's own storage) into place.

Every rank draws every block, so the RNG stream advances on every rank exactly as
it does in one process, and the gathered parameter is bit-identical to the
single-process per-block init of the full tensor, whatever the world size, mesh
shape or placements. Cost per rank: time of initialising the whole parameter
once (plus copying the local part); peak extra memory of one logical block
(the scratch buffer) plus what the init function itself allocates for one block.
No communication.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch import Tensor, nn

from packedinit.engine.execute import LocalSink, Scratch, execute, fill_block
from packedinit.engine.orient import fill_stored, stored_order, stored_shape
from packedinit.engine.plan import Plan, Request, Where, check_tensor, make_plan
from packedinit.errors import PackedInitError
from packedinit.layout import LogicalBlock
from packedinit.shapes import fmt_shape
from packedinit.torch_compat import buffer_dict, custom_shard_order, param_dict

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["global_params", "init_dtensor", "local_ranges", "plan_dtensor", "write_planned", "DTensorPlan", "ShardSink"]


def init_dtensor(req: Request, scratch: Scratch | None = None) -> None:
    r"""Initialise a DTensor (or an FSDP2 sharded parameter) per logical block, in place.

    What :func:`packedinit.chunked_init` does for a ``DTensor``: the plan is made
    for the *global* shape (fans of the global logical blocks), and each rank
    writes only the elements of its local shard. Every rank generates every
    logical block in block order from the same RNG state and keeps the part that
    falls in its shard, so the full tensor equals the single-process init of the
    global tensor bit for bit (on CPU), for any world size, mesh and placements,
    provided every rank starts from the same RNG state (seed every rank alike).

    Supported placements: ``Shard(d)`` on any dim (uneven shards included, nested
    ``Shard`` of one dim over several mesh dims in the default left-to-right
    order) and ``Replicate()``, on meshes of any number of dims. A DTensor on the
    meta device is validated and left alone, as the engine does for meta tensors.

    Args:
        req: the request; ``req.tensor`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2
            parameter is one), the rest as for :func:`packedinit.chunked_init`.
        scratch: a scratch buffer to share across calls (one is made when ``None``).

    Raises:
        PackedInitError: any check of :func:`packedinit.chunked_init`, or a
            placement this module cannot map to index ranges (``Partial``,
            ``_StridedShard``, a non-default shard order); raised before the
            first write.
    """
    write_planned(plan_dtensor(req), scratch)


#: What :func:`plan_dtensor` returns: (plan or None when nothing is written, local shard, global ranges).
DTensorPlan: TypeAlias = tuple[Plan | None, Tensor, list[range] | None]


def write_planned(planned: DTensorPlan, scratch: Scratch | None = None) -> None:
    """The writing half of :func:`init_dtensor`, for what :func:`plan_dtensor` returned.

    Lets a caller (the whole-model walk) check every parameter first and write after,
    without planning each DTensor twice.
    """
    plan, local, ranges = planned
    if plan is None or local.is_meta:
        return
    if ranges is not None and tuple(len(r) for r in ranges) == tuple(plan.shape):
        execute(plan, LocalSink(local, plan.layout), scratch)  # the whole tensor is local (Replicate)
        return
    execute(plan, ShardSink(local, ranges), scratch)


def plan_dtensor(req: Request) -> DTensorPlan:
    """Every check of :func:`init_dtensor`, nothing written: ``(plan, local shard, global ranges)``.

    ``plan`` is ``None`` when there is nothing to write; ``ranges`` is ``None`` on a
    rank outside the DTensor's mesh. Whole-model callers run this for every DTensor
    first, so that a bad parameter is refused before any other is written.
    """
    from torch.distributed.tensor import DTensor

    tensor, param = req.tensor, req.param
    if not isinstance(tensor, DTensor):
        raise PackedInitError(f"{_where(param, tensor.shape)}: expected a DTensor, got {type(tensor).__name__}.")
    shape = tensor.shape
    meta = torch.empty(shape, dtype=tensor.dtype, device="meta")
    plan = make_plan(dataclasses.replace(req, tensor=meta))
    where = plan.where() if plan is not None else _where(param, shape)
    ranges = local_ranges(tensor, where)
    with torch.no_grad():
        local = tensor.to_local()
    _check_local(tensor, local, ranges, where)
    if plan is not None:
        check_tensor(local, plan.generator, where)  # inference tensors, generator on another device
    return plan, local, ranges


def _check_local(tensor: DTensor, local: Tensor, ranges: Sequence[range] | None, where: str) -> None:
    if ranges is not None and tuple(len(r) for r in ranges) != tuple(local.shape):
        raise PackedInitError(
            f"{where}: the local shard on this rank has shape {fmt_shape(local.shape)} but "
            f"placements {tuple(tensor.placements)} on mesh {tuple(tensor.device_mesh.shape)} give "
            f"{fmt_shape([len(r) for r in ranges])}; packedinit cannot tell which elements this rank "
            f"holds. Re-create the DTensor with distribute_tensor/DTensor.from_local and even shapes."
        )


def _where(param: str | None, shape: Sequence[int]) -> str:
    return str(Where(param, shape))


def local_ranges(tensor: DTensor, where: str) -> list[range] | None:
    """Global index range, per tensor dim, of this rank's local shard; ``None`` off the mesh.

    Follows ``Shard``'s ``torch.chunk`` semantics (chunks of ``ceil(n / k)``, the last
    ones shorter or empty), mesh dims applied left to right.
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh = tensor.device_mesh
    placements = tuple(tensor.placements)
    shape = tuple(tensor.shape)
    ndim = len(shape)
    sharded_dims: list[int] = []
    for mesh_dim, p in enumerate(placements):
        if type(p) is Replicate:
            continue
        if type(p) is Shard:
            sharded_dims.append(p.dim % ndim if ndim else p.dim)
            continue
        kind = "a Partial placement (pending reduction: the values are not the tensor's)" if p.is_partial() else (
            f"placement {p!r}"
        )
        raise PackedInitError(
            f"{where}: mesh dim {mesh_dim} has {kind}, which packedinit cannot map to the elements a rank "
            f"holds; placements are {placements}. Initialise a DTensor with Shard(d)/Replicate() placements "
            f"(e.g. redistribute(...) first, or init before applying this placement)."
        )
    if len(set(sharded_dims)) != len(sharded_dims):
        # A dim sharded over several mesh dims: only the default (left-to-right) order is mapped.
        order = custom_shard_order(tensor, placements)
        if order is not None:
            raise PackedInitError(
                f"{where}: placements {placements} shard one dim over several mesh dims in the order "
                f"{order}, not the default left-to-right order; packedinit maps only the default order. "
                f"Initialise before re-ordering the sharding."
            )
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    ranges = [range(n) for n in shape]
    for mesh_dim, p in enumerate(placements):
        if type(p) is not Shard:
            continue
        d = p.dim % ndim
        r = ranges[d]
        n, k, c = len(r), mesh.size(mesh_dim), int(coord[mesh_dim])
        full = -(-n // k)
        start = min(c * full, n)
        stop = min(start + full, n)
        ranges[d] = range(r.start + start, r.start + stop)
    return ranges


class ShardSink:
    """One rank's shard of a DTensor: every drawing block is generated in full, the local part kept.

    ``local`` is the shard of a tensor of global shape ``plan.shape``:
    ``local[i0, i1, ...]`` holds global element ``[ranges[0][i0], ranges[1][i1], ...]``.
    Every block that draws random numbers is generated in full (in block order, so the RNG
    stream advances as in one process); blocks whose function draws nothing are generated
    only when they intersect the shard. ``ranges=None`` (a rank outside the mesh) writes
    nothing but still advances the RNG. ``pieces`` (views of ``local`` with their global
    ranges) replace ``(local, ranges)`` where the shard is several boxes of the tensor.
    """

    __slots__ = ("device", "local", "pieces")

    def __init__(
        self, local: Tensor, ranges: Sequence[range] | None, pieces: Sequence[tuple[Tensor, Sequence[range]]] = ()
    ) -> None:
        self.local = local
        self.pieces = list(pieces) if pieces else ([] if ranges is None else [(local, ranges)])
        self.device = local.device

    def backup(self) -> Tensor:
        return self.local.detach().clone()

    def restore(self, backup: Tensor) -> None:
        self.local.copy_(backup)

    def runs(self, plan: Plan, todo: list[LogicalBlock]) -> list[tuple[LogicalBlock, ...]]:
        return [(b,) for b in todo]

    def write_run(self, plan: Plan, run: tuple[LogicalBlock, ...]) -> None:
        raise AssertionError("ShardSink.runs makes runs of one block only")

    def touches(self, plan: Plan, block: LogicalBlock, fn: Callable[..., Tensor]) -> bool:
        return False  # every block is generated in a scratch buffer, then its local part copied

    def write(self, plan: Plan, block: LogicalBlock, fn: Callable[..., Tensor], scratch: Scratch) -> None:
        targets = [t for v, r in self.pieces if (t := _block_target(plan, block, v, r)) is not None]
        if not targets and not plan.draws(fn):
            return  # draws nothing: no need to generate what this rank does not hold
        if stored_order(plan.layout, fn, plan.direct[block.index]):  # as the local engine draws it
            stored = scratch.get(stored_shape(block), plan.dtype, self.local.device)
            fill_stored(plan, block, fn, stored)
            buf = stored.transpose(0, 1)
        else:
            buf = scratch.get(block.shape, plan.dtype, self.local.device)
            fill_block(plan, block, fn, buf)
        for target in targets:
            _copy(plan, block, buf, target)


class _Target:
    """Where one block's local part goes: ``dst`` (a view of the local shard) and how to select from the block."""

    __slots__ = ("dst", "index", "narrows")

    def __init__(self, dst: Tensor, narrows: list[tuple[int, int, int]], index: Tensor | None) -> None:
        self.dst = dst
        self.narrows = narrows  # (dim, start, length) over the block in storage dim order
        self.index = index  # local positions along the packed dim when they are not contiguous


def _block_target(plan: Plan, block: LogicalBlock, local: Tensor, ranges: Sequence[range]) -> _Target | None:
    """Intersect ``block``'s storage positions with the local ranges; ``None`` when empty."""
    layout = plan.layout
    ndim = len(plan.shape)
    nb = layout.batch_dims
    dst = local
    for b, i in enumerate(block.batch_index):
        r = ranges[b]
        if not r.start <= i < r.stop:
            return None
        dst = dst.select(0, i - r.start)
    d = layout.normalized_dim(ndim) - nb
    narrows: list[tuple[int, int, int]] = []
    index: Tensor | None = None
    for i in range(ndim - nb):
        r = ranges[nb + i]
        if i != d:
            if len(r) == 0:
                return None
            narrows.append((i, r.start, len(r)))
            continue
        # Along the packed dim the block's k-th row (in (group, row) order) is stored at
        # g * total + off + j with (g, j) = divmod(k, size): increasing in k, so the rows
        # inside [r.start, r.stop) are one run k0 <= k < k1.
        size = layout.sizes[block.part]
        total = layout.packed_size // layout.groups
        off = layout.offset(block.part)
        k0 = _rows_before(r.start, layout.groups, size, total, off)
        k1 = _rows_before(r.stop, layout.groups, size, total, off)
        if k0 == k1:
            return None
        narrows.append((i, k0, k1 - k0))
        if layout.groups == 1:
            dst = dst.narrow(i, off + k0 - r.start, k1 - k0)
        else:
            k = torch.arange(k0, k1, device=local.device)
            index = (k // size) * total + off + (k % size) - r.start
    return _Target(dst, narrows, index)


def _rows_before(x: int, groups: int, size: int, total: int, off: int) -> int:
    """How many of a block's rows (positions ``g * total + off + j``) lie before position ``x``."""
    y = x - off
    if y <= 0:
        return 0
    q, rem = divmod(y, total)
    if q >= groups:
        return groups * size
    return q * size + min(rem, size)


def _copy(plan: Plan, block: LogicalBlock, logical: Tensor, target: _Target) -> None:
    layout = plan.layout
    ndim = len(plan.shape)
    d = layout.normalized_dim(ndim) - layout.batch_dims
    # to_storage splits the packed dim into (groups, size); merging it back is always a view.
    src = layout.to_storage(logical, block, ndim).flatten(d, d + 1)
    for i, start, length in target.narrows:
        src = src.narrow(i, start, length)
    if target.index is None:
        target.dst.copy_(src)
    else:
        target.dst.index_copy_(d, target.index, src)



@contextmanager
def global_params(module: nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s own DTensor parameters and buffers are plain tensors of their global shape.

    For code that initialises a module through its own methods (``Linear.reset_parameters()``,
    a third-party ``_init_weights``): run it inside this block on every rank with the same
    RNG state, and on exit each rank keeps exactly its shard of what was written, so the
    result is the single-process init, at every world size. Each stand-in starts with
    this rank's shard in its place (elements elsewhere are undefined), so a parameter the
    code does not write keeps its values. The DTensor objects themselves are put back
    (FSDP2 keeps its references). Only the module's own tensors (``recurse=False``) are
    swapped; peak extra memory is their global size, one module at a time.

    Args:
        module: the module whose own parameters/buffers may be DTensors.

    Raises:
        PackedInitError: a placement that cannot be mapped (see :func:`init_dtensor`),
            before anything is swapped.

    Examples:
        >>> lin = torch.nn.Linear(4, 3)  # plain parameters: the block changes nothing
        >>> with global_params(lin):
        ...     lin.reset_parameters()
        >>> lin.weight.shape
        torch.Size([3, 4])
    """
    from torch.distributed.tensor import DTensor

    found: list[tuple[bool, str, DTensor, Tensor, list[range] | None]] = []
    for is_param, store in ((True, param_dict(module)), (False, buffer_dict(module))):
        for name, t in store.items():
            if isinstance(t, DTensor):
                where = _where(f"{type(module).__name__}.{name}", t.shape)
                ranges = local_ranges(t, where)
                with torch.no_grad():
                    local = t.to_local()
                _check_local(t, local, ranges, where)
                found.append((is_param, name, t, local, ranges))
    stand_ins: list[Tensor] = []
    with torch.no_grad():
        for is_param, _, t, local, ranges in found:
            full = torch.empty(t.shape, dtype=t.dtype, device=local.device)
            if ranges is not None and not local.is_meta:
                _slice(full, ranges).copy_(local)
            stand_ins.append(nn.Parameter(full, requires_grad=t.requires_grad) if is_param else full)
    _swap(module, [(p, n, s) for (p, n, _, _, _), s in zip(found, stand_ins, strict=True)])
    try:
        yield
        with torch.no_grad():
            for is_param, name, _, local, ranges in found:
                now = (param_dict(module) if is_param else buffer_dict(module)).get(name)
                if ranges is not None and not local.is_meta and isinstance(now, Tensor):
                    local.copy_(_slice(now, ranges))
    finally:
        _swap(module, [(p, n, t) for p, n, t, _, _ in found])


def _swap(module: nn.Module, items: Sequence[tuple[bool, str, Tensor]]) -> None:
    for is_param, name, t in items:
        if is_param:
            param_dict(module)[name] = t  # a Parameter, or the DTensor parameter back
        else:
            buffer_dict(module)[name] = t


def _slice(t: Tensor, ranges: Sequence[range]) -> Tensor:
    for d, r in enumerate(ranges):
        t = t.narrow(d, r.start, len(r))
    return t

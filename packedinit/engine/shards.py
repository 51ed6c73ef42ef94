"""One rank's local shard of a larger parameter, filled with the fans of the global logical blocks.

An init call handed a local shard (a DTensor's ``to_local()``, a Megatron-style tensor-parallel
shard) sees only the shard's shape, so a fan-dependent function computes the fans of the shard
(``fan_out / world`` for a row shard). Here the plan is made for the *global* shape, on a meta
tensor, so every check and every fan is the global logical block's; then, as for a DTensor
(:class:`~packedinit.engine.distributed.ShardSink`), every block is drawn in full, in block order,
and the part of it the shard holds is copied into place: with the same RNG state on every rank the
gathered parameter is the single-process init, bit for bit, at every tensor-parallel degree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from packedinit.engine.distributed import ShardSink
from packedinit.engine.execute import Scratch, execute
from packedinit.engine.plan import Request, check_tensor, make_plan
from packedinit.errors import PackedInitError
from packedinit.shapes import fmt_shape

__all__ = ["init_shard"]

#: One box of a local shard: a view of the local tensor, and the global index range it holds per dim.
Piece = tuple[Tensor, Sequence[range]]


def init_shard(req: Request, shape: Sequence[int], pieces: Sequence[Piece], scratch: Scratch | None = None) -> None:
    """Initialise ``req.tensor``, the local shard of a tensor of global ``shape``, per global logical block.

    Args:
        req: the request; ``req.tensor`` is the local shard (a plain tensor), ``req.chunks`` the layout
            of the *global* tensor (``None``: one block).
        shape: the global (logical) shape.
        pieces: the boxes of the shard, each a view of ``req.tensor`` and its global ranges per dim.
        scratch: a scratch buffer to share across calls.

    Raises:
        PackedInitError: any check of :func:`packedinit.chunked_init` on the global shape, or pieces
            whose shapes do not match their ranges; raised before the first write.
    """
    local = req.tensor
    meta = torch.empty(tuple(shape), dtype=local.dtype, device="meta")
    plan = make_plan(dataclasses.replace(req, tensor=meta))
    if plan is None:
        return
    for view, ranges in pieces:
        if tuple(view.shape) != tuple(len(r) for r in ranges) or len(ranges) != len(shape):
            raise PackedInitError(
                f"{plan.where()}: a piece of the local shard has shape {fmt_shape(view.shape)} but holds the "
                f"global ranges {[(r.start, r.stop) for r in ranges]}; the shard's geometry is inconsistent. "
                f"Check its tensor-parallel attributes (partition_dim, partition_stride, world size and rank)."
            )
    check_tensor(local, plan.generator, plan.where())
    if local.is_meta:
        return
    execute(plan, ShardSink(local, None, pieces), scratch)

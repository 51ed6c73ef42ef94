"""Who is a local shard: a tensor that is one rank's piece of a larger (logical) parameter.

Two kinds are recognised:

- **the local tensor of a DTensor parameter** (``p.to_local()``, TransformerEngine's
  ``p._local_tensor``): DTensor parameters are noted (:func:`note`) when a module registers one
  while the fix is on (``parallelize_module``, ``distribute_module``) and when a model is handed to
  the fix; a later tensor is that parameter's local shard when it has the same storage, offset,
  shape and strides as the parameter's local tensor. The record holds the parameter weakly and is
  keyed by the storage's address; it is checked against the live parameter on every lookup.
- **a Megatron-style shard**: a plain Parameter with ``tensor_model_parallel=True``,
  ``partition_dim`` and ``partition_stride`` (Megatron-LM's ``set_tensor_model_parallel_attributes``).
  The world size and rank of its tensor-parallel group are, in this order: the Parameter's own
  ``tensor_model_parallel_world_size`` and ``tensor_model_parallel_rank`` attributes; Megatron's
  ``megatron.core.parallel_state`` when it is imported and initialised; the default
  ``torch.distributed`` group when one is initialised (right when every rank is in one
  tensor-parallel group). With stride ``s`` the shard is ``s`` chunks of the partition dim, chunk
  ``j`` being the global chunk ``j * world + rank`` (Megatron's ``_initialize_affine_weight_cpu``).
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from packedinit.errors import PackedInitError
from packedinit.shapes import fmt_shape

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["MegatronShard", "dtensor_of", "megatron_shard", "note", "is_dtensor"]

_lock = threading.RLock()  # re-entrant: a record's weakref callback may run while it is held
#: Storage address of a DTensor parameter's local tensor -> the parameters (weakly) whose local tensor lives there.
_seen: dict[int, list[weakref.ref[DTensor]]] = {}


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing torch.distributed)."""
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def _local(p: Tensor) -> Tensor:
    with torch.no_grad():
        local: Tensor = p.to_local()  # type: ignore[attr-defined]  # a DTensor (checked by the callers)
    return local


def _address(t: Tensor) -> int:
    return 0 if t.is_meta else int(t.untyped_storage().data_ptr())


def note(p: object) -> None:
    """Remember DTensor ``p`` so that a later init call on its local tensor is known to be a shard."""
    if not is_dtensor(p):
        return
    assert isinstance(p, Tensor)
    p = cast("DTensor", p)
    ptr = _address(_local(p))
    if ptr == 0:  # meta, or an empty shard: nothing to find later
        return
    with _lock:
        refs = [r for r in _seen.get(ptr, []) if r() is not None]
        if not any(r() is p for r in refs):
            refs.append(weakref.ref(p, functools.partial(_forget, ptr)))
        _seen[ptr] = refs


def _forget(ptr: int, ref: weakref.ref[DTensor]) -> None:
    """A noted parameter was freed: drop its record."""
    with _lock:
        refs = [r for r in _seen.get(ptr, []) if r is not ref and r() is not None]
        if refs:
            _seen[ptr] = refs
        else:
            _seen.pop(ptr, None)


def dtensor_of(t: object) -> DTensor | None:
    """The noted DTensor parameter whose local tensor ``t`` is (same storage, offset, shape, strides), else None."""
    if not isinstance(t, Tensor) or is_dtensor(t) or t.is_meta or not _seen:
        return None
    ptr = _address(t)
    with _lock:
        refs = [r for r in _seen.get(ptr, []) if r() is not None]
        if refs:
            _seen[ptr] = refs
        else:
            _seen.pop(ptr, None)
    for ref in refs:
        p = ref()
        if p is None:
            continue
        local = _local(p)
        same = _address(local) == ptr and local.storage_offset() == t.storage_offset()
        if same and local.shape == t.shape and local.stride() == t.stride():
            return p
    return None


@dataclass(frozen=True)
class MegatronShard:
    """Where a Megatron-style shard sits in its logical parameter.

    Attributes:
        dim: the partition dim.
        stride: the partition stride (chunks per rank along ``dim``).
        world: the tensor-parallel world size.
        rank: this rank in it.
        local_shape: the shard's shape.
    """

    dim: int
    stride: int
    world: int
    rank: int
    local_shape: tuple[int, ...]

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The logical parameter's shape: the partition dim ``world`` times longer."""
        s = list(self.local_shape)
        s[self.dim] *= self.world
        return tuple(s)

    def pieces(self, local: Tensor) -> list[tuple[Tensor, list[range]]]:
        """The shard's boxes: ``stride`` views of ``local`` along ``dim``, each with its global ranges."""
        chunk = self.local_shape[self.dim] // self.stride
        out: list[tuple[Tensor, list[range]]] = []
        for j in range(self.stride):
            start = (j * self.world + self.rank) * chunk
            ranges = [range(n) for n in self.local_shape]
            ranges[self.dim] = range(start, start + chunk)
            out.append((local.narrow(self.dim, j * chunk, chunk), ranges))
        return out


def _int_attr(p: Tensor, name: str) -> int | None:
    v: Any = getattr(p, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _group(p: Tensor) -> tuple[int, int]:
    """(world size, rank) of ``p``'s tensor-parallel group (see the module docstring); (1, 0) when none is known."""
    world, rank = _int_attr(p, "tensor_model_parallel_world_size"), _int_attr(p, "tensor_model_parallel_rank")
    if world is not None or rank is not None:
        if world is None or rank is None or not 0 <= rank < world:
            raise PackedInitError(
                f"tensor-parallel shard of shape {fmt_shape(p.shape)}: tensor_model_parallel_world_size={world!r} "
                f"and tensor_model_parallel_rank={rank!r} must both be set, with 0 <= rank < world size."
            )
        return world, rank
    ps = sys.modules.get("megatron.core.parallel_state")
    is_init = getattr(ps, "model_parallel_is_initialized", None) if ps is not None else None
    if callable(is_init) and is_init():
        assert ps is not None
        return int(ps.get_tensor_model_parallel_world_size()), int(ps.get_tensor_model_parallel_rank())
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size()), int(dist.get_rank())
    return 1, 0


def megatron_shard(t: object) -> MegatronShard | None:
    """The geometry of a Megatron-style shard (``None`` for anything else, or a world size of 1).

    Raises:
        PackedInitError: attributes that do not describe a shard of ``t`` (a partition dim out of range, a
            stride that does not divide it, a world size without a rank).

    Examples:
        >>> w = torch.nn.Parameter(torch.empty(128, 64))  # rank 1 of 2 of a Linear(64, 256) split by rows
        >>> w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, 0, 1
        >>> w.tensor_model_parallel_world_size, w.tensor_model_parallel_rank = 2, 1
        >>> shard = megatron_shard(w)
        >>> shard.global_shape, [r for r in shard.pieces(w)[0][1]]
        ((256, 64), [range(128, 256), range(0, 64)])
    """
    if not isinstance(t, nn.Parameter) or is_dtensor(t) or getattr(t, "tensor_model_parallel", False) is not True:
        return None
    dim, stride = _int_attr(t, "partition_dim"), _int_attr(t, "partition_stride")
    stride = 1 if stride is None and getattr(t, "partition_stride", None) is None else stride
    shape = tuple(int(n) for n in t.shape)
    ok = dim is not None and -len(shape) <= dim < len(shape) and stride is not None and stride >= 1
    if not ok or shape[dim % len(shape)] % stride:  # type: ignore[operator]  # dim, stride checked by `ok`
        raise PackedInitError(
            f"tensor-parallel shard of shape {fmt_shape(shape)}: partition_dim={getattr(t, 'partition_dim', None)!r}, "
            f"partition_stride={getattr(t, 'partition_stride', None)!r} do not describe it (the partition dim must "
            f"be one of its dims and the stride must divide its length); fix the attributes, or set "
            f"tensor_model_parallel=False for a tensor that is not sharded."
        )
    assert dim is not None
    assert stride is not None
    world, rank = _group(t)
    if world <= 1:
        return None
    return MegatronShard(dim % len(shape), stride, world, rank, shape)

r"""Fans from a local shard: sharded weights whose init computed its fans from one rank's piece.

A fan-dependent init (``xavier_*``, ``kaiming_*``, ``orthogonal_``) run on the local shard of a
tensor-parallel weight (TransformerEngine's ``reset_parameters`` on ``param._local_tensor``,
Megatron's GPU init on the rank's partition) reads the shard's shape: for ``Linear(64, 256)``
split by rows over :math:`k` ranks, ``xavier`` draws with std
:math:`\sqrt{2/(\text{fan\_in} + \text{fan\_out}/k)}` instead of
:math:`\sqrt{2/(\text{fan\_in} + \text{fan\_out})}`: a ratio of
:math:`\sqrt{(\text{fan\_in}+\text{fan\_out})/(\text{fan\_in}+\text{fan\_out}/k)}`, 1.29 at
:math:`k = 2` and 1.58 at :math:`k = 4`, growing with the tensor-parallel degree.

For every sharded weight (a DTensor parameter whose local shard is smaller than it, a
Megatron-style shard, see :mod:`packedinit.model.shards`) the local values are measured and tested
against each fan-dependent reference run on the logical (global) shape and on the local shape.
A weight is flagged when its std and kurtosis fit a reference on the local shape, that reference
on the local shape is not the same std as on the logical one, and no reference fits it on the
logical shape; fan-free inits (``normal_``, ``uniform_``, constants) are never flagged. Read-only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from packedinit.auditing.stats import DEFAULT_REFERENCES, KURT_VAR, Reference, Z, family_of, moments, tolerance
from packedinit.errors import PackedInitError
from packedinit.layout import Layout
from packedinit.model.shards import is_dtensor, megatron_shard
from packedinit.shapes import fmt_shape

__all__ = ["LocalFans", "local_fans"]

#: Fewer local values than this cannot tell the fans apart reliably: not tested.
MIN_VALUES = 256


@dataclass(frozen=True)
class LocalFans:
    """One sharded weight whose values fit an init run with the fans of its local shard.

    Attributes:
        name: the parameter's name.
        shape: the logical (global) shape.
        local_shape: the shape of this rank's shard.
        sharding: how it is sharded, in words (``"DTensor (Shard(0),) on mesh (2,)"``).
        reference: the reference init the values fit on the local shape (e.g. ``"xavier"``).
        std: the std measured on the local shard.
        expected: the std that reference gives the logical (per-block) weight.
        predicted_ratio: the std the reference gives the local shape over :attr:`expected`.
    """

    name: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    sharding: str
    reference: str
    std: float
    expected: float
    predicted_ratio: float

    @property
    def measured_ratio(self) -> float:
        """The measured std over the logical per-block std."""
        return self.std / self.expected

    def describe(self) -> str:
        """One line: ``"weight: fans from a local shard: ... 1.29x the logical per-block std ..."``."""
        return (
            f"{self.name}: fans from a local shard: {self.reference} on the local {fmt_shape(self.local_shape)} "
            f"of {fmt_shape(self.shape)} ({self.sharding}) gives {self.predicted_ratio:.2f}x the logical "
            f"per-block std {self.expected:.4g} (measured {self.measured_ratio:.2f}x)"
        )


def _geometry(p: Tensor) -> tuple[Tensor, tuple[int, ...], str] | None:
    """(local values, logical shape, how sharded) of a sharded weight; ``None`` for any other tensor."""
    if is_dtensor(p):
        with torch.no_grad():
            local: Tensor = p.to_local()  # type: ignore[attr-defined]  # a DTensor, checked above
        if tuple(local.shape) == tuple(p.shape):
            return None
        mesh = tuple(p.device_mesh.shape)  # type: ignore[attr-defined]  # a DTensor
        return local, tuple(p.shape), f"DTensor {tuple(p.placements)} on mesh {mesh}"  # type: ignore[attr-defined]
    try:
        geo = megatron_shard(p)
    except PackedInitError:  # attributes that describe no shard: not the audit's to judge here
        return None
    if geo is None:
        return None
    how = f"tensor-parallel partition_dim={geo.dim}, stride {geo.stride}, rank {geo.rank} of {geo.world}"
    return p, geo.global_shape, how


def _kurtosis_fits(ref: Reference, shape: Sequence[int], kurt: float, n: int) -> bool:
    for fn in (ref.fn, *ref.also):
        try:
            expected = ref.kurtosis(fn, shape)
        except KeyError:  # a function the audit has no family for
            continue
        if expected is None or abs(kurt - expected) <= Z * math.sqrt(KURT_VAR[family_of(fn)] / n) + 0.02:
            return True
    return False


def _orthonormal(local: Tensor, gain: float) -> bool:
    """Whether a few rows (or columns, whichever are fewer) of ``local`` are orthogonal with norm ``gain``."""
    mat = local.detach().reshape(local.shape[0], -1).double()
    if mat.shape[0] > mat.shape[1]:
        mat = mat.T
    few = mat[:8]
    gram = few @ few.T
    eye = torch.eye(few.shape[0], dtype=gram.dtype, device=gram.device) * gain * gain
    return bool(torch.allclose(gram, eye, atol=1e-3 * gain * gain))


def _block_shape(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The logical shape of every block of ``layout`` on ``shape``; ``None`` when they differ (or it does not fit)."""
    try:
        found = {tuple(b.shape) for b in layout.blocks(shape)}
    except PackedInitError:
        return None
    return found.pop() if len(found) == 1 else None


def _gain(r: Reference) -> float:
    return float(dict(r.kwargs).get("gain", 1.0))


def _fits(std: float, expected: float | None, tol: float) -> bool:
    return expected is not None and expected > 0 and abs(math.log(std / expected)) <= tol


def local_fans(
    model: nn.Module,
    references: Sequence[Reference] = DEFAULT_REFERENCES,
    layouts: Mapping[str, Layout] | None = None,
) -> tuple[LocalFans, ...]:
    r"""The sharded weights of ``model`` (on this rank) whose init used the fans of the local shard.

    Args:
        model: the model; its DTensor and Megatron-style tensor-parallel parameters are tested.
        references: the inits to compare with (the fan-dependent ones can flag).
        layouts: ``{name: Layout}`` of the packed parameters (the logical per-block shape is then a
            block's; a packed weight with blocks of different shapes is not tested).

    Returns:
        One :class:`LocalFans` per flagged weight, in ``named_parameters`` order.

    Examples:
        >>> w = torch.nn.Parameter(torch.empty(128, 64))  # rank 0 of 2 of a Linear(64, 256), rows
        >>> w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, 0, 1
        >>> w.tensor_model_parallel_world_size, w.tensor_model_parallel_rank = 2, 0
        >>> _ = torch.nn.init.xavier_uniform_(w, generator=torch.Generator().manual_seed(0))  # local fans
        >>> m = torch.nn.Module()
        >>> m.weight = w
        >>> [f"{f.name} {f.reference} {f.predicted_ratio:.2f}" for f in local_fans(m)]
        ['weight xavier 1.29']
        >>> _ = torch.nn.init.normal_(w, std=0.02)  # fan-free: never flagged
        >>> local_fans(m)
        ()
    """
    out: list[LocalFans] = []
    for name, p in model.named_parameters():
        geo = _geometry(p)
        if geo is None:
            continue
        local, shape, how = geo
        layout = (layouts or {}).get(name)
        logical = _block_shape(layout, shape) if layout is not None else shape
        if logical is None:
            continue
        if local.is_meta or not local.is_floating_point() or local.numel() < MIN_VALUES:
            continue
        with torch.no_grad():
            m = moments(local.detach())
        if not m.finite or m.std <= 0:
            continue
        tol = tolerance(m.n, m.kurtosis)
        local_shape = tuple(local.shape)
        if len(local_shape) < 2:
            continue
        # orthonormal rows (or columns) of the shard tell an orthogonal_ run on the shard from i.i.d. draws
        # (a shard of an orthogonal_ run on the whole weight is not orthonormal itself)
        ortho = {r.name: _orthonormal(local, _gain(r)) for r in references if r.fn == "orthogonal_"}
        on_shard = any(ortho.values())
        if any(_fits(m.std, r.std(logical), tol) for r in references if not on_shard or ortho.get(r.name, False)):
            continue  # fits some init on the logical shape: nothing to say
        best: tuple[float, Reference, float, float] | None = None
        for r in references:
            if r.fan_independent or ortho.get(r.name, False) != on_shard:
                continue
            g, loc = r.std(logical), r.std(local_shape)
            if g is None or loc is None or abs(math.log(loc / g)) <= tol or not _fits(m.std, loc, tol):
                continue
            if not _kurtosis_fits(r, local_shape, m.kurtosis, m.n):
                continue
            miss = abs(math.log(m.std / loc))
            if best is None or miss < best[0]:
                best = (miss, r, g, loc)
        if best is not None:
            _, r, g, loc = best
            out.append(LocalFans(name, shape, local_shape, how, r.name, m.std, g, loc / g))
    return tuple(out)

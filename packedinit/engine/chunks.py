"""The ``chunks``/``dim`` arguments of the public API, turned into a checked Layout.

``chunks`` is a number of equal blocks, a list of block sizes, or a :class:`~packedinit.Layout`;
``dim`` the packed dim for the first two. :func:`logical_blocks` shows what the engine will hand
the init function for each block.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TypeAlias, Union

from torch import Tensor

from packedinit.errors import PackedInitError
from packedinit.layout import Layout, LogicalBlock
from packedinit.shapes import fmt_shape, is_int, where_prefix
from packedinit.torch_compat import compile_safe_cache

__all__ = ["Chunks", "as_layout", "logical_blocks"]

#: What ``chunks`` may be: a number of equal blocks, a list of block sizes, or a Layout.
Chunks: TypeAlias = Union[int, Sequence[int], "Layout"]  # a union with a class: kept as Union for the alias


def as_layout(
    chunks: Chunks | None,
    dim: int | None,
    shape: Sequence[int],
    *,
    param: str | None = None,
) -> Layout | None:
    """Turn the ``chunks``/``dim`` arguments of the public API into a checked Layout.

    ``chunks=None`` (or ``1``) is the one-block layout of an unpacked tensor.
    ``None`` is returned when the packed dim has length 0 (nothing to initialise).
    Results are cached for hashable arguments (plain ints, tuples/lists of ints, Layouts).
    """
    shape = tuple(shape)
    if type(chunks) is list:
        chunks = tuple(chunks)
    cacheable = (
        (chunks is None or type(chunks) is int or type(chunks) is Layout or type(chunks) is tuple)
        and (dim is None or type(dim) is int)
        and all(type(s) is int for s in shape)
        and (type(chunks) is not tuple or all(type(s) is int for s in chunks))
    )
    if cacheable:
        return _as_layout_cached(chunks, dim, shape, param)
    return _as_layout(chunks, dim, tuple(operator.index(s) for s in shape), param)


def _as_layout(
    chunks: Chunks | None,
    dim: int | None,
    shape: tuple[int, ...],
    param: str | None,
) -> Layout | None:
    where = f"{where_prefix(param)}of shape {fmt_shape(shape)}"
    ndim = len(shape)
    if dim is not None and not is_int(dim):
        raise PackedInitError(f"{where}: dim must be an int, got {dim!r}.")
    if isinstance(chunks, Layout):
        if dim is not None and operator.index(dim) != chunks.dim:
            d = operator.index(dim)
            if not (-ndim <= d < ndim and chunks.normalized_dim(ndim) == d % ndim):
                raise PackedInitError(f"{where}: dim={d} disagrees with {chunks!r}; pass dim=None with a Layout.")
        chunks.check(shape, param=param)
        return chunks
    d = 0 if dim is None else operator.index(dim)
    if ndim == 0:
        raise PackedInitError(f"{where}: a 0-D tensor has no dim to pack; pass a tensor with at least 1 dim.")
    if not -ndim <= d < ndim:
        raise PackedInitError(
            f"{where}: dim {d} is out of range for a {ndim}-D tensor; use a dim in [{-ndim}, {ndim - 1}]."
        )
    length = shape[d]
    if chunks is None:
        return Layout(dim=d, sizes=(length,)) if length > 0 else None
    if is_int(chunks):
        n = operator.index(chunks)
        if n < 1:
            raise PackedInitError(f"{where}: chunks={n} must be a positive number of blocks.")
        if length % n:
            raise PackedInitError(
                f"{where}: dim {d} has length {length}, which {n} equal chunks cannot divide; "
                f"pass sizes instead, e.g. chunks=[...] summing to {length}."
            )
        if length == 0:
            return None
        return Layout(dim=d, sizes=(length // n,) * n)
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Sequence):
        raise PackedInitError(
            f"{where}: chunks must be an int, a sequence of sizes or a Layout, got {type(chunks).__name__}."
        )
    sizes = list(chunks)
    for s in sizes:
        if not is_int(s) or operator.index(s) <= 0:
            raise PackedInitError(
                f"{where}: chunks={sizes} has a non-positive or non-int size {s!r}; sizes must be positive ints."
            )
    if not sizes:
        raise PackedInitError(f"{where}: chunks=[] is empty; give at least one block size.")
    total = sum(operator.index(s) for s in sizes)
    if total != length:
        raise PackedInitError(
            f"{where}: chunks={sizes} sum to {total} but dim {d} has length {length}; sizes must sum to {length}."
        )
    return Layout(dim=d, sizes=sizes)


_as_layout_cached = compile_safe_cache(maxsize=4096)(_as_layout)


def logical_blocks(
    tensor: Tensor | Sequence[int],
    chunks: Chunks | None = None,
    dim: int | None = None,
) -> tuple[LogicalBlock, ...]:
    """The logical blocks, with their shapes and fans, of a packed tensor.

    This is what every fan-dependent init should see: one entry per logical
    block, with ``fan_in``/``fan_out`` computed exactly as ``torch.nn.init``
    computes them for a separate tensor of the block's shape.

    Args:
        tensor: a tensor (any device, meta included) or a shape.
        chunks: the number of equal blocks, a list of sizes, or a :class:`Layout`.
        dim: the packed dim when ``chunks`` is not a Layout (default 0).

    Examples:
        >>> import torch
        >>> mha = torch.nn.MultiheadAttention(16, 4)
        >>> [(b.shape, b.fan_in, b.fan_out) for b in logical_blocks(mha.in_proj_weight, 3)]
        [(torch.Size([16, 16]), 16, 16), (torch.Size([16, 16]), 16, 16), (torch.Size([16, 16]), 16, 16)]
    """
    shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else tuple(int(s) for s in tensor)
    layout = as_layout(chunks, dim, shape)
    return () if layout is None else layout.blocks(shape)

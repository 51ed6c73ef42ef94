"""Shapes as torch.nn.init sees them: a shape's fans, one logical block (:class:`LogicalBlock`), the
integer test for sizes and dims, and shapes as messages print them. Holds no data and imports no packedinit module."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import SupportsIndex, TypeGuard

import torch

__all__ = ["LogicalBlock", "fans", "fmt_shape", "is_int", "where_prefix"]


def fmt_shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def where_prefix(param: str | None) -> str:
    return f"parameter {param!r} " if param else "tensor "


@dataclass(frozen=True)
class LogicalBlock:
    """One logical matrix held inside a packed tensor.

    Attributes:
        index: position in block order (batch index major, then part).
        batch_index: index into the layout's batch dims (``()`` when none).
        part: which entry of ``Layout.sizes`` this block is.
        name: the part's name, when the layout names its parts.
        shape: the logical shape, ``(out, in, *rest)`` as ``torch.nn.init`` sees it.
        fan_in: ``torch.nn.init``'s fan_in of ``shape`` (``None`` below 2 dims).
        fan_out: ``torch.nn.init``'s fan_out of ``shape`` (``None`` below 2 dims).
    """

    index: int
    batch_index: tuple[int, ...]
    part: int
    name: str | None
    shape: torch.Size
    fan_in: int | None
    fan_out: int | None

    @functools.cached_property
    def numel(self) -> int:
        """Number of elements of the block."""
        return math.prod(self.shape)

    @property
    def label(self) -> str:
        """A short human name: ``"k"``, ``"part 1"``, ``"[3] gate"``."""
        base = self.name if self.name is not None else f"part {self.part}"
        if self.batch_index:
            return "[" + ", ".join(map(str, self.batch_index)) + "] " + base
        return base


def fans(shape: Sequence[int]) -> tuple[int | None, int | None]:
    if len(shape) < 2:
        return None, None
    receptive = math.prod(shape[2:])
    return int(shape[1]) * receptive, int(shape[0]) * receptive


def is_int(x: object) -> TypeGuard[SupportsIndex]:
    """An integer (Python, numpy or 0-d integer tensor), but not a bool."""
    if isinstance(x, int):
        return not isinstance(x, bool)
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.dtype.is_floating_point and not x.dtype.is_complex and x.dtype != torch.bool
    if type(x).__name__ in ("bool_", "bool"):  # numpy.bool_ has __index__ in old numpy
        return False
    try:
        operator.index(x)  # type: ignore[arg-type]  # probing: anything with __index__ is an integer
    except TypeError:
        return False
    return True

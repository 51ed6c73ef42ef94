"""The forward tracer's coordinate and label tensors, each made once per geometry.

A weight on its way to a matmul is followed by two coordinate tensors (the storage row and column of
every element, expanded ``arange``\\ s) and a projection's output by a label tensor (the weight row of
every feature, expanded along the other dims). A model's repeated layers read equal ones: the same
shapes, strides and memory. Label and coordinate tensors are never written in place (every op on them
makes a new tensor or a view), so while one is alive, its memory, shape and strides say its numbers:
:class:`Coords` keeps what is made from one (its line along an axis, its expansion to an output, its
distinct rows) by that geometry, and holds the tensor so that its memory is not reused meanwhile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from packedinit.trace.rows import rows_of

__all__ = ["Coords", "line", "along"]


def line(coords: Tensor, axis: int) -> Tensor:
    """The coordinates along one axis (all others at 0).

    Examples:
        >>> rows = torch.arange(3).view(-1, 1).expand(3, 4)
        >>> line(rows, 0).tolist(), line(rows, 1).tolist()
        ([0, 1, 2], [0, 0, 0, 0])
    """
    return coords[tuple(slice(None) if i == axis % coords.dim() else 0 for i in range(coords.dim()))]


def along(out: Tensor, axis: int, values: Tensor) -> Tensor:
    """``values`` (1-D) laid along ``out``'s ``axis``, expanded to ``out``'s shape (no copy).

    Examples:
        >>> along(torch.empty(2, 3), -1, torch.arange(3)).tolist()
        [[0, 1, 2], [0, 1, 2]]
    """
    return values.view([-1 if i == axis % out.dim() else 1 for i in range(out.dim())]).expand(out.shape)


class Coords:
    """One trace's coordinate and label tensors and what is read of them, each made once per geometry.

    Examples:
        >>> coords = Coords()
        >>> rows, cols = coords.of_weight((4, 2))
        >>> coords.of_weight((4, 2))[0] is rows, coords.every_row(coords.line(rows, 0), 4)
        (True, True)
        >>> sorted(coords.distinct(rows[1:3]))
        [1, 2]
    """

    def __init__(self) -> None:
        self._aranges: dict[int, Tensor] = {}
        self._weights: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}  # a weight's (rows, cols), by shape
        self._rows: dict[tuple[object, ...], tuple[Tensor, frozenset[int]]] = {}
        self._views: dict[tuple[object, ...], tuple[Tensor, Tensor]] = {}  # line / along results, by geometry

    def arange(self, n: int) -> Tensor:
        """``torch.arange(n)``, one per ``n``."""
        kept = self._aranges.get(n)
        if kept is None:
            kept = self._aranges[n] = torch.arange(n)
        return kept

    def of_weight(self, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """The storage row (dim -2) and column (dim -1) of every element of a weight of ``shape``."""
        kept = self._weights.get(shape)
        if kept is None:
            rows = self.arange(shape[-2]).view(-1, 1).expand(shape)
            kept = self._weights[shape] = (rows, self.arange(shape[-1]).expand(shape))
        return kept

    @staticmethod
    def _geometry(t: Tensor, *more: object) -> tuple[object, ...]:
        return (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), *more)

    def distinct(self, labels: Tensor, *, flat: bool = False) -> frozenset[int]:
        """:func:`~packedinit.trace.rows.rows_of` (``flat``: of a 1-D line of coordinates), once per labelling."""
        key = self._geometry(labels, flat)
        kept = self._rows.get(key)
        if kept is None:
            rows = frozenset(labels.tolist()) if flat else rows_of(labels)
            kept = self._rows[key] = (labels, rows)
        return kept[1]

    def every_row(self, coords: Tensor, rows: int) -> bool:
        """Whether a 1-D line of coordinates is the whole ``arange(rows)`` itself (a weight used unsliced)."""
        whole = self._aranges.get(rows)
        return (
            whole is not None and coords.shape == whole.shape and coords.stride() == (1,)
            and coords.storage_offset() == 0 and coords.data_ptr() == whole.data_ptr()
        )  # fmt: skip

    def line(self, coords: Tensor, axis: int) -> Tensor:
        """:func:`line`, once per coordinate tensor and axis."""
        key = self._geometry(coords, "line", axis)
        kept = self._views.get(key)
        if kept is None:
            kept = self._views[key] = (coords, line(coords, axis))
        return kept[1]

    def along(self, out: Tensor, axis: int, values: Tensor) -> Tensor:
        """:func:`along`, once per values tensor, output shape and axis."""
        key = self._geometry(values, "along", tuple(out.shape), axis)
        kept = self._views.get(key)
        if kept is None:
            kept = self._views[key] = (values, along(out, axis, values))
        return kept[1]

"""Layouts of the forward tracer compared: the Layout a row labelling gives, whether two layouts cut the
same blocks, and where the forward and the registered layouts disagree."""

from __future__ import annotations

import functools
from collections.abc import Mapping

from packedinit.layout import Layout
from packedinit.trace.verdict import Inferred

__all__ = ["layout_of_labels", "same_blocks", "disagreements"]


def layout_of_labels(labels: list[int], dim: int, transposed: bool, batch_dims: int) -> Layout | None:
    """The Layout whose blocks are the runs of equal ``labels`` along the packed dim; ``None`` for one block.

    The smallest number of groups is taken for which every group is the same sequence of
    contiguous runs, each label in one run.

    Examples:
        >>> layout_of_labels([0, 0, 1, 2, 0, 0, 1, 2], 0, False, 0)
        Layout(dim=0, sizes=(2, 1, 1), groups=2)
        >>> layout_of_labels([5, 5, 5], 0, False, 0) is None
        True
    """
    n = len(labels)
    if len(set(labels)) < 2:
        return None
    for g in range(1, n + 1):
        if n % g:
            continue
        step = n // g
        pattern = labels[:step]
        if any(labels[i * step : (i + 1) * step] != pattern for i in range(1, g)):
            continue
        sizes: list[int] = []
        seen: list[int] = []
        for lab in pattern:
            if seen and seen[-1] == lab:
                sizes[-1] += 1
            else:
                seen.append(lab)
                sizes.append(1)
        if len(set(seen)) == len(seen) and len(seen) > 1:
            return Layout(dim + batch_dims, sizes, groups=g, transposed=transposed, batch_dims=batch_dims)
    return None


@functools.lru_cache(maxsize=256)
def _row_labels(groups: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(j for _ in range(groups) for j, size in enumerate(sizes) for _ in range(size))


def same_blocks(a: Layout | None, b: Layout | None) -> bool:
    """Whether two layouts (``None``: one block) cut the same dim into the same blocks (names aside).

    Examples:
        >>> same_blocks(Layout(0, [4, 4], names=("k", "v")), Layout(0, [4, 4]))
        True
        >>> same_blocks(Layout(0, [2, 2], groups=2), Layout(0, [4, 4]))
        False
    """
    if a is not None and len(a.sizes) == 1 and a.groups == 1:
        a = None  # one block (a Conv1D's transposed storage): not packed
    if b is not None and len(b.sizes) == 1 and b.groups == 1:
        b = None
    if a is None or b is None:
        return a is None and b is None
    if (a.dim, a.transposed, a.batch_dims) != (b.dim, b.transposed, b.batch_dims):
        return False
    cut_a, cut_b = (a.groups, tuple(a.sizes)), (b.groups, tuple(b.sizes))
    return cut_a == cut_b or _row_labels(*cut_a) == _row_labels(*cut_b)  # (equal cuts: no labels to make)


def disagreements(inferred: Mapping[str, Inferred], claimed: Mapping[str, Layout]) -> list[tuple[str, str]]:
    """``(name, why)`` for every weight where the forward and the registered layouts disagree (opaque ones skipped).

    Examples:
        >>> from packedinit.trace.verdict import Inferred
        >>> seen = {"w": Inferred("packed", Layout(0, [4, 4]), "split")}
        >>> disagreements(seen, {})
        [('w', 'the forward shows Layout(dim=0, sizes=(4, 4)); no adapter or annotation describes it')]
    """
    out: list[tuple[str, str]] = []
    for name, found in inferred.items():
        if found.verdict == "opaque":
            continue
        mine = claimed.get(name)
        if same_blocks(mine, found.layout):
            continue
        if mine is None:
            out.append((name, f"the forward shows {found.layout!r}; no adapter or annotation describes it"))
        else:
            out.append((name, f"the adapters say {mine!r}, the forward shows {found.layout!r}"))
    return out

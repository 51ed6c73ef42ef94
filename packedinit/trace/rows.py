"""Row bookkeeping of the forward tracer: the rows each weight's output features come from, the pieces the
forward keeps apart, and the blocks they give (:func:`blocks_of`). Labels are CPU tensors of row numbers,
mostly expanded views (a batch or a sequence costs nothing); they are counted, never sorted."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["WeightRows", "blocks_of", "compact", "pairs_of", "rows_of"]


@dataclass
class WeightRows:
    """One traced weight: its output rows, where they lie in storage, and what the forward did with them."""

    name: str
    rows: int
    dim: int  # storage dim of the rows, counted after the batch dims (0: (out, in); 1: (in, out))
    transposed: bool
    batch_dims: int
    pieces: list[frozenset[int]] = field(default_factory=list)
    # (pieces recorded before it, rows, from a cat): a cat is undone by a later split that separates its rows
    merges: list[tuple[int, frozenset[int], bool]] = field(default_factory=list)
    uses: set[str] = field(default_factory=set)


def compact(*labels: Tensor) -> tuple[Tensor, ...]:
    """The label tensors without the dims along which all of them repeat (stride 0: a batch, a sequence)."""
    keep = tuple(
        0 if size > 1 and all(t.stride(i) == 0 for t in labels) else slice(None)
        for i, size in enumerate(labels[0].shape)
    )
    return tuple(t[keep] for t in labels)


def rows_of(labels: Tensor) -> frozenset[int]:
    """The distinct row numbers in a label tensor (a count, not a sort: labels are small and non-negative)."""
    (small,) = compact(labels)
    return frozenset(torch.bincount(small.reshape(-1)).nonzero().view(-1).tolist())


def pairs_of(a: Tensor, b: Tensor) -> set[tuple[int, int]]:
    """The distinct ``(a[i], b[i])`` pairs of two label tensors of one shape."""
    a, b = compact(a, b.expand(a.shape))
    width = int(b.max()) + 1
    codes = torch.tensor(sorted(set((a.reshape(-1) * width + b.reshape(-1)).tolist())), dtype=torch.long)
    return set(zip((codes // width).tolist(), (codes % width).tolist(), strict=True))  # a set: torch's sort is slow


def blocks_of(w: WeightRows) -> list[int]:
    """A block label per row: rows in the same pieces share a block; concatenated-back pieces merge.

    Examples:
        >>> w = WeightRows("qkv", 6, 0, False, 0, pieces=[frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5})])
        >>> blocks_of(w)
        [0, 0, 1, 1, 2, 2]
    """
    if not w.pieces:
        return [0] * w.rows  # used whole: one block (a merge can only join it with itself)
    member = torch.zeros(len(w.pieces), w.rows, dtype=torch.bool)
    for j, piece in enumerate(w.pieces):
        at = torch.tensor(list(piece), dtype=torch.long)
        member[j, at[at < w.rows]] = True
    if len(w.pieces) < 63:  # each row's pieces as the bits of one number
        codes = (member.long() << torch.arange(len(w.pieces)).view(-1, 1)).sum(0)
    else:  # each row's pieces as one column of the membership matrix
        codes = torch.unique(member, dim=1, return_inverse=True)[1]
    labels = _first_seen(codes)
    parent = list(range(max(labels, default=0) + 1))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for before, rows, by_cat in w.merges:
        if by_cat and any(0 < len(rows & p) < len(rows) for p in w.pieces[before:]):
            continue  # concatenated, then split again along its pieces (a conv over [q | k | v])
        blocks = sorted({labels[r] for r in rows if r < w.rows})
        for b in blocks[1:]:
            parent[root(b)] = root(blocks[0])
    if len(parent) == 1 or not w.merges:
        return labels
    roots = torch.tensor([root(i) for i in range(len(parent))])
    out: list[int] = roots[torch.tensor(labels)].tolist()
    return out


def _first_seen(codes: Tensor) -> list[int]:
    """Each code's number in order of first appearance (``[7, 7, 3, 7, 5] -> [0, 0, 1, 0, 2]``), vectorised."""
    values, inverse = torch.unique(codes, return_inverse=True)
    n = codes.numel()
    first = torch.full((values.numel(),), n, dtype=torch.long).scatter_reduce_(0, inverse, torch.arange(n), "amin")
    rank = torch.empty_like(first)
    rank[first.argsort()] = torch.arange(values.numel())
    out: list[int] = rank[inverse].tolist()
    return out

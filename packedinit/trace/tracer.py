"""The tracer itself: a ``TorchFunctionMode`` that labels every output feature of a projection with the
weight row it comes from and records which sets of rows the forward keeps apart (see :mod:`packedinit.trace.forward`).

The labels are CPU tensors of row numbers that ride beside the traced tensors, which may be on the meta device:
the tracer reads shapes only, never values of the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["Tracer", "WeightRows", "blocks_of"]

@dataclass
class WeightRows:
    name: str
    rows: int
    dim: int  # storage dim of the rows (after batch dims)
    transposed: bool
    batch_dims: int
    pieces: list[frozenset[int]] = field(default_factory=list)
    # (pieces recorded before it, rows, from a cat): a cat is undone by a later split that separates its rows
    merges: list[tuple[int, frozenset[int], bool]] = field(default_factory=list)
    uses: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Ref:
    """A weight, a per-expert slice of it, or a transpose of either, before it reaches a matmul."""

    name: str
    batch_dims: int
    swapped: bool  # the last two dims are swapped relative to storage


_SHAPE_METHODS = {
    "view", "reshape", "transpose", "permute", "contiguous", "unsqueeze", "squeeze", "flatten", "unflatten",
    "expand", "expand_as", "__getitem__", "split", "chunk", "unbind", "narrow", "select", "movedim", "swapaxes",
    "t", "split_with_sizes", "tensor_split", "view_as", "reshape_as", "clone", "detach",
}  # fmt: skip
_PASS_METHODS = {"to", "float", "half", "bfloat16", "double", "type_as", "type", "cpu", "requires_grad_"}
_ELEMENTWISE = {
    "add", "sub", "mul", "div", "neg", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
    "__truediv__", "__neg__", "relu", "gelu", "silu", "sigmoid", "tanh", "exp", "softplus", "pow", "__pow__",
    "clamp", "abs", "square", "sqrt", "rsqrt", "dropout", "leaky_relu", "elu", "mish", "hardswish", "erf",
}  # fmt: skip
_MATMULS = {"matmul", "__matmul__", "mm", "bmm"}
_SUMS = {"add", "sub", "__add__", "__radd__", "__sub__", "__rsub__", "__iadd__", "__isub__", "add_", "sub_"}


def _compact(*labels: Tensor) -> tuple[Tensor, ...]:
    """The label tensors without the dims along which all of them repeat (stride 0: a batch, a sequence)."""
    keep = tuple(
        0 if size > 1 and all(t.stride(i) == 0 for t in labels) else slice(None)
        for i, size in enumerate(labels[0].shape)
    )
    return tuple(t[keep] for t in labels)


def _rows(labels: Tensor) -> frozenset[int]:
    """The distinct row numbers in a label tensor (a count, not a sort: labels are small and non-negative)."""
    (small,) = _compact(labels)
    return frozenset(torch.bincount(small.reshape(-1)).nonzero().view(-1).tolist())


def _pairs(a: Tensor, b: Tensor) -> set[tuple[int, int]]:
    """The distinct ``(a[i], b[i])`` pairs of two label tensors of one shape."""
    a, b = _compact(a, b.expand(a.shape))
    width = int(b.max()) + 1
    codes = set((a.reshape(-1) * width + b.reshape(-1)).tolist())  # a set: torch's sort is slower on CPU
    return {divmod(c, width) for c in codes}


def _fname(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", "") or ""


class Tracer(TorchFunctionMode):
    def __init__(self, params: Mapping[int, str]) -> None:
        super().__init__()
        self.params = params  # id(param) -> name
        self.weights: dict[str, WeightRows] = {}
        self.refs: dict[int, tuple[Tensor, _Ref]] = {}
        self.labels: dict[int, tuple[Tensor, str, Tensor]] = {}  # id(t) -> (t, weight, label tensor)
        self.embedded: set[str] = set()

    # -- bookkeeping --------------------------------------------------------------------------
    def _ref(self, t: object) -> _Ref | None:
        if not isinstance(t, Tensor):
            return None
        name = self.params.get(id(t))
        if name is not None:
            return _Ref(name, 0, False)
        kept = self.refs.get(id(t))
        return kept[1] if kept is not None and kept[0] is t else None

    def _label(self, t: object) -> tuple[str, Tensor] | None:
        if not isinstance(t, Tensor):
            return None
        kept = self.labels.get(id(t))
        return (kept[1], kept[2]) if kept is not None and kept[0] is t else None

    def _tag(self, out: Tensor, weight: str, lab: Tensor) -> None:
        if lab.shape == out.shape:
            self.labels[id(out)] = (out, weight, lab)

    def _start(self, out: Tensor, ref: _Ref, weight: Tensor, axis: int, use: str) -> None:
        """``out``'s ``axis`` holds the rows of ``ref``'s projection."""
        shape = weight.shape
        # F.linear reads W as (out, in): rows are the second-to-last dim of what it was given;
        # matmul reads W as (in, out): rows are the last dim.
        row_dim = -2 if use == "linear" else -1
        if ref.swapped:
            row_dim = -1 if row_dim == -2 else -2
        rows = int(shape[row_dim])
        storage_dim = (len(shape) + row_dim) if not ref.swapped else (len(shape) + (-1 if row_dim == -2 else -2))
        # storage_dim counts dims of the slice handed in; the stored parameter has ref.batch_dims more
        dim = storage_dim - (len(shape) - 2)
        transposed = (use != "linear") != ref.swapped
        w = self.weights.get(ref.name)
        if w is None:
            w = self.weights[ref.name] = WeightRows(ref.name, rows, dim, transposed, ref.batch_dims)
        w.uses.add(use)
        lab = torch.arange(rows, device="cpu").view([rows if i == (axis % out.dim()) else 1 for i in range(out.dim())])
        self._tag(out, ref.name, lab.expand(out.shape))

    def _piece(self, weight: str, parent: Tensor, child: Tensor) -> None:
        rows = _rows(child)
        if rows and rows != _rows(parent):
            self.weights[weight].pieces.append(rows)

    # -- the mode -----------------------------------------------------------------------------
    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # a label we cannot carry through this op: that path is simply not followed
        with contextlib.suppress(RuntimeError, TypeError, ValueError, IndexError):
            self._follow(func, args, kwargs, out)
        return out

    def _follow(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        name = _fname(func)
        first = args[0] if args else None
        # a weight (or a slice / transpose of it) on its way to a matmul
        ref = self._ref(first)
        if ref is not None and isinstance(out, Tensor):
            if name == "__getitem__" and ref.batch_dims == 0 and first is not None and first.dim() >= 3:
                self.refs[id(out)] = (out, _Ref(ref.name, 1, ref.swapped))
                return
            if name in ("t", "transpose", "swapaxes", "mT") or (name == "T" and first is not None):
                self.refs[id(out)] = (out, _Ref(ref.name, ref.batch_dims, not ref.swapped))
                return
            # Mamba's depthwise conv weight (C, 1, k) goes in as squeeze(1), then unsqueeze(1)
            if name in _PASS_METHODS or name in ("contiguous", "detach", "squeeze", "unsqueeze"):
                self.refs[id(out)] = (out, ref)
                return
        if name == "linear" and len(args) >= 2 and isinstance(out, Tensor):
            wref = self._ref(args[1])
            if wref is not None:
                self._start(out, wref, args[1], -1, "linear")
                return
        if name in _MATMULS and len(args) >= 2 and isinstance(out, Tensor):
            wref = self._ref(args[1])
            if wref is not None:
                self._start(out, wref, args[1], -1, "matmul")
                return
        if name == "addmm" and len(args) >= 3 and isinstance(out, Tensor):
            wref = self._ref(args[2])
            if wref is not None:
                self._start(out, wref, args[2], -1, "matmul")
                return
        if name in _MATMULS and len(args) >= 2 and isinstance(out, Tensor) and out.dim() >= 2:
            wref = self._ref(args[0])
            if wref is not None:  # W @ x: the rows of W index the second-to-last dim of the result
                self._start(out, wref, args[0], -2, "linear")
                return
        if name in ("conv1d", "conv2d") and isinstance(out, Tensor):
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            wref = self._ref(weight)
            groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
            lab = self._label(first)
            if wref is not None and groups == 1 and isinstance(weight, Tensor):
                self._conv(out, wref, weight)
                return
            if wref is not None and isinstance(weight, Tensor):  # a grouped conv: each channel on its own
                held = WeightRows(wref.name, int(weight.shape[0]), 0, False, 0)
                self.weights.setdefault(wref.name, held).uses.add("conv")
            if lab is not None and isinstance(first, Tensor) and groups == out.shape[1] == first.shape[1]:
                channels = lab[1].movedim(1, 0).reshape(out.shape[1], -1)[:, 0]  # depthwise: channel c stays c
                self._tag(out, lab[0], channels.view([-1 if i == 1 else 1 for i in range(out.dim())]).expand(out.shape))
                return
        if name == "embedding" and len(args) >= 2:
            wref = self._ref(args[1])
            if wref is not None:
                self.embedded.add(wref.name)
                return
        if name in ("cat", "concat", "concatenate", "stack"):
            self._cat(func, args, kwargs, out)
            return
        lab = self._label(first)
        if lab is None:
            if name in _ELEMENTWISE and isinstance(out, Tensor) and len(args) >= 2:
                other = self._label(args[1])
                if other is not None and other[1].shape == out.shape:
                    self._tag(out, *other)
            return
        weight, labels = lab
        if name == "view_as_complex" and isinstance(out, Tensor):  # (..., 2) -> (...): each pair is one number
            w = self.weights[weight]
            for a, b in _pairs(labels[..., 0], labels[..., 1]):
                if a != b:
                    w.merges.append((len(w.pieces), frozenset((a, b)), False))
            self._tag(out, weight, labels[..., 0])
            return
        if name == "view_as_real" and isinstance(out, Tensor):
            self._tag(out, weight, labels.unsqueeze(-1).expand(out.shape))
            return
        if name in ("contiguous", "clone", "detach") and isinstance(out, Tensor):
            self._tag(out, weight, labels)  # same shape, same rows: no need to copy the labels
            return
        if name in _SHAPE_METHODS:
            sub = func(labels, *args[1:], **kwargs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            subs = sub if isinstance(sub, (tuple, list)) else (sub,)
            for o, s in zip(outs, subs, strict=False):
                if isinstance(o, Tensor) and isinstance(s, Tensor):
                    self._tag(o, weight, s)
                    self._piece(weight, labels, s)
            return
        if name in _PASS_METHODS and isinstance(out, Tensor):
            self._tag(out, weight, labels)
            return
        if name in _ELEMENTWISE and isinstance(out, Tensor):
            mine = labels.expand(out.shape)
            for other in (self._label(a) for a in args[1:]):
                if other is None or torch.equal(*_compact(theirs := other[1].expand(out.shape), mine)):
                    continue
                if other[0] != weight or (name not in _SUMS and _rows(theirs) != _rows(mine)):
                    return  # different features multiplied (a gate times a value): not followed further
                # features of one weight summed (rotary: x1 * cos - x2 * sin), or the same rows in another
                # order combined (x * cos + rotate_half(x) * sin): they are one block
                w = self.weights[weight]
                for a, b in _pairs(mine, theirs):
                    if a != b:
                        w.merges.append((len(w.pieces), frozenset((a, b)), False))
            self._tag(out, weight, mine)

    def _conv(self, out: Tensor, ref: _Ref, weight: Tensor) -> None:
        rows = int(weight.shape[0])
        w = self.weights.get(ref.name)
        if w is None:
            w = self.weights[ref.name] = WeightRows(ref.name, rows, 0, False, ref.batch_dims)
        w.uses.add("conv")
        lab = torch.arange(rows, device="cpu").view([rows if i == 1 else 1 for i in range(out.dim())])
        self._tag(out, ref.name, lab.expand(out.shape))

    def _cat(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        tensors = args[0] if args else kwargs.get("tensors", ())
        labs = [self._label(t) for t in tensors]
        by_weight: dict[str, set[int]] = {}
        for lab in labs:
            if lab is not None:
                by_weight.setdefault(lab[0], set()).update(_rows(lab[1]))
        for weight, rows in by_weight.items():
            if sum(1 for lab in labs if lab is not None and lab[0] == weight) > 1:
                w = self.weights[weight]
                w.merges.append((len(w.pieces), frozenset(rows), True))
        if len(by_weight) == 1 and all(lab is not None for lab in labs) and isinstance(out, Tensor):
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            join = torch.stack if _fname(func) == "stack" else torch.cat  # rotate_every_two stacks (-x2, x1)
            parts = [lab[1] for lab in labs if lab is not None]
            if join is torch.cat:  # keep the dims all parts repeat along (batch, sequence) repeated, not copied
                at = dim % parts[0].dim()
                keep = [
                    slice(0, 1) if i != at and size > 1 and all(p.stride(i) == 0 for p in parts) else slice(None)
                    for i, size in enumerate(parts[0].shape)
                ]
                self._tag(out, next(iter(by_weight)), torch.cat([p[tuple(keep)] for p in parts], at).expand(out.shape))
            else:
                self._tag(out, next(iter(by_weight)), join(parts, dim))


def blocks_of(w: WeightRows) -> list[int]:
    """A block label per row: rows in the same pieces share a block; concatenated-back pieces merge."""
    member = torch.zeros(len(w.pieces), w.rows, dtype=torch.bool)
    for j, piece in enumerate(w.pieces):
        member[j, [r for r in piece if r < w.rows]] = True
    ids: dict[tuple[bool, ...], int] = {}
    labels = [ids.setdefault(s, len(ids)) for s in zip(*member.tolist(), strict=True)] if w.pieces else [0] * w.rows
    parent = list(range(len(ids) or 1))

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
    return [root(lab) for lab in labels]

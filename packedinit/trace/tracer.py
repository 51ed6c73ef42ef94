"""The tracer itself: a ``TorchFunctionMode`` that labels every output feature of a projection with the
weight row it comes from and records which sets of rows the forward keeps apart (see :mod:`packedinit.trace.forward`).

A weight on its way to a matmul is followed through transposes, slices, splits and per-expert indexing by
two coordinate tensors (the storage row and column of every element): at the projection the coordinate
that runs along the output features says which storage dim holds them and which of its rows this use
reads. An output is labelled per weight (a sum of two projections, ``W_ih x + W_hh h``, carries both). The
labels are CPU tensors beside the traced tensors, which may be on the meta device: only shapes are read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from packedinit.torch_compat import GROUPED_MM_NAMES, torch_function_off
from packedinit.trace.coords import Coords, along
from packedinit.trace.rows import WeightRows, compact, pairs_of

__all__ = ["Tracer"]

Entries = tuple[tuple[str, Tensor], ...]  # (weight, label tensor of the weight row of every element)


class _Ref(NamedTuple):
    """A weight, or a view of it, before it reaches a matmul: the storage coordinates of every element."""

    name: str
    rows: Tensor  # storage row (the weight's dim -2) of every element
    cols: Tensor  # storage column (dim -1)
    size: tuple[int, int]
    batch_dims: int  # leading dims of the stored weight (experts, stacked layers)


_SHAPE_METHODS = {
    "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten",
    "expand", "expand_as", "__getitem__", "split", "chunk", "unbind", "narrow", "select", "movedim", "swapaxes",
    "t", "split_with_sizes", "tensor_split", "view_as", "reshape_as", "moveaxis", "swapdims",
}  # fmt: skip
_SAME = {"contiguous", "clone", "detach", "to", "float", "half", "bfloat16", "double", "type_as", "type", "cpu"}
_SAME |= {"requires_grad_", "__get__"}
_REF_VIEWS = _SHAPE_METHODS - {"expand", "expand_as", "view_as", "reshape_as"}
#: shape methods whose result holds every element of their input (reordered, reshaped or repeated): the same rows,
#: so never a piece (no need to count them)
_KEEP_EVERY_ROW = _SHAPE_METHODS - {"__getitem__", "split", "chunk", "unbind", "narrow", "select", "split_with_sizes",
                                    "tensor_split"}  # fmt: skip
_ELEMENTWISE = {
    "add", "sub", "mul", "div", "neg", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
    "__truediv__", "__neg__", "relu", "gelu", "silu", "sigmoid", "tanh", "exp", "softplus", "pow", "__pow__",
    "clamp", "abs", "square", "sqrt", "rsqrt", "dropout", "leaky_relu", "elu", "mish", "hardswish", "erf",
    "__iadd__", "__isub__", "__imul__", "add_", "sub_", "mul_", "masked_fill",
}  # fmt: skip
_MATMULS = {"matmul", "__matmul__", "mm", "bmm", *GROUPED_MM_NAMES}
_SUMS = {"add", "sub", "__add__", "__radd__", "__sub__", "__rsub__", "__iadd__", "__isub__", "add_", "sub_"}
_MHA = "multi_head_attention_forward"
_CATS = {"cat", "concat", "concatenate", "stack"}
_CONVS = {"conv1d", "conv2d"}
#: every op :meth:`Tracer._follow` does something with: any other op of the forward is not followed at all
_FOLLOWED = frozenset({
    *_SHAPE_METHODS, *_SAME, *_ELEMENTWISE, *_MATMULS, *_CATS, *_CONVS, _MHA, "linear", "addmm",
    "embedding", "view_as_complex", "view_as_real", "glu",
})  # fmt: skip


def _fname(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", "") or ""
    return name.split(".")[0]  # an OpOverload: "grouped_mm_fallback.default"


def _meta_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an index tensor in ``args``/``kwargs`` is on meta: its values are unknown, so are the rows it picks."""
    todo: list[Any] = [*args, *kwargs.values()]
    while todo:
        value = todo.pop()
        if isinstance(value, Tensor):
            if value.is_meta and value.dtype in (torch.int64, torch.int32, torch.bool):
                return True
        elif isinstance(value, (tuple, list)):
            todo.extend(value)
    return False


class Tracer(TorchFunctionMode):
    """Labels projection outputs with their weight rows and records the pieces the forward keeps apart."""

    def __init__(self, params: Mapping[int, tuple[str, Tensor]]) -> None:
        super().__init__()
        self.params = params  # id(param) -> (name, param)
        self.weights: dict[str, WeightRows] = {}
        self.refs: dict[int, tuple[Tensor, _Ref]] = {}
        self.labels: dict[int, tuple[Tensor, Entries]] = {}
        self.embedded: set[str] = set()
        self.coords = Coords()  # label and coordinate tensors, made once per geometry (repeated layers)

    # -- bookkeeping --------------------------------------------------------------------------
    def _ref(self, t: object) -> _Ref | None:
        if not isinstance(t, Tensor):
            return None
        kept = self.refs.get(id(t))
        if kept is not None and kept[0] is t:
            return kept[1]
        held = self.params.get(id(t))
        if held is None or held[1] is not t:
            return None
        shape = tuple(t.shape)
        rows, cols = self.coords.of_weight(shape)
        ref = _Ref(held[0], rows, cols, (shape[-2], shape[-1]), len(shape) - 2)
        self.refs[id(t)] = (t, ref)
        return ref

    def _label(self, t: object) -> Entries:
        if not isinstance(t, Tensor):
            return ()
        kept = self.labels.get(id(t))
        return kept[1] if kept is not None and kept[0] is t else ()

    def _tag(self, out: object, entries: Entries) -> None:
        if isinstance(out, Tensor):
            shape = out.shape
            if len(entries) == 1:  # the common case: one weight's labels, kept as they are
                if entries[0][1].shape == shape:
                    self.labels[id(out)] = (out, entries)
                return
            kept = tuple((w, lab) for w, lab in entries if lab.shape == shape)
            if kept:
                self.labels[id(out)] = (out, kept)

    def _project(self, out: Tensor, ref: _Ref, feature: int, axis: int, use: str) -> None:
        """``out``'s ``axis`` holds the projection's features: the handed weight view's ``feature`` axis."""
        along_rows = ref.rows.stride(feature) != 0 or (ref.rows.shape[feature] == 1 and use == "linear")
        storage = 0 if along_rows else 1
        labels = self.coords.line(ref.rows if along_rows else ref.cols, feature)
        w = self.weights.get(ref.name)
        if w is None:
            w = WeightRows(ref.name, ref.size[storage], storage, storage == 1, ref.batch_dims)
            self.weights[ref.name] = w
        w.uses.add(use)
        if w.dim != storage:
            return  # the same weight read along its other dim too (a tied embedding): keep the first
        if not self.coords.every_row(labels, w.rows):
            seen = self.coords.distinct(labels, flat=True)
            if len(seen) < w.rows:
                w.pieces.append(seen)  # a slice of the weight projected on its own is one piece
        self._tag(out, ((ref.name, self.coords.along(out, axis, labels)),))

    def _piece(self, weight: str, parent: Tensor | frozenset[int], child: Tensor) -> frozenset[int]:
        """Record ``child``'s rows as a piece where they are fewer than ``parent``'s; returns ``parent``'s rows."""
        rows = self.coords.distinct(child)
        whole = self.coords.distinct(parent) if isinstance(parent, Tensor) else parent
        if rows and rows != whole:
            self.weights[weight].pieces.append(rows)
        return whole

    def _touches(self, values: Iterable[Any]) -> bool:
        """Whether a weight, a followed view of one or a labelled tensor is among ``values`` (or one list deep).

        Only ids are looked up: a stale id that matches sends the op down the full path, which checks
        the object itself (:meth:`_ref`, :meth:`_label`).
        """
        for v in values:
            if isinstance(v, Tensor):
                i = id(v)
                if i in self.params or i in self.refs or i in self.labels:
                    return True
            elif isinstance(v, (list, tuple)) and self._touches(v):
                return True
        return False

    # -- the mode -----------------------------------------------------------------------------
    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.observe(func, args, kwargs, out)
        return out

    def observe(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Follow one op of the forward that gave ``out`` (as a mode, or told by :func:`~.known.observed`)."""
        name = _fname(func)
        if name not in _FOLLOWED or (name == "__get__" and not isinstance(out, Tensor)):
            return  # an op the tracer reads nothing from (a norm, attention, .shape): not followed
        if not self._touches(args) and not (kwargs and self._touches(kwargs.values())):
            return  # no weight, no view of one, no labelled output among the inputs: nothing to follow
        try:
            with torch_function_off():  # plain torch: the modes under this one see the forward only
                self._follow(name, func, args, kwargs, out)
        except (RuntimeError, TypeError, ValueError, IndexError):
            pass  # a label we cannot carry through this op: that path is simply not followed

    def _follow(
        self, name: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        first = args[0] if args else None
        ref = self._ref(first)
        if ref is not None and (name in _REF_VIEWS or name in _SAME):
            self._view_ref(func, name, args, kwargs, out, ref)
            return
        if name == _MHA:
            self._mha(args, kwargs, out)
            return
        if isinstance(out, Tensor) and self._matmul(name, args, out):
            return
        if name in _CONVS and isinstance(out, Tensor):
            self._conv(args, kwargs, out)
            return
        if name == "embedding" and len(args) >= 2:
            wref = self._ref(args[1])
            if wref is not None:
                self.embedded.add(wref.name)
            return
        if name in _CATS:
            self._cat(name, func, args, kwargs, out)
            return
        entries = self._label(first)
        if not entries:
            if name in _ELEMENTWISE and isinstance(out, Tensor) and len(args) >= 2:
                self._tag(out, tuple((w, lab.expand(out.shape)) for w, lab in self._label(args[1])))
            return
        if name == "view_as_complex" and isinstance(out, Tensor):  # (..., 2) -> (...): each pair is one number
            for weight, labels in entries:
                self._merge(weight, pairs_of(labels[..., 0], labels[..., 1]))
            self._tag(out, tuple((w, lab[..., 0]) for w, lab in entries))
        elif name == "view_as_real" and isinstance(out, Tensor):
            self._tag(out, tuple((w, lab.unsqueeze(-1).expand(out.shape)) for w, lab in entries))
        elif name in _SAME:
            self._tag(out, entries)  # same shape, same rows: no need to copy the labels
        elif name == "glu":  # F.glu / nn.GLU: a * sigmoid(b) on the two halves of dim, so two blocks
            dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
            for weight, labels in entries:
                halves: Tensor | frozenset[int] = labels
                for half in labels.chunk(2, dim):
                    halves = self._piece(weight, halves, half)
        elif name in _SHAPE_METHODS:
            if _meta_index(args[1:], kwargs):
                return  # an index whose values a meta twin does not hold (a token permutation): not followed
            for weight, labels in entries:
                sub = func(labels, *args[1:], **kwargs)
                outs = out if isinstance(out, (tuple, list)) else (out,)
                subs = sub if isinstance(sub, (tuple, list)) else (sub,)
                whole: Tensor | frozenset[int] = labels  # its rows counted once for all the parts
                for o, s in zip(outs, subs, strict=False):
                    if isinstance(o, Tensor) and isinstance(s, Tensor):
                        self._tag(o, (*self._label(o), (weight, s)))
                        if name not in _KEEP_EVERY_ROW:
                            whole = self._piece(weight, whole, s)
        elif name in _ELEMENTWISE and isinstance(out, Tensor):
            self._elementwise(name, args, entries, out)

    def _merge(self, weight: str, pairs: set[tuple[int, int]]) -> None:
        w = self.weights[weight]
        for a, b in pairs:
            if a != b:
                w.merges.append((len(w.pieces), frozenset((a, b)), False))

    def _elementwise(self, name: str, args: tuple[Any, ...], entries: Entries, out: Tensor) -> None:
        shape = out.shape  # (a label of the result's shape already is its own expansion: no new view for it)
        mine = {w: lab if lab.shape == shape else lab.expand(shape) for w, lab in entries}
        for weight, theirs in ((w, lab if lab.shape == shape else lab.expand(shape))
                               for a in args[1:] for w, lab in self._label(a)):  # fmt: skip
            if weight not in mine:
                if name not in _SUMS:
                    return  # different weights multiplied (a gate times a value): not followed further
                mine[weight] = theirs  # projections summed (W_ih x + W_hh h): the sum carries both
                continue
            if theirs is mine[weight] or torch.equal(*compact(theirs, mine[weight])):  # (the same labels: x * f(x))
                continue
            if name not in _SUMS and self.coords.distinct(theirs) != self.coords.distinct(mine[weight]):
                return  # different features multiplied (a gate times a value): not followed further
            # features of one weight summed (rotary: x1 * cos - x2 * sin), or the same rows in another
            # order combined (x * cos + rotate_half(x) * sin): they are one block
            self._merge(weight, pairs_of(mine[weight], theirs))
        self._tag(out, tuple(mine.items()))

    def _view_ref(
        self, func: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, ref: _Ref
    ) -> None:
        first = args[0]
        if name in _SAME and name != "__get__":
            if isinstance(out, Tensor):
                self.refs[id(out)] = (out, ref)
            return
        if name == "__get__":  # .T / .mT / .H swap the last two dims; .data is the same view
            if not isinstance(out, Tensor) or out.dim() < 2:
                return
            if out.shape == first.shape and out.stride() == first.stride():
                self.refs[id(out)] = (out, ref)
                return
            rows, cols = ref.rows.transpose(-2, -1), ref.cols.transpose(-2, -1)
        elif name == "__getitem__" and len(args) > 1 and isinstance(out, Tensor) and self._indexed_by_tensor(args[1]):
            if out.shape[1:] != first.shape[1:]:
                return  # W[expert_ids]: the stack gathered, every matrix whole
            rows, cols = ref.rows[0].expand(out.shape), ref.cols[0].expand(out.shape)
        else:
            rows = func(ref.rows, *args[1:], **kwargs)
            cols = func(ref.cols, *args[1:], **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        pairs = zip(rows, cols, strict=True) if isinstance(rows, (tuple, list)) else [(rows, cols)]
        for o, (r, c) in zip(outs, pairs, strict=False):
            if isinstance(o, Tensor) and o.dim() >= 2 and r.shape == o.shape:
                self.refs[id(o)] = (o, _Ref(ref.name, r, c, ref.size, ref.batch_dims))

    @staticmethod
    def _indexed_by_tensor(index: object) -> bool:
        head = index[0] if isinstance(index, tuple) and index else index
        return isinstance(head, Tensor) and head.dtype != torch.bool

    def _matmul(self, name: str, args: tuple[Any, ...], out: Tensor) -> bool:
        if name == "linear" and len(args) >= 2 and (wref := self._ref(args[1])) is not None:
            self._project(out, wref, -2, -1, "linear")  # F.linear reads W as (out, in)
        elif name in _MATMULS and len(args) >= 2 and (wref := self._ref(args[1])) is not None:
            self._project(out, wref, -1, -1, "matmul")  # x @ W reads W as (in, out)
        elif name == "addmm" and len(args) >= 3 and (wref := self._ref(args[2])) is not None:
            self._project(out, wref, -1, -1, "matmul")
        elif name in _MATMULS and len(args) >= 2 and out.dim() >= 2 and (wref := self._ref(args[0])) is not None:
            self._project(out, wref, -2, -2, "linear")  # W @ x: W's features index the result's dim -2
        else:
            return False
        return True

    def _mha(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """``F.multi_head_attention_forward``: ``in_proj_weight`` is [q | k | v] (torch/nn/functional.py,
        ``_in_projection_packed``: ``linear(q, w).unflatten(-1, (3, E))``, or ``w.chunk(3)`` for separate q, k, v)."""
        names = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
                 "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias")  # fmt: skip
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        packed = self._ref(given.get("in_proj_weight"))
        if packed is not None and not given.get("use_separate_proj_weight", False):
            w = self.weights.setdefault(packed.name, WeightRows(packed.name, packed.size[0], 0, False, 0))
            w.uses.add("linear")
            third = packed.size[0] // 3
            w.pieces += [frozenset(range(j * third, (j + 1) * third)) for j in range(3)]
        for key in ("out_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
            whole = self._ref(given.get(key))
            if whole is not None:
                held = self.weights.setdefault(whole.name, WeightRows(whole.name, whole.size[0], 0, False, 0))
                held.uses.add("linear")
        result = out[0] if isinstance(out, (tuple, list)) and out else out
        proj = self._ref(given.get("out_proj_weight"))
        if isinstance(result, Tensor) and proj is not None:
            self._tag(result, ((proj.name, self.coords.along(result, -1, self.coords.arange(proj.size[0]))),))

    def _conv(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Tensor) -> None:
        first = args[0] if args else None
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        wref = self._ref(weight)
        groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
        if wref is not None and isinstance(weight, Tensor):
            rows = int(weight.shape[0])
            held = self.weights.setdefault(wref.name, WeightRows(wref.name, rows, 0, False, 0))
            held.uses.add("conv")
            if groups == 1:
                self._tag(out, ((wref.name, self.coords.along(out, 1, self.coords.arange(rows))),))
                return
        entries = self._label(first)  # a grouped conv: each channel on its own; depthwise: channel c stays c
        if entries and isinstance(first, Tensor) and groups == out.shape[1] == first.shape[1]:
            chans = tuple((w, along(out, 1, lab.movedim(1, 0).reshape(out.shape[1], -1)[:, 0])) for w, lab in entries)
            self._tag(out, chans)

    def _cat(
        self, name: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        tensors = args[0] if args else kwargs.get("tensors", ())
        labs = [self._label(t) for t in tensors]
        by_weight: dict[str, set[int]] = {}
        for entries in labs:
            for weight, lab in entries:
                by_weight.setdefault(weight, set()).update(self.coords.distinct(lab))
        for weight, rows in by_weight.items():
            if sum(1 for entries in labs for w, _ in entries if w == weight) > 1:
                w = self.weights[weight]
                w.merges.append((len(w.pieces), frozenset(rows), True))
        if len(by_weight) != 1 or not all(len(e) == 1 for e in labs) or not isinstance(out, Tensor):
            return
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        parts = [e[0][1] for e in labs]
        weight = next(iter(by_weight))
        if name == "stack":  # rotate_every_two stacks (-x2, x1)
            self._tag(out, ((weight, torch.stack(parts, dim)),))
            return
        at = dim % parts[0].dim()  # keep the dims all parts repeat along (batch, sequence) repeated, not copied
        keep = tuple(
            slice(0, 1) if i != at and size > 1 and all(p.stride(i) == 0 for p in parts) else slice(None)
            for i, size in enumerate(parts[0].shape)
        )
        self._tag(out, ((weight, torch.cat([p[keep] for p in parts], at).expand(out.shape)),))

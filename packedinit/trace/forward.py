"""The forward tracer: which weights a model's forward splits, and how (:func:`infer_layouts`).

The forward runs once on the caller's example input under a read-only ``TorchFunctionMode``.
Every output feature of a projection (``F.linear``, ``matmul`` / ``@`` / ``addmm`` with a
stored ``(in, out)`` weight, ``conv1d`` / ``conv2d``; a per-expert slice ``W[e]`` of a stacked
weight too) is labelled with the weight row it comes from. The labels ride along with the
tensor through shape operations (``view``, ``reshape``, ``transpose``, ``permute``, indexing,
``contiguous``, ``expand``, ...), elementwise operations with untracked tensors (activations,
scaling, a bias) and depthwise convolutions. Whenever a shape operation (``split``, ``chunk``,
``unbind``, a slice, a strided slice) keeps only some of the rows, that set of rows is one
*piece*. The weight's blocks are the common refinement of all its pieces, put back together
where the forward concatenates pieces of the same weight again; the blocks' pattern along the
rows gives the :class:`~packedinit.Layout` (``sizes`` and ``groups``).

The tracer never changes what the forward computes: it only reads. It is a check, not an
oracle: a weight whose output reaches only operations it does not follow (``einsum``, a fused
kernel) before being split is reported as *opaque*.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from packedinit.errors import PackedInitError
from packedinit.layout import Layout
from packedinit.trace.compare import layout_of_labels

__all__ = ["Inferred", "infer_layouts"]

Verdict = Literal["packed", "not packed", "opaque"]


@dataclass(frozen=True)
class Inferred:
    """What the forward showed about one weight.

    Attributes:
        verdict: ``"packed"`` (``layout`` says how), ``"not packed"`` (its output is used
            whole), or ``"opaque"`` (the tracer could not follow the weight: ``why`` says why).
        layout: the Layout for ``"packed"``, else ``None``.
        why: one line in words.
    """

    verdict: Verdict
    layout: Layout | None
    why: str


# -- labels: which weight row each element of a tracked tensor comes from ---------------------------


@dataclass
class _Weight:
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


def _rows(labels: Tensor) -> frozenset[int]:
    return frozenset(torch.unique(labels).tolist())  # unique first: a logits tensor holds millions of labels


def _fname(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", "") or ""


class _Tracer(TorchFunctionMode):
    def __init__(self, params: Mapping[int, str]) -> None:
        super().__init__()
        self.params = params  # id(param) -> name
        self.weights: dict[str, _Weight] = {}
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
            # a whole stack (n, a, b) handed to bmm / matmul: its leading dims index the matrices
            batch = ref.batch_dims or len(shape) - 2
            w = self.weights[ref.name] = _Weight(ref.name, rows, dim, transposed, batch)
        w.uses.add(use)
        lab = torch.arange(rows).view([rows if i == (axis % out.dim()) else 1 for i in range(out.dim())])
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
                held = _Weight(wref.name, int(weight.shape[0]), 0, False, 0)
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
            pairs = zip(labels[..., 0].flatten().tolist(), labels[..., 1].flatten().tolist(), strict=True)
            for a, b in {(int(a), int(b)) for a, b in pairs}:
                if a != b:
                    w.merges.append((len(w.pieces), frozenset((a, b)), False))
            self._tag(out, weight, labels[..., 0])
            return
        if name == "view_as_real" and isinstance(out, Tensor):
            self._tag(out, weight, labels.unsqueeze(-1).expand(out.shape))
            return
        if name == "glu":  # F.glu / nn.GLU: a * sigmoid(b) on the two halves of dim, so two blocks
            dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
            for half in labels.chunk(2, dim):
                self._piece(weight, labels, half)
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
                if other is None or torch.equal(theirs := other[1].expand(out.shape), mine):
                    continue
                if other[0] != weight or (name not in _SUMS and _rows(theirs) != _rows(mine)):
                    return  # different features multiplied (a gate times a value): not followed further
                # features of one weight summed (rotary: x1 * cos - x2 * sin), or the same rows in another
                # order combined (x * cos + rotate_half(x) * sin): they are one block
                w = self.weights[weight]
                pairs = zip(mine.flatten().tolist(), theirs.flatten().tolist(), strict=True)
                for a, b in {(int(a), int(b)) for a, b in pairs}:
                    if a != b:
                        w.merges.append((len(w.pieces), frozenset((a, b)), False))
            self._tag(out, weight, mine)

    def _conv(self, out: Tensor, ref: _Ref, weight: Tensor) -> None:
        rows = int(weight.shape[0])
        w = self.weights.get(ref.name)
        if w is None:
            w = self.weights[ref.name] = _Weight(ref.name, rows, 0, False, ref.batch_dims)
        w.uses.add("conv")
        lab = torch.arange(rows).view([rows if i == 1 else 1 for i in range(out.dim())])
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
            self._tag(out, next(iter(by_weight)), join([lab[1] for lab in labs if lab is not None], dim))


def _blocks(w: _Weight) -> list[int]:
    """A block label per row: rows in the same pieces share a block; concatenated-back pieces merge."""
    signature = [tuple(r in p for p in w.pieces) for r in range(w.rows)]
    ids: dict[tuple[bool, ...], int] = {}
    labels = [ids.setdefault(s, len(ids)) for s in signature]
    parent = list(range(len(ids)))

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


def infer_layouts(model: nn.Module, *example_inputs: Any, **example_kwargs: Any) -> dict[str, Inferred]:
    """Run ``model``'s forward once and say, for every weight (2+ dims), whether and how it is packed.

    The forward is run under ``torch.no_grad()`` on the example input you give (keep it tiny:
    a batch of 2 and a few tokens is enough); nothing in the model changes. See
    :mod:`packedinit.trace.forward` for what is followed. Compare the result with
    :func:`packedinit.layouts` to check hand-written adapters, or paste a layout into
    :func:`packedinit.annotate`.

    Args:
        model: the module.
        *example_inputs: positional arguments of ``model(...)``.
        **example_kwargs: keyword arguments of ``model(...)``.

    Returns:
        ``{parameter name: Inferred}`` for every parameter with 2 or more dims, in
        ``named_parameters()`` order.

    Raises:
        PackedInitError: ``model`` is not a module, or its forward raised on the example input.

    Examples:
        >>> import torch
        >>> class Attn(torch.nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.qkv = torch.nn.Linear(8, 16)  # [q: 8 | k: 4 | v: 4]
        ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
        ...         q, k, v = self.qkv(x).split([8, 4, 4], dim=-1)
        ...         return q.sum() + k.sum() * v.sum()
        >>> found = infer_layouts(Attn(), torch.randn(2, 3, 8))
        >>> found["qkv.weight"].layout
        Layout(dim=0, sizes=(8, 4, 4))
    """
    if not isinstance(model, nn.Module):
        raise PackedInitError(f"infer_layouts(model, ...) needs an nn.Module, got {type(model).__name__}.")
    named = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    params = {id(p): n for n, p in named}
    tracer = _Tracer(params)
    try:
        with torch.no_grad(), tracer:
            model(*example_inputs, **example_kwargs)
    except Exception as e:
        raise PackedInitError(
            f"infer_layouts({type(model).__name__}, ...): the forward raised {type(e).__name__}: {e}; "
            f"give an example input the model's forward accepts (a batch of 2, a few tokens)."
        ) from e
    return {n: _verdict(n, tracer) for n, _ in named}


def _verdict(name: str, tracer: _Tracer) -> Inferred:
    w = tracer.weights.get(name)
    if w is None:
        if name in tracer.embedded:
            return Inferred("not packed", None, "an embedding table (looked up, not multiplied)")
        return Inferred(
            "opaque", None,
            "the forward used it in none of F.linear, matmul, addmm, conv1d/conv2d, embedding "
            "(einsum, a fused kernel, or not at all on this input)",
        )  # fmt: skip
    layout = layout_of_labels(_blocks(w), w.dim, w.transposed, w.batch_dims)
    if layout is None and w.batch_dims:  # a stack of matrices, each used whole: per-matrix fans
        stack = Layout(w.dim + w.batch_dims, [w.rows], transposed=w.transposed, batch_dims=w.batch_dims)
        return Inferred("packed", stack, f"a stack of matrices, each used whole ({w.rows} features)")
    if layout is None:
        return Inferred("not packed", None, f"its output ({w.rows} features) is used whole")
    return Inferred("packed", layout, f"the forward splits its {w.rows} output features into {len(layout.sizes)} "
                    f"parts{f' in each of {layout.groups} groups' if layout.groups > 1 else ''}")  # fmt: skip

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

The forward never runs on the model itself but on a twin (:mod:`packedinit.trace.twin`): a meta
copy with meta inputs where the forward allows, else a full copy; the model, its flags, hooks and every
random state are untouched. It is a check, not an oracle: a weight whose output reaches only
operations it does not follow (``einsum``, a fused kernel) before being split is reported as *opaque*.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from packedinit.errors import PackedInitError
from packedinit.layout import Layout
from packedinit.trace.compare import layout_of_labels
from packedinit.trace.known import observed
from packedinit.trace.rows import WeightRows, blocks_of
from packedinit.trace.tracer import Tracer
from packedinit.trace.twin import run_read_only
from packedinit.trace.verdict import Inferred

__all__ = ["Inferred", "infer_layouts", "trace_layouts"]


def infer_layouts(model: nn.Module, *example_inputs: Any, **example_kwargs: Any) -> dict[str, Inferred]:
    """Run ``model``'s forward once and say, for every weight (2+ dims), whether and how it is packed.

    The forward is run under ``torch.no_grad()`` on a twin of the model (on the meta device where the
    forward allows, else a full copy) with the example input you give (keep it tiny: a batch of 2 and a
    few tokens is enough); nothing in the model, its inputs or any random state changes. See
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
    return trace_layouts(model, example_inputs, example_kwargs)


def trace_layouts(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, eval_mode: bool = False
) -> dict[str, Inferred]:
    """:func:`infer_layouts`; ``eval_mode``: the twin is put in eval mode first (the model never is)."""
    if not isinstance(model, nn.Module):
        raise PackedInitError(f"infer_layouts(model, ...) needs an nn.Module, got {type(model).__name__}.")
    named = [n for n, p in model.named_parameters() if p.dim() >= 2]

    def trace(twin: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tracer:
        if eval_mode:
            twin.eval()
        tracer = Tracer({id(p): (n, p) for n, p in twin.named_parameters() if p.dim() >= 2})
        with observed(tracer, tracer.observe):  # one mode with the twin's known values where they are there
            twin(*args, **kwargs)
        return tracer

    try:
        tracer, _ = run_read_only(model, args, kwargs, trace)
    except Exception as e:
        raise PackedInitError(
            f"infer_layouts({type(model).__name__}, ...): the forward raised {type(e).__name__}: {e}; "
            f"give an example input the model's forward accepts (a batch of 2, a few tokens)."
        ) from e
    same: dict[tuple[object, ...], Inferred] = {}  # repeated layers: one verdict per distinct use
    return {n: _verdict(n, tracer, same) for n in named}


def _verdict(name: str, tracer: Tracer, same: dict[tuple[object, ...], Inferred]) -> Inferred:
    w = tracer.weights.get(name)
    if w is not None:  # what the verdict reads of the weight, all of it (the name only picks the weight)
        key = (w.rows, w.dim, w.transposed, w.batch_dims, tuple(w.pieces), tuple(w.merges))
        kept = same.get(key)
        if kept is None:
            kept = same[key] = _weight_verdict(w)
        return kept
    if name in tracer.embedded:
        return Inferred("not packed", None, "an embedding table (looked up, not multiplied)")
    return Inferred(
        "opaque", None,
        "the forward used it in none of F.linear, matmul, addmm, conv1d/conv2d, embedding "
        "(einsum, a fused kernel, or not at all on this input)",
    )  # fmt: skip


def _weight_verdict(w: WeightRows) -> Inferred:
    # no piece: every row in one block, no layout (what layout_of_labels says of one label, without the labels)
    layout = layout_of_labels(blocks_of(w), w.dim, w.transposed, w.batch_dims) if w.pieces else None
    stack = f" in each of its {w.batch_dims}-dim stack of matrices" if w.batch_dims else ""
    if layout is None and w.batch_dims:  # a stack of matrices, each used whole: one block per matrix, its own fans
        whole = Layout(w.dim + w.batch_dims, [w.rows], transposed=w.transposed, batch_dims=w.batch_dims)
        return Inferred("packed", whole, f"its output ({w.rows} features) is used whole{stack}", w.batch_dims)
    if layout is None:
        return Inferred("not packed", None, f"its output ({w.rows} features) is used whole", w.batch_dims)
    groups = f" in each of {layout.groups} groups" if layout.groups > 1 else ""
    why = f"the forward splits its {w.rows} output features into {len(layout.sizes)} parts{groups}{stack}"
    return Inferred("packed", layout, why, w.batch_dims)

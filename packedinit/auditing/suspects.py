r"""Parameters nobody described that look packed: the audit's "looks packed" heuristics.

A parameter is a candidate when no layout describes it (see :func:`packedinit.layouts`), no
annotation names it, and neither its module nor any ancestor module has a registered adapter
(an adapter on an attention block already said which of its children are packed). A candidate
weight (2-D or more) *looks packed* when one of two rules holds:

1. **Name.** The module's attribute name or the parameter's own name contains a fused-projection
   word: ``qkv`` / ``wqkv`` / ``c_attn`` / ``in_proj`` / ``query_key_value`` (3 blocks),
   ``gate_up`` / ``up_gate`` / ``w13`` / ``w1_3`` (2 blocks), ``kv`` as a word, ``kv_proj``,
   ``to_kv`` (2 blocks). The packed dim must divide evenly.
2. **Shape.** A linear layer (``in_features`` / ``out_features``) whose output is ``k * m``
   with ``k`` in {2, 3}, while a sibling linear layer (same parent module) reads vectors of
   size ``m`` and *no* sibling reads vectors of the full size ``k * m``: the output is split
   before it is used (``qkv: d -> 3d`` beside ``proj: d -> d``; ``w13: d -> 2h`` beside
   ``w2: h -> d``). An MLP expansion ``fc1: d -> 4d`` is read whole by ``fc2: 4d -> d``, so it
   is never flagged; neither are Llama's separate ``q_proj`` / ``k_proj`` / ``gate_proj``.

The guess splits the packed dim evenly (dim 1, transposed, for GPT-2-style ``Conv1D`` modules
with an ``nf`` attribute; dim 0 otherwise). A parameter of 3 or more dims outside a conv layer
is a stack of matrices (MoE experts): its dim 0 is a batch dim, never split, and the guess
splits dim 1. The printed line carries ``groups`` and ``batch_dims``, so pasted it gives the
same blocks. For grouped-query attention, where q is larger than
k and v, replace the guessed sizes with :func:`packedinit.fused_qkv`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

from torch import Tensor, nn

from packedinit.layout import Layout
from packedinit.model.claims import annotations_of
from packedinit.model.found import Finding
from packedinit.model.looks import annotate_line, axis_fix, axis_view, by_name, parts
from packedinit.model.registry import lookup

__all__ = ["Guess", "guesses"]

@dataclass(frozen=True)
class Guess:
    """One parameter that looks packed, with the layout guessed and the line that describes it."""

    name: str
    param: Tensor
    layout: Layout
    why: str
    annotate: str


def _linear_like(m: nn.Module) -> tuple[int, int] | None:
    fi, fo = getattr(m, "in_features", None), getattr(m, "out_features", None)
    return (fi, fo) if isinstance(fi, int) and isinstance(fo, int) else None


@dataclass
class _Siblings:
    """The linear children of one parent by input size, built once per parent (the audit stays linear)."""

    readers: dict[int, list[tuple[str, int]]]  # in_features -> [(child name, id(child))]

    @classmethod
    def of(cls, parent: nn.Module) -> _Siblings:
        readers: dict[int, list[tuple[str, int]]] = {}
        for n, s in parent.named_children():
            lin = _linear_like(s)
            if lin is not None:
                readers.setdefault(lin[0], []).append((n, id(s)))
        return cls(readers)

    def reader(self, size: int, module: nn.Module) -> str | None:
        """A sibling (not ``module``) that reads vectors of ``size``, or ``None``."""
        for n, ident in self.readers.get(size, ()):
            if ident != id(module):
                return n
        return None


def _by_shape(
    attr: str, module: nn.Module, parent: nn.Module | None, cache: dict[int, _Siblings]
) -> tuple[int, str] | None:
    io = _linear_like(module)
    if io is None or parent is None:
        return None
    siblings = cache.get(id(parent))
    if siblings is None:
        siblings = cache[id(parent)] = _Siblings.of(parent)
    out = io[1]
    if siblings.reader(out, module) is not None:  # some sibling reads the whole output: not split
        return None
    for k in (3, 2):
        reader = siblings.reader(out // k, module) if out % k == 0 else None
        if reader is not None:
            return k, f"out_features {out} = {k} x {out // k}, the input size of sibling {reader!r}"
    return None


def _covered(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Module | None]]:
    """``(path, module, parent)`` of every module that neither it nor an ancestor has an adapter for."""
    stack: list[tuple[str, nn.Module, nn.Module | None]] = [("", model, None)]
    seen: set[int] = set()
    while stack:
        path, mod, parent = stack.pop()
        if id(mod) in seen or lookup(type(mod)) is not None:
            continue
        seen.add(id(mod))
        yield path, mod, parent
        for n, child in reversed(list(mod.named_children())):
            stack.append((f"{path}.{n}" if path else n, child, mod))


def _traced(fqn: str, p: Tensor, mod: nn.Module, path: str, found: Finding) -> Guess:
    layout = found.layout
    assert layout is not None
    entries = [(fqn, layout)]
    bias = getattr(mod, "bias", None) if fqn.endswith("weight") else None
    fits = isinstance(bias, Tensor) and bias.dim() == 1 and int(bias.shape[0]) == layout.packed_size
    if layout.batch_dims == 0 and fits:
        entries.append((f"{path}.bias" if path else "bias", Layout(0, layout.sizes, groups=layout.groups)))
    return Guess(fqn, p, layout, f"forward: {found.why}", annotate_line(entries))


def guesses(
    model: nn.Module, described: Collection[str], traced: Mapping[str, Finding] | None = None
) -> list[Guess]:
    """The parameters of ``model`` that look packed and that no layout in ``described`` covers.

    With ``traced`` (what :func:`packedinit.infer_layouts` found on an example input), a weight
    the forward splits is guessed with the forward's own layout, and one it uses whole is not
    guessed; the name and shape rules decide only for weights the tracer could not follow.
    """
    out: list[Guess] = []
    taken: set[int] = set()
    siblings: dict[int, _Siblings] = {}
    for path, mod, parent in _covered(model):
        notes = annotations_of(mod)
        attr = path.rpartition(".")[2]
        for leaf, p in mod.named_parameters(recurse=False):
            fqn = f"{path}.{leaf}" if path else leaf
            if fqn in described or leaf in notes or p.dim() < 2 or id(p) in taken:
                continue
            seen = traced.get(fqn) if traced is not None else None
            if seen is not None and seen.verdict == "packed":
                taken.add(id(p))
                out.append(_traced(fqn, p, mod, path, seen))
                continue
            if seen is not None and seen.verdict == "not packed":
                continue
            transposed = isinstance(getattr(mod, "nf", None), int) and p.shape[-1] == getattr(mod, "nf", None)
            # A parameter of 3+ dims outside a conv layer is a stack (experts, layers): dim 0 indexes
            # independent matrices and is never split; the packed dim is the stacked matrices' out dim.
            batch = 1 if p.dim() >= 3 and not isinstance(getattr(mod, "in_channels", None), int) else 0
            dim = (1 if transposed else 0) + batch
            found = by_name(leaf) or (by_name(attr) if attr else None)
            if found is not None:
                k, names, why = found
            else:
                shaped = _by_shape(attr, mod, parent, siblings) if leaf == "weight" else None
                if shaped is None:
                    continue
                k, why = shaped
                names = None
            got = axis_view(fqn, p) if found is not None else None
            line = axis_fix(fqn, p)
            if got is not None and line is not None:  # blocks w[..., j, :]: measured through the row-interleaved view
                taken.add(id(p))
                why += f"; its blocks are w[..., j, :] on dim -2, measured through the view {got[0]}"
                out.append(Guess(fqn, p.view(got[0]), got[1], why, line))
                continue
            k, names = parts(k, names, p, dim, transposed)
            size = int(p.shape[dim])
            if size % k or size < k:
                continue
            layout = Layout(dim, [size // k] * k, transposed=transposed, batch_dims=batch, names=names)
            if batch:
                why += f"; dim 0 ({int(p.shape[0])}) indexes stacked matrices and is not split"
            entries = [(fqn, layout)]
            bias = getattr(mod, "bias", None) if leaf == "weight" else None
            if isinstance(bias, Tensor) and bias.dim() == 1 and int(bias.shape[0]) == size:
                entries.append((f"{path}.bias" if path else "bias", Layout(0, [size // k] * k, names=names)))
            taken.add(id(p))
            out.append(Guess(fqn, p, layout, why, annotate_line(entries)))
    return out

"""The audit's records: one block's and one parameter's audit, a looks-packed suspect, and JSON-safe values."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packedinit.auditing.stats import ExpectedStd, Reference
from packedinit.auditing.verdict import Verdict
from packedinit.layout import Layout

__all__ = ["AFFECTED", "BlockAudit", "ParamAudit", "Suspect", "compact", "json_safe", "multi_block"]

#: Verdicts that mean "this parameter's init ran on the whole packed tensor".
AFFECTED: tuple[Verdict, ...] = ("packed", "mixed")


def json_safe(x: Any) -> Any:
    """``x`` with every NaN / inf float replaced by ``None`` (JSON has no NaN), recursively.

    Examples:
        >>> json_safe({"a": [1.0, float("nan")], "b": (float("inf"),)})
        {'a': [1.0, None], 'b': [None]}
    """
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


@dataclass(frozen=True)
class BlockAudit:
    """The audit of one logical block.

    Attributes:
        index: position in block order.
        label: the block's short name (``"q"``, ``"part 1"``, ``"[3] gate"``).
        shape: the logical shape ``(out, in, *rest)`` as ``torch.nn.init`` sees it.
        fan_in: ``torch.nn.init``'s fan_in of ``shape`` (``None`` below 2 dims).
        fan_out: ``torch.nn.init``'s fan_out of ``shape`` (``None`` below 2 dims).
        numel: number of elements.
        mean: measured mean (``None`` when unmeasured).
        std: measured std, population form (``None`` when unmeasured).
        kurtosis: measured ``mean(w**4) / mean(w**2)**2`` (1.8 uniform, 3 normal; ``None`` when unmeasured).
        expected: per reference, the per-block and packed stds.
        tolerance: the relative tolerance of the std test (see :func:`packedinit.auditing.measure.tolerance`).
        verdict: see :data:`packedinit.auditing.measure.Verdict`.
        matches: the references that support the verdict.
        detail: the verdict in words, with the signals that decided it.
        maxabs: measured ``max|w|`` (the exact bound of uniform inits; ``None`` when unmeasured).
        decided_by: the tests that ruled out the other hypotheses (``"std"``, ``"kurtosis"``, ``"max|w|"``).
    """

    index: int
    label: str
    shape: tuple[int, ...]
    fan_in: int | None
    fan_out: int | None
    numel: int
    mean: float | None
    std: float | None
    kurtosis: float | None
    expected: tuple[ExpectedStd, ...]
    tolerance: float
    verdict: Verdict
    matches: tuple[str, ...]
    detail: str
    maxabs: float | None = None
    decided_by: tuple[str, ...] = ()

    def expected_std(self, reference: str) -> ExpectedStd:
        """The expected stds for the reference named ``reference``."""
        for e in self.expected:
            if e.reference == reference:
                return e
        raise KeyError(f"no reference {reference!r}; known: {[e.reference for e in self.expected]}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field (non-finite numbers as ``None``)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "expected"}
        d["shape"] = list(self.shape)
        d["matches"] = list(self.matches)
        d["decided_by"] = list(self.decided_by)
        d["expected"] = {e.reference: {"per_block": e.per_block, "packed": e.packed} for e in self.expected}
        return dict(json_safe(d))


def compact(layout: Layout) -> str:
    """A short description of a layout: ``dim 0 = 4 x [q:8 | k:8 | v:8], stored (in, out)``.

    Examples:
        >>> compact(Layout(1, [4, 4], groups=2, transposed=True, batch_dims=1, names=("gate", "up")))
        'dim 1 = 2 x [gate:4 | up:4], stored (in, out), 1 batch dim'
    """
    names = layout.names or tuple(f"part{j}" for j in range(layout.num_parts))
    cat = " | ".join(f"{n}:{s}" for n, s in zip(names, layout.sizes, strict=True))
    text = f"dim {layout.dim} = " + (f"{layout.groups} x " if layout.groups != 1 else "") + f"[{cat}]"
    if layout.transposed:
        text += ", stored (in, out)"
    if layout.batch_dims:
        text += f", {layout.batch_dims} batch dim" + ("s" if layout.batch_dims > 1 else "")
    return text


def multi_block(layout: Layout) -> bool:
    """True when a layout holds several logical blocks per matrix (not just transposed or batched storage)."""
    return layout.num_parts * layout.groups > 1


@dataclass(frozen=True)
class ParamAudit:
    """The audit of one packed parameter.

    Attributes:
        name: fully qualified parameter name.
        aliases: other names of the same tensor (tied weights), audited once.
        shape: the stored shape.
        dtype: e.g. ``"float32"``.
        device: e.g. ``"cpu"``, ``"meta"``.
        layout: how the storage holds the blocks.
        blocks: one entry per logical block, in block order.
        verdict: the parameter's verdict, from the evidence of all its blocks pooled (``"mixed"`` when
            some blocks are per-block and others packed).
        matches: the references that support the verdict.
        detail: the verdict in words, with the signals that decided it.
        note: why values were not measured, when they were not.
        module: the class name of the module that owns the parameter (``""`` when not known).
        decided_by: the tests that ruled out the other hypotheses, pooled over the blocks.
        fns: the ``torch.nn.init`` functions whose distribution fits a ``packed`` verdict.
        context: references added for this parameter (its module's own default, the model config's
            ``initializer_range``), on top of the report's ``references``.
        non_finite: how many values are nan or inf (left out of the statistics).
    """

    name: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    device: str
    layout: Layout
    blocks: tuple[BlockAudit, ...]
    verdict: Verdict
    matches: tuple[str, ...] = ()
    detail: str = ""
    note: str | None = None
    module: str = ""
    decided_by: tuple[str, ...] = ()
    fns: tuple[str, ...] = ()
    context: tuple[Reference, ...] = ()
    non_finite: int = 0

    @property
    def multi_block(self) -> bool:
        """True for several blocks per matrix; False for single-block transposed or batched storage."""
        return multi_block(self.layout)

    @property
    def affected(self) -> bool:
        """True when the values show an init run on the whole packed tensor (verdict ``packed``/``mixed``)."""
        return self.verdict in AFFECTED

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field (the layout as its constructor arguments)."""
        lay = self.layout
        return dict(
            json_safe(
                {
                    "name": self.name,
                    "aliases": list(self.aliases),
                    "shape": list(self.shape),
                    "dtype": self.dtype,
                    "device": self.device,
                    "module": self.module,
                    "storage": "multi-block" if self.multi_block else "single-block",
                    "layout": {
                        "dim": lay.dim,
                        "sizes": list(lay.sizes),
                        "groups": lay.groups,
                        "transposed": lay.transposed,
                        "batch_dims": lay.batch_dims,
                        "names": list(lay.names) if lay.names is not None else None,
                        "describe": compact(lay),
                    },
                    "verdict": self.verdict,
                    "affected": self.affected,
                    "matches": list(self.matches),
                    "detail": self.detail,
                    "decided_by": list(self.decided_by),
                    "note": self.note,
                    "non_finite": self.non_finite,
                    "context": {r.name: r.describe() for r in self.context},
                    "blocks": [b.to_dict() for b in self.blocks],
                }
            )
        )


@dataclass(frozen=True)
class Suspect:
    """A parameter that no adapter or annotation describes but that looks packed (a fused projection).

    Attributes:
        name: fully qualified parameter name.
        why: the heuristic that flagged it, in words (``"name 'qkv'"``, ``"out 3 x 16 = 3 x proj.in_features"``).
        layout: the guessed layout.
        annotate: a ready-to-paste ``packedinit.annotate(...)`` line that describes it.
        audit: the parameter audited with the guessed layout: its verdict says whether the init in use is affected.
    """

    name: str
    why: str
    layout: Layout
    annotate: str
    audit: ParamAudit

    @property
    def affected(self) -> bool:
        """True when, read with the guessed layout, the values show an init run on the whole tensor."""
        return self.audit.affected

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field."""
        return {
            "name": self.name,
            "why": self.why,
            "annotate": self.annotate,
            "affected": self.affected,
            "audit": self.audit.to_dict(),
        }

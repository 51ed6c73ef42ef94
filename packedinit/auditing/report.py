"""The audit's report: per-block and per-parameter records, the one-line answer, JSON and the text table."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from packedinit.auditing.stats import DEFAULT_REFERENCES, TOL_FLOOR, ExpectedStd, Reference, Z
from packedinit.auditing.verdict import UNDECIDED_ALIKE, Verdict
from packedinit.layout import Layout, fmt_shape

__all__ = ["AuditReport", "BlockAudit", "ParamAudit", "Suspect", "compact", "json_safe", "render"]

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


def _init_call(report: AuditReport, p: ParamAudit) -> str:
    """``torch.nn.init.<fn>`` and its keywords (``, mode='fan_out'``) that the packed values of ``p`` fit."""
    refs = {r.name: r for r in (*report.references, *p.context)}
    ref = refs.get(p.matches[0]) if p.matches else None
    fn = p.fns[0] if p.fns else (ref.fn if ref is not None else "xavier_uniform_")
    kw = "".join(f", {k}={v!r}" for k, v in ref.kwargs) if ref is not None else ""
    return f"torch.nn.init.{fn}{kw}"


def _fix_call(report: AuditReport) -> str:
    """The statement that re-initialises exactly the affected parameters per block, with the init they had.

    Looks-packed parameters are annotated first (the guessed layout). Every other parameter keeps
    its values: the call names the affected parameters (``init_model(..., params=[...])``), so a
    model whose own init is not torch's default (DETR's xavier everywhere, a transformers
    ``_init_weights``) keeps it everywhere else.
    """
    hit = [p for p in report.params if p.affected] + [s.audit for s in report.suspects if s.affected]
    notes = [s.annotate for s in report.suspects if s.affected]
    groups: dict[str, list[str]] = {}
    for p in hit:
        groups.setdefault(_init_call(report, p), []).append(p.name)
    calls = []
    for call, names in groups.items():
        fn, _, kw = call.partition(", ")
        calls.append(f"packedinit.init_model(model, {fn}, params={names!r}{', ' + kw if kw else ''})")
    return "; ".join([*notes, *calls])


@dataclass(frozen=True)
class AuditReport:
    """What :func:`packedinit.audit` found: one :class:`ParamAudit` per packed parameter.

    ``str(report)`` is a plain-text table ending with the one-line :meth:`answer`;
    :meth:`to_dict` / :meth:`to_json` give machine output. ``report[name]`` looks a
    parameter up by any of its names. :attr:`affected` lists the parameters whose init
    ran on a whole packed tensor: what ``python -m packedinit audit --check`` fails on
    (``undecided`` and ``looks packed`` alone never fail it).

    Attributes:
        params: the packed parameters (adapters and annotations), in ``named_parameters`` order.
        references: the reference inits every block was compared with.
        unpacked: number of parameter tensors that are neither packed nor looked packed (not audited).
        model: the audited model's class name.
        z: the z-score of every test.
        tolerance_floor: the smallest relative tolerance.
        suspects: parameters nobody described that look packed (see :class:`Suspect`).
        lazy: parameters of lazy modules (``nn.LazyLinear``) not yet materialised: skipped.
    """

    params: tuple[ParamAudit, ...]
    references: tuple[Reference, ...] = DEFAULT_REFERENCES
    unpacked: int = 0
    model: str = ""
    z: float = Z
    tolerance_floor: float = TOL_FLOOR
    suspects: tuple[Suspect, ...] = ()
    lazy: tuple[str, ...] = ()
    _by_name: Mapping[str, ParamAudit] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {n: p for p in self.params for n in (p.name, *p.aliases)}
        object.__setattr__(self, "_by_name", index)

    def __getitem__(self, name: str) -> ParamAudit:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{name!r} is not an audited (packed) parameter; audited: {list(self._by_name)}") from None

    def __len__(self) -> int:
        return len(self.params)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def packed(self) -> tuple[ParamAudit, ...]:
        """The described parameters whose values show the packed-init signature (verdict ``packed`` or ``mixed``)."""
        return tuple(p for p in self.params if p.affected)

    @property
    def affected(self) -> tuple[str, ...]:
        """Names of the parameters initialised on a whole packed tensor: the packed ones, and the
        suspects (:attr:`suspects`) whose values show it under the guessed layout. Empty: not affected."""
        return tuple(p.name for p in self.packed) + tuple(s.name for s in self.suspects if s.affected)

    @property
    def undecided(self) -> tuple[str, ...]:
        """Names of the parameters whose numbers cannot tell per-block from packed init."""
        return tuple(p.name for p in self.params if p.verdict == "undecided")

    def counts(self) -> dict[str, int]:
        """How many described parameters got each verdict."""
        out: dict[str, int] = {}
        for p in self.params:
            out[p.verdict] = out.get(p.verdict, 0) + 1
        return out

    def summary(self) -> str:
        """One line: how many packed parameters (several blocks; single-block stored), and their verdicts."""
        who = f"{self.model}: " if self.model else ""
        multi = [p for p in self.params if p.multi_block]
        single = [p for p in self.params if not p.multi_block]

        def tally(ps: list[ParamAudit]) -> str:
            c: dict[str, int] = {}
            for p in ps:
                c[p.verdict] = c.get(p.verdict, 0) + 1
            return ", ".join(f"{v} {k}" for k, v in sorted(c.items())) or "none"

        text = f"{who}{len(multi)} packed parameter(s) ({tally(multi)})"
        if single:
            text += f", {len(single)} single-block stored transposed or batched ({tally(single)})"
        if self.suspects:
            text += f", {len(self.suspects)} look packed"
        text += f", {self.unpacked} unpacked parameter(s) not audited"
        if self.lazy:
            text += f", {len(self.lazy)} lazy parameter(s) skipped (not materialised yet: {', '.join(self.lazy)})"
        return text

    def fix(self) -> str | None:
        """The one call that fixes the affected parameters (``None`` when nothing is affected)."""
        return _fix_call(self) if self.affected else None

    @property
    def cannot_tell(self) -> tuple[str, ...]:
        """Names of the packed (or looks-packed) parameters with no values to measure: meta tensors,
        sharded DTensors, integer or quantised dtypes, every value nan/inf (verdict ``unmeasured``)."""
        return tuple(
            p.name for p in self._all() if p.verdict == "unmeasured" and any(b.fan_in is not None for b in p.blocks)
        )

    @property
    def non_finite(self) -> tuple[str, ...]:
        """Names of the audited parameters holding nan or inf (measured around those values)."""
        return tuple(p.name for p in self._all() if p.non_finite)

    def _all(self) -> tuple[ParamAudit, ...]:
        return (*self.params, *(s.audit for s in self.suspects))

    def answer(self) -> str:
        """The one-line answer: affected, cannot tell, or not affected; how many parameters; the fix.

        Examples:
            >>> import torch, packedinit
            >>> print(packedinit.audit(torch.nn.MultiheadAttention(64, 4)).answer())
            affected: 1 packed parameter initialised whole (in_proj_weight); fix: packedinit.init_model(model, ...
            >>> print(packedinit.audit(torch.nn.MultiheadAttention(64, 4, device="meta")).answer())
            cannot tell: 1 packed parameter(s) have no values to measure (in_proj_weight: meta tensor: ...
        """
        hit = self.affected
        looks = [s for s in self.suspects if not s.affected]
        tail = ""
        nf = self.non_finite
        if nf:
            tail += f"; {len(nf)} parameter(s) hold nan/inf ({_names(nf)}): measured around those values"
        if looks:
            tail += (
                f"; {len(looks)} parameter(s) look packed but their current init is not affected"
                " (annotate them, lines above, before you re-initialise)"
            )
        blind = self.cannot_tell
        notes = {p.name: p.note or "no values" for p in self._all() if p.verdict == "unmeasured"}
        why = "; ".join(f"{n}: {notes[n]}" for n in blind[:3])
        why += f"; and {len(blind) - 3} more" if len(blind) > 3 else ""
        if hit:
            word = "parameter" if len(hit) == 1 else "parameters"
            also = f"; cannot tell for {len(blind)} more ({why})" if blind else ""
            head = f"affected: {len(hit)} packed {word} initialised whole ({_names(hit)})"
            return f"{head}; fix: {self.fix()}{also}{tail}"
        if blind:
            return (
                f"cannot tell: {len(blind)} packed parameter(s) have no values to measure "
                f"({why}); audit the model with its values (materialised, in a float dtype){tail}"
            )
        checked = len(self.params)
        text = (
            f"not affected: none of {checked} packed parameter(s) was initialised whole"
            if checked
            else "not affected: no packed parameters"
        )
        und = [p for p in self.params if p.verdict == "undecided"]
        if und:
            few = sum("too few values" in p.detail for p in und)
            reasons = [f"{few} too few values to tell"] if few else []
            if len(und) - few:
                reasons.append(f"{len(und) - few} {UNDECIDED_ALIKE}")
            text += f" ({len(und)} undecided: {', '.join(reasons)})"
        return text + "; nothing to fix" + tail

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict: the model, the answer, the references, the rules and every parameter."""
        return dict(
            json_safe(
                {
                    "model": self.model,
                    "summary": self.summary(),
                    "answer": self.answer(),
                    "affected": list(self.affected),
                    "cannot_tell": list(self.cannot_tell),
                    "fix": self.fix(),
                    "counts": self.counts(),
                    "storage": {
                        "multi_block": sum(p.multi_block for p in self.params),
                        "single_block": sum(not p.multi_block for p in self.params),
                    },
                    "unpacked": self.unpacked,
                    "tolerance": {
                        "z": self.z,
                        "floor": self.tolerance_floor,
                        "rule": "|ln(std/expected)| <= max(z*sqrt((kurtosis-1)/(4n)), floor); "
                        "|kurtosis - expected| <= z*sqrt(V/n) + 0.02; uniform: max|w| within the exact bound",
                    },
                    "references": {
                        r.name: {"fn": r.fn, "kwargs": dict(r.kwargs), "describe": r.describe()}
                        for r in self.references
                    },
                    "params": [p.to_dict() for p in self.params],
                    "suspects": [s.to_dict() for s in self.suspects],
                }
            )
        )

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as JSON text (``NaN``/``inf`` never appear: unknown values are ``null``)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def __str__(self) -> str:
        return render(self)


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _fmt(x: float | None, width: int = 8) -> str:
    if x is None or not math.isfinite(x):
        return ("-" if x is None else str(x)).rjust(width)
    return f"{x:.4g}".rjust(width) if x >= 1e-3 or x == 0 else f"{x:.2e}".rjust(width)


def _param_lines(p: ParamAudit, ref: str | None) -> list[str]:
    alias = f" (tied: {', '.join(p.aliases)})" if p.aliases else ""
    lines = [f"{p.name}{alias}  {fmt_shape(p.shape)} {p.dtype} {p.device}  [{compact(p.layout)}]"]
    pooled = " (all blocks pooled)" if sum(b.verdict not in ("constant", "n/a") for b in p.blocks) > 1 else ""
    lines.append(f"  verdict{pooled}: {p.detail}")
    if p.note:
        lines.append(f"  note: {p.note}")
    label_w = max(5, *(len(b.label) for b in p.blocks))
    shape_w = max(5, *(len(fmt_shape(b.shape)) for b in p.blocks))
    ref_cols = f"{(ref or '') + ' blk':>12} {(ref or '') + ' pkd':>12}" if ref else ""
    lines.append(
        f"  {'block':<{label_w}}  {'shape':<{shape_w}} {'fan_in':>7} {'fan_out':>7} {'std':>8} {ref_cols}  verdict"
    )
    for b in p.blocks:
        cols = ""
        if ref is not None:
            e = b.expected_std(ref)
            cols = f"{_fmt(e.per_block, 12)} {_fmt(e.packed, 12)}"
        words = b.detail.partition("; ")[0]
        fi = "-" if b.fan_in is None else str(b.fan_in)
        fo = "-" if b.fan_out is None else str(b.fan_out)
        lines.append(
            f"  {b.label:<{label_w}}  {fmt_shape(b.shape):<{shape_w}} {fi:>7} {fo:>7} {_fmt(b.std)} {cols}  {words}"
        )
    return lines


def render(report: AuditReport, *, reference: str | None = None) -> str:
    """The plain-text table of ``str(report)``, ending with the one-line :meth:`AuditReport.answer`.

    Args:
        report: the report.
        reference: the reference whose per-block and packed stds are shown as columns
            (default: the first of ``report.references``). Every reference still counts in the verdict.
    """
    ref = reference or (report.references[0].name if report.references else None)
    lines = [f"packedinit audit — {report.summary()}"]
    if ref is not None:
        lines.append(
            f"columns '{ref} blk' / '{ref} pkd': the std {ref} gives each block alone / the whole packed tensor"
        )
    lines.append(
        f"fit: |ln(std / expected)| <= max({report.z:g} * sqrt((kurtosis - 1) / 4n), {report.tolerance_floor:g}); "
        f"kurtosis {report.z:g} s.e.; uniform: max|w| at bound"
    )
    if not report.params and report.suspects:
        lines.append("no adapter or annotation describes a packed parameter; some look packed (below).")
    elif not report.params:
        lines.append("no packed parameters found: per-tensor init is already per block.")
    for p in report.params:
        lines.append("")
        lines.extend(_param_lines(p, ref))
    if report.suspects:
        lines.append("")
        lines.append("looks packed (no adapter or annotation describes these parameters):")
        for s in report.suspects:
            state = "AFFECTED" if s.affected else "not affected"
            lines.append(f"  {s.name}  {fmt_shape(s.audit.shape)}: {s.why}; guessed [{compact(s.layout)}]")
            lines.append(f"    init in use: {s.audit.detail} -> {state}")
            lines.append(f"    {s.annotate}")
    lines.append("")
    answer = textwrap.fill(
        f"answer: {report.answer()}", width=118, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False
    )
    lines.append(answer)
    return "\n".join(lines)

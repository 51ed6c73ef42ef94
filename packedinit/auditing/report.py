"""The audit's report: the one-line answer and its printed fix, JSON output and the text table."""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from packedinit.auditing.records import ParamAudit, Suspect, compact, json_safe
from packedinit.auditing.shards import LocalFans
from packedinit.auditing.stats import DEFAULT_REFERENCES, TOL_FLOOR, Reference, Z
from packedinit.auditing.verdict import UNDECIDED_ALIKE
from packedinit.shapes import fmt_shape

__all__ = ["AuditReport", "render"]


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
        local_fans: sharded weights whose init used the fans of the local shard (see
            :func:`packedinit.auditing.shards.local_fans`): "fans from a local shard".
    """

    params: tuple[ParamAudit, ...]
    references: tuple[Reference, ...] = DEFAULT_REFERENCES
    unpacked: int = 0
    model: str = ""
    z: float = Z
    tolerance_floor: float = TOL_FLOOR
    suspects: tuple[Suspect, ...] = ()
    lazy: tuple[str, ...] = ()
    local_fans: tuple[LocalFans, ...] = ()
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
        if self.local_fans:  # the packed parameters' answer follows the local shards' one
            rest = dataclasses.replace(self, local_fans=()).answer()
            return f"{_shard_head(self.local_fans)}; packed parameters: {rest}"
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
                    "local_fans": [
                        {
                            "name": f.name,
                            "shape": list(f.shape),
                            "local_shape": list(f.local_shape),
                            "sharding": f.sharding,
                            "reference": f.reference,
                            "std": f.std,
                            "expected": f.expected,
                            "predicted_ratio": f.predicted_ratio,
                            "measured_ratio": f.measured_ratio,
                        }
                        for f in self.local_fans
                    ],
                }
            )
        )

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as JSON text (``NaN``/``inf`` never appear: unknown values are ``null``)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def __str__(self) -> str:
        return render(self)


def _shard_head(found: tuple[LocalFans, ...]) -> str:
    """The answer's words for weights initialised with the fans of a local shard."""
    each = ", ".join(f"{f.name} {f.predicted_ratio:.2f}x" for f in found[:3]) + (" ..." if len(found) > 3 else "")
    return (
        f"affected: fans from a local shard: {len(found)} sharded weight(s) drawn with their shard's fans ({each} "
        f"the logical per-block std); fix: run the init under packedinit.fix_torch_defaults(model)"
    )


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
    if report.local_fans:
        lines.append("")
        lines.append("fans from a local shard (the init read the shard's shape, not the weight's):")
        lines.extend(f"  {f.describe()}" for f in report.local_fans)
    lines.append("")
    answer = textwrap.fill(
        f"answer: {report.answer()}", width=118, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False
    )
    lines.append(answer)
    return "\n".join(lines)

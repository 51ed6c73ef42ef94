"""The command line's before/after table: measured stds per scenario next to the per-block std, block by block."""

from __future__ import annotations

from collections.abc import Sequence

from packedinit.auditing.measure import AuditReport, Reference, compact
from packedinit.shapes import fmt_shape

__all__ = ["render_comparison"]


def _fmt_std(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4f}" if x >= 1e-3 or x == 0 else f"{x:.1e}"


_SHORT = {
    "per-block": "ok",
    "packed": "PACKED",
    "undecided": "?",
    "unknown": "other",
    "constant": "const",
    "fan-independent": "fan-indep",
}


def render_comparison(reports: Sequence[tuple[str, AuditReport]], ref: Reference, title: str) -> str:
    """The before/after table: one column of measured stds per scenario, 2-D blocks only."""
    first = reports[0][1]
    lines = [title, f"init: {ref.describe()}; 'per-block' = the std it gives each logical block on its own"]
    lines.append("cells: measured std, ratio to per-block, verdict (ok = per-block; PACKED = the init ran on the")
    lines.append("       whole packed tensor; fan-indep = an init that reads no fans, so packing does not change it;")
    lines.append("       ? = undecided (too few values); other = neither)")
    lines.append("")
    rows: list[tuple[str, ...]] = []
    for pi, p in enumerate(first.params):
        if p.blocks and p.blocks[0].fan_in is None:
            continue
        rows.append((f"{p.name}  {fmt_shape(p.shape)}  [{compact(p.layout)}]",))
        for bi, b in enumerate(p.blocks):
            expected = b.expected_std(ref.name).per_block
            cells = [f"  {b.label}", fmt_shape(b.shape), str(b.fan_in), str(b.fan_out), _fmt_std(expected)]
            for _, rep in reports:
                rb = rep.params[pi].blocks[bi]
                if rb.std is None or not expected:
                    cells.append(_fmt_std(rb.std))
                else:
                    cells.append(f"{_fmt_std(rb.std)} {rb.std / expected:4.2f}x {_SHORT.get(rb.verdict, rb.verdict)}")
            rows.append(tuple(cells))
    head = ("  block", "shape", "fan_in", "fan_out", "per-block", *(name for name, _ in reports))
    ncols = len(head)
    widths = [max([len(head[i])] + [len(r[i]) for r in rows if len(r) == ncols]) for i in range(ncols)]
    left = {0, 1}
    lines.append(
        "  ".join(h.ljust(w) if i in left else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths, strict=False)))
    )
    for r in rows:
        if len(r) == 1:
            lines.append(r[0])
        else:
            lines.append(
                "  ".join(
                    c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))
                )
            )
    lines.append("")
    for name, rep in reports:
        ratios: list[float] = []
        counts: dict[str, int] = {}
        for p in rep.params:
            for b in p.blocks:
                e = b.expected_std(ref.name).per_block
                if b.fan_in is None or b.std is None or not e:
                    continue
                ratios.append(b.std / e)
                counts[b.verdict] = counts.get(b.verdict, 0) + 1
        if ratios:
            words = {k: _SHORT[k] if k in ("packed", "per-block") else k for k in counts}
            tally = ", ".join(f"{v} {words[k]}" for k, v in sorted(counts.items()))
            lines.append(f"{name}: {tally}; std / per-block std from {min(ratios):.2f}x to {max(ratios):.2f}x")
    if not rows:
        lines.append("no 2-D packed parameters: nothing to compare.")
    return "\n".join(lines)

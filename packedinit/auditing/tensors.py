"""The audit of tensors with given layouts (:func:`audit_tensors`): each logical block measured and judged
against the reference inits, block verdicts pooled into the parameter's (see :mod:`packedinit.auditing.measure`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from packedinit.auditing.records import BlockAudit, ParamAudit, multi_block
from packedinit.auditing.report import AuditReport
from packedinit.auditing.stats import (
    DEFAULT_REFERENCES,
    ExpectedStd,
    Moments,
    Reference,
    moments,
    tolerance,
)
from packedinit.auditing.verdict import Judgement, Sample, judge
from packedinit.errors import PackedInitError
from packedinit.layout import Layout, LogicalBlock

__all__ = ["audit_tensors"]


def _is_dtensor(t: Tensor) -> bool:
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def _unmeasured_reason(t: Tensor) -> str | None:
    if t.is_meta:
        return "meta tensor: shapes and fans only"
    if _is_dtensor(t):
        return "sharded DTensor: values not gathered (audit an unsharded copy, or shapes only)"
    if not (t.dtype.is_floating_point or t.dtype.is_complex) or t.is_complex():
        return f"{t.dtype} values: no std to compare"
    return None


_NON_FINITE = "unmeasured: every value is nan or inf"
_OVERFLOW = "unknown: values too large for statistics (their moments overflow)"


def _measure(view: Tensor) -> tuple[Moments | None, int]:
    """The block's moments, measured around nan/inf values (a copy of the finite ones, only then), and their count."""
    m = moments(view)
    if m.finite:
        return m, 0
    keep = torch.isfinite(view)
    bad = int(view.numel() - int(keep.sum()))
    if bad == 0:  # finite values whose moments overflow (huge magnitudes): nothing to leave out
        return m, 0
    finite = view[keep]
    return (moments(finite) if finite.numel() > 0 else None), bad


def _judge_block(
    m: Moments | None, block: LogicalBlock, shape: tuple[int, ...], refs: Sequence[Reference], bad: int = 0
) -> Judgement:
    if m is None:
        return Judgement("unmeasured", (), _NON_FINITE if bad else "unmeasured")
    if not m.finite:
        return Judgement("unknown", (), _OVERFLOW)
    if m.std == 0.0:
        return Judgement("constant", (), f"constant ({m.mean:.4g})")
    if block.fan_in is None:
        return Judgement("n/a", (), "n/a (1-D: no fans)")
    return judge([Sample(m.n, m.std, m.kurtosis, m.maxabs, tuple(block.shape), shape)], refs)


def _param_verdict(blocks: Sequence[BlockAudit], shape: tuple[int, ...], refs: Sequence[Reference]) -> Judgement:
    kinds = {b.verdict for b in blocks}
    if "unmeasured" in kinds or not blocks:
        all_bad = any(b.detail == _NON_FINITE for b in blocks)
        return Judgement("unmeasured", (), _NON_FINITE if all_bad else "unmeasured")
    if any(b.detail == _OVERFLOW for b in blocks):
        return Judgement("unknown", (), _OVERFLOW)
    informative = [b for b in blocks if b.verdict not in ("constant", "n/a")]
    if not informative:
        if kinds == {"constant"}:
            return Judgement("constant", (), "constant")
        return Judgement("n/a", (), "n/a (1-D: no fans)")
    if "packed" in kinds and kinds & {"per-block", "fan-independent"}:
        per = [b.label for b in blocks if b.verdict in ("per-block", "fan-independent")]
        pk = [b.label for b in blocks if b.verdict == "packed"]
        return Judgement("mixed", (), f"mixed: per-block {', '.join(per)}; packed {', '.join(pk)}")
    samples = [
        Sample(b.numel, b.std, b.kurtosis or 3.0, b.maxabs or 0.0, b.shape, shape)
        for b in informative
        if b.std is not None
    ]
    return judge(samples, refs)


def _audit_one(
    name: str, t: Tensor, layout: Layout, refs: Sequence[Reference], aliases: Sequence[str], module: str
) -> ParamAudit:
    shape = tuple(int(s) for s in t.shape)
    reason = _unmeasured_reason(t)
    blocks: list[BlockAudit] = []
    non_finite = 0
    for b in layout.blocks(shape, param=name):
        m, bad = _measure(layout.storage_view(t, b)) if reason is None and b.numel > 0 else (None, 0)
        non_finite += bad
        expected = tuple(ExpectedStd(r.name, r.std(tuple(b.shape)), r.std(shape)) for r in refs)
        j = _judge_block(m, b, shape, refs, bad)
        kurt = m.kurtosis if m is not None else None
        blocks.append(
            BlockAudit(
                index=b.index,
                label=b.label,
                shape=tuple(b.shape),
                fan_in=b.fan_in,
                fan_out=b.fan_out,
                numel=b.numel,
                mean=None if m is None else m.mean,
                std=None if m is None else m.std,
                kurtosis=kurt,
                expected=expected,
                tolerance=tolerance(b.numel, 3.0 if kurt is None else kurt),
                verdict=j.verdict,
                matches=j.matches,
                detail=j.detail,
                maxabs=None if m is None else m.maxabs,
                decided_by=j.decided_by,
            )
        )
    j = _param_verdict(blocks, shape, refs)
    detail = j.detail
    if j.verdict == "packed" and not multi_block(layout):
        detail = detail.replace("packed:", "packed (the init ran on the stored shape, not the logical one):", 1)
    return ParamAudit(
        name=name,
        aliases=tuple(aliases),
        shape=shape,
        dtype=str(t.dtype).removeprefix("torch."),
        device=str(t.device),
        layout=layout,
        blocks=tuple(blocks),
        verdict=j.verdict,
        matches=j.matches,
        detail=detail,
        note=reason or (f"{non_finite} nan/inf value(s) left out of the statistics" if non_finite else None),
        module=module,
        non_finite=non_finite,
        decided_by=j.decided_by,
        fns=j.fns,
        context=tuple(r for r in refs if r not in DEFAULT_REFERENCES),
    )


def _check_refs(refs: Sequence[Reference]) -> None:
    names = [r.name for r in refs]
    if len(set(names)) != len(names):
        raise PackedInitError(f"references have repeated names {names}; give each Reference a unique name.")


def audit_tensors(
    items: Iterable[tuple[str, Tensor, Layout]],
    *,
    references: Sequence[Reference] = DEFAULT_REFERENCES,
    aliases: Mapping[str, Sequence[str]] | None = None,
    unpacked: int = 0,
    model: str = "",
    progress: Callable[[int, int, str], None] | None = None,
    context: Mapping[str, Sequence[Reference]] | None = None,
    modules: Mapping[str, str] | None = None,
) -> AuditReport:
    """Audit ``(name, tensor, layout)`` triples; the engine of :func:`audit`.

    Args:
        items: the packed tensors with their layouts.
        references: the inits to compare with (default :data:`DEFAULT_REFERENCES`).
        aliases: other names of each tensor (tied weights), by name.
        unpacked: number of parameters not audited (reported only).
        model: the model's name (reported only).
        progress: called as ``progress(done, total, name)`` before each tensor.
        context: more references per tensor name (e.g. from :func:`context_references`).
        modules: the owning module's class name per tensor name (reported; picks the fix line).

    Raises:
        PackedInitError: a layout that does not fit its tensor's shape, or references with repeated names.

    Examples:
        >>> w = torch.randn(96, 32)  # any tensor, with a layout you give: std 1 is no xavier
        >>> audit_tensors([("w", w, Layout(0, [32] * 3))], references=DEFAULT_REFERENCES[:1])["w"].verdict
        'unknown'
    """
    items = list(items)
    refs = tuple(references)
    _check_refs(refs)
    for name, t, layout in items:
        if not isinstance(t, Tensor):
            raise PackedInitError(f"parameter {name!r}: expected a tensor, got {type(t).__name__}.")
        if not isinstance(layout, Layout):
            raise PackedInitError(f"parameter {name!r}: expected a Layout, got {type(layout).__name__}.")
        layout.check(t.shape, param=name)
    params: list[ParamAudit] = []
    with torch.no_grad():
        for k, (name, t, layout) in enumerate(items):
            if progress is not None:
                progress(k, len(items), name)
            known = {(x.fn, x.kwargs) for x in refs}  # a context init equal to a reference adds nothing
            extra = [r for r in (context or {}).get(name, ()) if (r.fn, r.kwargs) not in known]
            all_refs = (*refs, *extra)
            _check_refs(all_refs)
            params.append(
                _audit_one(name, t, layout, all_refs, (aliases or {}).get(name, ()), (modules or {}).get(name, ""))
            )
    if progress is not None:
        progress(len(items), len(items), "")
    return AuditReport(params=tuple(params), references=refs, unpacked=unpacked, model=model)

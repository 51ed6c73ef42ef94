"""Run the cases: build every variant of a row, probe it, time it interleaved, summarise.

A *row* is one (case, init fn, dtype, device). Its *variants* are timed in the same
interleaved repeats:

- ``plain``: the init fn on each whole tensor (lower bound: the same RNG work), or for a
  model the usual ``for p in model.parameters(): if p.dim() > 1: f(p)`` loop;
- ``chunked``: ``packedinit.chunked_init(t, layout, None, f)`` per tensor, or for a model
  ``packedinit.chunked(f)(model)`` (``model.apply(chunked(f))`` or ``init_model(model, f)`` for
  cases of those idioms);
- ``naive``: the init fn called on each block's view directly (a per-head loop when a block
  is interleaved and has no single view), what users write by hand;
- ``timm``: one ``uniform_``/``normal_`` over the whole packed tensor with the per-block
  bound/std (the hand-written single corrected bound; only for fan-dependent uniform/normal fns);
- ``fill``: ``fill_`` of every tensor, the device's write-bandwidth roofline;
- ``copy``: ``copy_`` into every tensor (read + write), for reference.
"""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

import packedinit
from packedinit import chunked_init
from packedinit.trace.auto import forget

from .cases import Case, Materialized, materialize, naive_views
from .device_plan import device_plan
from .fingerprint_rows import FINGERPRINT, fingerprint_variants
from .metrics import Target, gbps, iqr, median, paired_ratio, pct_of_roofline, target_for
from .probes import count_kernels, count_launches, count_ops, peak_memory
from .timing import Clock, Samples, calibrate, clock_for, run_interleaved

__all__ = [
    "FNS",
    "ROW_FNS",
    "DTYPES",
    "VARIANTS",
    "Config",
    "VariantResult",
    "Row",
    "build_variants",
    "bench_row",
    "run_all",
]

_init = torch.nn.init
#: Init functions benchmarked, by name.
FNS: dict[str, Callable[..., Tensor]] = {
    "xavier_uniform_": _init.xavier_uniform_,
    "kaiming_normal_": _init.kaiming_normal_,
    "trunc_normal_": _init.trunc_normal_,
    "orthogonal_": _init.orthogonal_,
}
#: The ``fn`` of every row: the init functions, then the fingerprint (see :mod:`benchmarks.fingerprint_rows`).
ROW_FNS: tuple[str, ...] = (*FNS, FINGERPRINT)
#: Dtypes benchmarked, by name.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Variant names, in report order.
VARIANTS: tuple[str, ...] = ("plain", "chunked", "naive", "timm", "fill", "copy")

Thunk = Callable[[], object]


@dataclass
class Config:
    """How hard to measure."""

    repeats: int = 21
    min_repeats: int = 5
    warmup: int = 1
    min_sample_s: float = 0.005
    max_row_s: float = 30.0
    ortho_max_numel: int = 4 * 1024 * 1024
    memory: bool = True
    counts: bool = True
    counts_max_call_s: float = 0.5
    kernels_max_ops: int = 2000
    max_call_s: float | None = None
    seed: int = 0
    verbose: bool = True


@dataclass
class VariantResult:
    """One variant's measurements in a row (times in seconds)."""

    status: str = "ok"  # ok | n/a | unavailable | error
    note: str = ""
    median_s: float = float("nan")
    iqr_s: float = float("nan")
    min_s: float = float("nan")
    number: int = 0
    samples_s: list[float] = field(default_factory=list)
    gbps: float = float("nan")
    pct_roofline: float = float("nan")
    ratio_to_plain: float = float("nan")
    ratio_of_medians: float = float("nan")
    peak_mem_bytes: int | None = None
    ops: int | None = None
    kernels: int | None = None
    #: ops that compute (no views, no allocations): a kernel launch each on a GPU
    launches: int | None = None
    #: ``launches`` of the plan packedinit makes for a CUDA tensor, computed on a CPU stand-in (chunked only)
    device_launches: int | None = None


@dataclass
class Row:
    """One (case, fn, dtype, device) with every variant's result."""

    case: str
    family: str
    kind: str
    description: str
    fn: str
    dtype: str
    device: str
    scale: int
    tensors: int
    numel: int
    bytes: int
    status: str = "ok"  # ok | skipped | unsupported | error
    note: str = ""
    repeats: int = 0
    seconds: float = 0.0
    variants: dict[str, VariantResult] = field(default_factory=dict)
    target: dict[str, Any] | None = None
    blocks: int = 0  # logical blocks written by one chunked call

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN becomes ``None``)."""
        out: dict[str, Any] = _clean(asdict(self))
        return out

    def ratio(self, variant: str = "chunked") -> float:
        """``variant``'s paired ratio to plain (``nan`` when not measured)."""
        v = self.variants.get(variant)
        return v.ratio_to_plain if v is not None and v.status == "ok" else float("nan")


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def _single_bound_fn(fn_name: str, m: Materialized) -> Thunk | str:
    """The timm-style baseline: one draw over each whole tensor with the first block's bound."""
    if fn_name not in ("xavier_uniform_", "kaiming_normal_"):
        return f"{fn_name} has no single corrected bound (not fan-dependent, or not elementwise)"
    if m.model is not None:
        return "not defined for a whole model"
    params: list[tuple[Tensor, float]] = []
    for t, spec in zip(m.tensors, m.specs, strict=True):
        shape = spec.layout.blocks(spec.shape)[0].shape if spec.layout is not None else torch.Size(spec.shape)
        fan_in, fan_out = _init._calculate_fan_in_and_fan_out(torch.empty(shape, device="meta"))
        if fn_name == "xavier_uniform_":
            params.append((t, math.sqrt(6.0 / (fan_in + fan_out))))
        else:
            params.append((t, math.sqrt(2.0) / math.sqrt(fan_in)))
    if fn_name == "xavier_uniform_":

        def timm() -> None:
            for t, a in params:
                t.uniform_(-a, a)

    else:

        def timm() -> None:
            for t, std in params:
                t.normal_(0.0, std)

    return timm


def build_variants(m: Materialized, fn_name: str, with_copy: bool = True) -> dict[str, Thunk | str]:
    """Every variant of a row as a zero-argument callable, or a string saying why it is n/a.

    All tensors, views, bounds and wrappers are made here, outside any timed region.
    """
    fn = FNS[fn_name]
    tensors = m.tensors
    out: dict[str, Thunk | str] = {}
    model = m.model
    if model is not None:

        def plain_model() -> None:
            for p in model.parameters():
                if p.dim() > 1:
                    fn(p)

        wrapped = packedinit.chunked(fn)
        idiom = m.case.idiom

        def chunked_model() -> None:
            if idiom == "traced":
                forget(model)  # the first call on this architecture: the trace is paid again
                wrapped(model)
            elif idiom == "apply":
                model.apply(wrapped)
            elif idiom == "init_model":
                packedinit.init_model(model, fn)
            else:
                wrapped(model)

        out["plain"] = plain_model
        out["chunked"] = chunked_model
        out["naive"] = "not defined for a whole model"
    else:
        pairs = [(t, s.layout) for t, s in zip(tensors, m.specs, strict=True)]

        def plain() -> None:
            for t in tensors:
                fn(t)

        def chunked() -> None:
            for t, layout in pairs:
                chunked_init(t, layout, None, fn)

        views = [v for t, layout in pairs for v in naive_views(t, layout)]

        def naive() -> None:
            for v in views:
                fn(v)

        out["plain"] = plain
        out["chunked"] = chunked
        out["naive"] = naive
    out["timm"] = _single_bound_fn(fn_name, m)

    def fill() -> None:
        for t in tensors:
            t.fill_(1.0)

    out["fill"] = fill
    if with_copy:
        srcs = [torch.zeros_like(t) for t in tensors]
        dst_src = list(zip(tensors, srcs, strict=True))

        def copy() -> None:
            for t, s in dst_src:
                t.copy_(s)

        out["copy"] = copy
    else:
        out["copy"] = "disabled"
    return out


def _log(cfg: Config, msg: str) -> None:
    if cfg.verbose:
        print(msg, file=sys.stderr, flush=True)


def _is_unimplemented(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, NotImplementedError) or "not implemented yet" in text


def _new_row(case: Case, fn_name: str, dtype_name: str, device: torch.device, m: Materialized | None) -> Row:
    tensors = len(m.tensors) if m is not None else case.copies * len(case.tensors)
    numel = sum(t.numel() for t in m.tensors) if m is not None else case.numel
    nbytes = m.bytes_written if m is not None else 0
    return Row(
        case=case.name,
        family=case.family,
        kind=case.kind,
        description=case.description,
        fn=fn_name,
        dtype=dtype_name,
        device=str(device),
        scale=case.scale,
        tensors=tensors,
        numel=numel,
        bytes=nbytes,
    )


def bench_row(m: Materialized, fn_name: str, dtype_name: str, cfg: Config, clock: Clock) -> Row:
    """Measure one row: preflight each variant, probe memory/ops, then time interleaved."""
    case, device = m.case, m.device
    row = _new_row(case, fn_name, dtype_name, device, m)
    t0 = time.perf_counter()
    tgt = target_for(case.kind, fn_name, max((t.numel() for t in m.tensors), default=0), case.scale, case.name)
    if fn_name == "orthogonal_" and max((t.numel() for t in m.tensors), default=0) > cfg.ortho_max_numel:
        row.status = "skipped"
        row.note = f"orthogonal_ is O(n^3): a tensor exceeds --ortho-max-numel {cfg.ortho_max_numel}"
        return row
    fingerprinting = fn_name == FINGERPRINT
    variants = fingerprint_variants(m) if fingerprinting else build_variants(m, fn_name)
    # the plain baseline on a tiny tensor of the same dtype/device: is the fn supported at all?
    try:
        if not fingerprinting:
            FNS[fn_name](torch.empty(4, 4, dtype=m.dtype, device=device))
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        row.status = "unsupported"
        row.note = f"torch.nn.init.{fn_name} fails on {dtype_name} {device.type}: {type(e).__name__}: {e}"
        return row
    thunks: dict[str, Thunk] = {}
    first_call: dict[str, float] = {}
    for name in VARIANTS:
        v = variants[name]
        res = VariantResult()
        row.variants[name] = res
        if isinstance(v, str):
            res.status, res.note = "n/a", v
            continue
        try:
            torch.manual_seed(cfg.seed)
            start = time.perf_counter()
            if cfg.memory:
                res.peak_mem_bytes = peak_memory(v, device)
            else:
                v()
            clock.sync()
            first_call[name] = time.perf_counter() - start
            for _ in range(max(0, cfg.warmup - 1)):
                v()
        except Exception as e:  # a variant that fails is reported, not fatal
            if name == "chunked" and _is_unimplemented(e):
                res.status, res.note = "unavailable", f"{type(e).__name__}: {e}"
            else:
                res.status, res.note = "error", f"{type(e).__name__}: {e}"
                row.status = "error"
            continue
        thunks[name] = v
        if name == "plain" and cfg.max_call_s is not None and first_call[name] > cfg.max_call_s:
            row.status = "skipped"
            row.note = f"one plain call took {first_call[name]:.1f} s > --max-call-seconds {cfg.max_call_s:g}"
            return row
    if "plain" not in thunks:
        row.status = "error"
        row.note = "the plain baseline failed: " + row.variants["plain"].note
        return row
    # untimed probes: dispatched ops (and kernels on CUDA) of one call
    if cfg.counts:
        for name, v in thunks.items():
            if first_call.get(name, 0.0) > cfg.counts_max_call_s:
                continue
            try:
                ops = row.variants[name].ops = count_ops(v)
                row.variants[name].launches = count_launches(v)
                if device.type == "cuda" and ops <= cfg.kernels_max_ops:  # profiler post-processing is slow
                    row.variants[name].kernels = count_kernels(v, device)
            except Exception as e:  # counting is best-effort; say why it is missing
                row.variants[name].note = f"counts unavailable: {type(e).__name__}: {e}"
        if not fingerprinting and "chunked" in thunks and first_call.get("chunked", 0.0) <= cfg.counts_max_call_s:
            stand_in, row.blocks = device_plan(m, FNS[fn_name])
            stand_in()  # warm, as the chunked variant is when it is counted
            row.variants["chunked"].device_launches = count_launches(stand_in)
    number: dict[str, int] = {}
    for name, v in thunks.items():
        if first_call[name] > 10 * cfg.min_sample_s:
            number[name] = 1
        else:
            _, number[name] = calibrate(clock, v, cfg.min_sample_s)
    budget = max(0.0, cfg.max_row_s - (time.perf_counter() - t0))
    samples = run_interleaved(clock, thunks, number, cfg.repeats, min_repeats=cfg.min_repeats, budget_s=budget)
    _summarise(row, samples, tgt)
    row.seconds = time.perf_counter() - t0
    return row


def _summarise(row: Row, samples: Samples, tgt: Target | None) -> None:
    row.repeats = samples.repeats
    base = samples.times["plain"]
    fill_t = median(samples.times["fill"]) if "fill" in samples.times else float("nan")
    plain_med = median(base)
    for name, ts in samples.times.items():
        res = row.variants[name]
        res.samples_s = list(ts)
        res.number = samples.number[name]
        res.median_s = median(ts)
        res.iqr_s = iqr(ts)
        res.min_s = min(ts) if ts else float("nan")
        res.gbps = gbps(row.bytes, res.median_s)
        res.pct_roofline = pct_of_roofline(res.median_s, fill_t)
        res.ratio_to_plain = paired_ratio(ts, base)
        res.ratio_of_medians = res.median_s / plain_med if plain_med > 0 else float("nan")
    if tgt is not None:
        ratio = row.ratio("chunked")
        row.target = {"rule": tgt.rule, "limit": tgt.limit, "ratio": ratio, "met": tgt.met(ratio)}


def run_all(
    cases: Sequence[Case],
    fn_names: Sequence[str],
    dtype_names: Sequence[str],
    device: torch.device,
    cfg: Config,
) -> list[Row]:
    """Measure every (case, dtype, fn) on ``device``; a case is allocated once per dtype."""
    clock = clock_for(device)
    rows: list[Row] = []
    for case in cases:
        for dtype_name in dtype_names:
            try:
                m = materialize(case, DTYPES[dtype_name], device)
            except Exception as e:  # e.g. out of memory, or transformers missing
                for fn_name in fn_names:
                    row = _new_row(case, fn_name, dtype_name, device, None)
                    missing = isinstance(e, ImportError)
                    row.status = "unsupported" if missing else "error"
                    row.note = f"could not build the case: {type(e).__name__}: {e}"
                    rows.append(row)
                continue
            for fn_name in fn_names:
                row = bench_row(m, fn_name, dtype_name, cfg, clock)
                rows.append(row)
                _log(cfg, _progress(row))
            del m
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _progress(row: Row) -> str:
    head = f"[{row.device}] {row.case:<28} {row.dtype:<8} {row.fn:<16}"
    if row.status in ("skipped", "unsupported") or "plain" not in row.variants:
        return f"{head} {row.status}: {row.note}"
    parts = []
    for name in ("chunked", "naive", "timm"):
        v = row.variants.get(name)
        if v is not None and v.status == "ok":
            parts.append(f"{name} {v.ratio_to_plain:.3f}x")
        elif v is not None and v.status in ("error", "unavailable"):
            parts.append(f"{name} {v.status}")
    plain = row.variants.get("plain")
    ms = f"plain {plain.median_s * 1e3:.3f} ms" if plain is not None and plain.status == "ok" else ""
    tail = f" n={row.repeats} {row.seconds:.1f}s"
    flag = "" if row.status == "ok" else f" [{row.status}]"
    return f"{head} {ms} " + ", ".join(parts) + tail + flag

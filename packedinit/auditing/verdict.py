"""The audit's verdicts: which hypotheses (reference init, per block or packed) the measured blocks fit.

See :mod:`packedinit.auditing.stats` for the three tests (std, kurtosis, ``max|w|`` bound) and
:mod:`packedinit.auditing.measure` for the words. The rules, for one block or pooled over a parameter:

* ``packed``: some fan-based reference fits only when run on the whole stored tensor, its
  per-block and packed stds differ by more than twice the tolerance, and *no* other
  hypothesis fits (no per-block reference, no fan-independent one, no init that packing
  does not change). Anything that also fits turns ``packed`` into ``undecided``.
* ``per-block``: a fan-based reference fits per block (or fits an init that this packing does
  not change, like ``kaiming_in`` on dim-0 packing) and no packed hypothesis fits.
* ``fan-independent``: only inits whose std does not depend on the shape fit (``normal_(0, 0.02)``,
  HF's scaled residual projections, torch's recurrent default): packing does not change them.
* ``undecided``: the numbers cannot tell (tiny blocks, or stds that coincide).
* ``unknown``: no reference fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from packedinit.auditing.stats import (
    BOUND_SLACK,
    KURT_FLOOR,
    KURT_VAR,
    SUPPORTED,
    TOL_FLOOR,
    Reference,
    Z,
    family_of,
    tolerance,
)

__all__ = ["Judgement", "Sample", "Verdict", "judge", "UNDECIDED_ALIKE"]

#: A block's (or parameter's) verdict.
#:
#: * ``"per-block"``: a reference init run on each block alone fits (and no packed init does);
#: * ``"packed"``: only a reference init run on the whole stored tensor fits, and that differs
#:   from its per-block std (the packed-init signature, e.g. MultiheadAttention's default);
#: * ``"fan-independent"``: only inits whose std does not depend on the shape fit
#:   (``normal_(0, 0.02)``, HF's scaled residual ``normal_(0, 0.02/sqrt(2*n_layer))``, torch's
#:   recurrent default ``uniform_(-1/sqrt(H), 1/sqrt(H))``): packing does not change them;
#: * ``"undecided"``: a packed and a non-packed hypothesis both fit, or the block is too small to tell;
#: * ``"unknown"``: no reference fits (a custom scale, or trained weights);
#: * ``"constant"``: every value is the same (``zeros_``, ``ones_``, a forget-gate bias);
#: * ``"n/a"``: a 1-D block (a bias): no fans, no fan-based reference;
#: * ``"unmeasured"``: no values to read (meta tensor, sharded DTensor, non-float dtype);
#: * ``"mixed"`` (parameters only): blocks disagree (some per-block, some packed).
Verdict: TypeAlias = Literal[
    "per-block", "packed", "fan-independent", "undecided", "unknown", "constant", "n/a", "unmeasured", "mixed"
]

Signal: TypeAlias = Literal["std", "std (pooled)", "kurtosis", "kurtosis (pooled)", "max|w|", "max|w| (pooled)"]
_SIGNAL_ORDER: tuple[Signal, ...] = (
    "std",
    "std (pooled)",
    "kurtosis",
    "kurtosis (pooled)",
    "max|w|",
    "max|w| (pooled)",
)


@dataclass(frozen=True)
class Sample:
    """One measured block: its moments and the shapes a reference is run on."""

    n: int
    std: float
    kurtosis: float
    maxabs: float
    block_shape: tuple[int, ...]
    packed_shape: tuple[int, ...]


@dataclass(frozen=True)
class Judgement:
    """A verdict, the references behind it, the words, and the signals that ruled out the rivals."""

    verdict: Verdict
    matches: tuple[str, ...]
    detail: str
    decided_by: tuple[str, ...] = ()
    fns: tuple[str, ...] = ()  # the torch.nn.init functions whose family fit (for the fix line)


def _fits_fn(ref: Reference, fn: str, samples: Sequence[Sample], packed: bool) -> tuple[bool, set[Signal], float]:
    """Does ``fn`` (one of ``ref``'s functions), per block or packed, fit every sample and the pool?

    Returns (fits, the signals that failed, n-weighted mean of ln(std / expected)).
    """
    fails: set[Signal] = set()
    total = sum(x.n for x in samples)
    mean_log = 0.0
    kappa_pool = 0.0
    kurt_pool = 0.0
    known_kurt = True
    rel_max = 0.0  # max over blocks of max|w| / bound (uniform families)
    family = family_of(fn)
    for x in samples:
        shape = x.packed_shape if packed else x.block_shape
        s = ref.std(shape)
        if s is None or s <= 0:
            return False, {"std"}, math.inf
        kappa = ref.kurtosis(fn, shape)
        lr = math.log(x.std / s)
        mean_log += x.n / total * lr
        k_for_tol = kappa if kappa is not None else x.kurtosis
        kappa_pool += x.n / total * k_for_tol
        kurt_pool += x.n / total * x.kurtosis
        known_kurt = known_kurt and kappa is not None
        if abs(lr) > tolerance(x.n, k_for_tol):
            fails.add("std")
        if kappa is not None and abs(x.kurtosis - kappa) > Z * math.sqrt(KURT_VAR[family] / x.n) + KURT_FLOOR:
            fails.add("kurtosis")
        b = ref.bound(fn, shape)
        if b is not None:
            rel_max = max(rel_max, x.maxabs / b)
            if not (b * (1 - BOUND_SLACK / x.n - TOL_FLOOR) <= x.maxabs <= b * (1 + TOL_FLOOR)):
                fails.add("max|w|")
    if len(samples) > 1:
        if abs(mean_log) > tolerance(total, kappa_pool):
            fails.add("std (pooled)")
        if known_kurt and abs(kurt_pool - kappa_pool) > Z * math.sqrt(KURT_VAR[family] / total) + KURT_FLOOR:
            fails.add("kurtosis (pooled)")
        if rel_max and rel_max < 1 - BOUND_SLACK / total - TOL_FLOOR:
            fails.add("max|w| (pooled)")
    return not fails, fails, mean_log


@dataclass
class _Fit:
    ref: Reference
    fits: bool
    fails: set[Signal]
    fns: list[str]
    mean_log: float


def _fit(ref: Reference, samples: Sequence[Sample], packed: bool) -> _Fit:
    best: _Fit | None = None
    fns: list[str] = []
    for fn in (ref.fn, *(f for f in ref.also if f in SUPPORTED)):
        ok, fails, ml = _fits_fn(ref, fn, samples, packed)
        if ok:
            fns.append(fn)
        if best is None or len(fails) < len(best.fails):
            best = _Fit(ref, ok, fails, [], ml)
    assert best is not None
    return _Fit(ref, bool(fns), set() if fns else best.fails, fns, best.mean_log)


def _fmt_ratios(ratios: Sequence[float]) -> str:
    lo, hi = min(ratios), max(ratios)
    return f"{lo:.2f}x" if hi - lo < 0.005 else f"{lo:.2f}x to {hi:.2f}x"


def _signals(rivals: Sequence[_Fit]) -> tuple[str, ...]:
    """The signals that ruled out the rivals: ``std`` where it sufficed, else the finer tests."""
    seen: set[str] = set()
    for f in rivals:
        seen |= {"std"} if "std" in f.fails else set(f.fails)
    return tuple(s for s in _SIGNAL_ORDER if s in seen)


def _by(signals: Sequence[str]) -> str:
    return f"; decided by {', '.join(signals)}" if signals else ""


def _label(ref: Reference) -> str:
    return f"{ref.name} ({ref.note})" if ref.note and ref.fan_independent else ref.name


@dataclass
class _Hypotheses:
    """Every reference sorted by what the samples fit: the input of each hypothesis's rule."""

    fan_indep: list[_Fit] = field(default_factory=list)
    same: list[_Fit] = field(default_factory=list)  # fan-based, but this packing does not change it
    per_block: list[_Fit] = field(default_factory=list)
    packed: list[_Fit] = field(default_factory=list)
    noisy: list[_Fit] = field(default_factory=list)  # fits, but per-block and packed are too close to tell
    rivals_of_packed: list[_Fit] = field(default_factory=list)
    rivals_of_rest: list[_Fit] = field(default_factory=list)
    ratios: dict[str, list[float]] = field(default_factory=dict)
    near: list[tuple[float, str, str, float]] = field(default_factory=list)

    @property
    def others(self) -> list[_Fit]:
        """Every non-packed hypothesis that fits."""
        return self.fan_indep + self.same + self.per_block + self.noisy


def _sort_ref(h: _Hypotheses, ref: Reference, samples: Sequence[Sample], total: int, tol: float) -> None:
    """Test ``ref`` per block and packed on ``samples``; file the fits into ``h``."""
    sb_ = [ref.std(x.block_shape) for x in samples]
    sp_ = [ref.std(x.packed_shape) for x in samples]
    sb = [s for s in sb_ if s is not None and s > 0]
    sp = [s for s in sp_ if s is not None and s > 0]
    if len(sb) != len(samples) or len(sp) != len(samples):
        return
    gaps = [abs(math.log(b / p)) for b, p in zip(sb, sp, strict=True)]
    fb = _fit(ref, samples, packed=False)
    h.near.append((abs(fb.mean_log), "" if ref.fan_independent else "per-block ", ref.name, math.exp(fb.mean_log)))
    if max(gaps) <= 1e-9:  # packing does not change this reference's std
        if not fb.fits:
            h.rivals_of_packed.append(fb)
        else:
            (h.fan_indep if ref.fan_independent else h.same).append(fb)
        return
    fp = _fit(ref, samples, packed=True)
    h.near.append((abs(fp.mean_log), "packed ", ref.name, math.exp(fp.mean_log)))
    gap = sum(x.n / total * g for x, g in zip(samples, gaps, strict=True))
    if gap <= 2 * tol:
        if fb.fits or fp.fits:
            h.noisy.append(fb if fb.fits else fp)
        return
    (h.per_block if fb.fits else h.rivals_of_packed).append(fb)
    if fp.fits:
        h.packed.append(fp)
        h.ratios[ref.name] = [b / p for b, p in zip(sb, sp, strict=True)]
    else:
        h.rivals_of_rest.append(fp)


def _packed(h: _Hypotheses) -> Judgement | None:
    """``packed``: only whole-tensor hypotheses fit."""
    if not h.packed or h.others:
        return None
    names = tuple(f.ref.name for f in h.packed)
    fns = tuple(fn for f in h.packed for fn in f.fns)
    by = _signals(h.rivals_of_packed)
    ratio = _fmt_ratios(h.ratios[names[0]])
    return Judgement("packed", names, f"packed: {', '.join(names)} (per-block std would be {ratio}){_by(by)}", by, fns)


def _packed_or_not(h: _Hypotheses) -> Judgement | None:
    """``undecided``: a packed hypothesis fits, and so does another one."""
    if not h.packed:
        return None
    parts = [
        *(f"packed {f.ref.name}" for f in h.packed),
        *(f"per-block {f.ref.name}" for f in h.per_block),
        *(_label(f.ref) for f in (*h.fan_indep, *h.same)),
        *(f"{f.ref.name} (per-block or packed: too few values)" for f in h.noisy),
    ]
    why = "too few values to tell" if not (h.per_block or h.fan_indep or h.same) else UNDECIDED_ALIKE
    return Judgement("undecided", tuple(parts), f"undecided: fits {' and '.join(parts)} ({why})")


def _per_block(h: _Hypotheses) -> Judgement | None:
    """``per-block``: a fan-based reference fits per block (or one this packing does not change)."""
    if not (h.per_block or (h.same and not h.fan_indep)):
        return None
    by = _signals(h.rivals_of_rest)
    names = tuple(f.ref.name for f in (*h.per_block, *h.same))
    extra = " (packing does not change it here)" if h.same and not h.per_block else ""
    return Judgement("per-block", names, f"per-block: {', '.join(names)}{extra}{_by(by)}", by)


def _fan_independent(h: _Hypotheses) -> Judgement | None:
    """``fan-independent``: only inits whose std reads no fans fit."""
    if not h.fan_indep:
        return None
    by = _signals(h.rivals_of_rest)
    names = tuple(f.ref.name for f in (*h.fan_indep, *h.same))
    labels = ", ".join(_label(f.ref) for f in h.fan_indep)
    also = f" (also fits {', '.join(f.ref.name for f in h.same)})" if h.same else ""
    return Judgement(
        "fan-independent", names, f"fan-independent: {labels}{also}; packing does not change it{_by(by)}", by
    )


def _too_few(h: _Hypotheses) -> Judgement | None:
    """``undecided``: a reference fits, but its per-block and packed stds are too close for this many values."""
    if not h.noisy:
        return None
    names = tuple(f.ref.name for f in h.noisy)
    return Judgement("undecided", names, f"undecided: {', '.join(names)} (too few values to tell)")


def _unknown(h: _Hypotheses) -> Judgement:
    if not h.near:
        return Judgement("unknown", (), "unknown (no reference applies)")
    _, kind, ref_name, r = min(h.near)
    return Judgement("unknown", (), f"unknown: fits no reference (nearest: {kind}{ref_name}, std {r:.2f}x)")


#: The words of an ``undecided`` verdict whose hypotheses give the same distribution (not a matter of size).
UNDECIDED_ALIKE = "indistinguishable: the same distribution here"
_RULES = (_packed, _packed_or_not, _per_block, _fan_independent, _too_few)


def judge(samples: Sequence[Sample], refs: Sequence[Reference]) -> Judgement:
    """The verdict for one block, or for a parameter's blocks pooled (see the module docstring).

    Each reference is filed by what the samples fit; then the rules are asked in order
    (packed, packed-or-not, per-block, fan-independent, too few values), the first that
    applies gives the verdict, and ``unknown`` when none does.
    """
    total = sum(x.n for x in samples)
    kappa = sum(x.n * x.kurtosis for x in samples) / total
    tol = tolerance(total, kappa)
    h = _Hypotheses()
    for ref in refs:
        _sort_ref(h, ref, samples, total, tol)
    for rule in _RULES:
        j = rule(h)
        if j is not None:
            return j
    return _unknown(h)

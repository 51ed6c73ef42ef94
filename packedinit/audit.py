r"""Read-only audit of a model's packed parameters: is my model affected?

For every packed parameter (see :func:`packedinit.layouts`) and every logical
block of it, the audit reports the block's logical shape and fans, the measured
standard deviation of its values, the std that common initialisers give when
run on the block alone (*per block*) and when run on the whole stored tensor
(*packed*), and a verdict saying which of the two the values look like.

Statistics. The sample std :math:`\hat\sigma` of :math:`n` i.i.d. values of a
distribution with kurtosis :math:`\kappa` has relative standard error
:math:`\sqrt{(\kappa - 1) / (4n)}` (delta method): :math:`1/\sqrt{2n}` for a
normal distribution (:math:`\kappa = 3`), :math:`\sqrt{0.2/n}` for a uniform one
(:math:`\kappa = 1.8`), larger for heavy tails (``sparse_``). The audit measures
each block's kurtosis :math:`\hat\kappa = \overline{x^4} / (\overline{x^2})^2`
alongside its std and says the block *matches* a reference std :math:`s` when

.. math::
    |\ln(\hat\sigma / s)| \le \tau = \max\left(z\sqrt{\frac{\hat\kappa - 1}{4n}},\ \tau_{\min}\right),
    \qquad z = 5,\ \tau_{\min} = 0.005,

i.e. within 5 standard errors: a true match is missed with probability below
:math:`10^{-6}`, while a fixed tolerance sized for normal draws would let
uniform draws (every torch default) match references up to 1.6 times further
away. A reference separates per-block from packed init on a block only when its
two stds differ by more than :math:`2\tau`; a block too small to tell is
reported as *ambiguous* rather than guessed.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor, nn

from .errors import PackedInitError
from .layout import Layout, LogicalBlock, fans, fmt_shape

__all__ = [
    "AuditReport",
    "ParamAudit",
    "BlockAudit",
    "ExpectedStd",
    "Reference",
    "DEFAULT_REFERENCES",
    "Verdict",
    "audit",
]

#: A block's (or parameter's) verdict.
#:
#: * ``"per-block"``: the measured std matches what a reference init gives on the block alone
#:   (and matches no packed-only std);
#: * ``"packed"``: it matches what a reference init gives on the whole stored tensor, and that
#:   differs from the per-block std (the packed-init signature, e.g. MHA's default);
#: * ``"ambiguous"``: it matches both a per-block and a packed std, or the block is too small to tell;
#: * ``"unknown"``: it matches no reference (a custom scale, or trained weights);
#: * ``"constant"``: every value is the same (``zeros_``, ``ones_``, a forget-gate bias);
#: * ``"n/a"``: a 1-D block (a bias): no fans, no fan-based reference;
#: * ``"unmeasured"``: no values to read (meta tensor, sharded DTensor, non-float dtype);
#: * ``"mixed"`` (parameters only): blocks disagree (some per-block, some packed).
Verdict: TypeAlias = Literal["per-block", "packed", "ambiguous", "unknown", "constant", "n/a", "unmeasured", "mixed"]

#: z-score of the match tolerance (see the module docstring).
Z: float = 5.0
#: Smallest relative tolerance, whatever the block size (covers float rounding, bf16 storage).
TOL_FLOOR: float = 0.005

_NO_CLOSED_FORM = (
    "orthogonal_, xavier_uniform_, xavier_normal_, kaiming_uniform_, kaiming_normal_, normal_, uniform_, trunc_normal_"
)


def _std_normal_pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _std_normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclass(frozen=True)
class Reference:
    """A common init whose standard deviation is known in closed form from the shape.

    Build one with :meth:`of`. The std is that of the distribution the init draws from
    (for ``orthogonal_``, the root mean square of an orthogonal matrix: exact).

    Attributes:
        name: short label used in tables and verdicts, e.g. ``"xavier"``.
        fn: the ``torch.nn.init`` function name, e.g. ``"xavier_uniform_"``.
        kwargs: the keyword arguments, as sorted ``(name, value)`` pairs.
        also: other functions with the same std (``xavier_normal_`` for ``xavier_uniform_``).
    """

    name: str
    fn: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    also: tuple[str, ...] = ()

    @classmethod
    def of(cls, fn: str, name: str | None = None, also: Sequence[str] = (), **kwargs: Any) -> Reference:
        """A reference for ``torch.nn.init.<fn>(tensor, **kwargs)``.

        Args:
            fn: one of ``xavier_uniform_``, ``xavier_normal_``, ``kaiming_uniform_``,
                ``kaiming_normal_``, ``orthogonal_``, ``normal_``, ``uniform_``, ``trunc_normal_``.
            name: the label (default: ``fn`` with its non-default kwargs).
            also: other functions with the same std, listed in descriptions.
            **kwargs: the init's keyword arguments (checked against its signature).

        Raises:
            PackedInitError: unknown function, no closed-form std, or bad keyword arguments.

        Examples:
            >>> r = Reference.of("kaiming_normal_", nonlinearity="relu")
            >>> r.name, round(r.std((64, 128)) or 0, 4)
            ("kaiming_normal_(nonlinearity='relu')", 0.125)
        """
        target = getattr(torch.nn.init, fn, None) if isinstance(fn, str) else None
        if target is None or fn.startswith("_") or not callable(target):
            raise PackedInitError(f"{fn!r} is not a torch.nn.init function; use one of {_NO_CLOSED_FORM}.")
        if fn not in _NO_CLOSED_FORM.split(", "):
            raise PackedInitError(
                f"torch.nn.init.{fn} has no closed-form std the audit can compare with; use one of {_NO_CLOSED_FORM}."
            )
        sig = inspect.signature(target)
        try:
            sig.bind(None, **kwargs)
        except TypeError as e:
            raise PackedInitError(f"torch.nn.init.{fn}(tensor, {_kw(kwargs)}): {e}.") from e
        if "generator" in kwargs:
            raise PackedInitError(f"torch.nn.init.{fn}: generator= does not change the std; drop it.")
        ref = cls(name or "", fn, tuple(sorted(kwargs.items())), tuple(also))
        try:
            ref.std((4, 4))
        except (ValueError, TypeError, ZeroDivisionError) as e:
            raise PackedInitError(f"torch.nn.init.{fn}(tensor, {_kw(kwargs)}): {e}") from e
        if not name:
            object.__setattr__(ref, "name", f"{fn}({_kw(kwargs)})" if kwargs else fn)
        return ref

    def describe(self) -> str:
        """``fn(kwargs)``, with the functions of equal std: ``xavier_uniform_ / xavier_normal_ (gain=1)``."""
        fns = " / ".join((self.fn, *self.also))
        return f"{fns} ({_kw(dict(self.kwargs))})" if self.kwargs else fns

    def std(self, shape: Sequence[int]) -> float | None:
        """The std this init gives a tensor of ``shape``; ``None`` when it needs 2 dims and has fewer."""
        shape = tuple(int(s) for s in shape)
        kw = dict(self.kwargs)
        if self.fn == "normal_":
            return float(kw.get("std", 1.0))
        if self.fn == "uniform_":
            return (float(kw.get("b", 1.0)) - float(kw.get("a", 0.0))) / math.sqrt(12.0)
        if self.fn == "trunc_normal_":
            mean, std = float(kw.get("mean", 0.0)), float(kw.get("std", 1.0))
            lo, hi = (float(kw.get("a", -2.0)) - mean) / std, (float(kw.get("b", 2.0)) - mean) / std
            mass = _std_normal_cdf(hi) - _std_normal_cdf(lo)
            pa, pb = _std_normal_pdf(lo), _std_normal_pdf(hi)
            var = 1.0 + (lo * pa - hi * pb) / mass - ((pa - pb) / mass) ** 2
            return std * math.sqrt(var)
        if len(shape) < 2 or math.prod(shape) == 0:
            return None
        fan_in, fan_out = fans(shape)
        assert fan_in is not None
        assert fan_out is not None
        if self.fn in ("xavier_uniform_", "xavier_normal_"):
            return float(kw.get("gain", 1.0)) * math.sqrt(2.0 / (fan_in + fan_out))
        if self.fn in ("kaiming_uniform_", "kaiming_normal_"):
            mode = kw.get("mode", "fan_in")
            if mode not in ("fan_in", "fan_out"):
                raise ValueError(f"mode {mode!r} not supported, use 'fan_in' or 'fan_out'")
            gain = torch.nn.init.calculate_gain(kw.get("nonlinearity", "leaky_relu"), kw.get("a", 0))
            return gain / math.sqrt(fan_in if mode == "fan_in" else fan_out)
        # orthogonal_: rows or columns of the (rows, numel / rows) matrix are orthonormal.
        rows = shape[0]
        cols = math.prod(shape) // rows
        return float(kw.get("gain", 1.0)) / math.sqrt(max(rows, cols))


def _kw(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


#: What the audit compares every block with (``torch.nn.init`` defaults unless stated):
#:
#: * ``xavier``: ``xavier_uniform_`` / ``xavier_normal_``, gain 1: :math:`\sqrt{2/(\text{fan\_in}+\text{fan\_out})}`;
#: * ``kaiming_in``: ``kaiming_uniform_`` / ``kaiming_normal_`` with torch's defaults ``a=0``,
#:   ``mode="fan_in"``, ``nonlinearity="leaky_relu"`` (gain :math:`\sqrt 2`): :math:`\sqrt{2/\text{fan\_in}}`;
#: * ``kaiming_out``: the same with ``mode="fan_out"``: :math:`\sqrt{2/\text{fan\_out}}`;
#: * ``orthogonal``: ``orthogonal_``, gain 1: :math:`1/\sqrt{\max(\text{rows}, \text{cols})}`;
#: * ``linear_default``: ``kaiming_uniform_(a=sqrt(5))``, ``nn.Linear``'s default:
#:   :math:`1/\sqrt{3\,\text{fan\_in}}`;
#: * ``normal_0.02``: ``normal_(std=0.02)``, the ``initializer_range`` of GPT-2, BERT and most
#:   transformers configs (not fan-based: packing cannot change it).
DEFAULT_REFERENCES: tuple[Reference, ...] = (
    Reference.of("xavier_uniform_", name="xavier", also=("xavier_normal_",)),
    Reference.of("kaiming_uniform_", name="kaiming_in", also=("kaiming_normal_",)),
    Reference.of("kaiming_uniform_", name="kaiming_out", also=("kaiming_normal_",), mode="fan_out"),
    Reference.of("orthogonal_", name="orthogonal"),
    Reference.of("kaiming_uniform_", name="linear_default", a=math.sqrt(5)),
    Reference.of("normal_", name="normal_0.02", std=0.02),
)


@dataclass(frozen=True)
class ExpectedStd:
    """The std one reference init gives a block: run on the block alone, and on the whole stored tensor.

    Attributes:
        reference: the reference's name (see :class:`Reference`).
        per_block: std of the init run on the block's logical shape (``None``: needs 2 dims).
        packed: std of the init run on the whole stored (packed) tensor (``None``: needs 2 dims).
    """

    reference: str
    per_block: float | None
    packed: float | None


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
        kurtosis: measured ``mean(x**4) / mean(x**2)**2`` (1.8 uniform, 3 normal; ``None`` when unmeasured).
        expected: per reference, the per-block and packed stds.
        tolerance: the relative tolerance :math:`\\tau` used for matching (see :func:`tolerance`).
        verdict: see :data:`Verdict`.
        matches: the references that support the verdict (``"packed xavier"`` style for packed ones).
        detail: the verdict in words.
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

    def expected_std(self, reference: str) -> ExpectedStd:
        """The expected stds for the reference named ``reference``."""
        for e in self.expected:
            if e.reference == reference:
                return e
        raise KeyError(f"no reference {reference!r}; known: {[e.reference for e in self.expected]}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "expected"}
        d["shape"] = list(self.shape)
        d["matches"] = list(self.matches)
        d["expected"] = {e.reference: {"per_block": e.per_block, "packed": e.packed} for e in self.expected}
        return d


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
        detail: the verdict in words.
        note: why values were not measured, when they were not.
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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field (the layout as its constructor arguments)."""
        lay = self.layout
        return {
            "name": self.name,
            "aliases": list(self.aliases),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "device": self.device,
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
            "matches": list(self.matches),
            "detail": self.detail,
            "note": self.note,
            "blocks": [b.to_dict() for b in self.blocks],
        }


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit` found: one :class:`ParamAudit` per packed parameter.

    ``str(report)`` is a plain-text table; :meth:`to_dict` / :meth:`to_json` give
    machine output. ``report[name]`` looks a parameter up by any of its names.

    Attributes:
        params: the packed parameters, in ``named_parameters`` order.
        references: the reference inits every block was compared with.
        unpacked: number of parameter tensors that are not packed (not audited).
        model: the audited model's class name.
        z: the z-score of the match tolerance.
        tolerance_floor: the smallest relative tolerance.
    """

    params: tuple[ParamAudit, ...]
    references: tuple[Reference, ...] = DEFAULT_REFERENCES
    unpacked: int = 0
    model: str = ""
    z: float = Z
    tolerance_floor: float = TOL_FLOOR
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
        """The parameters whose values show the packed-init signature (verdict ``packed`` or ``mixed``)."""
        return tuple(p for p in self.params if p.verdict in ("packed", "mixed"))

    def counts(self) -> dict[str, int]:
        """How many parameters got each verdict."""
        out: dict[str, int] = {}
        for p in self.params:
            out[p.verdict] = out.get(p.verdict, 0) + 1
        return out

    def summary(self) -> str:
        """One line: how many packed parameters, and their verdicts."""
        counts = ", ".join(f"{v} {k}" for k, v in sorted(self.counts().items()))
        who = f"{self.model}: " if self.model else ""
        return (
            f"{who}{len(self.params)} packed parameter(s) ({counts or 'none'}), "
            f"{self.unpacked} unpacked parameter(s) not audited"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict: the model, the references, the tolerance rule and every parameter."""
        return {
            "model": self.model,
            "summary": self.summary(),
            "counts": self.counts(),
            "unpacked": self.unpacked,
            "tolerance": {
                "z": self.z,
                "floor": self.tolerance_floor,
                "rule": "|ln(std/expected)| <= max(z*sqrt((kurtosis-1)/(4n)), floor)",
            },
            "references": {
                r.name: {"fn": r.fn, "kwargs": dict(r.kwargs), "describe": r.describe()} for r in self.references
            },
            "params": [p.to_dict() for p in self.params],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as JSON text (``NaN``/``inf`` never appear: unknown values are ``null``)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def __str__(self) -> str:
        return render(self)


def _fmt(x: float | None, width: int = 8) -> str:
    if x is None:
        return "-".rjust(width)
    return f"{x:.4g}".rjust(width) if x >= 1e-3 or x == 0 else f"{x:.2e}".rjust(width)


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


def render(report: AuditReport, *, reference: str | None = None) -> str:
    """The plain-text table of ``str(report)``.

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
        f"match: |ln(std / expected)| <= max({report.z:g} * sqrt((kurtosis - 1) / 4n), {report.tolerance_floor:g})"
    )
    if not report.params:
        lines.append("no packed parameters found: per-tensor init is already per block.")
        return "\n".join(lines)
    for p in report.params:
        lines.append("")
        alias = f" (tied: {', '.join(p.aliases)})" if p.aliases else ""
        lines.append(f"{p.name}{alias}  {fmt_shape(p.shape)} {p.dtype} {p.device}  [{compact(p.layout)}]")
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
            fi = "-" if b.fan_in is None else str(b.fan_in)
            fo = "-" if b.fan_out is None else str(b.fan_out)
            lines.append(
                f"  {b.label:<{label_w}}  {fmt_shape(b.shape):<{shape_w}} {fi:>7} {fo:>7} "
                f"{_fmt(b.std)} {cols}  {b.detail}"
            )
    return "\n".join(lines)


def tolerance(n: int, kurtosis: float = 3.0, z: float = Z, floor: float = TOL_FLOOR) -> float:
    r"""The relative tolerance :math:`\max(z\sqrt{(\kappa - 1)/(4n)}, \text{floor})` of a block's std.

    Args:
        n: number of elements in the block.
        kurtosis: the values' kurtosis :math:`\kappa` (3 for normal draws, 1.8 for uniform ones).
        z: z-score (default 5).
        floor: smallest tolerance (default 0.005).

    Examples:
        >>> round(tolerance(128 * 128), 4)  # normal draws: 5 / sqrt(2n)
        0.0276
        >>> round(tolerance(128 * 128, kurtosis=1.8), 4)  # uniform draws
        0.0175
    """
    k = kurtosis if math.isfinite(kurtosis) else 3.0
    return max(z * math.sqrt(max(k - 1.0, 0.0) / (4 * max(n, 1))), floor)


@dataclass(frozen=True)
class _Sample:
    """What the verdict needs of one measured block."""

    n: int
    std: float
    kurtosis: float
    tol: float
    expected: tuple[ExpectedStd, ...]


def _fmt_ratios(ratios: Sequence[float]) -> str:
    lo, hi = min(ratios), max(ratios)
    return f"{lo:.2f}x" if hi - lo < 0.005 else f"{lo:.2f}x to {hi:.2f}x"


def _classify(samples: Sequence[_Sample]) -> tuple[Verdict, tuple[str, ...], str]:
    """Per-block or packed: for one block, or pooled over the blocks of one parameter.

    A hypothesis (reference R, per block or packed) holds when every block matches it on its
    own and the n-weighted mean of ln(std / expected) is within the pooled tolerance, whose
    standard error shrinks with the total number of values.
    """
    total = sum(x.n for x in samples)
    kappa = sum(x.n * x.kurtosis for x in samples) / total
    tol = samples[0].tol if len(samples) == 1 else tolerance(total, kappa)
    weights = [x.n / total for x in samples]
    per_block: list[str] = []
    packed: list[str] = []
    noisy: list[str] = []
    ratios: dict[str, list[float]] = {}
    near: list[tuple[float, str, str, float]] = []
    for j, ref in enumerate(e.reference for e in samples[0].expected):
        es = [x.expected[j] for x in samples]
        if any(e.per_block is None or e.packed is None or e.per_block <= 0 or e.packed <= 0 for e in es):
            continue
        sb = [float(e.per_block) for e in es if e.per_block is not None]
        sp = [float(e.packed) for e in es if e.packed is not None]
        lb = [math.log(x.std / s) for x, s in zip(samples, sb, strict=True)]
        lp = [math.log(x.std / s) for x, s in zip(samples, sp, strict=True)]
        mean_b = sum(w * v for w, v in zip(weights, lb, strict=True))
        mean_p = sum(w * v for w, v in zip(weights, lp, strict=True))
        gaps = [abs(math.log(b / q)) for b, q in zip(sb, sp, strict=True)]
        gap = sum(w * g for w, g in zip(weights, gaps, strict=True))
        hit_b = abs(mean_b) <= tol and all(abs(v) <= x.tol for v, x in zip(lb, samples, strict=True))
        hit_p = abs(mean_p) <= tol and all(abs(v) <= x.tol for v, x in zip(lp, samples, strict=True))
        near += [(abs(mean_b), "per-block", ref, math.exp(mean_b)), (abs(mean_p), "packed", ref, math.exp(mean_p))]
        if max(gaps) <= 1e-9:  # packing does not change this init: it is per-block by construction
            if hit_b:
                per_block.append(ref)
        elif gap > 2 * tol:
            if hit_b:
                per_block.append(ref)
            if hit_p:
                packed.append(ref)
                ratios[ref] = [b / q for b, q in zip(sb, sp, strict=True)]
        elif hit_b or hit_p:
            noisy.append(ref)
    if not per_block and not packed and not noisy:
        if not near:
            return "unknown", (), "unknown (no reference applies)"
        _, kind, ref, r = min(near)
        return "unknown", (), f"unknown (nearest: {kind} {ref}, std {r:.2f}x)"
    if per_block and not packed and not noisy:
        return "per-block", tuple(per_block), "per-block: " + ", ".join(per_block)
    if packed and not per_block and not noisy:
        return (
            "packed",
            tuple(packed),
            f"packed: {', '.join(packed)} (per-block std would be {_fmt_ratios(ratios[packed[0]])})",
        )
    parts = [
        *(f"block {r}" for r in per_block),
        *(f"packed {r}" for r in packed),
        *(f"{r} (too few values)" for r in noisy),
    ]
    return "ambiguous", tuple(parts), "ambiguous: " + ", ".join(parts)


def _judge(
    std: float | None,
    mean: float | None,
    kurt: float | None,
    block: LogicalBlock,
    expected: tuple[ExpectedStd, ...],
    tol: float,
) -> tuple[Verdict, tuple[str, ...], str]:
    if std is None:
        return "unmeasured", (), "unmeasured"
    if std == 0.0:
        return "constant", (), f"constant ({mean:.4g})" if mean is not None else "constant"
    if block.fan_in is None:
        return "n/a", (), "n/a (1-D: no fans)"
    return _classify([_Sample(block.numel, std, 3.0 if kurt is None else kurt, tol, expected)])


def _param_verdict(blocks: Sequence[BlockAudit]) -> tuple[Verdict, tuple[str, ...], str]:
    kinds = {b.verdict for b in blocks}
    if "unmeasured" in kinds or not blocks:
        return "unmeasured", (), "unmeasured"
    informative = [b for b in blocks if b.verdict not in ("constant", "n/a")]
    if not informative:
        if kinds == {"constant"}:
            return "constant", (), "constant"
        return "n/a", (), "n/a (1-D: no fans)"
    if "per-block" in kinds and "packed" in kinds:
        per = [b.label for b in blocks if b.verdict == "per-block"]
        pk = [b.label for b in blocks if b.verdict == "packed"]
        return "mixed", (), f"mixed: per-block {', '.join(per)}; packed {', '.join(pk)}"
    if len(informative) == 1:
        b = informative[0]
        return b.verdict, b.matches, b.detail
    samples = [
        _Sample(b.numel, b.std, 3.0 if b.kurtosis is None else b.kurtosis, b.tolerance, b.expected)
        for b in informative
        if b.std is not None
    ]
    return _classify(samples)


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


def _moments(view: Tensor) -> tuple[float, float, float]:
    """Mean, population std and kurtosis about zero of a block view.

    Reductions only: no copy for float32/float64 blocks (fp16/bf16 blocks are upcast, one block at a time).
    The kurtosis is ``mean(x**4) / mean(x**2)**2``; 3.0 when it cannot be computed (all zeros, overflow).
    """
    v = view if view.dtype in (torch.float32, torch.float64) else view.float()
    var, mean = torch.var_mean(v, correction=0)
    m, s2 = float(mean), max(float(var), 0.0)
    n = v.numel()
    m2 = s2 + m * m
    m4 = float(torch.linalg.vector_norm(v, 4)) ** 4 / n
    kurt = m4 / (m2 * m2) if m2 > 0 and math.isfinite(m4) else 3.0
    return m, math.sqrt(s2), kurt if math.isfinite(kurt) else 3.0


def audit_tensors(
    items: Iterable[tuple[str, Tensor, Layout]],
    *,
    references: Sequence[Reference] = DEFAULT_REFERENCES,
    aliases: Mapping[str, Sequence[str]] | None = None,
    unpacked: int = 0,
    model: str = "",
    progress: Callable[[int, int, str], None] | None = None,
) -> AuditReport:
    """Audit ``(name, tensor, layout)`` triples; the engine of :func:`audit`.

    Args:
        items: the packed tensors with their layouts.
        references: the inits to compare with (default :data:`DEFAULT_REFERENCES`).
        aliases: other names of each tensor (tied weights), by name.
        unpacked: number of parameters not audited (reported only).
        model: the model's name (reported only).
        progress: called as ``progress(done, total, name)`` before each tensor.

    Raises:
        PackedInitError: a layout that does not fit its tensor's shape.
    """
    items = list(items)
    refs = tuple(references)
    names = [r.name for r in refs]
    if len(set(names)) != len(names):
        raise PackedInitError(f"references have repeated names {names}; give each Reference a unique name.")
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
            shape = tuple(int(s) for s in t.shape)
            reason = _unmeasured_reason(t)
            packed_std = {r.name: r.std(shape) for r in refs}
            blocks: list[BlockAudit] = []
            for b in layout.blocks(shape, param=name):
                mean = std = kurt = None
                if reason is None and b.numel > 0:
                    mean, std, kurt = _moments(layout.storage_view(t, b))
                expected = tuple(ExpectedStd(r.name, r.std(tuple(b.shape)), packed_std[r.name]) for r in refs)
                tol = tolerance(b.numel, 3.0 if kurt is None else kurt)
                verdict, matches, detail = _judge(std, mean, kurt, b, expected, tol)
                blocks.append(
                    BlockAudit(
                        index=b.index,
                        label=b.label,
                        shape=tuple(b.shape),
                        fan_in=b.fan_in,
                        fan_out=b.fan_out,
                        numel=b.numel,
                        mean=mean,
                        std=std,
                        kurtosis=kurt,
                        expected=expected,
                        tolerance=tol,
                        verdict=verdict,
                        matches=matches,
                        detail=detail,
                    )
                )
            verdict, matches, detail = _param_verdict(blocks)
            params.append(
                ParamAudit(
                    name=name,
                    aliases=tuple((aliases or {}).get(name, ())),
                    shape=shape,
                    dtype=str(t.dtype).removeprefix("torch."),
                    device=str(t.device),
                    layout=layout,
                    blocks=tuple(blocks),
                    verdict=verdict,
                    matches=matches,
                    detail=detail,
                    note=reason,
                )
            )
    if progress is not None:
        progress(len(items), len(items), "")
    return AuditReport(params=tuple(params), references=refs, unpacked=unpacked, model=model)


def audit(
    model: nn.Module,
    *,
    layouts: Mapping[str, Layout] | None = None,
    references: Sequence[Reference] = DEFAULT_REFERENCES,
    progress: Callable[[int, int, str], None] | None = None,
) -> AuditReport:
    r"""Audit every packed parameter of ``model``: is its init per block, or packed?

    Read-only: nothing is written, no parameter is copied (each block is read
    through :meth:`Layout.storage_view`; only fp16/bf16 blocks are upcast, one
    block at a time). For every packed parameter and every logical block it
    reports the logical shape, fans, measured mean and std, and for each
    reference init (:data:`DEFAULT_REFERENCES`: xavier, kaiming fan_in/fan_out
    with torch's default ``a=0, nonlinearity="leaky_relu"``, orthogonal, and
    ``nn.Linear``'s default) the std it gives the block alone and the whole
    stored tensor. The verdict says which the values match (see the module
    docstring for the statistics). Tied parameters are audited once, under
    their first name, with the others as ``aliases``. Meta tensors give shapes
    and fans only (``std=None``, verdict ``"unmeasured"``).

    For ``nn.MultiheadAttention(E, h)`` torch's default runs ``xavier_uniform_``
    on the packed ``(3E, E)`` weight: std :math:`\sqrt{2/4E}` instead of the
    per-block :math:`\sqrt{2/2E}`, so each of q, k, v is :math:`\sqrt 2` too small.

    Args:
        model: the model (any device, meta included).
        layouts: ``{parameter name: Layout}`` to audit instead of
            :func:`packedinit.layouts` ``(model)``.
        references: the inits to compare with.
        progress: called as ``progress(done, total, name)``, e.g. for a progress bar.

    Returns:
        An :class:`AuditReport`.

    Raises:
        PackedInitError: a name in ``layouts`` that is not a parameter of ``model``,
            or a layout that does not fit its parameter.

    Examples:
        >>> mha = torch.nn.MultiheadAttention(64, 4)  # torch's default init: packed xavier
        >>> report = audit(mha)
        >>> [(b.label, b.verdict) for b in report["in_proj_weight"].blocks]
        [('q', 'packed'), ('k', 'packed'), ('v', 'packed')]
        >>> report["in_proj_weight"].blocks[0].detail
        'packed: xavier (per-block std would be 1.41x)'
        >>> from packedinit import chunked_init
        >>> _ = chunked_init(mha.in_proj_weight, 3, 0, torch.nn.init.xavier_uniform_)
        >>> audit(mha)["in_proj_weight"].verdict
        'per-block'
        >>> w = torch.randn(96, 32)  # any tensor, with a layout you give: std 1 is no xavier
        >>> audit_tensors([("w", w, Layout(0, [32] * 3))], references=DEFAULT_REFERENCES[:1])["w"].verdict
        'unknown'
    """
    if not isinstance(model, nn.Module):
        raise PackedInitError(f"audit(model) needs an nn.Module, got {type(model).__name__}.")
    if layouts is None:
        from .claims import layouts as _layouts

        layouts = _layouts(model)
    all_named = list(model.named_parameters(remove_duplicate=False))
    first_name: dict[int, str] = {}
    names_of: dict[int, list[str]] = {}
    by_name: dict[str, Tensor] = {}
    for n, p in all_named:
        by_name[n] = p
        first_name.setdefault(id(p), n)
        names_of.setdefault(id(p), []).append(n)
    items: list[tuple[str, Tensor, Layout]] = []
    seen: set[int] = set()
    for name, layout in layouts.items():
        t = by_name.get(name)
        if t is None:
            raise PackedInitError(
                f"layouts names {name!r}, which is not a parameter of {type(model).__name__}; "
                f"parameters: {[n for n, _ in all_named][:12]}{' ...' if len(all_named) > 12 else ''}."
            )
        if id(t) in seen:
            continue
        seen.add(id(t))
        items.append((first_name[id(t)], t, layout))
    order = {n: i for i, n in enumerate(by_name)}
    items.sort(key=lambda it: order[it[0]])
    aliases = {first_name[i]: [n for n in ns if n != first_name[i]] for i, ns in names_of.items() if len(ns) > 1}
    unpacked = len(names_of) - len(items)
    return audit_tensors(
        items, references=references, aliases=aliases, unpacked=unpacked, model=type(model).__name__, progress=progress
    )

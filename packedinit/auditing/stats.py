r"""The audit's numbers: reference inits, measured moments, and the tests that give a verdict.

A *hypothesis* is one reference init (:class:`Reference`) run either on each logical block
alone (*per block*) or on the whole stored tensor (*packed*). It predicts, for every block,
the std :math:`s`, the distribution family (uniform, normal, orthogonal, truncated normal)
and so the kurtosis :math:`\kappa`, and for uniform draws the exact bound
:math:`b = \sqrt 3\, s` on :math:`|w|`. A block of :math:`n` values with measured std
:math:`\hat\sigma`, kurtosis :math:`\hat\kappa = \overline{w^4}/(\overline{w^2})^2` and
maximum :math:`M = \max|w|` *fits* the hypothesis when all of these hold (each a
5-standard-error test, :math:`z = 5`, so a true hypothesis fails one with probability
below about :math:`10^{-6}`):

* std: :math:`|\ln(\hat\sigma/s)| \le \max(z\sqrt{(\kappa-1)/(4n)},\ 0.005)`;
* kurtosis: :math:`|\hat\kappa - \kappa| \le z\sqrt{V/n} + 0.02`, with :math:`V = 24` for
  normal-like draws and :math:`V = 1.317` for uniform ones (the delta-method variance of
  :math:`\hat\kappa`);
* bound (uniform families only): :math:`b(1 - 14/n - 0.005) \le M \le b(1 + 0.005)`: no
  uniform draw exceeds :math:`b`, and the chance that all :math:`n` stay below
  :math:`b(1-t)` is :math:`(1-t)^n \le e^{-nt}` (:math:`e^{-14} < 10^{-6}`).

A parameter fits when every block fits and the :math:`n`-weighted mean of
:math:`\ln(\hat\sigma/s)` over its blocks is within the pooled tolerance of all its values.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor

from packedinit.errors import PackedInitError
from packedinit.shapes import fans

__all__ = [
    "DEFAULT_REFERENCES",
    "ExpectedStd",
    "Family",
    "Moments",
    "Reference",
    "TOL_FLOOR",
    "Z",
    "family_of",
    "moments",
    "tolerance",
]

#: z-score of every test (see the module docstring).
Z: float = 5.0
#: Smallest relative tolerance, whatever the block size (covers float rounding, bf16 storage).
TOL_FLOOR: float = 0.005
#: Added to the kurtosis tolerance (rounding, bf16 storage).
KURT_FLOOR: float = 0.02
#: ``-ln(1e-6)``, rounded up: the bound test's allowance, in units of ``1/n``.
BOUND_SLACK: float = 14.0

#: The distribution an init draws from.
Family: TypeAlias = Literal["uniform", "normal", "orthogonal", "trunc_normal"]

SUPPORTED = (
    "orthogonal_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "normal_",
    "uniform_",
    "trunc_normal_",
)
_FAMILY: dict[str, Family] = {
    "orthogonal_": "orthogonal",
    "xavier_uniform_": "uniform",
    "kaiming_uniform_": "uniform",
    "uniform_": "uniform",
    "xavier_normal_": "normal",
    "kaiming_normal_": "normal",
    "normal_": "normal",
    "trunc_normal_": "trunc_normal",
}
#: Variance constant of the sample kurtosis, ``Var(k) ~ V / n``: 24 for normal draws, 1.317 for uniform.
KURT_VAR: dict[Family, float] = {"uniform": 1.317, "normal": 24.0, "orthogonal": 24.0, "trunc_normal": 24.0}
_SHAPE_FREE = ("normal_", "uniform_", "trunc_normal_")


def family_of(fn: str) -> Family:
    """The distribution family of ``torch.nn.init.<fn>``.

    Examples:
        >>> family_of("xavier_normal_"), family_of("kaiming_uniform_")
        ('normal', 'uniform')
    """
    return _FAMILY[fn]


def _pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _kw(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


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
        note: where this reference comes from, shown in verdicts (e.g. ``"torch's recurrent default"``).
    """

    name: str
    fn: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    also: tuple[str, ...] = ()
    note: str = ""

    @classmethod
    def of(cls, fn: str, name: str | None = None, also: Sequence[str] = (), note: str = "", **kwargs: Any) -> Reference:
        """A reference for ``torch.nn.init.<fn>(tensor, **kwargs)``.

        Args:
            fn: one of ``xavier_uniform_``, ``xavier_normal_``, ``kaiming_uniform_``,
                ``kaiming_normal_``, ``orthogonal_``, ``normal_``, ``uniform_``, ``trunc_normal_``.
            name: the label (default: ``fn`` with its non-default kwargs).
            also: other functions with the same std, listed in descriptions; those the audit
                knows are tried as alternative distribution families (``xavier_normal_`` for
                ``xavier_uniform_``).
            note: where the reference comes from, shown in verdicts.
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
            raise PackedInitError(f"{fn!r} is not a torch.nn.init function; use one of {', '.join(SUPPORTED)}.")
        if fn not in SUPPORTED:
            raise PackedInitError(
                f"torch.nn.init.{fn} has no closed-form std the audit can compare with; "
                f"use one of {', '.join(SUPPORTED)}."
            )
        sig = inspect.signature(getattr(torch.nn.init, fn))
        try:
            sig.bind(None, **kwargs)
        except TypeError as e:
            raise PackedInitError(f"torch.nn.init.{fn}(tensor, {_kw(kwargs)}): {e}.") from e
        if "generator" in kwargs:
            raise PackedInitError(f"torch.nn.init.{fn}: generator= does not change the std; drop it.")
        ref = cls(name or "", fn, tuple(sorted(kwargs.items())), tuple(also), note)
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

    @property
    def fan_independent(self) -> bool:
        """True for inits whose std does not depend on the shape (``normal_``, ``uniform_``, ``trunc_normal_``)."""
        return self.fn in _SHAPE_FREE

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
            mass = _cdf(hi) - _cdf(lo)
            pa, pb = _pdf(lo), _pdf(hi)
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

    def kurtosis(self, fn: str, shape: Sequence[int]) -> float | None:
        """The kurtosis about zero, :math:`E[w^4]/E[w^2]^2`, of ``fn``'s draws on ``shape`` (``None``: not known)."""
        kw = dict(self.kwargs)
        if fn == "uniform_":
            a, b = float(kw.get("a", 0.0)), float(kw.get("b", 1.0))
            if b <= a:
                return None
            m2 = (a * a + a * b + b * b) / 3
            m4 = (b**5 - a**5) / (5 * (b - a))
            return m4 / (m2 * m2) if m2 > 0 else None
        if fn == "normal_":
            mu, s = float(kw.get("mean", 0.0)), float(kw.get("std", 1.0))
            m2 = mu * mu + s * s
            return (mu**4 + 6 * mu * mu * s * s + 3 * s**4) / (m2 * m2) if m2 > 0 else None
        if fn == "trunc_normal_":
            return self._trunc_kurtosis()
        family = _FAMILY[fn]
        if family == "uniform":
            return 1.8
        if family == "normal":
            return 3.0
        shape = tuple(int(s) for s in shape)
        if len(shape) < 2 or math.prod(shape) == 0:
            return None
        d = max(shape[0], math.prod(shape) // shape[0])  # entries of a uniform unit vector in R^d
        return 3.0 * d / (d + 2)

    def _trunc_kurtosis(self) -> float | None:
        kw = dict(self.kwargs)
        mean, std = float(kw.get("mean", 0.0)), float(kw.get("std", 1.0))
        a, b = float(kw.get("a", -2.0)), float(kw.get("b", 2.0))
        if not (std > 0 and b > a):
            return None
        steps = 2000
        h = (b - a) / steps
        m0 = m2 = m4 = 0.0
        for i in range(steps + 1):
            x = a + i * h
            w = (1 if i in (0, steps) else (4 if i % 2 else 2)) * _pdf((x - mean) / std)
            m0, m2, m4 = m0 + w, m2 + w * x * x, m4 + w * x**4
        return (m4 / m0) / (m2 / m0) ** 2 if m2 > 0 else None

    def bound(self, fn: str, shape: Sequence[int]) -> float | None:
        """The exact bound on ``|w|`` of a symmetric uniform init (``None`` for other families)."""
        if _FAMILY[fn] != "uniform":
            return None
        if fn == "uniform_":
            kw = dict(self.kwargs)
            a, b = float(kw.get("a", 0.0)), float(kw.get("b", 1.0))
            return b if a == -b and b > 0 else None
        s = self.std(shape)
        return None if s is None else math.sqrt(3.0) * s


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
#:   transformers configs (fan-independent: packing cannot change it).
DEFAULT_REFERENCES: tuple[Reference, ...] = (
    Reference.of("xavier_uniform_", name="xavier", also=("xavier_normal_",)),
    Reference.of("kaiming_uniform_", name="kaiming_in", also=("kaiming_normal_",)),
    Reference.of("kaiming_uniform_", name="kaiming_out", also=("kaiming_normal_",), mode="fan_out"),
    Reference.of("orthogonal_", name="orthogonal"),
    Reference.of("kaiming_uniform_", name="linear_default", a=math.sqrt(5), note="nn.Linear / nn.Conv default"),
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
class Moments:
    """What the tests read of one block: size, mean, std, kurtosis about zero and ``max|w|``."""

    n: int
    mean: float
    std: float
    kurtosis: float
    maxabs: float

    @property
    def finite(self) -> bool:
        """False when the block holds NaN or inf."""
        return all(math.isfinite(x) for x in (self.mean, self.std, self.kurtosis, self.maxabs))


def moments(view: Tensor) -> Moments:
    """Mean, population std, kurtosis about zero and ``max|w|`` of a block view.

    Reductions only: no copy for float32/float64 blocks (fp16/bf16 blocks are upcast, one block at a time).
    The kurtosis is ``mean(w**4) / mean(w**2)**2``; 3.0 when it cannot be computed (all zeros, overflow).

    Examples:
        >>> m = moments(torch.tensor([[-1.0, 1.0], [-1.0, 1.0]]))
        >>> m.mean, m.std, round(m.kurtosis, 6), m.maxabs
        (0.0, 1.0, 1.0, 1.0)
    """
    v = view if view.dtype in (torch.float32, torch.float64) else view.float()
    n = v.numel()
    var, mean = torch.var_mean(v, correction=0)
    m, s2 = float(mean), float(var)
    s2 = s2 if math.isnan(s2) else max(s2, 0.0)
    m2 = s2 + m * m
    m4 = float(torch.linalg.vector_norm(v, 4)) ** 4 / n
    kurt = m4 / (m2 * m2) if m2 > 0 and math.isfinite(m4) and math.isfinite(m2) else 3.0
    maxabs = float(torch.linalg.vector_norm(v, float("inf")))
    return Moments(n, m, math.sqrt(s2) if s2 == s2 else s2, kurt if math.isfinite(kurt) else 3.0, maxabs)

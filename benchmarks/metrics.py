"""Pure arithmetic on samples: medians, spreads, bandwidth, ratios and the issue's targets."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Target",
    "median",
    "iqr",
    "gbps",
    "paired_ratio",
    "pct_of_roofline",
    "target_for",
]


def median(xs: Sequence[float]) -> float:
    """The median (``nan`` for no samples)."""
    return float(statistics.median(xs)) if xs else float("nan")


def iqr(xs: Sequence[float]) -> float:
    """Interquartile range (0 below 2 samples)."""
    if len(xs) < 2:
        return 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return float(q[2] - q[0])


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s: ``nbytes / seconds / 1e9`` (``nan`` for a non-positive time)."""
    if not seconds > 0:
        return float("nan")
    return nbytes / seconds / 1e9


def paired_ratio(xs: Sequence[float], base: Sequence[float]) -> float:
    """Median over repeats of ``xs[i] / base[i]``, samples taken in the same repeat.

    Pairing samples of one repeat cancels slow drift (other processes, clocks) that the
    ratio of two medians would keep.
    """
    pairs = [x / b for x, b in zip(xs, base, strict=False) if b > 0]
    return median(pairs)


def pct_of_roofline(seconds: float, roofline_seconds: float) -> float:
    """Percent of the roofline's speed: ``100 * roofline_seconds / seconds``.

    With the same bytes written, this is the variant's GB/s as a share of ``fill_``'s.
    """
    if not seconds > 0:
        return float("nan")
    return 100.0 * roofline_seconds / seconds


@dataclass(frozen=True)
class Target:
    """A ratio target: ``chunked / plain <= limit``."""

    rule: str
    limit: float

    def met(self, ratio: float) -> bool | None:
        """Whether ``ratio`` meets it (``None`` when the ratio is not a number)."""
        if ratio != ratio:  # nan
            return None
        return ratio <= self.limit


def target_for(kind: str, fn_name: str, max_tensor_numel: int, scale: int, case: str = "") -> Target | None:
    """The issue's target for a row, or ``None`` when the issue sets none.

    - (issue 30) ``packedinit.fingerprint``: one read pass, ``<= 2.00`` x a float64 sum of the same tensors.
    - ``orthogonal_``: per block no slower than whole (``<= 1.00``).
    - (issue 23) transposed storage, GPT-2 ``Conv1D`` / GPT-OSS experts at E >= 1024: ``<= 1.10``;
      10,000 unpacked small tensors: ``<= 1.05``.
    - (issue 26) many small ``nn.Linear`` layers: ``model.apply(chunked(f))`` ``<= 1.15``, the other
      whole-model idioms (tracing included) ``<= 1.10``.
    - whole models: ``chunked(f)(model)`` ``<= 1.10`` x the plain ``for p in params`` loop, the trace
      of the forward included (``*_traced`` rows pay it on every call).
    - contiguous layouts with a tensor of >= 1M elements: ``<= 1.03``.
    - layouts that need scratch (dim-1, transposed, interleaved) at E >= 1024: ``<= 1.15``.
    """
    if fn_name == "fingerprint":
        return Target("fingerprint <= 2 x a float64 sum of the same tensors", 2.00)
    if fn_name == "orthogonal_":
        return Target("orthogonal_ per block <= whole", 1.00)
    if case.startswith(("gpt2_conv1d", "moe_gptoss")) and scale >= 1024:
        return Target("transposed storage, E >= 1024: <= 1.10", 1.10)
    if case.startswith("model_linear") and case.endswith("_apply"):
        return Target("many small Linear, model.apply(chunked(f)): <= 1.15", 1.15)
    if case.startswith("model_linear"):
        return Target("many small Linear, whole-model idioms incl. tracing: <= 1.10", 1.10)
    if case == "small_10000x64x64":
        return Target("10,000 unpacked small tensors: <= 1.05", 1.05)
    if kind == "model":
        return Target("whole model <= 1.10 x plain loop", 1.10)
    if kind == "contiguous" and max_tensor_numel >= 1_000_000:
        return Target("contiguous, >= 1M elements: <= 1.03", 1.03)
    if kind == "scratch" and scale >= 1024:
        return Target("needs scratch, E >= 1024: <= 1.15", 1.15)
    return None

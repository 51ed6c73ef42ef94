"""Scaling rows: the cost of a first (uncached) call at n and 10n blocks, and their ratio.

The timed rows of :mod:`benchmarks.runner` repeat one call, so after the first they time
packedinit's cached write program, not its planning. Planning cost per block is what
grows with the number of blocks (issue 20 item 10: ``Layout.storage_view`` summed the
sizes before each block, quadratic in blocks), so these rows time cold calls: every
repeat uses a tensor of a new width, which no cache has seen.

``python -m benchmarks.scaling [--smoke]`` prints one Markdown row per (case, n) and the
ratio ``t(10n) / t(n)``: about 10 for a linear cost, about 100 for a quadratic one.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.init import uniform_

from packedinit import Layout, chunked_init

__all__ = ["ScalingRow", "cold_call_seconds", "scaling_rows", "main"]


@dataclass(frozen=True)
class ScalingRow:
    """A case timed at ``n`` and ``10 n`` blocks (median seconds of cold calls) and their ratio."""

    case: str
    n: int
    seconds_n: float
    seconds_10n: float

    @property
    def ratio(self) -> float:
        """``t(10n) / t(n)``: about 10 when the cost is linear in blocks."""
        return self.seconds_10n / self.seconds_n if self.seconds_n > 0 else float("nan")


def _as_parts(n: int, width: int) -> Tensor:
    t = torch.empty(2 * n, width)
    chunked_init(t, Layout(0, [2] * n), None, uniform_)
    return t


def _as_batch(n: int, width: int) -> Tensor:
    t = torch.empty(n, 2, width)
    chunked_init(t, Layout(1, [2], batch_dims=1), None, uniform_)
    return t


#: Case name -> a cold call with ``n`` blocks of (2, width) elements.
CASES: dict[str, Callable[[int, int], Tensor]] = {
    "chunks": _as_parts,  # n parts of one packed dim
    "batch": _as_batch,  # the same blocks as a batch dim
}


def cold_call_seconds(call: Callable[[int, int], Tensor], n: int, repeats: int, first_width: int) -> float:
    """Median seconds of ``repeats`` calls, each with a width no earlier call used (nothing cached)."""
    samples = []
    for r in range(repeats):
        start = time.perf_counter()
        call(n, first_width + r)
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2]


def scaling_rows(ns: Sequence[int], repeats: int = 3, cases: Sequence[str] = tuple(CASES)) -> list[ScalingRow]:
    """One row per case and ``n``: cold-call time at ``n`` and ``10 n`` blocks."""
    rows = []
    for name in cases:
        for n in ns:
            small = cold_call_seconds(CASES[name], n, repeats, _fresh_widths(repeats))
            big = cold_call_seconds(CASES[name], 10 * n, repeats, _fresh_widths(repeats))
            rows.append(ScalingRow(name, n, small, big))
    return rows


_widths = itertools.count(3)


def _fresh_widths(k: int) -> int:
    """The first of ``k`` consecutive widths this process has not used yet."""
    first = next(_widths)
    for _ in range(k - 1):
        next(_widths)
    return first


def markdown(rows: Sequence[ScalingRow]) -> str:
    """The rows as a Markdown table."""
    lines = ["| case | n | t(n) ms | t(10n) ms | t(10n)/t(n) |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.case} | {r.n} | {1e3 * r.seconds_n:.1f} | {1e3 * r.seconds_10n:.1f} | {r.ratio:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the scaling rows (``--smoke``: tiny sizes, for the tests)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__)
    p.add_argument("--smoke", action="store_true", help="n = 20 only, one repeat")
    p.add_argument("--n", type=int, action="append", help="block counts (default 2000; t is also taken at 10n)")
    ns = p.parse_args(argv)
    rows = scaling_rows([20], repeats=1) if ns.smoke else scaling_rows(ns.n or [2000])
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

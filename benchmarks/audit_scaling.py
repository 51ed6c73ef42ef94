"""How the audit scales with a module's children: ``python -m benchmarks.audit_scaling``.

The audit's "looks packed" shape rule compares each linear layer with its siblings. Built
per weight, the sibling table made the audit quadratic in the number of children (issue 20,
item 11: 5,000 ``Linear`` in one ``Sequential`` took 44 s). This measures the audit (with and
without the suspects pass) at ``n`` and ``10 n`` children and prints the ratio: linear is
about 10, quadratic about 100. The model's own objects are frozen out of CPython's cyclic
collector while timing (``gc.freeze``): otherwise each collection rescans the 10 n modules,
a cost of the interpreter, not of the audit. It writes a Markdown table with ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

import packedinit

__all__ = ["main", "measure"]


def _model(n: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def _time(model: nn.Module, suspects: bool, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        gc.collect()
        gc.freeze()  # the model is long-lived: keep CPython's collector from rescanning it (cost not the audit's)
        try:
            start = time.perf_counter()
            packedinit.audit(model, suspects=suspects)
            samples.append(time.perf_counter() - start)
        finally:
            gc.unfreeze()
    return statistics.median(samples)


def measure(n: int, repeats: int = 3) -> list[tuple[str, float, float]]:
    """``(what, seconds at n, seconds at 10 n)`` for the audit with and without suspects."""
    small, large = _model(n), _model(10 * n)
    packedinit.audit(_model(2))  # warm up: the built-in adapters register on first use
    return [
        (what, _time(small, suspects, repeats), _time(large, suspects, repeats))
        for what, suspects in (("audit(model)", True), ("audit(model, suspects=False)", False))
    ]


def table(n: int, rows: Sequence[tuple[str, float, float]]) -> str:
    """The rows as Markdown."""
    lines = [
        f"| call on `Sequential` of n `Linear(4, 4)` | n = {n} | n = {10 * n} | ratio (10 = linear) |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{what}` | {a:.3f} s | {b:.3f} s | {b / a:.1f} |" for what, a, b in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.audit_scaling", description=__doc__)
    parser.add_argument("--n", type=int, default=1000, help="children in the small model (the large has 10 n)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per size (the median is kept)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this Markdown file")
    args = parser.parse_args(argv)
    text = table(args.n, measure(args.n, args.repeats))
    text += f"\ntorch {torch.__version__}, packedinit {packedinit.__version__}, CPU, median of {args.repeats}.\n"
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

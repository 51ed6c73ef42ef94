"""Timing: warm-up, calibrated inner loops, interleaved repeats, per-device clocks.

CPU samples use :func:`time.perf_counter`. CUDA samples use CUDA events recorded on
the current stream around the timed calls; the device is synchronised *before* the
start event (so no earlier work is queued and the host's launch overhead is inside the
measured interval) and the end event is waited on *after* it. Nothing inside a timed
region copies between host and device: the timed callables receive no tensors from the
host, and elapsed times are read only after the end event completed.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Clock", "CpuClock", "CudaClock", "Samples", "clock_for", "calibrate", "run_interleaved"]

Thunk = Callable[[], object]


class Clock(ABC):
    """Times ``number`` back-to-back calls of a thunk; returns seconds per call."""

    @abstractmethod
    def sample(self, fn: Thunk, number: int) -> float:
        """Seconds per call of ``fn``, over ``number`` back-to-back calls."""

    def sync(self) -> None:  # noqa: B027  (an optional hook: CPU work is never queued)
        """Wait for all queued work (a no-op on CPU)."""


class CpuClock(Clock):
    """Wall-clock timing with :func:`time.perf_counter`."""

    def sample(self, fn: Thunk, number: int) -> float:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        return (time.perf_counter() - start) / number


class CudaClock(Clock):
    """CUDA-event timing on the current stream of ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def sample(self, fn: Thunk, number: int) -> float:
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch stub is untyped
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch stub is untyped
        torch.cuda.synchronize(self.device)  # empty queue: the interval starts when we start launching
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()  # outside the timed interval
        return float(start.elapsed_time(end)) / 1000.0 / number


def clock_for(device: torch.device) -> Clock:
    """The clock to use on ``device``."""
    if device.type == "cuda":
        return CudaClock(device)
    return CpuClock()


def calibrate(clock: Clock, fn: Thunk, min_sample_s: float, max_number: int = 1000) -> tuple[float, int]:
    """Time one call (after warm-up) and pick how many calls one sample must hold.

    Returns:
        (seconds of one call, calls per sample) so that a sample lasts >= ``min_sample_s``.
    """
    t = clock.sample(fn, 1)
    if t <= 0:
        return t, max_number
    return t, max(1, min(max_number, math.ceil(min_sample_s / t)))


@dataclass
class Samples:
    """Per-variant samples (seconds per call), one per repeat, in repeat order."""

    times: dict[str, list[float]]
    number: dict[str, int]

    @property
    def repeats(self) -> int:
        """Number of complete repeats (every variant sampled)."""
        return min((len(v) for v in self.times.values()), default=0)


def run_interleaved(
    clock: Clock,
    fns: Mapping[str, Thunk],
    number: Mapping[str, int],
    repeats: int,
    *,
    min_repeats: int = 3,
    budget_s: float | None = None,
) -> Samples:
    """Sample every variant once per repeat, interleaved to cancel drift.

    Even repeats run the variants in order (A B C), odd ones in reverse (C B A), so no
    variant always runs first or last. Stops early once ``budget_s`` seconds have passed,
    but never before ``min_repeats`` complete repeats.
    """
    names: Sequence[str] = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    for r in range(repeats):
        order = names if r % 2 == 0 else list(reversed(names))
        for n in order:
            times[n].append(clock.sample(fns[n], number[n]))
        done = r + 1
        if budget_s is not None and done >= min_repeats and time.perf_counter() - start > budget_s:
            break
    return Samples(times, dict(number))

"""Untimed probes of one call: peak extra memory, dispatched ops and device kernels.

Peak memory on CPU is the growth of the process's resident set high-water mark over
one call, psutil-free: glibc's free lists are first returned to the OS
(``malloc_trim(0)``), the kernel's high-water mark is reset (``5 > /proc/self/clear_refs``),
and ``VmHWM - VmRSS`` is read from ``/proc/self/status`` after the call. Where that
is not available (not Linux) ``resource.getrusage``'s ``ru_maxrss`` growth is used,
which only sees new all-time peaks. On CUDA it is ``torch.cuda.max_memory_allocated``
over the call minus what was allocated before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["peak_memory", "count_ops", "count_launches", "count_kernels", "memory_method"]

Thunk = Callable[[], object]


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc() if sys.platform.startswith("linux") else None


def _status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def memory_method(device: torch.device) -> str:
    """How :func:`peak_memory` measures on ``device`` in this process."""
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated growth over one call"
    if _status_kb("VmHWM") is not None and _reset_hwm():
        return "peak RSS growth over one call (malloc_trim + /proc/self/clear_refs + VmHWM)"
    return "ru_maxrss growth over one call (only new all-time peaks are seen)"


def peak_memory(fn: Thunk, device: torch.device) -> int:
    """Bytes of extra memory at the peak of one call of ``fn`` (see module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base)
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)
    if _reset_hwm():
        rss = _status_kb("VmRSS")
        if rss is not None:
            fn()
            peak = _status_kb("VmHWM")
            if peak is not None:
                return max(0, peak - rss) * 1024
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return max(0, after - before) * scale


class _OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode class is untyped
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's mode class is untyped
        self.count = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Thunk) -> int:
    """Number of ATen ops one call of ``fn`` dispatches (views and factories included)."""
    counter = _OpCounter()
    with counter:
        fn()
    return counter.count


_NO_KERNEL = frozenset({"empty", "empty_strided", "empty_like", "detach", "lift_fresh"})


class _LaunchCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode class is untyped
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's mode class is untyped
        self.count = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = func.__name__.split(".")[0]
        if not func.is_view and name not in _NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_launches(fn: Thunk) -> int:
    """Number of ATen ops one call of ``fn`` dispatches that compute: no views, no allocations.

    On a GPU each is (at least) one kernel launch; this counts them on any device, so the
    plan packedinit makes for a CUDA tensor can be counted on a CPU stand-in (see
    :mod:`benchmarks.device_plan`).
    """
    counter = _LaunchCounter()
    with counter:
        fn()
    return counter.count


def count_kernels(fn: Thunk, device: torch.device) -> int:
    """Number of device activities (kernels, memsets, memcpys) one call launches on CUDA.

    Counted with ``torch.profiler`` (CUDA activity); the device is synchronised inside
    the profiled region so every activity of the call is recorded.
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(1 for e in prof.events() if getattr(e.device_type, "name", "") == "CUDA")

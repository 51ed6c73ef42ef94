"""Benchmarks of packedinit's init cost against plain torch.nn.init and hand-written baselines.

Run ``python -m benchmarks --help``. The harness times every variant of a row (plain
whole-tensor init, per-block ``chunked``, a naive per-view loop, the timm-style single
corrected bound, and ``fill_``/``copy_`` as the bandwidth roofline) in the same
interleaved repeats, and writes JSON, Markdown and a PNG per device.
"""

from __future__ import annotations

__all__: list[str] = []

"""The plan packedinit makes for a CUDA tensor, run on a CPU stand-in, so its ops can be counted without a GPU.

The executor's only device-dependent choices read ``LocalSink.cpu`` (merging adjacent draws,
drawing into strided views, cache-sized bands: CPU only). A sink over a CPU tensor with
``cpu = False`` therefore takes exactly the branches a CUDA tensor of the same shape and
strides takes, and :func:`benchmarks.probes.count_launches` counts its compute ops (one
kernel launch each on a GPU). Unpacked tensors take the lean path, the same on both devices.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from packedinit.engine.execute import LocalSink, Scratch, execute
from packedinit.engine.plan import Plan, Request, make_plan
from packedinit.layout import Layout
from packedinit.model.claims import resolve

from .cases import Materialized

__all__ = ["device_plan"]

Thunk = Callable[[], object]


def device_plan(m: Materialized, fn: Callable[..., Tensor]) -> tuple[Thunk, int]:
    """A thunk that writes every tensor of ``m`` as packedinit would on a CUDA device, and the number of blocks."""
    pairs: list[tuple[Tensor, Layout | None]]
    if m.model is not None:
        pairs = [(p, lay) for _, p, lay in resolve(m.model) if p.dim() - (lay.batch_dims if lay else 0) >= 2]
    else:
        pairs = [(t, s.layout) for t, s in zip(m.tensors, m.specs, strict=True)]
    blocks = sum(len(lay.blocks(tuple(t.shape))) if lay is not None else 1 for t, lay in pairs)
    scratch = Scratch()
    work: list[tuple[Tensor, Plan | None, LocalSink | None]] = []
    for t, lay in pairs:  # plans and geometry made here, outside what is counted (cached in real use)
        plan = make_plan(Request(t, lay, None, fn)) if lay is not None else None
        sink = LocalSink(t, plan.layout) if plan is not None else None
        if sink is not None:
            sink.cpu = False  # every branch a CUDA tensor of this shape and these strides takes
        work.append((t, plan, sink))

    def run() -> None:
        for t, plan, sink in work:
            if plan is None or sink is None:
                fn(t)  # the lean path: the plain call, on every device
            else:
                execute(plan, sink, scratch)

    return run, blocks

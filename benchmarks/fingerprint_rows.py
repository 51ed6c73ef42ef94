"""The fingerprint's rows: ``packedinit.fingerprint`` against a float64 sum over the same tensors.

A row with ``fn = "fingerprint"`` times, interleaved like every row (see :mod:`benchmarks.runner`):

- ``plain``: ``torch.sum(t, dtype=torch.float64)`` of every tensor: one read pass, the baseline the
  issue's target names (issue 30: one read pass, at most 2x a float64 sum over the same parameters);
- ``chunked``: ``packedinit.fingerprint`` of the model (every parameter, blocks from its layouts) or of
  the packed tensors held as one module's parameters with their layouts (one call): hash, float64
  sums, min/max, nan/inf count, one pass;
- ``fill`` / ``copy``: the write roofline, for reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import packedinit
from packedinit import Layout

from .cases import Materialized

__all__ = ["FINGERPRINT", "fingerprint_variants"]

#: The ``fn`` of a fingerprint row (given to ``--fn`` like an init function's name).
FINGERPRINT = "fingerprint"


def fingerprint_variants(m: Materialized) -> dict[str, Callable[[], object] | str]:
    """The row's variants as zero-argument callables (or why one is n/a), built outside any timed region."""
    model = m.model
    layouts: dict[str, Layout] | None = None
    if model is None:  # the packed tensors as one module's parameters (sharing storage): one call for all
        model = nn.Module()
        layouts = {}
        for i, (t, spec) in enumerate(zip(m.tensors, m.specs, strict=True)):
            model.register_parameter(f"t{i}", nn.Parameter(t, requires_grad=False))
            if spec.layout is not None:
                layouts[f"t{i}"] = spec.layout
    tensors = list(model.parameters())
    holder, given = model, layouts

    def plain() -> None:
        for t in tensors:
            torch.sum(t, dtype=torch.float64)

    def chunked() -> None:
        packedinit.fingerprint(holder, layouts=given)

    def fill() -> None:
        for t in m.tensors:
            t.fill_(1.0)

    srcs = [(t, torch.zeros_like(t)) for t in m.tensors]

    def copy() -> None:
        for t, s in srcs:
            t.copy_(s)

    na = "not defined for the fingerprint"
    return {"plain": plain, "chunked": chunked, "naive": na, "timm": na, "fill": fill, "copy": copy}

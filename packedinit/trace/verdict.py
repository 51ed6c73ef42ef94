"""What the forward tracer says about one weight (:class:`Inferred`): packed with a layout, used whole, or opaque."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from packedinit.layout import Layout

__all__ = ["Inferred", "Verdict"]

Verdict = Literal["packed", "not packed", "opaque"]


@dataclass(frozen=True)
class Inferred:
    """What the forward showed about one weight.

    Attributes:
        verdict: ``"packed"`` (``layout`` says how), ``"not packed"`` (its output is used
            whole), or ``"opaque"`` (the tracer could not follow the weight: ``why`` says why).
        layout: the Layout for ``"packed"``, else ``None``.
        why: one line in words.
        batch_dims: leading dims of the weight that the forward used as separate matrices (a stack of
            experts read per expert, or all at once by ``bmm`` / ``grouped_mm``): each matrix has its own fans.
    """

    verdict: Verdict
    layout: Layout | None
    why: str
    batch_dims: int = 0

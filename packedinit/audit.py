"""Read-only audit of a model's packed parameters. (Stub: filled by issue 5.)"""

from __future__ import annotations

from torch import nn

__all__ = ["AuditReport", "audit"]


class AuditReport:
    """The audit's typed report (stub)."""


def audit(model: nn.Module) -> AuditReport:
    """Audit every packed parameter of ``model`` (stub)."""
    raise NotImplementedError

"""``packedinit.audit``: the audit function, and the documented module of its statistics.

``packedinit.audit(model)`` is :func:`packedinit.auditing.measure.audit`. This module is
callable as that function, so the documented paths keep working both ways:
``from packedinit.audit import DEFAULT_REFERENCES, tolerance, audit_tensors`` and
``packedinit.audit.DEFAULT_REFERENCES`` as well as ``packedinit.audit(model)``. The code lives
in :mod:`packedinit.auditing` (statistics, verdicts, report, "looks packed" guesses, measuring).

Examples:
    >>> import torch, packedinit
    >>> import packedinit.audit as m
    >>> m is packedinit.audit, callable(m), len(m.DEFAULT_REFERENCES) > 0
    (True, True, True)
    >>> packedinit.audit(torch.nn.MultiheadAttention(64, 4)).affected
    ('in_proj_weight',)
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

from packedinit.auditing.measure import (
    DEFAULT_REFERENCES,
    TOL_FLOOR,
    AuditReport,
    BlockAudit,
    ExpectedStd,
    ParamAudit,
    Reference,
    Suspect,
    Verdict,
    Z,
    audit,
    compact,
    context_references,
    render,
    tolerance,
)
from packedinit.auditing.tensors import audit_tensors

__all__ = [
    "AuditReport",
    "ParamAudit",
    "BlockAudit",
    "ExpectedStd",
    "Reference",
    "Suspect",
    "DEFAULT_REFERENCES",
    "Verdict",
    "Z",
    "TOL_FLOOR",
    "audit",
    "audit_tensors",
    "compact",
    "context_references",
    "render",
    "tolerance",
]


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`packedinit.auditing.measure.audit` (``packedinit.audit(model)``)."""

    __signature__ = inspect.signature(audit)

    def __call__(self, *args: Any, **kwargs: Any) -> AuditReport:
        return audit(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

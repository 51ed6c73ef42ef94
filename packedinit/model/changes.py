"""One number that changes whenever what is known about layouts changes: an adapter registered or removed, an
annotation written, a trace that shows something new.

:mod:`packedinit.model.kept` compares it before it re-uses a decision; :mod:`packedinit.model.registry`,
:mod:`packedinit.model.marks` and :mod:`packedinit.model.found` call :func:`bump` after each change.
Read :data:`NOW` ``[0]``: a plain read, for the per-module path of ``model.apply``.
"""

from __future__ import annotations

import threading

__all__ = ["NOW", "bump"]

#: ``NOW[0]``: the current number (only ever written by :func:`bump`, under a lock: no change is lost).
NOW = [0]
_lock = threading.Lock()


def bump() -> None:
    """Say that something a kept decision may have read has changed (call it after the change)."""
    with _lock:
        NOW[0] += 1

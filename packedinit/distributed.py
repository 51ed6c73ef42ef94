"""``packedinit.distributed``: the documented path of :func:`global_params`.

The code lives in :mod:`packedinit.engine.distributed`.
"""

from __future__ import annotations

from packedinit.engine.distributed import global_params

__all__ = ["global_params"]

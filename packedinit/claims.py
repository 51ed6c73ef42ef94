"""``packedinit.claims``: the documented path of :func:`annotations_of`.

The code lives in :mod:`packedinit.model.claims`.
"""

from __future__ import annotations

from packedinit.model.claims import annotate, annotations_of, layouts

__all__ = ["annotate", "annotations_of", "layouts"]

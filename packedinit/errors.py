"""The one exception type packedinit raises for bad input."""

from __future__ import annotations

__all__ = ["PackedInitError"]


class PackedInitError(ValueError):
    """Raised for input packedinit cannot handle correctly.

    It is a :class:`ValueError`, so code that already catches the errors of
    ``torch.nn.init`` keeps working. The message names the parameter (when
    known), its shape, the layout and the fix. It is always raised before the
    first write: the tensor is left bit-identical to what it was.
    """

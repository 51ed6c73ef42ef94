"""The one exception type packedinit raises for bad input."""

from __future__ import annotations

__all__ = ["PackedInitError"]


class PackedInitError(ValueError):
    """Raised for input packedinit cannot handle correctly.

    It is a :class:`ValueError`, so code that already catches the errors of
    ``torch.nn.init`` keeps working. The message names the parameter (when
    known), its shape, the layout and the fix. packedinit raises it before it
    writes anything: the tensor is left bit-identical to what it was (with an
    unpacked tensor and your own init function, as that function left it).

    Examples:
        >>> import torch
        >>> from packedinit import PackedInitError, chunked_init
        >>> w = torch.zeros(10, 4)
        >>> try:
        ...     chunked_init(w, 3, 0, torch.nn.init.xavier_uniform_)
        ... except PackedInitError as e:
        ...     print(e)
        tensor of shape (10, 4): dim 0 has length 10, which 3 equal chunks cannot divide; pass sizes instead, ...
        >>> bool((w == 0).all())
        True
    """

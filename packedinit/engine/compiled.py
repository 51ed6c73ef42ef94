"""A request met inside a function ``torch.compile`` is tracing.

The engine's planning is Python work on shapes and strides (storage offsets, cached write
programs, meta-tensor dry runs) that Dynamo cannot put in a graph. So while compiling:

- a packed tensor whose every logical block is a contiguous view of it (the common case: blocks
  along dim 0, as MHA's ``in_proj_weight`` or an LSTM's gates), filled by a ``torch.nn.init``
  function, gets that function once per block view, in block order: Dynamo traces those calls
  as it traces the plain function, with no graph break;
- anything else runs the eager engine under ``torch.compiler.disable``: one graph break around
  the call, the result exactly the eager one.

Either way the numbers are the eager call's: the blocks are drawn in block order from the same
stream, each as a contiguous tensor of its logical shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from packedinit.engine.chunks import as_layout
from packedinit.engine.lean import PLAIN_TYPES
from packedinit.engine.plan import Request
from packedinit.engine.traits import LOW_PRECISION, TORCH_FNS, hashable_in
from packedinit.torch_compat import TORCH_VERSION

__all__ = ["compiling", "traced_blocks"]

#: Dynamo traces the per-block calls from torch 2.13 (checked on 2.13 and 2.15); torch 2.6's fails inside the
#: layout code (a frozenset lookup of a function, hash() of a tuple, an internal error in as_layout), so
#: there every request takes the eager engine under ``torch.compiler.disable`` (graph breaks, eager numbers).
_TRACES_BLOCKS = TORCH_VERSION >= (2, 13)

#: The dtypes whose blocks are traced (others take the eager engine, which checks them first).
_TRACED_DTYPES = (torch.float32, torch.float64, *LOW_PRECISION)


def compiling() -> bool:
    """Whether torch.compile is tracing the caller now (``torch.compiler.is_compiling``)."""
    return torch.compiler.is_compiling()


def _views(req: Request) -> list[Tensor] | None:
    """Each block as a contiguous view of ``req.tensor``, in block order; ``None`` if one is not."""
    tensor = req.tensor
    if req.chunks is None and req.dim is None:
        return [tensor] if tensor.is_contiguous() else None
    layout = as_layout(req.chunks, req.dim, tuple(tensor.shape), param=req.param)
    if layout is None:
        return [tensor] if tensor.is_contiguous() else None
    if layout.transposed or layout.groups != 1 or tensor.dim() - layout.batch_dims < 2:
        return None
    views: list[Tensor] = []
    for block in layout.blocks(tuple(tensor.shape), param=req.param):
        view = layout.logical_view(tensor, block)
        if view is None or not view.is_contiguous():
            return None
        views.append(view)
    return views


def traced_blocks(req: Request) -> bool:
    """Fill ``req.tensor`` with one traceable call per block view; ``False`` (nothing written) where it cannot."""
    if not _TRACES_BLOCKS:
        return False
    fn = req.init_fn
    tensor = req.tensor
    if not (callable(fn) and hashable_in(fn, TORCH_FNS)) or type(tensor) not in PLAIN_TYPES:
        return False
    if tensor.is_meta or tensor.dtype not in _TRACED_DTYPES or fn is torch.nn.init.orthogonal_:
        return False  # orthogonal_'s QR and the meta/dtype rules are the eager engine's
    views = _views(req)
    if views is None:
        return False
    init: Callable[..., Tensor] = fn
    with torch.no_grad():
        for view in views:
            init(view, *req.args, **req.kwargs)
    return True

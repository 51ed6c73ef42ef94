"""Run one request: the lean path, a DTensor, or plan + execute. The engine's single entry point."""

from __future__ import annotations

from .distributed import init_dtensor
from .execute import PLAIN_TYPES, LocalSink, Scratch, execute, run_whole
from .layout import Chunks, Layout, as_layout
from .plan import Request, make_plan
from .traits import is_dtensor

__all__ = ["run", "is_whole"]


def is_whole(req: Request) -> bool:
    """Whether ``chunks``/``dim`` make one block that is the tensor as stored (raises if they don't fit).

    ``None`` and ``1`` always do (the call is then exactly ``init_fn(tensor)``); an explicit
    one-part Layout or ``[n]`` only for a contiguous tensor (a separate tensor is contiguous).
    """
    chunks: Chunks | None = req.chunks
    tensor, dim = req.tensor, req.dim
    if chunks is None or (type(chunks) is int and chunks == 1):
        nd = tensor.dim()
        return (dim is None or (type(dim) is int and -nd <= dim < nd)) and (chunks is None or nd > 0)
    # one explicit part: the whole tensor; the same draws as a separate tensor only when contiguous
    if isinstance(chunks, Layout):
        if chunks.num_parts != 1 or chunks.transposed or chunks.batch_dims:
            return False
    elif not (type(chunks) in (list, tuple) and len(chunks) == 1):  # type: ignore[arg-type]  # a list or tuple
        return False
    return as_layout(chunks, dim, tensor.shape, param=req.param) is not None and tensor.is_contiguous()


def run(req: Request, scratch: Scratch | None = None) -> None:
    """Initialise ``req.tensor`` as ``req`` says (the engine behind chunked_init, chunked and the model walk).

    ``scratch`` may be shared across calls.
    """
    tensor, fn = req.tensor, req.init_fn
    if type(tensor) in PLAIN_TYPES and callable(fn) and is_whole(req) and run_whole(req, fn):
        return
    if is_dtensor(tensor):
        init_dtensor(req, scratch)
        return
    plan = make_plan(req)
    if plan is None or tensor.is_meta or tensor.numel() == 0:
        return
    execute(plan, LocalSink(tensor, plan.layout), scratch)

"""Run one request: the lean path, a DTensor, or plan + execute. The engine's single entry point."""

from __future__ import annotations

import torch
from torch import Tensor

from .chunks import Chunks, as_layout
from .distributed import init_dtensor
from .execute import PLAIN_TYPES, LocalSink, Scratch, execute, run_whole
from .layout import Layout
from .plan import Plan, Request, cacheable, make_plan, request_key, typed
from .torch_compat import set_grad_enabled
from .traits import DirectDraw, draw, is_dtensor

__all__ = ["run", "is_whole"]

#: Per request key (everything the checks read, see plan.make_plan), what writing such a tensor takes:
#: the merged ``uniform_`` runs (storage offset, length, low, high, generator) when every block is one,
#: else the plan. Bounded; cleared when full.
_Runs = tuple[tuple[int, int, DirectDraw, "torch.Generator | None"], ...]
_PROGRAMS: dict[tuple[object, ...], _Runs | Plan] = {}
_PROGRAMS_MAX = 4096


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
    key = None
    if type(tensor) in PLAIN_TYPES:
        if callable(fn) and is_whole(req) and run_whole(req, fn):
            return
        key = request_key(req, (typed(req.chunks), typed(req.dim)))
        prog = _PROGRAMS.get(key) if key is not None else None
        if prog is not None:
            _replay(prog, tensor, scratch)
            return
    elif is_dtensor(tensor):
        init_dtensor(req, scratch)
        return
    plan = make_plan(req)
    if plan is None or tensor.is_meta or tensor.numel() == 0:
        return
    sink = LocalSink(tensor, plan.layout)
    if key is not None and cacheable(plan):
        if len(_PROGRAMS) >= _PROGRAMS_MAX:
            _PROGRAMS.clear()
        _PROGRAMS[key] = _compile(plan, sink)
    execute(plan, sink, scratch)


def _compile(plan: Plan, sink: LocalSink) -> _Runs | Plan:
    """The merged uniform_ runs of a validated plan on this geometry, when every block is one; else the plan."""
    todo = plan.todo()
    if sink.geometry is None or not todo:
        return plan
    out: list[tuple[int, int, DirectDraw, torch.Generator | None]] = []
    for run_ in sink.runs(plan, todo):
        d = plan.direct[run_[0].index]
        g = sink.geometry[run_[0].index]
        if d is None or not g.inplace:  # direct draws are made in the tensor's dtype
            return plan
        out.append((g.view[1], sum(b.numel for b in run_), d, plan.generator))
    return tuple(out)


def _replay(prog: _Runs | Plan, tensor: Tensor, scratch: Scratch | None) -> None:
    if isinstance(prog, Plan):
        execute(prog, LocalSink(tensor, prog.layout), scratch)
        return
    offset = tensor.storage_offset()
    grad = torch.is_grad_enabled()
    set_grad_enabled(False)
    try:
        for start, n, d, gen in prog:
            draw(tensor.as_strided((n,), (1,), offset + start), d, gen)
    finally:
        set_grad_enabled(grad)

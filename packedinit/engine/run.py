"""Run one request: the lean path, a DTensor, or plan + execute. The engine's single entry point."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from packedinit.engine.compiled import compiling, traced_blocks
from packedinit.engine.direct import DirectDraw, draw
from packedinit.engine.distributed import init_dtensor
from packedinit.engine.execute import LocalSink, Scratch, execute
from packedinit.engine.keys import request_key
from packedinit.engine.lean import GENERAL, PLAIN_TYPES, call, route, whole
from packedinit.engine.plan import Plan, Request, cacheable, make_plan
from packedinit.engine.traits import is_dtensor
from packedinit.torch_compat import TORCH_VERSION, set_grad_enabled

__all__ = ["run"]

#: Per request key (:func:`packedinit.engine.keys.request_key`: every field of the request, holding no caller
#: object), what writing such a tensor takes: the merged direct draws (storage offset, length, draw)
#: when every block is one, else the plan (without a generator: the call's own is bound). Bounded;
#: cleared when full.
_Runs = tuple[tuple[int, int, DirectDraw], ...]
_PROGRAMS: dict[tuple[object, ...], _Runs | Plan] = {}
_PROGRAMS_MAX = 4096


def run(req: Request, scratch: Scratch | None = None) -> None:
    """Initialise ``req.tensor`` as ``req`` says (the engine behind chunked_init, chunked and the model walk).

    ``scratch`` may be shared across calls.
    """
    if compiling():  # inside torch.compile: per-block calls Dynamo traces, else the eager engine (one break)
        if not traced_blocks(req):
            _eager()(req, scratch)
        return
    tensor, fn = req.tensor, req.init_fn
    key = None
    if type(tensor) in PLAIN_TYPES:
        if callable(fn) and whole(tensor, req.chunks, req.dim, req.param):
            how = route(tensor, fn, req.args, req.kwargs, req.param)
            if how != GENERAL:
                call(how, tensor, fn, req.args, req.kwargs, req.param)
                return
        key = request_key(req)
        prog = _PROGRAMS.get(key) if key is not None else None
        if prog is not None:
            _replay(prog, tensor, req.kwargs.get("generator"), scratch)
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
        return plan.bind(None)
    out: list[tuple[int, int, DirectDraw]] = []
    for run_ in sink.runs(plan, todo):
        d = plan.direct[run_[0].index]
        g = sink.geometry[run_[0].index]
        if d is None or not g.inplace:  # direct draws are made in the tensor's dtype
            return plan.bind(None)
        out.append((g.view[1], sum(b.numel for b in run_), d))
    return tuple(out)


def _replay(prog: _Runs | Plan, tensor: Tensor, gen: torch.Generator | None, scratch: Scratch | None) -> None:
    if isinstance(prog, Plan):
        execute(prog.bind(gen), LocalSink(tensor, prog.layout), scratch)
        return
    offset = tensor.storage_offset()
    grad = torch.is_grad_enabled()
    set_grad_enabled(False)
    try:
        for start, n, d in prog:
            draw(tensor.as_strided((n,), (1,), offset + start), d, gen)
    finally:
        set_grad_enabled(grad)


_EAGER: list[Callable[[Request, Scratch | None], None]] = []


def _eager() -> Callable[[Request, Scratch | None], None]:
    """:func:`run` outside Dynamo's trace: the engine's Python planning cannot be put in a graph.

    Made on first use (only ever under ``torch.compile``, which has imported Dynamo): wrapping it at
    import would import Dynamo (~1 s, some 10^5 objects the garbage collector then walks) for everyone.
    """
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(run, recursive=True))  # type: ignore[no-untyped-call]  # torch leaves it untyped
    return _EAGER[0]


if TORCH_VERSION < (2, 13):  # torch 2.6's Dynamo cannot trace making it (a graph break, with a warning): made now
    _eager()

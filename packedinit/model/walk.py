"""Whole-model init: resolve every parameter to its Layout once, then init a model.

Two entry points share one planner:

- ``chunked(f)(model)`` / :func:`init_model` own the whole tree: every distinct
  parameter with ``dim >= 2``, in ``model.named_parameters()`` order.
- ``model.apply(chunked(f))`` calls ``chunked(f)`` once per submodule (children
  first). Each call owns only that module's own parameters (``recurse=False``),
  with layouts from the module's annotations, its adapter and the adapters of the
  modules ``apply`` is visiting it from (its ancestors up to the module ``apply``
  was called on). So every parameter is initialised once, packed ones per block.

Everything is validated before the first write of a call: layouts against shapes,
the init function against every distinct block shape (a dry run on meta tensors).
"""

from __future__ import annotations

import fnmatch
import re
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn

from packedinit.engine.chunks import Chunks
from packedinit.engine.distributed import DTensorPlan, plan_dtensor, write_planned
from packedinit.engine.execute import LocalSink, RngState, Scratch, execute
from packedinit.engine.lean import GENERAL, PLAIN_TYPES, call, route
from packedinit.engine.plan import Plan, Request, make_plan
from packedinit.engine.traits import TORCH_FNS, fn_name, is_dtensor
from packedinit.errors import PackedInitError, packed_error
from packedinit.layout import Layout
from packedinit.model.claims import own_layouts, resolve
from packedinit.model.marks import annotations_of
from packedinit.model.parametrized import is_holder, originals_of, stand_in, write_through
from packedinit.torch_compat import apply_ancestors as frames_from_apply
from packedinit.torch_compat import param_dict

__all__ = [
    "init_model",
    "select",
    "ParamFilter",
    "init_tree",
    "module_call",
    "apply_ancestors",
    "plan_steps",
    "plan_requests",
    "run_steps",
    "Step",
    "LeanStep",
    "through_parametrizations",
    "init_held",
]

@dataclass(frozen=True)
class Step:
    """One validated write of a whole-model call: a local plan, or a DTensor's plan and shard."""

    req: Request
    plan: Plan | None = None
    dtensor: DTensorPlan | None = None
    lean: int = GENERAL  # an unpacked plain tensor: what packedinit.engine.lean.route decided for it


#: A write of an unpacked tensor whose checks an equal one passed: ``lean.call``'s arguments
#: (route, tensor, fn, args, kwargs, name).
LeanStep: TypeAlias = tuple[int, Tensor, Callable[..., Tensor], tuple[Any, ...], Mapping[str, Any], str | None]


def plan_steps(
    entries: Iterable[tuple[str, Tensor, Layout | None]],
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    min_dim: int = 2,
) -> list[Step | LeanStep]:
    """Validate every entry with ``dim >= min_dim`` before anything is written; return what to write, in order.

    Every tensor gets every check of its own (its memory, dtype, generator device); the
    dry run of ``init_fn`` on each distinct block shape is cached, so validating a large
    model costs little more than one check per parameter. An unpacked tensor whose checks an
    equal one passed (see :func:`_checked_key`) is not planned again.
    """
    head = _call_key(init_fn, args, kwargs)
    mode = torch.is_inference_mode_enabled()
    steps: list[Step | LeanStep] = []
    for name, p, layout in entries:
        # A layout's batch dims index independent blocks: a stacked (n_experts, 2I) bias holds
        # 1-D blocks and is skipped like any bias, although its stored ndim is 2.
        if p.dim() - (layout.batch_dims if layout is not None else 0) < min_dim:
            continue
        if head is not None and layout is None:
            key = _tensor_key(p, head, mode)
            how = _CHECKED.get(key) if key is not None else None
            if how is not None:
                steps.append((how, p, init_fn, args, kwargs, name))
                continue
        steps.extend(plan_requests((Request(p, layout, None, init_fn, args, kwargs, name),)))
    return steps


#: Unpacked plain tensors whose every check passed, by everything those checks read (see _checked_key),
#: with what packedinit.engine.lean.route decided for them. Only torch.nn.init functions with plain-valued
#: arguments: the key keeps no caller's object alive. Bounded; cleared when full.
_CHECKED: dict[tuple[object, ...], int] = {}
_CHECKED_MAX = 4096
_PLAIN_VALUES = (int, float, str, bool, type(None))


def _checked_key(req: Request) -> tuple[object, ...] | None:
    """For an unpacked plain tensor and a torch.nn.init function with plain-valued arguments: everything
    ``make_plan(req, full=True)`` and ``route`` read (the name only goes into messages); else None."""
    if req.chunks is not None or req.dim is not None:
        return None
    head = _call_key(req.init_fn, req.args, req.kwargs)
    return _tensor_key(req.tensor, head, torch.is_inference_mode_enabled()) if head is not None else None


def _tensor_key(p: Tensor, head: tuple[object, ...], mode: bool) -> tuple[object, ...] | None:
    """:func:`_checked_key` from its two parts: the call's (:func:`_call_key`) and the tensor's."""
    if type(p) not in PLAIN_TYPES or p.layout != torch.strided:
        return None
    return (head, type(p), p.shape, p.stride(), p.dtype, p.device, p.is_inference(), mode)


def _call_key(fn: object, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[object, ...] | None:
    """The function and its arguments with their types, for :func:`_checked_key`; None unless a torch.nn.init
    function with plain-valued arguments."""
    if type(fn) is not types.FunctionType or fn not in TORCH_FNS:
        return None
    if not args and not kwargs:
        return (fn,)
    if not all(type(v) in _PLAIN_VALUES for v in (*args, *kwargs.values())):
        return None
    return (fn, tuple((type(v), v) for v in args), tuple((k, type(v), v) for k, v in kwargs.items()))


def plan_requests(reqs: Iterable[Request]) -> list[Step]:
    """Validate every request before anything is written; return the steps that write, in order.

    An unpacked tensor whose checks an equal one already passed (same shape, strides, dtype,
    device, function and arguments) is not checked again: the checks read nothing else.
    """
    steps: list[Step] = []
    for req in reqs:
        p, layout = req.tensor, req.chunks
        if is_dtensor(p):
            # every check now, so that the whole model stays all-or-nothing; written by the distributed path
            steps.append(Step(req, dtensor=plan_dtensor(req)))
            continue
        key = _checked_key(req)
        how = _CHECKED.get(key) if key is not None else None
        if how is not None:  # an equal tensor passed every check (only written ones are kept)
            steps.append(Step(req, lean=how))
            continue
        plan = make_plan(req, full=True)
        if plan is not None and not p.is_meta and p.numel():
            unpacked = layout is None and req.dim is None and callable(req.init_fn)
            how = route(p, req.init_fn, req.args, req.kwargs, req.param) if unpacked else GENERAL
            steps.append(Step(req, plan=plan, lean=how))
            if key is not None and how != GENERAL:
                if len(_CHECKED) >= _CHECKED_MAX:
                    _CHECKED.clear()
                _CHECKED[key] = how
    return steps


def run_steps(steps: Sequence[Step | LeanStep], scratch: Scratch | None = None) -> None:
    """Write what :func:`plan_steps` validated, in order, sharing one scratch buffer.

    When some function could not be tried on meta (it reads values: the dry run proved
    nothing about it) and more than one tensor is written, every tensor is copied first, so
    that a failure on a later tensor puts back the earlier ones and the RNG state: the call
    stays all-or-nothing.
    """
    scratch = scratch or Scratch()
    if len(steps) > 1 and any(not isinstance(s, tuple) and s.plan is not None and not s.plan.verified for s in steps):
        _run_undoable(steps, scratch)
        return
    _run(steps, scratch)


def _run(steps: Sequence[Step | LeanStep], scratch: Scratch) -> None:
    for step in steps:
        if isinstance(step, tuple):
            call(*step)
            continue
        req = step.req
        if step.dtensor is not None:
            write_planned(step.dtensor, scratch)
        elif step.lean != GENERAL:
            call(step.lean, req.tensor, req.init_fn, req.args, req.kwargs, req.param)  # type: ignore[arg-type]
        elif step.plan is not None:
            execute(step.plan, LocalSink(req.tensor, step.plan.layout), scratch)


def _run_undoable(steps: Sequence[Step | LeanStep], scratch: Scratch) -> None:
    tensors = [s[1] if isinstance(s, tuple) else s.req.tensor for s in steps]
    backups = [t.detach().clone() for t in tensors]
    plan = next(s.plan for s in steps if not isinstance(s, tuple) and s.plan is not None)
    rng = RngState(tensors[0].device, plan.generator)
    try:
        _run(steps, scratch)
    except Exception as e:
        with torch.no_grad():
            for t, b in zip(tensors, backups, strict=True):
                t.copy_(b)
        rng.restore()
        if isinstance(e, PackedInitError):
            msg = _AS_LEFT.sub("Nothing was written", str(e))
            cause = e.__cause__
            msg += " (packedinit restored every tensor it had written and the RNG state)"
            raise packed_error(msg, cause) from cause
        if hasattr(e, "add_note"):
            e.add_note("packedinit: restored every tensor it had written and the RNG state; nothing was written.")
        raise


_AS_LEFT = re.compile(r"packedinit wrote nothing; the tensor is as \S+ left it")


Entry: TypeAlias = tuple[str, Tensor, Layout | None]
#: A packed parametrized tensor: its ``ParametrizationList`` and the plain stand-in initialised per block.
Swap: TypeAlias = tuple[nn.Module, Tensor]


def through_parametrizations(
    modules: Iterable[nn.Module], entries: Sequence[Entry], init_fn: object
) -> tuple[list[Entry], list[Swap]]:
    """Entries in which each packed original of a parametrized tensor is replaced by a plain stand-in.

    The per-block init is meant for the tensor the module computes (``weight = g * v / ||v||``
    for ``weight_norm``), not for the original that holds the blocks: the stand-in, of the
    parametrized tensor's shape, is initialised per block, then written to the originals
    through ``right_inverse`` (:func:`packedinit.parametrized.write_through`: ``g = ||w||,
    v = w``; a ``spectral_norm``'s vectors are drawn again), as ``module.weight = w`` does.
    The other originals (``g``) are dropped: the plain loop on the unparametrised module
    never sees them, so the draws are those of that loop. An original annotated with a
    layout of its own shape, other than the tensor's, is initialised as it is.
    """
    holders = [m for m in modules if is_holder(m)]
    if not holders:
        return list(entries), []
    layout_of = {id(p): lay for _, p, lay in entries}
    swapped: dict[int, Tensor] = {}
    dropped: set[int] = set()
    swaps: list[Swap] = []
    for holder in holders:
        held = originals_of(holder)
        packed = [t for t in held if layout_of.get(id(t)) is not None]
        if len(packed) != 1:
            continue
        one = packed[0]
        lay = layout_of[id(one)]
        assert lay is not None  # packed: claimed with a layout
        if one.dim() - lay.batch_dims < 2:  # a packed 1-D tensor: skipped as any bias is
            continue
        name = next(n for n, p, _ in entries if p is one)
        standin = stand_in(holder, name, current=not callable(init_fn))
        if tuple(standin.shape) != tuple(one.shape):
            continue
        swapped[id(one)] = standin
        dropped.update(id(t) for t in held if t is not one)
        swaps.append((holder, standin))
    if not swaps:
        return list(entries), []
    out = [(n, swapped.get(id(p), p), lay) for n, p, lay in entries if id(p) not in dropped]
    return out, swaps


def _write(
    entries: Sequence[Entry],
    swaps: Sequence[Swap],
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> None:
    """Plan every entry (stand-ins included), write them, then write each stand-in through its parametrization."""
    run_steps(plan_steps(entries, init_fn, args, kwargs))
    for holder, standin in swaps:
        write_through(holder, standin)


def init_held(
    holder: nn.Module,
    p: Tensor,
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    lays: Mapping[int, Layout | None] | None = None,
) -> bool:
    """``f(p)`` on an original of a packed ``ParametrizationList``: through the parametrization.

    The packed original: a stand-in of the parametrized tensor is initialised per block and
    written through ``right_inverse`` (see :func:`through_parametrizations`); a sibling of it
    (``weight_norm``'s ``g``) is left as it is (that write sets it). False: neither (``p`` is
    then initialised as it is). ``lays``: the originals' layouts by ``id``; default, the
    annotations on ``holder``.
    """
    anns = annotations_of(holder)
    prefix = type(holder).__name__
    entries = [
        (f"{prefix}.{n}", t, anns.get(n) if lays is None else lays.get(id(t))) for n, t in _leaves(holder)
    ]
    out, swaps = through_parametrizations((holder,), entries, init_fn)
    if not swaps or any(t is p for _, t, _ in out):
        return False  # p is initialised as it is
    if any(t is p and lay is not None for _, t, lay in entries):  # the packed original: through the stand-in
        _write([e for e in out if e[1] is swaps[0][1]], swaps, init_fn, args, kwargs)
    return True  # else a sibling (g): the packed original's write sets it


def _leaves(holder: nn.Module) -> list[tuple[str, Tensor]]:
    """``(leaf name, original)`` of a ``ParametrizationList``."""
    held = originals_of(holder)
    if len(held) == 1:
        return [("original", held[0])]
    return [(f"original{i}", t) for i, t in enumerate(held)]


def init_tree(
    model: nn.Module,
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> None:
    """Every distinct parameter with ``dim >= 2`` of ``model``, packed ones per block; all checked first."""
    entries, swaps = through_parametrizations(model.modules(), resolve(model), init_fn)
    _write(entries, swaps, init_fn, args, kwargs)


def apply_ancestors(module: nn.Module, depth: int = 1) -> list[nn.Module] | None:
    """The modules ``nn.Module.apply`` is visiting ``module`` from, nearest first; ``None`` if not from apply.

    The frames are read in :mod:`packedinit.torch_compat` (versions checked there): ``nn.Module.apply(fn)`` calls
    ``fn(module)`` children first and passes nothing else, so an init function called from it
    cannot otherwise know that it owns only ``module``'s own parameters, nor which ancestors'
    adapters describe them. ``depth`` is how many frames above this function's caller the call
    from ``apply`` is (1: the caller itself was called by ``apply``).
    """
    return frames_from_apply(module, depth + 1)


def _init_own(
    module: nn.Module,
    ancestors: Sequence[nn.Module],
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> None:
    own = [(n, p) for n, p in param_dict(module).items() if p is not None and p.dim() >= 2]
    if not own:
        return
    lays = own_layouts(module, ancestors)
    prefix = type(module).__name__
    head = _call_key(init_fn, args, kwargs) if not lays else None
    if head is not None:  # nothing packed: where an equal parameter passed every check of each one, just call
        mode = torch.is_inference_mode_enabled()
        hows = [_CHECKED.get(_tensor_key(p, head, mode) or ()) for _, p in own]
        if None not in hows:
            for (n, p), how in zip(own, hows, strict=True):
                assert how is not None  # checked just above, before the first write
                call(how, p, init_fn, args, kwargs, f"{prefix}.{n}")
            return
    entries, swaps = through_parametrizations(
        (module,), [(f"{prefix}.{n}", p, lays.get(id(p))) for n, p in own], init_fn
    )
    _write(entries, swaps, init_fn, args, kwargs)


def module_call(
    module: nn.Module,
    init_fn: Callable[..., Tensor],
    chunks: Chunks | None,
    dim: int | None,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    ancestors: Sequence[nn.Module] | None,
) -> None:
    """``chunked(f)(module)``: the whole tree, or (``ancestors`` given: from ``nn.Module.apply``) its own parameters."""
    if chunks is not None or dim is not None:
        raise PackedInitError(
            f"chunked({fn_name(init_fn)}, chunks={chunks!r}, dim={dim!r}) was called on a "
            f"{type(module).__name__}; chunks/dim describe one tensor. For a module, layouts come from "
            f"adapters and annotations: use chunked({fn_name(init_fn)})(module) and "
            f"packedinit.annotate(module, name=Layout(...)) for parameters no adapter knows."
        )
    if ancestors is not None:
        _init_own(module, ancestors, init_fn, args, kwargs)
    else:
        init_tree(module, init_fn, args, kwargs)


#: What ``init_model(..., params=...)`` takes: glob pattern(s) on qualified names, or a predicate.
ParamFilter: TypeAlias = str | Sequence[str] | Callable[[str, Tensor], bool]


def select(
    model: nn.Module,
    entries: list[tuple[str, Tensor, Layout | None]],
    modules: type[nn.Module] | tuple[type[nn.Module], ...] | None,
    params: ParamFilter | None,
) -> list[tuple[str, Tensor, Layout | None]]:
    """The entries that lie under a module of type ``modules`` and whose name matches ``params``."""
    if modules is not None:
        kinds = modules if isinstance(modules, tuple) else (modules,)
        if not kinds or not all(isinstance(k, type) and issubclass(k, nn.Module) for k in kinds):
            raise PackedInitError(
                f"init_model(..., modules={modules!r}): modules must be an nn.Module subclass or a tuple of them "
                f"(as for isinstance), e.g. modules=torch.nn.Linear."
            )
        under = {id(p) for m in model.modules() if isinstance(m, kinds) for p in m.parameters()}
        entries = [e for e in entries if id(e[1]) in under]
    if params is not None:
        if callable(params):
            keep: Callable[[str, Tensor], bool] = params
        else:
            patterns = (params,) if isinstance(params, str) else tuple(params)
            if not patterns or not all(isinstance(x, str) for x in patterns):
                raise PackedInitError(
                    f"init_model(..., params={params!r}): params must be a glob pattern on qualified parameter "
                    f"names (e.g. '*.attn.*'), a list of them, or a function (name, param) -> bool."
                )

            def keep(name: str, _: Tensor) -> bool:
                return any(fnmatch.fnmatchcase(name, x) for x in patterns)

        entries = [e for e in entries if keep(e[0], e[1])]
    return entries


def init_model(
    model: nn.Module,
    init_fn: Callable[..., Tensor],
    /,
    *args: Any,
    modules: type[nn.Module] | tuple[type[nn.Module], ...] | None = None,
    params: ParamFilter | None = None,
    **kwargs: Any,
) -> nn.Module:
    r"""Initialise every parameter with ``dim >= 2`` of ``model``, packed ones per logical block.

    This is the ``for p in model.parameters(): if p.dim() > 1: init_fn(p)`` idiom
    done right: a parameter that :func:`~packedinit.layouts` knows to be packed
    (through a registered adapter or an annotation) gets ``init_fn`` once per
    logical block; every other parameter gets ``init_fn`` on the whole tensor,
    exactly as the plain loop would. 1-D parameters (biases, norms) are left alone.
    Tied parameters are initialised once. ``chunked(init_fn)(model, ...)`` is the
    same call without filters.

    Order: parameters in ``model.named_parameters()`` order, blocks in block order,
    all from one RNG stream. On CPU the result is bit-identical to the plain loop
    run on the separate logical tensors (on transposed storage, for functions i.i.d.
    per element given the fans, the separate tensors in their stored orientation).

    Filters replace the hand-written ``apply`` callback: ``modules`` keeps the
    parameters of modules of those types (and of their submodules), ``params`` the
    parameters whose qualified name matches a glob pattern (``fnmatch``, e.g.
    ``"*.attn.*"``, ``"*.weight"``) or a predicate ``(name, param) -> bool``; given
    both, a parameter must pass both. A filter that keeps nothing raises (a typo
    would otherwise initialise nothing, silently).

    Keywords: ``modules`` and ``params`` are this function's own; every other keyword
    goes to ``init_fn``. packedinit never gives its own options a name that a
    ``torch.nn.init`` function takes (``a, b, mean, std, gain, mode, nonlinearity, val,
    sparsity, groups``); ``generator`` means the same everywhere. An init function of
    your own with a ``modules``/``params`` keyword takes it through ``functools.partial``.

    Args:
        model: the module.
        init_fn: a ``torch.nn.init``-style function ``fn(tensor, *args, **kwargs)``.
        *args: forwarded to ``init_fn``.
        modules: only parameters under modules of this type (or tuple of types).
        params: only parameters whose qualified name matches (glob(s) or a predicate).
        **kwargs: forwarded to ``init_fn``; ``generator=`` is used for every draw.

    Returns:
        ``model`` itself.

    Raises:
        PackedInitError: a bad adapter/annotation or filter, a filter that keeps no
            parameter, or ``init_fn`` rejecting some parameter or block; raised before
            anything is written.

    Examples:
        >>> import torch
        >>> from torch.nn.init import kaiming_uniform_, xavier_uniform_
        >>> model = torch.nn.TransformerEncoderLayer(d_model=16, nhead=4)
        >>> _ = init_model(model, xavier_uniform_, generator=torch.Generator().manual_seed(0))
        >>> bound = (6 / (16 + 16)) ** 0.5  # per q/k/v block, not sqrt(6 / (48 + 16))
        >>> w = model.self_attn.in_proj_weight
        >>> bool(w.abs().max() <= bound), bool(w.abs().max() > (6 / 64) ** 0.5)
        (True, True)
        >>> _ = init_model(model, kaiming_uniform_, modules=torch.nn.Linear, params="linear*", nonlinearity="relu")
        >>> _ = init_model(model, xavier_uniform_, modules=torch.nn.MultiheadAttention)
    """
    if not isinstance(model, nn.Module):
        raise PackedInitError(f"init_model(model, ...) needs an nn.Module, got {type(model).__name__}.")
    if not callable(init_fn):
        raise PackedInitError(f"init_model(model, init_fn): init_fn must be callable, got {type(init_fn).__name__}.")
    entries = resolve(model)
    if modules is not None or params is not None:
        kept = select(model, entries, modules, params)
        if not any(p.dim() - (lay.batch_dims if lay is not None else 0) >= 2 for _, p, lay in kept):
            names = [n for n, p, _ in entries if p.dim() >= 2][:8]
            raise PackedInitError(
                f"init_model({type(model).__name__}, {fn_name(init_fn)}, modules={modules!r}, params={params!r}): "
                f"the filters keep no parameter with dim >= 2; nothing was written. Parameters it has: {names}."
            )
        entries = kept
    entries, swaps = through_parametrizations(model.modules(), entries, init_fn)
    _write(entries, swaps, init_fn, args, kwargs)
    return model

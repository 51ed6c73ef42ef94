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
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn

from packedinit.engine.chunks import Chunks
from packedinit.engine.lean import call
from packedinit.engine.traits import fn_name, reads_fans
from packedinit.errors import PackedInitError
from packedinit.layout import Layout
from packedinit.model.claims import own_layouts, resolve
from packedinit.model.found import end_pass, own_forward
from packedinit.model.held import through_parametrizations, write_entries
from packedinit.model.kept import keep_apply, keep_tree, tree_kept, world
from packedinit.model.keywords import FILTERS, check_keywords
from packedinit.model.steps import CHECKED, call_key, tensor_key
from packedinit.torch_compat import apply_ancestors as frames_from_apply
from packedinit.torch_compat import param_dict

__all__ = [
    "init_model",
    "select",
    "ParamFilter",
    "init_tree",
    "module_call",
    "apply_ancestors",
]


def init_tree(
    model: nn.Module,
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> None:
    """Every distinct parameter with ``dim >= 2`` of ``model``, packed ones per block; all checked first."""
    whole_tree(model, f"chunked({fn_name(init_fn)})(model)", init_fn, args, kwargs)


def whole_tree(
    model: nn.Module, idiom: str, init_fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> None:
    """:func:`init_tree` under the idiom's name; a decision kept from an equal call first (:mod:`.kept`)."""
    if tree_kept(model, init_fn, args, kwargs):
        return
    was = world()
    found = resolve(model, idiom, loud=reads_fans(init_fn))
    entries, swaps = through_parametrizations(model.modules(), found, init_fn)
    steps = write_entries(entries, swaps, init_fn, args, kwargs)
    if not swaps:  # (a parametrized tree is never kept)
        keep_tree(model, call_key(init_fn, args, kwargs), was, entries, steps)


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
    later: AbstractSet[int],
) -> None:
    own = [(n, p) for n, p in param_dict(module).items() if p is not None and p.dim() >= 2 and id(p) not in later]
    if not own:
        if not ancestors:
            end_pass(module)
        return
    was = world()
    lays = own_forward(
        ancestors[-1] if ancestors else module, own, own_layouts(module, ancestors), module, init_fn, _apply_say
    )
    prefix = type(module).__name__
    head = call_key(init_fn, args, kwargs) if not lays else None
    if head is not None:  # nothing packed: where an equal parameter passed every check of each one, just call
        mode = torch.is_inference_mode_enabled()
        hows = [CHECKED.get(tensor_key(p, head, mode) or ()) for _, p in own]
        if None not in hows:
            labels = {id(p): f"{prefix}.{n}" for n, p in own}
            for (_, p), how in zip(own, hows, strict=True):
                assert how is not None  # checked just above, before the first write
                call(how, p, init_fn, args, kwargs, labels[id(p)])
            kept = {id(p): h for (_, p), h in zip(own, hows, strict=True) if h is not None}
            keep_apply(module, ancestors, head, was, kept, labels)
            return
    entries, swaps = through_parametrizations(
        (module,), [(f"{prefix}.{n}", p, lays.get(id(p))) for n, p in own], init_fn
    )
    write_entries(entries, swaps, init_fn, args, kwargs)


def _apply_say(root: nn.Module, init_fn: object, whole: bool) -> tuple[str, bool]:
    """For :func:`~packedinit.model.found.own_forward`: the idiom's name, whether ``init_fn`` reads fans;
    ``whole``: resolve ``root`` with the forward first, which warns for the whole tree."""
    idiom, loud = f"model.apply(chunked({fn_name(init_fn)}))", reads_fans(init_fn)
    if whole:
        resolve(root, idiom, loud=loud)
    return idiom, loud


def module_call(
    module: nn.Module,
    init_fn: Callable[..., Tensor],
    chunks: Chunks | None,
    dim: int | None,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    ancestors: Sequence[nn.Module] | None,
    later: AbstractSet[int] = frozenset(),
) -> None:
    """``chunked(f)(module)``: the whole tree, or (``ancestors`` given: from ``nn.Module.apply``) its own parameters
    but those in ``later`` (a later visit of the same traversal writes them: :mod:`.visits`)."""
    if chunks is not None or dim is not None:
        raise PackedInitError(
            f"chunked({fn_name(init_fn)}, chunks={chunks!r}, dim={dim!r}) was called on a "
            f"{type(module).__name__}; chunks/dim describe one tensor. For a module, layouts come from "
            f"adapters and annotations: use chunked({fn_name(init_fn)})(module) and "
            f"packedinit.annotate(module, name=Layout(...)) for parameters no adapter knows."
        )
    if kwargs:  # (the label is built only where there is a keyword to check: apply calls this per module)
        check_keywords(f"chunked({fn_name(init_fn)})", (), init_fn, kwargs)
    if ancestors is not None:
        _init_own(module, ancestors, init_fn, args, kwargs, later)
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
    check_keywords("init_model", FILTERS, init_fn, kwargs)
    idiom = f"init_model(model, {fn_name(init_fn)})"
    if modules is not None or params is not None:
        kept = select(model, resolve(model), modules, params)
        entries = resolve(model, idiom, loud=reads_fans(init_fn), only={id(p) for _, p, _ in kept})
        kept = select(model, entries, modules, params)
        if not any(p.dim() - (lay.batch_dims if lay is not None else 0) >= 2 for _, p, lay in kept):
            names = [n for n, p, _ in entries if p.dim() >= 2][:8]
            raise PackedInitError(
                f"init_model({type(model).__name__}, {fn_name(init_fn)}, modules={modules!r}, params={params!r}): "
                f"the filters keep no parameter with dim >= 2; nothing was written. Parameters it has: {names}."
            )
        entries = kept
    else:
        whole_tree(model, idiom, init_fn, args, kwargs)
        return model
    entries, swaps = through_parametrizations(model.modules(), entries, init_fn)
    write_entries(entries, swaps, init_fn, args, kwargs)
    return model

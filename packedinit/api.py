"""The front door: ``chunked_init`` and ``chunked``, dispatching tensor vs DTensor vs module.

Plan first (pure, validated, nothing written), then apply: see :mod:`packedinit.engine.plan` and
:mod:`packedinit.engine.execute`. An unpacked tensor (``chunks=None`` or ``chunks=1``) takes the
lean path where :func:`packedinit.engine.lean.route` says so: the init function is called on the
tensor itself, exactly as a plain call would.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, Protocol, overload

from torch import Tensor, nn
from torch.nn import init as _init

from packedinit.engine.chunks import Chunks, as_layout
from packedinit.engine.lean import PLAIN_TYPES, TORCH, lean_call, route
from packedinit.engine.plan import InitSpec, Request
from packedinit.engine.run import run
from packedinit.engine.traits import base, fn_name, hashable_in
from packedinit.errors import PackedInitError, PackedInitTypeError
from packedinit.layout import Layout, fmt_shape, is_int
from packedinit.model.held import init_held
from packedinit.model.kept import apply_kept
from packedinit.model.marks import param_claim
from packedinit.model.plans import end_plan, keep_plan, plan_visit
from packedinit.model.visits import end_traversal, later_writes
from packedinit.model.walk import module_call
from packedinit.torch_compat import apply_ancestors as frames_from_apply

__all__ = ["chunked_init", "chunked", "ChunkedInit"]

P = ParamSpec("P")

#: torch.nn.init functions that need fans, so a matrix: torch refuses them on a 1-D tensor.
_MATRIX_FNS: frozenset[Callable[..., Tensor]] = frozenset(
    {
        _init.xavier_uniform_,
        _init.xavier_normal_,
        _init.kaiming_uniform_,
        _init.kaiming_normal_,
        _init.orthogonal_,
        _init.eye_,
        _init.dirac_,
        _init.sparse_,
    }
)


def _stacked_bias_left(target: Tensor, layout: Layout, init_fn: object) -> bool:
    """An annotated stacked bias (``(n_experts, 2I)``: 1-D blocks) handed to a matrix-only torch function.

    The plain loop ``for p in model.parameters(): if p.dim() > 1: f(p)`` reaches it only
    because the expert dim makes it 2-D; run on the separate per-expert biases, the same
    loop skips every one of them. So it is left as it is, as whole-model init leaves it.
    """
    return (
        target.dim() >= 2
        and target.dim() - layout.batch_dims < 2
        and callable(init_fn)
        and hashable_in(base(init_fn), _MATRIX_FNS)
    )


def _refuse_held(tensor: Tensor, init_fn: object) -> None:
    """Raise when ``tensor`` (given explicit chunks) is an original of an annotated packed parametrized tensor.

    Its blocks are meant for the tensor the module computes (``g * v / ||v||`` for
    ``weight_norm``): writing the original per block would leave the others (``g``) stale.
    """
    if not isinstance(tensor, nn.Parameter):
        return
    holder = param_claim(tensor)[1]
    if holder is None:
        return
    kinds = ", ".join(type(p).__name__ for p in holder.children())
    name = getattr(init_fn, "__name__", "f")
    raise PackedInitError(
        f"the tensor of shape {tuple(tensor.shape)} is an original of a packed parametrized tensor ({kinds}); "
        f"initialising it per block with explicit chunks would leave the parametrized weight (and its other "
        f"originals) wrong. Nothing was written. Fix: init the module instead: packedinit.chunked({name})(module), "
        f"or call packedinit.chunked({name})(original) without chunks (its annotation gives the layout)."
    )


def _blocks(layout: Layout | None, ndim: int) -> tuple[object, ...]:
    """What decides the blocks (names aside); one block for ``None`` and one-part layouts."""
    if layout is None or (layout.num_parts == 1 and layout.groups == 1 and layout.batch_dims == 0):
        return ("one block",)
    return (layout.normalized_dim(ndim), layout.sizes, layout.groups, layout.transposed, layout.batch_dims)


def _refuse_contradiction(tensor: Tensor, chunks: Chunks | None, dim: int | None, init_fn: object) -> None:
    """Raise before any write when explicit ``chunks``/``dim`` give other blocks than the layout ``tensor`` is known by.

    Known: an annotation (:func:`packedinit.annotate`, which also records an adapter's layout)
    on the module holding the Parameter ``tensor`` now. Chunks that give the same blocks
    (block names aside) pass, as does an explicit one block (``chunks=1``: the whole tensor, on
    purpose) and anything on a tensor with no known packed layout.

    Raises:
        PackedInitError: the explicit blocks differ from the known ones; the message names
            both and how to override deliberately (annotate the layout you mean).
    """
    if not isinstance(tensor, nn.Parameter):
        return
    known = param_claim(tensor)[0]
    if known is None or _blocks(known, tensor.dim()) == ("one block",):
        return
    given = as_layout(chunks, dim, tuple(tensor.shape))
    if _blocks(given, tensor.dim()) in (_blocks(known, tensor.dim()), ("one block",)):
        return  # the known blocks, or an explicit one block (chunks=1): the whole tensor on purpose
    name = getattr(init_fn, "__name__", "f")
    raise PackedInitError(
        f"parameter of shape {fmt_shape(tensor.shape)} is known to be packed as {known!r} (annotated), but the "
        f"explicit chunks give {given!r}: other blocks. Nothing was written. Fix: drop the chunks to init per "
        f"known block (packedinit.chunked({name})(param)); to use other blocks on purpose, annotate them first "
        f"(packedinit.annotate(module, <name>=Layout(...))), or pass the tensor's .data, which carries no layout."
    )


_CHUNKED_INIT_SIG = "chunked_init(tensor, chunks=None, dim=None, init_fn=None, *args, **kwargs)"
_CHUNKED_SIG = "chunked(init_fn, chunks=None, dim=None)(tensor_or_module, *args, **kwargs)"


def _refuse_chunked_order(fn: object, *rest: object) -> None:
    """``chunked_init(f, w, 3, 0)``: the arguments in ``chunked``'s order; name both signatures."""
    got = ", ".join([fn_name(fn), *("tensor" if isinstance(r, Tensor) else repr(r) for r in rest if r is not None)])
    raise PackedInitTypeError(
        f"chunked_init({got}): the first argument is the function, as in chunked; chunked_init takes the tensor "
        f"first. Signatures: {_CHUNKED_INIT_SIG}; {_CHUNKED_SIG}. Nothing was written. Fix: "
        f"chunked_init(tensor, chunks, dim, {fn_name(fn)}) or chunked({fn_name(fn)}, chunks, dim)(tensor)."
    )


def chunked_init(
    tensor: Tensor,
    chunks: Chunks | None = None,
    dim: int | None = None,
    init_fn: InitSpec | None = None,
    *args: Any,
    **init_kwargs: Any,
) -> Tensor:
    r"""Fill a packed tensor in place, running ``init_fn`` once per logical block.

    Each block is handed to ``init_fn`` as a tensor of its own logical shape
    ``(out, in, *rest)``, so fan-dependent functions (``xavier_*``, ``kaiming_*``,
    ``orthogonal_``, ``eye_``, ``dirac_``, ``sparse_``) compute the fans of the
    block, not of the packed tensor. Blocks are filled in block order from one
    RNG stream: on CPU the result is bit-identical to initialising the separate
    logical tensors one after another with the same seed, then packing them. On
    transposed storage a function whose values are i.i.d. per element given the
    fans (``uniform_``, ``normal_``, ``trunc_normal_``, ``xavier_*``, ``kaiming_*``,
    ``constant_``...) draws each block in its stored ``(in, out)`` order with the
    block's own fans: the separate tensors are then in their stored orientation.

    For ``nn.MultiheadAttention.in_proj_weight`` of shape :math:`(3E, E)`,
    ``xavier_uniform_`` on the packed tensor draws from
    :math:`\mathcal{U}(-a, a)` with :math:`a = \sqrt{6 / (3E + E)}`; per block it is
    :math:`a = \sqrt{6 / (E + E)}`, :math:`\sqrt{2}` times larger.

    Args:
        tensor: the packed tensor (a parameter, any device; meta tensors are
            validated and left alone).
        chunks: a number of equal blocks, a list of block sizes, or a
            :class:`~packedinit.Layout`. ``None`` (or ``1``) means one block: the
            call is then exactly ``init_fn(tensor, *args, **init_kwargs)``.
        dim: the packed dim for int/list chunks (default 0); ``None`` with a Layout.
        init_fn: the init function; or one per block (``None`` skips a block); or a
            mapping from block name (or part index) to function, leaving the others
            untouched.
        *args: positional arguments forwarded to ``init_fn`` after the tensor.
        **init_kwargs: keyword arguments forwarded to ``init_fn``. ``generator=``
            is passed to every function that draws; the global RNG is then untouched.

    Returns:
        ``tensor`` itself.

    Raises:
        PackedInitError: bad chunks/layout/functions/dtype, or an init function that
            rejects a block's shape or its arguments; raised before anything is written.

    Examples:
        >>> import torch
        >>> from torch.nn.init import xavier_uniform_, zeros_, ones_
        >>> mha = torch.nn.MultiheadAttention(64, 8)
        >>> w = chunked_init(mha.in_proj_weight, 3, 0, xavier_uniform_)
        >>> bool(w.abs().max() <= (6 / (64 + 64)) ** 0.5)
        True
        >>> H = 4
        >>> b = torch.empty(4 * H)
        >>> _ = chunked_init(b, Layout(0, [H] * 4, names=("i", "f", "g", "o")), init_fn={"f": ones_, "i": zeros_})
        >>> b[:2 * H].tolist()
        [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
        >>> chunked_init(torch.empty(10, 4), 3, 0, xavier_uniform_)
        Traceback (most recent call last):
        ...
        packedinit.errors.PackedInitError: tensor of shape (10, 4): dim 0 has length 10, which 3 equal chunks ...
    """
    if not isinstance(tensor, Tensor) and callable(tensor):
        _refuse_chunked_order(tensor, chunks, dim, init_fn)
    if chunks is None and dim is None and isinstance(tensor, nn.Parameter):
        chunks, holder = param_claim(tensor)  # annotated by packedinit.annotate: per block
        if chunks is not None and _stacked_bias_left(tensor, chunks, init_fn):
            return tensor
        if holder is not None and init_held(holder, tensor, init_fn, args, init_kwargs):  # type: ignore[arg-type]
            return tensor  # an original of a packed parametrized tensor: written through the parametrization
    elif chunks is not None or dim is not None:
        _refuse_held(tensor, init_fn)
        _refuse_contradiction(tensor, chunks, dim, init_fn)  # before any write: other blocks than the known ones
    plain = chunks is None and dim is None and type(tensor) in PLAIN_TYPES
    if plain and route(tensor, init_fn, args, init_kwargs, first=True) == TORCH:
        lean_call(tensor, init_fn, args, init_kwargs)  # type: ignore[arg-type]  # route: a torch.nn.init function
        return tensor
    run(Request(tensor, chunks, dim, init_fn, args, init_kwargs))
    return tensor


class ChunkedInit(Protocol[P]):
    """What :func:`chunked` returns: the init function's own signature, for tensors and modules."""

    @overload
    def __call__(self, tensor: Tensor, /, *args: P.args, **kwargs: P.kwargs) -> Tensor: ...

    @overload
    def __call__(self, module: nn.Module, /, *args: P.args, **kwargs: P.kwargs) -> None: ...

    def __call__(self, target: Tensor | nn.Module, /, *args: P.args, **kwargs: P.kwargs) -> Tensor | None: ...


def _check_chunks_arg(chunks: Chunks | None, dim: int | None) -> Chunks | None:
    """Type checks of ``chunked``'s arguments (shape checks happen per call); lists become tuples."""
    if dim is not None and not is_int(dim):
        raise PackedInitError(f"chunked(dim={dim!r}): dim must be an int (or None).")
    if chunks is None or isinstance(chunks, Layout):
        return chunks
    if is_int(chunks):
        if operator.index(chunks) < 1:
            raise PackedInitError(f"chunked(chunks={chunks!r}): chunks must be a positive number of blocks.")
        return operator.index(chunks)
    if isinstance(chunks, Sequence) and not isinstance(chunks, (str, bytes)):
        sizes = tuple(chunks)
        if not sizes or not all(is_int(s) and operator.index(s) > 0 for s in sizes):
            raise PackedInitError(f"chunked(chunks={chunks!r}): sizes must be a non-empty list of positive ints.")
        return sizes
    raise PackedInitError(
        f"chunked(chunks={chunks!r}): chunks must be an int, a sequence of sizes or a Layout, "
        f"got {type(chunks).__name__}."
    )


def chunked(
    init_fn: Callable[Concatenate[Tensor, P], Tensor],
    chunks: Chunks | None = None,
    dim: int | None = None,
) -> ChunkedInit[P]:
    r"""Wrap an init function so that it initialises per logical block.

    The result has ``init_fn``'s own signature (and name and docstring). Called on
    a tensor it runs :func:`chunked_init` with ``chunks``/``dim``; with neither it
    treats the tensor as one block and behaves exactly as ``init_fn``. Called on an
    ``nn.Module`` it initialises the module's parameters, packed ones per block
    (see :func:`packedinit.init_model`).

    Args:
        init_fn: any ``fn(tensor, *args, **kwargs) -> tensor`` init function.
        chunks: a number of equal blocks, a list of sizes, or a Layout.
        dim: the packed dim for int/list chunks (default 0).

    Returns:
        A function with ``init_fn``'s signature that fills a tensor per block and
        returns it (or initialises a module's parameters and returns ``None``).

    Raises:
        PackedInitError: ``init_fn`` is not callable or ``chunks``/``dim`` have the
            wrong type; shape errors are raised when the result is called.

    Examples:
        >>> import torch
        >>> from torch.nn.init import xavier_uniform_
        >>> init = chunked(xavier_uniform_, 3)
        >>> w = init(torch.empty(24, 8), gain=2.0)
        >>> w.shape
        torch.Size([24, 8])
        >>> init.__name__
        'xavier_uniform_'
    """
    if isinstance(init_fn, Tensor):
        raise PackedInitTypeError(
            f"chunked(tensor, ...): chunked takes the init function first and returns a function to call on the "
            f"tensor; chunked_init takes the tensor first. Signatures: {_CHUNKED_SIG}; {_CHUNKED_INIT_SIG}. "
            f"Fix: chunked(f, chunks, dim)(tensor) or chunked_init(tensor, chunks, dim, f)."
        )
    if not callable(init_fn):
        raise PackedInitError(f"chunked(init_fn=...) needs a function, got {type(init_fn).__name__}.")
    chunks = _check_chunks_arg(chunks, dim)
    unset = chunks is None and dim is None
    tensor_types = PLAIN_TYPES

    @functools.wraps(init_fn)
    def wrapper(target: Any, /, *args: Any, **kwargs: Any) -> Any:
        if isinstance(target, nn.Module):  # first: model.apply(chunked(f)) comes here once per submodule
            # `model.apply(chunked(f))` calls us once per submodule: then each call owns only
            # the module's own parameters (see walk.apply_ancestors); a direct call owns the whole tree.
            ancestors = frames_from_apply(target)
            if ancestors is None or not unset:
                module_call(target, init_fn, chunks, dim, args, kwargs, ancestors=ancestors)
                return None
            try:  # a shared parameter is written by the last visit of the traversal that holds it (.visits)
                if plan_visit(target, ancestors, init_fn, args, kwargs):  # the whole traversal checked at once
                    return None
                later = later_writes(target, ancestors)
                if not apply_kept(target, ancestors, init_fn, args, kwargs, later):
                    module_call(target, init_fn, chunks, dim, args, kwargs, ancestors=ancestors, later=later)
                if not ancestors:
                    keep_plan(target, init_fn, args, kwargs)
            except BaseException:
                end_traversal()
                end_plan()
                raise
            return None
        if unset and isinstance(target, nn.Parameter):
            layout, holder = param_claim(target)  # annotated by packedinit.annotate: per block
            if layout is not None and _stacked_bias_left(target, layout, init_fn):
                return target
            if holder is not None and init_held(holder, target, init_fn, args, kwargs):
                return target  # an original of a packed parametrized tensor: written through the parametrization
            if layout is not None:
                run(Request(target, layout, None, init_fn, args, kwargs))
                return target
        lean = unset and type(target) in tensor_types and route(target, init_fn, args, kwargs, first=True) == TORCH
        if lean:  # the lean path: init_fn on the tensor as it is
            lean_call(target, init_fn, args, kwargs)
            return target
        if not unset:
            _refuse_held(target, init_fn)
            _refuse_contradiction(target, chunks, dim, init_fn)
        run(Request(target, chunks, dim, init_fn, args, kwargs))
        return target

    return wrapper

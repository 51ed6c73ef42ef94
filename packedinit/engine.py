"""The engine: run any init function once per logical block of a packed tensor.

Plan first (pure, validated, nothing written), then apply. A block that is a
contiguous view of the storage is filled in place; any other block is filled in
a contiguous scratch buffer (one flat buffer reused for every block) and copied
back once, so it draws exactly what a separate tensor of the block's shape would.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeAlias, overload

import torch
from torch import Tensor, nn

from .errors import PackedInitError
from .layout import Chunks, Layout, LogicalBlock, _fmt_shape, as_layout

__all__ = ["chunked_init", "chunked", "InitFn", "InitSpec", "ChunkedInit"]

P = ParamSpec("P")

#: An init function: ``fn(tensor, *args, **kwargs) -> tensor``, filling ``tensor`` in place.
InitFn: TypeAlias = Callable[..., Tensor]
#: One init fn for every block, one per part (``None`` skips a part), or a mapping by part name/index.
InitSpec: TypeAlias = InitFn | Sequence[InitFn | None] | Mapping[str | int, InitFn]

_init = torch.nn.init
#: torch.nn.init functions that draw random numbers (they need a floating-point tensor).
_RANDOM_FNS: frozenset[Callable[..., Tensor]] = frozenset(
    {
        _init.uniform_,
        _init.normal_,
        _init.trunc_normal_,
        _init.xavier_uniform_,
        _init.xavier_normal_,
        _init.kaiming_uniform_,
        _init.kaiming_normal_,
        _init.orthogonal_,
        _init.sparse_,
    }
)
#: torch.nn.init functions that draw nothing.
_DETERMINISTIC_FNS: frozenset[Callable[..., Tensor]] = frozenset(
    {_init.constant_, _init.ones_, _init.zeros_, _init.eye_, _init.dirac_}
)
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_APPLY_CODE = nn.Module.apply.__code__


def _sparse_(
    tensor: Tensor,
    sparsity: float,
    std: float = 0.01,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``torch.nn.init.sparse_`` whose zero pattern also comes from ``generator``.

    Without a generator it makes exactly torch's draws (bit-identical); torch's own
    ``sparse_`` ignores ``generator`` for the pattern and calls ``randperm`` on the
    global RNG, which breaks the "a generator leaves the global RNG untouched" contract.
    """
    if tensor.ndimension() != 2:
        raise ValueError("Only tensors with 2 dimensions are supported")
    if tensor.is_meta:
        return tensor
    rows, cols = tensor.shape
    num_zeros = math.ceil(sparsity * rows)
    with torch.no_grad():
        tensor.normal_(0, std, generator=generator)
        for col_idx in range(cols):
            row_indices = torch.randperm(rows, generator=generator)
            tensor[row_indices[:num_zeros], col_idx] = 0
    return tensor


_SUBSTITUTES: dict[Callable[..., Tensor], Callable[..., Tensor]] = {_init.sparse_: _sparse_}


@functools.lru_cache(maxsize=512)
def _accepts_generator(fn: Callable[..., Tensor]) -> bool | None:
    """True/False from the signature; None when it cannot be read."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return any(p.name == "generator" or p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


def _fn_name(fn: object) -> str:
    if isinstance(fn, functools.partial):
        return f"partial({_fn_name(fn.func)})"
    mod = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"torch.nn.init.{name}" if mod == "torch.nn.init" else str(name)


def _is_dtensor(t: Tensor) -> bool:
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


@dataclass(frozen=True)
class Plan:
    """A validated plan: which function fills which block, with which arguments.

    Built by :func:`make_plan` before anything is written; consumed by the local
    engine and by :mod:`packedinit.distributed`.
    """

    layout: Layout
    blocks: tuple[LogicalBlock, ...]
    fns: tuple[Callable[..., Tensor] | None, ...]  # one per block (None: skip)
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    generator: torch.Generator | None
    shape: torch.Size
    dtype: torch.dtype
    param: str | None

    def where(self) -> str:
        who = f"parameter {self.param!r}" if self.param else "tensor"
        return f"{who} of shape {_fmt_shape(self.shape)} with {self.layout!r}"

    def compute_dtype(self, fn: Callable[..., Tensor]) -> torch.dtype:
        """The dtype a block is computed in: float32 for orthogonal_ on fp16/bf16."""
        if fn is _init.orthogonal_ and self.dtype in _LOW_PRECISION:
            return torch.float32
        return self.dtype

    def call(self, fn: Callable[..., Tensor], block_tensor: Tensor) -> Tensor:
        """Run ``fn`` on a tensor of a block's logical shape; return what holds the values."""
        run = _SUBSTITUTES.get(fn, fn)
        kwargs = dict(self.kwargs)
        if self.generator is not None and _accepts_generator(run) is not False:
            kwargs["generator"] = self.generator
        out = run(block_tensor, *self.args, **kwargs)
        return out if isinstance(out, Tensor) and out.shape == block_tensor.shape else block_tensor

    def fill_logical(self, block: LogicalBlock, out: Tensor) -> None:
        """Fill ``out`` (contiguous, ``block.shape``, any dtype) with the block's init."""
        fn = self.fns[block.index]
        if fn is None or block.numel == 0:
            return
        cdt = self.compute_dtype(fn)
        if cdt != out.dtype:
            tmp = torch.empty(block.shape, dtype=cdt, device=out.device)
            out.copy_(self.call(fn, tmp))
            return
        res = self.call(fn, out)
        if res is not out:
            out.copy_(res)


def _resolve_fns(
    init_fn: InitSpec | None,
    layout: Layout,
    blocks: tuple[LogicalBlock, ...],
    where: str,
) -> tuple[Callable[..., Tensor] | None, ...]:
    if init_fn is None:
        raise PackedInitError(f"{where}: no init_fn given; pass e.g. init_fn=torch.nn.init.xavier_uniform_.")
    per_part: list[Callable[..., Tensor] | None]
    if isinstance(init_fn, Mapping):
        per_part = [None] * layout.num_parts
        for key, item in init_fn.items():
            if isinstance(key, str) and (layout.names is None or key not in layout.names):
                known = list(layout.names) if layout.names else "none: give the Layout names=(...)"
                raise PackedInitError(
                    f"{where}: init_fn names block {key!r}, which the layout does not have; known names: {known}."
                )
            if not isinstance(key, str) and (
                not isinstance(key, int)
                or isinstance(key, bool)
                or not -layout.num_parts <= key < layout.num_parts
            ):
                raise PackedInitError(
                    f"{where}: init_fn key {key!r} is neither a block name nor a part index "
                    f"in 0..{layout.num_parts - 1}."
                )
            j = layout.part_index(key)
            if per_part[j] is not None:
                raise PackedInitError(f"{where}: init_fn gives part {j} twice (as {key!r}); give each block once.")
            if not callable(item):
                raise PackedInitError(f"{where}: init_fn[{key!r}] = {item!r} is not callable.")
            per_part[j] = item
    elif callable(init_fn):
        per_part = [init_fn] * layout.num_parts
    elif isinstance(init_fn, Sequence) and not isinstance(init_fn, (str, bytes)):
        per_part = list(init_fn)
        if len(per_part) != layout.num_parts:
            raise PackedInitError(
                f"{where}: {len(per_part)} init functions for {layout.num_parts} blocks; "
                f"give one per block (None leaves a block untouched)."
            )
        for k, fn in enumerate(per_part):
            if fn is not None and not callable(fn):
                raise PackedInitError(f"{where}: init_fn[{k}] = {fn!r} is not callable.")
    else:
        raise PackedInitError(
            f"{where}: init_fn must be a function, a list of functions (one per block) or a mapping "
            f"by block name, got {type(init_fn).__name__}."
        )
    return tuple(per_part[b.part] for b in blocks)


def make_plan(
    tensor: Tensor,
    chunks: Chunks | None,
    dim: int | None,
    init_fn: InitSpec | None,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    param: str | None = None,
) -> Plan | None:
    """Validate everything and build a :class:`Plan`; ``None`` when nothing is to be written.

    Runs every check (layout against shape, functions, dtypes, generator) and a dry
    run of every distinct (function, block shape) on meta tensors, so that an init
    function that rejects a block does so before the first write.
    """
    if not isinstance(tensor, Tensor):
        raise PackedInitError(f"expected a torch.Tensor (or nn.Module with chunked), got {type(tensor).__name__}.")
    shape = tensor.shape
    layout = as_layout(chunks, dim, shape, param=param)
    if layout is None:
        if init_fn is None:
            raise PackedInitError(f"no init_fn given for tensor of shape {_fmt_shape(shape)}.")
        return None
    blocks = layout.blocks(shape, param=param)
    kwargs = dict(kwargs)
    generator = kwargs.pop("generator", None)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise PackedInitError(f"generator must be a torch.Generator, got {type(generator).__name__}.")
    plan = Plan(layout, blocks, (), tuple(args), kwargs, generator, shape, tensor.dtype, param)
    where = plan.where()
    fns = _resolve_fns(init_fn, layout, blocks, where)
    plan = Plan(layout, blocks, fns, tuple(args), kwargs, generator, shape, tensor.dtype, param)
    distinct = {fn for fn in fns if fn is not None}
    for fn in distinct:
        if fn in _RANDOM_FNS and not tensor.dtype.is_floating_point:
            raise PackedInitError(
                f"{where}: {_fn_name(fn)} draws random floats but the tensor is {tensor.dtype}; "
                f"init a floating-point tensor (or use constant_/zeros_/ones_)."
            )
        if generator is not None and fn not in _DETERMINISTIC_FNS and _accepts_generator(fn) is False:
            raise PackedInitError(
                f"{where}: generator= was given but {_fn_name(fn)} takes no generator and would draw from "
                f"the global RNG; give it a `generator` parameter or drop generator=."
            )
    _dry_run(plan, tensor.is_meta or len(blocks) > 1)
    return plan


def _dry_run(plan: Plan, needed: bool) -> None:
    """Call each distinct (fn, block shape) on meta tensors; turn rejections into PackedInitError.

    Costs no memory and draws nothing: the global RNG and the caller's generator are
    restored afterwards, and warnings from the dry run are not shown.
    """
    if not needed:
        return
    seen: set[tuple[object, torch.Size]] = set()
    cpu_state = torch.get_rng_state()
    gen_state = plan.generator.get_state() if plan.generator is not None else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for block in plan.blocks:
                fn = plan.fns[block.index]
                if fn is None or block.numel == 0 or (fn, block.shape) in seen:
                    continue
                seen.add((fn, block.shape))
                meta = torch.empty(block.shape, dtype=plan.compute_dtype(fn), device="meta")
                try:
                    plan.call(fn, meta)
                except (ValueError, TypeError, IndexError) as e:
                    raise _rejected(plan, block, fn, e) from e
                except (NotImplementedError, RuntimeError):
                    # The function cannot run on meta tensors (e.g. it reads values); the
                    # real run still checks, but a later block's failure could not be undone.
                    continue
    finally:
        torch.set_rng_state(cpu_state)
        if plan.generator is not None and gen_state is not None:
            plan.generator.set_state(gen_state)


def _rejected(plan: Plan, block: LogicalBlock, fn: Callable[..., Tensor], e: BaseException) -> PackedInitError:
    if isinstance(e, PackedInitError):
        return e
    hint = ""
    if len(block.shape) < 2 and "fewer than 2 dimensions" in str(e):
        hint = " A 1-D block (a bias) has no fan_in/fan_out: use uniform_/normal_/zeros_ for biases."
    return PackedInitError(
        f"{plan.where()}: {_fn_name(fn)} rejected block {block.label!r} of logical shape "
        f"{_fmt_shape(block.shape)}: {type(e).__name__}: {e}.{hint} Nothing was written; "
        f"pick an init function that accepts this block shape (or per-block functions)."
    )


class _Scratch:
    """One flat contiguous buffer per (dtype, device), grown on demand and reused."""

    __slots__ = ("_bufs",)

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def get(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
        n = math.prod(shape)
        key = (dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:n].view(shape)


def execute(plan: Plan, tensor: Tensor, scratch: _Scratch | None = None) -> None:
    """Write every block of ``plan`` into ``tensor`` (a plain, non-meta tensor)."""
    scratch = scratch or _Scratch()
    layout, ndim = plan.layout, tensor.dim()
    single = len(plan.blocks) == 1
    for block in plan.blocks:
        fn = plan.fns[block.index]
        if fn is None or block.numel == 0:
            continue
        cdt = plan.compute_dtype(fn)
        lv = layout.logical_view(tensor, block)
        if lv is not None and cdt == tensor.dtype and lv.is_contiguous():
            try:
                res = plan.call(fn, lv)
            except (ValueError, TypeError, IndexError) as e:
                if single:  # nothing was written yet: same contract as a multi-block dry run
                    raise _rejected(plan, block, fn, e) from e
                raise
            if res is not lv:
                lv.copy_(res)
            continue
        buf = scratch.get(block.shape, cdt, tensor.device)
        try:
            res = plan.call(fn, buf)
        except (ValueError, TypeError, IndexError) as e:
            if single:
                raise _rejected(plan, block, fn, e) from e
            raise
        layout.storage_view(tensor, block).copy_(layout.to_storage(res, block, ndim))


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
    logical tensors one after another with the same seed, then packing them.

    For ``nn.MultiheadAttention.in_proj_weight`` of shape :math:`(3E, E)`,
    ``xavier_uniform_`` on the packed tensor draws from
    :math:`\mathcal{U}(-a, a)` with :math:`a = \sqrt{6 / (3E + E)}`; per block it is
    :math:`a = \sqrt{6 / (E + E)}`, :math:`\sqrt{2}` times larger.

    Args:
        tensor: the packed tensor (a parameter, any device; meta tensors are
            validated and left alone).
        chunks: a number of equal blocks, a list of block sizes, or a
            :class:`~packedinit.Layout`. ``None`` means one block.
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
            rejects a block's shape; raised before anything is written.

    Examples:
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
    """
    _run(tensor, chunks, dim, init_fn, args, init_kwargs)
    return tensor


def _run(
    tensor: Tensor,
    chunks: Chunks | None,
    dim: int | None,
    init_fn: InitSpec | None,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    param: str | None = None,
    scratch: _Scratch | None = None,
) -> None:
    if isinstance(tensor, Tensor) and _is_dtensor(tensor):
        from .distributed import init_dtensor

        init_dtensor(tensor, chunks, dim, init_fn, args, kwargs, param=param)
        return
    plan = make_plan(tensor, chunks, dim, init_fn, args, kwargs, param=param)
    if plan is None or tensor.is_meta or tensor.numel() == 0:
        return
    with torch.no_grad():
        execute(plan, tensor, scratch)


class ChunkedInit(Protocol[P]):
    """What :func:`chunked` returns: the init function's own signature, for tensors and modules."""

    @overload
    def __call__(self, tensor: Tensor, /, *args: P.args, **kwargs: P.kwargs) -> Tensor: ...

    @overload
    def __call__(self, module: nn.Module, /, *args: P.args, **kwargs: P.kwargs) -> None: ...

    def __call__(self, target: Tensor | nn.Module, /, *args: P.args, **kwargs: P.kwargs) -> Tensor | None: ...


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

    Examples:
        >>> from torch.nn.init import xavier_uniform_
        >>> init = chunked(xavier_uniform_, 3)
        >>> w = init(torch.empty(24, 8), gain=2.0)
        >>> w.shape
        torch.Size([24, 8])
    """
    if not callable(init_fn):
        raise PackedInitError(f"chunked(init_fn=...) needs a function, got {type(init_fn).__name__}.")

    @functools.wraps(init_fn)
    def wrapper(target: Any, /, *args: Any, **kwargs: Any) -> Any:
        if isinstance(target, nn.Module):
            from . import walk

            # `model.apply(chunked(f))` calls us once per submodule: then each call owns only
            # the module's own parameters (see walk); a direct call owns the whole tree.
            from_apply = sys._getframe(1).f_code is _APPLY_CODE
            walk._module_call(target, init_fn, chunks, dim, args, kwargs, from_apply=from_apply)
            return None
        _run(target, chunks, dim, init_fn, args, kwargs)
        return target

    return wrapper

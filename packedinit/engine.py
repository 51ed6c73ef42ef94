"""The engine: run any init function once per logical block of a packed tensor.

Plan first (pure, validated, nothing written), then apply. A block that is a
contiguous view of the storage is filled in place; any other block is filled in
a contiguous scratch buffer (one flat buffer reused for every block) and copied
back once, so it draws exactly what a separate tensor of the block's shape would.

An unpacked tensor (``chunks=None`` or ``chunks=1``) takes a lean path: the init
function is called on the tensor itself, exactly as a plain call would, with
errors turned into :class:`PackedInitError`.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import sys
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, NamedTuple, ParamSpec, Protocol, TypeAlias, overload

import torch
from torch import Tensor, nn

from .errors import PackedInitError
from .layout import Chunks, Layout, LogicalBlock, as_layout, fmt_shape, is_int

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
_TORCH_FNS = _RANDOM_FNS | _DETERMINISTIC_FNS
#: Functions whose only draw is one ``uniform_`` and whose result only needs fans of the shape:
#: on CPU ``uniform_`` fills in memory order, so on a strided view whose memory order is its
#: logical (row-major) order it draws exactly what a contiguous tensor of that shape draws.
_UNIFORM_FNS: frozenset[Callable[..., Tensor]] = frozenset(
    {_init.uniform_, _init.xavier_uniform_, _init.kaiming_uniform_, _init.constant_, _init.ones_, _init.zeros_}
)
#: Random torch.nn.init functions that fail on complex tensors (and may write before failing).
_REAL_ONLY: frozenset[Callable[..., Tensor]] = frozenset({_init.trunc_normal_, _init.orthogonal_})
#: torch.nn.init functions the lean path may hand ``generator=`` to unchanged.
_GENERATOR_OK = _RANDOM_FNS - {_init.sparse_}
#: The lean path: torch.nn.init functions called on an unpacked tensor as they are.
#: fn -> (skip zero-element tensors first (kaiming_ warns on them), may take generator=).
_LEAN: dict[Callable[..., Tensor], tuple[bool, bool]] = {
    _init.uniform_: (False, True),
    _init.normal_: (False, True),
    _init.xavier_uniform_: (False, True),  # (0, 0) divides by zero: ignored after the fact
    _init.xavier_normal_: (False, True),
    _init.kaiming_uniform_: (True, True),
    _init.kaiming_normal_: (True, True),
    _init.constant_: (False, False),
    _init.ones_: (False, False),
    _init.zeros_: (False, False),
    _init.eye_: (False, False),
    _init.dirac_: (False, False),
}
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_APPLY_CODE = nn.Module.apply.__code__
_PLAIN_TYPES = (Tensor, nn.Parameter)
#: Exceptions an init function raises for a shape or an argument it does not accept.
_REJECTIONS = (ValueError, TypeError, LookupError, ArithmeticError)


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
            if generator is None:
                row_indices = torch.randperm(rows)  # exactly torch's draw
            else:
                row_indices = torch.randperm(rows, generator=generator, device=generator.device)
            tensor[row_indices[:num_zeros], col_idx] = 0
    return tensor


def _hashable_in(fn: object, group: frozenset[Callable[..., Tensor]]) -> bool:
    try:
        return fn in group
    except TypeError:  # an unhashable callable object
        return False


def _base(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """The function under any ``functools.partial`` layers."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _substitute(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` with torch's ``sparse_`` (also inside partials) replaced by the generator-driven one."""
    if fn is _init.sparse_:
        return _sparse_
    if isinstance(fn, functools.partial):
        inner = _substitute(fn.func)
        if inner is not fn.func:
            return functools.partial(inner, *fn.args, **fn.keywords)
    return fn


def _accepts_generator(fn: Callable[..., Tensor]) -> bool | None:
    """True/False from the signature; None when it cannot be read."""
    try:
        return _accepts_generator_cached(fn)
    except TypeError:  # unhashable callable
        return _read_accepts_generator(fn)


def _read_accepts_generator(fn: Callable[..., Tensor]) -> bool | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return any(p.name == "generator" or p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


_accepts_generator_cached = functools.lru_cache(maxsize=512)(_read_accepts_generator)


def _fn_name(fn: object) -> str:
    if isinstance(fn, functools.partial):
        return f"partial({_fn_name(fn.func)})"
    mod = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"torch.nn.init.{name}" if mod == "torch.nn.init" else str(name)


def _is_dtensor(t: Tensor) -> bool:
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def _who(param: str | None) -> str:
    return f"parameter {param!r}" if param else "tensor"


class _Context:
    """``"parameter 'w' of shape (...) with Layout(...)"``, built only when an error message needs it."""

    __slots__ = ("layout", "param", "shape")

    def __init__(self, param: str | None, shape: Sequence[int], layout: Layout) -> None:
        self.param, self.shape, self.layout = param, shape, layout

    def __str__(self) -> str:
        return f"{_who(self.param)} of shape {fmt_shape(self.shape)} with {self.layout!r}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


@dataclass(frozen=True)
class Plan:
    """A validated plan: which function fills which block, with which arguments.

    Built by :func:`make_plan` before anything is written; consumed by the local
    engine and by :mod:`packedinit.distributed`.

    ``verified`` is False when some init function could not be tried on meta
    tensors (it reads values, or does not support meta); :func:`execute` then keeps
    a copy of the tensor so that a failing block can be undone.
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
    verified: bool = True
    _prepared: dict[int, tuple[Callable[..., Tensor], dict[str, Any]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def where(self) -> str:
        """``"parameter 'w' of shape (...) with Layout(...)"``, for messages."""
        return f"{_who(self.param)} of shape {fmt_shape(self.shape)} with {self.layout!r}"

    def compute_dtype(self, fn: Callable[..., Tensor]) -> torch.dtype:
        """The dtype a block is computed in: float32 for orthogonal_ on fp16/bf16."""
        if self.dtype in _LOW_PRECISION and _base(fn) is _init.orthogonal_:
            return torch.float32
        return self.dtype

    def _prepare(self, fn: Callable[..., Tensor]) -> tuple[Callable[..., Tensor], dict[str, Any]]:
        got = self._prepared.get(id(fn))
        if got is None:
            run = _substitute(fn)
            kwargs = dict(self.kwargs)
            if self.generator is not None and _accepts_generator(run) is not False:
                kwargs["generator"] = self.generator
            got = (run, kwargs)
            self._prepared[id(fn)] = got
        return got

    def call(self, fn: Callable[..., Tensor], block_tensor: Tensor) -> Tensor:
        """Run ``fn`` on a tensor of a block's logical shape; return what holds the values.

        ``fn`` may fill ``block_tensor`` in place (and return it or ``None``) or return
        a new tensor of the block's shape; any other shape raises ``ValueError``.
        """
        run, kwargs = self._prepare(fn)
        out = run(block_tensor, *self.args, **kwargs)
        if out is block_tensor or not isinstance(out, Tensor):
            return block_tensor
        if out.shape != block_tensor.shape:
            raise ValueError(
                f"{_fn_name(fn)} returned a tensor of shape {fmt_shape(out.shape)} for a block of shape "
                f"{fmt_shape(block_tensor.shape)}; an init function must fill its argument in place or "
                f"return a tensor of the same shape"
            )
        return out

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
            if not isinstance(key, str) and (not is_int(key) or not -layout.num_parts <= int(key) < layout.num_parts):
                raise PackedInitError(
                    f"{where}: init_fn key {key!r} is neither a block name nor a part index "
                    f"in 0..{layout.num_parts - 1}."
                )
            j = layout.part_index(key if isinstance(key, str) else int(key))
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


def _check_tensor_fn(tensor: Tensor, fn: Callable[..., Tensor], generator: torch.Generator | None, where: str) -> None:
    """Checks that need no call: dtype of random torch fns, inference tensors, generator."""
    base = _base(fn)
    dtype = tensor.dtype
    if _hashable_in(base, _RANDOM_FNS):
        ok = dtype.is_floating_point or (dtype.is_complex and base not in _REAL_ONLY)
        if not ok:
            kind = "real floating-point" if base in _REAL_ONLY else "floating-point"
            raise PackedInitError(
                f"{where}: {_fn_name(fn)} draws random floats but the tensor is {dtype}; "
                f"init a {kind} tensor (or use constant_/zeros_/ones_)."
            )
    if generator is not None and not _hashable_in(base, _DETERMINISTIC_FNS) and _accepts_generator(fn) is False:
        raise PackedInitError(
            f"{where}: generator= was given but {_fn_name(fn)} takes no generator and would draw from "
            f"the global RNG; give it a `generator` parameter or drop generator=."
        )


_INFERENCE_FIX = (
    "the tensor was created under torch.inference_mode() and cannot be written outside it; "
    "init it inside `with torch.inference_mode():` or create it outside inference mode."
)


def _check_tensor(tensor: Tensor, generator: torch.Generator | None, where: str) -> None:
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise PackedInitError(f"{where}: {_INFERENCE_FIX}")
    if not tensor.is_meta and tensor.layout == torch.strided:
        shared = [d for d, (n, st) in enumerate(zip(tensor.shape, tensor.stride(), strict=True)) if n > 1 and st == 0]
        if shared:
            raise PackedInitError(
                f"{where}: dim {shared[0]} has stride 0 (an expanded tensor): its rows share memory, so blocks "
                f"would overwrite each other; init a tensor that owns its memory (e.g. .clone() it)."
            )
    if generator is not None and not tensor.is_meta and generator.device.type != tensor.device.type:
        raise PackedInitError(
            f"{where}: generator is on {generator.device} but the tensor is on {tensor.device}; "
            f"pass torch.Generator(device={tensor.device.type!r})."
        )


def _bound_args(fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    try:
        bound = inspect.signature(fn).bind(None, *args, **kwargs)
    except (TypeError, ValueError):
        return None  # the dry run reports a bad call
    bound.apply_defaults()
    return dict(bound.arguments)


def _check_values(fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any], where: str) -> None:
    """Argument checks that torch only makes on real tensors (meta kernels skip them)."""
    base = _base(fn)
    if base not in (_init.uniform_, _init.trunc_normal_, _init.xavier_uniform_):
        return
    if not args and not kwargs and not isinstance(fn, functools.partial):
        return  # the defaults are valid
    got = _bound_args(fn, args, kwargs)
    if got is None:
        return
    try:
        if base is _init.xavier_uniform_:
            bad = float(got["gain"]) < 0
            what = f"gain={got['gain']!r} makes the bound negative (torch raises); use gain >= 0"
        else:
            bad = float(got["a"]) > float(got["b"])
            what = f"a={got['a']!r} > b={got['b']!r} is an empty range (torch raises); use a <= b"
    except (TypeError, ValueError, KeyError):
        return  # the dry run reports a bad type
    if bad:
        raise PackedInitError(f"{where}: {_fn_name(fn)} with {what}. Nothing was written.")


def _count_writes(plan: Plan) -> int:
    return sum(1 for b in plan.blocks if plan.fns[b.index] is not None and b.numel)


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

    Runs every check (layout against shape, functions, dtypes, generator) and, when
    more than one block is written (or the tensor is on meta), a dry run of every
    distinct (function, block shape) on meta tensors, so that an init function that
    rejects a block does so before the first write.
    """
    if not isinstance(tensor, Tensor):
        raise PackedInitError(f"expected a torch.Tensor (or nn.Module with chunked), got {type(tensor).__name__}.")
    shape = tensor.shape
    layout = as_layout(chunks, dim, shape, param=param)
    if layout is None:
        if init_fn is None:
            raise PackedInitError(f"no init_fn given for {_who(param)} of shape {fmt_shape(shape)}.")
        return None
    blocks = layout.blocks(shape, param=param)
    kwargs = dict(kwargs)
    generator = kwargs.pop("generator", None)
    where: Any = _Context(param, shape, layout)  # formatted only when a message is
    if generator is not None and not isinstance(generator, torch.Generator):
        raise PackedInitError(f"{where}: generator must be a torch.Generator, got {type(generator).__name__}.")
    fns = _resolve_fns(init_fn, layout, blocks, where)
    _check_tensor(tensor, generator, where)
    distinct: dict[int, Callable[..., Tensor]] = {id(fn): fn for fn in fns if fn is not None}
    for fn in distinct.values():
        _check_tensor_fn(tensor, fn, generator, where)
        _check_values(fn, tuple(args), kwargs, where)
    plan = Plan(layout, blocks, fns, tuple(args), kwargs, generator, shape, tensor.dtype, param)
    if tensor.is_meta or _count_writes(plan) > 1:
        verified = _dry_run(plan)
        if not verified:
            plan = Plan(layout, blocks, fns, tuple(args), kwargs, generator, shape, tensor.dtype, param, False)
    return plan


class _MetaRejectedError(Exception):
    """A torch.nn.init function raised on a meta block (carries the block index and the error)."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index, error)
        self.index = index
        self.error = error


@functools.lru_cache(maxsize=2048)
def _torch_meta_checked(
    layout: Layout,
    shape: torch.Size,
    dtype: torch.dtype,
    fns: tuple[Callable[..., Tensor] | None, ...],
    args: tuple[Any, ...],
    kw_items: tuple[tuple[str, Any], ...],
) -> bool:
    """Run each distinct (torch.nn.init fn, block shape) of a plan on meta; cached on success.

    Raises _MetaRejectedError (not cached) for the first block a function rejects.
    """
    kwargs = dict(kw_items)
    seen: set[tuple[Callable[..., Tensor], torch.Size]] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for block in layout.blocks(shape):
            fn = fns[block.index]
            if fn is None or block.numel == 0 or (fn, block.shape) in seen:
                continue
            seen.add((fn, block.shape))
            cdt = torch.float32 if dtype in _LOW_PRECISION and _base(fn) is _init.orthogonal_ else dtype
            try:
                _substitute(fn)(torch.empty(block.shape, dtype=cdt, device="meta"), *args, **kwargs)
            except Exception as e:  # torch.nn.init functions all run on meta: any error is a rejection
                raise _MetaRejectedError(block.index, e) from e
    return True


def _dry_run(plan: Plan) -> bool:
    """Call each distinct (fn, block shape) on meta tensors; turn rejections into PackedInitError.

    Costs no memory and draws nothing. When every function is a torch.nn.init function
    (or a partial of one) the check runs without the generator and is cached per
    (layout, shape, dtype, functions, arguments). Other functions run each time, with the
    global RNG and the caller's generator restored afterwards and warnings hidden.
    Returns False when some function could not run on meta (then nothing is known
    about it until the real run).
    """
    distinct = {id(fn): fn for fn in plan.fns if fn is not None}
    if all(_hashable_in(_base(fn), _TORCH_FNS) for fn in distinct.values()):
        key: tuple[Any, ...] | None = (*_key_parts(plan)[:5], tuple(sorted(plan.kwargs.items())))
        try:
            hash(key)
        except TypeError:  # unhashable arguments: check without the cache
            key = None
        try:
            if key is not None:
                _torch_meta_checked(*key)
            else:
                _torch_meta_checked.__wrapped__(*_key_parts(plan))
        except _MetaRejectedError as r:
            block = plan.blocks[r.index]
            fn = plan.fns[r.index]
            assert fn is not None  # a rejected block has a function
            raise _rejected(plan.where(), block, fn, r.error, wrote_nothing=True) from r.error
        return True
    verified = True
    seen: set[tuple[int, torch.Size]] = set()
    saved = (torch.get_rng_state(), plan.generator.get_state() if plan.generator else None)
    try:
        for block in plan.blocks:
            fn = plan.fns[block.index]
            if fn is None or block.numel == 0 or (id(fn), block.shape) in seen:
                continue
            seen.add((id(fn), block.shape))
            is_torch = _hashable_in(_base(fn), _TORCH_FNS)
            try:
                meta = torch.empty(block.shape, dtype=plan.compute_dtype(fn), device="meta")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    plan.call(fn, meta)
            except _REJECTIONS as e:
                raise _rejected(plan.where(), block, fn, e, wrote_nothing=True) from e
            except Exception as e:
                if is_torch:  # torch.nn.init functions all run on meta: this is a real rejection
                    raise _rejected(plan.where(), block, fn, e, wrote_nothing=True) from e
                verified = False  # e.g. it reads values; the real run is guarded by a backup
    finally:
        torch.set_rng_state(saved[0])
        if plan.generator is not None and saved[1] is not None:
            plan.generator.set_state(saved[1])
    return verified


def _key_parts(plan: Plan) -> tuple[Any, ...]:
    return (plan.layout, plan.shape, plan.dtype, plan.fns, plan.args, tuple(plan.kwargs.items()))


def _rejected(
    where: str, block: LogicalBlock | None, fn: Callable[..., Tensor], e: BaseException, *, wrote_nothing: bool
) -> PackedInitError:
    """The PackedInitError for an init function that raised on a block (``None``: the whole tensor)."""
    if isinstance(e, PackedInitError):
        return e
    hint = ""
    if block is not None and len(block.shape) < 2 and ("fewer than 2 dimensions" in str(e) or "2 or more" in str(e)):
        hint = " A 1-D block (a bias) has no fan_in/fan_out: use uniform_/normal_/zeros_ for biases."
    if block is not None:
        what = f"block {block.label!r} of logical shape {fmt_shape(block.shape)}"
        fix = "pick an init function (or arguments) that accepts this block, or give per-block functions"
    else:
        what = "the tensor"
        fix = "pick an init function (or arguments) that accepts this tensor"
    tail = (
        "Nothing was written" if wrote_nothing else f"packedinit wrote nothing; the tensor is as {_fn_name(fn)} left it"
    )
    return PackedInitError(f"{where}: {_fn_name(fn)} rejected {what}: {type(e).__name__}: {e}.{hint} {tail}; {fix}.")


def _convertible(e: BaseException, torch_fn: bool) -> bool:
    """Whether an exception from an init function means 'bad input' (vs. e.g. out of memory)."""
    if isinstance(e, _REJECTIONS):
        return True
    return torch_fn and type(e) in (RuntimeError, NotImplementedError)


class _Scratch:
    """One flat contiguous buffer per (dtype, device, inference mode), grown on demand and reused."""

    __slots__ = ("_bufs",)

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.dtype, torch.device, bool, int], Tensor] = {}

    def flat(self, n: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> Tensor:
        """The shared flat buffer number ``slot``, at least ``n`` elements long."""
        key = (dtype, device, torch.is_inference_mode_enabled(), slot)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf

    def get(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A contiguous tensor of ``shape`` (uninitialised), a view of the shared buffer."""
        n = math.prod(shape)
        return self.flat(n, dtype, device)[:n].view(shape)


class _RngState:
    """The random state a failed, undone init restores: CPU, the tensor's CUDA device, the generator."""

    def __init__(self, device: torch.device, generator: torch.Generator | None) -> None:
        self.cpu = torch.get_rng_state()
        self.device = device if device.type == "cuda" else None
        self.cuda = torch.cuda.get_rng_state(device) if self.device is not None else None
        self.generator = generator
        self.gen = generator.get_state() if generator is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        if self.generator is not None and self.gen is not None:
            self.generator.set_state(self.gen)


class _Where(NamedTuple):
    """Where one block lives in a tensor of given shape and strides (all as_strided arguments).

    ``inplace``: the block's logical view is contiguous: ``as_strided(block.shape, *view)``.
    ``ordered``: the logical view exists, is not contiguous, but its memory order is its
    row-major order (a dim-1 split): ``view`` holds it too. Otherwise ``storage`` is (shape,
    stride, offset) of the block's storage view and ``from_logical`` the (shape, stride)
    that views a contiguous logical tensor the same way.
    """

    inplace: bool
    ordered: bool
    view: tuple[tuple[int, ...], int]
    contiguous: tuple[int, ...]
    storage: tuple[tuple[int, ...], tuple[int, ...], int]
    from_logical: tuple[tuple[int, ...], tuple[int, ...]]


#: Logical rows per tile of a transposing copy: a (32, in) slab stays in cache while its columns
#: are written (measured on CPU at E=4096: 36 ms against 165 ms for one strided copy_).
_TILE = 32


def _copy_transposed(dst: Tensor, logical: Tensor) -> None:
    """``dst.copy_(logical.t())`` for a strided ``(in, out)`` destination, in cache-sized tiles."""
    rows = logical.shape[0]
    if rows <= _TILE:
        dst.copy_(logical.t())
        return
    for r in range(0, rows, _TILE):
        dst[:, r : r + _TILE].copy_(logical[r : r + _TILE].t())


def _row_major(t: Tensor) -> bool:
    """Whether walking ``t`` in memory order visits its elements in row-major order (no overlap)."""
    extent = 1
    for size, stride in reversed(list(zip(t.shape, t.stride(), strict=True))):
        if size == 1:
            continue
        if stride < extent:
            return False
        extent = stride * size
    return True


@functools.lru_cache(maxsize=4096)
def _geometry(layout: Layout, shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[_Where, ...]:
    """Per block, where it lives, computed once on meta tensors (pure, cached)."""
    meta = torch.empty_strided(shape, stride, device="meta")
    out: list[_Where] = []
    for block in layout.blocks(shape):
        logical = torch.empty(block.shape, device="meta")
        lv = layout.logical_view(meta, block)
        inplace = lv is not None and lv.is_contiguous()
        ordered = lv is not None and not inplace and not layout.transposed and _row_major(lv)
        sv = layout.storage_view(meta, block)
        ts = layout.to_storage(logical, block, len(shape))
        out.append(
            _Where(
                inplace,
                ordered,
                (tuple(lv.stride()), int(lv.storage_offset())) if lv is not None and (inplace or ordered) else ((), 0),
                tuple(logical.stride()),
                (tuple(sv.shape), tuple(sv.stride()), int(sv.storage_offset())),
                (tuple(ts.shape), tuple(ts.stride())),
            )
        )
    return tuple(out)


def execute(plan: Plan, tensor: Tensor, scratch: _Scratch | None = None) -> None:
    """Write every block of ``plan`` into ``tensor`` (a plain, non-meta tensor), under no_grad.

    Contiguous logical views are filled in place; other blocks (and orthogonal_ on
    fp16/bf16) in a scratch buffer, copied back once. If ``plan.verified`` is False a
    copy of the tensor is kept so that a failing block can be undone.
    """
    scratch = scratch or _Scratch()
    layout, ndim, dtype = plan.layout, tensor.dim(), tensor.dtype
    todo = [b for b in plan.blocks if plan.fns[b.index] is not None and b.numel]
    if not todo:
        return
    low = dtype in _LOW_PRECISION
    cpu = tensor.device.type == "cpu"
    tiled = layout.transposed and layout.normalized_dim(ndim) - layout.batch_dims == 1
    plain = type(tensor) in _PLAIN_TYPES
    geometry = _geometry(layout, tuple(tensor.shape), tuple(tensor.stride())) if plain else None
    offset = tensor.storage_offset()
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # torch.no_grad() without the context-manager overhead
    try:
        backup = tensor.detach().clone() if not plan.verified and len(todo) > 1 else None
        rng = _RngState(tensor.device, plan.generator) if backup is not None else None
        written = False
        for block in todo:
            fn = plan.fns[block.index]
            assert fn is not None  # todo holds only blocks with a function
            cdt = torch.float32 if low and _base(fn) is _init.orthogonal_ else dtype
            lv: Tensor | None = None
            try:
                if geometry is not None:
                    g = geometry[block.index]
                    if cdt == dtype and (g.inplace or (g.ordered and cpu and _hashable_in(_base(fn), _UNIFORM_FNS))):
                        lv = tensor.as_strided(block.shape, g.view[0], offset + g.view[1])
                else:
                    lv = layout.logical_view(tensor, block) if cdt == dtype else None
                    lv = lv if lv is not None and lv.is_contiguous() else None
                if lv is not None:
                    res = plan.call(fn, lv)
                    if res is not lv:
                        lv.copy_(res)
                elif geometry is not None:
                    buf = scratch.flat(block.numel, cdt, tensor.device).as_strided(block.shape, g.contiguous)
                    res = plan.call(fn, buf)
                    sshape, sstride, soff = g.storage
                    dst = tensor.as_strided(sshape, sstride, offset + soff)
                    if tiled and res.dim() == 2 and (layout.groups == 1 or sshape[2] == 1):
                        # storage (in, groups, size) with one of groups/size 1: logical row r is column r
                        _copy_transposed(dst[:, 0, :] if layout.groups == 1 else dst[:, :, 0], res)
                    elif res is buf:
                        dst.copy_(res.as_strided(*g.from_logical))
                    else:
                        dst.copy_(layout.to_storage(res, block, ndim))
                else:
                    buf = scratch.get(block.shape, cdt, tensor.device)
                    res = plan.call(fn, buf)
                    layout.storage_view(tensor, block).copy_(layout.to_storage(res, block, ndim))
            except Exception as e:
                restored = backup is not None
                if backup is not None and rng is not None:
                    tensor.copy_(backup)
                    rng.restore()
                torch_fn = _hashable_in(_base(fn), _TORCH_FNS)
                if (restored or not written) and _convertible(e, torch_fn):
                    nothing = restored or lv is None or torch_fn
                    raise _rejected(plan.where(), block, fn, e, wrote_nothing=nothing) from e
                if written and not restored and hasattr(e, "add_note"):
                    e.add_note(f"packedinit: blocks before {block.label!r} of {plan.where()} were already written.")
                raise
            written = True
    finally:
        torch._C._set_grad_enabled(grad)


def _run_single(
    tensor: Tensor,
    fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    param: str | None,
) -> bool:
    """The lean path for one block that is the whole tensor: call ``fn`` on it directly.

    Returns False when the general path must handle it (orthogonal_ that needs a
    float32/contiguous scratch, generator= that needs care, a user function on meta).
    """
    lean = _lean_get(fn)
    if lean is not None and (lean[1] or not kwargs or "generator" not in kwargs):
        if lean[0] and tensor.numel() == 0:
            return True
        _lean_call(tensor, fn, args, kwargs, param)
        return True
    if type(fn) is types.FunctionType and fn in _TORCH_FNS:
        if fn is _init.orthogonal_ or fn is _init.trunc_normal_:
            dtype = tensor.dtype
            if dtype in _LOW_PRECISION or dtype.is_complex or (fn is _init.orthogonal_ and not tensor.is_contiguous()):
                return False
        if kwargs and "generator" in kwargs and fn not in _GENERATOR_OK:
            return False
        if tensor.numel() == 0:
            return True
        _lean_call(tensor, fn, args, kwargs, param)
        return True
    if tensor.is_meta or (kwargs and "generator" in kwargs):
        return False
    if tensor.numel() == 0:
        return True
    try:
        with torch.no_grad():
            out = fn(tensor, *args, **kwargs)
            if out is not tensor and isinstance(out, Tensor):
                if out.shape != tensor.shape:
                    raise ValueError(
                        f"{_fn_name(fn)} returned a tensor of shape {fmt_shape(out.shape)}; an init function "
                        f"must fill its argument in place or return a tensor of the same shape"
                    )
                tensor.copy_(out)
    except _REJECTIONS as e:
        where = f"{_who(param)} of shape {fmt_shape(tensor.shape)}"
        raise _rejected(where, None, fn, e, wrote_nothing=False) from e
    return True


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
    _run(tensor, chunks, dim, init_fn, args, init_kwargs)
    return tensor


def _is_whole(tensor: Tensor, chunks: Chunks | None, dim: int | None, param: str | None) -> bool:
    """Whether ``chunks``/``dim`` make one block that is the tensor as stored (raises if they don't fit).

    ``None`` and ``1`` always do (the call is then exactly ``init_fn(tensor)``); an explicit
    one-part Layout or ``[n]`` only for a contiguous tensor (a separate tensor is contiguous).
    """
    if chunks is None or (type(chunks) is int and chunks == 1):
        nd = tensor.dim()
        return (dim is None or (type(dim) is int and -nd <= dim < nd)) and (chunks is None or nd > 0)
    # one explicit part: the whole tensor; the same draws as a separate tensor only when contiguous
    if isinstance(chunks, Layout):
        if chunks.num_parts != 1 or chunks.transposed or chunks.batch_dims:
            return False
    elif not (type(chunks) in (list, tuple) and len(chunks) == 1):  # type: ignore[arg-type]  # a list or tuple
        return False
    return as_layout(chunks, dim, tensor.shape, param=param) is not None and tensor.is_contiguous()


def _lean_get(fn: Any) -> tuple[bool, bool] | None:
    try:
        return _LEAN.get(fn)
    except TypeError:  # an unhashable callable
        return None


def _lean_call(
    tensor: Tensor, fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any], param: str | None
) -> None:
    """Call a torch.nn.init function on the whole tensor as it is (the lean path).

    Those functions check their input before they write and use no_grad themselves; a
    rejection becomes PackedInitError (see :func:`_lean_failed`).
    """
    try:
        fn(tensor, *args, **kwargs)
    except Exception as e:
        if not _lean_failed(tensor, fn, kwargs, param, e):
            raise


def _lean_failed(
    tensor: Tensor, fn: Callable[..., Tensor], kwargs: Mapping[str, Any], param: str | None, e: Exception
) -> bool:
    """A torch.nn.init function raised on the lean path: raise PackedInitError when it means bad input.

    Returns True when the error is to be ignored (a zero-element tensor: nothing to fill),
    False when the caller re-raises the original (e.g. out of memory, or an inference
    tensor outside inference mode: torch writes it before it refuses).
    """
    if tensor.numel() == 0:
        return True
    if not _convertible(e, True):
        return False
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note(f"packedinit: {_INFERENCE_FIX}")
        return False
    where = f"{_who(param)} of shape {fmt_shape(tensor.shape)}"
    gen = kwargs.get("generator")
    _check_tensor(tensor, gen if isinstance(gen, torch.Generator) else None, where)
    _check_tensor_fn(tensor, fn, None, where)
    raise _rejected(where, None, fn, e, wrote_nothing=True) from e


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
    """Initialise ``tensor`` (the engine behind chunked_init, chunked and the model walk).

    ``param`` names the tensor in error messages; ``scratch`` may be shared across calls.
    """
    if (
        type(tensor) in _PLAIN_TYPES
        and callable(init_fn)
        and _is_whole(tensor, chunks, dim, param)
        and _run_single(tensor, init_fn, args, kwargs, param)
    ):
        return
    if isinstance(tensor, Tensor) and _is_dtensor(tensor):
        from .distributed import init_dtensor

        init_dtensor(tensor, chunks, dim, init_fn, args, kwargs, param=param, scratch=scratch)
        return
    plan = make_plan(tensor, chunks, dim, init_fn, args, kwargs, param=param)
    if plan is None or tensor.is_meta or tensor.numel() == 0:
        return
    execute(plan, tensor, scratch)


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
        >>> from torch.nn.init import xavier_uniform_
        >>> init = chunked(xavier_uniform_, 3)
        >>> w = init(torch.empty(24, 8), gain=2.0)
        >>> w.shape
        torch.Size([24, 8])
        >>> init.__name__
        'xavier_uniform_'
    """
    if not callable(init_fn):
        raise PackedInitError(f"chunked(init_fn=...) needs a function, got {type(init_fn).__name__}.")
    chunks = _check_chunks_arg(chunks, dim)
    lean = _lean_get(init_fn) if chunks is None and dim is None else None
    fast = lean is not None  # the lean path of _run_single, inlined: an unpacked tensor and a torch.nn.init function
    skip_empty, takes_generator = lean if lean is not None else (False, False)
    tensor_types = _PLAIN_TYPES

    @functools.wraps(init_fn)
    def wrapper(target: Any, /, *args: Any, **kwargs: Any) -> Any:
        if fast and type(target) in tensor_types and (takes_generator or not kwargs or "generator" not in kwargs):
            if not (skip_empty and target.numel() == 0):
                _lean_call(target, init_fn, args, kwargs, None)
            return target
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

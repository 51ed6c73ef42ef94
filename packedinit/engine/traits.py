"""What packedinit knows about init functions: which draw, which are uniform-family, which dtypes they take.

No tensor is written here. Every rule about a ``torch.nn.init`` function lives in this one
module (the fp16/bf16 -> float32 rule of ``orthogonal_``, the dtypes random functions
accept, the arguments torch checks only on real tensors), plus the generator-driven
replacement of ``sparse_``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from packedinit.errors import PackedInitError, packed_error

__all__ = [
    "RANDOM_FNS",
    "DETERMINISTIC_FNS",
    "TORCH_FNS",
    "UNIFORM_FNS",
    "REAL_ONLY",
    "GENERATOR_OK",
    "LEAN",
    "LOW_PRECISION",
    "REJECTIONS",
    "sparse_",
    "base",
    "substitute",
    "hashable_in",
    "accepts_generator",
    "fn_name",
    "is_dtensor",
    "who",
    "compute_dtype",
    "check_fn_dtype",
    "check_values",
    "convertible",
    "bound_args",
    "TORCH_INIT",
    "normal_merges",
    "FAN_FREE",
    "reads_fans",
]

#: torch.nn.init's functions as imported: ``fix_torch_defaults`` replaces the module's names while it is on,
#: and every identity rule here is about torch's own functions.
TORCH_INIT = types.SimpleNamespace(**vars(torch.nn.init))
_init = TORCH_INIT
#: torch.nn.init functions that draw random numbers (they need a floating-point tensor).
RANDOM_FNS: frozenset[Callable[..., Tensor]] = frozenset(
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
DETERMINISTIC_FNS: frozenset[Callable[..., Tensor]] = frozenset(
    {_init.constant_, _init.ones_, _init.zeros_, _init.eye_, _init.dirac_}
)
TORCH_FNS = RANDOM_FNS | DETERMINISTIC_FNS
#: Functions whose only draw is one ``uniform_`` and whose result only needs fans of the shape:
#: on CPU ``uniform_`` fills in memory order, so on a strided view whose memory order is its
#: logical (row-major) order it draws exactly what a contiguous tensor of that shape draws.
UNIFORM_FNS: frozenset[Callable[..., Tensor]] = frozenset(
    {_init.uniform_, _init.xavier_uniform_, _init.kaiming_uniform_, _init.constant_, _init.ones_, _init.zeros_}
)
#: torch.nn.init functions whose values do not depend on the tensor's shape: blocks change nothing.
FAN_FREE: frozenset[Callable[..., Tensor]] = frozenset(
    {_init.uniform_, _init.normal_, _init.trunc_normal_, _init.constant_, _init.ones_, _init.zeros_}
)
#: Random torch.nn.init functions that fail on complex tensors (and may write before failing).
REAL_ONLY: frozenset[Callable[..., Tensor]] = frozenset({_init.trunc_normal_, _init.orthogonal_})
#: torch.nn.init functions the lean path may hand ``generator=`` to unchanged.
GENERATOR_OK = RANDOM_FNS - {_init.sparse_}
#: The lean path: torch.nn.init functions called on an unpacked tensor as they are.
#: fn -> (skip zero-element tensors first (kaiming_ warns on them), may take generator=).
LEAN: dict[Callable[..., Tensor], tuple[bool, bool]] = {
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
LOW_PRECISION = (torch.float16, torch.bfloat16)
#: Dtypes torch's random kernels fill (float8 and friends have no uniform_/normal_ kernel).
_RANDOM_REAL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_RANDOM_COMPLEX = (torch.complex64, torch.complex128)
#: Exceptions an init function raises for a shape or an argument it does not accept.
REJECTIONS = (ValueError, TypeError, LookupError, ArithmeticError)


def sparse_(
    tensor: Tensor,
    sparsity: float,
    std: float = 0.01,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``torch.nn.init.sparse_`` whose zero pattern also comes from ``generator``.

    Without a generator it makes exactly torch's draws (bit-identical); torch's own
    ``sparse_`` ignores ``generator`` for the pattern and calls ``randperm`` on the
    global RNG, which breaks the "a generator leaves the global RNG untouched" contract.

    Examples:
        >>> w = sparse_(torch.empty(4, 3), 0.5, generator=torch.Generator().manual_seed(0))
        >>> int((w == 0).sum())
        6
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


def hashable_in(fn: object, group: frozenset[Callable[..., Tensor]]) -> bool:
    """``fn in group``, False for an unhashable callable."""
    try:
        return fn in group
    except TypeError:  # an unhashable callable object
        return False


def base(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """The function under any ``functools.partial`` layers (torch's own under a ``fix_torch_defaults`` wrapper)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    inner: Callable[..., Tensor] | None = getattr(fn, "__packedinit_torch__", None)
    return inner if inner is not None else fn


def substitute(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` with torch's ``sparse_`` (also inside partials) replaced by the generator-driven one."""
    if fn is _init.sparse_:
        return sparse_
    if isinstance(fn, functools.partial):
        inner = substitute(fn.func)
        if inner is not fn.func:
            return functools.partial(inner, *fn.args, **fn.keywords)
    return fn


def accepts_generator(fn: Callable[..., Tensor]) -> bool | None:
    """True/False from the signature; None when it cannot be read.

    Remembered per function weakly (a caller's function and its closure are not kept alive).
    """
    try:
        return _ACCEPTS[fn]
    except (KeyError, TypeError):  # not seen yet; or unhashable / not weak-referenceable
        pass
    got = _read_accepts_generator(fn)
    with contextlib.suppress(TypeError):  # e.g. a builtin or an object without __weakref__: read each time
        _ACCEPTS[fn] = got
    return got


def _read_accepts_generator(fn: Callable[..., Tensor]) -> bool | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return any(p.name == "generator" or p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


_ACCEPTS: weakref.WeakKeyDictionary[Callable[..., Tensor], bool | None] = weakref.WeakKeyDictionary()


def reads_fans(fn: object) -> bool:
    """Whether ``fn``'s values may depend on the shape it is handed (False only for torch's fan-free functions)."""
    return not (callable(fn) and hashable_in(base(fn), FAN_FREE))


def fn_name(fn: object) -> str:
    """``torch.nn.init.xavier_uniform_``, ``partial(...)`` or the function's qualified name."""
    if isinstance(fn, functools.partial):
        return f"partial({fn_name(fn.func)})"
    mod = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"torch.nn.init.{name}" if mod == "torch.nn.init" else str(name)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing torch.distributed)."""
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def who(param: str | None) -> str:
    """``"parameter 'w'"`` or ``"tensor"``, for messages."""
    return f"parameter {param!r}" if param else "tensor"


def compute_dtype(fn: Callable[..., Tensor], dtype: torch.dtype) -> torch.dtype:
    """The dtype a block is computed in: float32 for ``orthogonal_`` on fp16/bf16 (its QR needs it)."""
    if dtype in LOW_PRECISION and base(fn) is _init.orthogonal_:
        return torch.float32
    return dtype


def check_fn_dtype(dtype: torch.dtype, fn: Callable[..., Tensor], where: object) -> None:
    """Refuse a random torch.nn.init function on a dtype its kernels cannot fill (before any write)."""
    b = base(fn)
    if not hashable_in(b, RANDOM_FNS):
        return
    if not (dtype.is_floating_point or (dtype.is_complex and b not in REAL_ONLY)):
        kind = "real floating-point" if b in REAL_ONLY else "floating-point"
        raise PackedInitError(
            f"{where}: {fn_name(fn)} draws random floats but the tensor is {dtype}; "
            f"init a {kind} tensor (or use constant_/zeros_/ones_)."
        )
    if dtype not in _RANDOM_REAL and dtype not in _RANDOM_COMPLEX:
        raise PackedInitError(
            f"{where}: {fn_name(fn)} draws random floats but the tensor is {dtype}, which torch's random "
            f"kernels cannot fill; init a float32 (or float16/bfloat16/float64) tensor and convert it "
            f"(.to({dtype})). Nothing was written."
        )


def bound_args(fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """Every argument of ``fn(tensor, *args, **kwargs)`` by name, defaults filled in; ``None`` for a bad call."""
    try:
        bound = inspect.signature(fn).bind(None, *args, **kwargs)
    except (TypeError, ValueError):
        return None  # the dry run reports a bad call
    bound.apply_defaults()
    return dict(bound.arguments)


#: Per torch.nn.init function, the arguments that must be real numbers (torch checks some only on
#: real tensors, after it has drawn, or not at all on meta tensors: orthogonal_ returns early there).
_NUMBERS: dict[Callable[..., Tensor], tuple[str, ...]] = {
    _init.uniform_: ("a", "b"),
    _init.normal_: ("mean", "std"),
    _init.trunc_normal_: ("mean", "std", "a", "b"),
    _init.xavier_uniform_: ("gain",),
    _init.xavier_normal_: ("gain",),
    _init.orthogonal_: ("gain",),
    _init.sparse_: ("sparsity", "std"),
    _init.constant_: ("val",),
}


def _number_problem(name: str, value: object) -> tuple[str, type[Exception]] | None:
    if not isinstance(value, numbers.Real):
        if isinstance(value, Tensor) and value.numel() == 1 and not value.dtype.is_complex:
            value = value.item()
        else:
            return f"{name}={value!r} is not a real number", TypeError
    if not math.isfinite(float(value)) and name not in ("a", "b", "val"):
        return f"{name}={value!r} is not finite", ValueError
    return None


def check_values(fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any], where: object) -> None:
    """Argument checks torch makes only on real tensors, late, or not at all on meta; raised before any write.

    Types of numeric arguments, ``a <= b``, ``gain >= 0`` for ``xavier_uniform_``,
    ``0 <= sparsity <= 1``. A torch error type is kept (see :func:`packedinit.errors.packed_error`).
    """
    b = base(fn)
    names = _NUMBERS.get(b) if hashable_in(b, TORCH_FNS) else None
    if names is None or (not args and not kwargs and not isinstance(fn, functools.partial)):
        return  # the defaults are valid
    got = bound_args(fn, args, kwargs)
    if got is None:
        return
    problem: tuple[str, type[Exception]] | None = None
    for name in names:
        if name in got:
            problem = _number_problem(name, got[name])
            if problem is not None:
                break
    if problem is None:
        vals = {n: float(got[n].item() if isinstance(got[n], Tensor) else got[n]) for n in names if n in got}
        if "a" in vals and "b" in vals and vals["a"] > vals["b"]:
            problem = (f"a={vals['a']!r} > b={vals['b']!r} is an empty range (torch raises); use a <= b", RuntimeError)
        elif b is _init.xavier_uniform_ and vals["gain"] < 0:
            problem = (f"gain={vals['gain']!r} makes the bound negative (torch raises); use gain >= 0", RuntimeError)
        elif b is _init.sparse_ and not 0 <= vals["sparsity"] <= 1:
            problem = (f"sparsity={vals['sparsity']!r} is not a fraction in [0, 1]", ValueError)
    if problem is not None:
        what, kind = problem
        raise packed_error(f"{where}: {fn_name(fn)} with {what}. Nothing was written.", kind(what))


def convertible(e: BaseException, torch_fn: bool) -> bool:
    """Whether an exception from an init function means 'bad input' (vs. e.g. out of memory)."""
    if isinstance(e, REJECTIONS):
        return True
    return torch_fn and type(e) in (RuntimeError, NotImplementedError)


def normal_merges(sizes: Sequence[int]) -> bool:
    """Whether one CPU ``normal_`` call over consecutive blocks of ``sizes`` elements equals one call per block.

    torch's CPU kernel (``normal_kernel`` in ATen's ``native/cpu/DistributionTemplates.h``)
    takes one of two paths. A contiguous tensor of at least 16 elements is filled with
    uniforms in order and transformed in groups of 16 (Box-Muller on the two halves of each
    group); when its size is not a multiple of 16 the last 16 are drawn again and transformed.
    A tensor of fewer than 16 elements takes the scalar path: one Box-Muller sample per
    element, in order, the spare sample kept in the generator. So one call equals the separate
    calls exactly when all blocks together have fewer than 16 elements (every call is scalar),
    or every block but the last is a multiple of 16 and the last has at least 16 elements
    (tests/test_normal_rule.py checks every split of 1..64 elements, bit for bit, and that the
    rule is exact).

    Examples:
        >>> normal_merges([16, 4, 4]), normal_merges([16, 16, 20]), normal_merges([3, 4])
        (False, True, True)
    """
    if sum(sizes) < 16:
        return True
    return sizes[-1] >= 16 and all(s % 16 == 0 for s in sizes[:-1])

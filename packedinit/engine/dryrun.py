"""The meta dry run of a plan: each distinct (function, block shape) called on meta tensors before any write,
and the error that names the block an init function rejected."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from packedinit.engine.keys import UncacheableError, value_key
from packedinit.engine.rng import global_restored
from packedinit.engine.traits import (
    REJECTIONS,
    TORCH_FNS,
    base,
    compute_dtype,
    fn_name,
    hashable_in,
    substitute,
)
from packedinit.errors import PackedInitError, packed_error
from packedinit.layout import LogicalBlock
from packedinit.shapes import fmt_shape

if TYPE_CHECKING:
    from packedinit.engine.plan import Plan

__all__ = ["dry_run", "rejected"]


class _MetaRejectedError(Exception):
    """A torch.nn.init function raised on a meta block (carries the block index and the error)."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index, error)
        self.index = index
        self.error = error


#: Value keys (see :mod:`packedinit.engine.keys`) of (layout, shape, dtype, functions, arguments) whose
#: torch.nn.init dry run passed. Bounded; cleared when full. Holds no caller object.
_META_OK: set[object] = set()
_META_MAX = 2048


def _torch_meta_check(plan: Plan) -> None:
    """Run each distinct (torch.nn.init fn, block shape) of a plan on meta; remembered on success.

    Raises _MetaRejectedError for the first block a function rejects.
    """
    try:
        key: object = value_key((plan.layout, tuple(plan.shape), plan.dtype, plan.fns, plan.args, dict(plan.kwargs)))
    except UncacheableError:  # e.g. a tensor argument: check without remembering
        key = None
    if key is not None and key in _META_OK:
        return
    seen: set[tuple[Callable[..., Tensor], torch.Size]] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for block in plan.blocks:
            fn = plan.fns[block.index]
            if fn is None or block.numel == 0 or (fn, block.shape) in seen:
                continue
            seen.add((fn, block.shape))
            meta = torch.empty(block.shape, dtype=compute_dtype(fn, plan.dtype), device="meta")
            try:
                substitute(fn)(meta, *plan.args, **plan.kwargs)
            except Exception as e:  # torch.nn.init functions all run on meta: any error is a rejection
                raise _MetaRejectedError(block.index, e) from e
    if key is not None:
        if len(_META_OK) >= _META_MAX:
            _META_OK.clear()
        _META_OK.add(key)


def dry_run(plan: Plan) -> bool:
    """Call each distinct (fn, block shape) on meta tensors; turn rejections into PackedInitError.

    Costs no memory and draws nothing. When every function is a torch.nn.init function
    (or a partial of one) the check runs without the generator and is cached per
    (layout, shape, dtype, functions, arguments). Other functions run each time, with the
    caller's generator restored afterwards (without one: the global RNG, if they drew from it;
    see :func:`packedinit.engine.rng.global_restored`) and warnings hidden.
    Returns False when some function could not run on meta (then nothing is known
    about it until the real run).
    """
    distinct = {id(fn): fn for fn in plan.fns if fn is not None}
    if all(hashable_in(base(fn), TORCH_FNS) for fn in distinct.values()):
        try:
            _torch_meta_check(plan)
        except _MetaRejectedError as r:
            fn = plan.fns[r.index]
            assert fn is not None  # a rejected block has a function
            raise rejected(plan.where(), plan.blocks[r.index], fn, r.error, wrote_nothing=True) from r.error
        return True
    if plan.generator is None:
        with global_restored():
            return _dry_run_calls(plan)
    saved = plan.generator.get_state()
    try:
        return _dry_run_calls(plan)
    finally:
        plan.generator.set_state(saved)


def _dry_run_calls(plan: Plan) -> bool:
    verified = True
    seen: set[tuple[int, torch.Size]] = set()
    for block in plan.blocks:
        fn = plan.fns[block.index]
        if fn is None or block.numel == 0 or (id(fn), block.shape) in seen:
            continue
        seen.add((id(fn), block.shape))
        is_torch = hashable_in(base(fn), TORCH_FNS)
        try:
            meta = torch.empty(block.shape, dtype=plan.compute_dtype(fn), device="meta")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan.call(fn, meta)
        except REJECTIONS as e:
            raise rejected(plan.where(), block, fn, e, wrote_nothing=True) from e
        except Exception as e:
            if is_torch:  # torch.nn.init functions all run on meta: this is a real rejection
                raise rejected(plan.where(), block, fn, e, wrote_nothing=True) from e
            verified = False  # e.g. it reads values; the real run is guarded by a backup
    return verified


def rejected(
    where: str, block: LogicalBlock | None, fn: Callable[..., Tensor], e: BaseException, *, wrote_nothing: bool
) -> PackedInitError:
    """The PackedInitError for an init function that raised on a block (``None``: the whole tensor).

    It is also an instance of the type ``fn`` raised (see :func:`packedinit.errors.packed_error`).
    """
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
        "Nothing was written" if wrote_nothing else f"packedinit wrote nothing; the tensor is as {fn_name(fn)} left it"
    )
    return packed_error(f"{where}: {fn_name(fn)} rejected {what}: {type(e).__name__}: {e}.{hint} {tail}; {fix}.", e)

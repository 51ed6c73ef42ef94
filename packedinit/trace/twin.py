"""The tracer's forward runs on a twin of the model, never on the model: read-only by construction.

:func:`run_read_only` first builds a *meta twin*: a deep copy of the module tree whose every Parameter,
buffer and tensor attribute is an empty tensor of the same shape and dtype on the meta device, fed meta
copies of the example inputs. No value is read or written and no arithmetic is done; dropout, batch norm
in train mode, in-place operations and hooks act on the twin alone. A value the forward reads from what its
example inputs alone give (``if (position_ids == 0).all():``) comes from copies of the inputs' values
(:mod:`packedinit.trace.known`); a forward that needs other values (``.item()`` of a buffer, a
weight-dependent ``nonzero``) cannot run on meta: it then runs on a full copy of the model and of its inputs.
Around both, the CPU and CUDA random states and Python's and NumPy's are saved and put back, so a forward
that draws from a global generator on its own (``torch.randn(...)`` with no device) leaves them as they
were too.
"""

from __future__ import annotations

import copy
import copyreg
import random
import sys
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor, nn

from packedinit.torch_compat import buffer_dict, param_dict
from packedinit.trace.known import KnownValues

__all__ = ["Twin", "meta_twin", "run_read_only", "random_states_kept"]

T = TypeVar("T")
Twin = Literal["meta", "copy"]


@contextmanager
def random_states_kept() -> Iterator[None]:
    """Put the CPU, CUDA (every device), Python and NumPy random states back on exit.

    Examples:
        >>> import torch
        >>> before = torch.get_rng_state()
        >>> with random_states_kept():
        ...     _ = torch.randn(3)
        >>> torch.equal(before, torch.get_rng_state())
        True
    """
    cpu = torch.get_rng_state()
    started = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # torch stub
    cuda = torch.cuda.get_rng_state_all() if started else None
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(python)
        if numpy is not None and numpy_state is not None:
            numpy.random.set_state(numpy_state)


def _meta(t: Tensor) -> Tensor:
    out = torch.empty_like(t, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(out, requires_grad=t.requires_grad)
    return out


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        return _meta(value)
    if isinstance(value, (list, tuple)):
        items = [_to_meta(v) for v in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict):
        return type(value)((k, _to_meta(v)) for k, v in value.items())
    return value


def _pair(value: Any, meta: Any, out: list[tuple[Tensor, Tensor]]) -> None:
    """Each meta input with a CPU copy of the caller's values (never the caller's tensor itself)."""
    if isinstance(value, Tensor) and isinstance(meta, Tensor):
        if not value.is_meta:
            out.append((meta, value.detach().to("cpu", copy=True)))
    elif isinstance(value, (list, tuple)) and isinstance(meta, (list, tuple)):
        for v, m in zip(value, meta, strict=False):
            _pair(v, m, out)
    elif isinstance(value, dict) and isinstance(meta, dict):
        for k, v in value.items():
            _pair(v, meta.get(k), out)


def meta_twin(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` that shares nothing with it, every tensor on the meta device (no data copied).

    Examples:
        >>> import torch
        >>> lin = torch.nn.Linear(4, 3)
        >>> twin = meta_twin(lin)
        >>> twin.weight.device.type, twin.weight.shape, twin.weight is lin.weight
        ('meta', torch.Size([3, 4]), False)
    """
    # deepcopy with a memo: every tensor, empty container and plain module made here first; a plain module's
    # __dict__ copied here as deepcopy would copy it (its generic protocol and per-value calls cost most of a copy)
    memo: dict[int, Any] = {}
    shells: list[tuple[nn.Module, nn.Module]] = []
    for module in model.modules():
        for value in (*param_dict(module).values(), *buffer_dict(module).values(), *vars(module).values()):
            if isinstance(value, Tensor):
                if id(value) not in memo:
                    memo[id(value)] = _meta(value)
            elif type(value) in _EMPTY and not value:  # what deepcopy makes of it, without its reduce protocol:
                memo[id(value)] = type(value)()  # a module's many empty hook dicts cost most of a copy
        cls = type(module)
        if _pickled_as_module(cls):  # what deepcopy does for it, without its generic protocol (below)
            memo[id(module)] = shell = cls.__new__(cls)
            shells.append((module, shell))
    for module, shell in shells:  # every module's twin exists now: children and references find theirs in memo
        state = {k: _copied(v, memo) for k, v in nn.Module.__getstate__(module).items()}  # type: ignore[no-untyped-call]
        nn.Module.__setstate__(shell, state)  # type: ignore[no-untyped-call]  # torch stub
    return copy.deepcopy(model, memo)  # the root's twin from memo (or copied here, if its class pickles itself)


#: container types whose empty instances the twin gets as new empty ones directly (exact types only)
_EMPTY = (dict, OrderedDict, set, list)
#: types deepcopy returns as they are
_ATOMIC = frozenset({type(None), bool, int, float, complex, str, bytes, type, types.FunctionType, range})


def _copied(value: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy(value, memo)``, without its call for what it returns as is or has made already."""
    if type(value) in _ATOMIC:
        return value
    made = memo.get(id(value), memo)  # (memo itself: not there; a value deepcopy made may be falsy)
    if made is not memo:
        return made
    if type(value) is dict:  # a module's _parameters, _buffers, _modules: as deepcopy copies a dict
        out: dict[Any, Any] = {}
        memo[id(value)] = out
        for k, v in value.items():
            out[_copied(k, memo)] = _copied(v, memo)
        return out
    return copy.deepcopy(value, memo)


def _pickled_as_module(cls: type) -> bool:
    """Whether ``copy.deepcopy`` copies an instance of ``cls`` as it copies a plain ``nn.Module``: a new object
    whose ``nn.Module.__getstate__()`` (its ``__dict__``, less a compiled call) is deep-copied and handed to
    ``nn.Module.__setstate__``."""
    return (
        getattr(cls, "__deepcopy__", None) is None
        and cls not in copyreg.dispatch_table
        and all(getattr(cls, name) is getattr(base, name) for name, base in _MODULE_PROTOCOL)
    )


#: where ``copy.deepcopy`` of a plain module finds how to copy it
_MODULE_PROTOCOL = (
    ("__reduce_ex__", object), ("__reduce__", object), ("__new__", object),
    ("__getstate__", nn.Module), ("__setstate__", nn.Module),
)  # fmt: skip


def run_read_only(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    run: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], T],
) -> tuple[T, Twin]:
    """``run(twin, twin_args, twin_kwargs)`` on a meta twin of ``model``, else on a full copy; which one is said.

    ``model`` and the inputs are never handed to ``run``: every weight, buffer, flag and hook of the
    model, and the random states, are as before whatever ``run`` does. The copy's error is raised
    when both fail.

    Examples:
        >>> import torch
        >>> drop = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(4)).train()
        >>> before = torch.get_rng_state()
        >>> shape, how = run_read_only(drop, (torch.ones(2, 4),), {}, lambda m, a, k: m(*a, **k).shape)
        >>> shape, how, torch.equal(before, torch.get_rng_state()), int(drop[1].num_batches_tracked)
        (torch.Size([2, 4]), 'meta', True, 0)
    """
    with random_states_kept(), torch.no_grad():
        try:
            twin = meta_twin(model)
            meta_args, meta_kwargs = _to_meta(args), _to_meta(kwargs)
            known: list[tuple[Tensor, Tensor]] = []
            _pair(args, meta_args, known)
            _pair(kwargs, meta_kwargs, known)
            with KnownValues(known):  # what comes from the inputs alone can be branched on
                return run(twin, meta_args, meta_kwargs), "meta"
        except Exception:  # a forward that reads values (.item(), if mask.all()): a full copy instead
            pass
    with random_states_kept(), torch.no_grad():
        copied = copy.deepcopy(model)
        inputs = copy.deepcopy((args, kwargs))
        return run(copied, *inputs), "copy"

"""Values the meta twin knows: what the forward computes from its example inputs alone, kept beside the meta tensors.

A meta tensor holds no values, so a forward that branches on one (``if (ids == 0).all():``, ``.item()``,
``.tolist()``) cannot run on the meta twin. Many such branches read only what comes from the example inputs
(token ids, position ids, a mask built from them) and never a weight. :class:`KnownValues` is a
``TorchFunctionMode`` that keeps, beside every meta tensor computed from example inputs and factory calls
(``torch.arange(..., device="meta")``) only, a small CPU tensor with its values, computed by the same
operation on the known values. When a meta tensor is asked for a value (``__bool__``, ``item``, ``tolist``,
``nonzero``, ...), the answer comes from its known values; a tensor that depends on a weight or a buffer has
none, and the call fails as before (the twin's caller then falls back to a full copy). Common operations on
meta tensors are answered from their shapes (:mod:`packedinit.trace.quick`) instead of torch's slow meta path.

The known values are copies of the inputs and results of factory calls: the model, its weights and buffers,
and the caller's inputs are never read or written through them.

The forward tracer rides in this mode (:func:`observed`): told of each op after it ran, it costs no second
mode on the stack, so no second Python dispatch per op of the forward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from packedinit.trace.quick import quick_meta

__all__ = ["KnownValues", "Observe", "observed"]

#: factory functions whose result on the meta device is known from their arguments alone
_FACTORIES = frozenset({"arange", "zeros", "ones", "full", "eye", "linspace", "tensor", "as_tensor", "tril_indices"})
_MAX_NUMEL = 1 << 16  # keep values of small tensors only (example inputs are a batch of 2, a few tokens)
_CPU = torch.device("cpu")


def _on_cpu(kwargs: dict[str, Any]) -> dict[str, Any]:
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "meta":
        return {**kwargs, "device": _CPU}
    return kwargs


def _in_place(name: str) -> bool:
    """Whether an operation of this name writes its first argument (``add_``, ``__setitem__``, ``__iadd__``)."""
    if name.startswith("__"):
        return name == "__setitem__" or (name.startswith("__i") and name not in ("__index__", "__int__", "__invert__"))
    return name.endswith("_")


def _small(out: Any) -> bool:
    """Whether the meta result ``out`` is small enough to compute its values (a huge factory call is not)."""
    if isinstance(out, Tensor):
        return out.numel() <= _MAX_NUMEL
    if isinstance(out, (list, tuple)):
        return all(_small(o) for o in out)
    return True


#: told of one op after it ran: ``(func, args, kwargs, result)``
Observe = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any], Any], None]


class _Active(threading.local):
    now: KnownValues | None = None


_ACTIVE = _Active()


@contextmanager
def observed(mode: TorchFunctionMode, observe: Observe) -> Iterator[None]:
    """Tell ``observe`` (``mode``'s own handler after the op) of every op of the code inside: as the observer of this
    thread's innermost :class:`KnownValues` (one mode on the stack instead of two: one dispatch per op), else
    with ``mode`` entered."""
    known = _ACTIVE.now
    if known is None or known.observer is not None:
        with mode:
            yield
        return
    known.observer = observe
    try:
        yield
    finally:
        known.observer = None


class KnownValues(TorchFunctionMode):
    """Keeps the values of the meta tensors computed from known ones only, and answers value reads from them.

    Args:
        known: ``[(meta tensor, its values)]``: the meta example inputs with CPU copies of the caller's values.

    Examples:
        >>> import torch
        >>> ids = torch.tensor([[1, 2, 0]])
        >>> meta = ids.to("meta")
        >>> with KnownValues([(meta, ids.clone())]):
        ...     bool((meta == 0).any()), int((meta + 1).sum())
        (True, 6)
    """

    def __init__(self, known: list[tuple[Tensor, Tensor]]) -> None:
        super().__init__()
        self.values: dict[int, tuple[Tensor, Tensor]] = {id(m): (m, v) for m, v in known if v.numel() <= _MAX_NUMEL}
        #: told of every op after it ran, with its result (see :func:`observed`)
        self.observer: Observe | None = None
        self._outer: KnownValues | None = None

    def __enter__(self) -> KnownValues:
        self._outer, _ACTIVE.now = _ACTIVE.now, self
        super().__enter__()  # type: ignore[no-untyped-call]  # torch stub
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.now = self._outer
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # torch stub

    def _value(self, t: Tensor) -> Tensor | None:
        kept = self.values.get(id(t))
        return kept[1] if kept is not None and kept[0] is t else None

    def _swap(self, value: Any) -> tuple[Any, bool]:
        """``value`` with every meta tensor replaced by its known values; False: some meta tensor has none."""
        if isinstance(value, Tensor):
            if not value.is_meta:
                return value, True
            known = self._value(value)
            return (known, True) if known is not None else (value, False)
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            items = [self._swap(v) for v in value]
            return type(value)(v for v, _ in items), all(ok for _, ok in items)
        return value, True

    def _on_values(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
        """``func`` run on the known values; False where some meta argument has none or it cannot run."""
        metas = False
        for a in (*args, *kwargs.values()):
            if isinstance(a, Tensor) and a.is_meta:
                if id(a) not in self.values:
                    return None, False  # the common case: a meta tensor of unknown values (from a weight)
                metas = True
        if not metas and not (getattr(func, "__name__", "") in _FACTORIES and kwargs.get("device") is not None):
            return None, False
        swapped, ok = self._swap(args)
        if not ok:
            return None, False
        by_name: dict[str, Any] = {}
        for k, v in _on_cpu(kwargs).items():
            v, ok = self._swap(v)
            if not ok:
                return None, False
            by_name[k] = v
        try:
            return func(*swapped, **by_name), True
        except Exception:  # the values cannot say it either (devices mixed, an op only meta has): unknown
            return None, False

    def _reads_known(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a tensor argument (not one in a list) holds known values: only then can the op's result have
        them (:meth:`_on_values` reads no other), or an in-place op drop them (``out=`` included)."""
        values = self.values
        if not values:
            return False
        for a in args:
            if isinstance(a, Tensor) and id(a) in values:
                return True
        return any(isinstance(a, Tensor) and id(a) in values for a in kwargs.values()) if kwargs else False

    def _keep(self, out: Any, value: Any) -> None:
        if isinstance(out, Tensor) and isinstance(value, Tensor):
            if out.is_meta and value.device == _CPU and value.shape == out.shape and value.numel() <= _MAX_NUMEL:
                self.values[id(out)] = (out, value)
        elif isinstance(out, (list, tuple)) and isinstance(value, (list, tuple)) and len(out) == len(value):
            for o, v in zip(out, value, strict=True):
                self._keep(o, v)

    @staticmethod
    def _mirror(value: Any) -> Any:
        """A value computed on known values as the forward expects it: tensors on meta, the rest as is."""
        if isinstance(value, Tensor):
            return torch.empty_like(value, device="meta")
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(KnownValues._mirror(v) for v in value)
        return value

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = self._run(func, args, kwargs)
        if self.observer is not None:
            self.observer(func, args, kwargs, out)
        return out

    def _run(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            out = quick_meta(func, args, kwargs)
            if out is None:
                out = func(*args, **kwargs)
        except Exception:  # a value a meta tensor does not hold (.item(), bool(), nonzero): from the known values
            value, ok = self._on_values(func, args, kwargs)
            if not ok:
                raise
            out = self._mirror(value)
            self._keep(out, value)
            return out
        if not self._reads_known(args, kwargs) and getattr(func, "__name__", "") not in _FACTORIES:
            return out  # no argument of known values (most ops: of a weight): nothing to compute, nothing to drop
        value, ok = self._on_values(func, args, kwargs) if _small(out) else (None, False)
        if ok:
            self._keep(out, value)
        else:  # written in place from something unknown (add_, x[i] = w, out=): its values are unknown now
            written = args[0] if args and _in_place(getattr(func, "__name__", "")) else None
            for t in (out, written, kwargs.get("out")):
                if isinstance(t, Tensor) and id(t) in self.values:
                    del self.values[id(t)]
        return out

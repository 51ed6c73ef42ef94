"""The tracer as the idioms use it: inputs built from the model, moved to its device, nothing left changed.

:func:`trace_model` is what ``packedinit`` installs in :mod:`packedinit.model.found`: it traces a
model on the inputs given (or built by :func:`~packedinit.trace.inputs.example_inputs`) with the
model's twin in eval mode (the model's own flags are never set, not even for a moment: another
thread may read them) and every RNG state saved and restored, so the idioms' results do not depend
on whether a trace ran. On built inputs the result is kept per architecture too (the class, the
config, the parameters' shapes): a second model built from the same config is not traced again.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from packedinit.errors import PackedInitError
from packedinit.model import found
from packedinit.trace.forward import Inferred, trace_layouts
from packedinit.trace.inputs import example_inputs

__all__ = ["trace_model", "forget"]


def _device(model: nn.Module) -> torch.device | None:
    for p in model.parameters():
        return p.device
    return None


def _moved(value: Any, device: torch.device | None) -> Any:
    if device is not None and isinstance(value, Tensor) and value.device != device:
        return value.to(device)
    return value


def trace_model(
    model: nn.Module, args: tuple[Any, ...] | None, kwargs: Mapping[str, Any]
) -> dict[str, Inferred] | None:
    """What the forward shows about ``model``; ``args=None``: on inputs built from it (None: none, or it failed).

    Examples:
        >>> import torch
        >>> trace_model(torch.nn.Linear(2, 2), None, {}) is None  # no inputs can be built
        True
        >>> trace_model(torch.nn.Linear(2, 2), (torch.ones(1, 2),), {})["weight"].verdict
        'not packed'
    """
    built = args is None
    key: tuple[object, ...] | None = None
    if args is None:
        got = example_inputs(model)
        if got is None:
            return None
        key = _architecture(model)
        kept = _BY_ARCHITECTURE.get(key) if key is not None else None
        if kept is not None:
            return dict(kept)
        device = _device(model)
        args = tuple(_moved(a, device) for a in got[0])
        kwargs = {k: _moved(v, device) for k, v in got[1].items()}
    try:  # on a twin in eval mode: the model itself, its flags and every RNG state are never touched
        found = trace_layouts(model, args, dict(kwargs), eval_mode=True)
    except PackedInitError:
        if built:
            return None  # the idioms then name what looks packed
        raise
    if key is not None:
        with _lock:
            _BY_ARCHITECTURE[key] = found
            while len(_BY_ARCHITECTURE) > 64:
                _BY_ARCHITECTURE.pop(next(iter(_BY_ARCHITECTURE)))
    return found


#: What the forward showed, by architecture (class path, config, parameter names and shapes): a second
#: model built from the same config is not traced again. Only strings and Inferred values are kept.
_BY_ARCHITECTURE: dict[tuple[object, ...], dict[str, Inferred]] = {}
_lock = threading.Lock()


def forget(model: nn.Module) -> None:
    """Drop every trace kept of ``model``: its own and its architecture's (the benchmarks' first-call rows)."""
    key = _architecture(model)
    with _lock:
        if key is not None:
            _BY_ARCHITECTURE.pop(key, None)
    found.forget(model)


def _architecture(model: nn.Module) -> tuple[object, ...] | None:
    """A key for inputs built from the model's config: the class, the config as JSON, every parameter's shape."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    try:
        text = to_json(use_diff=False)
    except Exception:  # a config that cannot say itself: trace this model on its own
        return None
    cls = type(model)
    shapes = tuple((n, tuple(p.shape), p.dtype) for n, p in model.named_parameters())
    return (f"{cls.__module__}.{cls.__qualname__}", text, shapes)

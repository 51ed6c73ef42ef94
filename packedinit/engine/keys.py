"""Cache keys derived from a request's own fields, holding no object the caller passed.

:func:`request_key` walks every field of a request (a dataclass) and turns each value
into a key part with :func:`value_key`. Nothing is listed by hand: a field added to the
request is in the key at once, and a value of a kind this module does not know makes the
request uncacheable (``None``) instead of being silently ignored.

A key part keeps what the result depends on and nothing that lives on the caller's side:

- numbers by type and bits (``1``, ``1.0`` and ``True`` hash alike but are checked
  differently; ``0.0`` and ``-0.0`` compare equal but write different bits; NaN payloads);
- the tensor to initialise (a field with ``metadata={"key": "facts"}``) by the facts the
  checks read (type, shape, strides, dtype, device, inference state), never the tensor;
  a tensor anywhere else (an argument) is uncacheable: its values matter;
- a ``torch.Generator`` by its device (which the checks read), never the generator: the
  caches keep no generator alive, and a plan is bound to the caller's generator per call;
- ``torch.nn.init`` functions (module-level, torch's own) as themselves, and a
  ``functools.partial`` of one by its function and argument values, never the partial;
- a :class:`~packedinit.layout.Layout` as itself (an immutable value of packedinit's).

Anything else (a user function, a tensor argument, an arbitrary object) is uncacheable.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from packedinit.engine.traits import TORCH_FNS, hashable_in
from packedinit.layout import Layout

__all__ = ["UncacheableError", "value_key", "tensor_key", "request_key"]


class UncacheableError(Exception):
    """A value :func:`value_key` cannot turn into a key part that holds no caller object."""


_ATOMS = (type(None), bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def tensor_key(t: Tensor) -> tuple[object, ...]:
    """What the checks read of a tensor: type, shape, strides, dtype, device, inference state."""
    return (
        "tensor",
        type(t),
        tuple(t.shape),
        tuple(t.stride()) if t.layout == torch.strided else None,
        t.layout,
        t.dtype,
        t.device,
        t.is_inference(),
    )


def value_key(x: object) -> object:
    """A hashable key part for ``x`` that holds no object the caller made; raises :class:`UncacheableError`.

    Examples:
        >>> value_key(0.0) == value_key(-0.0), value_key(1) == value_key(True)
        (False, False)
    """
    kind = type(x)
    if kind in _ATOMS:
        return (kind, x)
    if kind is float:
        return (float, struct.pack("<d", x))  # every bit: the sign of zero, NaN payloads
    if kind in (tuple, list):
        return (kind, tuple(value_key(e) for e in x))  # type: ignore[attr-defined]  # a tuple or list
    if kind in (dict, MappingProxyType):
        m: Mapping[object, object] = x  # type: ignore[assignment]  # checked above
        return (dict, tuple((value_key(k), value_key(v)) for k, v in m.items()))
    if kind is torch.Generator:
        return ("generator", x.device)  # type: ignore[attr-defined]  # a torch.Generator
    if kind is Layout:
        return x
    if kind is functools.partial:
        p: functools.partial[Any] = x  # type: ignore[assignment]  # checked above
        return ("partial", value_key(p.func), value_key(p.args), value_key(p.keywords))
    if hashable_in(x, TORCH_FNS):
        return x
    raise UncacheableError(kind.__name__)


def request_key(req: object, *extra: object) -> tuple[object, ...] | None:
    """A key for the dataclass ``req``: every field's :func:`value_key`, then ``extra``; ``None`` if uncacheable.

    The global inference mode is part of it (the checks read it); ``extra`` holds what the
    caller's cache adds (the plan cache: whether the whole-model dry run was asked for).
    """
    assert dataclasses.is_dataclass(req)
    try:
        parts = tuple(
            tensor_key(v) if f.metadata.get("key") == "facts" and isinstance(v, Tensor) else value_key(v)
            for f in dataclasses.fields(req)
            for v in (getattr(req, f.name),)
        )
    except UncacheableError:
        return None
    return (type(req), *parts, torch.is_inference_mode_enabled(), *extra)

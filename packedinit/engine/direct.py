"""Direct draws: the one ``Tensor.uniform_`` / ``normal_`` call a ``torch.nn.init`` function makes on a block,
computed from the block's fans so the executor may make it itself, and when neighbouring draws may be one call."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from packedinit.engine.traits import TORCH_INIT, base, bound_args, hashable_in

__all__ = ["DirectDraw", "direct_draw", "draw", "joins"]

_init = TORCH_INIT

_DIRECT: frozenset[Callable[..., Tensor]] = frozenset(
    {
        _init.uniform_,
        _init.xavier_uniform_,
        _init.kaiming_uniform_,
        _init.normal_,
        _init.xavier_normal_,
        _init.kaiming_normal_,
    }
)
_PLAIN_NUMBER = (int, float)
#: A draw the executor may make itself: ("uniform", low, high) or ("normal", mean, std).
DirectDraw = tuple[str, float, float]


def direct_draw(
    fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any], fan_in: int | None, fan_out: int | None
) -> DirectDraw | None:
    """The one ``Tensor.uniform_``/``normal_`` call ``fn(block, *args, **kwargs)`` makes, or ``None``.

    For ``uniform_``, ``normal_``, ``xavier_*`` and ``kaiming_*`` (also as partials) with plain
    number arguments: the same float arithmetic as ``torch.nn.init`` on a block with these
    fans, so the executor may make that call itself (merged with neighbours, or in bands, where
    that draws the same numbers): the same draws, bit for bit, without the Python wrapper's
    per-call cost (the engine tests compare every layout against torch's own functions on
    separate tensors). ``None`` for anything else: then the function itself is called.
    """
    b = base(fn)
    if not hashable_in(b, _DIRECT):
        return None
    got = bound_args(fn, args, kwargs)
    if got is None or got.get("generator") is not None:
        return None
    if b is _init.uniform_ or b is _init.normal_:
        x, y = (got["a"], got["b"]) if b is _init.uniform_ else (got["mean"], got["std"])
        if type(x) not in _PLAIN_NUMBER or type(y) not in _PLAIN_NUMBER:
            return None
        return ("uniform" if b is _init.uniform_ else "normal"), float(x), float(y)
    if fan_in is None or fan_out is None or fan_in <= 0 or fan_out <= 0:
        return None
    if b is _init.xavier_uniform_ or b is _init.xavier_normal_:
        gain = got["gain"]
        if type(gain) not in _PLAIN_NUMBER:
            return None
        std = gain * math.sqrt(2.0 / float(fan_in + fan_out))
        if b is _init.xavier_normal_:
            return "normal", 0.0, std
        a = math.sqrt(3.0) * std
        return "uniform", -a, a
    slope, mode, nonlinearity = got["a"], got["mode"], got["nonlinearity"]
    if type(slope) not in _PLAIN_NUMBER or not isinstance(mode, str) or not isinstance(nonlinearity, str):
        return None
    mode = mode.lower()
    if mode not in ("fan_in", "fan_out"):
        return None
    fan = fan_in if mode == "fan_in" else fan_out
    try:
        gain = _init.calculate_gain(nonlinearity, slope)
    except ValueError:
        return None
    std = gain / math.sqrt(fan)
    if b is _init.kaiming_normal_:
        return "normal", 0.0, std
    bound = math.sqrt(3.0) * std
    return "uniform", -bound, bound


def draw(t: Tensor, d: DirectDraw, generator: torch.Generator | None) -> None:
    """Make the draw :func:`direct_draw` described, in place on ``t``."""
    if d[0] == "uniform":
        t.uniform_(d[1], d[2], generator=generator)
    else:
        t.normal_(d[1], d[2], generator=generator)


def joins(d: DirectDraw, total: int, aligned: bool, numel: int) -> bool:
    """Whether a block of ``numel`` elements may join a run already drawn with ``d`` in one call.

    ``total``: the elements already in the run; ``aligned``: every block in it has a multiple
    of 16 elements. One call then draws exactly what one call per block draws (see
    :func:`normal_merges` for ``normal_``; ``uniform_`` draws one number per element in memory
    order, so it always does).
    """
    if d[0] == "uniform" or total + numel < 16:
        return True
    return aligned and numel >= 16

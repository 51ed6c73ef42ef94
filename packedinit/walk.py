"""Whole-model init: resolve every parameter to its Layout once, init a model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

from .errors import PackedInitError
from .layout import Chunks

__all__: list[str] = []


def _module_call(
    module: nn.Module,
    init_fn: Callable[..., Tensor],
    chunks: Chunks | None,
    dim: int | None,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    from_apply: bool,
) -> None:
    """``chunked(f)(module)``: placeholder until the registry lands."""
    raise PackedInitError("chunked(f)(module) is not implemented yet")

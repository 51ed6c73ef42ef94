"""DTensor / FSDP2 parameters: each rank fills only its local shard."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from .errors import PackedInitError
from .layout import Chunks

__all__: list[str] = []


def init_dtensor(
    tensor: Tensor,
    chunks: Chunks | None,
    dim: int | None,
    init_fn: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    param: str | None = None,
) -> None:
    """Placeholder until DTensor support lands."""
    raise PackedInitError("DTensor parameters are not supported yet")

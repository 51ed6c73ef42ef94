"""Reading a model's config for the example-input builders: where its tensors live, sizes, sub-configs.

Shared by :mod:`packedinit.trace.inputs` and the per-modality builders beside it. transformers is never
imported: a config is read through its attributes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["BATCH", "TOKENS", "Builder", "Inputs", "image_size", "int_of", "sub_config", "where"]

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
BATCH, TOKENS = 2, 5


def where(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for t in itertools.chain(model.parameters(), model.buffers()):  # lazily: stops at the first (no tree walk)
        if t.is_floating_point():
            return t.device, t.dtype
    first = next(iter(model.parameters()), None)
    return (first.device if first is not None else torch.device("cpu")), torch.get_default_dtype()


def int_of(config: Any, *keys: str, default: int) -> int:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def sub_config(config: Any, *names: str) -> Any:
    for name in names:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            return sub
    return config


def image_size(vision: Any) -> int:
    size = getattr(vision, "image_size", None)
    if isinstance(size, dict):
        size = size.get("height") or next(iter(size.values()), None)
    if isinstance(size, (list, tuple)) and size:
        size = size[0]
    return size if isinstance(size, int) and size > 0 else 224  # a detector's queries need a real feature map



#: Builds one named input from a config, on a device and floating dtype.
Builder = Callable[[Any, torch.device, torch.dtype], Any]

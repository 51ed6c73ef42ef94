"""What every transformers adapter reads: parameters through wrappers, ints from a module or its config.

Shared by :mod:`packedinit.adapters.hf` (fused attention and MLP layers) and
:mod:`packedinit.adapters.hf_experts` (stacked MoE experts). Never imports ``transformers``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from packedinit.errors import PackedInitError
from packedinit.layout import Layout
from packedinit.model.wrappers import find

__all__ = ["M", "tensor", "fit", "int_attr", "qkv"]

M = "transformers.models"


def tensor(module: nn.Module, name: str) -> Tensor | None:
    """The parameter ``name`` (dotted, relative to ``module``, through wrappers), or ``None``; buffers never count."""
    found = find(module, name)
    return None if found is None else found.param


def fit(module: nn.Module, layouts: Mapping[str, Layout]) -> dict[str, Layout]:
    """Drop the layouts of tensors the module registers as ``None`` (``bias=False``); keep the rest.

    A name that does not resolve at all (a wrapper packedinit does not know moved the
    parameter) is kept, so that the registry refuses it loudly, naming the module the
    path stopped at; it is never dropped in silence. The registry also checks every
    kept layout against its parameter's shape and names this adapter when one does not
    fit (a transformers version that packs the layer differently).
    """
    out: dict[str, Layout] = {}
    for name, layout in layouts.items():
        found = find(module, name)
        if found is None or found.param is not None:
            out[name] = layout
    return out


def int_attr(module: nn.Module, *names: str) -> int:
    """The first of ``names`` found as an int on ``module`` or on ``module.config``."""
    config = getattr(module, "config", None)
    for owner in (module, config):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    raise PackedInitError(
        f"{type(module).__qualname__} has none of {list(names)} (as an int on the module or its config), which "
        f"this adapter reads to lay out the packed projection; give the layout yourself with "
        f"packedinit.annotate(module, ...)."
    )


def qkv(prefix: str, layout: Layout, bias: Layout) -> dict[str, Layout]:
    return {f"{prefix}.weight": layout, f"{prefix}.bias": bias}

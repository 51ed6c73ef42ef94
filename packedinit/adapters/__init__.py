"""Built-in adapters (torch.nn; transformers, timm, open_clip, diffusers, torchrl, torchtitan by class path).

Importing this package registers nothing. ``packedinit`` hands :func:`register_builtins` to
the registry (:func:`packedinit.model.registry.set_builtin_loader`), which calls it once, on its
first lookup, registration or listing, so ``import packedinit`` stays cheap
and third-party packages are never imported. A built-in adapter module either defines
``ADAPTERS: Mapping[type | str, Adapter]`` (registered here, in order) or registers its
adapters itself with ``@packedinit.register(...)`` when it is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType

__all__ = ["BUILTIN_MODULES", "register_builtins"]

#: The built-in adapter modules, in registration order.
BUILTIN_MODULES = (
    "packedinit.adapters.torch_nn",
    "packedinit.adapters.hf",
    "packedinit.adapters.libs",
    "packedinit.adapters.titan",
)
#: The built-in adapter modules that must import (torch.nn's); the others may lack an optional dependency.
REQUIRED_MODULES = frozenset({"packedinit.adapters.torch_nn"})


def __getattr__(name: str) -> ModuleType:
    """``packedinit.adapters.hf`` (or ``.torch_nn``) works without importing it first (PEP 562)."""
    if f"{__name__}.{name}" in BUILTIN_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _import_optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:  # a real missing dependency inside the module: don't hide it
            raise
        return None


def register_builtins() -> None:
    """Import every built-in adapter module and register its ``ADAPTERS`` table."""
    from packedinit.model.registry import register

    for name in BUILTIN_MODULES:
        module = importlib.import_module(name) if name in REQUIRED_MODULES else _import_optional(name)
        table = getattr(module, "ADAPTERS", None) if module is not None else None
        if isinstance(table, Mapping):
            for key, adapter in table.items():
                register(key)(adapter)

"""Built-in adapters (torch.nn, transformers-style fused layers by class path) and user helpers.

Importing this package registers nothing. The registry calls :func:`_register_builtins`
once, on its first lookup, registration or listing, so ``import packedinit`` stays cheap
and third-party packages are never imported. A built-in adapter module either defines
``ADAPTERS: Mapping[type | str, Adapter]`` (registered here, in order) or registers its
adapters itself with ``@packedinit.register(...)`` when it is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType

__all__: list[str] = []

#: The built-in adapter modules, in registration order.
BUILTIN_MODULES = ("packedinit.adapters.torch_nn", "packedinit.adapters.hf")


def _import_optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:  # a real missing dependency inside the module: don't hide it
            raise
        return None


def _register_builtins() -> None:
    """Import every built-in adapter module and register its ``ADAPTERS`` table."""
    from ..registry import register

    for name in BUILTIN_MODULES:
        module = importlib.import_module(name) if name.endswith(".torch_nn") else _import_optional(name)
        table = getattr(module, "ADAPTERS", None) if module is not None else None
        if isinstance(table, Mapping):
            for key, adapter in table.items():
                register(key)(adapter)

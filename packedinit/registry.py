"""Adapters: module type (or instance) -> {param name: Layout}. (Stub: filled by issue 3.)"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TypeAlias, TypeVar

from torch import nn

from .layout import Layout

__all__ = ["Adapter", "register", "unregister", "registered", "annotate", "layouts"]

#: An adapter: ``fn(module) -> {param name relative to module: Layout}``.
Adapter: TypeAlias = Callable[[nn.Module], Mapping[str, Layout]]
A = TypeVar("A", bound=Adapter)
Key: TypeAlias = type[nn.Module] | str
Mod = TypeVar("Mod", bound=nn.Module)


def register(key: Key, *, replace: bool = False) -> Callable[[A], A]:
    """Register an adapter for a module type or class path (stub)."""
    raise NotImplementedError


def unregister(key: Key) -> Adapter | None:
    """Remove and return the adapter registered for ``key`` (stub)."""
    raise NotImplementedError


def registered() -> Mapping[Key, Adapter]:
    """A read-only view of the registered adapters (stub)."""
    return MappingProxyType({})


def annotate(module: Mod, **param_layouts: Layout) -> Mod:
    """Mark packed parameters of one module instance (stub)."""
    raise NotImplementedError


def layouts(model: nn.Module) -> dict[str, Layout]:
    """Every packed parameter of ``model`` by fully qualified name (stub)."""
    raise NotImplementedError

"""transformers configs recognised without importing transformers: a config, a config class, and every key
a config class knows."""

from __future__ import annotations

import inspect

__all__ = ["is_hf_config", "is_hf_config_class", "config_keys"]


def is_hf_config(obj: object) -> bool:
    """Whether ``obj`` is a transformers config (an instance of ``PretrainedConfig``)."""
    return any(
        c.__name__ in ("PretrainedConfig", "PreTrainedConfig") and c.__module__.startswith("transformers")
        for c in type(obj).__mro__
    )


def is_hf_config_class(obj: object) -> bool:
    """Whether ``obj`` is a transformers config class (a subclass of ``PretrainedConfig``)."""
    return isinstance(obj, type) and any(
        c.__name__ in ("PretrainedConfig", "PreTrainedConfig") and c.__module__.startswith("transformers")
        for c in obj.__mro__
    )


def config_keys(cls: type) -> set[str] | None:
    """Every key a config class knows: its fields, aliases, ``__init__`` parameters and settable properties."""
    try:
        fresh = cls()
    except Exception:  # a config without defaults: its keys cannot be listed, so they are not checked
        return None
    keys = set(fresh.to_dict()) | set(vars(fresh)) | set(getattr(cls, "attribute_map", {}))
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if callable(init):
            keys |= set(inspect.signature(init).parameters) - {"self", "args", "kwargs"}
    keys |= {n for n in dir(cls) if isinstance(inspect.getattr_static(cls, n, None), property)}
    return keys

"""torchvision's two op schemas, so that timm and open_clip import beside a CPU torch (no op is run).

The one shim is ``tests/torchvision_shim.py`` (its docstring says why it is needed); this module keeps
the name the ``test_model_init_*`` files import and loads the shim by its path, as ``tests/conftest.py``
does (the tests folder is not a package).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SHIM = Path(__file__).with_name("torchvision_shim.py")
_LOADED: list[ModuleType] = []  # keeps the shim module, and so the schemas it defines, alive


def define_torchvision_ops() -> None:
    """Define the ``torchvision::nms`` / ``torchvision::qnms`` schemas once (idempotent)."""
    if _LOADED:
        return
    spec = importlib.util.spec_from_file_location("packedinit_tests_torchvision_shim", SHIM)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()
    _LOADED.append(module)

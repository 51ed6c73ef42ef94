"""torchvision's two op schemas, so that timm and open_clip import beside a CPU torch (no op is run).

The one shim is ``tests/torchvision_shim.py`` (its docstring says why it is needed); this module keeps
the name the ``test_model_init_*`` files import.
"""

from __future__ import annotations

from torchvision_shim import install


def define_torchvision_ops() -> None:
    """Define the ``torchvision::nms`` / ``torchvision::qnms`` schemas once (idempotent)."""
    install()

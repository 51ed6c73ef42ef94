"""Let timm and open_clip import beside a torchvision whose C++ ops cannot load.

torchvision's only wheel for torch 2.13 is a CUDA build; next to the CPU torch its ``_C`` library
does not load, and ``import torchvision`` then fails in ``torchvision/_meta_registrations.py``, which
calls ``torch.library.register_fake("torchvision::nms")`` (and ``"torchvision::qnms"``) for operators
that only the C++ library defines ("RuntimeError: operator torchvision::nms does not exist").
timm and open_clip import torchvision (transforms, datasets) but no model constructor runs a
torchvision operator. :func:`install` defines those two operator schemas (as torchvision's C++ code
declares them, ``torchvision/csrc/ops/nms.cpp``) so the import goes through; calling either operator
still fails, as it would have. Where torchvision's ops do load, or the schemas exist, it does nothing.
Used by the ``lib`` fixture in ``tests/conftest.py`` before it imports a library.
"""

from __future__ import annotations

import importlib.util

import torch

#: The operator schemas torchvision's import registers fake (meta) kernels for without checking them.
SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARY: list[torch.library.Library] = []  # keeps the fragment (and so the schemas) alive


def _defined(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def install() -> None:
    """Define the torchvision operator schemas its import needs, when torchvision is installed and lacks them."""
    if _LIBRARY or importlib.util.find_spec("torchvision") is None:
        return
    missing = [name for name in SCHEMAS if not _defined(name)]
    if not missing:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        lib.define(SCHEMAS[name])
    _LIBRARY.append(lib)

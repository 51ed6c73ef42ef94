"""torchvision's two op schemas, so that timm and open_clip import beside a CPU torch (no op is run).

torchvision 0.29.1's only wheel for torch 2.13 is a CUDA build whose C ops cannot load next to the
CPU torch; its Python import registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``
and fails when the schemas do not exist. Defining the two schemas first lets it import.
"""

from __future__ import annotations

import torch

_LIB: list[torch.library.Library] = []


def define_torchvision_ops() -> None:
    """Define the ``torchvision::nms`` / ``torchvision::qnms`` schemas once (idempotent)."""
    if _LIB:
        return
    try:
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:  # already defined (by torchvision's own C ops or another shim)
        return
    _LIB.append(lib)

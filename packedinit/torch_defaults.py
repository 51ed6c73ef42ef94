"""``packedinit.torch_defaults``: the documented path of the process-wide fix.

The code lives in :mod:`packedinit.recipes.torch_defaults`.
"""

from __future__ import annotations

from packedinit.recipes.torch_defaults import TorchDefaultsFix, fix_torch_defaults, torch_defaults_fixed

__all__ = ["TorchDefaultsFix", "fix_torch_defaults", "torch_defaults_fixed"]

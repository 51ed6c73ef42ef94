"""diffusers: models initialise with torch's defaults at construction, so the meta flow gives them; what ``__init__``
computes outside any init (DiT's sin-cos position buffer) is refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the tests' private helpers (--import-mode=importlib adds none)
from _model_init_check import eager_and_meta, mismatches
from _tv_ops import define_torchvision_ops

import packedinit
from packedinit.errors import PackedInitError

define_torchvision_ops()  # diffusers imports transformers, which imports torchvision when it is installed
diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install diffusers)")


def test_unet2d_meta_flow_is_like_eager() -> None:
    def build() -> torch.nn.Module:
        model: torch.nn.Module = diffusers.UNet2DModel(
            sample_size=16,
            block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            layers_per_block=1,
            norm_num_groups=8,
        )
        return model

    eager, meta_built = eager_and_meta(build)
    packedinit.reset_parameters(meta_built)
    assert mismatches(eager, meta_built) == []


def test_dit_sincos_buffer_is_refused_by_name() -> None:
    with torch.device("meta"):
        model = diffusers.DiTTransformer2DModel(
            num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=1, sample_size=8, patch_size=2
        )
    model.to_empty(device="cpu")
    with pytest.raises(PackedInitError, match=r"buffer 'pos_embed\.pos_embed' \(shape \(1, 16, 32\), non-persistent"):
        packedinit.reset_parameters(model)

"""example_inputs for vision and multimodal models (packedinit/trace/inputs_vision.py): real transformers models,
built tiny from their config classes, get inputs their own forward accepts, and the tracer follows them.

Before: each of these had no input (``example_inputs`` gave ``None`` or one the forward refused: a missing
``bbox``, ``visual_feats``, ``spatial_shapes``; a square image for a 32 x 128 model; a prompt without its
image tokens), so the sweep could not trace it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import packedinit
from packedinit.trace.inputs import example_inputs

transformers = pytest.importorskip("transformers", reason="the models of issue 26 are transformers models")
SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}


def _siglip2() -> nn.Module:
    return transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(**SMALL, patch_size=4, num_patches=16))


def _lxmert() -> nn.Module:
    cfg = transformers.LxmertConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, intermediate_size=64, l_layers=1, x_layers=1,
        r_layers=1, visual_feat_dim=16, visual_pos_dim=4,
    )  # fmt: skip
    return transformers.LxmertModel(cfg)


def _bros() -> nn.Module:
    cfg = transformers.BrosConfig(**{**SMALL, "hidden_size": 128}, vocab_size=64)  # box widths: hidden // 4 // 8
    return transformers.BrosModel(cfg)


def _mgp_str() -> nn.Module:
    cfg = transformers.MgpstrConfig(**SMALL, image_size=[8, 16], patch_size=4, max_token_length=5)
    return transformers.MgpstrForSceneTextRecognition(cfg)


def _gemma4_vision() -> nn.Module:
    cfg = transformers.Gemma4VisionConfig(**SMALL, num_key_value_heads=2, head_dim=16, patch_size=4)
    return transformers.Gemma4VisionModel(cfg)


def _blip2() -> nn.Module:
    cfg = transformers.Blip2Config(
        vision_config={**SMALL, "image_size": 16, "patch_size": 8},
        qformer_config={**SMALL, "vocab_size": 64, "encoder_hidden_size": 32},
        text_config={"model_type": "opt", **SMALL, "ffn_dim": 64, "vocab_size": 64, "word_embed_proj_dim": 32},
        num_query_tokens=3, image_token_index=63,
    )  # fmt: skip
    return transformers.Blip2Model(cfg)


def _hunyuan_vision() -> nn.Module:
    return transformers.HunYuanVLVisionTransformer(transformers.HunYuanVLVisionConfig(**SMALL))


def _kimi_vision() -> nn.Module:
    return transformers.Kimi_K25VisionModel(transformers.Kimi_K25VisionConfig(**SMALL))


BUILDS: dict[str, Callable[[], nn.Module]] = {
    "siglip2 (patches and spatial_shapes)": _siglip2,
    "lxmert (visual_feats, visual_pos)": _lxmert,
    "bros (bbox)": _bros,
    "mgp-str (a 8 x 16 image)": _mgp_str,
    "gemma4 vision (pixel_position_ids)": _gemma4_vision,
    "blip-2 (image tokens in the prompt)": _blip2,
    "hunyuan-vl vision (flat patches it reshapes itself)": _hunyuan_vision,
    "kimi-k2.5 vision (patch images for its Conv2d)": _kimi_vision,
}


@pytest.mark.parametrize("build", BUILDS.values(), ids=list(BUILDS))
def test_the_forward_accepts_the_built_inputs_and_is_traced(build: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    model = build().eval()
    built = example_inputs(model)
    assert built is not None
    args, kwargs = built
    with torch.no_grad():
        model(*args, **kwargs)  # the model's own forward takes them
    found = packedinit.infer_layouts(model, *args, **kwargs)
    weights = {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert found
    assert set(found) <= weights


def test_the_shapes_follow_the_config() -> None:
    siglip = _siglip2()
    kwargs = example_inputs(siglip)[1]  # type: ignore[index]
    patches = siglip.config.num_patches
    assert kwargs["pixel_values"].shape[1:] == (patches, 3 * siglip.config.patch_size**2)
    assert kwargs["spatial_shapes"].prod(-1).tolist() == [patches] * kwargs["pixel_values"].shape[0]
    mgp = _mgp_str()
    assert tuple(example_inputs(mgp)[1]["pixel_values"].shape[-2:]) == tuple(mgp.config.image_size)  # type: ignore[index]
    # a p x p Conv2d embeds both: Kimi's forward takes patch images, HunYuan-VL's the flat patches (tried on meta)
    assert example_inputs(_kimi_vision())[1]["pixel_values"].dim() == 4  # type: ignore[index]
    assert example_inputs(_hunyuan_vision())[1]["pixel_values"].dim() == 2  # type: ignore[index]
    blip = _blip2()
    ids = example_inputs(blip)[1]["input_ids"]  # type: ignore[index]
    assert ((ids == blip.config.image_token_index).sum(-1) == blip.config.num_query_tokens).all()


def _sweep() -> Any:
    path = Path(__file__).resolve().parents[1] / "docs" / "scripts" / "sweep.py"
    spec = importlib.util.spec_from_file_location("sweep", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sweep_keeps_a_stage_count_and_makes_its_stages_shallow() -> None:
    """Before: ConvNeXt's num_hidden_layers (its num_stages) went to 1, so the last LayerNorm (768, the fourth
    stage's width) met the first stage's 96 channels."""
    if not hasattr(transformers.ConvNextConfig(), "num_hidden_layers"):
        pytest.skip("this transformers' ConvNextConfig has no num_hidden_layers (5.20): the shrink leaves its stages")
    cfg = _sweep().shrink(transformers.ConvNextConfig())
    assert cfg.num_stages == len(cfg.hidden_sizes)
    assert list(cfg.depths) == [1] * cfg.num_stages
    model = transformers.ConvNextModel(cfg).eval()
    args, kwargs = example_inputs(model)  # type: ignore[misc]
    assert packedinit.infer_layouts(model, *args, **kwargs)

"""open_clip 3.3.0 with its real constructor (issue 27): its own ``Attention.in_proj_weight`` (the 'custom' blocks)
and the ``nn.MultiheadAttention`` of the default blocks, checked against the forward, and the whole story.
Skips, naming open_clip, where it is not installed (.ci/libs.txt installs it with --no-deps)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import packedinit

BLOCKS = ["default", "custom"]


def _clip(lib: Any, block_type: str) -> nn.Module:
    oc = lib("open_clip.model")
    vision = oc.CLIPVisionCfg(layers=2, width=64, head_width=16, patch_size=8, image_size=32, block_type=block_type)
    text = oc.CLIPTextCfg(context_length=8, vocab_size=64, width=32, heads=4, layers=2, block_type=block_type)
    model: nn.Module = oc.CLIP(embed_dim=16, vision_cfg=vision, text_cfg=text)
    return model


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3, 32, 32), torch.randint(0, 64, (2, 8))


@pytest.mark.parametrize("block_type", BLOCKS)
def test_every_in_proj_weight_has_the_layout_its_forward_splits_by(block_type: str, lib: Any, story: Any) -> None:
    model = _clip(lib, block_type)
    found = packedinit.layouts(model)
    weights = [n for n, p in model.named_parameters() if n.endswith("in_proj_weight")]
    assert len(weights) == 4
    for n in weights:
        out = dict(model.named_parameters())[n].shape[0]
        # open_clip/transformer.py:159 F.linear(x, in_proj_weight, in_proj_bias).chunk(3, dim=-1) (custom);
        # nn.MultiheadAttention's F._in_projection_packed: w.chunk(3) (default)
        oracle = [c.tolist() for c in torch.arange(out).chunk(3)]
        assert story.rows(found[n], out) == oracle, n
        assert found[n].names == ("q", "k", "v")


@pytest.mark.parametrize("block_type", BLOCKS)
def test_infer_layouts_finds_each_layout(block_type: str, lib: Any, story: Any) -> None:
    model = _clip(lib, block_type)
    found = packedinit.layouts(model)
    inferred = packedinit.infer_layouts(model, *_inputs())
    weights = [n for n in found if n.endswith("in_proj_weight")]
    assert weights
    for n in weights:
        if block_type == "default":  # nn.MultiheadAttention runs a fused kernel the tracer cannot follow
            assert inferred[n].verdict in ("packed", "opaque"), (n, inferred[n])
        else:
            assert inferred[n].verdict == "packed", (n, inferred[n])
        if inferred[n].verdict == "packed":
            assert story.same_layout(inferred[n].layout, found[n]), n


def test_audit_and_its_printed_fix_default_blocks(lib: Any, story: Any) -> None:
    """The vision tower's ``nn.MultiheadAttention`` keeps torch's default (xavier_uniform_ on the whole
    ``in_proj_weight``); the text tower's ``init_parameters`` redraws its own with ``normal_(std=...)``."""
    torch.manual_seed(0)
    before = story.audit_fix_works(_clip(lib, "default"))
    assert set(before.affected) == {f"visual.transformer.resblocks.{i}.attn.in_proj_weight" for i in range(2)}


def test_audit_custom_blocks_not_affected(lib: Any) -> None:
    """open_clip's own ``Attention`` draws ``randn * head_dim ** -0.5`` (transformer.py:119), which reads no fan."""
    torch.manual_seed(0)
    report = packedinit.audit(_clip(lib, "custom"))
    assert report.affected == (), report.answer()
    assert report.fix() is None


@pytest.mark.parametrize("block_type", BLOCKS)
def test_fix_torch_defaults_builds_per_block_and_identical_elsewhere(block_type: str, lib: Any, story: Any) -> None:
    story.fix_builds_per_block(lambda: _clip(lib, block_type))


@pytest.mark.parametrize("block_type", BLOCKS)
def test_chunked_is_per_block(block_type: str, lib: Any, story: Any) -> None:
    story.chunked_is_per_block(_clip(lib, block_type), torch.nn.init.xavier_uniform_)

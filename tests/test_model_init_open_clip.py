"""open_clip: ``init_parameters()`` runs in the meta flow; what ``__init__`` draws outside it is refused by name.

open_clip's towers set ``class_embedding``, ``positional_embedding`` and ``proj`` from
``scale * torch.randn(...)`` and ``logit_scale`` from a constant in ``__init__``: no init function or
method makes them, so a meta build cannot reproduce them and ``reset_parameters`` names them
(with the entry points it ran) instead of leaving uninitialised memory.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the tests' private helpers (--import-mode=importlib adds none)
from _model_init_check import eager_and_meta, mismatches, stds
from _tv_ops import define_torchvision_ops

import packedinit
from packedinit.errors import PackedInitError

define_torchvision_ops()
open_clip = pytest.importorskip("open_clip", reason="open_clip_torch is not installed (pip install open_clip_torch)")

_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 100, "width": 64, "heads": 2, "layers": 2},
}


def test_clip_meta_flow_refuses_the_init_code_outside_init_parameters_by_name() -> None:
    with torch.device("meta"):
        model = open_clip.CLIP(**_CFG)
    model.to_empty(device="cpu")
    before = model.visual.conv1.weight.detach().clone()
    named = r"'logit_scale'.*'visual\.class_embedding'.*VisionTransformer\.init_parameters\(\)"
    with pytest.raises(PackedInitError, match=named):
        packedinit.reset_parameters(model)
    assert torch.equal(before.view(torch.int32), model.visual.conv1.weight.detach().view(torch.int32))


def test_strict_false_then_the_named_tensors_filled_is_like_eager() -> None:
    """The printed fix: strict=False initialises the rest (the text tower by open_clip's own
    TextTransformer.init_parameters(), which CLIP does not keep), then fill what it names."""
    eager, model = eager_and_meta(lambda: open_clip.CLIP(**_CFG))
    with pytest.warns(UserWarning, match=r"'visual\.class_embedding'"):
        packedinit.reset_parameters(model, strict=False)
    with torch.no_grad():  # what CLIP's __init__ does outside any init: scale * randn, a constant, a mask
        scale = model.visual.transformer.width**-0.5
        for t in (model.visual.class_embedding, model.visual.positional_embedding, model.visual.proj):
            t.normal_(0, scale)
        model.logit_scale.fill_(math.log(1 / 0.07))
        model.attn_mask.copy_(eager.attn_mask)
    assert mismatches(eager, model) == []
    assert stds(model, ["token_embedding.weight"])["token_embedding.weight"] == pytest.approx(0.02, rel=0.15)
    w = model.visual.transformer.resblocks[0].attn.in_proj_weight  # torch's MHA default, per q/k/v block
    assert float(w.detach().abs().max()) <= (6 / (2 * 64)) ** 0.5

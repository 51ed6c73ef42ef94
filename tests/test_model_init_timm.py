"""timm: the meta flow runs the model's own ``init_weights()`` (ViT), or refuses by name (maxxvit's unkept scheme).

Real timm 1.0.x models at tiny sizes; timm imports beside a CPU torch once torchvision's two op
schemas exist (tests/_tv_ops.py).
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the tests' private helpers (--import-mode=importlib adds none)
from _model_init_check import eager_and_meta, mismatches, stds
from _tv_ops import define_torchvision_ops

import packedinit
from packedinit.errors import PackedInitError

define_torchvision_ops()
timm = pytest.importorskip("timm", reason="timm is not installed (pip install timm; see tests/_tv_ops.py)")


def _vit() -> torch.nn.Module:
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2)


def _maxxvit() -> torch.nn.Module:
    return timm.create_model("maxxvit_rmlp_nano_rw_256", pretrained=False, img_size=64)


def test_vit_meta_flow_runs_init_weights() -> None:
    eager, meta_built = eager_and_meta(_vit)
    packedinit.reset_parameters(meta_built)  # on main: refuses cls_token / pos_embed
    assert mismatches(eager, meta_built) == []
    assert stds(meta_built, ["pos_embed"])["pos_embed"] == pytest.approx(0.02, rel=0.15)
    assert float(meta_built.cls_token.detach().abs().max()) < 1e-4  # normal_(std=1e-6), timm's own


def test_vit_deferred_materialize_runs_init_weights_once_without_warnings() -> None:
    torch.manual_seed(0)
    eager = _vit()
    with packedinit.deferred() as construction:
        built = _vit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        construction.materialize(built, device="cpu")
    assert mismatches(eager, built) == []


def test_gcvit_meta_flow_is_like_eager() -> None:
    eager, meta_built = eager_and_meta(lambda: timm.create_model("gcvit_xxtiny", pretrained=False, img_size=64))
    packedinit.reset_parameters(meta_built)
    assert mismatches(eager, meta_built) == []


def test_maxxvit_refuses_by_name_and_its_printed_fix_works() -> None:
    eager, meta_built = eager_and_meta(_maxxvit)
    before = meta_built.stem.conv1.weight.detach().clone()
    with pytest.raises(PackedInitError, match=r"timm's MaxxVit .*_init_weights, scheme=cfg.weight_init.*'stem'"):
        packedinit.reset_parameters(meta_built)
    after = meta_built.stem.conv1.weight.detach()
    assert torch.equal(before.view(torch.int32), after.view(torch.int32))  # nothing written (bits: NaN-safe)
    named_apply = timm.models.named_apply  # the fix as the message prints it, with this config's scheme
    packedinit.reset_parameters(
        meta_built, model_init=lambda m: named_apply(functools.partial(m._init_weights, scheme="normal"), m)
    )
    assert mismatches(eager, meta_built) == []
    assert stds(meta_built, ["stem.conv1.weight"])["stem.conv1.weight"] == pytest.approx(0.02, rel=0.15)


def test_maxxvit_under_deferred_replays_the_constructions_own_calls() -> None:
    torch.manual_seed(0)
    eager = _maxxvit()
    with packedinit.deferred() as construction:
        built = _maxxvit()
    construction.materialize(built, device="cpu")  # the blocks' init_weights(scheme) calls were recorded
    assert mismatches(eager, built) == []


def test_fan_dependent_calls_inside_init_weights_run_per_block_on_packed_qkv() -> None:
    """ViT ``weight_init='jax'``: ``init_weights()`` calls ``nn.init.xavier_uniform_`` on each qkv (3E, E)."""
    e = 192
    with torch.device("meta"):
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1, weight_init="jax")
    for block in model.blocks:
        packedinit.annotate(block.attn.qkv, weight=packedinit.Layout(sizes=(e, e, e)))
    model.to_empty(device="cpu")
    packedinit.reset_parameters(model)
    w = model.blocks[0].attn.qkv.weight.detach()
    assert float(w.abs().max()) <= (6 / (2 * e)) ** 0.5  # xavier per (E, E) block
    assert float(w.abs().max()) > (6 / (4 * e)) ** 0.5  # not the packed (3E, E) bound

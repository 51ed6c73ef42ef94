"""timm 1.0.31 with its real constructors (issue 27): each fused attention's layout, checked against the
forward it is split by, and the whole story (audit and its fix, fix_torch_defaults, chunked, infer_layouts).
Skips, naming timm, where timm is not installed (.ci/libs.txt installs it with --no-deps)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import packedinit

IMG = 32


def _maxxvit(lib: Callable[[str], ModuleType], head_first: bool) -> nn.Module:
    mx = lib("timm.models.maxxvit")
    t = mx.MaxxVitTransformerCfg(head_first=head_first, dim_head=16)
    cfg = mx.MaxxVitCfg(embed_dim=(32, 64), depths=(1, 1), block_type=("M", "M"), stem_width=16, transformer_cfg=t)
    model: nn.Module = mx.MaxxVit(cfg, img_size=IMG, num_classes=4)
    return model


def _models(lib: Callable[[str], ModuleType]) -> dict[str, Callable[[], nn.Module]]:
    timm: Any = lib("timm")
    return {
        "vit": lambda: timm.create_model("vit_tiny_patch16_224", img_size=IMG, patch_size=8, depth=2, num_classes=4),
        "maxvit head_first": lambda: _maxxvit(lib, True),
        "maxvit tf (not head_first)": lambda: _maxxvit(lib, False),
        "gcvit": lambda: timm.create_model("gcvit_xxtiny", img_size=IMG, window_size=(4, 4, 2, 1), num_classes=4),
        "swinv2_cr": lambda: timm.create_model(
            "swinv2_cr_tiny_ns_224", img_size=IMG, window_size=4, depths=(1, 1, 1, 1), num_classes=4
        ),
    }


NAMES = ["vit", "maxvit head_first", "maxvit tf (not head_first)", "gcvit", "swinv2_cr"]


def _oracle(module: nn.Module, out: int) -> list[list[int]]:
    """The rows of q, k, v (or k, v) as the library's forward takes them, replayed on row indices."""
    rows = torch.arange(out)
    cls = type(module).__name__
    if cls == "Attention":  # timm/layers/attention.py:119 qkv.reshape(B, N, 3, num_heads, head_dim)
        parts = rows.reshape(3, -1).unbind(0)
    elif cls in ("Attention2d", "AttentionCl"):
        nh, d = module.num_heads, module.dim_head
        # timm/models/maxxvit.py:221 (head_first) view(B, nh, dim_head * 3, -1).chunk(3, dim=2);
        # :223 (otherwise) reshape(B, 3, nh, dim_head, -1).unbind(1)
        parts = rows.view(nh, 3 * d).chunk(3, dim=1) if module.head_first else rows.reshape(3, nh, d).unbind(0)
    elif cls == "WindowAttentionGlobal":  # timm/models/gcvit.py:219 (global query: kv) and :226
        parts = rows.reshape(2 if module.use_global else 3, -1).unbind(0)
    else:  # timm/models/swin_transformer_v2_cr.py:231 view(Bw, L, 3, num_heads, C // num_heads)
        assert cls == "WindowMultiHeadAttention", cls
        parts = rows.view(3, -1).unbind(0)
    return [p.flatten().tolist() for p in parts]


@pytest.mark.parametrize("name", NAMES)
def test_every_fused_attention_has_the_layout_its_forward_splits_by(name: str, lib: Any, story: Any) -> None:
    model = _models(lib)[name]()
    found = packedinit.layouts(model)
    fused = {n: m for n, m in model.named_modules() if isinstance(getattr(m, "qkv", None), nn.Module)}
    assert fused, name
    for prefix, module in fused.items():
        layout = found[f"{prefix}.qkv.weight"]
        assert story.rows(layout, module.qkv.weight.shape[0]) == _oracle(module, module.qkv.weight.shape[0])
    if name == "gcvit":  # the global-query blocks hold [k | v]
        assert {found[f"{p}.qkv.weight"].names for p in fused} == {("k", "v"), ("q", "k", "v")}


@pytest.mark.parametrize("name", NAMES)
def test_infer_layouts_finds_each_layout(name: str, lib: Any, story: Any) -> None:
    model = _models(lib)[name]()
    found = packedinit.layouts(model)
    inferred = packedinit.infer_layouts(model, torch.randn(2, 3, IMG, IMG))
    weights = [n for n in found if n.endswith("qkv.weight")]
    assert weights
    for n in weights:
        assert inferred[n].verdict == "packed", (n, inferred[n])
        assert story.same_layout(inferred[n].layout, found[n]), (n, inferred[n].layout, found[n])


def test_maxvit_audit_and_its_printed_fix(lib: Any, story: Any) -> None:
    """MaxViT's own init (timm/models/maxxvit.py:407, the default 'vit_eff' scheme) runs xavier_uniform_ on the whole
    packed qkv (a 1x1 conv or a Linear): affected, and the printed fix makes it per block."""
    torch.manual_seed(0)
    before = story.audit_fix_works(_maxxvit(lib, True))
    assert before.affected
    assert all(n.endswith("qkv.weight") for n in before.affected)


@pytest.mark.parametrize("name", NAMES)
def test_fix_torch_defaults_builds_per_block_and_identical_elsewhere(name: str, lib: Any, story: Any) -> None:
    plain, fixed = story.fix_builds_per_block(_models(lib)[name])
    if name.startswith("maxvit"):  # timm's own xavier_uniform_ on the packed qkv: now per block, so it differs
        pairs = zip(plain.named_parameters(), fixed.named_parameters(), strict=True)
        differ = [n for (n, a), (_, b) in pairs if not torch.equal(a, b)]
        assert differ
        assert all(n.endswith("qkv.weight") for n in differ)


@pytest.mark.parametrize("name", NAMES)
def test_chunked_is_per_block(name: str, lib: Any, story: Any) -> None:
    story.chunked_is_per_block(_models(lib)[name](), torch.nn.init.xavier_uniform_)


def test_the_read_only_calls_leave_a_timm_model_as_it_was(lib: Any) -> None:
    model = _maxxvit(lib, True).eval()
    values = {n: t.detach().clone() for n, t in model.state_dict().items()}
    rng = torch.get_rng_state()
    packedinit.layouts(model)
    packedinit.audit(model)
    packedinit.infer_layouts(model, torch.zeros(2, 3, IMG, IMG))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(t, values[n]) for n, t in model.state_dict().items())
    assert not model.training

"""diffusers 0.42.1 with its real constructors (issue 27): the projections ``fuse_qkv_projections()`` adds
(``to_qkv``, ``to_added_qkv``, cross-attention ``to_kv``) and Flux 2's ``to_qkv_mlp_proj`` (fused at construction),
checked against the forward, and the whole story. Skips, naming diffusers, where it is not installed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import packedinit


def _flux(lib: Any, fused: bool = True) -> nn.Module:
    d = lib("diffusers")
    model: nn.Module = d.FluxTransformer2DModel(
        in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    if fused:
        model.fuse_qkv_projections()
    return model


def _flux2(lib: Any) -> nn.Module:
    d = lib("diffusers")
    model: nn.Module = d.Flux2Transformer2DModel(
        in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(2, 2, 2, 2),
    )  # fmt: skip
    return model


def _cross(lib: Any) -> nn.Module:
    ap = lib("diffusers.models.attention_processor")
    attn: nn.Module = ap.Attention(query_dim=32, cross_attention_dim=16, heads=4, dim_head=8, bias=True)
    attn.fuse_projections()
    return attn


def _flux_inputs() -> dict[str, torch.Tensor]:
    return {
        "hidden_states": torch.randn(1, 4, 4), "encoder_hidden_states": torch.randn(1, 3, 16),
        "pooled_projections": torch.randn(1, 16), "timestep": torch.ones(1),
        "img_ids": torch.zeros(4, 3), "txt_ids": torch.zeros(3, 3),
    }  # fmt: skip


def test_fused_projections_have_the_layouts_their_forward_splits_by(lib: Any, story: Any) -> None:
    flux, cross, flux2 = _flux(lib), _cross(lib), _flux2(lib)
    params = {**dict(flux.named_parameters()), **{f"cross.{n}": p for n, p in cross.named_parameters()},
              **{f"flux2.{n}": p for n, p in flux2.named_parameters()}}  # fmt: skip
    found = {**packedinit.layouts(flux), **{f"cross.{n}": v for n, v in packedinit.layouts(cross).items()},
             **{f"flux2.{n}": v for n, v in packedinit.layouts(flux2).items()}}  # fmt: skip
    assert {n.rsplit(".", 2)[-2] for n in found} == {"to_qkv", "to_added_qkv", "to_kv", "to_qkv_mlp_proj", "linear_in"}
    for n in found:
        out = params[n].shape[0]
        rows = torch.arange(out)
        if "to_qkv_mlp_proj" in n:
            # diffusers/models/transformers/transformer_flux2.py:594-599 split([3 * inner_dim, rest]), qkv.chunk(3);
            # :297 Flux2SwiGLU x[..., :half] / x[..., half:]
            attn = flux2.single_transformer_blocks[0].attn
            qkv, mlp = rows.split([3 * attn.inner_dim, out - 3 * attn.inner_dim])
            oracle = [c.tolist() for c in (*qkv.chunk(3), *mlp.chunk(2))]
        elif "linear_in" in n:  # transformer_flux2.py:297 Flux2SwiGLU x[..., :half] / x[..., half:]
            oracle = [c.tolist() for c in rows.chunk(2)]
        else:
            # transformer_flux.py:61 to_qkv(...).chunk(3, dim=-1), :65 to_added_qkv(...).chunk(3, dim=-1);
            # attention_processor.py:3280 torch.split(kv, kv.shape[-1] // 2, dim=-1)
            oracle = [c.tolist() for c in rows.chunk(2 if ".to_kv." in n else 3)]
        assert story.rows(found[n], out) == oracle, n


def test_infer_layouts_finds_each_fused_layout(lib: Any, story: Any) -> None:
    flux = _flux(lib)
    found = packedinit.layouts(flux)
    inferred = packedinit.infer_layouts(flux, **_flux_inputs())
    weights = [n for n in found if n.endswith("weight")]
    assert weights
    for n in weights:
        assert inferred[n].verdict == "packed", (n, inferred[n])
        assert story.same_layout(inferred[n].layout, found[n]), n


def test_nothing_is_packed_before_fusing(lib: Any) -> None:
    assert packedinit.layouts(_flux(lib, fused=False)) == {}


def test_audit_and_its_printed_fix_after_a_whole_tensor_init(lib: Any, story: Any) -> None:
    """A user's xavier loop over every Linear of the fused model initialises to_qkv whole: affected, and fixed."""
    flux = _flux(lib)
    torch.manual_seed(0)
    for m in flux.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
    before = story.audit_fix_works(flux)
    assert {n.rsplit(".", 2)[-2] for n in before.affected} == {"to_qkv", "to_added_qkv"}


@pytest.mark.parametrize("make", ["flux", "flux2"])
def test_fix_torch_defaults_builds_per_block_and_identical_elsewhere(make: str, lib: Any, story: Any) -> None:
    story.fix_builds_per_block(lambda: _flux(lib) if make == "flux" else _flux2(lib))


@pytest.mark.parametrize("make", ["flux", "flux2", "cross"])
def test_chunked_is_per_block(make: str, lib: Any, story: Any) -> None:
    model = {"flux": _flux, "flux2": _flux2, "cross": _cross}[make](lib)
    story.chunked_is_per_block(model, torch.nn.init.xavier_uniform_)


@pytest.mark.parametrize("make", ["flux", "flux2"])
def test_the_meta_flow_builds_what_construction_builds(make: str, lib: Any, story: Any) -> None:
    """diffusers' Flux models keep torch's defaults (no init entry point): the meta flow rebuilds them."""
    story.meta_flow_matches(lambda: _flux(lib, fused=False) if make == "flux" else _flux2(lib))

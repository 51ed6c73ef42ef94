"""x-transformers 2.31.10 with its real constructor (issue 27): where it fuses (the GLU feed-forward's ``proj``,
attention-on-attention's ``to_out``), checked against the forward, and the whole story. Skips, naming
x_transformers, where it is not installed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import packedinit


def _model(lib: Any) -> nn.Module:
    xt = lib("x_transformers")
    decoder = xt.Decoder(dim=32, depth=2, heads=4, ff_glu=True, attn_on_attn=True)
    model: nn.Module = xt.TransformerWrapper(num_tokens=64, max_seq_len=16, attn_layers=decoder)
    return model


def test_fused_projections_have_the_layouts_their_forward_splits_by(lib: Any, story: Any) -> None:
    model = _model(lib)
    found = packedinit.layouts(model)
    params = dict(model.named_parameters())
    assert {n.rsplit(".", 2)[-2] for n in found} == {"proj", "0"}
    for n, layout in found.items():
        out = params[n].shape[0]
        # x_transformers/x_transformers.py:1756 up, gate = self.proj(x).chunk(2, dim = -1);
        # :2240 nn.Sequential(LinearNoBias(out_dim, dim_out * 2), nn.GLU()): nn.GLU halves its input's last dim
        assert story.rows(layout, out) == [c.tolist() for c in torch.arange(out).chunk(2)], n
        assert layout.names == (("up", "gate") if ".proj." in n else ("value", "gate"))


def test_infer_layouts_finds_each_layout(lib: Any, story: Any) -> None:
    model = _model(lib)
    found = packedinit.layouts(model)
    inferred = packedinit.infer_layouts(model, torch.randint(0, 64, (2, 8)))
    for n in (n for n in found if n.endswith("weight")):
        assert inferred[n].verdict == "packed", (n, inferred[n])
        assert story.same_layout(inferred[n].layout, found[n]), n


def test_audit_and_its_printed_fix_after_a_whole_tensor_init(lib: Any, story: Any) -> None:
    """x-transformers keeps torch's defaults (kaiming_uniform_, a per-block bound already: not affected); a user's
    xavier loop over every Linear initialises the fused ones whole: affected, and the printed fix works."""
    model = _model(lib)
    assert packedinit.audit(model).affected == ()
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
    before = story.audit_fix_works(model)
    assert set(before.affected) == {n for n in packedinit.layouts(model) if n.endswith("weight")}


def test_fix_torch_defaults_builds_per_block_and_identical_elsewhere(lib: Any, story: Any) -> None:
    story.fix_builds_per_block(lambda: _model(lib))


def test_chunked_is_per_block(lib: Any, story: Any) -> None:
    story.chunked_is_per_block(_model(lib), torch.nn.init.xavier_uniform_)

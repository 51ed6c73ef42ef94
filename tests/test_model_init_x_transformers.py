"""x-transformers: ``TransformerWrapper.init_()`` runs in the meta flow (its token embedding's ``kaiming_normal_``).

Its ``LayerNorm`` sets ``gamma`` with ``nn.init.constant_`` in ``__init__`` (no init method): a plain
meta build cannot see that and is refused by name; ``packedinit.deferred()`` records it.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the tests' private helpers (--import-mode=importlib adds none)
from _model_init_check import mismatches, stds

import packedinit
from packedinit.errors import PackedInitError

xt = pytest.importorskip("x_transformers", reason="x-transformers is not installed (pip install x-transformers)")


def _wrapper() -> torch.nn.Module:
    model: torch.nn.Module = xt.TransformerWrapper(
        num_tokens=256, max_seq_len=64, attn_layers=xt.Decoder(dim=64, depth=2, heads=4)
    )
    return model


def test_deferred_materialize_runs_init_and_the_recorded_calls() -> None:
    torch.manual_seed(0)
    eager = _wrapper()
    with packedinit.deferred() as construction:
        built = _wrapper()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        construction.materialize(built, device="cpu")
    assert mismatches(eager, built) == []
    emb = "token_emb.emb.weight"
    assert stds(built, [emb])[emb] == pytest.approx((2 / 64) ** 0.5, rel=0.15)  # kaiming_normal_, by init_()


def test_plain_meta_build_refuses_the_constructor_constants_by_name() -> None:
    with torch.device("meta"):
        model = _wrapper()
    model.to_empty(device="cpu")
    with pytest.raises(PackedInitError, match=r"'attn_layers\.final_norm\.gamma'.*TransformerWrapper\.init_\(\)"):
        packedinit.reset_parameters(model)

"""torchtitan: the meta flow runs the model's own ``init_states`` (``init_weights(buffer_device=...)``).

torchtitan's own flow is meta -> ``to_empty`` -> ``model.init_weights(buffer_device=...)``;
``packedinit.reset_parameters`` must give what that gives, per parameter (on main it gave
torch's defaults: ``FusedQKVLinear`` at std 0.036 where titan's ``trunc_normal_(std=0.02)`` gives 0.02).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the tests' private helpers (--import-mode=importlib adds none)
from _model_init_check import eager_and_meta, mismatches, stds

import packedinit

pytest.importorskip("triton", reason="torchtitan needs triton to import")
llama3 = pytest.importorskip("torchtitan.models.llama3", reason="torchtitan is not installed (pip install torchtitan)")


def _debugmodel() -> torch.nn.Module:
    """torchtitan's llama3 ``debugmodel`` (fused QKV), 2 layers and a 512-token RoPE cache to keep it fast."""
    config = llama3.llama3_configs["debugmodel"](attn_backend="flex")
    for layer in config.layers:
        layer.attention.rope.max_seq_len = 512
    config.layers = config.layers[:2]
    model: torch.nn.Module = config.build()
    return model


def test_llama3_debugmodel_meta_flow_is_titans_init() -> None:
    eager, meta_built = eager_and_meta(_debugmodel)
    with torch.no_grad():
        eager.init_weights(buffer_device=None)  # titan's own flow, on the eager build
    packedinit.reset_parameters(meta_built)  # on main: refused the RoPE caches; torch defaults elsewhere
    assert mismatches(eager, meta_built) == []
    qkv = "layers.0.attention.qkv_linear.wqkv.weight"
    assert stds(meta_built, [qkv])[qkv] == pytest.approx(0.02, rel=0.15)
    for n, b in eager.named_buffers():
        assert torch.allclose(b, dict(meta_built.named_buffers())[n]), n  # RoPE caches computed, not left empty


def test_llama3_debugmodel_under_deferred_is_titans_init() -> None:
    torch.manual_seed(0)
    eager = _debugmodel()
    with torch.no_grad():
        eager.init_weights(buffer_device=None)
    with packedinit.deferred() as construction:
        built = _debugmodel()
    construction.materialize(built, device="cpu")
    assert mismatches(eager, built) == []

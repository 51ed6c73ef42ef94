"""torchrl: its modules initialise with torch's defaults at construction; the meta flow gives them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the tests' private helpers (--import-mode=importlib adds none)
from _model_init_check import eager_and_meta, mismatches

import packedinit

modules = pytest.importorskip("torchrl.modules", reason="torchrl is not installed (pip install torchrl)")


@pytest.mark.parametrize("name", ["MLP", "LSTMModule"])
def test_meta_flow_is_like_eager(name: str) -> None:
    def build() -> torch.nn.Module:
        if name == "MLP":
            mlp: torch.nn.Module = modules.MLP(in_features=16, out_features=8, num_cells=[64, 64])
            return mlp
        lstm: torch.nn.Module = modules.LSTMModule(input_size=16, hidden_size=32, in_key="x", out_key="y")
        return lstm

    eager, meta_built = eager_and_meta(build)
    packedinit.reset_parameters(meta_built)
    assert mismatches(eager, meta_built) == []
    assert len(list(meta_built.parameters())) > 0

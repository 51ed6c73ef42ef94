"""Issue 26, audit: "looks packed" guesses come from the forward, and the printed line writes the true layout.

Hand-written replicas of timm's layers (timm is not a test dependency), each citing where its forward is.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn
from torch.nn import init

import packedinit
from packedinit import Layout

E, HEADS = 64, 4
D = E // HEADS


class GcvitGlobal(nn.Module):
    """timm/models/gcvit.py WindowAttentionGlobal (use_global): ``qkv`` is (2E, E) holding [k | v]; q comes in."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 2 * E)
        self.proj = nn.Linear(E, E)

    def forward(self, x: Tensor, q_global: Tensor) -> Tensor:
        b, n, c = x.shape
        k, v = self.qkv(x).reshape(b, n, 2, HEADS, D).permute(2, 0, 3, 1, 4).unbind(0)
        q = q_global.reshape(b, n, HEADS, D).transpose(1, 2)
        out = (q @ k.transpose(-2, -1)).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class MaxxvitAttention2d(nn.Module):
    """timm/models/maxxvit.py Attention2d: a 1x1 conv qkv, q, k, v interleaved inside every head."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Conv2d(E, 3 * E, 1)
        self.proj = nn.Conv2d(E, E, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, _, h, w = x.shape
        q, k, v = self.qkv(x).view(b, HEADS, D * 3, -1).chunk(3, dim=2)
        attn = (q.transpose(-2, -1) @ k).softmax(dim=-1)
        return self.proj((v @ attn.transpose(-2, -1)).view(b, -1, h, w))


def _block_stds(w: Tensor, sizes: list[int], groups: int) -> list[tuple[float, float]]:
    """(std, per-block xavier std) of each part, rows gathered over the groups (written from the forwards above)."""
    flat = w.detach().reshape(w.shape[0], -1)
    step, out = sum(sizes), []
    for j, size in enumerate(sizes):
        rows = [g * step + sum(sizes[:j]) + i for g in range(groups) for i in range(size)]
        block = flat[rows]
        out.append((float(block.std()), (2 / (block.shape[0] + block.shape[1])) ** 0.5))
    return out


@pytest.mark.parametrize(
    ("build", "inputs", "layout"),
    [
        (GcvitGlobal, (torch.randn(2, 5, E), torch.randn(2, 5, E)), Layout(0, [E, E])),
        (MaxxvitAttention2d, (torch.randn(2, E, 3, 3),), Layout(0, [D, D, D], groups=HEADS)),
    ],
    ids=["gcvit_kv", "maxxvit_interleaved"],
)
def test_the_printed_fix_writes_the_true_layout_and_gives_every_block_its_std(
    build: type[nn.Module], inputs: tuple[Tensor, ...], layout: Layout
) -> None:
    model = build()
    report = packedinit.audit(model, example_inputs=inputs)
    (guess,) = [s for s in report.suspects if s.name == "qkv.weight"]
    assert guess.layout == layout
    assert guess.why.startswith("forward: ")
    exec(guess.annotate, {"packedinit": packedinit, "model": model})  # the printed line, run
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", packedinit.LayoutWarning)
        packedinit.chunked(init.xavier_uniform_)(model)
    for std, want in _block_stds(model.qkv.weight, list(layout.sizes), layout.groups):
        assert abs(std / want - 1) < 0.12, (std, want)


def test_without_the_forward_a_kv_qkv_is_still_listed_as_two_blocks() -> None:
    report = packedinit.audit(GcvitGlobal())  # no input can be built for it: the name and shape rule
    (guess,) = [s for s in report.suspects if s.name == "qkv.weight"]
    assert guess.layout == Layout(0, [E, E], names=("k", "v"))


def test_a_transformers_model_is_traced_by_the_audit_with_no_inputs_passed() -> None:
    transformers = pytest.importorskip("transformers", reason="a transformers model builds its own inputs")
    # lfm2/modeling_lfm2.py Lfm2ShortConv: in_proj(x).transpose(-1, -2).chunk(3, dim=-2): [B | C | x]
    cfg = transformers.Lfm2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"],
    )  # fmt: skip
    model = transformers.Lfm2ForCausalLM(cfg)
    (guess,) = packedinit.audit(model).suspects
    assert guess.name == "model.layers.0.conv.in_proj.weight"
    assert guess.layout == Layout(0, [E, E, E])
    assert guess.why.startswith("forward: ")

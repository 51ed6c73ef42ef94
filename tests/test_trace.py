"""The forward tracer (packedinit.infer_layouts) on hand-written modules of every layout kind, and controls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  # the usual alias
import transformers
from torch import Tensor, nn

import packedinit
from packedinit import Layout, PackedInitError
from packedinit.trace.compare import disagreements, same_blocks
from packedinit.trace.forward import infer_layouts

X = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))


class Uneven(nn.Module):  # GQA: [q: 8 | k: 4 | v: 4]
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 16)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).split([8, 4, 4], dim=-1)
        return q.sum() + (k * v).sum()


class PerHead(nn.Module):  # GPT-NeoX: per head [q k v], 2 heads of 4
    def __init__(self) -> None:
        super().__init__()
        self.query_key_value = nn.Linear(8, 24)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.query_key_value(x).view(2, 3, 2, 12)
        q, k, v = qkv.chunk(3, dim=-1)
        return (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)).sum() + v.sum()


class Transposed(nn.Module):  # GPT-2 Conv1D: stored (in, 3E), used as x @ W
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 24))
        self.bias = nn.Parameter(torch.zeros(24))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.addmm(self.bias, x.view(-1, 8), self.weight).view(2, 3, 24)
        q, k, v = y.split(8, dim=2)
        return (q * k).sum() + v.sum()


class StridedExperts(nn.Module):  # GPT-OSS: (n, E, 2I) transposed, gate = [..., ::2], up = [..., 1::2]
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 8, 12))
        self.down_proj = nn.Parameter(torch.randn(4, 6, 8))

    def forward(self, x: Tensor) -> Tensor:
        out = x.new_zeros(x.shape)
        for e in range(4):
            gate_up = x @ self.gate_up_proj[e]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            out = out + (F.silu(gate) * up) @ self.down_proj[e]
        return out


class ChunkedExperts(nn.Module):  # Mixtral: (n, 2I, E), linear(x, W[e]).chunk(2)
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 12, 8))
        self.down_proj = nn.Parameter(torch.randn(4, 8, 6))

    def forward(self, x: Tensor) -> Tensor:
        out = x.new_zeros(x.shape)
        for e in range(4):
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out + F.linear(F.silu(gate) * up, self.down_proj[e])
        return out


class Mla(nn.Module):  # DeepSeek: kv_a = [latent: 6 | k_rot: 2]; kv_b per head [k_nope: 3 | v: 5], 2 heads
    def __init__(self) -> None:
        super().__init__()
        self.kv_a_proj_with_mqa = nn.Linear(8, 8, bias=False)
        self.norm = nn.LayerNorm(6)
        self.kv_b_proj = nn.Linear(6, 16, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [6, 2], dim=-1)
        kv = self.kv_b_proj(self.norm(latent)).view(2, 3, -1, 8).transpose(1, 2)
        k_nope, v = torch.split(kv, [3, 5], dim=-1)
        return k_nope.sum() * k_rot.sum() + v.sum()


class Controls(nn.Module):
    """Not packed: an MLP expansion, a q projection viewed to heads, a last-token slice; rotary's halves rejoined."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 8)
        self.q_proj = nn.Linear(8, 8)
        self.opaque = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc2(F.gelu(self.fc1(x)))
        q = self.q_proj(h).view(2, 3, 2, 4).transpose(1, 2)
        x1, x2 = q[..., :2], q[..., 2:]
        rotated = torch.cat((-x2, x1), dim=-1)  # rotate_half: the halves are put back together
        last = rotated[:, :, -1]
        return last.sum() + torch.einsum("bsi,ij->bsj", x, self.opaque).sum()


@pytest.mark.parametrize(
    ("module", "name", "expected"),
    [
        (Uneven, "qkv.weight", Layout(0, [8, 4, 4])),
        (PerHead, "query_key_value.weight", Layout(0, [4, 4, 4], groups=2)),
        (Transposed, "weight", Layout(1, [8, 8, 8], transposed=True)),
        (StridedExperts, "gate_up_proj", Layout(2, [1, 1], groups=6, transposed=True, batch_dims=1)),
        (ChunkedExperts, "gate_up_proj", Layout(1, [6, 6], batch_dims=1)),
        # a stack of matrices, each used whole: one block per expert, with that expert's fans (issue 26)
        (StridedExperts, "down_proj", Layout(2, [8], transposed=True, batch_dims=1)),
        (ChunkedExperts, "down_proj", Layout(1, [8], batch_dims=1)),
        (Mla, "kv_a_proj_with_mqa.weight", Layout(0, [6, 2])),
        (Mla, "kv_b_proj.weight", Layout(0, [3, 5], groups=2)),
    ],
)
def test_tracer_finds_each_layout_kind(module: type[nn.Module], name: str, expected: Layout) -> None:
    found = infer_layouts(module(), X)
    assert found[name].verdict == "packed", found[name]
    assert found[name].layout == expected


@pytest.mark.parametrize(
    ("module", "name"),
    [(Controls, n) for n in ("fc1.weight", "fc2.weight", "q_proj.weight")],
)
def test_tracer_not_packed_controls(module: type[nn.Module], name: str) -> None:
    found = infer_layouts(module(), X)[name]
    assert found.verdict == "not packed", found
    assert found.layout is None


def test_tracer_says_opaque_where_it_cannot_follow() -> None:
    found = infer_layouts(Controls(), X)["opaque"]
    assert found.verdict == "opaque"
    assert "einsum" in found.why


def test_tracer_leaves_the_model_and_its_output_unchanged() -> None:
    model = Mla()
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    with torch.no_grad():
        want = model(X)
    infer_layouts(model, X)
    with torch.no_grad():
        assert torch.equal(model(X), want)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_tracer_names_a_forward_that_fails() -> None:
    with pytest.raises(PackedInitError, match=r"infer_layouts\(Uneven, \.\.\.\): the forward raised RuntimeError"):
        infer_layouts(Uneven(), torch.randn(2, 5))


def test_tracer_agrees_with_the_gpt2_adapter_and_flags_an_unclaimed_split() -> None:
    cfg = transformers.GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2Model(cfg).eval()
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))
    found = infer_layouts(model, input_ids=ids, use_cache=False)
    assert found["h.0.attn.c_attn.weight"].layout == Layout(1, [16, 16, 16], transposed=True)
    assert found["h.0.mlp.c_fc.weight"].verdict == "not packed"
    assert disagreements(found, packedinit.layouts(model)) == []
    (name, why), *rest = disagreements(infer_layouts(Uneven(), X), {})
    assert (name, rest) == ("qkv.weight", [])
    assert "no adapter or annotation describes it" in why


def test_same_blocks_ignores_names_and_one_block_layouts() -> None:
    assert same_blocks(Layout(1, [8], transposed=True), None)
    assert not same_blocks(Layout(0, [4, 4]), Layout(1, [4, 4]))


def test_nn_glu_splits_its_input_in_two_blocks() -> None:
    """``nn.GLU`` (x-transformers' attention-on-attention ``to_out``) is ``a * sigmoid(b)`` on ``[a | b]``."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.GLU())
    found = packedinit.infer_layouts(model, torch.randn(2, 8))
    assert found["0.weight"].verdict == "packed"
    assert found["0.weight"].layout == packedinit.Layout(0, [6, 6])

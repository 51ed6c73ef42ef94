"""fused_qkv / fused_gate_up: the Layout of a fused projection, from the numbers its forward splits by.

Each layout is checked against a forward written the way the model families write it
(split / view / chunk / stride-2 slicing), on real nn.Linear and (in, out) parameters.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  # the usual alias
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from packedinit import Layout, PackedInitError, chunked_init
from packedinit.adapters.fused import fused_gate_up, fused_qkv


def _read(t: Tensor, layout: Layout, name: str, batch: tuple[int, ...] = ()) -> Tensor:
    blk = next(b for b in layout.blocks(t.shape) if b.name == name and b.batch_index == batch)
    out = torch.empty(blk.shape, dtype=t.dtype)
    layout.to_storage(out, blk, t.dim()).copy_(layout.storage_view(t.detach(), blk))
    return out


def _split(y: Tensor, nh: int, d: int, nkv: int, interleaved: bool) -> dict[str, Tensor]:
    """How model code splits a fused qkv output (B, S, F) into q (B,S,nh*d), k, v (B,S,nkv*d)."""
    if not interleaved:  # Phi-3 / DBRX / timm: plain split
        q, k, v = torch.split(y, [nh * d, nkv * d, nkv * d], dim=-1)
        return {"q": q, "k": k, "v": v}
    g = nh // nkv  # GPT-NeoX (g = 1) and Falcon's new decoder architecture
    qkv = y.view(*y.shape[:-1], nkv, g + 2, d)
    return {
        "q": qkv[..., :-2, :].flatten(-3),
        "k": qkv[..., -2, :].flatten(-2),
        "v": qkv[..., -1, :].flatten(-2),
    }


@given(
    nkv=st.integers(1, 4),
    g=st.integers(1, 3),
    d=st.integers(1, 4),
    interleaved=st.booleans(),
    transposed=st.booleans(),
)
def test_fused_qkv_blocks_are_what_the_forward_splits(
    nkv: int, g: int, d: int, interleaved: bool, transposed: bool
) -> None:
    nh, e = nkv * g, 6
    out = (nh + 2 * nkv) * d
    gen = torch.Generator().manual_seed(nkv * 100 + g * 10 + d)
    w = torch.randn((e, out) if transposed else (out, e), generator=gen)
    b = torch.randn(out, generator=gen)
    x = torch.randn(2, 3, e, generator=gen)
    y = (x @ w + b) if transposed else F.linear(x, w, b)
    lw = fused_qkv(nh, d, nkv, interleaved=interleaved, transposed=transposed)
    lb = fused_qkv(nh, d, nkv, interleaved=interleaved, bias=True)
    for name, got in _split(y, nh, d, nkv, interleaved).items():
        torch.testing.assert_close(got, F.linear(x, _read(w, lw, name), _read(b, lb, name)))


def test_fused_qkv_covers_the_documented_families() -> None:
    assert fused_qkv(4, 8) == Layout(0, [32, 32, 32], names=("q", "k", "v"))
    assert fused_qkv(4, 8, 2) == Layout(0, [32, 16, 16], names=("q", "k", "v"))  # Phi-3 GQA
    assert fused_qkv(4, 8, 1) == Layout(0, [32, 8, 8], names=("q", "k", "v"))  # MQA
    assert fused_qkv(4, 8, interleaved=True) == Layout(0, [8, 8, 8], groups=4, names=("q", "k", "v"))  # NeoX
    assert fused_qkv(4, 8, 2, interleaved=True) == Layout(0, [16, 8, 8], groups=2, names=("q", "k", "v"))
    # MQA grouped per kv head is the plain layout: one group
    assert fused_qkv(4, 8, 1, interleaved=True) == fused_qkv(4, 8, 1)
    assert fused_qkv(4, 8, transposed=True) == Layout(1, [32, 32, 32], transposed=True, names=("q", "k", "v"))
    assert fused_qkv(4, 8, order="qvk") == Layout(0, [32, 32, 32], names=("q", "v", "k"))  # CodeGen
    assert fused_qkv(4, 8, 2, order="kvq") == Layout(0, [16, 16, 32], names=("k", "v", "q"))
    assert fused_qkv(4, 8, names=("query", "key", "value")).names == ("query", "key", "value")
    assert fused_qkv(4, 8, stacked=True) == Layout(1, [32, 32, 32], batch_dims=1, names=("q", "k", "v"))


def test_fused_qkv_gqa_xavier_bounds_per_block() -> None:
    nh, nkv, d, e = 8, 2, 16, 128
    qkv = torch.nn.Linear(e, (nh + 2 * nkv) * d)
    layout = fused_qkv(nh, d, nkv)
    chunked_init(qkv.weight, layout, init_fn=torch.nn.init.xavier_uniform_, generator=torch.Generator().manual_seed(0))
    w = qkv.weight.detach()
    q, k = w[: nh * d], w[nh * d : (nh + nkv) * d]
    assert float(q.abs().max()) <= math.sqrt(6 / (e + nh * d))
    assert float(k.abs().max()) <= math.sqrt(6 / (e + nkv * d))
    assert float(k.abs().max()) > math.sqrt(6 / (e + nh * d))  # k's own (larger) bound, not q's
    assert float(k.abs().max()) > math.sqrt(6 / (e + (nh + 2 * nkv) * d))  # nor the packed tensor's


@given(
    i=st.integers(1, 6), e=st.integers(1, 5), n=st.integers(1, 3), interleaved=st.booleans(), transposed=st.booleans()
)
def test_fused_gate_up_blocks_are_what_the_forward_gates(
    i: int, e: int, n: int, interleaved: bool, transposed: bool
) -> None:
    gen = torch.Generator().manual_seed(i * 100 + e * 10 + n)
    w = torch.randn((n, e, 2 * i) if transposed else (n, 2 * i, e), generator=gen)
    b = torch.randn(n, 2 * i, generator=gen)
    x = torch.randn(4, e, generator=gen)
    lw = fused_gate_up(i, interleaved=interleaved, transposed=transposed, stacked=True)
    lb = fused_gate_up(i, interleaved=interleaved, bias=True, stacked=True)
    for ex in range(n):
        y = (x @ w[ex] if transposed else F.linear(x, w[ex])) + b[ex]
        gate, up = (y[..., ::2], y[..., 1::2]) if interleaved else y.chunk(2, dim=-1)  # GPT-OSS / Mixtral
        torch.testing.assert_close(gate, F.linear(x, _read(w, lw, "gate", (ex,)), _read(b, lb, "gate", (ex,))))
        torch.testing.assert_close(up, F.linear(x, _read(w, lw, "up", (ex,)), _read(b, lb, "up", (ex,))))


def test_fused_gate_up_layouts() -> None:
    assert fused_gate_up(16) == Layout(0, [16, 16], names=("gate", "up"))
    assert fused_gate_up(16, names=("up", "gate")).names == ("up", "gate")
    assert fused_gate_up(16, interleaved=True) == Layout(0, [1, 1], groups=16, names=("gate", "up"))
    assert fused_gate_up(16, transposed=True, stacked=True) == Layout(
        2, [16, 16], transposed=True, batch_dims=1, names=("gate", "up")
    )


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: fused_qkv(0, 8), "num_heads must be a positive int"),
        (lambda: fused_qkv(4, -1), "head_dim must be a positive int"),
        (lambda: fused_qkv(4, 8, 3), "num_kv_heads=3 does not divide num_heads=4"),
        (lambda: fused_qkv(4, 8, True), "num_kv_heads must be a positive int"),  # a bool is not a head count
        (lambda: fused_qkv(4, 8, order="qqv"), "order must be a permutation of 'qkv'"),
        (lambda: fused_qkv(4, 8, names=("q", "k")), "names must be three non-empty strings"),
        (lambda: fused_qkv(4, 8, names=("q", "q", "v")), "names .* repeat"),
        (lambda: fused_qkv(4, 8, transposed=True, bias=True), "a bias is 1-D and cannot be transposed"),
        (lambda: fused_gate_up(0), "intermediate_size must be a positive int"),
        (lambda: fused_gate_up(4, names="gu"), "names must be two non-empty strings"),
        (lambda: fused_gate_up(4, transposed=True, bias=True), "a bias is 1-D"),
        (lambda: fused_gate_up(4, stacked=1), "must be bools"),  # type: ignore[arg-type]  # bad input on purpose
    ],
)
def test_bad_arguments_raise(call: object, match: str) -> None:
    with pytest.raises(PackedInitError, match=match):
        call()  # type: ignore[operator]  # the lambdas above


def test_wrong_size_is_refused_before_writing() -> None:
    w = torch.randn(3 * 32, 32)
    before = w.clone()
    with pytest.raises(PackedInitError, match=r"dim 0 has length 96 but the layout needs"):
        chunked_init(w, fused_qkv(4, 8, 2), init_fn=torch.nn.init.xavier_uniform_)
    assert torch.equal(w, before)

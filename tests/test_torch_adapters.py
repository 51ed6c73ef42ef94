"""torch.nn adapters, each proven against the module's own forward; reset_parameters; init_recurrent_."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  # torch's own convention
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.init import dirac_, orthogonal_, xavier_uniform_

from packedinit import Layout, PackedInitError, chunked, layouts
from packedinit.recipes.recurrent import init_recurrent_
from packedinit.recipes.reset import reset_parameters

LSTM_GATES = ("i", "f", "g", "o")
GRU_GATES = ("r", "z", "n")


def blocks(p: Tensor, layout: Layout) -> dict[str, Tensor]:
    """packedinit's own view of each named block (what the tests prove is what the forward uses)."""
    out: dict[str, Tensor] = {}
    for b in layout.blocks(p.shape):
        view = layout.logical_view(p, b)
        assert view is not None
        assert b.name is not None
        out[b.name] = view
    return out


def par(module: nn.Module, name: str) -> Tensor:
    """A parameter by (dotted) name, typed."""
    return module.get_parameter(name)


def randomize(module: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


# -- MultiheadAttention ---------------------------------------------------------------------------------
def mha_reference(
    mha: nn.MultiheadAttention, x: Tensor, mem: Tensor, w: dict[str, Tensor], b: dict[str, Tensor]
) -> Tensor:
    """Attention computed from separate q, k, v projections (seq-first inputs)."""
    e, h = mha.embed_dim, mha.num_heads
    d = e // h
    q = F.linear(x, w["q"], b["q"])
    k = F.linear(mem, w["k"], b["k"])
    v = F.linear(mem, w["v"], b["v"])
    length, n = x.shape[:2]
    s = mem.shape[0]
    q = q.reshape(length, n * h, d).transpose(0, 1)
    k = k.reshape(s, n * h, d).transpose(0, 1)
    v = v.reshape(s, n * h, d).transpose(0, 1)
    att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), dim=-1)
    o = (att @ v).transpose(0, 1).reshape(length, n, e)
    return F.linear(o, mha.out_proj.weight, mha.out_proj.bias)


def test_mha_packed_path_layout_matches_its_forward() -> None:
    e = 8
    mha = nn.MultiheadAttention(e, 2, dtype=torch.float64).eval()
    randomize(mha)
    lay = layouts(mha)
    assert lay == {
        "in_proj_weight": Layout(0, [e, e, e], names=("q", "k", "v")),
        "in_proj_bias": Layout(0, [e, e, e], names=("q", "k", "v")),
    }
    w = blocks(mha.in_proj_weight, lay["in_proj_weight"])
    b = blocks(mha.in_proj_bias, lay["in_proj_bias"])
    x = torch.randn(5, 3, e, dtype=torch.float64)
    mem = torch.randn(7, 3, e, dtype=torch.float64)
    out, _ = mha(x, mem, mem, need_weights=False)
    torch.testing.assert_close(out, mha_reference(mha, x, mem, w, b))
    # ... and equals the separately-projected forward (the kdim/vdim path's code) fed packedinit's blocks
    sep, _ = F.multi_head_attention_forward(
        x, mem, mem, e, 2, None, mha.in_proj_bias, None, None, False, 0.0,
        mha.out_proj.weight, par(mha, "out_proj.bias"), training=False, need_weights=False,
        use_separate_proj_weight=True, q_proj_weight=w["q"], k_proj_weight=w["k"], v_proj_weight=w["v"],
    )  # fmt: skip
    torch.testing.assert_close(out, sep)


def test_mha_kdim_path_packs_only_the_bias() -> None:
    e = 8
    mha = nn.MultiheadAttention(e, 2, kdim=3, vdim=5, dtype=torch.float64).eval()
    randomize(mha, 1)
    lay = layouts(mha)
    assert lay == {"in_proj_bias": Layout(0, [e, e, e], names=("q", "k", "v"))}
    b = blocks(mha.in_proj_bias, lay["in_proj_bias"])
    w = {"q": mha.q_proj_weight, "k": mha.k_proj_weight, "v": mha.v_proj_weight}
    x = torch.randn(4, 2, e, dtype=torch.float64)
    key, value = torch.randn(6, 2, 3, dtype=torch.float64), torch.randn(6, 2, 5, dtype=torch.float64)
    out, _ = mha(x, key, value, need_weights=False)
    e_, h = mha.embed_dim, mha.num_heads
    q = F.linear(x, w["q"], b["q"]).reshape(4, 2 * h, e_ // h).transpose(0, 1)
    k = F.linear(key, w["k"], b["k"]).reshape(6, 2 * h, e_ // h).transpose(0, 1)
    v = F.linear(value, w["v"], b["v"]).reshape(6, 2 * h, e_ // h).transpose(0, 1)
    att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(e_ // h), dim=-1)
    ref = F.linear((att @ v).transpose(0, 1).reshape(4, 2, e_), mha.out_proj.weight, mha.out_proj.bias)
    torch.testing.assert_close(out, ref)


def test_mha_without_bias_and_with_bias_kv() -> None:
    mha = nn.MultiheadAttention(8, 2, bias=False, add_bias_kv=True)
    assert set(layouts(mha)) == {"in_proj_weight"}  # bias_k, bias_v, out_proj: not packed


def test_mha_chunked_init_per_block_statistics() -> None:
    e = 64
    mha = nn.MultiheadAttention(e, 4)
    chunked(xavier_uniform_)(mha, generator=torch.Generator().manual_seed(0))
    bound, packed_bound = math.sqrt(6 / (2 * e)), math.sqrt(6 / (4 * e))
    for name, blk in blocks(mha.in_proj_weight, layouts(mha)["in_proj_weight"]).items():
        assert blk.abs().max() <= bound, name
        assert blk.abs().max() > 0.95 * bound > packed_bound, name  # torch's packed init never gets here
        assert abs(blk.std().item() - bound / math.sqrt(3)) < 0.05 * bound, name
    assert torch.equal(mha.in_proj_bias, torch.zeros(3 * e))  # 1-D: untouched


def test_mha_chunked_init_is_bit_identical_to_separate_q_k_v() -> None:
    e = 16
    mha = nn.MultiheadAttention(e, 4)
    torch.manual_seed(3)
    chunked(xavier_uniform_)(mha)
    torch.manual_seed(3)
    q, k, v = (xavier_uniform_(torch.empty(e, e)) for _ in range(3))
    out_w = xavier_uniform_(torch.empty(e, e))  # named_parameters order: in_proj_weight, in_proj_bias, out_proj.*
    assert torch.equal(mha.in_proj_weight, torch.cat([q, k, v]))
    assert torch.equal(mha.out_proj.weight, out_w)


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.TransformerEncoderLayer(8, 2, dim_feedforward=16),
        lambda: nn.TransformerDecoderLayer(8, 2, dim_feedforward=16),
        lambda: nn.Transformer(8, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16, batch_first=True),
    ],
    ids=["encoder_layer", "decoder_layer", "transformer"],
)
def test_transformer_modules_are_covered_through_their_mha_children(make: object) -> None:
    assert callable(make)
    module: nn.Module = make()
    mhas = {n: m for n, m in module.named_modules() if isinstance(m, nn.MultiheadAttention)}
    expected = {f"{n}.{p}" for n in mhas for p in ("in_proj_weight", "in_proj_bias")}
    assert set(layouts(module)) == expected
    chunked(xavier_uniform_)(module)
    bound = math.sqrt(6 / 16)
    for m in mhas.values():
        for blk in blocks(m.in_proj_weight, Layout(0, [8, 8, 8], names=("q", "k", "v"))).values():
            assert blk.abs().max() <= bound
            assert blk.abs().max() > math.sqrt(6 / 32)


# -- recurrent modules -----------------------------------------------------------------------------------
def lstm_reference(lstm: nn.LSTM, x: Tensor) -> Tensor:
    """A step-by-step LSTM reading every gate through packedinit's layouts."""
    lay = layouts(lstm)
    hsz, psz = lstm.hidden_size, lstm.proj_size or lstm.hidden_size
    layer_in = x
    for layer in range(lstm.num_layers):
        outs = []
        for sfx in ("", "_reverse")[: 2 if lstm.bidirectional else 1]:
            n = f"l{layer}{sfx}"
            wi = blocks(getattr(lstm, f"weight_ih_{n}"), lay[f"weight_ih_{n}"])
            wh = blocks(getattr(lstm, f"weight_hh_{n}"), lay[f"weight_hh_{n}"])
            bi = blocks(getattr(lstm, f"bias_ih_{n}"), lay[f"bias_ih_{n}"])
            bh = blocks(getattr(lstm, f"bias_hh_{n}"), lay[f"bias_hh_{n}"])
            seq = layer_in.flip(0) if sfx else layer_in
            h = x.new_zeros(x.shape[1], psz)
            c = x.new_zeros(x.shape[1], hsz)
            hs = []
            for xt in seq:
                pre = {g: F.linear(xt, wi[g], bi[g]) + F.linear(h, wh[g], bh[g]) for g in LSTM_GATES}
                c = torch.sigmoid(pre["f"]) * c + torch.sigmoid(pre["i"]) * torch.tanh(pre["g"])
                h = torch.sigmoid(pre["o"]) * torch.tanh(c)
                if lstm.proj_size:
                    h = F.linear(h, getattr(lstm, f"weight_hr_{n}"))
                hs.append(h)
            out = torch.stack(hs)
            outs.append(out.flip(0) if sfx else out)
        layer_in = torch.cat(outs, -1)
    return layer_in


def gru_step(
    xt: Tensor, h: Tensor, wi: dict[str, Tensor], wh: dict[str, Tensor], bi: dict[str, Tensor], bh: dict[str, Tensor]
) -> Tensor:
    r = torch.sigmoid(F.linear(xt, wi["r"], bi["r"]) + F.linear(h, wh["r"], bh["r"]))
    z = torch.sigmoid(F.linear(xt, wi["z"], bi["z"]) + F.linear(h, wh["z"], bh["z"]))
    n = torch.tanh(F.linear(xt, wi["n"], bi["n"]) + r * F.linear(h, wh["n"], bh["n"]))
    return (1 - z) * n + z * h


@pytest.mark.parametrize(("bidirectional", "proj"), [(False, 0), (True, 0), (True, 3)])
def test_lstm_layouts_match_its_forward_every_layer_and_direction(bidirectional: bool, proj: int) -> None:
    lstm = nn.LSTM(4, 5, num_layers=2, bidirectional=bidirectional, proj_size=proj, dtype=torch.float64)
    randomize(lstm, 2)
    lay = layouts(lstm)
    names = {n for n, _ in lstm.named_parameters()}
    assert set(lay) == {n for n in names if not n.startswith("weight_hr")}
    assert all(v == Layout(0, [5] * 4, names=LSTM_GATES) for v in lay.values())
    x = torch.randn(6, 2, 4, dtype=torch.float64)
    out, _ = lstm(x)
    torch.testing.assert_close(out, lstm_reference(lstm, x))


def test_gru_layouts_match_its_forward_both_directions() -> None:
    gru = nn.GRU(3, 4, bidirectional=True, dtype=torch.float64)
    randomize(gru, 4)
    lay = layouts(gru)
    assert len(lay) == 8
    assert all(v == Layout(0, [4] * 3, names=GRU_GATES) for v in lay.values())
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    out, _ = gru(x)
    outs = []
    for sfx in ("", "_reverse"):
        kinds = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        args = [blocks(par(gru, f"{k}_l0{sfx}"), lay[f"{k}_l0{sfx}"]) for k in kinds]
        h = x.new_zeros(2, 4)
        hs = []
        for xt in x.flip(0) if sfx else x:
            h = gru_step(xt, h, *args)
            hs.append(h)
        o = torch.stack(hs)
        outs.append(o.flip(0) if sfx else o)
    torch.testing.assert_close(out, torch.cat(outs, -1))


def test_cells_layouts_match_their_forward() -> None:
    x = torch.randn(3, 4, dtype=torch.float64)
    h0, c0 = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    cell = nn.LSTMCell(4, 5, dtype=torch.float64)
    randomize(cell, 5)
    lay = layouts(cell)
    assert set(lay) == {"weight_ih", "weight_hh", "bias_ih", "bias_hh"}
    wi, wh, bi, bh = (blocks(getattr(cell, k), lay[k]) for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
    pre = {g: F.linear(x, wi[g], bi[g]) + F.linear(h0, wh[g], bh[g]) for g in LSTM_GATES}
    c = torch.sigmoid(pre["f"]) * c0 + torch.sigmoid(pre["i"]) * torch.tanh(pre["g"])
    h = torch.sigmoid(pre["o"]) * torch.tanh(c)
    got_h, got_c = cell(x, (h0, c0))
    torch.testing.assert_close((got_h, got_c), (h, c))

    gcell = nn.GRUCell(4, 5, dtype=torch.float64)
    randomize(gcell, 6)
    lay = layouts(gcell)
    args = [blocks(getattr(gcell, k), lay[k]) for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    torch.testing.assert_close(gcell(x, h0), gru_step(x, h0, *args))
    assert layouts(nn.RNNCell(4, 5)) == {}


def test_plain_rnn_has_nothing_packed_and_inits_like_the_plain_loop() -> None:
    rnn = nn.RNN(3, 4, num_layers=2, bidirectional=True, nonlinearity="relu")
    assert layouts(rnn) == {}
    torch.manual_seed(0)
    chunked(orthogonal_)(rnn)
    got = {n: p.detach().clone() for n, p in rnn.named_parameters()}
    torch.manual_seed(0)
    for p in rnn.parameters():
        if p.dim() > 1:
            orthogonal_(p)
    assert all(torch.equal(got[n], p) for n, p in rnn.named_parameters())


def test_lstm_chunked_orthogonal_is_per_gate_and_bit_identical_to_separate_gates() -> None:
    h = 6
    lstm = nn.LSTM(4, h, num_layers=2, bidirectional=True)
    g = torch.Generator().manual_seed(7)
    chunked(orthogonal_)(lstm, generator=g)
    g.manual_seed(7)
    for name, p in lstm.named_parameters():
        if p.dim() < 2:
            continue
        gates = [orthogonal_(torch.empty(h, p.shape[1]), generator=g) for _ in range(4)]
        assert torch.equal(p, torch.cat(gates)), name
        if name.startswith("weight_hh"):
            for blk in gates:
                torch.testing.assert_close(blk @ blk.T, torch.eye(h), atol=1e-5, rtol=0)


# -- reset_parameters ------------------------------------------------------------------------------------
def test_reset_mha_is_the_166378_fix_bit_identical_to_separate_q_k_v() -> None:
    e = 16
    mha = nn.MultiheadAttention(e, 4, add_bias_kv=True)
    torch.manual_seed(11)
    reset_parameters(mha)
    torch.manual_seed(11)
    out_proj = nn.Linear(e, e)  # the child is reset first, as torch constructs it first
    q, k, v = (xavier_uniform_(torch.empty(e, e)) for _ in range(3))
    bias_k, bias_v = (nn.init.xavier_normal_(torch.empty(1, 1, e)) for _ in range(2))
    assert torch.equal(mha.in_proj_weight, torch.cat([q, k, v]))
    assert torch.equal(mha.out_proj.weight, out_proj.weight)
    assert torch.equal(mha.in_proj_bias, torch.zeros(3 * e))
    assert torch.equal(par(mha, "out_proj.bias"), torch.zeros(e))  # zeroed, as torch's _reset_parameters does
    assert torch.equal(par(mha, "bias_k"), bias_k)
    assert torch.equal(par(mha, "bias_v"), bias_v)
    assert mha.in_proj_weight.abs().max() > math.sqrt(6 / (4 * e))  # beyond torch's packed bound


def test_reset_mha_with_generator_leaves_global_rng_alone() -> None:
    mha = nn.MultiheadAttention(8, 2)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    reset_parameters(mha, generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.get_rng_state(), before)
    other = nn.MultiheadAttention(8, 2)
    torch.manual_seed(5)
    reset_parameters(other)
    assert all(torch.equal(a, b) for a, b in zip(mha.parameters(), other.parameters(), strict=True))


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True, proj_size=2),
        lambda: nn.GRU(3, 4),
        lambda: nn.RNN(3, 4),
        lambda: nn.LSTMCell(3, 4),
        lambda: nn.MultiheadAttention(8, 2, kdim=3, vdim=5),
        lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Conv1d(4, 2, 3), nn.Embedding(5, 3, padding_idx=1)),
    ],
    ids=["lstm", "gru", "rnn", "lstm_cell", "mha_kdim", "others"],
)
def test_reset_of_unpacked_modules_is_bit_identical_to_torch_construction(make: object) -> None:
    assert callable(make)
    torch.manual_seed(21)
    ref = make()
    module = make()
    randomize(module)
    torch.manual_seed(21)
    reset_parameters(module)
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), ref.parameters(), strict=True))
    randomize(module)
    reset_parameters(module, generator=torch.Generator().manual_seed(21))
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), ref.parameters(), strict=True))


class Custom(nn.Module):
    """A module whose reset_parameters() takes no generator and draws from the global RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3, 4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.w.normal_()


class MyLinear(nn.Linear):
    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.5)
            if self.bias is not None:
                self.bias.fill_(-0.5)


def test_reset_routes_a_generator_through_modules_that_take_none() -> None:
    model = nn.Sequential(Custom(), nn.LayerNorm(4), MyLinear(4, 2))
    torch.manual_seed(1)
    before = torch.get_rng_state()
    g = torch.Generator().manual_seed(8)
    reset_parameters(model, generator=g)
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is untouched
    expected = torch.randn(3, 4, generator=torch.Generator().manual_seed(8))
    assert torch.equal(par(model, "0.w"), expected)
    follow = torch.randn(2, generator=g)  # the generator advanced past the module's draws
    ref = torch.Generator().manual_seed(8)
    torch.randn(3, 4, generator=ref)
    assert torch.equal(follow, torch.randn(2, generator=ref))
    assert torch.equal(par(model, "2.weight"), torch.full((2, 4), 0.5))  # a subclass's own reset is kept


def test_reset_transformer_encoder_layer_matches_construction_except_the_fixed_in_proj() -> None:
    e = 8
    torch.manual_seed(4)
    ref = nn.TransformerEncoderLayer(e, 2, dim_feedforward=16)
    layer = nn.TransformerEncoderLayer(e, 2, dim_feedforward=16)
    torch.manual_seed(4)
    reset_parameters(layer)
    for (name, a), b in zip(layer.named_parameters(), ref.parameters(), strict=True):
        if name != "self_attn.in_proj_weight":
            assert torch.equal(a, b), name  # same draws in the same order: only the bound of in_proj changed
    torch.manual_seed(4)
    nn.Linear(e, e)
    expected = torch.cat([xavier_uniform_(torch.empty(e, e)) for _ in range(3)])
    assert torch.equal(layer.self_attn.in_proj_weight, expected)


def test_reset_transformer_is_xavier_per_block_everywhere() -> None:
    t = nn.Transformer(16, 2, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=8, batch_first=True)
    reset_parameters(t, generator=torch.Generator().manual_seed(0))
    lay = layouts(t)
    for name, p in t.named_parameters():
        if p.dim() < 2:
            continue
        if name in lay:
            for blk in blocks(p, lay[name]).values():
                assert blk.abs().max() <= math.sqrt(6 / 32)
                assert blk.abs().max() > math.sqrt(6 / 64)
        else:
            assert p.abs().max() <= math.sqrt(6 / sum(p.shape))
    # the encoder layers were deep copies of one layer at construction; reset gives each its own draws
    w0, w1 = (t.encoder.layers[i].self_attn.in_proj_weight for i in (0, 1))
    assert not torch.equal(w0, w1)


def test_reset_parameters_bad_input() -> None:
    with pytest.raises(PackedInitError, match=r"generator must be a torch.Generator, got int"):
        reset_parameters(nn.LSTM(2, 3), generator=0)  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(PackedInitError, match=r"needs an nn.Module"):
        reset_parameters(torch.zeros(2))  # type: ignore[arg-type]  # wrong on purpose


# -- init_recurrent_ --------------------------------------------------------------------------------------
def test_init_recurrent_lstm_every_layer_and_direction() -> None:
    h, i = 6, 4
    lstm = nn.LSTM(i, h, num_layers=2, bidirectional=True, proj_size=3)
    assert init_recurrent_(lstm, forget_bias=1.0, generator=torch.Generator().manual_seed(0)) is lstm
    lay = layouts(lstm)
    for name, p in lstm.named_parameters():
        if name.startswith("weight_hh"):
            for blk in blocks(p, lay[name]).values():  # (H, P) with P = 3 < H: orthonormal columns
                torch.testing.assert_close(blk.T @ blk, torch.eye(3), atol=1e-5, rtol=0)
        elif name.startswith("weight_ih"):
            fan_in = p.shape[1]
            for blk in blocks(p, lay[name]).values():
                assert blk.abs().max() <= math.sqrt(6 / (h + fan_in))
        elif name.startswith("weight_hr"):
            assert p.abs().max() <= math.sqrt(6 / (3 + h))
        elif name.startswith("bias_ih"):
            gates = blocks(p, lay[name])
            assert torch.equal(gates["f"], torch.ones(h))
            assert all(torch.equal(gates[g], torch.zeros(h)) for g in ("i", "g", "o"))
            other = getattr(lstm, name.replace("bias_ih", "bias_hh"))
            assert torch.equal(other, torch.zeros(4 * h))  # summed forget bias is exactly forget_bias
        else:
            assert name.startswith("bias_hh")


def test_init_recurrent_is_bit_identical_to_separate_gates_and_keeps_global_rng() -> None:
    h = 5
    lstm = nn.LSTM(3, h)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    g = torch.Generator().manual_seed(9)
    init_recurrent_(lstm, generator=g)
    assert torch.equal(torch.get_rng_state(), before)
    g.manual_seed(9)
    wi = torch.cat([xavier_uniform_(torch.empty(h, 3), generator=g) for _ in range(4)])
    wh = torch.cat([orthogonal_(torch.empty(h, h), generator=g) for _ in range(4)])
    assert torch.equal(par(lstm, "weight_ih_l0"), wi)
    assert torch.equal(par(lstm, "weight_hh_l0"), wh)


def test_init_recurrent_gru_cells_and_models() -> None:
    model = nn.ModuleDict(
        {"gru": nn.GRU(3, 4, bidirectional=True), "cell": nn.LSTMCell(3, 4), "rnn": nn.RNNCell(3, 4)}
    )
    randomize(model)
    init_recurrent_(model, forget_bias=2.0)
    gru = model["gru"]
    for name, p in gru.named_parameters():
        if name.startswith("bias"):
            assert torch.equal(p, torch.zeros(12)), name  # no forget gate: zero biases
        elif name.startswith("weight_hh"):
            for blk in p.chunk(3):
                torch.testing.assert_close(blk @ blk.T, torch.eye(4), atol=1e-5, rtol=0)
    assert torch.equal(par(model, "cell.bias_ih"), torch.tensor([0.0] * 4 + [2.0] * 4 + [0.0] * 8))
    assert torch.equal(par(model, "cell.bias_hh"), torch.zeros(16))
    whh = par(model, "rnn.weight_hh")
    torch.testing.assert_close(whh @ whh.T, torch.eye(4), atol=1e-5, rtol=0)
    assert torch.equal(par(model, "rnn.bias_ih"), torch.zeros(4))


def test_init_recurrent_per_gate_specs() -> None:
    lstm = nn.LSTM(3, 4)
    randomize(lstm)
    old_ih = par(lstm, "weight_ih_l0").detach().clone()
    init_recurrent_(lstm, input_init={"g": nn.init.ones_}, hidden_init=[orthogonal_, None, None, nn.init.zeros_])
    assert torch.equal(par(lstm, "weight_ih_l0")[8:12], torch.ones(4, 3))
    assert torch.equal(par(lstm, "weight_ih_l0")[:8], old_ih[:8])  # unnamed gates left as they were
    assert torch.equal(par(lstm, "weight_hh_l0")[12:], torch.zeros(4, 4))


def test_init_recurrent_errors_write_nothing() -> None:
    lstm = nn.LSTM(3, 4, proj_size=2)
    randomize(lstm)
    before = [p.detach().clone() for p in lstm.parameters()]
    with pytest.raises(PackedInitError, match=r"dirac_ rejected block 'i' of logical shape \(4, 3\)"):
        init_recurrent_(lstm, input_init=dirac_)
    with pytest.raises(PackedInitError, match=r"'weight_hr_l0' \(proj_size projection, one matrix\) needs one fun"):
        init_recurrent_(lstm, input_init={"i": xavier_uniform_})
    with pytest.raises(PackedInitError, match=r"forget_bias must be a finite number, got nan"):
        init_recurrent_(lstm, forget_bias=float("nan"))
    assert all(torch.equal(a, b) for a, b in zip(lstm.parameters(), before, strict=True))
    with pytest.raises(PackedInitError, match=r"Linear contains no LSTM/GRU/RNN"):
        init_recurrent_(nn.Linear(2, 2))


@given(
    e=st.sampled_from([4, 8, 12]),
    heads=st.sampled_from([1, 2, 4]),
    hidden=st.integers(1, 6),
    layers=st.integers(1, 2),
    bidirectional=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_whole_model_init_bit_identical_to_separate_blocks(
    e: int, heads: int, hidden: int, layers: int, bidirectional: bool, seed: int
) -> None:
    model = nn.ModuleDict(
        {
            "attn": nn.MultiheadAttention(e, heads),
            "lstm": nn.LSTM(e, hidden, num_layers=layers, bidirectional=bidirectional),
            "gru": nn.GRUCell(e, hidden),
        }
    )
    chunked(xavier_uniform_)(model, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    lay = layouts(model)
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        if name in lay:
            parts = [xavier_uniform_(torch.empty(b.shape), generator=g) for b in lay[name].blocks(p.shape)]
            assert torch.equal(p, torch.cat(parts)), name
        else:
            assert torch.equal(p, xavier_uniform_(torch.empty(p.shape), generator=g)), name

"""``packedinit.fingerprint`` in one process: the hash is the documented function of the logical block's values
(checked against plain Python integers), storage, fusion and splitting do not change it, one changed value is
named by ``diff``, JSON round-trips exactly, and the call is read-only."""

from __future__ import annotations

import importlib.util
import io
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import packedinit
from packedinit import Fingerprint, Layout, PackedInitError, fingerprint
from packedinit.auditing.blockhash import block_hash
from packedinit.auditing.fp_reduce import block_sums

A = 0x9E3779B97F4A7C15
M = 1 << 64


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"packedinit_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


W = _load("_fp_worker")


def logical(t: Tensor, layout: Layout, block: object) -> Tensor:
    """The block as a contiguous tensor of its logical shape (through the layout's own views)."""
    s = layout.storage_view(t, block)  # type: ignore[arg-type]
    d = layout.normalized_dim(t.dim()) - layout.batch_dims
    merged = s.reshape(*s.shape[:d], s.shape[d] * s.shape[d + 1], *s.shape[d + 2 :])
    return (merged.transpose(0, 1) if layout.transposed else merged).contiguous()


def python_hash(values: Tensor) -> str:
    """The documented hash, with Python integers: the sum over logical flat index i of A**i * m(b_i) mod 2**64,
    m(b) = b ^ (b >>> w/2) in the values' width w, sign-extended."""
    w = 8 * values.element_size()
    ints = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[w]
    raw = 0
    for i, b in enumerate(values.reshape(-1).view(ints).tolist()):
        u = b % (1 << w)
        m = u ^ (u >> (w // 2))
        m = m - (1 << w) if m >> (w - 1) else m  # sign-extend
        raw = (raw + pow(A, i, M) * m) % M
    return block_hash(raw, values.numel())


LAYOUTS = [
    ("mha", (18, 6), Layout(0, [6, 6, 6])),
    ("gqa_uneven", (14, 7), Layout(0, [6, 4, 4])),
    ("neox_interleaved", (18, 5), Layout(0, [1, 1, 1], groups=6)),
    ("conv1d_transposed", (5, 12), Layout(1, [4, 4, 4], transposed=True)),
    ("experts", (3, 10, 4), Layout(1, [5, 5], batch_dims=1)),
    ("gpt_oss_interleaved_transposed", (2, 4, 6), Layout(2, [1, 1], groups=3, transposed=True, batch_dims=1)),
    ("conv", (12, 3, 2, 2), Layout(0, [4, 8])),
    ("bias", (12,), Layout(0, [4, 4, 4])),
]


@pytest.mark.parametrize(("name", "shape", "layout"), LAYOUTS, ids=[c[0] for c in LAYOUTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
@pytest.mark.parametrize("chunk", [1 << 16, 5])
def test_hash_is_the_documented_function_of_the_logical_block(
    name: str, shape: tuple[int, ...], layout: Layout, dtype: torch.dtype, chunk: int
) -> None:
    g = torch.Generator().manual_seed(len(name))
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    fp = fingerprint(t, layout=layout, name="w", chunk=chunk)
    for block, rec in zip(layout.blocks(shape), fp.blocks.values(), strict=True):
        values = logical(t, layout, block)
        assert rec.shape == tuple(values.shape) == tuple(block.shape)
        assert (rec.fan_in, rec.fan_out) == (block.fan_in, block.fan_out)
        assert rec.hash == python_hash(values)
        v = values.double()
        assert rec.count == v.numel()
        assert rec.mean == pytest.approx(float(v.mean()), rel=1e-12, abs=1e-12)
        assert rec.std == pytest.approx(float(v.std(correction=0)), rel=1e-9)
        assert (rec.min, rec.max) == (float(v.min()), float(v.max()))


def test_storage_does_not_change_the_hash() -> None:
    """Contiguous, transposed storage, a strided view, a packed copy: the same logical matrix hashes alike."""
    w = torch.randn(6, 8)
    plain = fingerprint(w)["tensor"].hash
    assert fingerprint(w.t().contiguous().t())["tensor"].hash == plain  # column-major storage
    big = torch.randn(12, 16)
    big[::2, ::2] = w
    assert fingerprint(big[::2, ::2])["tensor"].hash == plain  # strided view
    stored = w.t().contiguous()  # (in, out) storage, as GPT-2's Conv1D keeps it
    assert fingerprint(stored, layout=Layout(1, [6], transposed=True))["tensor"].hash == plain
    inter = torch.stack([w, torch.zeros(6, 8)], 1).reshape(12, 8)  # rows interleaved w0 z0 w1 z1 ...
    assert fingerprint(inter, layout=Layout(0, [1, 1], groups=6), name="x")["x[0]"].hash == plain
    assert fingerprint(w, chunk=3)["tensor"].hash == plain
    assert fingerprint(w.t())["tensor"].hash != plain  # the transposed matrix: other values at each index
    assert fingerprint(w.reshape(6, 2, 4))["tensor"].hash == plain  # the hash reads values in flat order (shape apart)


@settings(max_examples=40, deadline=None)
@given(
    case=st.sampled_from(LAYOUTS),
    data=st.data(),
)
def test_any_split_into_shards_adds_up_to_the_whole(
    case: tuple[str, tuple[int, ...], Layout], data: st.DataObject
) -> None:
    """The local shards of any box split (what DTensor placements give) add up to the whole block's sums."""
    _, shape, layout = case
    t = torch.randn(shape)
    cuts = []
    for n in shape:
        c = sorted(data.draw(st.lists(st.integers(0, n), max_size=2)))
        cuts.append([0, *c, n])
    whole_ranges = [range(n) for n in shape]
    for block in layout.blocks(shape):
        whole = block_sums(t, whole_ranges, shape, layout, block)
        raw, count = 0, 0
        boxes: list[list[range]] = [[]]
        for c in cuts:
            boxes = [[*b, range(c[i], c[i + 1])] for b in boxes for i in range(len(c) - 1)]
        for ranges in boxes:
            local = t[tuple(slice(r.start, r.stop) for r in ranges)]
            part = block_sums(local, ranges, shape, layout, block)
            raw, count = (raw + part.raw) % M, count + part.count
        assert (raw, count) == (whole.raw, whole.count)


def _twins() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    fused = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2), "lstm": nn.LSTM(4, 3)})
    twin = nn.ModuleDict({n: nn.Linear(8, 8) for n in "qkv"} | {g: nn.Linear(4, 3) for g in "ifgo"})
    with torch.no_grad():
        for i, n in enumerate("qkv"):
            twin[n].weight.copy_(fused["attn"].in_proj_weight[8 * i : 8 * i + 8])
            twin[n].bias.copy_(fused["attn"].in_proj_bias[8 * i : 8 * i + 8])
        for i, g in enumerate("ifgo"):
            twin[g].weight.copy_(fused["lstm"].weight_ih_l0[3 * i : 3 * i + 3])
            twin[g].bias.copy_(fused["lstm"].bias_ih_l0[3 * i : 3 * i + 3])
    return fused, twin


def test_a_fused_block_and_its_unfused_twin_hash_the_same() -> None:
    fused, twin = _twins()
    a, b = fingerprint(fused), fingerprint(twin)
    for n in "qkv":
        assert a[f"attn.in_proj_weight[{n}]"].hash == b[f"{n}.weight"].hash
        assert a[f"attn.in_proj_bias[{n}]"].hash == b[f"{n}.bias"].hash
        assert a[f"attn.in_proj_weight[{n}]"].std == pytest.approx(b[f"{n}.weight"].std, rel=1e-12)
    for g in "ifgo":
        assert a[f"lstm.weight_ih_l0[{g}]"].hash == b[f"{g}.weight"].hash
    hashes = [r.hash for k, r in a.blocks.items() if "weight" in k]  # (MHA's biases are all zeros)
    assert len(set(hashes)) == len(hashes)  # distinct values: distinct hashes


def _owners(model: nn.Module, fp: Fingerprint) -> dict[tuple[str, int], str]:
    """(param, flat storage index) -> key, from the layouts' own views of an index tensor."""
    lays = packedinit.layouts(model)
    out: dict[tuple[str, int], str] = {}
    keys = iter(fp.blocks)
    for name, p in model.named_parameters():
        idx = torch.arange(p.numel()).reshape(p.shape)
        lay = lays.get(name)
        blocks = lay.blocks(p.shape) if lay is not None else [None]
        for b in blocks:
            key = next(keys)
            pos = idx if b is None or lay is None else lay.storage_view(idx, b)
            out.update({(name, int(i)): key for i in pos.reshape(-1).tolist()})
    return out


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_one_changed_value_anywhere_is_named_by_diff(data: st.DataObject) -> None:
    model = W.eager()
    before = fingerprint(model)
    owners = _owners(model, before)
    name, i = data.draw(st.sampled_from(sorted(owners)))
    p = dict(model.named_parameters())[name]
    with torch.no_grad():
        flat = p.view(-1)
        flat[i] = torch.nextafter(flat[i], torch.tensor(math.inf))  # one ulp
    d = fingerprint(model).diff(before)
    assert d == [owners[(name, i)]]
    assert f"first: {owners[(name, i)]!r}" in str(d)


def test_eager_and_meta_to_empty_init_fingerprints_are_identical() -> None:
    a, b = fingerprint(W.eager()), fingerprint(W.meta_then_init())
    assert a == b
    assert a.diff(b) == []
    assert "fingerprints match" in str(a.diff(b))
    assert a.to_json() == b.to_json()


def test_diff_report_names_the_first_block_and_its_std_ratio() -> None:
    model = W.eager()
    a = fingerprint(model)
    with torch.no_grad():
        model.attn.in_proj_weight[6:12].mul_(2.0)  # k twice as large
    d = a.diff(fingerprint(model))
    assert d == ["attn.in_proj_weight[k]"]
    assert "std" in str(d)
    assert "(ratio 2.0000)" in str(d)
    extra = Fingerprint({**a.blocks, "x": a["head.bias"]}, "Net")
    assert a.diff(extra) == ["x"]
    assert "only in the second" in str(a.diff(extra))


def test_json_round_trip_is_exact() -> None:
    t = torch.tensor([[0.1, -0.0, float("nan")], [float("inf"), 1e-30, -3.5]])
    for fp in (
        fingerprint(W.eager()),
        fingerprint(t),
        fingerprint(torch.empty(3, 4, device="meta")),
        fingerprint(torch.full((2,), float("nan"))),
    ):
        text = fp.to_json()
        back = Fingerprint.from_json(text)
        assert back == fp
        assert back.to_json() == text
    rec = fingerprint(t)["tensor"]
    assert (rec.non_finite, rec.count, rec.min, rec.max) == (2, 6, -3.5, float(t[0, 0]))
    with pytest.raises(PackedInitError, match=r"not a fingerprint written by Fingerprint\.to_json"):
        Fingerprint.from_json('{"blocks": []}')


def test_meta_and_complex_give_shapes_and_fans_only() -> None:
    with torch.device("meta"):
        model = nn.MultiheadAttention(8, 2)
    rec = fingerprint(model)["in_proj_weight[k]"]
    assert (rec.shape, rec.fan_in, rec.fan_out, rec.count, rec.hash, rec.std) == ((8, 8), 8, 8, 64, None, None)
    assert fingerprint(torch.randn(3, 3, dtype=torch.complex64))["tensor"].hash is None
    assert fingerprint(torch.ones(()))["tensor"].hash == python_hash(torch.ones(1))
    assert fingerprint(torch.empty(0, 3))["tensor"].count == 0


def test_read_only() -> None:
    model = W.eager()
    model.train()
    hook = model.head.register_forward_hook(lambda *a: None)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = [p.requires_grad for p in model.parameters()]
    cpu = torch.get_rng_state()
    gen = torch.Generator().manual_seed(5)
    gen_state = gen.get_state()
    fingerprint(model)
    fingerprint(model.attn.in_proj_weight, layout=Layout(0, [6, 6, 6]))
    for n, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.int32), params[n].view(torch.int32)), n
    assert grads == [p.requires_grad for p in model.parameters()]
    assert torch.equal(cpu, torch.get_rng_state())
    assert torch.equal(gen_state, gen.get_state())
    assert model.training
    assert len(model.head._forward_hooks) == 1
    hook.remove()


def test_refused_inputs_name_the_fix() -> None:
    with pytest.raises(PackedInitError, match=r"needs an nn\.Module or a tensor, got list"):
        fingerprint([1, 2])  # type: ignore[arg-type]
    with pytest.raises(PackedInitError, match="layouts names 'nope', which is not a parameter of Linear"):
        fingerprint(nn.Linear(2, 2), layouts={"nope": Layout(0, [1, 1])})
    with pytest.raises(PackedInitError, match=r"give a tensor's layout as layout=Layout"):
        fingerprint(torch.zeros(2), layouts={})
    with pytest.raises(PackedInitError, match="chunk is a number of elements"):
        fingerprint(torch.zeros(2), chunk=0)
    with pytest.raises(PackedInitError, match="dim 0 has length 5"):
        fingerprint(torch.zeros(5, 2), layout=Layout(0, [2, 2]))


def _cli(*args: str) -> tuple[int, str, str]:
    from packedinit.cli.command import main

    out, err = io.StringIO(), io.StringIO()
    return main(list(args), stdout=out, stderr=err), out.getvalue(), err.getvalue()


def test_cli_prints_the_fingerprint_and_compares_with_a_saved_one(tmp_path: Path) -> None:
    mha = ("torch.nn:MultiheadAttention", "embed_dim=8", "num_heads=2")
    code, out, err = _cli("fingerprint", *mha, "--json")
    assert (code, err) == (0, "")
    torch.manual_seed(0)
    assert Fingerprint.from_json(out) == fingerprint(nn.MultiheadAttention(8, 2))
    saved = tmp_path / "fp.json"
    saved.write_text(out)
    code, out, _ = _cli("fingerprint", *mha, "--against", str(saved))
    assert code == 0
    assert "in_proj_weight[k]  (8, 8)" in out
    assert "fingerprints match: 8 blocks" in out
    code, out, _ = _cli("fingerprint", *mha, "--seed", "1", "--against", str(saved))
    assert code == 1
    assert "first: 'in_proj_weight[q]'" in out
    assert "changed: mean, std, min, max, hash" in out
    code, out, _ = _cli("fingerprint", *mha, "--meta", "--json")
    assert code == 0
    assert Fingerprint.from_json(out)["in_proj_weight[v]"].hash is None
    code, _, err = _cli("fingerprint", *mha, "--against", str(tmp_path / "missing.json"))
    assert code == 2
    assert "--against" in err
    assert "cannot read it" in err


def test_the_accelerator_contraction_equals_the_cpu_one() -> None:
    """CUDA has no int64 matmul: off the CPU, contract() multiplies and sums; both wrap modulo 2**64 alike."""
    g = torch.randint(-(2**62), 2**62, (7, 33), dtype=torch.int64)
    w = torch.randint(-(2**62), 2**62, (33,), dtype=torch.int64)
    assert torch.equal(torch.matmul(g, w), (g * w).sum(-1))
    want = [sum(int(a) * int(b) for a, b in zip(row, w.tolist(), strict=True)) % M for row in g.tolist()]
    assert [int(v) % M for v in torch.matmul(g, w).tolist()] == want

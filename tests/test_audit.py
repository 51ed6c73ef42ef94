"""packedinit.audit: per-block statistics, verdicts, meta/tied/unpacked models, no copies, JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import packedinit
from packedinit import Layout, PackedInitError, chunked_init
from packedinit.auditing.measure import DEFAULT_REFERENCES, AuditReport, Reference, audit, tolerance
from packedinit.auditing.tensors import audit_tensors

init = torch.nn.init
QKV = ("q", "k", "v")


def mha_layouts(e: int) -> dict[str, Layout]:
    return {
        "in_proj_weight": Layout(0, [e] * 3, names=QKV),
        "in_proj_bias": Layout(0, [e] * 3, names=QKV),
    }


def lstm_layouts(lstm: nn.LSTM) -> dict[str, Layout]:
    h = lstm.hidden_size
    return {n: Layout(0, [h] * 4, names=("i", "f", "g", "o")) for n, _ in lstm.named_parameters()}


def ratio(a: float | None, b: float | None) -> float:
    assert a is not None
    assert b is not None
    return a / b


# -- the MultiheadAttention problem, measured --------------------------------------------------


def test_mha_default_is_packed_xavier_sqrt2_too_small() -> None:
    torch.manual_seed(0)
    e = 64
    mha = nn.MultiheadAttention(e, 4)
    before = mha.in_proj_weight.detach().clone()
    rep = audit(mha, layouts=mha_layouts(e))
    assert torch.equal(mha.in_proj_weight, before)  # read-only
    p = rep["in_proj_weight"]
    assert p.verdict == "packed"
    assert p.layout == Layout(0, [e] * 3, names=QKV)
    for b, name in zip(p.blocks, QKV, strict=True):
        assert b.label == name
        assert b.shape == (e, e)
        assert (b.fan_in, b.fan_out) == (e, e)
        x = b.expected_std("xavier")
        assert x.per_block == pytest.approx(math.sqrt(2 / (2 * e)))
        assert x.packed == pytest.approx(math.sqrt(2 / (4 * e)))
        assert ratio(x.per_block, x.packed) == pytest.approx(math.sqrt(2))
        assert b.verdict == "packed"
        assert b.matches == ("xavier",)
        assert "1.41x" in b.detail
        view = before[QKV.index(name) * e : (QKV.index(name) + 1) * e]
        assert b.std == pytest.approx(view.std(unbiased=False).item(), rel=1e-5)
        assert b.mean == pytest.approx(view.mean().item(), abs=1e-6)
    assert rep["in_proj_bias"].verdict == "constant"  # torch zeroes it
    assert rep.unpacked == 2  # out_proj.weight, out_proj.bias
    assert [q.name for q in rep.packed] == ["in_proj_weight"]


def test_mha_after_chunked_xavier_is_per_block() -> None:
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(64, 4)
    chunked_init(mha.in_proj_weight, 3, 0, init.xavier_uniform_)
    rep = audit(mha, layouts=mha_layouts(64))
    p = rep["in_proj_weight"]
    assert p.verdict == "per-block"
    assert all("xavier" in b.matches for b in p.blocks)
    assert rep.packed == ()


def test_registry_layouts_are_the_default() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4)
    try:
        expected = packedinit.layouts(mha)
    except (NotImplementedError, AttributeError) as e:  # registry not wired yet
        pytest.fail(f"packedinit.layouts(model) is not usable: {e!r}")
    rep = audit(mha)
    assert [p.name for p in rep.params] == list(expected)
    assert rep["in_proj_weight"].verdict == "packed"


# -- LSTM gates, GQA, transposed, batch dims -------------------------------------------------------


def test_lstm_xavier_packed_vs_per_gate_and_orthogonal_recurrent() -> None:
    torch.manual_seed(2)
    lstm = nn.LSTM(32, 64)
    lay = lstm_layouts(lstm)
    w_ih, w_hh = lstm.get_parameter("weight_ih_l0"), lstm.get_parameter("weight_hh_l0")
    init.xavier_uniform_(w_ih)  # the forum recipe, on the packed (4H, I) tensor
    init.orthogonal_(w_hh)
    rep = audit(lstm, layouts=lay)
    ih, hh = rep["weight_ih_l0"], rep["weight_hh_l0"]
    assert ih.verdict == "packed"
    assert "xavier" in ih.blocks[0].matches
    assert ih.blocks[0].expected_std("xavier").packed == pytest.approx(math.sqrt(2 / (4 * 64 + 32)))
    assert hh.verdict == "packed"
    assert "orthogonal" in hh.blocks[0].matches
    assert hh.blocks[0].expected_std("orthogonal").packed == pytest.approx(1 / math.sqrt(4 * 64))
    assert rep["bias_ih_l0"].verdict == "n/a"
    # per gate: xavier per block and orthogonal per block
    chunked_init(w_ih, lay["weight_ih_l0"], None, init.xavier_uniform_)
    chunked_init(w_hh, lay["weight_hh_l0"], None, init.orthogonal_)
    rep = audit(lstm, layouts=lay)
    assert rep["weight_ih_l0"].verdict == "per-block"
    assert rep["weight_hh_l0"].verdict == "per-block"
    assert all("orthogonal" in b.matches for b in rep["weight_hh_l0"].blocks)


def test_lstm_default_init_is_not_fan_based() -> None:
    torch.manual_seed(3)
    lstm = nn.LSTM(32, 128)  # uniform(+-1/sqrt(H)): std 1/sqrt(3H), matches no xavier/kaiming on (H, 32)
    rep = audit(lstm, layouts=lstm_layouts(lstm))
    for b in rep["weight_ih_l0"].blocks:
        assert b.std == pytest.approx(1 / math.sqrt(3 * 128), rel=0.05)
        assert b.verdict == "fan-independent"  # torch's recurrent default (was "unknown" before issue 11)
        assert b.matches == ("rnn_default",)


def test_gqa_uneven_blocks() -> None:
    torch.manual_seed(4)
    nh, nkv, d, e = 8, 2, 16, 128
    w = torch.empty(nh * d + 2 * nkv * d, e)
    lay = Layout(0, [nh * d, nkv * d, nkv * d], names=QKV)
    init.xavier_normal_(w)
    rep = audit_tensors([("qkv_proj.weight", w, lay)])
    p = rep["qkv_proj.weight"]
    assert p.verdict == "packed"
    assert [b.shape for b in p.blocks] == [(128, 128), (32, 128), (32, 128)]
    ratios = [ratio(b.expected_std("xavier").per_block, b.expected_std("xavier").packed) for b in p.blocks]
    assert ratios == pytest.approx([math.sqrt(320 / 256), math.sqrt(320 / 160), math.sqrt(320 / 160)])
    chunked_init(w, lay, None, init.xavier_normal_)
    assert audit_tensors([("qkv_proj.weight", w, lay)])["qkv_proj.weight"].verdict == "per-block"


def test_transposed_conv1d_and_batched_experts() -> None:
    torch.manual_seed(5)
    e = 48
    c_attn = torch.empty(e, 3 * e)  # GPT-2 Conv1D: (in, 3*out)
    lay = Layout(1, [e] * 3, transposed=True, names=QKV)
    init.xavier_uniform_(c_attn)
    experts = torch.empty(4, 2 * 32, 48)  # Mixtral-style (n, 2I, E)
    lay_x = Layout(1, [32, 32], batch_dims=1, names=("gate", "up"))
    chunked_init(experts, lay_x, None, init.kaiming_normal_)
    rep = audit_tensors([("c_attn.weight", c_attn, lay), ("experts.gate_up", experts, lay_x)])
    p = rep["c_attn.weight"]
    assert p.verdict == "packed"
    assert p.blocks[0].expected_std("xavier").packed == pytest.approx(math.sqrt(2 / (4 * e)))
    x = rep["experts.gate_up"]
    assert len(x.blocks) == 8
    assert x.blocks[3].label == "[1] up"
    assert x.blocks[3].shape == (32, 48)
    assert x.verdict == "per-block"
    assert all("kaiming_in" in b.matches for b in x.blocks)
    for b in x.blocks:  # the per-expert view the audit reads equals the block's slice
        i, part = b.index // 2, b.index % 2
        assert b.std == pytest.approx(experts[i, part * 32 : (part + 1) * 32].std(unbiased=False).item(), rel=1e-5)


# -- unpacked, meta, tied, dtypes ------------------------------------------------------------------


def test_unpacked_model_has_nothing_to_audit() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    rep = audit(model, layouts={})
    assert len(rep) == 0
    assert rep.unpacked == 4
    assert "no packed parameters" in str(rep)
    assert json.loads(rep.to_json())["params"] == []
    rep = audit(model)  # the registry knows nn.Linear is not packed
    assert len(rep) == 0


def test_mha_kdim_path_has_only_the_bias_packed() -> None:
    mha = nn.MultiheadAttention(16, 2, kdim=8, vdim=12)
    assert mha.in_proj_weight is None
    rep = audit(mha)
    assert [p.name for p in rep.params] == ["in_proj_bias"]
    assert rep["in_proj_bias"].verdict == "constant"


def test_meta_model_gives_shapes_and_fans_only() -> None:
    with torch.device("meta"):
        enc = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64)
    lay = {"self_attn.in_proj_weight": Layout(0, [32] * 3, names=QKV)}
    rep = audit(enc, layouts=lay)
    p = rep["self_attn.in_proj_weight"]
    assert p.device == "meta"
    assert p.verdict == "unmeasured"
    assert p.note is not None
    assert "meta" in p.note
    for b in p.blocks:
        assert b.std is None
        assert b.mean is None
        assert (b.shape, b.fan_in, b.fan_out) == ((32, 32), 32, 32)
        assert b.expected_std("xavier").per_block == pytest.approx(math.sqrt(2 / 64))
    d = json.loads(rep.to_json())
    assert d["params"][0]["blocks"][0]["std"] is None
    assert "unmeasured" in str(rep)


def test_tied_weights_are_audited_once_with_aliases() -> None:
    torch.manual_seed(6)
    a, b = nn.Linear(8, 24), nn.Linear(8, 24)
    b.weight = a.weight
    model = nn.ModuleDict({"a": a, "b": b})
    lay = Layout(0, [8] * 3, names=QKV)
    rep = audit(model, layouts={"b.weight": lay, "a.weight": lay})
    assert [p.name for p in rep.params] == ["a.weight"]
    assert rep["a.weight"].aliases == ("b.weight",)
    assert rep["b.weight"] is rep["a.weight"]
    assert "b.weight" in rep
    assert "tied: b.weight" in str(rep)
    assert rep.unpacked == 2  # a.bias, b.bias


def test_bf16_and_integer_parameters() -> None:
    torch.manual_seed(7)
    w = torch.empty(3 * 64, 64)
    chunked_init(w, 3, 0, init.xavier_uniform_)
    lay = Layout(0, [64] * 3)
    rep = audit_tensors([("w", w.to(torch.bfloat16), lay), ("i", torch.zeros(192, 64, dtype=torch.int64), lay)])
    assert rep["w"].verdict == "per-block"
    assert rep["w"].dtype == "bfloat16"
    assert rep["i"].verdict == "unmeasured"
    assert rep["i"].note is not None
    assert "int64" in rep["i"].note


# -- no copies of parameters -----------------------------------------------------------------------


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode base class is untyped
    """Records every aten op and the size of every output that owns fresh memory."""

    def __init__(self, storage_ptr: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's mode base class is untyped
        self.storage_ptr = storage_ptr
        self.ops: list[str] = []
        self.fresh: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != self.storage_ptr:
                self.fresh.append(t.numel())
        return out


def test_audit_reads_views_and_copies_nothing() -> None:
    torch.manual_seed(8)
    e, g = 32, 4
    w = torch.empty(g * 3 * e // g * 1, e)  # (96, 32): NeoX-style per-head interleaving, non-contiguous blocks
    lay = Layout(0, [e // g] * 3, groups=g, names=QKV)
    chunked_init(w, lay, None, init.xavier_uniform_)
    rec = _Recorder(w.untyped_storage().data_ptr())
    with rec:
        rep = audit_tensors([("qkv", w, lay)])
    assert rep["qkv"].verdict == "per-block"
    assert not any(op.startswith(("aten.clone", "aten.copy", "aten._to_copy", "aten.contiguous")) for op in rec.ops)
    assert max(rec.fresh) <= 1  # only scalars (mean, var) are allocated


# -- statistics --------------------------------------------------------------------------------------


def test_tolerance_rule() -> None:
    assert tolerance(128 * 128) == pytest.approx(5 / math.sqrt(2 * 128 * 128))
    assert tolerance(128 * 128, kurtosis=1.8) == pytest.approx(5 * math.sqrt(0.2 / (128 * 128)))
    assert tolerance(10**9) == 0.005
    assert tolerance(1) == pytest.approx(5 / math.sqrt(2))
    assert tolerance(100, kurtosis=float("nan")) == tolerance(100)


def test_kurtosis_is_measured_and_sets_the_tolerance() -> None:
    g = torch.Generator().manual_seed(11)
    u, n, s = torch.empty(3 * 128, 128), torch.empty(3 * 128, 128), torch.empty(3 * 128, 128)
    chunked_init(u, 3, 0, init.xavier_uniform_, generator=g)
    chunked_init(n, 3, 0, init.xavier_normal_, generator=g)
    chunked_init(s, 3, 0, init.sparse_, 0.9, generator=g)  # 90% zeros per column: heavy tails
    lay = Layout(0, [128] * 3)
    rep = audit_tensors([("u", u, lay), ("n", n, lay), ("s", s, lay)])
    for name, kurt in (("u", 1.8), ("n", 3.0), ("s", 30.0)):
        for b in rep[name].blocks:
            assert b.kurtosis == pytest.approx(kurt, rel=0.15)
            assert b.kurtosis is not None
            assert b.tolerance == pytest.approx(tolerance(b.numel, b.kurtosis))
    assert rep["u"].verdict == "per-block"
    assert rep["n"].verdict == "per-block"


def test_small_lstm_default_is_not_mistaken_for_a_packed_init() -> None:
    # LSTM(16, 32): the default uniform(+-1/sqrt(32)) gives std 0.102, within 13% of packed xavier (0.118)
    # and packed orthogonal (0.088). A normal-case tolerance (5/sqrt(2n) = 16% at n = 512) would call it
    # "packed"; the uniform draws' own kurtosis gives 9.9%, and the verdict stays honest.
    for seed in range(5):
        torch.manual_seed(seed)
        lstm = nn.LSTM(16, 32)
        rep = audit(lstm, layouts=lstm_layouts(lstm))
        assert rep["weight_ih_l0"].verdict != "packed", [b.detail for b in rep["weight_ih_l0"].blocks]


def test_parameter_verdict_pools_the_blocks() -> None:
    # LSTM(8, 16): blocks of 128 values are too few to reject packed xavier (14% away, 3.6 standard errors)
    # one by one: each block is undecided (before issue 11 they read "packed"); pooled over the 4 gates
    # (512 values) packed xavier is ruled out and only torch's recurrent default remains.
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16)
    p = audit(lstm, layouts=lstm_layouts(lstm))["weight_ih_l0"]
    assert "packed" not in {b.verdict for b in p.blocks}
    assert "undecided" in {b.verdict for b in p.blocks}
    assert p.verdict == "fan-independent"
    assert "std (pooled)" in p.decided_by
    # and pooling sharpens a true packed signature: GQA blocks of different sizes, packed xavier
    w = torch.empty(8 * 8 + 2 * 2 * 8, 64)
    init.xavier_uniform_(w, generator=torch.Generator().manual_seed(1))
    q = audit_tensors([("w", w, Layout(0, [64, 16, 16], names=QKV))])["w"]
    assert q.verdict == "packed"
    assert q.matches == ("xavier",)
    assert "1.12x to 1.41x" in q.detail  # per-block std would be sqrt(160/128) for q, sqrt(160/80) for k, v


def test_mixed_parameter() -> None:
    torch.manual_seed(13)
    w = torch.empty(3 * 64, 64)
    lay = Layout(0, [64] * 3, names=QKV)
    init.xavier_uniform_(w)  # packed ...
    chunked_init(w, lay, None, {"q": init.xavier_uniform_})  # ... then q alone per block
    p = audit_tensors([("w", w, lay)])["w"]
    assert [b.verdict for b in p.blocks] == ["per-block", "packed", "packed"]
    assert p.verdict == "mixed"
    assert p.detail == "mixed: per-block q; packed k, v"


@given(
    k=st.integers(2, 4),
    out=st.integers(24, 80),
    fan_in=st.integers(24, 80),
    fn=st.sampled_from([init.xavier_uniform_, init.xavier_normal_, init.kaiming_uniform_, init.kaiming_normal_]),
    seed=st.integers(0, 2**16),
)
def test_per_block_init_is_never_called_packed(k: int, out: int, fan_in: int, fn: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.empty(k * out, fan_in)
    chunked_init(w, k, 0, fn, generator=g)
    rep = audit_tensors([("w", w, Layout(0, [out] * k))])
    verdicts = {b.verdict for b in rep["w"].blocks}
    assert verdicts <= {"per-block", "undecided"}, [b.detail for b in rep["w"].blocks]
    name = "xavier" if "xavier" in fn.__name__ else "kaiming_in"
    assert all(name in b.matches or b.verdict == "undecided" for b in rep["w"].blocks)
    whole = torch.empty(k * out, fan_in)
    fn(whole, generator=g)
    verdicts = {b.verdict for b in audit_tensors([("w", whole, Layout(0, [out] * k))])["w"].blocks}
    if name == "xavier":  # xavier depends on fan_out: the packed signature shows (or is too small to tell)
        assert verdicts <= {"packed", "undecided"}
    else:  # kaiming fan_in does not change with dim-0 packing: per-block by construction (small
        # blocks may also sit near another reference's packed std: then undecided, never packed)
        assert verdicts <= {"per-block", "undecided"}


@pytest.mark.parametrize(
    ("fn", "kwargs"),
    [
        ("xavier_uniform_", {}),
        ("xavier_normal_", {"gain": 2.0}),
        ("kaiming_uniform_", {"a": math.sqrt(5)}),
        ("kaiming_normal_", {"mode": "fan_out", "nonlinearity": "relu"}),
        ("orthogonal_", {}),
        ("normal_", {"std": 0.02}),
        ("uniform_", {"a": -0.1, "b": 0.3}),
        ("trunc_normal_", {"std": 1.0, "a": -1.0, "b": 1.5}),
    ],
)
def test_reference_std_is_what_torch_draws(fn: str, kwargs: dict[str, Any]) -> None:
    ref = Reference.of(fn, **kwargs)
    shape = (96, 200)
    t = torch.empty(shape)
    getattr(init, fn)(t, generator=torch.Generator().manual_seed(0), **kwargs)
    measured = t.std(unbiased=False).item()
    expected = ref.std(shape)
    assert expected is not None
    assert abs(math.log(measured / expected)) <= tolerance(t.numel())


def test_reference_errors() -> None:
    with pytest.raises(PackedInitError, match=r"not a torch\.nn\.init function"):
        Reference.of("nope_")
    with pytest.raises(PackedInitError, match="no closed-form std"):
        Reference.of("eye_")
    with pytest.raises(PackedInitError, match="unexpected keyword"):
        Reference.of("xavier_uniform_", gian=2.0)
    with pytest.raises(PackedInitError, match="mode"):
        Reference.of("kaiming_uniform_", mode="fan_avg")
    assert Reference.of("xavier_uniform_").std((5,)) is None
    assert Reference.of("xavier_normal_", also=("x",)).describe() == "xavier_normal_ / x"


def test_custom_references_and_repeated_names() -> None:
    w = torch.empty(3 * 64, 64)
    chunked_init(w, 3, 0, init.kaiming_normal_, nonlinearity="relu")
    ref = Reference.of("kaiming_normal_", nonlinearity="relu")
    rep = audit_tensors([("w", w, Layout(0, [64] * 3))], references=(ref,))
    assert rep["w"].verdict == "per-block"
    assert rep["w"].blocks[0].matches == (ref.name,)
    with pytest.raises(PackedInitError, match="repeated names"):
        audit_tensors([("w", w, Layout(0, [64] * 3))], references=(ref, ref))


# -- errors, rendering, JSON, progress ------------------------------------------------------------


def test_bad_input_raises() -> None:
    mha = nn.MultiheadAttention(16, 2)
    with pytest.raises(PackedInitError, match=r"needs an nn\.Module"):
        audit(torch.empty(3))  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(PackedInitError, match=r"'in_proj', which is not a parameter"):
        audit(mha, layouts={"in_proj": Layout(0, [16] * 3)})
    with pytest.raises(PackedInitError, match=r"in_proj_weight.*\(48, 16\).*needs"):
        audit(mha, layouts={"in_proj_weight": Layout(0, [8] * 3)})
    with pytest.raises(KeyError, match="not an audited"):
        audit(mha, layouts={})["in_proj_weight"]


def test_table_and_json_round_trip() -> None:
    torch.manual_seed(10)
    mha = nn.MultiheadAttention(64, 4)
    rep = audit(mha, layouts=mha_layouts(64))
    text = str(rep)
    assert "in_proj_weight" in text
    assert "packed: xavier" in text
    assert "xavier blk" in text
    assert max(len(line) for line in text.splitlines()) <= 120
    d = json.loads(rep.to_json())
    assert d["model"] == "MultiheadAttention"
    assert set(d["references"]) == {r.name for r in DEFAULT_REFERENCES}
    p = d["params"][0]
    assert p["name"] == "in_proj_weight"
    assert p["verdict"] == "packed"
    assert p["layout"]["sizes"] == [64, 64, 64]
    assert p["layout"]["names"] == ["q", "k", "v"]
    b = p["blocks"][1]
    assert b["label"] == "k"
    assert b["shape"] == [64, 64]
    assert b["expected"]["xavier"]["per_block"] == pytest.approx(0.125)
    assert b["std"] == pytest.approx(rep.params[0].blocks[1].std)
    assert d["counts"] == {"packed": 1, "constant": 1}


def test_report_is_frozen_and_progress_is_called() -> None:
    seen: list[tuple[int, int, str]] = []
    lstm = nn.LSTM(4, 8, num_layers=2)
    rep = audit(lstm, layouts=lstm_layouts(lstm), progress=lambda d, t, n: seen.append((d, t, n)))
    assert isinstance(rep, AuditReport)
    assert seen[0] == (0, 8, "weight_ih_l0")
    assert seen[-1] == (8, 8, "")
    with pytest.raises(AttributeError):
        rep.unpacked = 3  # type: ignore[misc]  # frozen on purpose


def test_shared_module_through_the_registry_is_audited_once() -> None:
    torch.manual_seed(12)
    mha = nn.MultiheadAttention(32, 4)
    model = nn.ModuleDict({"a": mha, "b": mha})
    rep = audit(model)
    assert [p.name for p in rep.params] == ["a.in_proj_weight", "a.in_proj_bias"]
    assert rep["b.in_proj_weight"].aliases == ("b.in_proj_weight",)
    assert rep["a.in_proj_weight"].verdict == "packed"


def test_sharded_dtensor_is_not_gathered(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = distribute_tensor(torch.randn(3 * 16, 16), mesh, [Shard(0)])
        rep = audit_tensors([("w", w, Layout(0, [16] * 3))])
        assert rep["w"].verdict == "unmeasured"
        assert rep["w"].note is not None
        assert "DTensor" in rep["w"].note
        assert rep["w"].blocks[0].fan_in == 16
    finally:
        dist.destroy_process_group()

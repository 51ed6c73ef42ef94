"""torchtitan 0.3.0 with its own config builders (issue 27): FusedQKVLinear, GroupedExperts and GPT-OSS's
experts get the layouts their forwards split by, and packedinit's per-block init draws bit for bit what
torchtitan's own fused init draws (peer parity). Skips, naming torchtitan, where it is not installed
(.ci/libs.txt installs it with --no-deps; it imports triton)."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import packedinit
from packedinit import Layout, chunked_init, fused_gate_up, fused_qkv

DIM = 64
INITS: dict[str, Callable[[Tensor], object]] = {
    "trunc_normal_": functools.partial(nn.init.trunc_normal_, std=0.02),
    "xavier_uniform_": nn.init.xavier_uniform_,
    "xavier_normal_": nn.init.xavier_normal_,
    "kaiming_uniform_": functools.partial(nn.init.kaiming_uniform_, a=5**0.5),
    "kaiming_normal_": nn.init.kaiming_normal_,
    "orthogonal_": nn.init.orthogonal_,
}
#: (n_heads, n_kv_heads, head_dim): GQA, MHA, MQA
HEADS = [(8, 2, 8), (4, 4, 16), (8, 1, 8)]


def _attention(lib: Any, n_heads: int, n_kv: int, head_dim: int, init: Callable[[Tensor], object]) -> nn.Module:
    """torchtitan's own builder: ``make_gqa_config(fuse_qkv=True)`` (the llama3/qwen3 configs' path)."""
    cu = lib("torchtitan.models.common.config_utils")
    rope = lib("torchtitan.models.common.rope")
    cfg = cu.make_gqa_config(
        dim=DIM,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        wqkv_param_init={"weight": init},
        wo_param_init={"weight": init},
        inner_attention=cu.get_attention_config("flex"),
        rope=rope.ComplexRoPE.Config(dim=head_dim, max_seq_len=32, theta=10000.0),
        fuse_qkv=True,
    )
    model: nn.Module = cfg.build()
    return model


def _experts(lib: Any, init: Callable[[Tensor], object]) -> nn.Module:
    moe = lib("torchtitan.models.common.moe")
    model: nn.Module = moe.GroupedExperts.Config(dim=DIM, hidden_dim=48, num_experts=4, param_init={
        "w1_EFD": init, "w2_EDF": init, "w3_EFD": init}).build()  # fmt: skip
    return model


@pytest.mark.parametrize(("n_heads", "n_kv", "head_dim"), HEADS)
def test_fused_qkv_layout_is_the_one_its_forward_splits_by(n_heads: int, n_kv: int, head_dim: int, lib: Any,
                                                           story: Any) -> None:  # fmt: skip
    attn = _attention(lib, n_heads, n_kv, head_dim, nn.init.zeros_)
    qkv = attn.qkv_linear
    layout = packedinit.layouts(attn)["qkv_linear.wqkv.weight"]
    out = qkv.wqkv.weight.shape[0]
    # torchtitan/models/common/attention.py:832 view(bs, seqlen, -1, r_dim, head_dim), then
    # :845 torch.split(t, [heads_per_kv, 1, 1], dim=-2)
    rows = torch.arange(out).view(-1, qkv.r_dim, head_dim)
    oracle = [p.flatten().tolist() for p in torch.split(rows, [qkv.heads_per_kv, 1, 1], dim=1)]
    assert story.rows(layout, out) == oracle
    assert layout == fused_qkv(n_heads, head_dim, n_kv, interleaved=True)


@pytest.mark.parametrize("init", list(INITS))
@pytest.mark.parametrize(("n_heads", "n_kv", "head_dim"), HEADS)
def test_peer_parity_with_torchtitans_fused_qkv_param_init(init: str, n_heads: int, n_kv: int, head_dim: int,
                                                           lib: Any) -> None:  # fmt: skip
    """``chunked_init(w, fused_qkv(...), None, f)`` == torchtitan's ``_fused_qkv_param_init`` (config_utils.py:106)."""
    f = INITS[init]
    attn = _attention(lib, n_heads, n_kv, head_dim, f)
    linear = attn.qkv_linear.wqkv
    torch.manual_seed(1)
    linear.init_states()  # torchtitan's own init: q, k, v drawn as the stock wq/wk/wv, then fused
    titan = linear.weight.detach().clone()
    torch.manual_seed(1)
    chunked_init(linear.weight, fused_qkv(n_heads, head_dim, n_kv, interleaved=True), None, f)
    assert torch.equal(linear.weight, titan)


@pytest.mark.parametrize("init", list(INITS))
def test_peer_parity_with_torchtitans_fused_gate_up_init(init: str, lib: Any) -> None:
    """FusedSwiGLU's ``w13`` ``(hidden, 2, dim)`` (overrides/fused_swiglu.py:449): flattened to ``(2 * hidden, dim)``
    it is gate/up interleaved row by row, and packedinit's init through that view draws exactly the stock
    FeedForward's separate ``w1`` then ``w3``. torchtitan's own ``_make_fused_gate_up_init`` (fused_swiglu.py:383)
    hands the strided halves ``w13[:, 0]``, ``w13[:, 1]`` to the init function: the same numbers for the uniform
    family and orthogonal_, not for the normal family (torch draws a strided tensor in another order)."""
    fs = lib("torchtitan.overrides.fused_swiglu")
    f = INITS[init]
    w13 = torch.empty(48, 2, DIM)
    torch.manual_seed(2)
    fs._make_fused_gate_up_init(f, f, gate_up_axis=1)(w13)
    titan = w13.clone()
    torch.manual_seed(2)
    gate, up = torch.empty(48, DIM), torch.empty(48, DIM)
    f(gate)
    f(up)
    torch.manual_seed(2)
    chunked_init(w13.view(-1, DIM), fused_gate_up(48, interleaved=True), None, f)
    assert torch.equal(w13, torch.stack([gate, up], dim=1))
    if "normal" not in init:
        assert torch.equal(w13, titan)


@pytest.mark.parametrize("init", list(INITS))
def test_stacked_experts_are_one_block_per_expert(init: str, lib: Any) -> None:
    """GroupedExperts' ``w1_EFD``/``w3_EFD`` ``(E, F, D)`` and ``w2_EDF`` ``(E, D, F)`` (moe.py:45-53), each expert
    used as ``x @ w.T`` (moe.py:97 ``B_t=w1_EFD.transpose(-2, -1)``): per-expert fans, bit-identical to
    initialising each expert's matrix on its own, in order."""
    f = INITS[init]
    experts = _experts(lib, f)
    found = packedinit.layouts(experts)
    assert found == {n: Layout(dim=1, sizes=[p.shape[1]], batch_dims=1) for n, p in experts.named_parameters()}
    for name, p in experts.named_parameters():
        torch.manual_seed(3)
        expected = torch.empty_like(p)
        for e in range(p.shape[0]):
            f(expected[e])
        torch.manual_seed(3)
        chunked_init(p, found[name], None, f)
        assert torch.equal(p, expected), name
        if init == "trunc_normal_":  # torchtitan's own init on the whole stack draws the same numbers
            torch.manual_seed(3)
            experts._init_param(name, p)
            assert torch.equal(p, expected), name


def test_grouped_experts_xavier_is_per_expert_where_the_issue_measured_a_third(lib: Any) -> None:
    """The issue's numbers: ``chunked(xavier_uniform_)`` gave 0.055-0.061 where each expert's own xavier is 0.204."""
    experts = _experts(lib, nn.init.zeros_)
    torch.manual_seed(0)
    packedinit.chunked(nn.init.xavier_uniform_)(experts)
    for p in experts.parameters():
        fan_in, fan_out = p.shape[2], p.shape[1]
        expected = (2.0 / (fan_in + fan_out)) ** 0.5
        assert abs(float(p.detach().std()) / expected - 1) < 0.05


def test_gpt_oss_experts_layout_is_the_one_swiglu_splits_by(lib: Any, story: Any) -> None:
    """GptOssGroupedExperts' ``mlp1_weight_EGD`` ``(E, 2F, D)``: ``swiglu`` takes ``x[..., ::2]`` and ``x[..., 1::2]``
    (torchtitan/models/gpt_oss/moe.py:68)."""
    moe = lib("torchtitan.models.gpt_oss.moe")
    experts = moe.GptOssGroupedExperts.Config(dim=DIM, hidden_dim=24, num_experts=2).build()
    found = packedinit.layouts(experts)
    layout = found["mlp1_weight_EGD"]
    rows = torch.arange(48)
    assert story.rows(Layout(0, layout.sizes, groups=layout.groups), 48) == [rows[::2].tolist(), rows[1::2].tolist()]
    assert layout.batch_dims == 1
    assert found["mlp2_weight_EDF"] == Layout(dim=1, sizes=[DIM], batch_dims=1)


def test_fix_torch_defaults_builds_fused_qkv_per_block_and_identical_elsewhere(lib: Any, story: Any) -> None:
    """torchtitan's Linear is an ``nn.Linear``: building it runs torch's default (kaiming_uniform_, a = sqrt 5) on the
    packed wqkv, whose bound reads fan_in only, the same for every block: the fixed build equals the plain one."""
    plain, fixed = story.fix_builds_per_block(lambda: _attention(lib, 8, 2, 8, nn.init.zeros_))
    assert "qkv_linear.wqkv.weight" in packedinit.layouts(fixed)
    for (n, a), (_, b) in zip(plain.named_parameters(), fixed.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_audit_says_torchtitans_own_init_is_per_block(lib: Any) -> None:
    """torchtitan's ``_fused_qkv_param_init`` is per block already: the audit says so, for xavier too."""
    attn = _attention(lib, 8, 2, 8, nn.init.xavier_uniform_)
    torch.manual_seed(0)
    attn.init_states()
    report = packedinit.audit(attn)
    assert report.affected == (), report.answer()
    assert report["qkv_linear.wqkv.weight"].verdict == "per-block"


def test_audit_and_its_printed_fix_after_a_whole_tensor_init(lib: Any, story: Any) -> None:
    """A user's DETR-style loop (``xavier_uniform_`` on every matrix) over a torchtitan attention: wqkv is affected,
    and the printed fix re-initialises exactly it, per block."""
    attn = _attention(lib, 8, 2, 8, nn.init.zeros_)
    torch.manual_seed(0)
    for p in attn.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    before = story.audit_fix_works(attn)
    assert before.affected == ("qkv_linear.wqkv.weight",)


def test_chunked_is_per_block(lib: Any, story: Any) -> None:
    story.chunked_is_per_block(_attention(lib, 8, 2, 8, nn.init.zeros_), nn.init.xavier_uniform_)


def _fused_swiglu(lib: Any, hidden: int = 48) -> nn.Module:
    """torchtitan's ``fused_swiglu`` override of its own ``make_ffn_config`` (the path ``--override.imports`` takes)."""
    cu, fs = lib("torchtitan.models.common.config_utils"), lib("torchtitan.overrides.fused_swiglu")
    init = {"weight": nn.init.xavier_uniform_}
    model: nn.Module = fs.fused_swiglu(cu.make_ffn_config(dim=DIM, hidden_dim=hidden, w1_param_init=init,
                                                          w2w3_param_init=init)).build()  # fmt: skip
    return model


def _fused_experts(lib: Any) -> nn.Module:
    fs = lib("torchtitan.overrides.fused_swiglu")
    init = dict.fromkeys(("w1_EFD", "w2_EDF", "w3_EFD"), nn.init.xavier_uniform_)
    cfg = lib("torchtitan.models.common.moe").GroupedExperts.Config(dim=DIM, hidden_dim=24, num_experts=3,
                                                                    param_init=init)  # fmt: skip
    model: nn.Module = fs.fused_grouped_experts(cfg).build()
    return model


IDIOMS: dict[str, Callable[[nn.Module], object]] = {
    "chunked(f)(model)": lambda m: packedinit.chunked(nn.init.xavier_uniform_)(m),
    "model.apply(chunked(f))": lambda m: m.apply(packedinit.chunked(nn.init.xavier_uniform_)),
    "init_model": lambda m: packedinit.init_model(m, nn.init.xavier_uniform_),
    "reset_parameters": packedinit.reset_parameters,
}


@pytest.mark.parametrize("build", ["FusedSwiGLU", "FusedGroupedExperts"])
@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_fused_w13_is_loud_and_its_printed_fix_is_per_block(idiom: str, build: str, lib: Any) -> None:
    """``w13`` ``(hidden, 2, dim)`` / ``(E, hidden, 2, dim)``: no Layout of that shape describes ``w13[..., j, :]``,
    so every whole-model idiom warns naming it, and the ``chunked_init`` line it prints (run here as printed)
    initialises gate and up each with its own fans. Oracle, torchtitan/overrides/fused_swiglu.py:456
    ``einsum("...d,hgd->...hg", x, w13).unbind(-1)``: gate is ``w13[:, 0]``, up ``w13[:, 1]``; :557-560 (experts)
    ``w13.reshape(E, 2F, D)`` then ``reshape(-1, F, 2).unbind(-1)``: the same rows, per expert."""
    model = (_fused_swiglu if build == "FusedSwiGLU" else _fused_experts)(lib)
    w13 = model.get_parameter("w13")
    with pytest.warns(packedinit.LayoutWarning, match=r"'w13' .*no Layout of the stored shape.*chunked_init") as rec:
        IDIOMS[idiom](model)
    msg = " ".join(str(r.message) for r in rec)
    lines = re.findall(r"packedinit\.chunked_init\(.*?, None, init\)", msg)
    assert len(lines) == 1, msg
    torch.manual_seed(4)
    exec(lines[0], {"packedinit": packedinit, "model": model, "init": nn.init.xavier_uniform_})  # the printed fix
    got = w13.detach().clone()
    torch.manual_seed(4)  # the oracle: each expert's gate then up, drawn as its own (hidden, dim) matrix
    expected = torch.empty_like(got)
    for m in expected.view(-1, *got.shape[-3:]):
        gate, up = torch.empty(got.shape[-3], DIM), torch.empty(got.shape[-3], DIM)
        nn.init.xavier_uniform_(gate)
        nn.init.xavier_uniform_(up)
        m.copy_(torch.stack([gate, up], dim=1))
    assert torch.equal(got, expected)
    bound = (6.0 / (got.shape[-3] + DIM)) ** 0.5
    for j in (0, 1):
        half = got.select(-2, j)
        assert float(half.abs().max()) <= bound
        assert abs(float(half.std()) / (bound / 3**0.5) - 1) < 0.1


def test_fused_w13_xavier_where_the_issue_measured_0_018(lib: Any) -> None:
    """The issue's numbers (hidden 2048, dim 64 -> per block 0.112 where whole gave 0.018), through the printed fix."""
    model = _fused_swiglu(lib, hidden=2048)
    with pytest.warns(packedinit.LayoutWarning) as rec:
        packedinit.chunked(nn.init.xavier_uniform_)(model)
    assert float(model.get_parameter("w13").detach().std()) < 0.02  # what the warning names: initialised whole
    line = re.findall(r"packedinit\.chunked_init\(.*?, None, init\)", str(rec[0].message))[0]
    exec(line, {"packedinit": packedinit, "model": model, "init": nn.init.xavier_uniform_})
    expected = (2.0 / (2048 + DIM)) ** 0.5
    for j in (0, 1):
        assert abs(float(model.get_parameter("w13").detach()[:, j].std()) / expected - 1) < 0.05


def test_audit_lists_w13_measured_per_block_with_its_chunked_init_line(lib: Any) -> None:
    """After torchtitan's own ``_make_fused_gate_up_init`` (fused_swiglu.py:383, per half) the audit measures w13
    per block through its row-interleaved view, and the line it prints initialises it per block."""
    model = _fused_swiglu(lib)
    torch.manual_seed(0)
    model.init_states()  # torchtitan's own init: xavier on w13[:, 0], then on w13[:, 1]
    report = packedinit.audit(model)
    (s,) = report.suspects
    assert (s.name, s.audit.verdict, s.audit.matches) == ("w13", "per-block", ("xavier",))
    assert s.annotate.startswith("packedinit.chunked_init(model.get_parameter('w13').view(96, 64)")
    w13 = model.get_parameter("w13")
    torch.manual_seed(0)
    with torch.no_grad():
        fs = lib("torchtitan.overrides.fused_swiglu")
        fs._make_fused_gate_up_init(nn.init.xavier_uniform_, nn.init.xavier_uniform_, gate_up_axis=1)(w13)
    titan = w13.detach().clone()
    torch.manual_seed(0)
    exec(s.annotate, {"packedinit": packedinit, "model": model, "init": nn.init.xavier_uniform_})
    assert torch.equal(model.get_parameter("w13"), titan)  # uniform family: the same numbers as torchtitan's own


def test_fix_torch_defaults_keeps_torchtitans_own_per_half_w13_init(lib: Any) -> None:
    """Under the fix, torchtitan's own init of w13 (``_make_fused_gate_up_init``: xavier on each half) is untouched:
    bit-identical to the build without the fix, and each half has its own (hidden, dim) fans."""
    builds = []
    for fixed in (False, True):
        torch.manual_seed(5)
        with packedinit.fix_torch_defaults() if fixed else contextlib.nullcontext():
            model = _fused_swiglu(lib, hidden=1024)
            model.init_states()
        builds.append(model.get_parameter("w13").detach().clone())
    assert torch.equal(builds[0], builds[1])
    expected = (2.0 / (1024 + DIM)) ** 0.5
    for j in (0, 1):
        assert abs(float(builds[1][:, j].std()) / expected - 1) < 0.05

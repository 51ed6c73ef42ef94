"""Adapters for Hugging Face transformers families, proven against each family's own forward.

For every family: a tiny model is built from its config (no downloads). The q/k/v (or
gate/up) tensors its forward computes are captured (a read-only ``TorchFunctionMode``
records what reaches the attention kernel; hooks record module inputs) and compared
with what packedinit's logical blocks of the packed weight predict, block by block.
Then one block (say ``k``) is set to a recognisable value through packedinit's own
storage view: exactly that projection changes, every other one stays bit-identical.
Finally ``packedinit.chunked(xavier_uniform_)(model)`` gives every logical block its
own xavier bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  # the usual alias
import transformers
from torch import Tensor, nn
from torch.nn.init import xavier_uniform_
from torch.overrides import TorchFunctionMode

import packedinit
from packedinit import Layout, LogicalBlock, PackedInitError
from packedinit.adapters.fused import fused_gate_up


def block(
    layout: Layout, shape: torch.Size | tuple[int, ...], part: str | int, batch: tuple[int, ...] = ()
) -> LogicalBlock:
    """The logical block ``part`` (a name or a part index) at batch index ``batch`` of a tensor of ``shape``."""
    j = layout.part_index(part)
    for b in layout.blocks(shape):
        if b.part == j and b.batch_index == batch:
            return b
    raise KeyError((part, batch))


def read_block(t: Tensor, layout: Layout, blk: LogicalBlock) -> Tensor:
    """A copy of ``blk`` of ``t`` in its logical shape, read through packedinit's storage view."""
    out = torch.empty(blk.shape, dtype=t.dtype)
    layout.to_storage(out, blk, t.dim()).copy_(layout.storage_view(t.detach(), blk))
    return out


def write_block(t: Tensor, layout: Layout, blk: LogicalBlock, value: Tensor) -> None:
    """Write ``value`` (of ``blk.shape``) into ``blk`` of ``t`` through packedinit's storage view."""
    with torch.no_grad():
        layout.storage_view(t, blk).copy_(layout.to_storage(value, blk, t.dim()))


def pattern(shape: torch.Size | tuple[int, ...], seed: float = 0.0) -> Tensor:
    """A recognisable deterministic value: ``sin`` of a ramp, never equal to a random init."""
    n = math.prod(shape)
    return torch.sin(torch.arange(n, dtype=torch.float32) * 0.37 + seed).view(shape) * 0.5


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """``x @ w.T + b``: what an ``(out, in)`` logical block computes."""
    return F.linear(x, w, b)


def heads(y: Tensor, head_dim: int) -> Tensor:
    """``(B, S, H * d) -> (B, H, S, d)``: the attention layout of a projection."""
    return y.view(*y.shape[:2], -1, head_dim).transpose(1, 2)


def assert_heads_close(got: Tensor, expected: Tensor) -> None:
    """``got`` equals ``expected``, allowing ``got`` to hold each kv head repeated (GQA broadcast)."""
    if got.shape[1] != expected.shape[1]:
        assert got.shape[1] % expected.shape[1] == 0, (got.shape, expected.shape)
        expected = expected.repeat_interleave(got.shape[1] // expected.shape[1], dim=1)
    torch.testing.assert_close(got, expected.expand_as(got))


def _keep(a: object) -> object:
    return a.detach().clone() if isinstance(a, Tensor) else a


class Capture(TorchFunctionMode):
    """Records the tensors handed to a few torch functions during a forward (read-only: results unchanged)."""

    WATCH = frozenset(
        {
            F.scaled_dot_product_attention,
            torch.Tensor.baddbmm,
            torch.baddbmm,
            torch.bmm,
            torch.matmul,
            torch.Tensor.matmul,
            F.conv1d,
            F.silu,
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in self.WATCH:
            self.calls.append((func, tuple(_keep(a) for a in args), {k: _keep(v) for k, v in kwargs.items()}))
        return func(*args, **kwargs)

    def of(self, *funcs: Callable[..., Any]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(a, k) for f, a, k in self.calls if f in funcs]


def qkv_sdpa(cap: Capture, call: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v ``(B, H, S, d)`` of the ``call``-th ``scaled_dot_product_attention``."""
    args, kwargs = cap.of(F.scaled_dot_product_attention)[call]
    names = ("query", "key", "value")
    got = [args[i] if i < len(args) else kwargs[n] for i, n in enumerate(names)]
    return got[0], got[1], got[2]


def qkv_bmm(cap: Capture, batch: int) -> tuple[Tensor, Tensor, Tensor]:
    """Bloom / GPT-NeoX-Japanese: ``baddbmm(scores, q, k^T)`` then ``bmm``/``matmul(probs, v)``, heads folded."""
    args, kwargs = cap.of(torch.Tensor.baddbmm, torch.baddbmm)[0]
    q = kwargs["batch1"] if "batch1" in kwargs else args[1]
    kt = kwargs["batch2"] if "batch2" in kwargs else args[2]
    v = cap.of(torch.bmm, torch.matmul)[0][0][1]

    def unfold(t: Tensor) -> Tensor:
        return t.reshape(batch, -1, *t.shape[-2:])

    return unfold(q), unfold(kt.transpose(-1, -2)), unfold(v)


def qkv_matmul(cap: Capture) -> tuple[Tensor, Tensor, Tensor]:
    """MPT: ``matmul(q, k^T)`` then ``matmul(probs, v)``."""
    (q, kt), _ = cap.of(torch.matmul)[0]
    v = cap.of(torch.matmul)[1][0][1]
    return q, kt.transpose(-1, -2), v


@contextmanager
def inputs_of(*modules: nn.Module) -> Iterator[list[Tensor]]:
    """Collect the first positional input of every call of ``modules`` (in call order)."""
    seen: list[Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach().clone())) for m in modules]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def xavier_bound(blk: LogicalBlock, gain: float = 1.0) -> float:
    """``torch.nn.init.xavier_uniform_``'s bound for a separate tensor of ``blk``'s shape."""
    assert blk.fan_in is not None
    assert blk.fan_out is not None
    return gain * math.sqrt(6.0 / (blk.fan_in + blk.fan_out))


# ---------------------------------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------------------------------

B, S, VOCAB = 2, 5, 64
TOKENS: dict[str, Any] = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _eval(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for p in model.parameters():  # a visible, non-degenerate starting point (some families init biases to 0)
        with torch.no_grad():
            p.normal_(0.0, 0.2)
    return model.eval()


def _ids() -> Tensor:
    return torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))


def _run(model: nn.Module, *, rope: bool = False, encoder: bool = False) -> None:
    """One forward of the model; rotary positions are all 0, which makes rotary embedding the identity."""
    kwargs: dict[str, Any] = {"input_ids": _ids()}
    if rope:
        kwargs["position_ids"] = torch.zeros(B, S, dtype=torch.long)
    if encoder:
        kwargs["encoder_hidden_states"] = torch.randn(B, 3, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(**kwargs)


def gpt2() -> nn.Module:
    c = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16, add_cross_attention=True, **TOKENS)
    return _eval(transformers.GPT2Model(c))


def openai_gpt() -> nn.Module:
    c = transformers.OpenAIGPTConfig(n_embd=32, n_layer=2, n_head=4, n_positions=16, **TOKENS)
    return _eval(transformers.OpenAIGPTModel(c))


def imagegpt() -> nn.Module:
    c = transformers.ImageGPTConfig(n_embd=32, n_layer=2, n_head=4, n_positions=16, **TOKENS)
    return _eval(transformers.ImageGPTModel(c))


def decision_transformer() -> nn.Module:
    c = transformers.DecisionTransformerConfig(hidden_size=32, n_layer=2, n_head=4, n_positions=16, **TOKENS)
    return _eval(transformers.models.decision_transformer.modeling_decision_transformer.DecisionTransformerGPT2Model(c))


def gpt_neox() -> nn.Module:
    c = transformers.GPTNeoXConfig(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, attention_bias=True, **TOKENS
    )
    return _eval(transformers.GPTNeoXModel(c))


def gpt_neox_japanese() -> nn.Module:
    c = transformers.GPTNeoXJapaneseConfig(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_multiple_size=2, **TOKENS
    )
    return _eval(transformers.GPTNeoXJapaneseModel(c))


def bloom() -> nn.Module:
    c = transformers.BloomConfig(hidden_size=32, n_head=4, n_layer=2, **TOKENS)
    return _eval(transformers.BloomModel(c))


def persimmon() -> nn.Module:
    c = transformers.PersimmonConfig(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, qk_layernorm=False, **TOKENS
    )
    return _eval(transformers.PersimmonModel(c))


def falcon(kind: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        arches: dict[str, dict[str, Any]] = {
            "new": dict(new_decoder_architecture=True, num_kv_heads=2),
            "mqa": dict(new_decoder_architecture=False, multi_query=True),
            "mha": dict(new_decoder_architecture=False, multi_query=False),
        }
        arch = arches[kind]
        c = transformers.FalconConfig(
            hidden_size=32, num_attention_heads=4, num_hidden_layers=2, alibi=False, bias=True, **arch, **TOKENS
        )
        return _eval(transformers.FalconModel(c))

    return build


def phi3() -> nn.Module:
    c = transformers.Phi3Config(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_hidden_layers=2,
        **TOKENS,
    )
    return _eval(transformers.Phi3Model(c))


def gpt_bigcode(multi_query: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        c = transformers.GPTBigCodeConfig(
            n_embd=32, n_head=4, n_layer=2, n_positions=16, multi_query=multi_query, **TOKENS
        )
        return _eval(transformers.GPTBigCodeModel(c))

    return build


def mpt() -> nn.Module:
    c = transformers.MptConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=16, **TOKENS)
    return _eval(transformers.MptModel(c))


def dbrx() -> nn.Module:
    c = transformers.DbrxConfig(
        d_model=32,
        n_heads=4,
        n_layers=2,
        max_seq_len=16,
        attn_config={"kv_n_heads": 2, "clip_qkv": 100.0, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2},
        **TOKENS,
    )
    return _eval(transformers.DbrxModel(c))


def codegen() -> nn.Module:
    c = transformers.CodeGenConfig(n_embd=32, n_head=4, n_layer=2, n_positions=16, n_ctx=16, rotary_dim=4, **TOKENS)
    return _eval(transformers.CodeGenModel(c))


# ---------------------------------------------------------------------------------------------------
# Attention: q/k/v seen by the forward == packedinit's logical blocks
# ---------------------------------------------------------------------------------------------------

Probe = Callable[[Capture], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class QKV:
    """One family: where its packed projection lives and how its forward hands q, k, v on."""

    build: Callable[[], nn.Module]
    attn: str  # the attention module of layer 0
    linear: str  # the packed linear inside it
    layout: Layout  # what the adapter must give its weight
    head_dim: int
    probe: Probe
    line: str  # the forward line that splits the projection (the docs table quotes it)
    rope: bool = False
    encoder: bool = False  # the packed linear reads encoder_hidden_states (cross-attention)
    names: tuple[str, ...] = ("q", "k", "v")
    extra: dict[str, Layout] = field(default_factory=dict)  # further layouts the adapter must give


_sdpa: Probe = qkv_sdpa
_E, _D = 32, 8
#: The other Conv1D weights of a GPT-2-style block: one transposed block each.
_CONV1D_EXTRA = {
    "h.0.attn.c_proj.weight": Layout(1, [_E], transposed=True),
    "h.0.mlp.c_fc.weight": Layout(1, [4 * _E], transposed=True),
    "h.0.mlp.c_proj.weight": Layout(1, [_E], transposed=True),
}

CASES: dict[str, QKV] = {
    "gpt2": QKV(
        gpt2,
        "h.0.attn",
        "c_attn",
        Layout(1, [_E] * 3, transposed=True, names=("q", "k", "v")),
        _D,
        _sdpa,
        "query_states, key_states, value_states = self.c_attn(hidden_states).split(self.split_size, dim=2)",
        encoder=False,
        extra=_CONV1D_EXTRA,
    ),
    "gpt2-cross": QKV(
        gpt2,
        "h.0.crossattention",
        "c_attn",
        Layout(1, [_E] * 2, transposed=True, names=("k", "v")),
        _D,
        lambda cap: qkv_sdpa(cap, 1),
        "key_states, value_states = self.c_attn(encoder_hidden_states).split(self.split_size, dim=2)",
        encoder=True,
        names=("k", "v"),
        extra={"h.0.crossattention.q_attn.weight": Layout(1, [_E], transposed=True)},
    ),
    "openai-gpt": QKV(
        openai_gpt,
        "h.0.attn",
        "c_attn",
        Layout(1, [_E] * 3, transposed=True, names=("q", "k", "v")),
        _D,
        qkv_matmul,
        "query, key, value = x.split(self.split_size, dim=2)",
        extra=_CONV1D_EXTRA,
    ),
    "imagegpt": QKV(
        imagegpt,
        "h.0.attn",
        "c_attn",
        Layout(1, [_E] * 3, transposed=True, names=("q", "k", "v")),
        _D,
        qkv_matmul,
        "query, key, value = self.c_attn(current_states).split(self.split_size, dim=2)",
        extra=_CONV1D_EXTRA,
    ),
    "decision-transformer": QKV(
        decision_transformer,
        "h.0.attn",
        "c_attn",
        Layout(1, [_E] * 3, transposed=True, names=("q", "k", "v")),
        _D,
        _sdpa,
        "query_states, key_states, value_states = self.c_attn(hidden_states).split(self.split_size, dim=2)",
        extra=_CONV1D_EXTRA,
    ),
    "gpt-neox": QKV(
        gpt_neox,
        "layers.0.attention",
        "query_key_value",
        Layout(0, [_D] * 3, groups=4, names=("q", "k", "v")),
        _D,
        _sdpa,
        "qkv = self.query_key_value(hidden_states).view(hidden_shape)...; qkv.chunk(3, dim=-1)",
        rope=True,
    ),
    "gpt-neox-japanese": QKV(
        gpt_neox_japanese,
        "layers.0.attention",
        "query_key_value",
        Layout(0, [_D] * 3, groups=4, names=("q", "k", "v")),
        _D,
        lambda cap: qkv_bmm(cap, B),
        "qkv.view(..., num_attention_heads, 3 * head_size); query = qkv[..., : head_size]",
        rope=True,
    ),
    "bloom": QKV(
        bloom,
        "h.0.self_attention",
        "query_key_value",
        Layout(0, [_D] * 3, groups=4, names=("q", "k", "v")),
        _D,
        lambda cap: qkv_bmm(cap, B),
        "fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)  # BloomAttention._reshape",
    ),
    "persimmon": QKV(
        persimmon,
        "layers.0.self_attn",
        "query_key_value",
        Layout(0, [_D] * 3, groups=4, names=("q", "k", "v")),
        _D,
        _sdpa,
        "fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)",
        rope=True,
    ),
    "falcon-new-arch": QKV(
        falcon("new"),
        "h.0.self_attention",
        "query_key_value",
        Layout(0, [2 * _D, _D, _D], groups=2, names=("q", "k", "v")),
        _D,
        _sdpa,
        "qkv = fused_qkv.view(batch, seq_len, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)",
        rope=True,
    ),
    "falcon-multi-query": QKV(
        falcon("mqa"),
        "h.0.self_attention",
        "query_key_value",
        Layout(0, [_E, _D, _D], names=("q", "k", "v")),
        _D,
        _sdpa,
        "fused_qkv.view(batch_size, seq_length, self.num_heads + 2, self.head_dim)",
        rope=True,
    ),
    "falcon-classic": QKV(
        falcon("mha"),
        "h.0.self_attention",
        "query_key_value",
        Layout(0, [_D] * 3, groups=4, names=("q", "k", "v")),
        _D,
        _sdpa,
        "fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)",
        rope=True,
    ),
    "phi3": QKV(
        phi3,
        "layers.0.self_attn",
        "qkv_proj",
        Layout(0, [_E, 2 * _D, 2 * _D], names=("q", "k", "v")),
        _D,
        _sdpa,
        "query_states = qkv[..., :query_pos]; key_states = qkv[..., query_pos : query_pos + nkv * head_dim]",
        rope=True,
    ),
    "gpt-bigcode-multi-query": QKV(
        gpt_bigcode(True),
        "h.0.attn",
        "c_attn",
        Layout(0, [_E, _D, _D], names=("q", "k", "v")),
        _D,
        _sdpa,
        "self.c_attn(hidden_states).unsqueeze(1).split((self.embed_dim, self.kv_dim, self.kv_dim), dim=3)",
    ),
    "gpt-bigcode-multi-head": QKV(
        gpt_bigcode(False),
        "h.0.attn",
        "c_attn",
        Layout(0, [_D] * 3, groups=4, names=("q", "k", "v")),
        _D,
        _sdpa,
        "self.c_attn(hidden_states).view(..., self.num_heads, 3 * self.head_dim).split(3 * [self.head_dim], dim=3)",
    ),
    "mpt": QKV(
        mpt,
        "blocks.0.attn",
        "Wqkv",
        Layout(0, [_E] * 3, names=("q", "k", "v")),
        _D,
        qkv_matmul,
        "query_states, key_states, value_states = mixed_qkv.chunk(3, dim=2)",
    ),
    "dbrx": QKV(
        dbrx,
        "blocks.0.norm_attn_norm.attn",
        "Wqkv",
        Layout(0, [_E, 2 * _D, 2 * _D], names=("q", "k", "v")),
        _D,
        _sdpa,
        "qkv_states.split([self.hidden_size, nkv * self.head_dim, nkv * self.head_dim], dim=2)",
        rope=True,
    ),
    "codegen": QKV(
        codegen,
        "h.0.attn",
        "qkv_proj",
        Layout(0, [_D] * 3, groups=4, names=("q", "v", "k")),
        _D,
        _sdpa,
        "qkv = self.qkv_proj(hidden_states).view(*input_shape, -1, 3 * local_dim); "
        "query, value, key = qkv.split(local_dim, dim=-1)",
        rope=True,
        names=("q", "v", "k"),
    ),
}


def _forward(case: QKV, model: nn.Module) -> tuple[Tensor, dict[str, Tensor]]:
    """Run the model; return the packed linear's input and the q/k/v its forward handed on."""
    linear = model.get_submodule(f"{case.attn}.{case.linear}")
    with inputs_of(linear) as seen, Capture() as cap:
        _run(model, rope=case.rope, encoder=case.encoder)
    q, k, v = case.probe(cap)
    return seen[0], {"q": q, "k": k, "v": v}


def _expected(case: QKV, model: nn.Module, x: Tensor, name: str) -> Tensor:
    layouts = packedinit.layouts(model)
    w = model.get_parameter(f"{case.attn}.{case.linear}.weight")
    lw = layouts[f"{case.attn}.{case.linear}.weight"]
    wb = read_block(w, lw, block(lw, w.shape, name))
    b = getattr(model.get_submodule(f"{case.attn}.{case.linear}"), "bias", None)
    bb = None
    if b is not None:
        lb = layouts[f"{case.attn}.{case.linear}.bias"]
        bb = read_block(b, lb, block(lb, b.shape, name))
    return heads(linear(x, wb, bb), case.head_dim)


@pytest.mark.parametrize("family", list(CASES))
def test_adapter_gives_documented_layout(family: str) -> None:
    case = CASES[family]
    model = case.build()
    found = packedinit.layouts(model)
    assert found[f"{case.attn}.{case.linear}.weight"] == case.layout
    for name, layout in case.extra.items():
        assert found[name] == layout
    b = getattr(model.get_submodule(f"{case.attn}.{case.linear}"), "bias", None)
    if b is not None:  # the bias is packed the same way along its only dim
        lb = found[f"{case.attn}.{case.linear}.bias"]
        assert (lb.sizes, lb.groups, lb.names, lb.dim, lb.transposed) == (
            case.layout.sizes,
            case.layout.groups,
            case.layout.names,
            0,
            False,
        )
    # every layer gets it, not just layer 0
    assert found[f"{case.attn.replace('.0.', '.1.')}.{case.linear}.weight"] == case.layout


@pytest.mark.parametrize("family", list(CASES))
def test_forward_sees_the_logical_blocks(family: str) -> None:
    case = CASES[family]
    model = case.build()
    if family == "codegen" and not hasattr(model.get_submodule(case.attn), "mp_num"):
        pytest.skip(
            f"transformers {transformers.__version__} (the newest on Python 3.10): CodeGen's attention is its own "
            "matmul, no scaled_dot_product_attention call for the probe to read (same qkv split as later versions)"
        )
    x, got = _forward(case, model)
    for name in case.names:  # each block, read through packedinit's view, is exactly that projection
        assert_heads_close(got[name], _expected(case, model, x, name))

    # Set one block ("k") to a recognisable value through packedinit's storage view.
    layouts = packedinit.layouts(model)
    w = model.get_parameter(f"{case.attn}.{case.linear}.weight")
    lw = layouts[f"{case.attn}.{case.linear}.weight"]
    blk = block(lw, w.shape, "k")
    write_block(w, lw, blk, pattern(blk.shape))
    assert torch.equal(read_block(w, lw, blk), pattern(blk.shape))
    x2, got2 = _forward(case, model)
    assert torch.equal(x2, x)  # layer 0's input is unchanged
    assert_heads_close(got2["k"], _expected(case, model, x, "k"))
    assert not torch.allclose(got2["k"], got["k"])  # the key projection changed ...
    for name in ("q", "v"):  # ... and nothing else did
        assert torch.equal(got2[name], got[name]), name


def _check_xavier(model: nn.Module, layouts: dict[str, Layout]) -> int:
    """Every >= 2-D logical block of every packed parameter reaches its own xavier bound; count them."""
    checked = 0
    for pname, layout in layouts.items():
        p = model.get_parameter(pname)
        for blk in layout.blocks(p.shape):
            if len(blk.shape) < 2:
                continue
            vals = read_block(p, layout, blk)
            bound = xavier_bound(blk)
            top = float(vals.abs().max())
            assert top <= bound * (1 + 1e-6), (pname, blk.label, top, bound)
            assert top >= 0.75 * bound, (pname, blk.label, top, bound)
            checked += 1
    return checked


@pytest.mark.parametrize("family", list(CASES))
def test_chunked_xavier_gives_each_block_its_bound(family: str) -> None:
    case = CASES[family]
    model = case.build()
    layouts = packedinit.layouts(model)
    torch.manual_seed(3)
    packedinit.chunked(xavier_uniform_)(model)
    assert _check_xavier(model, layouts) >= len(case.layout.sizes)
    # the packed q/k/v really are per block: k's bound is not the bound of the whole packed tensor
    w = model.get_parameter(f"{case.attn}.{case.linear}.weight")
    lw = case.layout
    whole = math.sqrt(6.0 / sum(w.shape))
    kb = block(lw, w.shape, "k")
    assert float(read_block(w, lw, kb).abs().max()) > whole or xavier_bound(kb) <= whole


# ---------------------------------------------------------------------------------------------------
# Gated MLP: Phi-3 gate_up_proj
# ---------------------------------------------------------------------------------------------------


def test_phi3_gate_up_blocks_are_what_the_mlp_gates() -> None:
    model = phi3()
    mlp = model.get_submodule("layers.0.mlp")
    fused, act = mlp.get_submodule("gate_up_proj"), mlp.get_submodule("activation_fn")
    name = "layers.0.mlp.gate_up_proj.weight"
    layout = packedinit.layouts(model)[name]
    assert layout == Layout(0, [48, 48], names=("gate", "up"))
    w = model.get_parameter(name)

    def run() -> tuple[Tensor, Tensor, Tensor]:
        with inputs_of(fused) as x, inputs_of(act) as gate, inputs_of(mlp.get_submodule("down_proj")) as h:
            _run(model, rope=True)
        return x[0], gate[0], h[0]

    def expect(x: Tensor) -> tuple[Tensor, Tensor]:
        g = linear(x, read_block(w, layout, block(layout, w.shape, "gate")))
        u = linear(x, read_block(w, layout, block(layout, w.shape, "up")))
        return g, act(g) * u

    x, gate, h = run()  # "gate, up_states = up_states.chunk(2, dim=-1); up_states = up_states * act(gate)"
    eg, eh = expect(x)
    torch.testing.assert_close(gate, eg)
    torch.testing.assert_close(h, eh)
    up = block(layout, w.shape, "up")
    write_block(w, layout, up, pattern(up.shape))
    x2, gate2, h2 = run()
    assert torch.equal(x2, x)
    assert torch.equal(gate2, gate)  # the gate did not move
    torch.testing.assert_close(h2, expect(x)[1])  # the up projection is the new value
    assert not torch.allclose(h2, h)


# ---------------------------------------------------------------------------------------------------
# Stacked MoE experts
# ---------------------------------------------------------------------------------------------------

_MOE: dict[str, Any] = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, **TOKENS)


def mixtral() -> nn.Module:
    c = transformers.MixtralConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, **_MOE)
    return _eval(transformers.MixtralModel(c))


def qwen2_moe() -> nn.Module:
    c = transformers.Qwen2MoeConfig(
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        **_MOE,
    )
    return _eval(transformers.Qwen2MoeModel(c))


def qwen3_moe() -> nn.Module:
    c = transformers.Qwen3MoeConfig(
        intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, **_MOE
    )
    return _eval(transformers.Qwen3MoeModel(c))


def olmoe() -> nn.Module:
    c = transformers.OlmoeConfig(intermediate_size=16, num_experts=4, num_experts_per_tok=2, **_MOE)
    return _eval(transformers.OlmoeModel(c))


def gpt_oss() -> nn.Module:
    c = transformers.GptOssConfig(
        intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=8,
        layer_types=["full_attention"],
        **_MOE,
    )
    return _eval(transformers.GptOssModel(c))


def phimoe() -> nn.Module:
    c = transformers.PhimoeConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, **_MOE)
    return _eval(transformers.PhimoeModel(c))


_DEEPSEEK_ROUTING: dict[str, Any] = dict(
    intermediate_size=48,
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=0,
    n_group=1,
    topk_group=1,
)


def glm4_moe() -> nn.Module:
    c = transformers.Glm4MoeConfig(**_DEEPSEEK_ROUTING, **_MOE)
    return _eval(transformers.Glm4MoeModel(c))


def deepseek_v3() -> nn.Module:
    mla: dict[str, Any] = dict(kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    c = transformers.DeepseekV3Config(**mla, **_DEEPSEEK_ROUTING, **_MOE)
    return _eval(transformers.DeepseekV3Model(c))


def granitemoe() -> nn.Module:
    c = transformers.GraniteMoeConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, **_MOE)
    return _eval(transformers.GraniteMoeModel(c))


def minimax() -> nn.Module:
    c = transformers.MiniMaxConfig(
        intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=8,
        layer_types=["full_attention"],
        **_MOE,
    )
    return _eval(transformers.MiniMaxModel(c))


def ernie4_5_moe() -> nn.Module:
    c = transformers.Ernie4_5_MoeConfig(
        intermediate_size=48, moe_intermediate_size=16, moe_num_experts=4, moe_k=2, moe_layer_start_index=0, **_MOE
    )
    return _eval(transformers.Ernie4_5_MoeModel(c))


def _act_times_up(experts: nn.Module, g: Tensor, u: Tensor) -> Tensor:
    return experts.act_fn(g) * u  # type: ignore[operator, no-any-return]  # act_fn is an nn.Module


def _gpt_oss_glu(experts: nn.Module, g: Tensor, u: Tensor) -> Tensor:
    limit, alpha = float(experts.__dict__["limit"]), float(experts.__dict__["alpha"])
    g = g.clamp(max=limit)
    return (u.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))


EXPERTS: dict[str, tuple[Callable[[], nn.Module], Layout, Layout, Callable[[nn.Module, Tensor, Tensor], Tensor]]] = {
    "mixtral": (
        mixtral,
        Layout(1, [16, 16], batch_dims=1, names=("gate", "up")),
        Layout(1, [32], batch_dims=1),
        _act_times_up,
    ),
    "qwen2-moe": (
        qwen2_moe,
        Layout(1, [16, 16], batch_dims=1, names=("gate", "up")),
        Layout(1, [32], batch_dims=1),
        _act_times_up,
    ),
    "qwen3-moe": (
        qwen3_moe,
        Layout(1, [16, 16], batch_dims=1, names=("gate", "up")),
        Layout(1, [32], batch_dims=1),
        _act_times_up,
    ),
    "olmoe": (
        olmoe,
        Layout(1, [16, 16], batch_dims=1, names=("gate", "up")),
        Layout(1, [32], batch_dims=1),
        _act_times_up,
    ),
    "phimoe": (
        phimoe,
        Layout(1, [16, 16], batch_dims=1, names=("gate", "up")),
        Layout(1, [32], batch_dims=1),
        _act_times_up,
    ),
    "glm4-moe": (
        glm4_moe,
        Layout(1, [16, 16], batch_dims=1, names=("gate", "up")),
        Layout(1, [32], batch_dims=1),
        _act_times_up,
    ),
    "deepseek-v3": (
        deepseek_v3,
        Layout(1, [16, 16], batch_dims=1, names=("gate", "up")),
        Layout(1, [32], batch_dims=1),
        _act_times_up,
    ),
    "granitemoe": (
        granitemoe,
        Layout(1, [16, 16], batch_dims=1, names=("gate", "up")),
        Layout(1, [32], batch_dims=1),
        _act_times_up,
    ),
    "minimax": (
        minimax,
        Layout(1, [16, 16], batch_dims=1, names=("gate", "up")),
        Layout(1, [32], batch_dims=1),
        _act_times_up,
    ),
    "ernie4.5-moe": (
        ernie4_5_moe,
        Layout(1, [16, 16], batch_dims=1, names=("gate", "up")),
        Layout(1, [32], batch_dims=1),
        _act_times_up,
    ),
    "gpt-oss": (
        gpt_oss,
        Layout(2, [1, 1], groups=16, transposed=True, batch_dims=1, names=("gate", "up")),
        Layout(2, [32], transposed=True, batch_dims=1),
        _gpt_oss_glu,
    ),
}


def _experts_of(model: nn.Module) -> tuple[str, nn.Module]:
    for name, m in model.named_modules():
        if type(m).__name__.endswith("Experts"):
            return name, m
    raise AssertionError("no experts module")


def _expert_call(model: nn.Module, experts: nn.Module) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run the model; return what its experts module got (tokens, expert ids, weights) and gave back."""
    seen: list[tuple[Tensor, ...]] = []

    def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Tensor) -> None:
        seen.append(tuple(t.detach().clone() for t in (*args, *kwargs.values(), out)))

    h = experts.register_forward_hook(hook, with_kwargs=True)
    try:
        _run(model, rope=True)
    finally:
        h.remove()
    x, idx, wts, out = seen[0]
    return x, idx, wts, out


def _expert_reference(
    model: nn.Module,
    prefix: str,
    experts: nn.Module,
    gating: Callable[[nn.Module, Tensor, Tensor], Tensor],
    x: Tensor,
    idx: Tensor,
    wts: Tensor,
) -> Tensor:
    """The experts' output computed from packedinit's per-expert logical blocks."""
    layouts = packedinit.layouts(model)
    inter = layouts[f"{prefix}.gate_up_proj"].packed_size // 2
    interleaved = layouts[f"{prefix}.gate_up_proj"].groups > 1
    if getattr(experts, "gate_up_proj_bias", None) is not None:  # GPT-OSS: the adapter claims the stacked biases
        assert layouts[f"{prefix}.gate_up_proj_bias"] == fused_gate_up(
            inter, interleaved=interleaved, bias=True, stacked=True
        )
        assert layouts[f"{prefix}.down_proj_bias"] == Layout(1, [x.shape[-1]], batch_dims=1)

    def blk(pname: str, part: str | int, e: int) -> Tensor | None:
        p = getattr(experts, pname, None)
        if p is None:
            return None
        lay = layouts[f"{prefix}.{pname}"]
        return read_block(p, lay, block(lay, p.shape, part, (e,)))

    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            g = linear(x[t], blk("gate_up_proj", "gate", e), blk("gate_up_proj_bias", "gate", e))  # type: ignore[arg-type]
            u = linear(x[t], blk("gate_up_proj", "up", e), blk("gate_up_proj_bias", "up", e))  # type: ignore[arg-type]
            y = linear(gating(experts, g, u), blk("down_proj", 0, e), blk("down_proj_bias", 0, e))  # type: ignore[arg-type]
            out[t] += wts[t, j] * y
    return out


@pytest.mark.parametrize("family", list(EXPERTS))
def test_experts_blocks_are_each_experts_projections(family: str) -> None:
    build, gate_up, down, gating = EXPERTS[family]
    model = build()
    prefix, experts = _experts_of(model)
    found = packedinit.layouts(model)
    assert found[f"{prefix}.gate_up_proj"] == gate_up
    assert found[f"{prefix}.down_proj"] == down
    x, idx, wts, out = _expert_call(model, experts)
    torch.testing.assert_close(out, _expert_reference(model, prefix, experts, gating, x, idx, wts))

    # Set expert e's "up" block to a recognisable value: only tokens routed to e change.
    e = int(idx[0, 0])
    p = model.get_parameter(f"{prefix}.gate_up_proj")
    b = block(gate_up, p.shape, "up", (e,))
    write_block(p, gate_up, b, pattern(b.shape))
    x2, idx2, wts2, out2 = _expert_call(model, experts)
    assert torch.equal(x2, x)
    assert torch.equal(idx2, idx)
    assert torch.equal(wts2, wts)
    torch.testing.assert_close(out2, _expert_reference(model, prefix, experts, gating, x, idx, wts))
    routed = (idx == e).any(dim=1)
    assert not torch.allclose(out2[routed], out[routed])
    torch.testing.assert_close(out2[~routed], out[~routed], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", list(EXPERTS))
def test_chunked_xavier_on_moe_model(family: str) -> None:
    model = EXPERTS[family][0]()
    layouts = packedinit.layouts(model)
    biases = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("_proj_bias")}
    torch.manual_seed(4)
    packedinit.chunked(xavier_uniform_)(model)
    for n, before in biases.items():  # stacked (n_experts, out) biases hold 1-D blocks: skipped like any bias
        assert torch.equal(model.get_parameter(n), before), n
    prefix, _ = _experts_of(model)
    n = model.get_parameter(f"{prefix}.gate_up_proj").shape[0]
    assert _check_xavier(model, {k: v for k, v in layouts.items() if k.startswith(prefix)}) >= 3 * n


def test_dbrx_experts_blocks_are_each_experts_projections() -> None:
    model = dbrx()
    prefix, experts = _experts_of(model)
    found = packedinit.layouts(model)
    ffn = [24] * 4
    assert found[f"{prefix}.mlp.w1"] == Layout(0, ffn)
    assert found[f"{prefix}.mlp.v1"] == Layout(0, ffn)
    assert found[f"{prefix}.mlp.w2"] == Layout(0, ffn, transposed=True)

    def reference(x: Tensor, idx: Tensor, wts: Tensor) -> Tensor:
        x = x.reshape(-1, x.shape[-1])
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[t, j])
                w = {n: model.get_parameter(f"{prefix}.mlp.{n}") for n in ("w1", "v1", "w2")}
                get = {
                    n: read_block(p, found[f"{prefix}.mlp.{n}"], block(found[f"{prefix}.mlp.{n}"], p.shape, e))
                    for n, p in w.items()
                }
                h = experts.get_submodule("mlp.activation_fn")(linear(x[t], get["w1"])) * linear(x[t], get["v1"])
                out[t] += wts[t, j] * linear(h, get["w2"])
        return out

    x, idx, wts, out = _expert_call(model, experts)
    torch.testing.assert_close(out.reshape(-1, out.shape[-1]), reference(x, idx, wts))
    e = int(idx[0, 0])
    v1 = model.get_parameter(f"{prefix}.mlp.v1")
    b = block(found[f"{prefix}.mlp.v1"], v1.shape, e)
    write_block(v1, found[f"{prefix}.mlp.v1"], b, pattern(b.shape))
    x2, _, _, out2 = _expert_call(model, experts)
    assert torch.equal(x2, x)
    torch.testing.assert_close(out2.reshape(-1, out.shape[-1]), reference(x, idx, wts))
    assert not torch.allclose(out2, out)
    torch.manual_seed(5)
    packedinit.chunked(xavier_uniform_)(model)
    assert _check_xavier(model, found) >= 12


# ---------------------------------------------------------------------------------------------------
# Registration hygiene and errors
# ---------------------------------------------------------------------------------------------------




def test_every_registered_transformers_class_path_exists(ships: Callable[[str], bool]) -> None:
    """A typo in a class path would never match: every key must name a real nn.Module class."""
    import importlib

    keys = [k for k in packedinit.registered() if isinstance(k, str) and k.startswith("transformers.")]
    assert len(keys) >= 19
    for key in keys:
        module_name, _, qualname = key.rpartition(".")
        if not ships(module_name):
            continue
        cls = getattr(importlib.import_module(module_name), qualname)
        assert isinstance(cls, type)
        assert issubclass(cls, nn.Module), key


def test_adapters_never_import_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys, torch, packedinit, packedinit.adapters.hf\n"
        "packedinit.layouts(torch.nn.TransformerEncoderLayer(8, 2))\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("family", ["gpt2", "falcon-new-arch"])
def test_apply_chunked_uses_the_ancestor_adapter(family: str) -> None:
    """``model.apply(chunked(f))`` reaches c_attn/query_key_value one module at a time, still per block."""
    case = CASES[family]
    model = case.build()
    layouts = packedinit.layouts(model)
    torch.manual_seed(6)
    model.apply(packedinit.chunked(xavier_uniform_))
    assert _check_xavier(model, layouts) >= 3


def test_a_layer_packed_differently_is_refused_before_writing() -> None:
    """A module whose stored shape disagrees with its config gets an error naming adapter and parameter."""
    model = gpt_neox()
    attn = model.get_submodule("layers.0.attention")
    attn.query_key_value = nn.Linear(32, 2 * 32)  # not 3 * hidden: not the layout the family's forward splits
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PackedInitError, match=r"GPTNeoXAttention.*query_key_value\.weight.*\(64, 32\)"):
        packedinit.layouts(model)
    with pytest.raises(PackedInitError, match=r"query_key_value\.weight"):
        packedinit.chunked(xavier_uniform_)(model)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_missing_config_value_names_the_adapter() -> None:
    model = phi3()
    attn = model.get_submodule("layers.0.self_attn")
    del attn.num_key_value_heads
    attn.__dict__["config"] = None  # a module built without a config
    with pytest.raises(PackedInitError, match=r"Phi3Attention has none of \['num_attention_heads'\]"):
        packedinit.layouts(model)


# ---------------------------------------------------------------------------------------------------
# Mamba: in_proj [x | z], x_proj [dt | B | C]
# ---------------------------------------------------------------------------------------------------


def mamba() -> nn.Module:
    c = transformers.MambaConfig(
        hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=4, time_step_rank=2, **TOKENS
    )
    return _eval(transformers.MambaModel(c))


def test_mamba_in_proj_and_x_proj_blocks_are_what_the_mixer_uses() -> None:
    model = mamba()
    mixer = model.get_submodule("layers.0.mixer")
    found = packedinit.layouts(model)
    lin, lx = found["layers.0.mixer.in_proj.weight"], found["layers.0.mixer.x_proj.weight"]
    assert lin == Layout(0, [32, 32], names=("x", "z"))
    assert lx == Layout(0, [2, 4, 4], names=("dt", "B", "C"))
    w_in, w_x = mixer.get_parameter("in_proj.weight"), mixer.get_parameter("x_proj.weight")

    def run() -> tuple[Tensor, Tensor, Capture]:
        with (
            inputs_of(mixer.get_submodule("in_proj")) as h,
            inputs_of(mixer.get_submodule("x_proj")) as u,
            Capture() as cap,
        ):
            _run(model)
        return h[0], u[0], cap

    def proj(x: Tensor, w: Tensor, layout: Layout, name: str) -> Tensor:
        return linear(x, read_block(w, layout, block(layout, w.shape, name))).transpose(1, 2)  # (B, channels, S)

    h, u, cap = run()
    # "hidden_states_B_C, gate = projected_states.chunk(2, dim=1)": x goes through the causal conv ...
    torch.testing.assert_close(cap.of(F.conv1d)[0][0][0], proj(h, w_in, lin, "x"))
    # ... z gates the scan output: "scan_output = scan_output * F.silu(z)" (the last silu of the layer)
    torch.testing.assert_close(cap.of(F.silu)[-1][0][0], proj(h, w_in, lin, "z"))
    # "time_step, B, C = torch.split(self.x_proj(...), [rank, state, state], dim=-1)": dt feeds
    # "self.dt_proj.weight @ time_step.transpose(1, 2)" ...
    torch.testing.assert_close(cap.of(torch.Tensor.matmul)[0][0][1], proj(u, w_x, lx, "dt"))
    # ... and C is read at every step: "torch.matmul(ssm_state, C[:, index, :].unsqueeze(-1))"
    c_steps = torch.stack([a[1][..., 0] for a, _ in cap.of(torch.matmul)], dim=-1)
    torch.testing.assert_close(c_steps, proj(u, w_x, lx, "C"))

    # Set z to a recognisable value: the conv input and the whole selective path stay bit-identical.
    z = block(lin, w_in.shape, "z")
    write_block(w_in, lin, z, pattern(z.shape))
    h2, u2, cap2 = run()
    assert torch.equal(h2, h)
    assert torch.equal(u2, u)  # x_proj's input comes from x only
    assert torch.equal(cap2.of(F.conv1d)[0][0][0], cap.of(F.conv1d)[0][0][0])
    torch.testing.assert_close(cap2.of(F.silu)[-1][0][0], proj(h, w_in, lin, "z"))
    # Set B: dt and C are unchanged, the scan (its output) is not.
    b = block(lx, w_x.shape, "B")
    before = cap2.of(torch.matmul)
    write_block(w_x, lx, b, pattern(b.shape))
    _, _, cap3 = run()
    assert torch.equal(cap3.of(torch.Tensor.matmul)[0][0][1], cap2.of(torch.Tensor.matmul)[0][0][1])
    for (a3, _), (a2, _) in zip(cap3.of(torch.matmul), before, strict=True):
        assert torch.equal(a3[1], a2[1])  # C
    assert not torch.allclose(cap3.of(torch.matmul)[-1][0][0], before[-1][0][0])  # the state did change

    torch.manual_seed(7)
    packedinit.chunked(xavier_uniform_)(model)
    assert _check_xavier(model, found) == 5

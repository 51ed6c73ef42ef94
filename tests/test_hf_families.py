"""Adapters of issue 19 (FalconMamba, Jamba, Mamba-2 mixers, DeepSeek MLA, Qwen3-Next), proven on the forward.

For each family a tiny model runs once while a read-only ``TorchFunctionMode`` records what
every ``split`` / ``chunk`` of the forward returns, and hooks record what each packed
projection read. Every logical block packedinit describes, applied as a separate
``F.linear`` to that input, must be exactly one piece the forward split off (compared in
``(batch, seq, features)`` order, whatever the forward's own view or transpose). Then
``chunked(xavier_uniform_)(model)`` gives each block its own bound.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  # the usual alias
import transformers
from torch import Tensor, nn
from torch.nn.init import xavier_uniform_
from torch.overrides import TorchFunctionMode

import packedinit
from packedinit import Layout

B, S, VOCAB = 2, 5, 64
TOKENS: dict[str, Any] = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_SPLITS = frozenset({torch.split, Tensor.split, torch.chunk, Tensor.chunk, Tensor.split_with_sizes})


class Splits(TorchFunctionMode):
    """Every piece any split/chunk of the forward returned (copies; the forward is unchanged)."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[Tensor] = []

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _SPLITS:
            self.pieces.extend(t.detach().clone() for t in out)
        return out


@contextmanager
def inputs_of(modules: dict[str, nn.Module]) -> Iterator[dict[str, Tensor]]:
    """The first positional input of each module's first call, by name."""
    seen: dict[str, Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(lambda _m, a, n=n: seen.setdefault(n, a[0].detach().clone()))
        for n, m in modules.items()
    ]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def _prepare(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # visible, non-degenerate values
            p.normal_(0.0, 0.2)
    return model.eval()


def _bsf(t: Tensor) -> Tensor | None:
    """A piece as ``(B, S, features)``: from ``(B, S, ...)``, ``(B, H, S, d)`` or ``(B, F, S)``."""
    if t.dim() < 3 or t.shape[0] != B:
        return None
    if t.shape[1] == S:
        return t.reshape(B, S, -1)
    if t.dim() == 3 and t.shape[2] == S:
        return t.transpose(1, 2)
    if t.dim() == 4 and t.shape[2] == S:
        return t.transpose(1, 2).reshape(B, S, -1)
    return None


def _block_weight(p: Tensor, layout: Layout, part: str) -> tuple[Tensor, list[int]]:
    """The rows of ``part`` (in logical order) of a dim-0 layout, and their indices."""
    rows: list[int] = []
    start = 0
    for _ in range(layout.groups):
        for j, size in enumerate(layout.sizes):
            if layout.names is not None and layout.names[j] == part:
                rows.extend(range(start, start + size))
            start += size
    return p.detach()[rows], rows


def _assert_split_off(splits: Splits, x: Tensor, weight: Tensor, bias: Tensor | None, label: str) -> None:
    want = F.linear(x, weight, bias).reshape(B, S, -1)
    for piece in splits.pieces:
        got = _bsf(piece)
        if got is not None and got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-4):
            return
    shapes = sorted({tuple(p.shape) for p in splits.pieces})
    raise AssertionError(f"block {label} {tuple(want.shape)} is no piece the forward split off; pieces: {shapes}")


def _prove(
    model: nn.Module, run: Callable[[], None], projections: dict[str, str], skip: frozenset[str] = frozenset()
) -> None:
    """Each named block of each projection (module path -> weight name) is a piece the forward split off."""
    found = packedinit.layouts(model)
    mods = {path: model.get_submodule(path) for path in projections}
    splits = Splits()
    with inputs_of(mods) as seen, torch.no_grad(), splits:
        run()
    for path, module in mods.items():
        layout = found[f"{path}.weight"]
        assert layout.dim == 0
        assert layout.names is not None
        bias = getattr(module, "bias", None)
        if bias is not None:
            assert found[f"{path}.bias"] == layout
        for name in layout.names:
            if name in skip:
                continue
            w, rows = _block_weight(module.weight, layout, name)
            b = bias.detach()[rows] if bias is not None else None
            _assert_split_off(splits, seen[path], w, b, f"{path}:{name}")


def _ids() -> Tensor:
    return torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))


def _runner(model: nn.Module, **extra: Any) -> Callable[[], None]:
    def run() -> None:
        model(input_ids=_ids(), use_cache=False, **extra)

    return run


def _xavier_bounds(model: nn.Module, names: list[str]) -> int:
    """After ``chunked(xavier_uniform_)(model)`` every >= 2-D block of these parameters is within its bound."""
    torch.manual_seed(3)
    packedinit.chunked(xavier_uniform_)(model)
    found = packedinit.layouts(model)
    checked = 0
    for pname in names:
        p = model.get_parameter(pname)
        layout = found[pname]
        for blk in layout.blocks(p.shape):
            view = layout.storage_view(p.detach(), blk)
            assert blk.fan_in is not None
            assert blk.fan_out is not None
            bound = math.sqrt(6 / (blk.fan_in + blk.fan_out))
            top = float(view.abs().max())
            assert 0.6 * bound <= top <= bound * (1 + 1e-6), (pname, blk.label, top, bound)
            checked += 1
    return checked


# -- Mamba mixers: [x | z], [dt | B | C] ------------------------------------------------------------------


def falcon_mamba() -> nn.Module:
    cfg = transformers.FalconMambaConfig(hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, **TOKENS)
    return _prepare(transformers.FalconMambaModel(cfg))


def jamba() -> nn.Module:
    cfg = transformers.JambaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_experts=4, num_experts_per_tok=2, expert_layer_period=1, expert_layer_offset=0,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_expand=2, mamba_dt_rank=4,
        use_mamba_kernels=False, **TOKENS,
    )  # fmt: skip
    return _prepare(transformers.JambaModel(cfg))


@pytest.mark.parametrize(("build", "mixer"), [(falcon_mamba, "layers.0.mixer"), (jamba, "layers.0.mamba")])
def test_mamba_style_mixer_blocks_are_what_the_forward_splits(build: Callable[[], nn.Module], mixer: str) -> None:
    """FalconMamba before: no adapter (the x block got 0.137 under chunked xavier instead of 0.177)."""
    model = build()
    found = packedinit.layouts(model)
    i = model.get_submodule(mixer).intermediate_size
    assert found[f"{mixer}.in_proj.weight"] == Layout(0, [i, i], names=("x", "z"))
    _prove(model, _runner(model), {f"{mixer}.in_proj": "weight", f"{mixer}.x_proj": "weight"})
    assert _xavier_bounds(model, [f"{mixer}.in_proj.weight", f"{mixer}.x_proj.weight"]) == 5


def test_jamba_experts_are_stacked_gate_up() -> None:
    model = jamba()
    found = packedinit.layouts(model)
    assert found["layers.0.feed_forward.experts.gate_up_proj"] == Layout(
        1, [32, 32], batch_dims=1, names=("gate", "up")
    )
    assert found["layers.0.feed_forward.experts.down_proj"] == Layout(1, [16], batch_dims=1)


# -- Mamba-2 mixers: [z | x | B | C | dt] -----------------------------------------------------------------

_M2: dict[str, Any] = dict(hidden_size=16, num_hidden_layers=1, state_size=4, n_groups=2, expand=2, **TOKENS)


def mamba2() -> nn.Module:
    cfg = transformers.Mamba2Config(num_heads=4, head_dim=8, chunk_size=8, **_M2)
    return _prepare(transformers.Mamba2Model(cfg))


def bamba() -> nn.Module:
    cfg = transformers.BambaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=4, mamba_expand=2, mamba_chunk_size=8,
        attn_layer_indices=[], **TOKENS,
    )  # fmt: skip
    return _prepare(transformers.BambaModel(cfg))


@pytest.mark.parametrize(("build", "mixer"), [(mamba2, "layers.0.mixer"), (bamba, "layers.0.mamba")])
def test_mamba2_in_proj_blocks_are_what_the_forward_splits(build: Callable[[], nn.Module], mixer: str) -> None:
    """Before: no adapter, and the audit said "no packed parameters" with no "looks packed" line."""
    model = build()
    m = model.get_submodule(mixer)
    gn = m.n_groups * m.ssm_state_size
    layout = packedinit.layouts(model)[f"{mixer}.in_proj.weight"]
    assert layout == Layout(0, [m.intermediate_size, m.intermediate_size, gn, gn, m.num_heads],
                            names=("z", "x", "B", "C", "dt"))  # fmt: skip
    # z and dt are split off the projection itself; x, B, C only after the depthwise conv: their
    # boundaries are the second split's sizes, and the three together are the first split's middle piece.
    _prove(model, _runner(model), {f"{mixer}.in_proj": "weight"}, skip=frozenset({"x", "B", "C"}))
    w = m.in_proj.weight.detach()
    xbc = w[m.intermediate_size : 2 * m.intermediate_size + 2 * gn]
    splits = Splits()
    with inputs_of({"p": m.in_proj}) as seen, torch.no_grad(), splits:
        _runner(model)()
    _assert_split_off(splits, seen["p"], xbc, None, "x|B|C")
    assert any(p.shape[-1] == gn for p in splits.pieces)  # B and C pieces of G * N features
    assert _xavier_bounds(model, [f"{mixer}.in_proj.weight"]) == 5


# -- DeepSeek MLA: kv_a = [kv_latent | k_rot], kv_b = per head [k_nope | v] --------------------------------------

_MLA: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, **TOKENS,
)  # fmt: skip


def deepseek_v2() -> nn.Module:
    cfg = dict(_MLA, num_experts=4)
    cfg.pop("n_routed_experts")
    return _prepare(transformers.DeepseekV2Model(transformers.DeepseekV2Config(**cfg)))


def deepseek_v3() -> nn.Module:
    return _prepare(transformers.DeepseekV3Model(transformers.DeepseekV3Config(**_MLA)))


@pytest.mark.parametrize("build", [deepseek_v2, deepseek_v3])
def test_mla_blocks_are_what_the_forward_splits(build: Callable[[], nn.Module]) -> None:
    """Before: no adapter; V got 0.204 under chunked xavier instead of 0.274."""
    model = build()
    found = packedinit.layouts(model)
    a = "layers.0.self_attn"
    assert found[f"{a}.kv_a_proj_with_mqa.weight"] == Layout(0, [16, 8], names=("kv_latent", "k_rot"))
    assert found[f"{a}.kv_b_proj.weight"] == Layout(0, [8, 12], groups=2, names=("k_nope", "v"))
    assert f"{a}.q_b_proj.weight" not in found  # [q_nope | q_rot] per head, concatenated back: one query
    run = _runner(model, position_ids=torch.zeros(B, S, dtype=torch.long))
    _prove(model, run, {f"{a}.kv_a_proj_with_mqa": "weight", f"{a}.kv_b_proj": "weight"})
    assert _xavier_bounds(model, [f"{a}.kv_a_proj_with_mqa.weight", f"{a}.kv_b_proj.weight"]) == 4


# -- Qwen3-Next: q_proj per head [q | gate]; in_proj_qkvz per key head [q | k | v | z]; in_proj_ba -------------


def qwen3_next() -> nn.Module:
    cfg = transformers.Qwen3NextConfig(
        hidden_size=32, intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
        num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"], **TOKENS,
    )  # fmt: skip
    return _prepare(transformers.Qwen3NextModel(cfg))


def test_qwen3_next_blocks_are_what_the_forward_splits() -> None:
    model = qwen3_next()
    found = packedinit.layouts(model)
    assert found["layers.1.self_attn.q_proj.weight"] == Layout(0, [8, 8], groups=2, names=("q", "gate"))
    qkvz = Layout(0, [8, 8, 16, 16], groups=2, names=("q", "k", "v", "z"))
    assert found["layers.0.linear_attn.in_proj_qkvz.weight"] == qkvz
    assert found["layers.0.linear_attn.in_proj_ba.weight"] == Layout(0, [2, 2], groups=2, names=("b", "a"))
    assert found["layers.0.mlp.experts.gate_up_proj"] == Layout(1, [16, 16], batch_dims=1, names=("gate", "up"))
    run = _runner(model, position_ids=torch.zeros(B, S, dtype=torch.long))
    _prove(
        model,
        run,
        {
            "layers.1.self_attn.q_proj": "weight",
            "layers.0.linear_attn.in_proj_qkvz": "weight",
            "layers.0.linear_attn.in_proj_ba": "weight",
        },
    )
    names = ["layers.1.self_attn.q_proj.weight", "layers.0.linear_attn.in_proj_qkvz.weight"]
    assert _xavier_bounds(model, names) == 6


# -- every registered class path of these families exists, and its forward has the split the adapter reads ----


_LINES = {
    "_phi3_mlp": (
        "up_states = self.gate_up_proj(hidden_states)",
        "gate, up_states = up_states.chunk(2, dim=-1)",
    ),
    "_mla_attention": (
        "torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)",
        "k_nope, value_states = torch.split(kv_nope, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)",
        "key_shape = (batch_size, seq_length, -1, self.qk_nope_head_dim + self.v_head_dim)",
    ),
    "_mamba2_mixer": (
        ".split( [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1 )",
        "[self.intermediate_size, self.n_groups * self.ssm_state_size, self.n_groups * self.ssm_state_size]",
        "projection_size = self.intermediate_size + self.conv_dim + self.num_heads",
    ),
}


@pytest.mark.parametrize("adapter", list(_LINES))
def test_registered_copies_share_the_forward_lines(adapter: str, ships: Callable[[str], bool]) -> None:
    """Each class the MLA / Mamba-2 adapter is registered for has the split lines of the families proven above."""
    from packedinit.adapters import hf

    fn = getattr(hf, adapter)
    paths = [k for k, v in packedinit.registered().items() if v is fn]
    assert len(paths) >= 6
    for path in paths:
        assert isinstance(path, str)
        mod, _, cls = path.rpartition(".")
        if not ships(mod):
            continue
        source = re.sub(r"\s+", " ", inspect.getsource(getattr(importlib.import_module(mod), cls)))
        for line in _LINES[adapter]:
            assert line in source, (path, line)


def test_a_wrong_layout_is_caught_by_the_proof() -> None:
    """Control: the guess the old audit printed for kv_a ([k:12 | v:12] for [latent:16 | k_rot:8]) fails the proof."""
    model = deepseek_v3()
    a = "layers.0.self_attn"
    packedinit.annotate(model, **{f"{a}.kv_a_proj_with_mqa.weight": Layout(0, [12, 12], names=("k", "v"))})
    run = _runner(model, position_ids=torch.zeros(B, S, dtype=torch.long))
    with pytest.raises(AssertionError, match="is no piece the forward split off"):
        _prove(model, run, {f"{a}.kv_a_proj_with_mqa": "weight"})


@pytest.mark.parametrize("build", [falcon_mamba, jamba, mamba2, bamba, deepseek_v2, deepseek_v3, qwen3_next])
def test_tracer_agrees_with_the_new_adapters(build: Callable[[], nn.Module]) -> None:
    """The forward tracer, run on the model, finds exactly the blocks the hand-written adapters claim."""
    from packedinit.trace.compare import disagreements

    model = build()
    found = packedinit.infer_layouts(model, input_ids=_ids(), use_cache=False)
    assert disagreements(found, packedinit.layouts(model)) == []
    assert sum(1 for f in found.values() if f.verdict == "packed") >= 1

"""Issue 26 on real transformers models nobody described: per block from the forward, or named.

Each oracle below is written from the model's own forward (transformers 5.24, file and line named),
not from packedinit's tables: ``(parameter suffix, dim, sizes, groups, batch dims)``. Every logical
block of ``chunked(xavier_uniform_)(model)`` must have the per-block xavier std within 12%.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn
from torch.nn import init

import packedinit
from packedinit.model import found

transformers = pytest.importorskip("transformers", reason="the models of issue 26 are transformers models")

Oracle = list[tuple[str, int, list[int], int, int]]
TEXT = {"vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16}


def _qwen3_5() -> tuple[nn.Module, Oracle]:
    # qwen3_5/modeling_qwen3_5.py:565,600: torch.split(in_proj_qkv(h), [key_dim, key_dim, value_dim], -1);
    # :782: q_proj(h).view(..., -1, head_dim * 2).chunk(2, -1): [q | gate] inside every head
    cfg = transformers.Qwen3_5TextConfig(
        **TEXT, intermediate_size=128, num_key_value_heads=2, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    )  # fmt: skip
    return transformers.Qwen3_5ForCausalLM(cfg), [
        ("linear_attn.in_proj_qkv.weight", 0, [32, 32, 64], 1, 0),
        ("self_attn.q_proj.weight", 0, [16, 16], 4, 0),
    ]


def _jetmoe() -> tuple[nn.Module, Oracle]:
    # jetmoe/modeling_jetmoe.py:464: kv_proj(h).chunk(2, -1); :139 ParallelExperts: F.linear(x_e, weight[e]),
    # input_linear's output chunked in two (gate | up) by JetMoeMoE
    cfg = transformers.JetMoeConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=1, num_key_value_heads=2, kv_channels=16,
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.JetMoeForCausalLM(cfg), [
        ("self_attention.kv_proj.weight", 0, [32, 32], 1, 0),
        ("mlp.input_linear.weight", 1, [64, 64], 1, 1),
        ("mlp.output_linear.weight", 1, [64], 1, 1),
    ]


def _llama4() -> tuple[nn.Module, Oracle]:
    # llama4/modeling_llama4.py Llama4TextExperts: torch.bmm(x, gate_up_proj).chunk(2, dim=-1) on (n, E, 2I)
    # stored (in, out); down_proj (n, I, E) through bmm: one matrix per expert
    cfg = transformers.Llama4TextConfig(
        **TEXT, intermediate_size=64, intermediate_size_mlp=128, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=1,
    )  # fmt: skip
    return transformers.Llama4ForCausalLM(cfg), [
        ("experts.gate_up_proj", 2, [64, 64], 1, 1),
        ("experts.down_proj", 2, [64], 1, 1),
    ]


def _lfm2() -> tuple[nn.Module, Oracle]:
    # lfm2/modeling_lfm2.py Lfm2ShortConv: in_proj(x).transpose(-1, -2).chunk(3, dim=-2): [B | C | x]
    cfg = transformers.Lfm2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"],
    )  # fmt: skip
    return transformers.Lfm2ForCausalLM(cfg), [("conv.in_proj.weight", 0, [64, 64, 64], 1, 0)]


def _blocks(w: Tensor, dim: int, sizes: list[int], groups: int, batch: int) -> list[Tensor]:
    """The logical matrices as the forward reads them: per expert, each part's rows gathered over the groups."""
    mats = list(w) if batch else [w]
    step, out = sum(sizes), []
    for m in mats:
        for j, size in enumerate(sizes):
            rows = [g * step + sum(sizes[:j]) + i for g in range(groups) for i in range(size)]
            out.append(m.index_select(dim - batch, torch.tensor(rows)))
    return out


def _check(model: nn.Module, oracle: Oracle) -> int:
    checked = 0
    for suffix, dim, sizes, groups, batch in oracle:
        params = [(n, p) for n, p in model.named_parameters() if n.endswith(suffix)]
        assert params, suffix
        for name, p in params:
            for block in _blocks(p.detach(), dim, sizes, groups, batch):
                want = (2 / (block.shape[0] + block.shape[1])) ** 0.5
                assert abs(float(block.std()) / want - 1) < 0.12, (name, tuple(block.shape), float(block.std()), want)
                checked += 1
    return checked


@pytest.mark.parametrize("build", [_qwen3_5, _jetmoe, _llama4, _lfm2], ids=lambda f: f.__name__[1:])
def test_chunked_model_is_per_block_from_the_forward(build: Callable[[], tuple[nn.Module, Oracle]]) -> None:
    model, oracle = build()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", packedinit.LayoutWarning)  # nothing to say: the forward showed them all
        packedinit.chunked(init.xavier_uniform_)(model)
    assert _check(model, oracle) >= 2
    kept = found.findings(model)
    assert kept is not None
    assert found.findings(model) is kept  # traced once: a second call costs nothing
    model.apply(packedinit.chunked(init.xavier_uniform_))  # the apply idiom reads the same trace
    assert _check(model, oracle) >= 2
    packedinit.init_model(model, init.xavier_uniform_)
    assert _check(model, oracle) >= 2


@contextlib.contextmanager
def _without_adapter(cls: type) -> Iterator[None]:
    """The built-in adapter of ``cls`` removed for the block (the path a model without one takes)."""
    key = f"{cls.__module__}.{cls.__qualname__}"
    adapter = packedinit.unregister(key)
    assert adapter is not None, key
    try:
        yield
    finally:
        packedinit.register(key)(adapter)


def test_an_expert_stack_is_per_block_from_adapter_or_forward_and_named_without_either() -> None:
    # cohere2_moe: the default experts implementation (integrations/moe.py: grouped_mm, eager path
    # F.linear(x, gate_up_proj[e]).chunk(2, -1) on (n, 2I, E), down_proj (n, E, I))
    cfg = transformers.Cohere2MoeConfig(
        **TEXT, intermediate_size=64, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, eos_token_id=1, pad_token_id=0, bos_token_id=2,
    )  # fmt: skip
    oracle: Oracle = [("experts.gate_up_proj", 1, [64, 64], 1, 1), ("experts.down_proj", 1, [64], 1, 1)]
    experts = type(transformers.Cohere2MoeForCausalLM(cfg).model.layers[0].mlp.experts)
    for adapter in (True, False):  # its adapter (adapters/hf_experts.py), then the forward alone
        model = transformers.Cohere2MoeForCausalLM(cfg)
        torch.manual_seed(0)
        with contextlib.ExitStack() as stack:
            if not adapter:
                stack.enter_context(_without_adapter(experts))
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("error", packedinit.LayoutWarning)
            packedinit.chunked(init.xavier_uniform_)(model)
        assert _check(model, oracle) == 24, adapter
    model = transformers.Cohere2MoeForCausalLM(cfg)
    found.remember(model, None)  # as for a forward packedinit cannot trace (no inputs, or it failed)
    first = r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' \(4, 128, 64\)"
    with _without_adapter(experts), pytest.warns(packedinit.LayoutWarning, match=first) as got:
        packedinit.chunked(init.xavier_uniform_)(model)  # no adapter and no trace: named, not silent
    message = str(got[0].message)
    assert "'model.layers.1.mlp.experts.down_proj' (4, 64, 64) (a stack of 4 matrices" in message
    line = message.split("Fix (check the sizes against the forward): ", 1)[1].split("; or trace the forward", 1)[0]
    with _without_adapter(experts):
        exec(line, {"packedinit": packedinit, "model": model})
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", packedinit.LayoutWarning)
            packedinit.chunked(init.xavier_uniform_)(model)
    assert _check(model, oracle) == 24


def test_a_vision_tower_is_named_without_inputs_and_per_block_with_them() -> None:
    # qwen3_vl/modeling_qwen3_vl.py:269: qkv(h).reshape(seq, 3, num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cfg = transformers.Qwen3VLVisionConfig(
        depth=2, hidden_size=64, num_heads=4, intermediate_size=128, patch_size=2, temporal_patch_size=2,
        in_channels=3, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16,
        deepstack_visual_indexes=[],
    )  # fmt: skip
    model = transformers.Qwen3VLVisionModel(cfg)
    oracle: Oracle = [("attn.qkv.weight", 0, [64, 64, 64], 1, 0)]
    found.remember(model, None)  # as for a forward packedinit cannot trace (no inputs, or it failed)
    with _without_adapter(type(model.blocks[0].attn)):
        with pytest.warns(packedinit.LayoutWarning, match=r"'blocks\.1\.attn\.qkv\.weight' \(192, 64\) \(name 'qkv'"):
            packedinit.chunked(init.xavier_uniform_)(model)  # no adapter and no trace: named, not silent
        packedinit.annotate(model, torch.randn(16, 24), grid_thw=torch.tensor([[1, 4, 4]]))  # the forward, traced
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", packedinit.LayoutWarning)
            packedinit.chunked(init.xavier_uniform_)(model)
    assert _check(model, oracle) == 6

"""The transformers sweep (docs/scripts/sweep.py): a fast subset of what the full run checks."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sweep", ROOT / "docs" / "scripts" / "sweep.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shrink_makes_a_tiny_config_and_its_sub_configs(sweep: ModuleType) -> None:
    cfg = sweep.shrink(transformers.LlavaConfig())
    assert cfg.text_config.hidden_size == 64
    assert cfg.text_config.num_hidden_layers == 1
    assert cfg.vision_config.hidden_size == 64


@pytest.mark.parametrize(
    ("model_type", "packed"),
    [("gpt2", 1), ("mamba2", 1), ("deepseek_v3", 2), ("falcon_mamba", 2), ("glm", 1), ("cohere", 0), ("modernbert", 4),
     ("phi4_multimodal", 2)],
)
def test_fast_subset_is_clean(sweep: ModuleType, model_type: str, packed: int) -> None:
    """Built on meta, materialised, reset strictly, audited, traced: the tracer agrees with the adapters.

    Before: GLM's fused gate_up_proj, ModernBERT's Wqkv and Wi and Phi-4-multimodal's qkv_proj had no
    adapter (the sweep found them); Cohere's rotate_every_two
    (``torch.stack((-x2, x1))``) made the tracer call q_proj and k_proj packed in pairs.
    """
    (name,) = [n for t, n in sweep.models([model_type])]
    row = sweep.check(model_type, name, seconds=120)
    assert row["built"], row
    assert row["reset"] == "ok", row
    assert row["disagree"] == [], row
    assert row["packed_by_forward"] == packed, row  # cohere: its interleaved rotary is not a split
    assert row["clean"], row


def test_a_failure_is_listed_with_its_reason(sweep: ModuleType, tmp_path: Path) -> None:
    rows = [
        sweep.check("gpt2", "GPT2Model"),
        {"model_type": "broken", "class": "BrokenModel", "built": False, "clean": False, "error": "ValueError: x"},
    ]
    text = sweep.page(rows, 1.0)
    assert "| 2 | 1 | 1 (100.0%) | 1 | 1 |" in text
    assert "| broken | BrokenModel | ValueError: x |" in text
    assert "| gpt2 | GPT2Model | yes (input_ids) | `h.*.attn.c_attn.weight` both | - | ok | yes |" in text
    out = tmp_path / "rows.jsonl"
    out.write_text("\n".join(json.dumps(r) for r in rows))
    page = tmp_path / "sweep.md"
    assert sweep.main(["--from-jsonl", "--jsonl", str(out), "--page", str(page)]) == 0
    assert page.read_text() == sweep.page(rows, 1.0).replace("(0 min", "(0 min")


def test_mla_without_a_rotary_part_claims_nothing_it_cannot_split(sweep: ModuleType) -> None:
    """Before: GLM-5-Next (qk_rope_head_dim 0) made the MLA adapter raise 'every size must be positive' on
    Layout(0, [512, 0]), so audit and chunked(f)(model) failed on the model; with no rotary part,
    kv_a_proj_with_mqa is one block and nothing is claimed for it."""
    row = sweep.check("glm5_next_text", "Glm5NextTextModel", seconds=120)
    assert row["built"], row
    assert row.get("error") is None, row
    assert not str(row["audit"]).startswith("FAILED"), row


@pytest.mark.parametrize("model_type", ["cohere2_moe", "aria_text", "llama4_text"])
def test_experts_the_forward_found_without_an_adapter_now_have_one(sweep: ModuleType, model_type: str) -> None:
    """Before: the tracer (following transformers' default grouped_mm experts) showed these stacks split
    into [gate | up] per expert, and no adapter described them: they were initialised with 3-D fans."""
    (name,) = [n for t, n in sweep.models([model_type])]
    row = sweep.check(model_type, name, seconds=120)
    assert row["disagree"] == [], row
    stacks = {n: who for n, who in row["sources"].items() if n.endswith("experts.gate_up_proj")}
    assert stacks, row
    assert set(stacks.values()) == {"both"}, row


@pytest.mark.parametrize(
    ("model_type", "weights"),
    [
        ("qwen3_5_text", {"layers.*.linear_attn.in_proj_qkv.weight", "layers.*.self_attn.q_proj.weight"}),
        ("exaone4_5_vision", {"blocks.*.attn.qkv.weight"}),  # [q: 64 | k: 32 | v: 32]
        ("glm4v_vision", {"blocks.*.attn.qkv.weight"}),
        ("sam_vision_model", {"vision_encoder.layers.*.attn.qkv.weight"}),
    ],
)
def test_fused_layers_the_forward_found_without_an_adapter_now_have_one(
    sweep: ModuleType, model_type: str, weights: set[str]
) -> None:
    """Before: the forward showed Qwen3.5's linear-attention [q | k | v] and per-head [q | gate] queries,
    and the vision towers' fused qkv, and no adapter described them (issue 26)."""
    (name,) = [n for t, n in sweep.models([model_type])]
    row = sweep.check(model_type, name, seconds=120)
    assert row["disagree"] == [], row
    assert {n: row["sources"].get(n) for n in weights} == dict.fromkeys(weights, "both"), row


def test_a_model_whose_tiny_config_disagrees_with_itself_is_traced_at_its_default_widths(sweep: ModuleType) -> None:
    """Swin's tiny config gives windows that do not tile its feature maps, so its forward raises; the
    sweep then traces the default widths with one layer on meta (no values read, nothing computed)."""
    row = sweep.check("swin", "SwinModel", seconds=120)
    assert row["traced_at"] == "default widths, 1 layer, on meta", row
    assert row["disagree"] == [], row
    cfg = sweep.shallow(transformers.SwinConfig())
    assert cfg.depths == transformers.SwinConfig().depths  # only the layer counts it knows by name change


def test_shrink_derives_again_what_a_config_derived_from_the_sizes_it_shrank(sweep: ModuleType) -> None:
    """Zamba-2's config derives its attention width, Mamba head size and hybrid layer ids from its sizes
    once: shrunk afterwards they pointed at layer 6 of 2 (KeyError: 1) and a 640-wide head of 128."""
    cfg = sweep.shrink(transformers.Zamba2Config())
    assert cfg.hybrid_layer_ids == [i for i, kind in enumerate(cfg.layers_block_type) if kind == "hybrid"]
    assert cfg.hybrid_layer_ids
    assert max(cfg.hybrid_layer_ids) < cfg.num_hidden_layers
    assert cfg.mamba_headdim * cfg.n_mamba_heads == cfg.mamba_expand * cfg.hidden_size
    assert cfg.attention_hidden_size == 2 * cfg.hidden_size
    row = sweep.check("zamba2", "Zamba2Model", seconds=120)
    assert row["traced"] > 0, row


def test_shrink_keeps_a_size_tied_to_the_hidden_size_tied(sweep: ModuleType, ships: Callable[[str], bool]) -> None:
    """WavTokenizer has no projection around its quantizer: its config refuses a codebook_dim that is not
    its hidden size, so shrinking the hidden size alone left a config the model cannot be built from."""
    if not ships("transformers.models.wavtokenizer"):
        pytest.skip("this transformers has no WavTokenizer yet (checked on 5.24: tests/conftest.py)")
    cfg = sweep.shrink(transformers.WavTokenizerEncoderConfig())
    assert cfg.codebook_dim == cfg.hidden_size == 64
    with torch.device("meta"):
        transformers.WavTokenizerEncoderModel(cfg)

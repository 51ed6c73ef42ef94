"""The sweep's config shrink (docs/scripts/sweep.py): a tiny config the model's own code still accepts.

``shrink`` sets the sizes below where a config has them (nested sub-configs too) and keeps what the model ties
to them consistent (stage counts and first-stage widths, projection widths, per-head box terms, codebooks);
``shallow`` keeps every width and makes each stack one layer deep, for the models whose widths cannot shrink.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["SIZES", "shallow", "shrink"]

SIZES: dict[str, int] = {
    "hidden_size": 64, "hidden_size_global": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embed_dim": 64,
    "n_embed": 64, "d_embed": 64,
    "num_hidden_layers": 1, "num_layers": 1, "n_layer": 1, "n_layers": 1, "encoder_layers": 1,
    "decoder_layers": 1, "num_encoder_layers": 1, "num_decoder_layers": 1, "depth": 1,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "ffn_dim": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "n_inner": 128,
    "d_ff": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "vocab_size": 256, "max_position_embeddings": 64, "n_positions": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "top_k": 2, "moe_topk": 2,
}  # fmt: skip


def _per_stage(config: Any, stages: int) -> bool:
    """``stages`` counts the stages of per-stage lists (widths, depths): make each stage 1 deep, keep the count."""
    lists = {k: v for k, v in vars(config).items() if isinstance(v, (list, tuple)) and len(v) == stages > 1}
    widths = [k for k, v in lists.items() if k.startswith("hidden_size") and all(isinstance(x, int) for x in v)]
    if not widths:
        return False
    for key in ("depths", "num_layers_per_stage"):
        if key in lists:
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, [1] * stages)
    return True


def _first_stage_width(config: Any, width: object) -> bool:
    """``width`` is the first of the config's per-stage widths (``embed_dim_per_stage``, ``hidden_sizes``)."""
    return any(
        isinstance(v, (list, tuple)) and v and v[0] == width and ("per_stage" in k or k == "hidden_sizes")
        for k, v in vars(config).items()
        if "dim" in k or "size" in k
    )


def _stages(config: Any, key: str, old: int) -> bool:
    """``key`` counts the stages a per-stage list describes (Muse Spark's audio pyramid): it is kept."""
    sizes = getattr(config, "hidden_sizes", None)
    return key == "num_hidden_layers" and isinstance(sizes, (list, tuple)) and len(sizes) == old


def _one_layer_per_type(config: Any) -> None:
    """A hybrid stack keeps one layer of each of its first two kinds (``layer_types``), its depth to match."""
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) > 1:
        kept = list(dict.fromkeys(layer_types))[:2]
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.layer_types = kept
            for key in ("num_hidden_layers", "num_layers"):
                if hasattr(config, key):
                    setattr(config, key, len(kept))


def shrink(config: Any, depth: int = 0) -> Any:
    """Shrink a config in place (and its sub-configs): the sizes above where the config has them."""
    from transformers import PretrainedConfig

    wide, wide_heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    for key, value in SIZES.items():
        old = getattr(config, key, None)
        if value == 1 and isinstance(old, int) and _per_stage(config, old):
            continue  # a stage count (ConvNeXt: num_hidden_layers is num_stages): its stages are made shallow instead
        if key == "hidden_size" and _first_stage_width(config, old):
            continue  # the first stage's width (SAM 2's Hiera): kept, as the stage widths are
        if isinstance(old, int) and not isinstance(old, bool) and old > value and not _stages(config, key, old):
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, value)
    if isinstance(wide, int) and getattr(config, "codebook_dim", None) == wide != config.hidden_size:
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.codebook_dim = config.hidden_size  # tied sizes stay tied (WavTokenizer: no projection between)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    for key in ("word_embed_proj_dim", "projection_size"):  # widths that were the hidden size stay it (OPT, SigLIP-2)
        if getattr(config, key, None) == wide and isinstance(hidden, int):
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, hidden)
    per_head = wide // wide_heads if isinstance(wide, int) and isinstance(wide_heads, int) and wide_heads else None
    if per_head and getattr(config, "dim_bbox_projection", None) == per_head and isinstance(hidden, int):
        with contextlib.suppress(AttributeError, TypeError, ValueError):  # BROS: the box term is per head
            config.dim_bbox_projection = hidden // heads if isinstance(heads, int) and heads else hidden
    if (
        isinstance(getattr(config, "head_dim", None), int)
        and isinstance(heads, int)
        and isinstance(hidden, int)
        and not hasattr(config, "qk_rope_head_dim")  # MLA: head_dim is the rotary size, kept
    ):
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.head_dim = max(hidden // heads, 8)
    ssm_heads, expand = getattr(config, "num_heads", None), getattr(config, "expand", None)
    mamba2 = isinstance(ssm_heads, int) and isinstance(expand, int) and isinstance(hidden, int)
    if mamba2 and hasattr(config, "head_dim"):
        with contextlib.suppress(AttributeError, TypeError, ValueError):  # Mamba-2: heads * head_dim = expand * hidden
            config.head_dim = expand * hidden // ssm_heads
    for key, value in (("n_group", 1), ("topk_group", 1), ("n_groups", 1), ("num_key_value_heads", 2)):
        old = getattr(config, key, None)  # routing groups, SSM groups: must divide what was shrunk
        if isinstance(old, int) and not isinstance(old, bool) and old > value:
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, value)
    if hasattr(config, "kv_lora_rank") and isinstance(heads, int) and hasattr(config, "num_key_value_heads"):
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.num_key_value_heads = heads  # MLA: every head has its own k and v
    routed = ("n_routed_experts", "num_experts", "num_local_experts")
    experts = any(isinstance(getattr(config, k, None), int) for k in routed)
    if experts and hasattr(config, "num_experts_per_tok") and config.num_experts_per_tok is None:
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.num_experts_per_tok = 2  # DeepSeek-V2's default config routes to None experts
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= 256:
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, 0)
    for key in ("image_token_index", "video_token_index"):  # BLIP-2's default config has no image token
        if key in vars(config) and hasattr(config, "num_query_tokens"):
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, SIZES["vocab_size"] - 1)
    _one_layer_per_type(config)
    rotary = getattr(config, "rotary_dim", None)  # GPT-J, CodeGen: the rotary part fits in a head
    if isinstance(rotary, int) and isinstance(hidden, int) and isinstance(heads, int) and rotary > hidden // heads:
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.rotary_dim = hidden // heads
    mamba_expand = getattr(config, "mamba_expand", None)  # Bamba, GraniteMoeHybrid: heads x head dim = expand x hidden
    if isinstance(mamba_expand, int) and isinstance(hidden, int) and hasattr(config, "mamba_n_heads"):
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.mamba_n_heads = 4
            config.mamba_d_head = mamba_expand * hidden // 4
    block_types = getattr(config, "layers_block_type", None)  # Zamba-2: what its __post_init__ derives, again
    if isinstance(block_types, list) and isinstance(getattr(config, "hybrid_layer_ids", None), list):
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.hybrid_layer_ids = [i for i, kind in enumerate(block_types) if kind == "hybrid"]
            if isinstance(hidden, int) and isinstance(getattr(config, "attention_hidden_size", None), int):
                config.attention_hidden_size = 2 * hidden  # the attention reads the embeddings beside the state
            if isinstance(mamba_heads := getattr(config, "n_mamba_heads", None), int) and isinstance(hidden, int):
                config.mamba_headdim = int(getattr(config, "mamba_expand", 2) * hidden) // mamba_heads
    if hasattr(config, "num_sliding_attention_heads") and getattr(config, "sliding_window", 0) is None:
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.sliding_window = 64  # Step-3.7 builds its sliding-window mask whatever its layer types
    rope = getattr(config, "rope_parameters", None)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None)
    if not isinstance(head_dim, int) and isinstance(hidden, int) and isinstance(heads, int) and heads:
        head_dim = hidden // heads
    if isinstance(rope, dict) and isinstance(head_dim, int):  # multimodal rotary (Qwen-VL, GLM-4V): sections of half
        factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        total = int(head_dim * (factor if isinstance(factor, float) else 1.0)) // 2
        third = total * 3 // 8
        rope["mrope_section"] = [total - 2 * third, third, third]
    if depth < 3:
        for value in list(vars(config).values()):
            if isinstance(value, PretrainedConfig):
                shrink(value, depth + 1)
    layers = getattr(config, "num_hidden_layers", None)
    names, indices = getattr(config, "stage_names", None), getattr(config, "out_indices", None)
    flat = not hasattr(config, "depths")  # a stage per layer (DINOv2), not stages of several layers (Swin)
    if flat and isinstance(layers, int) and isinstance(names, list) and len(names) > layers + 1 and indices:
        with contextlib.suppress(AttributeError, TypeError, ValueError):  # a backbone's outputs: of the layers kept
            config.stage_names = names[: layers + 1]
            config.out_indices = sorted({min(i, layers) for i in indices})
    hooks = getattr(config, "intermediate_hook_ids", None)  # DepthPro: the layers its fusion reads, of those kept
    if isinstance(hooks, (list, tuple)) and hooks:
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.intermediate_hook_ids = [0] * len(hooks)
    vision_width = getattr(getattr(config, "vision_config", None), "hidden_size", None)
    for value in list(vars(config).values()):  # a Q-Former reads the vision tower's width (BLIP-2): the shrunk one
        if isinstance(value, PretrainedConfig) and isinstance(getattr(value, "encoder_hidden_size", None), int):
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                if isinstance(vision_width, int) and value is not config.vision_config:
                    value.encoder_hidden_size = vision_width
    return config


_DEPTHS = [k for k, v in SIZES.items() if v == 1]


def shallow(config: Any, depth: int = 0) -> Any:
    """One layer (of each kind) per stack, every width as the config has it: a model whose shapes all agree."""
    from transformers import PretrainedConfig

    for key in _DEPTHS:
        old = getattr(config, key, None)
        if isinstance(old, int) and _per_stage(config, old):
            continue
        if isinstance(old, int) and not isinstance(old, bool) and old > 1 and not _stages(config, key, old):
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, 1)
    _one_layer_per_type(config)
    if depth < 3:
        for value in list(vars(config).values()):
            if isinstance(value, PretrainedConfig):
                shallow(value, depth + 1)
    return config

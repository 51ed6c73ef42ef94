"""Example inputs built from a model's own description, so the forward can be traced without the caller's data.

:func:`example_inputs` reads a transformers model's config and forward signature (transformers is never
imported: the model is read through its attributes) and builds a tiny batch for its main input: token
ids, pixel values, raw audio, audio features, video frames, vision-tower patches with their grid, time
series; encoder-decoder models get decoder ids too. ``torch.nn`` modules whose input follows from their
attributes (``MultiheadAttention``, ``Transformer`` and its layers, ``LSTM`` / ``GRU`` / ``RNN`` and their
cells) get one as well. Inputs go on the model's device; on the meta device they cost nothing.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor, nn

from packedinit.trace.config_read import BATCH, TOKENS, Builder, Inputs, int_of, sub_config, where
from packedinit.trace.inputs_audio import AUDIO_INPUTS, fitted_audio, fitted_other, wanted_audio
from packedinit.trace.inputs_vision import image_hw, is_video, patch_images, pixels, prompt_images, vision_inputs

__all__ = ["example_inputs"]

# -- torch.nn ---------------------------------------------------------------------------------------


def _seq(device: torch.device, dtype: torch.dtype, batch_first: bool, width: int) -> Tensor:
    shape = (BATCH, 3, width) if batch_first else (3, BATCH, width)
    return torch.zeros(shape, device=device, dtype=dtype)


def _torch_nn(model: nn.Module, device: torch.device, dtype: torch.dtype) -> Inputs | None:
    if isinstance(model, nn.MultiheadAttention):
        first = model.batch_first
        q = _seq(device, dtype, first, model.embed_dim)
        return (q, _seq(device, dtype, first, model.kdim), _seq(device, dtype, first, model.vdim)), {}
    if isinstance(model, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        attn = model.self_attn
        x = _seq(device, dtype, attn.batch_first, attn.embed_dim)
        return ((x,) if isinstance(model, nn.TransformerEncoderLayer) else (x, x)), {}
    if isinstance(model, (nn.TransformerEncoder, nn.TransformerDecoder)) and len(model.layers):
        attn = model.layers[0].self_attn
        x = _seq(device, dtype, attn.batch_first, attn.embed_dim)
        return ((x,) if isinstance(model, nn.TransformerEncoder) else (x, x)), {}
    if isinstance(model, nn.Transformer):
        x = _seq(device, dtype, model.batch_first, model.d_model)
        return (x, x), {}
    if isinstance(model, nn.RNNBase):
        return (_seq(device, dtype, model.batch_first, model.input_size),), {}
    if isinstance(model, nn.RNNCellBase):
        return (torch.zeros(BATCH, model.input_size, device=device, dtype=dtype),), {}
    return None


# -- transformers: one builder per input name -------------------------------------------------------


def _ids(config: Any, device: torch.device, dtype: torch.dtype) -> Tensor:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int_of(text, "vocab_size", default=100)
    ids = (torch.arange(BATCH * TOKENS) % max(min(vocab, 200) - 1, 1) + 1).view(BATCH, TOKENS)
    return ids.to(device)


def _video(config: Any, device: torch.device, dtype: torch.dtype) -> Tensor:
    vision = sub_config(config, "vision_config", "video_config")
    frames = int_of(vision, "num_frames", "frames_per_clip", default=4)
    tubelet = int_of(vision, "tubelet_size", default=1)
    frames = max(frames, tubelet) // tubelet * tubelet
    channels = int_of(vision, "num_channels", "in_channels", default=3)
    h, w = image_hw(vision)
    return torch.zeros(BATCH, frames, channels, h, w, device=device, dtype=dtype)


def _audio(config: Any, device: torch.device, dtype: torch.dtype) -> Tensor:
    audio = sub_config(config, "audio_config", "encoder_config")
    if hasattr(audio, "num_mel_bins") and hasattr(audio, "max_length"):  # a spectrogram (Audio Spectrogram Transformer)
        frames = int_of(audio, "max_length", default=64)
        return torch.zeros(BATCH, frames, int_of(audio, "num_mel_bins", default=64), device=device, dtype=dtype)
    codec = any(hasattr(audio, k) for k in ("upsampling_ratios", "downsampling_ratios", "hop_length", "codebook_size"))
    strides = getattr(audio, "conv_stride", None)
    hop = math.prod(strides) if isinstance(strides, (list, tuple)) and strides else 320
    length = max(hop * 16, 4000)
    channels = getattr(audio, "audio_channels", 1 if codec else None)  # a codec reads (batch, channels, samples)
    shape = (BATCH, channels, length) if isinstance(channels, int) and channels > 0 else (BATCH, length)
    return torch.zeros(shape, device=device, dtype=dtype)


def _features(config: Any, device: torch.device, dtype: torch.dtype, mel_first: bool = True) -> Tensor:
    audio = sub_config(config, "audio_config", "encoder_config", "speech_config")
    if hasattr(audio, "num_mel_bins") and not mel_first:  # a conformer: (batch, frames, mel bins)
        return torch.zeros(BATCH, 32, int_of(audio, "num_mel_bins", default=80), device=device, dtype=dtype)
    if hasattr(audio, "num_mel_bins"):  # Whisper-like: (batch, mel bins, 2 x positions after the strided conv)
        mel = int_of(audio, "num_mel_bins", default=80)
        positions = int_of(audio, "max_source_positions", default=32)
        return torch.zeros(BATCH, mel, 2 * positions, device=device, dtype=dtype)
    if hasattr(audio, "input_feat_per_channel"):  # Speech2Text: (batch, frames, features x channels)
        width = int_of(audio, "input_feat_per_channel", default=80) * int_of(audio, "input_channels", default=1)
        return torch.zeros(BATCH, 32, width, device=device, dtype=dtype)
    width = int_of(audio, "feature_projection_input_dim", "feature_size", "input_dim", "num_mel_bins", default=80)
    return torch.zeros(BATCH, 32, width, device=device, dtype=dtype)


def _patches(config: Any, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A vision tower fed flattened patches and their (t, h, w) grid (Qwen-VL and its descendants)."""
    vision = sub_config(config, "vision_config")
    merge = int_of(vision, "spatial_merge_size", "merge_size", default=2)
    width = (
        int_of(vision, "in_channels", "num_channels", default=3)
        * int_of(vision, "temporal_patch_size", "patch_temporal", default=1)
        * int_of(vision, "patch_size", default=14) ** 2
    )
    grid = torch.tensor([[1, 2 * merge, 2 * merge]], device=device)
    return torch.zeros(4 * merge * merge, width, device=device, dtype=dtype), grid


def _series(config: Any, device: torch.device, dtype: torch.dtype) -> Tensor:
    lags = getattr(config, "lags_sequence", None)
    length = int_of(config, "context_length", default=32) + (max(lags) if isinstance(lags, list) and lags else 0)
    channels = int_of(config, "num_input_channels", "input_size", default=1)
    return torch.zeros(BATCH, length, channels, device=device, dtype=dtype)


_BUILDERS: dict[str, Builder] = {
    "input_ids": _ids,
    "decoder_input_ids": _ids,
    "qformer_input_ids": _ids,
    "pixel_values": pixels,
    "pixel_values_videos": _video,
    "input_values": _audio,
    "input_features": _features,
    "audio_mel": _features,
    "past_values": _series,
}


def _transformers(model: nn.Module, device: torch.device, dtype: torch.dtype) -> Inputs | None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    main = getattr(model, "main_input_name", None)
    main = main[0] if isinstance(main, (list, tuple)) and main else main
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty and p.kind in named]
    kwargs: dict[str, Any] = {}
    missing: list[str] = []
    if "hidden_states" in required and "grid_thw" in required:
        kwargs["hidden_states"], kwargs["grid_thw"] = _patches(config, device, dtype)
        required = [n for n in required if n not in kwargs]
    if "pixel_values" in required and ("grid_thw" in required or "image_grid_thw" in required):
        grid_name = "grid_thw" if "grid_thw" in required else "image_grid_thw"
        kwargs["pixel_values"], kwargs[grid_name] = _patches(config, device, dtype)
        kwargs = patch_images(model, config, kwargs)
        required = [n for n in required if n not in kwargs]
    kwargs.update((k, v) for k, v in vision_inputs(model, config, params, device, dtype).items() if k not in kwargs)
    names = [n for n in dict.fromkeys([*([main] if isinstance(main, str) else []), *required]) if n not in kwargs]
    if isinstance(main, str) and main not in params and not required and "input_ids" in params:
        names.append("input_ids")  # a main input the forward does not take (SAM 3 Lite's text tower): its text
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        names.append("decoder_input_ids")
    image_tokens = any(hasattr(config, k) for k in ("image_token_id", "image_token_index", "image_token"))
    towers = hasattr(config, "vision_config") or (hasattr(config, "image_size") and "input_ids" in names)
    if towers and "pixel_values" in params and not image_tokens:
        names.append("pixel_values")  # a two-tower model (CLIP-like, ViLT) needs both of its inputs
    if "pixel_values" in names and "input_ids" in params and hasattr(config, "text_config") and not image_tokens:
        names.append("input_ids")  # an image model prompted by text (Kosmos-2, SAM 3)
    audio = wanted_audio(config, params, names)
    if audio is not None:
        names.append(audio)  # a text-and-audio model needs both of its inputs (CLAP)
    for name in names:
        if name not in params or name in kwargs:
            continue
        build = _BUILDERS.get(name)
        if name == "pixel_values" and is_video(config):
            build = _video  # a video model whose main input is called pixel_values (VideoMAE, ViViT)
        if name == "input_features":  # mel bins first where a Conv1d reads them as channels (Whisper)
            mel = getattr(sub_config(config, "audio_config", "encoder_config", "speech_config"), "num_mel_bins", None)
            first = any(isinstance(m, nn.Conv1d) and m.in_channels == mel for m in model.modules())
            kwargs[name] = _features(config, device, dtype, mel_first=first)
        elif build is not None:
            kwargs[name] = build(config, device, dtype)
            codebooks = getattr(getattr(config, "decoder_config", None), "num_channels", None)
            if name == "decoder_input_ids" and isinstance(codebooks, int):  # Dia: one id per codebook a step
                kwargs[name] = kwargs[name][..., None].expand(-1, -1, codebooks).contiguous()
        elif name in ("input_features_mask", "audio_mel_mask", "feature_attention_mask"):
            source = kwargs.get(name.removesuffix("_mask"), kwargs.get("input_features"))
            if isinstance(source, Tensor):  # (batch, frames) of ones, frames where the features have them
                mel_last = hasattr(sub_config(config, "audio_config"), "num_mel_bins")
                frames = source.shape[-1] if mel_last else source.shape[1]
                kwargs[name] = torch.ones(BATCH, frames, device=device, dtype=torch.long)
        elif name in ("query_embeds", "inputs_embeds"):
            width = int_of(config, "hidden_size", "d_model", default=64)
            tokens = int_of(config, "num_query_tokens", default=TOKENS) if name == "query_embeds" else TOKENS
            kwargs[name] = torch.zeros(BATCH, tokens, width, device=device, dtype=dtype)
        elif name in required or name == main:
            missing.append(name)  # no builder knows it: fitted below
    prompt_images(config, params, kwargs, device)
    if (kwargs or missing) and "use_cache" in params:
        kwargs["use_cache"] = False  # no cache to build (a hybrid model's cache can refuse a tiny config)
    if missing or "past_values" in kwargs:
        fitted = fitted_other(model, kwargs, missing, params)
        if fitted is None and missing:
            return None  # a required input nobody here knows how to build
        kwargs = fitted or kwargs
    if "past_observed_mask" in names and isinstance(kwargs.get("past_values"), Tensor):
        kwargs["past_observed_mask"] = torch.ones_like(kwargs["past_values"])
    if "lang_ids" in params and getattr(config, "languages", None) and getattr(config, "default_language", 0) is None:
        kwargs["lang_ids"] = torch.zeros(BATCH, device=device, dtype=torch.long)  # X-MOD: no default language
    if any(n in kwargs for n in AUDIO_INPUTS):
        kwargs = fitted_audio(model, kwargs, params)  # the layout, width and length the forward accepts
    return ((), kwargs) if kwargs else None


def example_inputs(model: nn.Module) -> Inputs | None:
    """A tiny ``(args, kwargs)`` the model's forward accepts, built from its config or attributes; else ``None``.

    For a transformers model the main input (``main_input_name``) and every required forward argument
    are built from the config: token ids ``(2, 5)``, pixel values ``(2, C, H, W)``, video
    ``(2, frames, C, H, W)``, raw audio, audio features, vision-tower patches with their grid, time
    series; an encoder-decoder also gets ``decoder_input_ids``. A ``torch.nn`` attention, transformer
    or recurrent module gets a batch of 2 and 3 steps in its own layout (``batch_first`` read). The
    inputs are zeros (ids count up from 1) on the model's device and floating dtype. ``None``: nothing
    here knows how to build this model's input; pass one to :func:`packedinit.infer_layouts` instead.

    Args:
        model: the module.

    Returns:
        ``(args, kwargs)`` for ``model(*args, **kwargs)``, or ``None``.

    Examples:
        >>> import torch
        >>> args, kwargs = example_inputs(torch.nn.LSTM(8, 4, batch_first=True))
        >>> args[0].shape, kwargs
        (torch.Size([2, 3, 8]), {})
        >>> example_inputs(torch.nn.Identity()) is None
        True
    """
    device, dtype = where(model)
    found = _torch_nn(model, device, dtype)
    return found if found is not None else _transformers(model, device, dtype)

"""Audio inputs that fit the model: the layouts a config allows, tried on a meta twin until the forward accepts one.

An audio model's config rarely says its input's layout in one field: raw audio is ``(batch, samples)`` for
one model and ``(batch, 1, samples)`` for the next, features are ``(batch, frames, mel bins)`` or
``(batch, mel bins, frames)``, the width is ``num_mel_bins`` or a stack of frames, and the length must be a
multiple of a hop or a chunk. :func:`fitted_audio` reads the widths the config names (every audio sub-config),
builds the few layouts they allow and runs the forward on a meta twin of the model (no value read, no
arithmetic) on each until one goes through. :func:`wanted_audio` names the audio input a two-tower model
(text and audio, CLAP-like) needs beside its text. :func:`fitted_other` builds, the same way, the inputs
no builder of :mod:`packedinit.trace.inputs` knows: a decision sequence, a series' padding and frequency,
embeddings fed in.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from packedinit.trace.config_read import BATCH, TOKENS, int_of
from packedinit.trace.trial import MASKS, first_fitting

__all__ = ["AUDIO_INPUTS", "fitted_audio", "fitted_other", "wanted_audio"]

#: The names a transformers forward gives its audio input.
AUDIO_INPUTS = ("input_values", "input_features", "audio_mel")
_SUBS = ("audio_config", "encoder_config", "speech_config", "asr_config", "acoustic_config", "audio_encoder_config")
_WIDTHS = (
    "num_mel_bins", "input_feat_size", "feature_size", "input_dim", "input_size", "n_mels", "num_mels",
    "model_in_channels", "feat_in", "input_channels", "channels", "vae_dim", "hidden_size",
)  # fmt: skip
_STACKS = ("num_stacked_frames", "stack_frames", "frame_stack", "context_size_frames")
_SAMPLES = 15360  # 2**10 * 3 * 5: a multiple of every usual hop (256, 320, 480, 512, 960, 1920, 3840)
_FRAMES = 200  # a multiple of the usual chunks (8, 40, 50, 100)


def _configs(config: Any) -> list[Any]:
    subs = [getattr(config, n, None) for n in _SUBS]
    return [*(s for s in subs if s is not None and hasattr(s, "to_dict")), config]


def _ints(configs: list[Any], keys: tuple[str, ...]) -> list[int]:
    out: list[int] = []
    for sub, key in itertools.product(configs, keys):
        value = getattr(sub, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 4096 and value not in out:
            out.append(value)
    return out


def _windows(configs: list[Any]) -> list[int]:
    """Chunk lengths the frames must be a multiple of (``n_window`` is half of one)."""
    return [2 * w for w in _ints(configs, ("n_window",))] + _ints(configs, ("chunk_length", "chunk_size"))


def _first_widths(model: nn.Module) -> list[int]:
    """What the model's first few linear and 1-d convolution layers read: a width the config may not name."""
    layers = (m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d)))
    return [m.in_features if isinstance(m, nn.Linear) else m.in_channels for m in itertools.islice(layers, 3)]


def _candidates(
    name: str, built: Tensor, model: nn.Module, config: Any, beside: Tensor | None = None
) -> Iterator[tuple[Tensor, int]]:
    """The layouts to try for one audio input, each with its time axis; the one built by the caller first."""
    device, dtype = built.device, built.dtype
    configs = _configs(config)
    widths = _ints(configs, _WIDTHS)
    yield built, (1 if built.dim() == 2 or built.shape[-1] in widths else -1)
    stacks = _ints(configs, _STACKS)
    widths += [w * s for w in widths[:2] for s in stacks] + [*_first_widths(model), 80, 128]
    frames = [_FRAMES, *(w * 4 for w in _windows(configs) if w * 4 != _FRAMES), 40]
    if beside is not None:  # features beside raw audio (a codec): as many frames as the audio has hops first
        frames.insert(0, 16)
    if name == "input_values":  # raw audio first, then a tower fed features or latents under the same name
        channels = _ints(configs, ("audio_channels",)) or [1]
        yield torch.zeros(BATCH, _SAMPLES, device=device, dtype=dtype), 1
        for c in dict.fromkeys([*channels, 1]):
            yield torch.zeros(BATCH, c, _SAMPLES, device=device, dtype=dtype), -1
    for length, width in itertools.product(frames, dict.fromkeys(widths)):
        yield torch.zeros(BATCH, length, width, device=device, dtype=dtype), 1
        yield torch.zeros(BATCH, width, length, device=device, dtype=dtype), -1
        yield torch.zeros(BATCH, 1, length, width, device=device, dtype=dtype), 2  # an image of the spectrogram


def _with(kwargs: dict[str, Any], name: str, value: Tensor, axis: int, params: Any) -> dict[str, Any]:
    out = dict(kwargs)
    out[name] = value
    if "decoder_" + name in params:  # an encoder-decoder fed the same kind on both sides (SpeechT5)
        out["decoder_" + name] = value
    for mask in (name + suffix for suffix in MASKS):  # its mask follows it (ones over its frames)
        if mask in params:
            out[mask] = torch.ones(BATCH, value.shape[axis], device=value.device, dtype=torch.long)
    return out


def fitted_audio(model: nn.Module, kwargs: dict[str, Any], params: Any) -> dict[str, Any]:
    """``kwargs`` with its audio input in the first layout the forward accepts on a meta twin of ``model``.

    The input built by :mod:`packedinit.trace.inputs` is tried first, then raw audio ``(2, samples)`` and
    ``(2, channels, samples)``, then features ``(2, frames, width)`` and ``(2, width, frames)`` for every
    width the config (and its audio sub-configs) names, stacked frames too; a ``<name>_mask`` parameter
    gets ones over the frames. A layout that reaches a value read (``.item()``) counts when none runs
    through. ``kwargs`` unchanged: no audio input, or no layout fits.

    Args:
        model: the transformers model (any device: the trial runs on a meta twin).
        kwargs: the inputs built so far.
        params: the forward's signature parameters.

    Returns:
        The inputs, the audio one fitted.
    """
    names = [n for n in AUDIO_INPUTS if isinstance(kwargs.get(n), Tensor)]
    config = getattr(model, "config", None)
    if not names or config is None:
        return kwargs
    name = names[-1]  # with raw audio beside features (a codec), the features are fitted to it
    raw = kwargs.get("input_values") if name != "input_values" else None
    built = _candidates(name, kwargs[name], model, config, raw)
    trials = [_with(kwargs, name, c, axis, params) for c, axis in built]
    return first_fitting(model, trials) or kwargs


def wanted_audio(config: Any, params: Any, names: list[str]) -> str | None:
    """The audio input a text-and-audio model needs beside its text (CLAP, CLVP), else ``None``.

    Args:
        config: the model's config.
        params: the forward's signature parameters.
        names: the inputs chosen so far.

    Returns:
        The name of the audio parameter to build, or ``None``.
    """
    tokens = any(hasattr(config, k) for k in ("audio_token_id", "audio_token_index", "audio_token"))
    towers = any(getattr(config, n, None) is not None for n in _SUBS[:3])
    if tokens or not towers or "input_ids" not in names or any(n in names for n in AUDIO_INPUTS):
        return None
    return next((n for n in AUDIO_INPUTS if n in params), None)


# -- inputs no builder knows: decision sequences, time series' side inputs, embeddings fed in ------------

_DECISIONS = {"states": ("state_dim",), "actions": ("act_dim", "action_dim"), "rewards": (), "returns_to_go": ()}
_LONGS = ("timesteps", "freq", "_ids")


def _series(value: Tensor, config: Any) -> Iterator[Tensor]:
    """A series as built, then ``(batch, length)``: up to 8 patches, no more than the context (TimesFM)."""
    yield value
    patch = int_of(config, "patch_length", "patch_len", "input_patch_len", default=1)
    length = patch * max(1, min(int_of(config, "context_length", default=32) // patch, 8))
    yield torch.zeros(BATCH, length, device=value.device, dtype=value.dtype)


def _side(name: str, series: Tensor | None, width: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """One input beside the main ones: a series' padding, an id or step count, or a ``(2, 5, width)`` tensor."""
    if series is not None and ("padding" in name or name.endswith("mask")):
        return torch.zeros(series.shape[:2], device=device, dtype=series.dtype)
    if name == "freq":
        return torch.zeros(BATCH, 1, device=device, dtype=torch.long)
    if name.endswith(_LONGS):
        return torch.zeros(BATCH, TOKENS, device=device, dtype=torch.long)
    return torch.zeros(BATCH, TOKENS, width, device=device, dtype=dtype)


def _other_widths(model: nn.Module, config: Any, name: str) -> list[int]:
    if name in _DECISIONS:  # a decision sequence: its own width, or one value a step
        return [int_of(config, *_DECISIONS[name], default=1)]
    if name.endswith(("padding", "mask", "freq")) or name.endswith(_LONGS):
        return [0]
    keys = ("hidden_size", "d_model", "d_latents", "n_embd")
    found = [int_of(config, k, default=0) for k in keys] + [int_of(config, k, default=0) for k in ("state_dim",)]
    found += [m.in_features for m in model.modules() if isinstance(m, nn.Linear)][:8]
    return [w for w in dict.fromkeys(found) if w > 0][:5]


def fitted_other(model: nn.Module, kwargs: dict[str, Any], missing: list[str], params: Any) -> dict[str, Any] | None:
    """``kwargs`` and the inputs in ``missing`` (no builder knows them), fitted on a meta twin; ``None``: none fits.

    A decision sequence (``states``, ``actions``, ``rewards``, ``returns_to_go``, ``timesteps``:
    Decision Transformer) is read from the config's ``state_dim`` and ``act_dim``; a series' padding
    and frequency (TimesFM) follow the series, which is tried as ``(2, length)`` too, the length a
    multiple of the config's patch; any other input is ``(2, 5, width)`` for the widths the config and
    the model's linear layers read, tried until the forward accepts them.

    Args:
        model: the transformers model.
        kwargs: the inputs built so far.
        missing: the inputs to build.
        params: the forward's signature parameters.

    Returns:
        The inputs with the missing ones, or ``None``.
    """
    config = getattr(model, "config", None)
    if config is None:
        return None
    if any(n in missing for n in _DECISIONS):
        missing = [*dict.fromkeys([*missing, *(n for n in (*_DECISIONS, "timesteps") if n in params)])]
    device, dtype = next(((p.device, p.dtype) for p in model.parameters() if p.is_floating_point()), (None, None))
    if device is None or dtype is None:
        return None
    main = getattr(model, "main_input_name", None)
    if main in AUDIO_INPUTS and len(missing) == 1:  # audio under another name (VibeVoice's hidden_states)
        seed = torch.zeros(BATCH, _SAMPLES, device=device, dtype=dtype)
        layouts = _candidates("input_values", seed, model, config)
        return first_fitting(model, [_with(kwargs, missing[0], c, axis, params) for c, axis in layouts])
    series = kwargs.get("past_values")
    bases = list(_series(series, config)) if isinstance(series, Tensor) else [None]
    trials: list[dict[str, Any]] = []
    for base in bases:
        for widths in itertools.islice(itertools.product(*(_other_widths(model, config, n) for n in missing)), 32):
            trial = dict(kwargs) if base is None else {**kwargs, "past_values": base}
            trial.update({n: _side(n, base, w, device, dtype) for n, w in zip(missing, widths, strict=True)})
            if "attention_mask" in params and any(n in _DECISIONS for n in missing):
                trial["attention_mask"] = torch.ones(BATCH, TOKENS, device=device, dtype=torch.long)
            trials.append(trial)
    return first_fitting(model, trials)

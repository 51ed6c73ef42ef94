"""example_inputs on audio, time-series and other models whose input layout the config does not spell out.

Each model is a real transformers model built tiny from its own config class (shrunk as the sweep does);
the inputs built must run its real forward, and the tracer must follow that forward.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from packedinit import infer_layouts
from packedinit.trace.inputs import example_inputs
from packedinit.trace.inputs_audio import fitted_audio

transformers = pytest.importorskip("transformers", reason="the models are transformers models")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sweep", ROOT / "docs" / "scripts" / "sweep.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny(sweep: ModuleType, model_type: str, class_name: str) -> nn.Module:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model: nn.Module = getattr(transformers, class_name)(sweep.shrink(CONFIG_MAPPING[model_type]()))
    return model.eval()


@pytest.mark.parametrize(
    ("model_type", "class_name", "inputs"),
    [
        ("qwen3_asr_encoder", "Qwen3ASREncoder", {"input_features", "input_features_mask"}),  # chunked frames
        ("decision_transformer", "DecisionTransformerModel",
         {"states", "actions", "rewards", "returns_to_go", "timesteps", "attention_mask"}),
        ("timesfm", "TimesFmModel", {"past_values", "past_values_padding", "freq"}),
        ("speecht5", "SpeechT5Model", {"input_values", "decoder_input_values"}),
        ("xmod", "XmodModel", {"input_ids", "lang_ids"}),  # no default language: one is given
        ("sam3_lite_text_text_model", "Sam3LiteTextTextModel", {"input_ids"}),  # main input not in its forward
    ],
    ids=["chunked features", "decisions", "series", "speech to speech", "language adapters", "text tower"],
)  # fmt: skip
def test_example_inputs_run_the_real_forward_and_trace(
    sweep: ModuleType, model_type: str, class_name: str, inputs: set[str]
) -> None:
    model = _tiny(sweep, model_type, class_name)
    built = example_inputs(model)
    assert built is not None
    args, kwargs = built
    assert set(kwargs) - {"use_cache"} == inputs
    with torch.no_grad():
        model(*args, **kwargs)  # the real forward accepts them
    assert infer_layouts(model, *args, **kwargs)


def test_raw_audio_gets_the_channel_dim_its_convolution_reads(sweep: ModuleType, ships: Callable[[str], bool]) -> None:
    if not ships("transformers.models.omniasr"):
        pytest.skip("this transformers has no OmniASR yet (checked on 5.24: tests/conftest.py)")
    model = _tiny(sweep, "omniasr_audio", "OmniASRAudioModel")
    built = example_inputs(model)
    assert built is not None
    audio = built[1]["input_values"]
    assert (audio.dim(), audio.shape[1]) == (3, 1)  # (batch, 1, samples): (batch, samples) reads as 2 channels
    with pytest.raises(RuntimeError, match="channels"):
        model(torch.zeros(2, audio.shape[-1]))


def test_a_width_no_config_field_names_is_read_from_the_first_layer(sweep: ModuleType) -> None:
    config = sweep.shallow(transformers.GraniteSpeech5EncoderConfig())  # its widths, one layer: its shapes agree
    with torch.device("meta"):
        model = transformers.GraniteSpeech5Encoder(config).eval()  # input_linear reads 4 x num_mel_bins
    built = example_inputs(model)
    assert built is not None
    assert built[1]["input_features"].shape[-1] == 4 * config.num_mel_bins
    assert infer_layouts(model, **built[1])


def test_a_text_and_audio_model_gets_both_inputs(sweep: ModuleType) -> None:
    config = sweep.shallow(transformers.ClapConfig())
    with torch.device("meta"):
        model = transformers.ClapModel(config).eval()
    built = example_inputs(model)
    assert built is not None
    features = built[1]["input_features"]  # a spectrogram image: (batch, 1, frames, mel bins)
    assert set(built[1]) == {"input_ids", "input_features"}
    assert (features.dim(), features.shape[1], features.shape[-1]) == (4, 1, config.audio_config.num_mel_bins)


def test_a_fitting_layout_is_kept_and_a_wrong_one_replaced(sweep: ModuleType) -> None:
    model = _tiny(sweep, "gemma4_audio", "Gemma4AudioModel")
    params: dict[str, Any] = {"input_features": None}
    mel = 128  # the feature extractor's width: the config names none, the first layer reads 32 channels x 128 / 4
    right = {"input_features": torch.zeros(2, 8, mel)}
    assert fitted_audio(model, right, params)["input_features"] is right["input_features"]  # the first runs: kept
    wrong = fitted_audio(model, {"input_features": torch.zeros(2, mel, 8)}, params)["input_features"]
    assert wrong.shape[-1] == mel
    with torch.no_grad():
        model(input_features=wrong)


def test_audio_fed_under_another_name_is_fitted(sweep: ModuleType) -> None:
    model = _tiny(sweep, "vibevoice_acoustic_tokenizer_decoder", "VibeVoiceAcousticTokenizerDecoderModel")
    built = example_inputs(model)  # its forward reads `hidden_states`, its main input is called input_values
    assert built is not None
    assert set(built[1]) - {"use_cache"} == {"hidden_states"}
    assert infer_layouts(model, **built[1])

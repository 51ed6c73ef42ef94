"""Loading never changes loaded values, also while ``packedinit.fix_torch_defaults()`` is on (issue 28).

Every load path: transformers' ``from_pretrained`` (default, ``low_cpu_mem_usage``, ``device_map``, a
checkpoint missing a key), ``load_state_dict`` with and without ``assign=True``, ``torch.load`` of a
whole module, safetensors, accelerate's ``init_empty_weights``; and the callers' own guards
(transformers' ``no_init_weights``) are respected, so the RNG is where it would be without the fix.
"""

from __future__ import annotations

import importlib.util
import io
import zlib
from pathlib import Path
from types import ModuleType

import accelerate
import pytest
import safetensors.torch
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from transformers.initialization import no_init_weights

import packedinit

E = 16


def perturb(model: nn.Module, seed: int = 0) -> dict[str, Tensor]:
    """Every parameter and float buffer filled with values no init gives; returns a copy of the state dict."""
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point():
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)
                t.copy_(torch.randn(t.shape, generator=g).mul_(0.5).add_(0.25))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(saved: dict[str, Tensor], model: nn.Module) -> list[str]:
    now = model.state_dict()
    return [k for k, v in saved.items() if k not in now or now[k].dtype != v.dtype or not torch.equal(now[k], v)]


def siglip_config() -> transformers.SiglipVisionConfig:
    return transformers.SiglipVisionConfig(
        hidden_size=E, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
    )


@pytest.fixture
def siglip_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, Tensor]]:
    """A tiny SigLIP vision model (its pooling head holds an nn.MultiheadAttention), perturbed and saved."""
    torch.manual_seed(0)
    model = transformers.SiglipVisionModel(siglip_config())
    saved = perturb(model)
    model.save_pretrained(tmp_path)
    return tmp_path, saved


class Torchy(nn.Module):
    """torch's packed modules together: MHA (with bias_k/v), an LSTM, an encoder layer."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, 2, add_bias_kv=True)
        self.lstm = nn.LSTM(E, E, num_layers=2, bidirectional=True)
        self.layer = nn.TransformerEncoderLayer(E, 2, dim_feedforward=8)
        self.bn = nn.BatchNorm1d(E)


@pytest.mark.parametrize(
    "kwargs", [{}, {"low_cpu_mem_usage": True}, {"device_map": "cpu"}], ids=["default", "low_cpu_mem", "device_map"]
)
def test_from_pretrained_under_the_fix_keeps_every_loaded_value(
    siglip_checkpoint: tuple[Path, dict[str, Tensor]], kwargs: dict[str, object]
) -> None:
    """Before: the pooling head's in_proj_weight re-drawn, in_proj_bias and out_proj.bias zeroed."""
    folder, saved = siglip_checkpoint
    with packedinit.fix_torch_defaults():
        model = transformers.SiglipVisionModel.from_pretrained(folder, **kwargs)
    assert changed(saved, model) == []


def test_from_pretrained_leaves_the_rng_where_it_is_without_the_fix(
    siglip_checkpoint: tuple[Path, dict[str, Tensor]],
) -> None:
    folder, _ = siglip_checkpoint
    torch.manual_seed(7)
    transformers.SiglipVisionModel.from_pretrained(folder)
    plain = torch.get_rng_state()
    torch.manual_seed(7)
    with packedinit.fix_torch_defaults():
        transformers.SiglipVisionModel.from_pretrained(folder)
    assert torch.equal(torch.get_rng_state(), plain)


def test_a_missing_key_is_initialised_per_block_and_the_loaded_ones_stay(
    siglip_checkpoint: tuple[Path, dict[str, Tensor]],
) -> None:
    folder, saved = siglip_checkpoint
    file = folder / "model.safetensors"
    tensors = safetensors.torch.load_file(file)
    del tensors["head.attention.in_proj_weight"]
    safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})
    with packedinit.fix_torch_defaults():
        model = transformers.SiglipVisionModel.from_pretrained(folder)
    assert changed(saved, model) == ["head.attention.in_proj_weight"]
    w = model.head.attention.in_proj_weight.detach()
    assert (6 / (4 * E)) ** 0.5 < float(w.abs().max()) <= (6 / (2 * E)) ** 0.5  # xavier per q/k/v block


def test_construction_under_no_init_weights_draws_nothing_under_the_fix() -> None:
    """transformers' ``no_init_weights`` makes torch's init calls no-ops; the fix's MHA method honours it."""
    torch.manual_seed(3)
    before = torch.get_rng_state()
    with packedinit.fix_torch_defaults(), no_init_weights():
        nn.MultiheadAttention(E, 2)
        nn.Transformer(E, 2, 1, 1, dim_feedforward=8, batch_first=True)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_under_the_fix(assign: bool) -> None:
    saved = perturb(Torchy())
    with packedinit.fix_torch_defaults():
        model = Torchy()
        model.load_state_dict(saved, assign=assign)
    assert changed(saved, model) == []


def test_torch_load_of_a_whole_module_under_the_fix() -> None:
    source = Torchy()
    saved = perturb(source)
    buffer = io.BytesIO()
    torch.save(source, buffer)
    buffer.seek(0)
    with packedinit.fix_torch_defaults():
        model = torch.load(buffer, weights_only=False)
    assert changed(saved, model) == []


def test_safetensors_load_model_under_the_fix(tmp_path: Path) -> None:
    source = Torchy()
    saved = perturb(source)
    safetensors.torch.save_model(source, str(tmp_path / "m.safetensors"))
    with packedinit.fix_torch_defaults():
        model = Torchy()
        safetensors.torch.load_model(model, str(tmp_path / "m.safetensors"))
    assert changed(saved, model) == []


def test_accelerate_empty_weights_then_checkpoint_under_the_fix(tmp_path: Path) -> None:
    source = Torchy()
    saved = perturb(source)
    torch.save(source.state_dict(), tmp_path / "sd.bin")
    with packedinit.fix_torch_defaults():
        with accelerate.init_empty_weights():
            model = Torchy()
        assert model.mha.in_proj_weight.is_meta
        accelerate.load_checkpoint_and_dispatch(model, str(tmp_path / "sd.bin"), device_map={"": "cpu"})
    assert changed(saved, model) == []


@settings(max_examples=8)
@given(
    hidden=st.sampled_from([8, 16, 24]),
    heads=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
    low_cpu=st.booleans(),
)
def test_property_siglip_round_trips_bit_for_bit_under_the_fix(
    tmp_path_factory: pytest.TempPathFactory, hidden: int, heads: int, seed: int, low_cpu: bool
) -> None:
    folder = tmp_path_factory.mktemp("siglip")
    cfg = transformers.SiglipVisionConfig(
        hidden_size=hidden, intermediate_size=16, num_hidden_layers=1, num_attention_heads=heads,
        image_size=8, patch_size=4,
    )  # fmt: skip
    with packedinit.fix_torch_defaults():  # built under the fix too, as its docs recommend
        source = transformers.SiglipVisionModel(cfg)
    saved = perturb(source, seed)
    source.save_pretrained(folder)
    with packedinit.fix_torch_defaults():
        model = transformers.SiglipVisionModel.from_pretrained(folder, low_cpu_mem_usage=low_cpu)
    assert changed(saved, model) == []


@settings(max_examples=20)
@given(
    heads=st.sampled_from([1, 2, 4]),
    bias=st.booleans(),
    bias_kv=st.booleans(),
    kdim=st.sampled_from([None, 8]),
    layers=st.integers(1, 2),
    bidirectional=st.booleans(),
    assign=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_torch_modules_round_trip_under_the_fix(
    heads: int, bias: bool, bias_kv: bool, kdim: int | None, layers: int, bidirectional: bool, assign: bool, seed: int
) -> None:
    def build() -> nn.Module:
        return nn.ModuleDict(
            {
                "mha": nn.MultiheadAttention(E, heads, bias=bias, add_bias_kv=bias_kv, kdim=kdim, vdim=kdim),
                "lstm": nn.LSTM(E, 8, num_layers=layers, bidirectional=bidirectional),
                "gru": nn.GRUCell(E, 8),
            }
        )

    saved = perturb(build(), seed)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    with packedinit.fix_torch_defaults():
        model = build()
        model.load_state_dict(torch.load(buffer), assign=assign)
    assert changed(saved, model) == []


@pytest.fixture(scope="module")
def roundtrip_sweep() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "docs" / "scripts" / "roundtrip_sweep.py"
    spec = importlib.util.spec_from_file_location("roundtrip_sweep", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model_type", ["siglip", "aria", "gpt2", "mixtral", "encodec"])
def test_fast_subset_of_the_roundtrip_sweep(roundtrip_sweep: ModuleType, model_type: str) -> None:
    """docs/scripts/roundtrip_sweep.py on models with an nn.MultiheadAttention (SigLIP's pooling head, Aria's
    projector), GPT-2's Conv1D, stacked experts (Mixtral), LSTMs and convolutions (Encodec)."""
    (name,) = [n for t, n in roundtrip_sweep.sweep.models([model_type])]
    row = roundtrip_sweep.check(model_type, name)
    assert row["built"], row
    assert row["saved"] > 0, row
    assert row["identical"], row
    assert row["same_rng"], row


def test_the_roundtrip_page_counts_what_changed(roundtrip_sweep: ModuleType) -> None:
    rows = [
        {"model_type": "a", "class": "A", "built": True, "saved": 3, "identical": True, "same_rng": True,
         "seconds": 1.0},
        {"model_type": "b", "class": "B", "built": True, "saved": 3, "identical": False, "differ": ["w"],
         "differ_without_fix": [], "by_fix": ["w"], "same_rng": False, "seconds": 1.0},
        {"model_type": "d", "class": "D", "built": True, "error": "KeyError: x", "stage": "load under the fix",
         "seconds": 1.0},
        {"model_type": "c", "class": "C", "built": False, "error": "ValueError: no", "seconds": 1.0},
    ]  # fmt: skip
    text = roundtrip_sweep.page(rows, 60.0)
    assert "| 4 | 3 | 2 | 1 | 1 | 0 | 1 | 0 | 1 |" in text
    assert "| b | w |" in text
    assert "| d | load under the fix: KeyError: x |" in text

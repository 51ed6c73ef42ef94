"""Per block, whoever calls (issue 17 items 1-2): torch.nn.init calls on known packed Parameters while the fix is on."""

from __future__ import annotations

import gc
import math
import threading
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
import transformers
import transformers.initialization as hf_init
from torch import Tensor, nn
from torch.nn.init import xavier_uniform_ as bound_before  # bound at import: the documented limit

import packedinit
from packedinit import Layout, audit, chunked_init, fix_torch_defaults, layouts, reset_parameters
from packedinit.recipes.init_calls import FAN_FNS, intercepting, packed_layout
from packedinit.recipes.torch_defaults import torch_defaults_fixed

TORCH = {name: getattr(torch.nn.init, name) for name in FAN_FNS}
HF_TABLE = dict(hf_init.TORCH_INIT_FUNCTIONS)


@pytest.fixture(autouse=True)
def _torch_functions_in_place() -> Iterator[None]:
    assert not torch_defaults_fixed()
    assert not intercepting()
    yield
    leaked = [n for n, f in TORCH.items() if getattr(torch.nn.init, n) is not f]
    leaked += [n for n, f in HF_TABLE.items() if hf_init.TORCH_INIT_FUNCTIONS[n] is not f]
    for n, f in TORCH.items():
        setattr(torch.nn.init, n, f)
    hf_init.TORCH_INIT_FUNCTIONS.update(HF_TABLE)
    assert not leaked, leaked
    assert not intercepting()


# -- tiny real models ---------------------------------------------------------------------------------
def siglip() -> nn.Module:
    cfg = transformers.SiglipVisionConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, image_size=8, patch_size=4,
        vision_use_head=True,
    )  # fmt: skip
    return transformers.SiglipVisionModel(cfg)


def siglip2() -> nn.Module:
    cfg = transformers.Siglip2VisionConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, patch_size=4, num_patches=4,
        vision_use_head=True,
    )  # fmt: skip
    return transformers.Siglip2VisionModel(cfg)


def encodec() -> nn.Module:
    cfg = transformers.EncodecConfig(
        num_filters=4, hidden_size=16, codebook_size=8, num_lstm_layers=1, upsampling_ratios=[2, 2],
        target_bandwidths=[1.5], codebook_dim=16,
    )  # fmt: skip
    return transformers.EncodecModel(cfg)


def mask2former() -> nn.Module:
    backbone = transformers.SwinConfig(
        embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], image_size=32,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )  # fmt: skip
    cfg = transformers.Mask2FormerConfig(
        backbone_config=backbone, hidden_dim=32, mask_feature_size=32, feature_size=32, encoder_layers=1,
        decoder_layers=2, num_queries=4, encoder_feedforward_dim=32, dim_feedforward=32, num_attention_heads=2,
    )  # fmt: skip
    return transformers.Mask2FormerForUniversalSegmentation(cfg)


MODELS = {"siglip": siglip, "siglip2": siglip2, "encodec": encodec, "mask2former": mask2former}


def build(make: Callable[[], nn.Module], seed: int, *, fixed: bool) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(seed)
    if fixed:
        with fix_torch_defaults():
            m = make()
    else:
        m = make()
    return m, torch.get_rng_state()


def per_block_xavier(p: Tensor, layout: Layout, gain: float = 1.0) -> bool:
    """Every block within its own xavier bound, and some value beyond the packed tensor's bound."""
    packed = gain * math.sqrt(6 / (p.shape[0] + p.shape[1]))
    views = [layout.logical_view(p.detach(), b) for b in layout.blocks(p.shape)]
    return (
        all(v is not None and float(v.abs().max()) <= gain * math.sqrt(6 / sum(v.shape)) for v in views)
        and float(p.detach().abs().max()) > packed
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_models_whose_own_init_packs_are_per_block_when_built_under_the_fix(name: str) -> None:
    """SigLIP/SigLIP2 heads and Mask2Former: xavier on MHA's in_proj_weight; Encodec: xavier on LSTM gates."""
    plain, rng_plain = build(MODELS[name], 0, fixed=False)
    fixed, rng_fixed = build(MODELS[name], 0, fixed=True)
    packed = {n: lay for n, lay in layouts(fixed).items() if fixed.get_parameter(n).dim() > 1}
    assert packed
    assert audit(plain).affected
    assert audit(fixed).affected == ()
    gain = fixed.config.init_xavier_std if name == "mask2former" else 1.0
    pp, fp = dict(plain.named_parameters()), dict(fixed.named_parameters())
    for n in pp:
        if n in packed and not torch.equal(pp[n], fp[n]):
            assert per_block_xavier(fp[n], packed[n], gain), n
        else:
            assert torch.equal(pp[n], fp[n]), n  # bit-identical to the normal build from the same seed
    assert sum(not torch.equal(pp[n], fp[n]) for n in packed) >= 1
    assert torch.equal(rng_plain, rng_fixed)  # the same draws in the same order


@pytest.mark.parametrize("name", ["siglip", "mask2former"])
def test_reset_parameters_runs_the_models_own_init_per_block(name: str) -> None:
    """Item 2: the printed fix reset_parameters(model) now fixes what the model's own _init_weights packs."""
    model, _ = build(MODELS[name], 1, fixed=False)
    before = audit(model)
    assert before.affected
    reset_parameters(model)
    assert audit(model).affected == ()
    target, _ = build(MODELS[name], 1, fixed=True)  # the model's own init, packed blocks per block
    for (n, p), q in zip(model.named_parameters(), target.parameters(), strict=True):
        if n in before.affected:
            assert per_block_xavier(p, layouts(model)[n]), n
        elif "position" not in n:  # std of everything else is the model's own init's
            assert (
                abs(float(p.detach().float().std()) - float(q.detach().float().std()))
                <= 0.35 * float(q.detach().float().std()) + 1e-6
            ), n


# -- which calls are covered ----------------------------------------------------------------------------
def mha() -> nn.MultiheadAttention:
    return nn.MultiheadAttention(32, 4)


CALL_PATHS: dict[str, Callable[[Tensor], object]] = {
    "torch.nn.init": lambda p: torch.nn.init.xavier_uniform_(p),
    "from torch.nn import init": lambda p: nn.init.xavier_uniform_(p),
    "transformers.initialization": lambda p: hf_init.xavier_uniform_(p),
    "torch.nn.modules.activation global": lambda p: torch.nn.modules.activation.xavier_uniform_(p),  # type: ignore[attr-defined]  # torch's module global
}


@pytest.mark.parametrize("path", list(CALL_PATHS))
def test_every_covered_call_path_runs_per_block_and_equals_chunked_init(path: str) -> None:
    with fix_torch_defaults():
        m = mha()
        p = m.in_proj_weight
        expected = p.detach().clone()
        torch.manual_seed(3)
        chunked_init(expected, Layout(0, [32, 32, 32]), None, TORCH["xavier_uniform_"])
        torch.manual_seed(3)
        CALL_PATHS[path](p)
    assert torch.equal(p.detach(), expected)


def test_a_function_bound_before_the_fix_is_not_reached() -> None:
    """The documented limit: ``from torch.nn.init import xavier_uniform_`` in a module packedinit does not know."""
    with fix_torch_defaults():
        m = mha()
        bound_before(m.in_proj_weight)
    assert float(m.in_proj_weight.detach().abs().max()) <= math.sqrt(6 / (4 * 32))


@pytest.mark.parametrize("fn", FAN_FNS)
def test_each_fan_function_runs_per_block_on_known_packed_parameters(fn: str) -> None:
    args: tuple[object, ...] = (0.5,) if fn == "sparse_" else (0, "fan_out") if fn.startswith("kaiming") else ()
    with fix_torch_defaults():
        lstm = nn.LSTM(4, 6) if fn != "dirac_" else None
        conv = packedinit.annotate(nn.Conv1d(4, 6, 3), weight=Layout(0, [3, 3])) if fn == "dirac_" else None
        p = lstm.weight_hh_l0 if lstm is not None else conv.weight  # type: ignore[union-attr]  # one of the two
        layout = packed_layout(p)
        assert layout is not None
        expected = p.detach().clone()
        torch.manual_seed(5)
        chunked_init(expected, layout[1], None, TORCH[fn], *args)
        torch.manual_seed(5)
        out = getattr(torch.nn.init, fn)(p, *args)
    assert out is p
    assert torch.equal(p.detach(), expected), fn
    torch.manual_seed(5)
    whole = TORCH[fn](p.detach().clone(), *args)
    assert not torch.equal(whole, expected)  # per block is not what torch does on the packed tensor


@pytest.mark.parametrize("fn", FAN_FNS)
def test_every_other_call_is_torchs_bit_for_bit(fn: str) -> None:
    args = (0.5,) if fn == "sparse_" else ()
    shape = (6, 4, 3) if fn == "dirac_" else (12, 4)
    with fix_torch_defaults():
        lin = nn.Linear(4, 12)
        lstm = nn.LSTM(4, 3)
        targets = [
            nn.Parameter(torch.empty(shape)),  # a bare Parameter nobody knows
            lstm.weight_ih_l0.data
            if fn != "dirac_"
            else packedinit.annotate(
                nn.Conv1d(4, 6, 3), weight=Layout(0, [3, 3])
            ).weight.data,  # a plain tensor (.data of a packed one): not the Parameter
        ]
        if fn != "dirac_":
            targets.append(lin.weight)  # an unpacked module's Parameter
        for t in targets:
            a = t.detach().clone()
            torch.manual_seed(7)
            getattr(torch.nn.init, fn)(t, *args)
            torch.manual_seed(7)
            TORCH[fn](a, *args)
            assert torch.equal(t.detach(), a)


def test_a_model_built_before_the_fix_is_covered_when_handed_to_it() -> None:
    m = mha()  # built outside the fix: not known
    with fix_torch_defaults():
        torch.nn.init.xavier_uniform_(m.in_proj_weight)
    assert float(m.in_proj_weight.detach().abs().max()) <= math.sqrt(6 / (4 * 32))
    with fix_torch_defaults(m):
        torch.nn.init.xavier_uniform_(m.in_proj_weight)
    assert per_block_xavier(m.in_proj_weight, Layout(0, [32] * 3))
    torch.nn.init.xavier_uniform_(m.in_proj_weight)  # off again: torch's whole-tensor call
    assert float(m.in_proj_weight.detach().abs().max()) <= math.sqrt(6 / (4 * 32))


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)


def test_registered_adapters_annotations_and_chunked_with_the_wrapper() -> None:
    packedinit.register(Fused)(lambda m: {"qkv.weight": Layout(0, [16, 16, 16])})
    try:
        with fix_torch_defaults():
            f = Fused()  # the adapter describes a child's parameter: registered with the child
            torch.nn.init.xavier_uniform_(f.qkv.weight)
            lin = packedinit.annotate(nn.Linear(16, 48), weight=Layout(0, [16, 16, 16]))
            torch.nn.init.xavier_uniform_(lin.weight)
            w = torch.empty(48, 16)
            torch.manual_seed(0)
            chunked_init(w, 3, 0, torch.nn.init.xavier_uniform_)  # the wrapper handed to packedinit itself
        torch.manual_seed(0)
        v = chunked_init(torch.empty(48, 16), 3, 0, TORCH["xavier_uniform_"])
    finally:
        packedinit.unregister(Fused)
    assert per_block_xavier(f.qkv.weight, Layout(0, [16] * 3))
    assert per_block_xavier(lin.weight, Layout(0, [16] * 3))
    assert torch.equal(w, v)


# -- reversible, counted, thread-safe, keeps nothing alive --------------------------------------------
def test_undo_restores_torchs_and_transformers_functions() -> None:
    fix = fix_torch_defaults()
    inner = fix_torch_defaults()
    assert torch.nn.init.xavier_uniform_ is not TORCH["xavier_uniform_"]
    assert hf_init.TORCH_INIT_FUNCTIONS["orthogonal_"] is not TORCH["orthogonal_"]
    assert torch.nn.init.uniform_ is hf_init.TORCH_INIT_FUNCTIONS["uniform_"]  # only fan-dependent ones
    fix.undo()
    assert intercepting()
    inner.undo()
    assert all(getattr(torch.nn.init, n) is f for n, f in TORCH.items())
    assert all(hf_init.TORCH_INIT_FUNCTIONS[n] is f for n, f in HF_TABLE.items())
    assert torch.nn.modules.activation.xavier_uniform_ is TORCH["xavier_uniform_"]  # type: ignore[attr-defined]  # torch's global


def test_threads_taking_and_giving_back_the_fix_leave_torch_as_it_was() -> None:
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(20):
                with fix_torch_defaults():
                    m = nn.LSTM(4, 8)
                    torch.nn.init.orthogonal_(m.weight_hh_l0)
                    blocks = m.weight_hh_l0.detach().view(4, 8, 8)
                    for b in blocks:
                        assert torch.allclose(b @ b.T, torch.eye(8), atol=1e-5)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_construction_in_other_threads_survives_the_fix_turning_on_and_off() -> None:
    errors: list[BaseException] = []
    stop = threading.Event()

    def build() -> None:
        try:
            while not stop.is_set():
                nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 4))
        except BaseException as e:  # reported below
            errors.append(e)

    def toggle() -> None:
        try:
            for _ in range(50):
                with fix_torch_defaults():
                    nn.MultiheadAttention(8, 2)
        except BaseException as e:  # reported below
            errors.append(e)

    builders = [threading.Thread(target=build) for _ in range(2)]
    togglers = [threading.Thread(target=toggle) for _ in range(2)]
    for t in (*builders, *togglers):
        t.start()
    for t in togglers:
        t.join()
    stop.set()
    for t in builders:
        t.join()
    assert errors == []


def test_nothing_built_under_the_fix_is_kept_alive() -> None:
    with fix_torch_defaults():
        m = nn.LSTM(4, 8)
        ref, pref = weakref.ref(m), weakref.ref(m.weight_ih_l0)
        del m
        gc.collect()
        assert ref() is None
        assert pref() is None
    m2 = mha()
    with fix_torch_defaults(m2):
        r2 = weakref.ref(m2.in_proj_weight)
    del m2
    gc.collect()
    assert r2() is None

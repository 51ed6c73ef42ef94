"""Whole-model init: chunked(f)(model), model.apply(chunked(f)), init_model."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.init import dirac_, eye_, orthogonal_, xavier_uniform_

from packedinit import Layout, PackedInitError, annotate, chunked, layouts, register, unregister
from packedinit.model.walk import init_model

E = 4


class FusedBlock(nn.Module):
    """The packed parameter lives in a child Linear; only the parent's adapter knows it."""

    def __init__(self, d: int = E) -> None:
        super().__init__()
        self.d = d
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)


def fused_block_layouts(m: FusedBlock) -> dict[str, Layout]:
    return {"qkv.weight": Layout(0, [m.d] * 3, names=("q", "k", "v"))}


@pytest.fixture(autouse=True)
def fused() -> Iterator[None]:
    register(FusedBlock)(fused_block_layouts)
    yield
    unregister(FusedBlock)


class Recorder:
    """An init fn that adds 1 (so double writes show) and records the shapes it is handed."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, t: Tensor) -> Tensor:
        if not t.is_meta:  # the engine dry-runs functions on meta tensors before writing
            self.shapes.append(tuple(t.shape))
        with torch.no_grad():
            return t.add_(1.0)


def zeroed(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(3, 5),
        nn.Sequential(FusedBlock(), nn.MultiheadAttention(E, 2)),
        nn.LSTM(E, 2, bidirectional=True),
        nn.LayerNorm(E),
        nn.Conv1d(2, 3, 3),
    )


def expected_shapes(model: nn.Module) -> list[tuple[int, ...]]:
    lay = layouts(model)
    out: list[tuple[int, ...]] = []
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            out += [tuple(b.shape) for b in lay[name].blocks(p.shape)] if name in lay else [tuple(p.shape)]
    return out


def test_whole_model_every_matrix_once_packed_per_block_in_named_parameters_order() -> None:
    model = zeroed(make_model())
    rec = Recorder()
    chunked(rec)(model)
    assert rec.shapes == expected_shapes(model)
    assert (3 * E, E) not in rec.shapes
    assert (8, E) not in rec.shapes
    for name, p in model.named_parameters():
        assert torch.equal(p, torch.full_like(p, 1.0 if p.dim() >= 2 else 0.0)), name


def test_apply_initialises_every_matrix_exactly_once_per_block() -> None:
    model = zeroed(make_model())
    rec = Recorder()
    assert model.apply(chunked(rec)) is model
    assert sorted(rec.shapes) == sorted(expected_shapes(model))
    for name, p in model.named_parameters():
        assert torch.equal(p, torch.full_like(p, 1.0 if p.dim() >= 2 else 0.0)), name


def test_apply_sees_an_ancestor_adapter_and_annotate_stamps_it_for_other_callers() -> None:
    block = FusedBlock(16)
    model = nn.Sequential(nn.Sequential(block))
    model.apply(chunked(xavier_uniform_))
    w = block.qkv.weight
    for blk in w.chunk(3):
        assert blk.abs().max() > math.sqrt(6 / 64)  # per-block bound sqrt(6/32), not the packed sqrt(6/64)
    # called on the child alone, nobody tells it about the parent's adapter ...
    rec = Recorder()
    chunked(rec)(block.qkv)
    assert rec.shapes == [(48, 16)]
    # ... until annotate(model) stamps what the adapters know onto the owning modules
    annotate(model)
    rec = Recorder()
    chunked(rec)(block.qkv)
    assert rec.shapes == [(16, 16)] * 3


def test_tied_parameters_are_initialised_once() -> None:
    emb = nn.Embedding(10, E)
    head = nn.Linear(E, 10, bias=False)
    head.weight = emb.weight
    model = zeroed(nn.Sequential(emb, nn.Linear(E, E), head))
    rec = Recorder()
    chunked(rec)(model)
    assert rec.shapes == [(10, E), (E, E)]
    assert torch.equal(emb.weight, torch.ones(10, E))


def test_generator_makes_it_reproducible_and_leaves_global_rng_alone() -> None:
    a, b = make_model(), make_model()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    chunked(xavier_uniform_)(a, generator=torch.Generator().manual_seed(3))
    init_model(b, xavier_uniform_, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.get_rng_state(), before)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        if p.dim() >= 2:
            assert torch.equal(p, q), name


def test_arguments_are_forwarded() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2))
    chunked(xavier_uniform_)(model, gain=0.0)
    assert all(p.abs().sum() == 0 for p in model.parameters() if p.dim() >= 2)


def test_chunks_with_a_module_is_an_error() -> None:
    model = nn.Linear(4, 12)
    w = model.weight.detach().clone()
    with pytest.raises(PackedInitError, match=r"chunks/dim describe one tensor.*packedinit.annotate"):
        chunked(xavier_uniform_, 3)(model)
    assert torch.equal(model.weight, w)


def test_rejection_anywhere_writes_nothing_anywhere() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Conv1d(2, 2, 3))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PackedInitError, match=r"parameter '1.weight' of shape \(2, 2, 3\).*eye_ rejected"):
        chunked(eye_)(model)
    mha = nn.Sequential(nn.Conv1d(2, 2, 3), nn.MultiheadAttention(4, 2))  # dirac_ accepts the conv
    before += [p.detach().clone() for p in mha.parameters()]
    with pytest.raises(PackedInitError, match=r"parameter '1.in_proj_weight' of shape \(12, 4\).*dirac_ rejected"):
        chunked(dirac_)(mha)
    after = [*model.parameters(), *mha.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_meta_model_validates_then_initialises_after_to_empty() -> None:
    with torch.device("meta"):
        model = nn.TransformerEncoderLayer(16, 2, dim_feedforward=8)
    chunked(xavier_uniform_)(model)  # validation only: nothing to write on meta
    with pytest.raises(PackedInitError, match=r"in_proj_weight"):
        chunked(dirac_)(model)
    model.to_empty(device="cpu")
    chunked(xavier_uniform_)(model, generator=torch.Generator().manual_seed(0))
    for blk in model.self_attn.in_proj_weight.chunk(3):
        assert math.sqrt(6 / 64) < blk.abs().max() <= math.sqrt(6 / 32)


def test_low_precision_orthogonal_per_gate() -> None:
    lstm = nn.LSTM(4, 8, dtype=torch.bfloat16)
    chunked(orthogonal_)(lstm)
    for blk in lstm.get_parameter("weight_hh_l0").float().chunk(4):
        torch.testing.assert_close(blk @ blk.T, torch.eye(8), atol=3e-2, rtol=0)


def test_out_of_place_init_fn_is_copied_back() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.MultiheadAttention(4, 2))
    chunked(lambda t: torch.full_like(t, 2.0))(model)
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in model.parameters() if p.dim() >= 2)


def test_init_model_bad_input() -> None:
    with pytest.raises(PackedInitError, match=r"needs an nn.Module, got Tensor"):
        init_model(torch.zeros(2, 2), xavier_uniform_)  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(PackedInitError, match=r"init_fn must be callable, got int"):
        init_model(nn.Linear(2, 2), 3)  # type: ignore[arg-type]  # wrong on purpose


KINDS: dict[str, Callable[[], nn.Module]] = {
    "linear": lambda: nn.Linear(3, 5),
    "mha": lambda: nn.MultiheadAttention(E, 2),
    "mha_kdim": lambda: nn.MultiheadAttention(E, 2, kdim=3, vdim=2),
    "lstm": lambda: nn.LSTM(3, 2, num_layers=2, bidirectional=True, proj_size=1),
    "gru_cell": lambda: nn.GRUCell(3, 2),
    "fused": lambda: FusedBlock(),
    "encoder": lambda: nn.TransformerEncoderLayer(E, 2, dim_feedforward=8),
}


@given(st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=4), st.booleans())
def test_tree_and_apply_agree_on_what_is_initialised(kinds: list[str], nest: bool) -> None:
    parts = [KINDS[k]() for k in kinds]
    model = nn.Sequential(nn.Sequential(nn.Sequential(*parts)) if nest else nn.Sequential(*parts), nn.Linear(2, 2))
    expected = expected_shapes(model)
    tree, applied = Recorder(), Recorder()
    chunked(tree)(zeroed(model))
    assert tree.shapes == expected
    model.apply(chunked(applied))
    assert sorted(applied.shapes) == sorted(expected)
    for p in model.parameters():
        assert torch.equal(p, torch.full_like(p, 2.0 if p.dim() >= 2 else 0.0))


def test_apply_on_a_real_transformers_model_uses_ancestor_adapters() -> None:
    """GPT-2's packed c_attn and transposed c_fc are described by their parent's adapter (by class path)."""
    from transformers import GPT2Config, GPT2Model

    e = 32
    cfg = GPT2Config(n_embd=e, n_layer=2, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    applied, direct = GPT2Model(cfg), GPT2Model(cfg)
    applied.apply(chunked(torch.nn.init.kaiming_uniform_))
    chunked(torch.nn.init.kaiming_uniform_)(direct)
    for model in (applied, direct):
        for block in model.h:
            for name in ("attn.c_attn.weight", "mlp.c_fc.weight"):
                w = block.get_parameter(name)  # Conv1D stores (in, out): fan_in is the stored dim 0 = e
                bound = math.sqrt(6 / e)  # kaiming_uniform_(a=0): sqrt(6 / fan_in); stored dim 1 would give less
                assert bound * 0.9 < w.abs().max() <= bound, name

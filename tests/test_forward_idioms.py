"""Issue 26: the whole-model idioms read layouts from the forward, and name what they cannot describe."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn
from torch.nn import init

import packedinit
from packedinit import Layout


class Gqa(nn.Module):  # an unregistered fused GQA projection: [q: 8 | k: 4 | v: 4], split in the forward
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 16)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).split([8, 4, 4], dim=-1)
        return self.proj(q * (k * v).sum(-1, keepdim=True))


class Fused(nn.Module):  # a fused qkv no trace reaches (no inputs can be built for it)
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"qkv": nn.Linear(16, 48), "fc": nn.Linear(16, 16)}) for _ in range(2)
        )
        self.experts = nn.Parameter(torch.empty(4, 32, 16))


def _bound(rows: int, cols: int) -> float:
    return (6 / (rows + cols)) ** 0.5


def test_annotate_with_inputs_records_the_forward_and_the_idioms_use_it() -> None:
    model = Gqa()
    assert packedinit.annotate(model, torch.randn(2, 3, 8)) is model
    assert packedinit.layouts(model)["qkv.weight"] == Layout(0, [8, 4, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packedinit.chunked(init.xavier_uniform_)(model)
    w = model.qkv.weight.detach()
    assert float(w[:8].abs().max()) > _bound(16, 8)  # the q block's own bound, above the packed one
    assert float(w[8:12].abs().max()) <= _bound(4, 8)


def test_annotate_refuses_inputs_mixed_with_layouts() -> None:
    with pytest.raises(packedinit.PackedInitError, match=r"example inputs and Layouts \(\['qkv'\]\) in one call"):
        packedinit.annotate(Gqa(), torch.randn(2, 3, 8), qkv=Layout(0, [8, 8]))


@pytest.mark.parametrize("idiom", ["chunked", "apply", "init_model"])
def test_what_looks_packed_is_named_with_a_line_that_fixes_it(idiom: str) -> None:
    model = Fused()
    run = {
        "chunked": lambda: packedinit.chunked(init.xavier_uniform_)(model),
        "apply": lambda: model.apply(packedinit.chunked(init.xavier_uniform_)),
        "init_model": lambda: packedinit.init_model(model, init.xavier_uniform_),
    }[idiom]
    with pytest.warns(packedinit.LayoutWarning, match=r"'blocks\.0\.qkv\.weight' \(48, 16\)") as got:
        run()
    message = str(got[0].message)
    assert "'blocks.1.qkv.weight'" in message
    assert "'experts' (4, 32, 16) (a stack of 4 matrices" in message
    line = message.split("Fix (check the sizes against the forward): ", 1)[1].split("; or trace the forward", 1)[0]
    exec(line, {"packedinit": packedinit, "model": model})  # the printed line, run
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fixed: no more warning
        run()
    for b in model.blocks:
        w = b["qkv"].weight.detach()
        for j in range(3):
            block = w[16 * j : 16 * (j + 1)]
            assert 0.85 * _bound(16, 16) < float(block.abs().max()) <= _bound(16, 16)
    assert 0.85 * _bound(32, 16) < float(model.experts.detach()[0].abs().max()) <= _bound(32, 16)


def test_fan_free_functions_and_filtered_out_weights_are_not_named() -> None:
    model = Fused()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packedinit.chunked(init.zeros_)(model)
        packedinit.init_model(model, init.xavier_uniform_, params="*.fc.*")


def test_strict_mode_raises_before_any_write() -> None:
    model = Fused()
    before = model.blocks[0]["qkv"].weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", packedinit.LayoutWarning)
        with pytest.raises(packedinit.LayoutWarning, match=r"look packed"):
            packedinit.chunked(init.xavier_uniform_)(model)
    assert torch.equal(model.blocks[0]["qkv"].weight.detach(), before)


class TwoHalves(nn.Module):  # its forward splits qkv [8 | 4 | 4]; the adapter below says [8 | 8]
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 16)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).split([8, 4, 4], dim=-1)
        return q.sum() + (k * v).sum()


def test_an_adapter_the_forward_contradicts_is_named_and_kept() -> None:
    packedinit.register(TwoHalves)(lambda m: {"qkv.weight": Layout(0, [8, 8])})
    try:
        model = TwoHalves()
        with pytest.warns(packedinit.LayoutWarning, match=r"disagree on 'qkv\.weight': the adapter says .*\(8, 8\)"):
            packedinit.annotate(model, torch.randn(2, 8))
        with pytest.warns(packedinit.LayoutWarning, match=r"'qkv\.weight' \(16, 8\): the adapter says .*\(8, 8\).* the "
                          r"forward shows Layout\(dim=0, sizes=\(8, 4, 4\)\)"):  # fmt: skip
            packedinit.chunked(init.xavier_uniform_)(model)  # the kept trace: no second forward
        assert packedinit.layouts(model)["qkv.weight"] == Layout(0, [8, 8])  # the adapter stays
        with warnings.catch_warnings():
            warnings.simplefilter("error", packedinit.LayoutWarning)  # strict mode: raised, nothing written
            before = model.qkv.weight.detach().clone()
            with pytest.raises(packedinit.LayoutWarning, match="disagree"):
                packedinit.init_model(model, init.xavier_uniform_)
            assert torch.equal(model.qkv.weight.detach(), before)
    finally:
        packedinit.unregister(TwoHalves)


def test_a_second_model_of_the_same_transformers_config_is_not_traced_again() -> None:
    transformers = pytest.importorskip("transformers", reason="a config to build the inputs from")
    from packedinit.model import found
    from packedinit.trace import auto

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    first, second = transformers.GPT2LMHeadModel(cfg), transformers.GPT2LMHeadModel(cfg)
    packedinit.chunked(init.xavier_uniform_)(first)
    kept = found.findings(first)
    assert kept is not None
    assert kept["transformer.h.0.attn.c_attn.weight"].layout == Layout(1, [16, 16, 16], transposed=True)
    before = len(auto._BY_ARCHITECTURE)
    assert found.findings(second) == kept  # from the architecture's entry
    assert len(auto._BY_ARCHITECTURE) == before
    auto.forget(second)
    assert found.findings(second) == kept  # traced again: the same

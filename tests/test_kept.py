"""Decisions kept for the next equal call (packedinit.model.kept): re-used only while everything they read holds.

Every test first makes the decision kept (two or three equal calls), checks that it is re-used, then changes
one thing it was read from and checks that the next call gives what a first call would: the numbers of the
plain loop on the logical tensors, the layouts of a new adapter or annotation, the new tensors.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.init import constant_, kaiming_normal_, xavier_uniform_, zeros_

import packedinit
from packedinit import Layout
from packedinit.model import kept

Idiom = Callable[[nn.Module, Callable[..., Tensor]], object]


def _tree(model: nn.Module, fn: Callable[..., Tensor]) -> None:
    packedinit.chunked(fn)(model)


def _init_model(model: nn.Module, fn: Callable[..., Tensor]) -> None:
    packedinit.init_model(model, fn)


def _apply(model: nn.Module, fn: Callable[..., Tensor]) -> None:
    model.apply(packedinit.chunked(fn))


IDIOMS = {"chunked": _tree, "init_model": _init_model, "apply": _apply}


def _stack(n: int = 4, side: int = 8) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(side, side) for _ in range(n)])


def _plain(model: nn.Module, fn: Callable[..., Tensor], seed: int) -> list[Tensor]:
    torch.manual_seed(seed)
    out = []
    for p in model.parameters():
        if p.dim() > 1:
            w = torch.empty_like(p)
            fn(w)
            out.append(w)
    return out


def _warm(model: nn.Module, idiom: Idiom, fn: Callable[..., Tensor] = kaiming_normal_) -> None:
    for _ in range(3):
        idiom(model, fn)


def _is_kept(model: nn.Module, idiom: str, fn: Callable[..., Tensor] = kaiming_normal_, at: int = 0) -> bool:
    if idiom == "apply":
        module = [m for m in model.modules() if any(p.dim() > 1 for p in m.parameters(recurse=False))][at]
        # (the decision of one module, compared against what a visit from `model` would see)
        with torch.random.fork_rng():
            return kept.apply_kept(module, [model], fn, (), {})
    with torch.random.fork_rng():
        return kept.tree_kept(model, fn, (), {})


@pytest.mark.parametrize("idiom", IDIOMS)
def test_a_kept_decision_gives_the_plain_loops_numbers(idiom: str) -> None:
    model = _stack()
    _warm(model, IDIOMS[idiom])
    assert _is_kept(model, idiom)
    want = _plain(model, kaiming_normal_, 7)
    torch.manual_seed(7)
    IDIOMS[idiom](model, kaiming_normal_)
    got = [p for p in model.parameters() if p.dim() > 1]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("idiom", IDIOMS)
def test_an_adapter_registered_later_is_used(idiom: str) -> None:
    class Fused(nn.Linear):
        pass

    model = nn.Sequential(Fused(8, 24), nn.Linear(8, 8))
    _warm(model, IDIOMS[idiom], xavier_uniform_)
    assert _is_kept(model, idiom, xavier_uniform_)

    @packedinit.register(Fused)
    def fused_layouts(m: nn.Module) -> dict[str, Layout]:
        return {"weight": Layout(0, [8, 8, 8])}

    try:
        assert not _is_kept(model, idiom, xavier_uniform_)
        IDIOMS[idiom](model, xavier_uniform_)
        bound = (6 / 16) ** 0.5  # per (8, 8) block; the whole (24, 8) tensor's bound is (6 / 32) ** 0.5
        w = model[0].weight.detach()
        assert float(w.abs().max()) > (6 / 32) ** 0.5
        assert float(w.abs().max()) <= bound
    finally:
        packedinit.unregister(Fused)


@pytest.mark.parametrize("idiom", IDIOMS)
def test_an_annotation_written_later_is_used(idiom: str) -> None:
    model = nn.Sequential(nn.Linear(8, 24), nn.Linear(8, 8))
    _warm(model, IDIOMS[idiom], xavier_uniform_)
    packedinit.annotate(model, **{"0.weight": Layout(0, [8, 8, 8])})
    assert not _is_kept(model, idiom, xavier_uniform_)
    IDIOMS[idiom](model, xavier_uniform_)
    assert packedinit.layouts(model) == {"0.weight": Layout(0, [8, 8, 8])}
    assert float(model[0].weight.detach().abs().max()) > (6 / 32) ** 0.5  # per block: only the (8, 8) bound holds


def _change(model: nn.Sequential, change: str) -> None:
    if change == "new parameter":
        model[1].weight = nn.Parameter(torch.zeros(8, 8))
    elif change == "new data shape":
        model[1].weight.data = torch.zeros(32, 2)
    elif change == "double":
        model.double()
    elif change == "new child":
        model[2] = nn.Linear(8, 8)
    elif change == "bias made 2-D":
        model[0].bias.data = torch.zeros(4, 4)
    elif change == "tied":
        model[2].weight = model[0].weight
    elif change == "renamed child":
        model._modules = {("x" if k == "1" else k): v for k, v in model._modules.items()}


@pytest.mark.parametrize("idiom", IDIOMS)
@pytest.mark.parametrize(
    "change", ["new parameter", "new data shape", "double", "new child", "bias made 2-D", "tied", "renamed child"]
)
def test_a_change_to_the_model_is_seen(idiom: str, change: str) -> None:
    warmed, fresh = _stack(3), _stack(3)
    _warm(warmed, IDIOMS[idiom])
    assert _is_kept(warmed, idiom)
    _change(warmed, change)
    _change(fresh, change)
    at = {"new parameter": 1, "new data shape": 1, "new child": 2, "tied": 2, "renamed child": 1}.get(change, 0)
    # (model.apply: the changed module's own decision; a renamed child's stays right: no adapter reads names)
    assert _is_kept(warmed, idiom, at=at) is (idiom == "apply" and change == "renamed child")
    for model in (warmed, fresh):
        torch.manual_seed(3)
        IDIOMS[idiom](model, kaiming_normal_)
    got = [p for p in warmed.parameters() if p.dim() > 1]
    want = [p for p in fresh.parameters() if p.dim() > 1]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if idiom != "apply":  # the plain loop's numbers on the changed model
        plain = _plain(fresh, kaiming_normal_, 3)
        assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))


def test_new_plain_arguments_are_used() -> None:
    model = _stack(2)
    for _ in range(3):
        packedinit.init_model(model, constant_, 0.25)
    assert kept.tree_kept(model, constant_, (0.25,), {})
    packedinit.init_model(model, constant_, 0.75)
    assert all(float(p.detach().min()) == float(p.detach().max()) == 0.75 for p in model.parameters() if p.dim() > 1)
    packedinit.init_model(model, constant_, val=0.5)
    assert all(float(p.detach().min()) == float(p.detach().max()) == 0.5 for p in model.parameters() if p.dim() > 1)


@pytest.mark.parametrize("idiom", IDIOMS)
def test_an_inference_tensor_is_refused_every_time(idiom: str) -> None:
    with torch.inference_mode():
        model = _stack(2)
    for _ in range(3):
        with pytest.raises(packedinit.PackedInitError, match=r"created under torch\.inference_mode"):
            IDIOMS[idiom](model, kaiming_normal_)
    assert not _is_kept(model, idiom)


@pytest.mark.parametrize("idiom", IDIOMS)
def test_a_warning_is_given_on_every_call(idiom: str) -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(8, 24)  # looks packed; nothing says how

    model = nn.Sequential(Block(), nn.Linear(8, 8))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(4):
            IDIOMS[idiom](model, xavier_uniform_)
    assert sum("look packed" in str(w.message) for w in seen) == 4


@pytest.mark.parametrize("idiom", IDIOMS)
def test_kept_decisions_keep_nothing_alive(idiom: str) -> None:
    model = _stack(2)
    _warm(model, IDIOMS[idiom])
    old = weakref.ref(model[0].weight)
    model[0].weight = nn.Parameter(torch.empty(8, 8))
    gc.collect()
    assert old() is None
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_threads_each_get_their_own_models_values() -> None:
    models = [_stack(3) for _ in range(4)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for k in range(40):
                val = float(i * 100 + k)
                if k % 3 == 0:  # model.apply takes no arguments for the function: zeros_, then the value
                    models[i].apply(packedinit.chunked(zeros_))
                    assert all(not p.any() for p in models[i].parameters() if p.dim() > 1)
                packedinit.init_model(models[i], constant_, val)
                if k % 7 == 0:  # changes anywhere make every kept decision stale, in every thread
                    packedinit.annotate(models[i], **{"0.weight": None})
                got = {float(p.detach().min()) for p in models[i].parameters() if p.dim() > 1}
                assert got == {val}, (i, k, got)
        except BaseException as e:  # handed to the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.mark.parametrize("idiom", ["chunked", "init_model"])
def test_a_forward_traced_again_keeps_the_decision_only_when_it_shows_the_same(idiom: str) -> None:
    from packedinit.model import found
    from packedinit.trace.verdict import Inferred

    model = _stack(2, 16)
    _warm(model, IDIOMS[idiom])
    assert _is_kept(model, idiom)
    found.forget(model)  # traced again on the next call: nothing is built for a Sequential, as before
    assert _is_kept(model, idiom)
    assert found.findings(model) is None
    # the forward now shows the first weight as [8 | 8] rows: a change, the next call is a first call
    split = Inferred("packed", Layout(0, [8, 8]), "split in two")
    found.remember(model, {"0.weight": split, "1.weight": Inferred("not packed", None, "used whole")})
    assert not _is_kept(model, idiom)
    torch.manual_seed(3)
    IDIOMS[idiom](model, xavier_uniform_)
    bound_block, bound_whole = (6 / 24) ** 0.5, (6 / 32) ** 0.5
    top = float(model[0].weight.detach().abs().max())
    assert bound_whole < top <= bound_block

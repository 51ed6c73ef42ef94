"""Read-only calls are read-only (issues 28, 30): ``audit``, ``layouts``, ``infer_layouts``, ``fingerprint``
leave every weight, buffer, RNG (the CPU default, a user generator, Python's ``random``), train/eval flag,
``requires_grad`` flag and hook exactly as they were, on models in train mode with dropout and batch norm (a forward
in train mode would move both)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import packedinit

E = 8


class Net(nn.Module):
    """MHA, an LSTM, a fused qkv Linear (annotated), dropout and batch norm: a forward in train mode
    draws random numbers and updates running statistics."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, 2, dropout=dropout)
        self.lstm = nn.LSTM(E, E)
        self.qkv = nn.Linear(E, 3 * E)
        self.drop = nn.Dropout(dropout)
        self.norm = nn.BatchNorm1d(E)

    def forward(self, x: Tensor) -> Tensor:
        a, _ = self.mha(x, x, x)
        h, _ = self.lstm(self.drop(a))
        q, k, v = self.qkv(h).split(E, dim=-1)
        y = q * k.sigmoid() + v
        return self.norm(y.flatten(0, 1)).sum()


def snapshot(model: nn.Module, generator: torch.Generator) -> dict[str, Any]:
    """Everything a read-only call must leave as it was."""
    return {
        "tensors": {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]},
        "objects": [id(t) for t in [*model.parameters(), *model.buffers()]],
        "grad": [p.requires_grad for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "hooks": [
            (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks), dict(m._state_dict_hooks))
            for m in model.modules()
        ],
        "cpu_rng": torch.get_rng_state(),
        "generator": generator.get_state(),
        "python_rng": random.getstate(),
    }


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["tensors"].keys() == after["tensors"].keys()
    for name, t in before["tensors"].items():
        assert torch.equal(t, after["tensors"][name]), name
    for key in ("objects", "grad", "training", "hooks", "python_rng"):
        assert before[key] == after[key], key
    assert torch.equal(before["cpu_rng"], after["cpu_rng"])
    assert torch.equal(before["generator"], after["generator"])


def build(seed: int, dropout: float, train: list[bool], hooked: list[bool], annotate: bool) -> Net:
    torch.manual_seed(seed)
    model = Net(dropout)
    for m, flag, hook in zip(model.children(), train, hooked, strict=False):
        m.train(flag)
        if hook:
            m.register_forward_hook(lambda mod, args, out: None)
            m.register_forward_pre_hook(lambda mod, args: None)
    if annotate:
        packedinit.annotate(model, **{"qkv.weight": packedinit.Layout(0, [E] * 3)})
    return model


models = st.builds(
    build,
    seed=st.integers(0, 2**16),
    dropout=st.sampled_from([0.0, 0.5]),
    train=st.lists(st.booleans(), min_size=5, max_size=5),
    hooked=st.lists(st.booleans(), min_size=5, max_size=5),
    annotate=st.booleans(),
)


@settings(max_examples=15)
@given(model=models, seed=st.integers(0, 2**16))
def test_property_layouts_audit_and_fingerprint_are_read_only(model: Net, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    before = snapshot(model, generator)
    packedinit.layouts(model)
    packedinit.audit(model)
    packedinit.fingerprint(model)
    assert_unchanged(before, snapshot(model, generator))


@settings(max_examples=8)
@given(model=models, seed=st.integers(0, 2**16))
def test_property_infer_layouts_and_audit_with_inputs_are_read_only_in_eval_mode(model: Net, seed: int) -> None:
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, E, generator=generator)
    before = snapshot(model, generator)
    found = packedinit.infer_layouts(model, x)
    packedinit.audit(model, example_inputs=(x,))
    assert_unchanged(before, snapshot(model, generator))
    assert found["qkv.weight"].verdict == "packed"


@pytest.mark.parametrize("call", ["infer_layouts", "audit"])
def test_infer_layouts_and_audit_with_inputs_are_read_only_in_train_mode(call: str) -> None:
    model = build(0, 0.5, [True] * 5, [True] * 5, True)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, E, generator=generator)
    before = snapshot(model, generator)
    if call == "infer_layouts":
        packedinit.infer_layouts(model, x)
    else:
        packedinit.audit(model, example_inputs=(x,))
    assert_unchanged(before, snapshot(model, generator))


class Wild(nn.Module):
    """A forward that does everything a read-only call must not let through: it writes its own weight
    and buffer in place, draws from the global RNG with no device, updates batch norm, writes its input,
    and (``values=True``) reads a value, so the meta twin cannot run it and the full copy does."""

    def __init__(self, values: bool) -> None:
        super().__init__()
        self.values = values
        self.qkv = nn.Linear(E, 3 * E)
        self.norm = nn.BatchNorm1d(E)
        self.register_buffer("steps", torch.zeros(()))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        self.qkv.weight.add_(1.0)
        self.steps += 1
        x.mul_(2.0)
        noise = torch.randn(E)  # on the CPU, whatever device the model is on
        if self.values and float(self.steps) > 0:  # a value: no meta forward
            noise = noise * 2
        q, k, v = self.qkv(self.drop(x)).split(E, dim=-1)
        return self.norm(q * k + v + noise.to(x.device)).sum()


@pytest.mark.parametrize("values", [False, True], ids=["meta twin", "full copy"])
def test_a_forward_that_writes_everything_leaves_model_input_and_rngs_as_they_were(values: bool) -> None:
    torch.manual_seed(0)
    model = Wild(values).train()
    model.register_forward_hook(lambda mod, args, out: None)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, E, generator=generator)
    x_before = x.clone()
    before = snapshot(model, generator)
    found = packedinit.infer_layouts(model, x)
    assert_unchanged(before, snapshot(model, generator))
    assert torch.equal(x, x_before)
    assert found["qkv.weight"].layout == packedinit.Layout(0, [E] * 3)


def test_the_twin_used_is_meta_where_the_forward_allows_and_a_copy_where_it_reads_values() -> None:
    from packedinit.trace.twin import run_read_only

    def kind(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        model(*args, **kwargs)
        return str(next(model.parameters()).device)

    x = torch.randn(4, E)
    assert run_read_only(Wild(False), (x,), {}, kind) == ("meta", "meta")
    assert run_read_only(Wild(True), (x,), {}, kind) == ("cpu", "copy")


_FLAG_WRITES: list[tuple[int, object]] = []


class _Watched(nn.Module):
    """Records every write of ``training`` by the id of the module written (a twin is another module)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.drop = nn.Dropout(0.5)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "training":
            _FLAG_WRITES.append((id(self), value))
        super().__setattr__(name, value)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.drop(self.qkv(x)).split(E, dim=-1)
        return (q * k + v).sum()


def test_the_idioms_trace_never_sets_the_models_flags_not_even_for_a_moment() -> None:
    # trace_model is what the whole-model idioms call: it traces in eval mode. Another thread reading
    # model.training during the trace would see a flip if the model itself were put in eval mode.
    from packedinit.trace.auto import trace_model

    model = _Watched().train()
    _FLAG_WRITES.clear()
    found = trace_model(model, (torch.randn(2, E),), {})
    assert found is not None
    assert found["qkv.weight"].layout == packedinit.Layout(0, [E, E, E])
    assert all(who != id(model) for who, _ in _FLAG_WRITES), _FLAG_WRITES
    assert any(flag is False for _, flag in _FLAG_WRITES)  # the twin was put in eval mode
    assert model.training


class _Pickles(nn.Linear):
    """Copies itself its own way: the twin takes deepcopy's path for it (and its tensors are still meta)."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["copied_its_way"] = True
        return state


class _Holder(nn.Module):
    """A shared child, a module kept in a plain list, a tied weight, a non-empty config-like dict."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(E, E)
        self.b = nn.Sequential(self.a, _Pickles(E, E))
        self.out = nn.Linear(E, E)
        self.out.weight = self.a.weight
        self.kept = [self.out]
        self.settings = {"scale": 2.0, "names": ["q", "k"]}


def test_the_meta_twin_is_the_deep_copy_deepcopy_makes_with_every_tensor_on_meta() -> None:
    from packedinit.trace.twin import meta_twin

    model = _Holder()
    model.out._compiled_call_impl = model.out._call_impl  # what .compile() sets: dropped, as deepcopy drops it
    twin = meta_twin(model)
    assert type(twin) is _Holder
    assert twin is not model
    assert twin.b[0] is twin.a
    assert twin.kept[0] is twin.out
    assert twin.out.weight is twin.a.weight
    assert twin.a is not model.a
    assert twin.kept is not model.kept
    assert twin.settings == model.settings
    assert twin.settings is not model.settings
    assert twin.settings["names"] is not model.settings["names"]
    assert getattr(twin.b[1], "copied_its_way", False)
    assert not getattr(model.b[1], "copied_its_way", False)
    assert "_compiled_call_impl" not in vars(twin.out)
    assert "_compiled_call_impl" in vars(model.out)
    for (n, p), (m, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert n == m
        assert q.device.type == "meta"
        assert p.device.type == "cpu"
        assert q.shape == p.shape
        assert isinstance(q, nn.Parameter)
        assert q.requires_grad == p.requires_grad
    twin.a._forward_hooks[0] = print  # the twin's hook dicts are its own
    assert not model.a._forward_hooks

"""Issue 20 item 3: annotation marks agree with the module-level idioms after copies, loads, moves and ties."""

from __future__ import annotations

import copy
import io
import pickle
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.init import xavier_uniform_

from packedinit import Layout, PackedInitError, annotate, chunked, chunked_init, layouts
from packedinit.model.marks import param_layout

E = 8
QKV = Layout(0, [E, E, E], names=("q", "k", "v"))


def _annotated() -> nn.Linear:
    return annotate(nn.Linear(E, 3 * E), weight=QKV)


def _per_block(p: torch.Tensor) -> bool:
    """chunked(xavier_uniform_)(p) draws what the per-block init draws (same seed)."""
    torch.manual_seed(0)
    got = chunked(xavier_uniform_)(p).detach().clone()
    torch.manual_seed(0)
    want = chunked_init(torch.empty(p.shape), QKV, None, xavier_uniform_)
    return torch.equal(got, want)


def _pickled(m: nn.Module) -> nn.Module:
    out: nn.Module = pickle.loads(pickle.dumps(m))
    return out


def _saved(m: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    out: nn.Module = torch.load(buf, weights_only=False)
    return out


def _to_empty(m: nn.Module) -> nn.Module:
    return m.to_empty(device="cpu")


def _assigned(m: nn.Module) -> nn.Module:
    m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
    return m


LOADS = {"pickle": _pickled, "torch.save": _saved}
THEN: dict[str, Callable[[nn.Module], nn.Module]] = {
    "as_loaded": lambda m: m,
    "deepcopy": copy.deepcopy,
    "to_empty": _to_empty,
    "load_state_dict_assign": _assigned,
}


@pytest.mark.parametrize("then", list(THEN))
@pytest.mark.parametrize("load", list(LOADS))
def test_marks_survive_a_load_then_a_copy(load: str, then: str) -> None:
    m = THEN[then](LOADS[load](_annotated()))
    assert layouts(m) == {"weight": QKV}
    assert param_layout(m.weight) == QKV
    assert _per_block(m.weight)


def test_a_parameter_looked_up_before_it_joins_an_annotated_module() -> None:
    lin = _annotated()
    p = nn.Parameter(torch.empty(3 * E, E))
    assert param_layout(p) is None  # not packed yet: nobody annotated holds it
    lin.weight = p
    assert param_layout(p) == QKV
    assert _per_block(p)


def test_an_annotated_parameter_moved_into_an_unannotated_linear() -> None:
    """The module idiom and the parameter loop agree (here: one block, as layouts() says)."""
    old = _annotated()
    p = old.weight
    old.weight = nn.Parameter(torch.empty(3 * E, E))
    new = nn.Linear(E, 3 * E)
    new.weight = p
    assert layouts(new) == {}
    torch.manual_seed(0)
    chunked(xavier_uniform_)(new)
    by_module = new.weight.detach().clone()
    torch.manual_seed(0)
    for q in new.parameters():
        if q.dim() > 1:
            chunked(xavier_uniform_)(q)
    assert torch.equal(new.weight, by_module)


def test_a_tied_weight_annotated_differently_raises_in_both_idioms() -> None:
    a, b = nn.Linear(E, 3 * E), nn.Linear(E, 3 * E)
    b.weight = a.weight
    annotate(a, weight=QKV)
    annotate(b, weight=Layout(0, [2 * E, E]))
    with pytest.raises(PackedInitError, match="two different layouts"):
        layouts(nn.Sequential(a, b))
    before = a.weight.detach().clone()
    with pytest.raises(PackedInitError, match="tied"):
        chunked(xavier_uniform_)(a.weight)
    assert torch.equal(a.weight, before)


def test_annotate_racing_lookups_in_another_thread() -> None:
    """Every weight ends packed although another thread looked it up while annotate ran."""
    mods = [nn.Linear(E, 3 * E) for _ in range(300)]
    done = threading.Event()

    def lookups() -> None:
        while not done.is_set():
            for m in mods:
                param_layout(m.weight)

    th = threading.Thread(target=lookups)
    th.start()
    try:
        for m in mods:
            annotate(m, weight=QKV)
    finally:
        done.set()
        th.join()
    missing = [i for i, m in enumerate(mods) if param_layout(m.weight) != QKV]
    assert not missing

"""model.apply(chunked(f)): a parameter shared by several modules is written once, by the last visit that holds it."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from torch import Tensor, nn

import packedinit
from packedinit.errors import PackedInitError


class Counting:
    """An init function that counts, by storage, the tensors it writes (meta dry runs not counted)."""

    def __init__(self) -> None:
        self.writes: Counter[int] = Counter()
        self.lock = threading.Lock()

    def __call__(self, t: Tensor) -> Tensor:
        if t.device.type != "meta":
            with self.lock:
                self.writes[t.data_ptr()] += 1
        return nn.init.normal_(t)


def tied_lm(vocab: int = 11, d: int = 6) -> nn.Sequential:
    model = nn.Sequential(nn.Embedding(vocab, d), nn.Sequential(nn.Linear(d, d), nn.ReLU()), nn.Linear(d, vocab))
    model[2].weight = model[0].weight
    return model


def test_tied_weight_written_once_by_the_last_visit() -> None:
    model = tied_lm()
    f = Counting()
    model.apply(packedinit.chunked(f))
    assert f.writes[model[0].weight.data_ptr()] == 1
    assert set(f.writes.values()) == {1}
    assert len(f.writes) == 2
    # the draws are those of a plain apply that leaves the first holder's visit out: the last visit writes it
    torch.manual_seed(0)
    model.apply(packedinit.chunked(nn.init.kaiming_normal_))
    got = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(0)
    for m in (model[1][0], model[2]):
        nn.init.kaiming_normal_(m.weight)
    assert all(torch.equal(a, p) for a, p in zip(got, model.parameters(), strict=True))


def test_every_traversal_writes_it_again() -> None:
    model = tied_lm()
    f = Counting()
    wrapped = packedinit.chunked(f)
    for _ in range(3):
        model.apply(wrapped)
    assert f.writes[model[0].weight.data_ptr()] == 3
    model[2].apply(wrapped)  # a traversal of the last holder alone: written there
    model[0].apply(wrapped)  # of the first holder alone: written there too
    assert f.writes[model[0].weight.data_ptr()] == 5


def test_an_error_mid_traversal_leaves_nothing_behind() -> None:
    model = tied_lm()
    with torch.inference_mode():
        bad = torch.empty(6, 6)
    model[1][0].weight = nn.Parameter(bad, requires_grad=False)
    wrapped = packedinit.chunked(nn.init.normal_)
    before = model[0].weight.detach().clone()
    with pytest.raises(PackedInitError, match="inference"):
        model.apply(wrapped)
    assert torch.equal(model[0].weight, before)  # left out at its first visit; the last one was never reached
    model[1][0].weight = nn.Parameter(torch.empty(6, 6))
    f = Counting()
    model.apply(packedinit.chunked(f))
    assert f.writes[model[0].weight.data_ptr()] == 1
    assert len(f.writes) == 2


class OwnApply(nn.Sequential):
    def apply(self, fn):  # type: ignore[no-untyped-def, override]
        return super().apply(fn)


def test_a_module_that_overrides_apply_turns_it_off() -> None:
    model = tied_lm()
    model[1] = OwnApply(*model[1])
    f = Counting()
    model.apply(packedinit.chunked(f))
    assert f.writes[model[0].weight.data_ptr()] == 2  # written at each visit, as any apply-based init


def test_parameters_held_elsewhere_are_still_written() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # holds every parameter: each looks shared
    f = Counting()
    model.apply(packedinit.chunked(f))
    assert len(f.writes) == 5
    assert set(f.writes.values()) == {1}
    assert opt.param_groups


def test_a_shared_module_is_still_written() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Sequential(shared), nn.Sequential(shared))
    f = Counting()
    model.apply(packedinit.chunked(f))
    assert f.writes[shared.weight.data_ptr()] >= 1


def test_threads_keep_their_own_traversal() -> None:
    models: list[nn.Sequential] = [tied_lm(vocab=200, d=32) for _ in range(4)]
    f = Counting()
    wrapped = packedinit.chunked(f)

    def run(m: nn.Module) -> None:
        for _ in range(20):
            m.apply(wrapped)

    threads = [threading.Thread(target=run, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(f.writes[m[0].weight.data_ptr()] == 20 for m in models)
    assert all(f.writes[m[1][0].weight.data_ptr()] == 20 for m in models)

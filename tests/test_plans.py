"""model.apply(chunked(f)) traversals kept as a plan (packedinit.model.plans): the same numbers as the per-visit
way, every check before the first write, and a changed tree, call or world noticed."""

from __future__ import annotations

import copy
import threading
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import Tensor, nn

import packedinit
from packedinit.model import plans


def small() -> nn.Sequential:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Embedding(13, 8),
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Conv2d(8, 4, 3)),
        nn.LayerNorm(8),
        nn.Linear(8, 16, bias=False),
        nn.Linear(8, 13),
    )
    model[4].weight = model[0].weight  # tied: written by its last visit only
    return model


def values(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def first_traversal(model: nn.Module, fn: Callable[..., Tensor], seed: int) -> list[Tensor]:
    """What the per-visit way writes: a deep copy's first traversal (nothing kept for it yet)."""
    return first_with_state(model, fn, seed)[0]


def first_with_state(model: nn.Module, fn: Callable[..., Tensor], seed: int) -> tuple[list[Tensor], Tensor]:
    fresh = copy.deepcopy(model)
    torch.manual_seed(seed)
    fresh.apply(packedinit.chunked(fn))
    return values(fresh), torch.get_rng_state()


def same(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


LOCK = threading.Lock()

FNS = [
    nn.init.kaiming_normal_,
    nn.init.kaiming_uniform_,
    nn.init.xavier_uniform_,
    nn.init.xavier_normal_,
    nn.init.normal_,
    nn.init.uniform_,
    nn.init.trunc_normal_,
    nn.init.orthogonal_,
]


@pytest.mark.parametrize("fn", FNS, ids=lambda f: f.__name__)
def test_a_kept_traversal_draws_what_the_per_visit_way_draws(fn: Callable[..., Tensor]) -> None:
    model = small()
    wrapped = packedinit.chunked(fn)
    wants = [first_with_state(model, fn, seed) for seed in range(5)]  # (a new model seen moves every plan's world)
    for seed, (want, state) in enumerate(wants):
        torch.manual_seed(seed)
        model.apply(wrapped)
        assert same(values(model), want), seed
        assert torch.equal(torch.get_rng_state(), state), seed
    assert id(model) in plans._PLANS  # kept after two traversals and still holding after three more


def test_the_numbers_are_torchs_own_functions_on_each_weight_in_visit_order() -> None:
    model = small()
    wrapped = packedinit.chunked(nn.init.kaiming_normal_)
    for _ in range(3):
        model.apply(wrapped)
    assert id(model) in plans._PLANS
    torch.manual_seed(7)
    model.apply(wrapped)
    got, after = values(model), torch.get_rng_state()
    torch.manual_seed(7)  # plain torch, apply's order; the tied weight at its last holder's visit (model[4])
    for m in (model[1][0], model[1][2], model[3], model[4]):
        nn.init.kaiming_normal_(m.weight)
    assert same(got, values(model))
    assert torch.equal(after, torch.get_rng_state())


def kept(model: nn.Module, fn: Callable[..., Tensor] = nn.init.xavier_uniform_) -> Callable[[nn.Module], None]:
    wrapped = packedinit.chunked(fn)
    for _ in range(3):
        model.apply(wrapped)
    assert id(model) in plans._PLANS
    return wrapped


def replace_a_layer(model: nn.Module) -> None:
    model[1][0] = nn.Linear(8, 8)


def change_the_dtype(model: nn.Module) -> None:
    model.double()  # param.data = ...: the same Parameter objects, float64


def reshape_through_data(model: nn.Module) -> None:
    model[3].weight.data = torch.empty(8, 16).t()  # same object, other strides


def tie_two_more(model: nn.Module) -> None:
    model[3].weight = nn.Parameter(torch.empty(16, 8))
    model[1][0].weight = model[4].weight  # three holders now


def an_own_apply(model: nn.Module) -> None:
    inner = model[1]
    inner.apply = types.MethodType(nn.Module.apply, inner)  # type: ignore[method-assign]  # (rebound by deepcopy)


class OwnApply(nn.Sequential):
    pass


def a_class_apply(model: nn.Module) -> None:
    model[1].__class__ = OwnApply
    OwnApply.apply = lambda self, fn: nn.Module.apply(self, fn)  # type: ignore[method-assign]


def annotate(model: nn.Module) -> None:
    packedinit.annotate(model[3], weight=packedinit.Layout(dim=0, sizes=[8, 8]))


def add_a_weight(model: nn.Module) -> None:
    model[2].extra = nn.Parameter(torch.empty(3, 3))


@pytest.mark.parametrize(
    "change",
    [
        replace_a_layer,
        change_the_dtype,
        reshape_through_data,
        tie_two_more,
        an_own_apply,
        a_class_apply,
        annotate,
        add_a_weight,
    ],
)
def test_a_change_is_seen_before_the_first_write(change: Callable[[nn.Module], None]) -> None:
    model = small()
    twin = copy.deepcopy(model)
    torch.manual_seed(9)
    change(twin)
    want = first_traversal(twin, nn.init.xavier_uniform_, 3)  # before the plan: seeing the twin moves the world
    wrapped = kept(model)
    plan = plans._PLANS[id(model)]
    torch.manual_seed(9)
    change(model)
    torch.manual_seed(3)
    model.apply(wrapped)
    assert same(values(model), want)
    assert plans._PLANS.get(id(model)) is not plan  # dropped at the first visit (then kept anew, or not)


def test_another_call_or_mode_does_not_use_the_plan() -> None:
    model = small()
    want = first_traversal(model, nn.init.kaiming_normal_, 5)
    fresh = copy.deepcopy(model)
    with torch.inference_mode():
        want_inference = first_traversal(fresh, nn.init.xavier_uniform_, 6)
    kept(model, nn.init.xavier_uniform_)
    torch.manual_seed(5)
    model.apply(packedinit.chunked(nn.init.kaiming_normal_))
    assert same(values(model), want)
    kept(model, nn.init.xavier_uniform_)
    plan = plans._PLANS[id(model)]
    with torch.inference_mode():
        torch.manual_seed(6)
        model.apply(packedinit.chunked(nn.init.xavier_uniform_))
    assert same(values(model), want_inference)
    assert plans._PLANS.get(id(model)) is not plan


def test_a_traversal_of_a_part_between_two_of_the_whole() -> None:
    model = small()
    want = first_traversal(model, nn.init.xavier_uniform_, 4)
    wrapped = kept(model)
    torch.manual_seed(2)
    model[1].apply(wrapped)  # another root: its own visits, the plan of the whole untouched
    part = values(model[1])
    torch.manual_seed(2)  # plain torch in the part's visit order
    nn.init.xavier_uniform_(model[1][0].weight)
    nn.init.xavier_uniform_(model[1][2].weight)
    assert same(part, values(model[1]))
    torch.manual_seed(4)
    model.apply(wrapped)
    assert same(values(model), want)


def test_threads_each_follow_their_own_plan() -> None:
    models = [small() for _ in range(4)]
    wants = [[first_traversal(m, nn.init.kaiming_normal_, 10 * i + k) for k in range(6)] for i, m in enumerate(models)]
    wrapped = packedinit.chunked(nn.init.kaiming_normal_)

    def work(i: int) -> list[list[Tensor]]:
        out = []
        with LOCK:  # each thread seeds the default generator: the threads take turns, six traversals each
            for k in range(6):
                torch.manual_seed(10 * i + k)
                models[i].apply(wrapped)
                out.append(values(models[i]))
        return out

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(work, range(4)))
    for i, m in enumerate(models):
        assert id(m) in plans._PLANS
        assert all(same(g, w) for g, w in zip(got[i], wants[i], strict=True))


def test_a_plan_holds_its_model_weakly() -> None:
    import gc
    import weakref

    model = small()
    kept(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None

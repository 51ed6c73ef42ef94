"""One decision for the lean path (packedinit.engine.lean.route): every entry point gives the same numbers.

An unpacked tensor reaches the engine four ways: ``chunked_init(t, None, None, f)``, ``chunked(f)(t)``,
``chunked_init(t, 1, 0, f)`` (through ``run``) and the whole-model walk (``init_model``). Each asks
``lean.route``; whichever path it picks, the tensor gets what ``f`` alone gives it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import init

from packedinit import chunked, chunked_init, init_model
from packedinit.engine.lean import GENERAL, SKIP, TORCH, USER, route

FNS: list[tuple[Callable[..., Tensor], dict[str, Any]]] = [
    (init.uniform_, {"a": -0.3, "b": 0.2}),
    (init.normal_, {"std": 0.5}),
    (init.xavier_uniform_, {"gain": 2.0}),
    (init.xavier_normal_, {}),
    (init.kaiming_uniform_, {"a": 0.1, "mode": "fan_out"}),
    (init.kaiming_normal_, {"nonlinearity": "relu"}),
    (init.trunc_normal_, {"std": 0.3}),
    (init.orthogonal_, {"gain": 0.5}),
    (init.sparse_, {"sparsity": 0.5}),
    (init.constant_, {"val": 0.7}),
    (init.eye_, {}),
    (functools.partial(init.xavier_uniform_, gain=0.5), {}),
    (lambda t: t.normal_(0.0, 0.1), {}),
]


def entry_points(fn: Callable[..., Tensor], kw: dict[str, Any]) -> list[Callable[[Tensor], object]]:
    def walk(t: Tensor) -> None:
        m = nn.Module()
        m.w = nn.Parameter(t)  # the Parameter shares t's memory
        init_model(m, fn, **kw)

    return [
        lambda t: chunked_init(t, None, None, fn, **kw),
        lambda t: chunked(fn)(t, **kw),
        lambda t: chunked_init(t, 1, 0, fn, **kw),
        walk,
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize(("fn", "kw"), FNS)
def test_every_entry_point_gives_the_plain_function(
    fn: Callable[..., Tensor], kw: dict[str, Any], contiguous: bool, dtype: torch.dtype
) -> None:
    def make() -> Tensor:
        t = torch.zeros(6, 10, dtype=dtype)
        return t if contiguous else torch.zeros(10, 6, dtype=dtype).t()

    want = make()
    torch.manual_seed(0)
    if fn is init.orthogonal_ and dtype == torch.float16:  # computed in float32, then cast (documented)
        want.copy_(init.orthogonal_(torch.empty(6, 10), **kw))
    else:
        with torch.no_grad():
            fn(want, **kw)
    for enter in entry_points(fn, kw):
        t = make()
        torch.manual_seed(0)
        enter(t)
        assert torch.equal(t, want), enter


def test_route_decides_each_kind_of_call() -> None:
    t = torch.empty(6, 10)
    assert route(t, init.xavier_uniform_, (), {}) == TORCH
    assert route(t, init.trunc_normal_, (), {"generator": torch.Generator()}) == TORCH
    assert route(t, init.sparse_, (), {"sparsity": 0.5, "generator": torch.Generator()}) == GENERAL
    assert route(t.half(), init.orthogonal_, (), {}) == GENERAL  # float32 scratch first
    assert route(t.t(), init.orthogonal_, (), {}) == GENERAL  # a contiguous scratch first
    assert route(t.to(torch.float8_e4m3fn), init.normal_, (), {}) == GENERAL  # refused before any write
    assert route(torch.empty(0, 4), init.kaiming_uniform_, (), {}) == SKIP
    assert route(t, lambda x: x.zero_(), (), {}) == USER
    assert route(t.to("meta"), lambda x: x.zero_(), (), {}) == GENERAL
    # the public functions' first look: torch's own checks stand; anything else goes on to run()
    assert route(t, init.xavier_uniform_, (), {}, first=True) == TORCH
    assert route(t.to(torch.float8_e4m3fn), init.normal_, (), {}, first=True) == TORCH
    assert route(torch.empty(0, 4), init.kaiming_uniform_, (), {}, first=True) == GENERAL
    assert route(t, init.constant_, (0.5,), {"generator": None}, first=True) == GENERAL

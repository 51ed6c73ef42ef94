"""The documented calls inside a ``torch.compile``d function: no warnings, no graph break, the eager numbers.

Run under the suite's ``filterwarnings = error``, so any warning Dynamo raised (it warns on every
``lru_cache`` it traces) fails the test. Backends ``eager`` and ``aot_eager`` (what the docs claim);
inductor needs a C++ toolchain and ~45 s on two cores, so it is not run here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.nn.init import kaiming_normal_, normal_, xavier_uniform_

from packedinit import Layout, chunked, chunked_init
from packedinit.torch_compat import TORCH_VERSION

CALLS: dict[str, Callable[[Tensor], object]] = {
    "chunked_init(w, 3, 0, f)": lambda w: chunked_init(w, 3, 0, xavier_uniform_),
    "chunked_init(w, sizes, 0, f, gain)": lambda w: chunked_init(w, [4, 4, 4], 0, xavier_uniform_, gain=2.0),
    "chunked(f, 3)(w)": lambda w: chunked(xavier_uniform_, 3)(w),
    "chunked(f)(w)": lambda w: chunked(xavier_uniform_)(w),
    "chunked(f, Layout)(w)": lambda w: chunked(kaiming_normal_, Layout(0, [8, 4]))(w, nonlinearity="relu"),
    "chunked_init(experts, Layout(batch_dims=1), f)": lambda w: chunked_init(
        w.view(3, 4, 4), Layout(1, [2, 2], batch_dims=1), init_fn=xavier_uniform_
    ),
}


def _eager(call: Callable[[Tensor], object]) -> Tensor:
    torch.manual_seed(0)
    w = torch.empty(12, 4)
    call(w)
    return w


#: Dynamo traces the per-block calls in one graph from torch 2.13 (checked on 2.13 and 2.15); torch 2.6's
#: cannot trace a function looked up in a frozenset or hash() of a tuple (docs/pages/quickstart.md).
ONE_GRAPH = TORCH_VERSION >= (2, 13)


def _compiled_matches_eager(name: str, backend: str, fullgraph: bool) -> None:
    """``CALLS[name]`` inside a compiled step: no warning, the eager call's numbers, the step's own result."""
    call = CALLS[name]

    def step(w: Tensor) -> Tensor:
        call(w)
        return w * 2

    torch.compiler.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=fullgraph)  # fullgraph: a graph break is an error
    torch.manual_seed(0)
    w = torch.empty(12, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = compiled(w)
    assert [str(x.message) for x in seen] == []
    assert torch.equal(w, _eager(call))  # the same blocks from the same stream as the eager call
    assert torch.equal(out, w * 2)


@pytest.mark.skipif(not ONE_GRAPH, reason="torch < 2.13: Dynamo graph-breaks in the layout checks (next test)")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_documented_calls_compile_in_one_graph_without_warnings(name: str, backend: str) -> None:
    _compiled_matches_eager(name, backend, fullgraph=True)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_documented_calls_inside_compile_give_the_eager_numbers_on_every_torch(name: str) -> None:
    _compiled_matches_eager(name, "aot_eager", fullgraph=False)  # graph breaks allowed (torch < 2.13 has some)


@pytest.mark.parametrize(
    "call",
    [
        lambda w: chunked_init(w, 2, 1, xavier_uniform_),  # blocks along dim 1: not contiguous views
        lambda w: chunked_init(w, Layout(0, [2, 2], groups=3), init_fn=normal_),
    ],
)
def test_layouts_without_contiguous_blocks_run_eagerly_inside_compile(call: Callable[[Tensor], object]) -> None:
    def step(w: Tensor) -> Tensor:
        call(w)
        return w + 1

    torch.compiler.reset()
    torch.manual_seed(0)
    w = torch.empty(12, 4)
    out = torch.compile(step, backend="eager")(w)
    assert torch.equal(w, _eager(call))
    assert torch.equal(out, w + 1)

"""Whole-model init checks an unpacked parameter once per kind (walk._checked_key), never fewer checks.

The per-parameter cost of ``init_model`` / ``chunked(f)(model)`` / ``model.apply(chunked(f))`` on
many small layers is the checks. An unpacked tensor whose shape, strides, dtype, device, inference
state, function and arguments equal those of one that passed every check is not checked again (the
checks read nothing else); anything that differs is checked, and a failure is never remembered.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import init

from packedinit import PackedInitError, chunked, init_model


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def stack(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(6, 6) for _ in range(n)])


@pytest.mark.parametrize("idiom", ["init_model", "chunked", "apply"])
def test_many_small_layers_get_the_plain_loop(idiom: str) -> None:
    model = stack(5)
    kw = {} if idiom == "apply" else {"nonlinearity": "relu"}  # apply passes no keywords
    torch.manual_seed(0)
    for p in model.parameters():
        if p.dim() > 1:
            init.kaiming_normal_(p, **kw)
    want = [bits(p) for p in model.parameters()]
    for _ in range(2):  # the second time every parameter's checks are remembered
        torch.manual_seed(0)
        if idiom == "init_model":
            init_model(model, init.kaiming_normal_, **kw)
        elif idiom == "chunked":
            chunked(init.kaiming_normal_)(model, **kw)
        else:
            model.apply(chunked(init.kaiming_normal_))
        assert [torch.equal(a, bits(p)) for a, p in zip(want, model.parameters(), strict=True)] == [True] * 10


def test_an_equal_shape_with_other_strides_is_still_checked() -> None:
    model = stack(2)
    init_model(model, init.xavier_uniform_)  # (6, 6) float32 contiguous: checked and remembered
    shared = nn.Module()
    shared.w = nn.Parameter(torch.zeros(6, 1).expand(6, 6))  # same shape, stride 0: rows share memory
    model.append(shared)
    before = [bits(p) for p in model.parameters()]
    rng = torch.get_rng_state()
    with pytest.raises(PackedInitError, match=r"dim 1 has stride 0 \(an expanded tensor\)"):
        init_model(model, init.xavier_uniform_)
    assert all(torch.equal(a, bits(p)) for a, p in zip(before, model.parameters(), strict=True))
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_rejection_is_never_remembered() -> None:
    model = stack(3)
    before = [bits(p) for p in model.parameters()]
    for _ in range(2):
        with pytest.raises(PackedInitError, match="nonlinearity"):
            init_model(model, init.kaiming_uniform_, nonlinearity="tanhh")
        assert all(torch.equal(a, bits(p)) for a, p in zip(before, model.parameters(), strict=True))
    init_model(model, init.kaiming_uniform_, nonlinearity="tanh")  # the same call, right argument: fine
    # other arguments are other checks: a bad mode after a good call is refused before any write
    before = [bits(p) for p in model.parameters()]
    with pytest.raises(PackedInitError, match="fan_avg"):
        init_model(model, init.kaiming_uniform_, mode="fan_avg")
    assert all(torch.equal(a, bits(p)) for a, p in zip(before, model.parameters(), strict=True))


def test_inference_tensors_are_checked_apart() -> None:
    init_model(stack(1), init.xavier_uniform_)
    with torch.inference_mode():
        frozen = nn.Linear(6, 6)
    model = nn.Sequential(nn.Linear(6, 6), frozen)
    before = bits(model[0].weight)
    with pytest.raises(PackedInitError, match="inference_mode"):
        init_model(model, init.xavier_uniform_)
    assert torch.equal(before, bits(model[0].weight))

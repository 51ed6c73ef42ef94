"""Messages that blame the right thing: keyword typos, arguments in another call's order, error types."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn.init import xavier_uniform_

import packedinit
from packedinit import (
    PackedInitError,
    PackedInitNotImplementedError,
    PackedInitRuntimeError,
    PackedInitTypeError,
    chunked,
    chunked_init,
    init_model,
)


def _layer() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(16, 4, dim_feedforward=32)


def _state(m: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def test_init_model_keyword_typo_says_did_you_mean_before_calling_the_function() -> None:
    layer, calls = _layer(), []

    def counting(tensor: Tensor, gain: float = 1.0) -> Tensor:
        calls.append(tensor.shape)
        return xavier_uniform_(tensor, gain=gain)

    before = _state(layer)
    with pytest.raises(PackedInitTypeError, match=r"init_model\(\.\.\., module=\.\.\.\).*did you mean `modules=`\?"):
        init_model(layer, counting, module=nn.Linear)
    with pytest.raises(TypeError, match=r"did you mean `params=`\?"):
        init_model(layer, xavier_uniform_, param="*.weight")
    with pytest.raises(
        PackedInitError, match=r"did you mean `gain=`\? \(It is torch\.nn\.init\.xavier_uniform_'s keyword\.\)"
    ):
        init_model(layer, xavier_uniform_, gian=2.0)
    assert calls == []
    assert all(torch.equal(a, b) for a, b in zip(before, _state(layer), strict=True))


@pytest.mark.parametrize(("given", "meant"), [("module", "modules"), ("modules", "modules"), ("param", "params")])
def test_chunked_on_a_module_points_filters_to_init_model(given: str, meant: str) -> None:
    layer = _layer()
    with pytest.raises(
        PackedInitTypeError,
        match=rf"has no filters .* takes no keyword '{given}'; "
        rf"did you mean packedinit\.init_model's filter `{meant}=`\?"
        rf".*Fix: packedinit\.init_model\(module, torch\.nn\.init\.xavier_uniform_, {meant}=\.\.\.\)",
    ):
        chunked(xavier_uniform_)(layer, **{given: nn.Linear})


def test_keywords_the_function_takes_and_unrelated_ones_are_left_to_it() -> None:
    layer = _layer()
    init_model(layer, xavier_uniform_, gain=2.0, generator=torch.Generator().manual_seed(0))
    init_model(layer, lambda t, **kw: xavier_uniform_(t), module=nn.Linear)  # **kwargs: the function's to judge
    with pytest.raises(PackedInitTypeError, match=r"unexpected keyword argument 'zzz'"):
        init_model(layer, xavier_uniform_, zzz=1)


def test_chunked_init_with_chunked_argument_order_names_both_signatures() -> None:
    w = torch.zeros(6, 2)
    with pytest.raises(
        PackedInitTypeError,
        match=r"chunked_init\(torch\.nn\.init\.xavier_uniform_, tensor, 3, 0\): the first argument is the function"
        r".*chunked_init\(tensor, chunks=None, dim=None, init_fn=None, \*args, \*\*kwargs\); "
        r"chunked\(init_fn, chunks=None, dim=None\)\(tensor_or_module",
    ):
        chunked_init(xavier_uniform_, w, 3, 0)  # type: ignore[arg-type]  # the mistake under test
    with pytest.raises(PackedInitTypeError, match=r"chunked\(tensor, \.\.\.\): chunked takes the init function first"):
        chunked(w, 3)  # type: ignore[arg-type]  # the mistake under test
    assert bool((w == 0).all())


@pytest.mark.parametrize(
    ("cls", "base"),
    [
        (PackedInitTypeError, TypeError),
        (PackedInitRuntimeError, RuntimeError),
        (PackedInitNotImplementedError, NotImplementedError),
    ],
)
def test_every_error_type_is_importable_and_exported(cls: type[PackedInitError], base: type[Exception]) -> None:
    assert cls.__name__ in packedinit.__all__
    assert issubclass(cls, PackedInitError)
    assert issubclass(cls, base)
    assert issubclass(cls, ValueError)
    assert cls.__module__ == "packedinit.errors"


def test_torch_errors_become_the_exported_types() -> None:
    with pytest.raises(PackedInitTypeError, match=r"orthogonal_"):
        chunked_init(torch.empty(6, 2), 3, 0, torch.nn.init.orthogonal_, gain="relu")
    names = {n for n in packedinit.__all__ if n.endswith("Error")}
    assert names == {
        "PackedInitError",
        "PackedInitTypeError",
        "PackedInitRuntimeError",
        "PackedInitNotImplementedError",
    }

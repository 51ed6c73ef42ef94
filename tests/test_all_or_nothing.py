"""All-or-nothing: every check before the first write, and a message that says nothing was written is true.

Each hole below once left a partly written tensor or model (or a moved RNG) behind a
message saying "Nothing was written"; the property test at the end draws random bad
inputs and checks that claim on every one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn import init

from packedinit import Layout, PackedInitError, chunked, chunked_init, init_model


def bits(t: Tensor) -> Tensor:
    """The raw bytes of ``t`` in logical order (-0.0 != 0.0, NaN == NaN)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a: dict[str, Tensor], model: nn.Module) -> bool:
    return all(torch.equal(bits(a[n]), bits(p)) for n, p in model.named_parameters())


def assert_untouched(call: Callable[[], object], tensor: Tensor, match: str, kind: type[Exception]) -> None:
    before, rng = tensor.detach().clone(), torch.get_rng_state()
    with pytest.raises(kind, match=match) as info:
        call()
    assert isinstance(info.value, PackedInitError)
    assert torch.equal(bits(before), bits(tensor))
    assert torch.equal(rng, torch.get_rng_state()), "the global RNG moved"


# -- orthogonal_ returns early on meta: its arguments are checked without the dry run ---------------------------
@pytest.mark.parametrize(
    "call",
    [
        lambda w: chunked_init(w, 3, 0, init.orthogonal_, gain="relu"),
        lambda w: chunked(init.orthogonal_)(w, gain="relu"),
        lambda w: chunked(init.orthogonal_, 3)(w, "relu"),
        lambda w: chunked_init(w, 3, 0, functools.partial(init.orthogonal_, gain=[1.0])),
    ],
)
def test_orthogonal_gain_is_checked_before_any_draw(call: Callable[[Tensor], object]) -> None:
    w = torch.randn(6, 4)
    match = r"orthogonal_\)? with gain=.* is not a real number\. Nothing was written"
    assert_untouched(lambda: call(w), w, match, TypeError)


def test_whole_model_orthogonal_gain_is_checked_before_any_parameter() -> None:
    lstm = nn.LSTM(3, 4)
    before, rng = snapshot(lstm), torch.get_rng_state()
    with pytest.raises(TypeError, match=r"parameter 'weight_ih_l0' of shape \(16, 3\).*gain='relu'"):
        chunked(init.orthogonal_)(lstm, gain="relu")
    assert same(before, lstm)
    assert torch.equal(rng, torch.get_rng_state())


# -- dtypes torch's random kernels cannot fill are refused up front -------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_is_refused_before_block_0_is_zeroed(dtype: torch.dtype) -> None:
    w = torch.randn(6, 4).to(dtype)
    assert_untouched(
        lambda: chunked_init(w, 3, 0, [init.zeros_, init.xavier_uniform_, None]),
        w,
        rf"xavier_uniform_ draws random floats but the tensor is {dtype}.*Nothing was written",
        PackedInitError,
    )


def test_a_float8_parameter_late_in_a_model_is_refused_before_the_first_is_written() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    model[2].weight.data = model[2].weight.data.to(torch.float8_e4m3fn)
    before = snapshot(model)
    with pytest.raises(PackedInitError, match=r"parameter '2\.weight' .*float8_e4m3fn"):
        init_model(model, init.xavier_uniform_)
    assert same(before, model)


def test_constant_fill_of_float8_still_works() -> None:
    w = torch.zeros(6, 4, dtype=torch.float8_e4m3fn)
    chunked_init(w, 3, 0, [init.ones_, init.zeros_, None])
    assert w.float()[:2].eq(1).all()
    assert w.float()[2:].eq(0).all()


# -- memory checks can never be skipped by a cache -------------------------------------------------------------------
def test_expanded_parameter_with_a_shape_seen_before_is_refused_every_call() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = nn.Parameter(torch.randn(4, 1).expand(4, 4))
    before = snapshot(model)
    for _ in range(2):  # within one call and across calls: the first (4, 4) weight is valid
        with pytest.raises(PackedInitError, match=r"parameter '1\.weight' .*stride 0"):
            chunked(init.xavier_uniform_)(model)
        assert same(before, model)
    fine = torch.empty(4, 4)
    chunked(init.xavier_uniform_)(fine)  # the same shape, owning its memory, still works


def test_overlapping_views_are_refused_like_expanded_ones() -> None:
    storage = torch.randn(24)
    w = storage.as_strided((6, 4), (2, 1))
    before = storage.clone()
    with pytest.raises(PackedInitError, match=r"strides \(2, 1\) make elements share memory.*Nothing was written"):
        chunked_init(w, 3, 0, init.xavier_uniform_)
    assert torch.equal(before, storage)
    ok = torch.randn(4, 6).t()  # non-contiguous but no overlap: fine
    chunked_init(ok, 3, 0, init.xavier_uniform_)


def test_a_cached_plan_is_never_reused_for_an_argument_that_only_hashes_alike() -> None:
    w = torch.empty(6, 4)
    for _ in range(2):  # the second call of each pair would hit the caches
        chunked_init(w, 3, 0, init.xavier_uniform_)
        with pytest.raises(PackedInitError, match=r"dim must be an int, got 0\.0"):
            chunked_init(w, 3, 0.0, init.xavier_uniform_)  # type: ignore[arg-type]  # the bad input under test
        chunked_init(w, [2, 2, 2], 0, init.uniform_, 0.0, 1.0)
        with pytest.raises(PackedInitError, match=r"non-int size 2\.0"):
            chunked_init(w, [2.0, 2, 2], 0, init.uniform_, 0.0, 1.0)  # type: ignore[list-item]  # under test


# -- PackedInitError in place of a torch error keeps that error's type ---------------------------------------------
@pytest.mark.parametrize(
    ("call", "kind"),
    [
        (lambda: chunked_init(torch.empty(6, 4), 3, 0, init.orthogonal_, gain="relu"), TypeError),
        (lambda: chunked(init.normal_)(torch.empty(6, 4), std=-1.0), RuntimeError),
        (lambda: chunked_init(torch.empty(6, 4), 3, 0, init.normal_, std=-1.0), RuntimeError),
        (lambda: chunked_init(torch.empty(6, 4), 3, 0, init.uniform_, 1.0, 0.0), RuntimeError),
        (lambda: chunked(init.kaiming_uniform_)(torch.empty(6), mode="fan_out"), ValueError),
    ],
)
def test_existing_except_clauses_keep_catching(call: Callable[[], object], kind: type[Exception]) -> None:
    with pytest.raises(kind) as info:
        call()
    assert isinstance(info.value, PackedInitError)
    assert isinstance(info.value, ValueError)


# -- property: whenever the message says nothing was written, nothing was -------------------------------------------
_FNS: list[tuple[Callable[..., Tensor], dict[str, Any]]] = [
    (init.xavier_uniform_, {"gain": st.one_of(st.floats(allow_nan=True), st.text(max_size=3), st.none())}),
    (init.orthogonal_, {"gain": st.one_of(st.floats(allow_nan=True), st.text(max_size=3), st.just([1.0]))}),
    (init.uniform_, {"a": st.floats(-3, 3), "b": st.floats(-3, 3)}),
    (init.normal_, {"std": st.one_of(st.floats(-2, 2), st.text(max_size=2))}),
    (init.kaiming_normal_, {"mode": st.sampled_from(["fan_in", "fan_out", "bad"])}),
    (init.sparse_, {"sparsity": st.one_of(st.floats(-1, 2), st.text(max_size=2))}),
    (init.trunc_normal_, {"a": st.floats(-3, 3), "b": st.floats(-3, 3)}),
    (init.eye_, {}),
    (init.dirac_, {}),
]
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.complex64, torch.float8_e4m3fn, torch.bool]


@st.composite
def bad_calls(draw: st.DrawFn) -> tuple[Tensor, Callable[[Tensor], object]]:
    fn, kw_strats = draw(st.sampled_from(_FNS))
    kwargs = {k: draw(s) for k, s in kw_strats.items() if draw(st.booleans())}
    dtype = draw(st.sampled_from(_DTYPES))
    rows = draw(st.integers(1, 4))
    parts = draw(st.integers(1, 3))
    cols = draw(st.integers(1, 4))
    ndim_extra = draw(st.sampled_from([(), (2,)]))
    shape = (rows * parts, cols, *ndim_extra)
    if draw(st.booleans()):
        shape = shape[:1]  # 1-D: fan-based functions reject it
    base = torch.randn(shape).to(dtype) if dtype != torch.bool else torch.randn(shape) > 0
    layout = draw(st.sampled_from(["chunks", "transposed", "none"]))
    if layout == "transposed" and len(shape) >= 2:
        t = base.t().contiguous().t() if len(shape) == 2 else base
        return t, lambda x: chunked_init(x, Layout(1, [shape[1]], transposed=True), None, fn, **kwargs)
    if layout == "none":
        return base, lambda x: chunked(fn)(x, **kwargs)
    return base, lambda x: chunked_init(x, parts, 0, fn, **kwargs)


@given(bad_calls())
def test_nothing_was_written_is_always_true(case: tuple[Tensor, Callable[[Tensor], object]]) -> None:
    tensor, call = case
    before, rng = tensor.clone(), torch.get_rng_state()
    message = ""
    claims = False
    try:
        call(tensor)
    except PackedInitError as e:
        message = str(e)
        claims = "Nothing was written" in message or "packedinit wrote nothing" not in message
    except Exception as e:  # anything else is a torch error passed through: it must claim nothing
        message = str(e)
        assert "Nothing was written" not in message  # the claim is the property under test
    if claims:
        assert torch.equal(bits(before), bits(tensor)), message
        assert torch.equal(rng, torch.get_rng_state()), message

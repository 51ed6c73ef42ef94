"""Bad input raises PackedInitError naming shape, layout and fix -- before anything is written.

Every case checks the message and that the tensor is bit-identical afterwards.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.nn import init

from packedinit import Layout, PackedInitError, chunked, chunked_init

E = 8

#: Exception notes (PEP 678) exist from Python 3.11; on 3.10 packedinit raises the same error without its note.
NOTES = sys.version_info >= (3, 11)


def bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def seeded(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(*shape, generator=g, dtype=dtype)
    return torch.randint(0, 5, shape, generator=g).to(dtype)


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[], Tensor]
    call: Callable[[Tensor], object]
    match: str


def reads_values(t: Tensor) -> Tensor:
    """A user init that cannot run on meta tensors (it reads a value) and rejects the second block."""
    if float(t.abs().sum()) >= 0 and t.shape[0] != E:
        raise ValueError(f"my_init only takes {E} rows")
    return t.uniform_()


def picky(t: Tensor) -> Tensor:
    """A user init with its own shape check: rejects blocks that are not square."""
    if t.shape[0] != t.shape[1]:
        raise ValueError("picky wants square blocks")
    return t.normal_()


def no_generator(t: Tensor) -> Tensor:
    return t.normal_()


def wrong_shape(t: Tensor) -> Tensor:
    return torch.zeros(t.shape[0] + 1, *t.shape[1:])


W = lambda: seeded(3 * E, E)  # noqa: E731  # a short factory keeps the table below readable

CASES: list[Case] = [
    # chunks / dim / sizes
    Case(
        "chunks_do_not_divide",
        lambda: seeded(10, 4),
        lambda t: chunked_init(t, 3, 0, init.xavier_uniform_),
        r"tensor of shape \(10, 4\): dim 0 has length 10, which 3 equal chunks cannot divide; pass sizes instead",
    ),
    Case(
        "sizes_do_not_sum",
        W,
        lambda t: chunked_init(t, [E, E], 0, init.xavier_uniform_),
        r"chunks=\[8, 8\] sum to 16 but dim 0 has length 24; sizes must sum to 24",
    ),
    Case(
        "dim_out_of_range",
        W,
        lambda t: chunked_init(t, 3, 2, init.xavier_uniform_),
        r"dim 2 is out of range for a 2-D tensor; use a dim in \[-2, 1\]",
    ),
    Case(
        "negative_dim_out_of_range",
        W,
        lambda t: chunked_init(t, 3, -3, init.xavier_uniform_),
        r"dim -3 is out of range for a 2-D tensor",
    ),
    Case(
        "zero_size",
        W,
        lambda t: chunked_init(t, [0, 3 * E], 0, init.xavier_uniform_),
        r"chunks=\[0, 24\] has a non-positive or non-int size 0; sizes must be positive ints",
    ),
    Case(
        "negative_size",
        W,
        lambda t: chunked_init(t, [-E, 4 * E], 0, init.xavier_uniform_),
        r"non-positive or non-int size -8",
    ),
    Case(
        "float_size",
        W,
        lambda t: chunked_init(t, [8.0, 16], 0, init.xavier_uniform_),  # type: ignore[list-item]
        r"non-positive or non-int size 8.0",
    ),
    Case(
        "zero_chunks",
        W,
        lambda t: chunked_init(t, 0, 0, init.xavier_uniform_),
        r"chunks=0 must be a positive number of blocks",
    ),
    Case(
        "negative_chunks",
        W,
        lambda t: chunked_init(t, -3, 0, init.xavier_uniform_),
        r"chunks=-3 must be a positive number of blocks",
    ),
    Case(
        "string_chunks",
        W,
        lambda t: chunked_init(t, "3", 0, init.xavier_uniform_),  # type: ignore[arg-type]
        r"chunks must be an int, a sequence of sizes or a Layout, got str",
    ),
    Case(
        "bool_chunks",
        W,
        lambda t: chunked_init(t, True, 0, init.xavier_uniform_),
        r"chunks must be an int, a sequence of sizes or a Layout, got bool",
    ),
    Case(
        "empty_sizes",
        W,
        lambda t: chunked_init(t, [], 0, init.xavier_uniform_),
        r"chunks=\[\] is empty; give at least one block size",
    ),
    Case(
        "float_dim",
        W,
        lambda t: chunked_init(t, 3, 0.0, init.xavier_uniform_),  # type: ignore[arg-type]
        r"dim must be an int, got 0.0",
    ),
    Case(
        "zero_dim_tensor",
        lambda: seeded(1).reshape(()),
        lambda t: chunked_init(t, 1, 0, init.uniform_),
        r"a 0-D tensor has no dim to pack",
    ),
    # Layouts that do not fit
    Case(
        "layout_packed_size",
        W,
        lambda t: chunked_init(t, Layout(0, [E, E]), init_fn=init.orthogonal_),
        r"tensor of shape \(24, 8\) with Layout\(dim=0, sizes=\(8, 8\)\): dim 0 has length 24 but the layout needs "
        r"sum\[8, 8\] = 16; fix sizes/groups or dim",
    ),
    Case(
        "layout_groups",
        W,
        lambda t: chunked_init(t, Layout(0, [2, 2, 2], groups=3), init_fn=init.orthogonal_),
        r"needs 3 x sum\[2, 2, 2\] = 18",
    ),
    Case(
        "layout_dim_disagrees",
        W,
        lambda t: chunked_init(t, Layout(0, [E] * 3), 1, init.orthogonal_),
        r"dim=1 disagrees with Layout\(dim=0, sizes=\(8, 8, 8\)\); pass dim=None with a Layout",
    ),
    Case(
        "layout_batch_dims_too_many",
        W,
        lambda t: chunked_init(t, Layout(1, [E], batch_dims=2), init_fn=init.normal_),
        r"batch_dims=2 leaves no dims for the matrix",
    ),
    Case(
        "layout_packs_a_batch_dim",
        lambda: seeded(2, 3 * E, E),
        lambda t: chunked_init(t, Layout(0, [1, 1], batch_dims=1), init_fn=init.normal_),
        r"the packed dim 0 is one of the 1 batch dims; pack a dim >= 1 or lower batch_dims",
    ),
    Case(
        "layout_transposed_1d",
        lambda: seeded(3 * E),
        lambda t: chunked_init(t, Layout(0, [E] * 3, transposed=True), init_fn=init.normal_),
        r"transposed=True needs at least 2 dims after the batch dims",
    ),
    # functions and their per-block specification
    Case("no_init_fn", W, lambda t: chunked_init(t, 3, 0), r"no init_fn given; pass e\.g\. init_fn="),
    Case(
        "init_fn_not_callable",
        W,
        lambda t: chunked_init(t, 3, 0, 5),  # type: ignore[arg-type]
        r"init_fn must be a function, a list of functions \(one per block\) or a mapping by block name, got int",
    ),
    Case(
        "per_block_list_wrong_length",
        W,
        lambda t: chunked_init(t, 3, 0, [init.xavier_uniform_, init.zeros_]),
        r"2 init functions for 3 blocks; give one per block \(None leaves a block untouched\)",
    ),
    Case(
        "per_block_list_not_callable",
        W,
        lambda t: chunked_init(t, 3, 0, [init.xavier_uniform_, "zeros", init.zeros_]),  # type: ignore[list-item]
        r"init_fn\[1\] = 'zeros' is not callable",
    ),
    Case(
        "unknown_block_name",
        W,
        lambda t: chunked_init(t, Layout(0, [E] * 3, names=("q", "k", "v")), init_fn={"x": init.zeros_}),
        r"init_fn names block 'x', which the layout does not have; known names: \['q', 'k', 'v'\]",
    ),
    Case(
        "block_name_without_names",
        W,
        lambda t: chunked_init(t, 3, 0, {"q": init.zeros_}),
        r"init_fn names block 'q', which the layout does not have; known names: none: give the Layout names",
    ),
    Case(
        "block_index_out_of_range",
        W,
        lambda t: chunked_init(t, 3, 0, {3: init.zeros_}),
        r"init_fn key 3 is neither a block name nor a part index in 0\.\.2",
    ),
    Case(
        "block_given_twice",
        W,
        lambda t: chunked_init(t, Layout(0, [E] * 3, names=("q", "k", "v")), init_fn={"q": init.zeros_, 0: init.ones_}),
        r"init_fn gives part 0 twice \(as 0\); give each block once",
    ),
    Case(
        "mapping_value_not_callable",
        W,
        lambda t: chunked_init(t, 3, 0, {0: None}),  # type: ignore[dict-item]
        r"init_fn\[0\] = None is not callable",
    ),
    # dtypes
    Case(
        "int_tensor_random_init",
        lambda: seeded(3 * E, E, dtype=torch.int64),
        lambda t: chunked_init(t, 3, 0, init.xavier_uniform_),
        r"torch\.nn\.init\.xavier_uniform_ draws random floats but the tensor is torch\.int64; init a floating-point",
    ),
    Case(
        "bool_tensor_random_init",
        lambda: seeded(3 * E, E, dtype=torch.bool),
        lambda t: chunked_init(t, 3, 0, init.normal_),
        r"draws random floats but the tensor is torch\.bool",
    ),
    Case(
        "int_tensor_unpacked",
        lambda: seeded(3 * E, E, dtype=torch.int32),
        lambda t: chunked(init.kaiming_uniform_)(t),
        r"tensor of shape \(24, 8\): torch\.nn\.init\.kaiming_uniform_ draws random floats but the tensor is "
        r"torch\.int32",
    ),
    Case(
        "int_tensor_orthogonal",
        lambda: seeded(3 * E, E, dtype=torch.uint8),
        lambda t: chunked_init(t, 3, 0, init.orthogonal_),
        r"orthogonal_ draws random floats but the tensor is torch\.uint8; init a real floating-point tensor",
    ),
    Case(
        "complex_trunc_normal_unpacked",
        lambda: seeded(3 * E, E, dtype=torch.complex64),
        lambda t: chunked(init.trunc_normal_)(t),  # torch's own trunc_normal_ writes, then fails, here
        r"trunc_normal_ draws random floats but the tensor is torch\.complex64; init a real floating-point tensor",
    ),
    Case(
        "int_partial_random",
        lambda: seeded(3 * E, E, dtype=torch.int16),
        lambda t: chunked_init(t, 3, 0, functools.partial(init.normal_, std=0.1)),
        r"partial\(torch\.nn\.init\.normal_\) draws random floats",
    ),
    # functions that reject a block's shape
    Case(
        "xavier_on_1d_blocks",
        lambda: seeded(4 * E),
        lambda t: chunked_init(t, Layout(0, [E] * 4, names=("i", "f", "g", "o")), init_fn=init.xavier_uniform_),
        r"xavier_uniform_ rejected block 'i' of logical shape \(8,\): ValueError: Fan in and fan out can not be "
        r"computed .* A 1-D block \(a bias\) has no fan_in/fan_out: use uniform_/normal_/zeros_ for biases\. "
        r"Nothing was written",
    ),
    Case(
        "xavier_on_1d_unpacked",
        lambda: seeded(E),
        lambda t: chunked(init.xavier_normal_)(t),
        r"tensor of shape \(8,\): torch\.nn\.init\.xavier_normal_ rejected the tensor: ValueError",
    ),
    Case(
        "orthogonal_on_1d_blocks",
        lambda: seeded(3 * E),
        lambda t: chunked_init(t, 3, 0, init.orthogonal_),
        r"orthogonal_ rejected block 'part 0' of logical shape \(8,\)",
    ),
    Case(
        "eye_on_3d_blocks",
        lambda: seeded(3 * E, E, 3),
        lambda t: chunked_init(t, 3, 0, init.eye_),
        r"eye_ rejected block 'part 0' of logical shape \(8, 8, 3\): ValueError: Only tensors with 2 dimensions",
    ),
    Case(
        "dirac_on_2d_blocks",
        W,
        lambda t: chunked_init(t, 3, 0, init.dirac_),
        r"dirac_ rejected block 'part 0' of logical shape \(8, 8\)",
    ),
    Case(
        "dirac_groups_do_not_divide",
        lambda: seeded(3 * E, E, 3),
        lambda t: chunked_init(t, 3, 0, init.dirac_, groups=3),
        r"dirac_ rejected block 'part 0' .* dim 0 must be divisible by groups",
    ),
    Case(
        "sparse_on_3d_experts",
        lambda: seeded(2, 3 * E, E),
        lambda t: chunked_init(t, Layout(1, [E] * 3), init_fn=init.sparse_, sparsity=0.1),
        r"sparse_ rejected block 'part 0' of logical shape \(2, 8, 8\)",
    ),
    Case(
        "rejected_only_by_a_later_block",
        lambda: seeded(E + 4, E),
        lambda t: chunked_init(t, [E, 4], 0, picky),
        r"picky rejected block 'part 1' of logical shape \(4, 8\): ValueError: picky wants square blocks\. "
        r"Nothing was written",
    ),
    Case(
        "one_fn_of_several_rejects",
        lambda: seeded(4 * E),
        lambda t: chunked_init(t, 4, 0, [init.zeros_, init.ones_, init.normal_, init.kaiming_normal_]),
        r"kaiming_normal_ rejected block 'part 3' of logical shape \(8,\)",
    ),
    # arguments
    Case(
        "kaiming_bad_mode",
        W,
        lambda t: chunked_init(t, 3, 0, init.kaiming_uniform_, mode="fan_sideways"),
        r"kaiming_uniform_ rejected block 'part 0' of logical shape \(8, 8\): ValueError: Mode fan_sideways not "
        r"supported",
    ),
    Case(
        "kaiming_bad_nonlinearity",
        W,
        lambda t: chunked_init(t, 2, 1, init.kaiming_normal_, nonlinearity="gelu"),
        r"Unsupported nonlinearity gelu",
    ),
    Case(
        "unexpected_keyword",
        W,
        lambda t: chunked_init(t, 3, 0, init.xavier_uniform_, gian=2.0),
        r"TypeError: xavier_uniform_\(\) got an unexpected keyword argument 'gian'",
    ),
    Case(
        "unexpected_keyword_unpacked",
        W,
        lambda t: chunked(init.xavier_uniform_)(t, gian=2.0),  # type: ignore[call-overload]
        r"tensor of shape \(24, 8\): torch\.nn\.init\.xavier_uniform_ rejected the tensor: TypeError",
    ),
    Case(
        "zeros_with_an_argument",
        W,
        lambda t: chunked_init(t, 3, 0, [init.zeros_, init.normal_, init.normal_], std=0.1),
        r"zeros_ rejected block 'part 0' .* TypeError: zeros_\(\) got an unexpected keyword argument 'std'",
    ),
    Case(
        "uniform_empty_range_later_block",
        W,
        lambda t: chunked_init(t, 3, 0, [init.zeros_, init.uniform_, init.uniform_], a=1.0, b=0.0),
        r"a=1\.0 > b=0\.0 is an empty range \(torch raises\); use a <= b",
    ),
    Case(
        "uniform_empty_range_unpacked",
        W,
        lambda t: chunked(init.uniform_)(t, 1.0, 0.0),
        r"uniform_ rejected the tensor: RuntimeError: uniform_ expects to return a \[from, to\) range",
    ),
    Case(
        "trunc_normal_empty_range",
        W,
        lambda t: chunked_init(t, 2, 1, init.trunc_normal_, a=2.0, b=-2.0),
        r"trunc_normal_ with a=2\.0 > b=-2\.0 is an empty range",
    ),
    Case(
        "xavier_negative_gain",
        W,
        lambda t: chunked_init(t, 3, 0, init.xavier_uniform_, gain=-1.0),
        r"xavier_uniform_ with gain=-1\.0 makes the bound negative \(torch raises\); use gain >= 0",
    ),
    Case(
        "partial_negative_gain",
        W,
        lambda t: chunked_init(t, 3, 0, functools.partial(init.xavier_uniform_, gain=-2.0)),
        r"gain=-2\.0 makes the bound negative",
    ),
    Case(
        "normal_negative_std",
        W,
        lambda t: chunked_init(t, 3, 0, init.normal_, std=-1.0),
        r"normal_ rejected block 'part 0' .* normal expects std >= 0\.0",
    ),
    Case(
        "normal_negative_std_unpacked",
        W,
        lambda t: chunked_init(t, None, None, init.normal_, std=-1.0),
        r"normal_ rejected the tensor: RuntimeError: normal expects std >= 0\.0",
    ),
    # generators
    Case(
        "generator_not_a_generator",
        W,
        lambda t: chunked_init(t, 3, 0, init.normal_, generator=0),
        r"generator must be a torch\.Generator, got int",
    ),
    Case(
        "generator_not_a_generator_unpacked",
        W,
        lambda t: chunked(init.normal_)(t, generator=0),  # type: ignore[call-overload]
        r"normal_ rejected the tensor: TypeError",
    ),
    Case(
        "generator_but_fn_takes_none",
        W,
        lambda t: chunked_init(t, 3, 0, no_generator, generator=torch.Generator()),
        r"generator= was given but no_generator takes no generator and would draw from the global RNG; give it a "
        r"`generator` parameter or drop generator=",
    ),
    Case(
        "generator_but_fn_takes_none_unpacked",
        W,
        lambda t: chunked_init(t, None, None, no_generator, generator=torch.Generator()),
        r"generator= was given but no_generator takes no generator",
    ),
    # user functions that misbehave
    Case(
        "user_fn_returns_wrong_shape",
        W,
        lambda t: chunked_init(t, 2, 1, wrong_shape),
        r"wrong_shape rejected block 'part 0' .* returned a tensor of shape \(25, 4\) for a block of shape \(24, 4\)",
    ),
    Case(
        "user_fn_returns_wrong_shape_unpacked",
        W,
        lambda t: chunked(wrong_shape)(t),
        r"wrong_shape rejected the tensor: ValueError: wrong_shape returned a tensor of shape \(25, 8\)",
    ),
    Case(
        "user_fn_that_cannot_run_on_meta_fails_late",
        lambda: seeded(E + 4, E),
        lambda t: chunked_init(t, [E, 4], 0, reads_values),
        r"reads_values rejected block 'part 1' of logical shape \(4, 8\): ValueError: my_init only takes 8 rows\. "
        r"Nothing was written",
    ),
    # what is not a tensor, and inference tensors outside inference mode
    Case(
        "not_a_tensor",
        lambda: seeded(1),
        lambda t: chunked_init(np.zeros((6, 2)), 3, 0, init.zeros_),  # type: ignore[arg-type]
        r"expected a torch\.Tensor \(or nn\.Module with chunked\), got ndarray",
    ),
    Case(
        "inference_tensor_outside_inference_mode",
        lambda: _inference_tensor(3 * E, E),
        lambda t: chunked_init(t, 2, 1, init.xavier_uniform_),
        r"was created under torch\.inference_mode\(\) and cannot be written outside it",
    ),
    Case(
        "inference_tensor_one_block_layout",
        lambda: _inference_tensor(3 * E, E),
        lambda t: chunked_init(t, Layout(1, [E], transposed=True), init_fn=init.xavier_uniform_),
        r"tensor of shape \(24, 8\) with Layout\(dim=1, sizes=\(8,\), transposed=True\): the tensor was created "
        r"under torch\.inference_mode\(\)",
    ),
    Case(
        "expanded_tensor",
        lambda: seeded(E).expand(3, E),
        lambda t: chunked_init(t, 3, 0, init.normal_),
        r"dim 0 has stride 0 \(an expanded tensor\): its rows share memory",
    ),
    Case(
        "expanded_tensor_unpacked",
        lambda: seeded(E).expand(3, E),
        lambda t: chunked(init.normal_)(t),
        r"tensor of shape \(3, 8\): dim 0 has stride 0",
    ),
    # meta tensors are validated too
    Case(
        "meta_tensor_bad_block",
        lambda: torch.empty(3 * E, device="meta"),
        lambda t: chunked_init(t, 3, 0, init.xavier_uniform_),
        r"xavier_uniform_ rejected block 'part 0'",
    ),
    # a parameter name, when known, is in the message
    Case(
        "eager_chunked_bad_chunks",
        W,
        lambda t: chunked(init.zeros_, "3"),  # type: ignore[arg-type]
        r"chunked\(chunks='3'\): chunks must be an int, a sequence of sizes or a Layout, got str",
    ),
    Case("eager_chunked_zero_chunks", W, lambda t: chunked(init.zeros_, 0), r"chunks must be a positive number"),
    Case(
        "eager_chunked_bad_dim",
        W,
        lambda t: chunked(init.zeros_, 3, "0"),  # type: ignore[arg-type]
        r"chunked\(dim='0'\): dim must be an int",
    ),
    Case("eager_chunked_bad_sizes", W, lambda t: chunked(init.zeros_, [4, 0]), r"sizes must be a non-empty list"),
    Case(
        "eager_chunked_not_callable",
        W,
        lambda t: chunked(3),  # type: ignore[arg-type]
        r"chunked\(init_fn=\.\.\.\) needs a function, got int",
    ),
]


def _inference_tensor(*shape: int) -> Tensor:
    with torch.inference_mode():
        return seeded(*shape)


def test_there_are_at_least_25_distinct_cases() -> None:
    assert len({c.id for c in CASES}) == len(CASES) >= 25
    assert len({c.match for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_before_writing(case: Case) -> None:
    t = case.make()
    before = bits(t) if not t.is_meta else None
    rng = torch.get_rng_state()
    with pytest.raises(PackedInitError, match=case.match) as info:
        case.call(t)
    assert isinstance(info.value, ValueError)
    if before is not None:
        assert torch.equal(bits(t), before), "the tensor was written"
    assert torch.equal(torch.get_rng_state(), rng)


def test_unpacked_inference_tensor_is_exactly_torch() -> None:
    """chunks=None: torch's error type and words, but refused before torch writes and draws (issue 20 item 8)."""
    t = _inference_tensor(3 * E, E)
    before, rng = t.clone(), torch.get_rng_state()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode") as info:
        chunked(init.xavier_uniform_)(t)
    assert isinstance(info.value, PackedInitError)
    assert "init it inside `with torch.inference_mode():`" in str(info.value)
    assert torch.equal(t, before), "the tensor was written"
    assert torch.equal(torch.get_rng_state(), rng), "the RNG advanced"


def test_parameter_name_is_in_the_message() -> None:
    from packedinit.engine.plan import Request
    from packedinit.engine.run import run

    t = seeded(10, 4)
    with pytest.raises(PackedInitError, match=r"parameter 'attn\.in_proj_weight' of shape \(10, 4\)"):
        run(Request(t, 3, 0, init.xavier_uniform_, (), {}, "attn.in_proj_weight"))
    with pytest.raises(PackedInitError, match=r"parameter 'lstm\.bias' of shape \(8,\) with Layout"):
        run(Request(seeded(8), 2, 0, init.xavier_uniform_, (), {}, "lstm.bias"))
    with pytest.raises(PackedInitError, match=r"parameter 'fc\.bias' of shape \(8,\): torch\.nn\.init\.xavier"):
        run(Request(seeded(8), None, None, init.xavier_uniform_, (), {}, "fc.bias"))


def test_errors_are_not_swallowed() -> None:
    """What is not bad input (here: a bug in the init function) propagates unchanged."""

    def buggy(t: Tensor) -> Tensor:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        chunked_init(seeded(8, 4), 2, 0, buggy)

    def oom(t: Tensor) -> Tensor:
        if not t.is_meta:
            raise torch.OutOfMemoryError("pretend")
        return t

    t = seeded(8, 4)
    before = bits(t)
    with pytest.raises(torch.OutOfMemoryError):
        chunked_init(t, 2, 0, oom)
    assert torch.equal(bits(t), before)


def test_a_late_failure_of_an_unverifiable_function_is_undone() -> None:
    """A function that cannot run on meta is guarded by a copy: block 0 written, block 1 fails -> restored."""
    calls: list[tuple[int, ...]] = []

    def second_fails(t: Tensor) -> Tensor:
        if t.is_meta:
            raise NotImplementedError("cannot run on meta")
        calls.append(tuple(t.shape))
        t.fill_(7.0)
        if len(calls) == 2:
            raise RuntimeError("flaky")
        return t

    t = seeded(3 * E, E)
    before = bits(t)
    with pytest.raises(RuntimeError, match="flaky"):
        chunked_init(t, 3, 0, second_fails)
    assert calls == [(E, E), (E, E)]
    assert torch.equal(bits(t), before)


def test_a_late_failure_of_a_verified_function_says_what_was_written() -> None:
    """Only a function that passes the meta dry run and then fails on real data can leave earlier blocks written."""
    seen: list[int] = []

    def fails_second_time(t: Tensor) -> Tensor:
        if not t.is_meta:
            seen.append(1)
            if len(seen) == 2:
                raise RuntimeError("disk on fire")
        return t.zero_()

    with pytest.raises(RuntimeError, match="disk on fire") as info:
        chunked_init(seeded(3 * E, E), 3, 0, fails_second_time)
    notes = getattr(info.value, "__notes__", [])
    if NOTES:
        assert any("blocks before 'part 1'" in n and "were already written" in n for n in notes)


def test_tensor_subclass_inputs_are_still_checked() -> None:
    p = torch.nn.Parameter(seeded(10, 4))
    before = bits(p)
    with pytest.raises(PackedInitError, match="which 3 equal chunks cannot divide"):
        chunked(init.xavier_uniform_, 3)(p)
    assert torch.equal(bits(p), before)
    with pytest.raises(PackedInitError, match="init_fn must be a function"):
        chunked_init(p, None, None, "xavier")  # type: ignore[arg-type]
    assert torch.equal(bits(p), before)


def test_any_exception_type_is_acceptable_from_meta_but_real_rejections_convert() -> None:
    """A user function raising AttributeError on meta is 'unverified'; on real data it propagates unchanged."""

    def attr_error(t: Tensor, **kw: Any) -> Tensor:
        raise AttributeError("nope")

    t = seeded(3 * E, E)
    before = bits(t)
    with pytest.raises(AttributeError, match="nope"):
        chunked_init(t, 3, 0, attr_error)
    assert torch.equal(bits(t), before)

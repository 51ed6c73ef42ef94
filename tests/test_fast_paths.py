"""The executor's fast paths draw exactly what separate tensors draw.

Direct draws (the one `uniform_`/`normal_` call an init function makes, made by the engine),
adjacent blocks merged into one call, transposed blocks drawn in row bands, and write programs
reused across calls: each is checked bit for bit against torch's own function on separate
tensors, in block order, from the same seed — at sizes on both sides of normal_'s 16-element
groups, where merging would change the numbers if the rule were wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.nn import init

from packedinit import Layout, chunked_init

FNS: list[Callable[..., Tensor]] = [
    init.uniform_,
    init.normal_,
    init.xavier_uniform_,
    init.xavier_normal_,
    functools.partial(init.kaiming_uniform_, a=0.2, mode="fan_out"),
    functools.partial(init.kaiming_normal_, nonlinearity="relu"),
    functools.partial(init.normal_, mean=0.5, std=2.0),
]
IDS = ["uniform", "normal", "xavier_u", "xavier_n", "kaiming_u", "kaiming_n", "normal_args"]


def bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def separate(shapes: list[tuple[int, ...]], fn: Callable[..., Tensor], dtype: torch.dtype) -> list[Tensor]:
    torch.manual_seed(7)
    return [fn(torch.empty(s, dtype=dtype)) for s in shapes]


@pytest.mark.parametrize("fn", FNS, ids=IDS)
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 16, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_contiguous_blocks_merged_or_not(fn: Callable[..., Tensor], rows: int, dtype: torch.dtype) -> None:
    cols = 7 if rows % 2 else 16  # block sizes that are and are not multiples of 16
    want = separate([(rows, cols)] * 3, fn, dtype)
    for _ in range(2):  # the second call replays the cached write program
        w = torch.empty(3 * rows, cols, dtype=dtype)
        torch.manual_seed(7)
        chunked_init(w, 3, 0, fn)
        assert torch.equal(bits(w), bits(torch.cat(want)))


@pytest.mark.parametrize("fn", FNS, ids=IDS)
@pytest.mark.parametrize(("inp", "out"), [(5, 3), (16, 4), (40, 9), (130, 33), (600, 17)])
def test_transposed_blocks_in_bands(
    fn: Callable[..., Tensor], inp: int, out: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import packedinit.execute as ex

    monkeypatch.setattr(ex, "_BAND", 256)  # small bands, so that blocks this size take several
    want = separate([(out, inp)] * 3, fn, torch.float32)
    w = torch.empty(inp, 3 * out)  # GPT-2 Conv1D storage (in, out)
    torch.manual_seed(7)
    chunked_init(w, Layout(1, [out] * 3, transposed=True), None, fn)
    assert torch.equal(bits(w), bits(torch.cat([t.t() for t in want], 1)))


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_stacked_experts_and_interleaved_transposed(fn: Callable[..., Tensor]) -> None:
    n, e, i = 3, 6, 5  # GPT-OSS gate_up (n, E, 2I), gate/up interleaved along the last dim
    want = separate([(i, e)] * (2 * n), fn, torch.float32)
    w = torch.empty(n, e, 2 * i)
    torch.manual_seed(7)
    chunked_init(w, Layout(2, [1, 1], groups=i, transposed=True, batch_dims=1), None, fn)
    ref = torch.empty(n, e, 2 * i)
    for k in range(n):
        ref[k, :, 0::2] = want[2 * k].t()
        ref[k, :, 1::2] = want[2 * k + 1].t()
    assert torch.equal(bits(w), bits(ref))


@pytest.mark.parametrize("fn", FNS, ids=IDS)
@pytest.mark.parametrize(("inp", "out"), [(5, 3), (64, 96), (130, 33)])
def test_single_transposed_block_one_copy(fn: Callable[..., Tensor], inp: int, out: int) -> None:
    (want,) = separate([(out, inp)], fn, torch.float32)
    w = torch.empty(inp, out)  # GPT-2 Conv1D c_fc / c_proj: one block, stored (in, out)
    torch.manual_seed(7)
    chunked_init(w, Layout(1, [out], transposed=True), None, fn)
    assert torch.equal(bits(w), bits(want.t()))

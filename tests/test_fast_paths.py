"""The executor's fast paths draw exactly what separate tensors draw.

Direct draws (the one `uniform_`/`normal_` call an init function makes, made by the engine),
adjacent blocks merged into one call, transposed blocks drawn in stored order (in bands for normal_), and write programs
reused across calls: each is checked bit for bit against torch's own function on separate
tensors, in block order, from the same seed — at sizes on both sides of normal_'s 16-element
groups, where merging would change the numbers if the rule were wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
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


# -- transposed storage: the reference is the separate tensors in their stored orientation ------------
# (three separate GPT-2 Conv1D weights (in, out)), drawn with the logical block's fans (see
# packedinit.orient). torch's own functions give it: the uniform family on the (out, in) view of the
# stored tensor (CPU uniform_ fills in memory order), the normal family on the stored tensor itself
# with fan_in and fan_out swapped (kaiming's mode; xavier is symmetric in them).
STORED_FNS: list[Callable[..., Tensor]] = [
    *FNS,
    init.trunc_normal_,
    functools.partial(init.trunc_normal_, std=0.5, a=-1.0, b=1.5),
    functools.partial(init.constant_, val=0.25),
    init.zeros_,
    functools.partial(init.xavier_uniform_, gain=np.float64(1.5)),  # no direct draw: fn on the (out, in) view
]
STORED_IDS = [*IDS, "trunc_normal", "trunc_args", "constant", "zeros", "xavier_u_npgain"]
_UNIFORM_FAMILY = (init.uniform_, init.xavier_uniform_, init.kaiming_uniform_)
_SWAP = {"fan_in": "fan_out", "fan_out": "fan_in"}


def stored_one(fn: Callable[..., Tensor], logical: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """``fn`` on a separate tensor of the block's stored shape, with the logical block's fans."""
    t = torch.empty((logical[1], logical[0], *logical[2:]), dtype=dtype)
    base = fn.func if isinstance(fn, functools.partial) else fn
    if base in _UNIFORM_FAMILY:
        fn(t.transpose(0, 1))
    elif base is init.kaiming_normal_:
        kw = dict(fn.keywords) if isinstance(fn, functools.partial) else {}
        init.kaiming_normal_(t, **{**kw, "mode": _SWAP[kw.get("mode", "fan_in")]})
    else:
        fn(t)
    return t


def stored(logical: list[tuple[int, ...]], fn: Callable[..., Tensor], dtype: torch.dtype) -> list[Tensor]:
    torch.manual_seed(7)
    return [stored_one(fn, s, dtype) for s in logical]


def test_stored_reference_is_torch_on_the_stored_tensor() -> None:
    # the reference itself: kaiming_normal_ with the mode swapped on (in, out) has the std of the logical (out, in)
    torch.manual_seed(0)
    t = stored_one(functools.partial(init.kaiming_normal_, nonlinearity="relu"), (8, 4000), torch.float32)
    assert t.shape == (4000, 8)
    assert abs(t.std().item() - (2 / 4000) ** 0.5) < 0.05 * (2 / 4000) ** 0.5


@pytest.mark.parametrize("fn", STORED_FNS, ids=STORED_IDS)
@pytest.mark.parametrize(("inp", "out"), [(5, 3), (16, 4), (40, 9), (130, 33), (600, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_blocks_drawn_in_stored_order(
    fn: Callable[..., Tensor], inp: int, out: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    import packedinit.engine.orient as orient

    monkeypatch.setattr(orient, "BAND", 256)  # small bands, so that blocks this size take several
    want = stored([(out, inp)] * 3, fn, dtype)
    w = torch.empty(inp, 3 * out, dtype=dtype)  # GPT-2 Conv1D storage (in, out)
    torch.manual_seed(7)
    chunked_init(w, Layout(1, [out] * 3, transposed=True), None, fn)
    assert torch.equal(bits(w), bits(torch.cat(want, 1)))


@pytest.mark.parametrize("fn", STORED_FNS, ids=STORED_IDS)
def test_stacked_experts_and_interleaved_transposed(fn: Callable[..., Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    import packedinit.engine.orient as orient

    monkeypatch.setattr(orient, "BAND", 64)
    n, e, i = 3, 40, 5  # GPT-OSS gate_up (n, E, 2I), gate/up interleaved along the last dim
    want = stored([(i, e)] * (2 * n), fn, torch.float32)
    w = torch.empty(n, e, 2 * i)
    torch.manual_seed(7)
    chunked_init(w, Layout(2, [1, 1], groups=i, transposed=True, batch_dims=1), None, fn)
    ref = torch.empty(n, e, 2 * i)
    for k in range(n):
        ref[k, :, 0::2] = want[2 * k]
        ref[k, :, 1::2] = want[2 * k + 1]
    assert torch.equal(bits(w), bits(ref))


@pytest.mark.parametrize("fn", STORED_FNS, ids=STORED_IDS)
@pytest.mark.parametrize(("inp", "out"), [(5, 3), (64, 96), (130, 33)])
def test_single_transposed_block_one_draw(fn: Callable[..., Tensor], inp: int, out: int) -> None:
    (want,) = stored([(out, inp)], fn, torch.float32)
    w = torch.empty(inp, out)  # GPT-2 Conv1D c_fc / c_proj: one block, stored (in, out)
    torch.manual_seed(7)
    chunked_init(w, Layout(1, [out], transposed=True), None, fn)
    assert torch.equal(bits(w), bits(want))


LOGICAL_FNS: list[Callable[..., Tensor]] = [
    init.orthogonal_,
    functools.partial(init.sparse_, sparsity=0.5),
    init.eye_,
    functools.partial(init.xavier_normal_, gain=np.float64(1.5)),  # no direct draw: kept logical
    lambda t: t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape)),  # a function of the user's
]


@pytest.mark.parametrize("fn", LOGICAL_FNS, ids=["orthogonal", "sparse", "eye", "xavier_n_npgain", "user"])
def test_orientation_dependent_functions_keep_the_logical_block(fn: Callable[..., Tensor]) -> None:
    inp, out = 12, 5
    torch.manual_seed(7)
    want = [fn(torch.empty(out, inp)) for _ in range(3)]
    w = torch.empty(inp, 3 * out)
    torch.manual_seed(7)
    chunked_init(w, Layout(1, [out] * 3, transposed=True), None, fn)
    assert torch.equal(bits(w), bits(torch.cat([t.t() for t in want], 1)))


def test_transposed_dtensor_path_draws_like_the_local_one() -> None:
    # the shard sink (DTensor path) fills whole blocks in a buffer: the same stored-order reference
    from packedinit.engine.distributed import ShardSink
    from packedinit.engine.execute import Scratch, execute
    from packedinit.engine.plan import Request, make_plan

    inp, out = 40, 9
    lay = Layout(1, [out] * 3, transposed=True)
    for fn in (init.xavier_normal_, init.kaiming_uniform_, init.trunc_normal_, init.orthogonal_):
        local = torch.empty(inp, 3 * out)
        torch.manual_seed(3)
        chunked_init(local, lay, None, fn)
        whole = torch.empty(inp, 3 * out)
        plan = make_plan(Request(whole, lay, None, fn))
        assert plan is not None
        torch.manual_seed(3)
        execute(plan, ShardSink(whole, [range(inp), range(3 * out)]), Scratch())
        assert torch.equal(bits(whole), bits(local)), fn

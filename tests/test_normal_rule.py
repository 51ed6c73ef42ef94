"""Issue 20 item 1: when one CPU ``normal_`` call over adjacent blocks draws what one call per block draws.

torch's CPU kernel fills a contiguous tensor of >= 16 elements in groups of 16 (the tail
redrawn as the last 16) and draws a smaller one by a scalar path. The engine merges adjacent
blocks into one call only under :func:`packedinit.engine.traits.normal_merges`; these tests prove the
rule exact against torch itself (bit for bit, RNG state after included) and the engine
bit-identical to separate tensors on every split.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.init import kaiming_normal_, normal_

from packedinit import Layout, chunked_init
from packedinit.engine.traits import normal_merges

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _separate(sizes: list[int], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = torch.cat([torch.empty(s, dtype=dtype).normal_(generator=g) for s in sizes])
    return out, torch.empty(7, dtype=dtype).normal_(generator=g)  # the state after: the next draw


def _merged(sizes: list[int], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(sum(sizes), dtype=dtype).normal_(generator=g)
    return out, torch.empty(7, dtype=dtype).normal_(generator=g)


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_rule_is_exact_on_every_two_block_split_up_to_64() -> None:
    """Every (a, b) with a + b <= 64: merged == separate exactly when the rule says so."""
    wrong = []
    for n in range(2, 65):
        for a in range(1, n):
            sizes = [a, n - a]
            if _same(_merged(sizes, torch.float32, n), _separate(sizes, torch.float32, n)) != normal_merges(sizes):
                wrong.append(sizes)
    assert not wrong


@given(
    sizes=st.lists(st.integers(1, 40), min_size=2, max_size=6).filter(lambda s: sum(s) <= 64),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_rule_is_exact_on_any_split_and_dtype(sizes: list[int], dtype: torch.dtype, seed: int) -> None:
    assert _same(_merged(sizes, dtype, seed), _separate(sizes, dtype, seed)) == normal_merges(sizes)


@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6).filter(lambda s: sum(s) <= 64),
    seed=st.integers(0, 2**31 - 1),
)
def test_engine_equals_separate_tensors_on_any_split(sizes: list[int], seed: int) -> None:
    """chunked_init(normal_) over any split of <= 64 elements is bit-identical to the separate draws."""
    torch.manual_seed(seed)
    got = chunked_init(torch.empty(sum(sizes)), sizes, 0, normal_)
    after = torch.randn(3)
    torch.manual_seed(seed)
    want = torch.cat([normal_(torch.empty(s)) for s in sizes])
    assert torch.equal(got, want)
    assert torch.equal(after, torch.randn(3))


def test_the_reported_split() -> None:
    """[16, 4, 4]: the earlier sizes are multiples of 16 but the small blocks take torch's scalar path."""
    torch.manual_seed(0)
    got = chunked_init(torch.empty(24), [16, 4, 4], 0, normal_)
    torch.manual_seed(0)
    want = torch.cat([normal_(torch.empty(s)) for s in (16, 4, 4)])
    assert torch.equal(got, want)


def test_gqa_kaiming_normal_bias_sized_blocks() -> None:
    """A GQA qkv of (16 + 4 + 4, 1) rows: the k and v blocks have 4 elements each."""
    layout = Layout(0, [16, 4, 4], names=("q", "k", "v"))
    torch.manual_seed(1)
    got = chunked_init(torch.empty(24, 1), layout, None, kaiming_normal_)
    torch.manual_seed(1)
    want = torch.cat([kaiming_normal_(torch.empty(s, 1)) for s in (16, 4, 4)])
    assert torch.equal(got, want)

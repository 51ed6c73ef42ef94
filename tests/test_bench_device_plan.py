"""Issue 23's benchmark rows: the CUDA plan counted on a CPU stand-in, and the whole-model idiom cases."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cases import IDIOMS, build_cases, materialize
from benchmarks.device_plan import device_plan
from benchmarks.probes import count_launches
from benchmarks.runner import FNS, build_variants

SMOKE = {c.name: c for c in build_cases(smoke=True)}


@pytest.mark.parametrize("fn_name", ["xavier_uniform_", "kaiming_normal_"])
@pytest.mark.parametrize("case", ["gpt2_conv1d_E32", "moe_gptoss_4x32x16", "mha_in_proj_E32", "lstm_stack_H16_L2"])
def test_device_plan_takes_at_most_two_ops_per_block(case: str, fn_name: str) -> None:
    m = materialize(SMOKE[case], torch.float32, torch.device("cpu"))
    run, blocks = device_plan(m, FNS[fn_name])
    run()  # the first call also fills packedinit's caches
    ops = count_launches(run)
    assert blocks > 1
    assert ops <= 2 * blocks, (ops, blocks)  # one draw, and a copy where the block is not contiguous


def test_device_plan_writes_what_the_cpu_plan_writes_up_to_the_rng() -> None:
    # the same blocks are written, in the same order, from the same distribution: here constant_
    m = materialize(SMOKE["gpt2_conv1d_E32"], torch.float32, torch.device("cpu"))
    run, _ = device_plan(m, torch.nn.init.ones_)
    m.tensors[0].zero_()
    run()
    assert bool((m.tensors[0] == 1).all())


def test_whole_model_idioms_have_rows() -> None:
    names = {c.name for c in build_cases()}
    for n in (2_000, 10_000):
        for idiom in IDIOMS:
            assert f"model_linear{n}x64_{idiom}" in names


@pytest.mark.parametrize("idiom", IDIOMS)
def test_idiom_rows_write_what_the_plain_loop_writes(idiom: str) -> None:
    m = materialize(SMOKE[f"model_linear20x8_{idiom}"], torch.float32, torch.device("cpu"))
    v = build_variants(m, "kaiming_normal_", with_copy=False)
    torch.manual_seed(0)
    v["plain"]()  # type: ignore[operator]
    want = [t.clone() for t in m.tensors]
    torch.manual_seed(0)
    v["chunked"]()  # type: ignore[operator]
    assert all(torch.equal(a, b) for a, b in zip(want, m.tensors, strict=True))

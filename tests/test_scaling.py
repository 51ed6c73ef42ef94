"""Issue 20 item 10: planning linear in blocks (the scaling rows live in benchmarks/scaling.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) does not put the repo root on sys.path
    sys.path.insert(0, str(ROOT))

from benchmarks import scaling  # noqa: E402  (needs the sys.path line above)
from packedinit import Layout  # noqa: E402


def test_part_offsets_are_precomputed_prefix_sums() -> None:
    sizes = [3, 1, 4, 1, 5, 9, 2, 6]
    lay = Layout(0, sizes, groups=2)
    assert [lay.offset(j) for j in range(len(sizes))] == [sum(sizes[:j]) for j in range(len(sizes))]
    t = torch.arange(2 * sum(sizes) * 2).view(2 * sum(sizes), 2)
    for block in lay.blocks(t.shape):
        view = lay.storage_view(t, block)
        want = torch.stack(
            [t.view(2, sum(sizes), 2)[g].narrow(0, lay.offset(block.part), block.shape[0] // 2) for g in range(2)]
        )
        assert torch.equal(view, want)


def test_scaling_rows_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    assert scaling.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| chunks | 20 |" in out
    assert "| batch | 20 |" in out
    rows = scaling.scaling_rows([5], repeats=1)
    assert [r.case for r in rows] == ["chunks", "batch"]
    assert all(r.seconds_n > 0 and r.seconds_10n > 0 for r in rows)

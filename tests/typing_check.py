"""Checked by `mypy --strict tests/typing_check.py` in CI (and run as a plain module by pytest).

`chunked(f)` keeps `f`'s signature: right keywords type-check, a wrong keyword does not.
The wrong calls carry `# type: ignore[...]`; mypy --strict (warn_unused_ignores) fails if
one of those ignores is unused, i.e. if the wrong call would type-check.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.init import kaiming_uniform_, ones_, orthogonal_, xavier_uniform_

import packedinit
from packedinit import Layout, chunked, chunked_init


def typed_calls() -> None:
    w = torch.empty(12, 4)
    a: torch.Tensor = chunked(kaiming_uniform_)(w, mode="fan_out")
    b: torch.Tensor = chunked(xavier_uniform_, 3)(w, gain=2.0)
    c: torch.Tensor = chunked(orthogonal_, Layout(0, [4, 4, 4]))(w, generator=torch.Generator())
    d: torch.Tensor = chunked_init(w, 3, 0, xavier_uniform_)
    gates = Layout(0, [4] * 4, names=("i", "f", "g", "o"))
    e: torch.Tensor = chunked_init(torch.empty(16), gates, init_fn={"f": ones_})
    chunked(xavier_uniform_)(nn.Linear(4, 4), gain=0.5)
    nn.Sequential(nn.Linear(2, 2)).apply(chunked(xavier_uniform_))
    blocks: tuple[packedinit.LogicalBlock, ...] = packedinit.logical_blocks(w, 3)
    del a, b, c, d, e, blocks


def wrong_calls() -> None:
    w = torch.empty(12, 4)
    chunked(kaiming_uniform_)(w, mood="fan_out")  # type: ignore[call-overload]
    chunked(kaiming_uniform_)(w, mode="fan_sideways")  # type: ignore[call-overload]
    chunked(xavier_uniform_)(w, gain="big")  # type: ignore[call-overload]
    chunked(xavier_uniform_)("not a tensor")  # type: ignore[call-overload]


def test_typing_file_imports() -> None:
    typed_calls()

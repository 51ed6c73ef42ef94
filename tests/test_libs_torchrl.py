"""torchrl 0.14.1 with its real constructors (issue 27): its python LSTM / GRU (``nn.RNNBase`` subclasses, covered
by torch.nn's adapter) and its ``LSTMCell`` / ``GRUCell`` (``nn.RNNCellBase`` subclasses, which are not
``nn.LSTMCell`` / ``nn.GRUCell`` and need their own adapters), checked against the forward, and the whole story.
Skips, naming torchrl, where it is not installed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import packedinit

IN, H = 6, 8


def _makers(lib: Any, hidden: int = H) -> dict[str, Callable[[], nn.Module]]:
    rnn = lib("torchrl.modules.tensordict_module.rnn")
    return {
        "LSTM": lambda: rnn.LSTM(IN, hidden, num_layers=2, batch_first=True),
        "GRU": lambda: rnn.GRU(IN, hidden, num_layers=2, batch_first=True),
        "LSTMCell": lambda: rnn.LSTMCell(IN, hidden),
        "GRUCell": lambda: rnn.GRUCell(IN, hidden),
        "LSTMModule": lambda: rnn.LSTMModule(input_size=IN, hidden_size=hidden, in_key="x", out_key="y"),
    }


KINDS = ["LSTM", "GRU", "LSTMCell", "GRUCell", "LSTMModule"]
#: the gates in the order the forward chunks them: rnn.py:487 / :606 ``i_gate, f_gate, g_gate, o_gate =
#: gates.chunk(4, 1)`` (LSTMCell / LSTM); rnn.py:1944 ``i_r, i_i, i_n = gate_x.chunk(3, 1)`` (GRUCell), the
#: same order as the GRU's scan (rnn.py:170 ``i_r, i_z, i_n = gates_x_t.split(gate_chunks, -1)``)
GATES = {"LSTM": ("i", "f", "g", "o"), "GRU": ("r", "z", "n")}


@pytest.mark.parametrize("kind", KINDS)
def test_every_gate_tensor_has_the_layout_its_forward_chunks_by(kind: str, lib: Any, story: Any) -> None:
    model = _makers(lib)[kind]()
    found = packedinit.layouts(model)
    gates = GATES["GRU" if "GRU" in kind else "LSTM"]
    names = [n for n, _ in model.named_parameters()]
    assert names
    assert set(found) == set(names)
    for n, p in model.named_parameters():
        out = p.shape[0]
        assert found[n].names == gates, n
        assert story.rows(found[n], out) == [c.tolist() for c in torch.arange(out).chunk(len(gates))], n


# torchrl's LSTM sums F.linear(x, weight_ih) + F.linear(hx, weight_hh) before gates.chunk(4, 1)
# (rnn.py:483-487, :601-606): the tracer follows both weights through the sum.
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "LSTMCell", "GRUCell"])
def test_infer_layouts_finds_each_layout(kind: str, lib: Any, story: Any) -> None:
    model = _makers(lib)[kind]()
    found = packedinit.layouts(model)
    x = torch.randn(2, 3, IN) if kind in ("LSTM", "GRU") else torch.randn(2, IN)
    inferred = packedinit.infer_layouts(model, x)
    assert inferred
    for n, got in inferred.items():
        assert got.verdict == "packed", (n, got)
        assert story.same_layout(got.layout, found[n]), (n, got.layout, found[n])


@pytest.mark.parametrize("kind", KINDS)
def test_audit_and_its_printed_fix_after_cleanrl_style_orthogonal(kind: str, lib: Any, story: Any) -> None:
    """torchrl's own init (uniform in +-1/sqrt(H)) reads no fan: not affected; a cleanrl-style ``orthogonal_`` on
    every weight (the idiom of PPO-LSTM scripts) orthogonalises across gates: affected, and the fix works."""
    torch.manual_seed(0)
    model = _makers(lib, hidden=64)[kind]()  # enough values per gate for the audit to tell
    assert packedinit.audit(model).affected == ()
    for n, p in model.named_parameters():
        if "weight" in n:
            nn.init.orthogonal_(p, 2**0.5)
    before = story.audit_fix_works(model)
    assert before.affected


@pytest.mark.parametrize("kind", KINDS)
def test_fix_torch_defaults_builds_per_block_and_identical_elsewhere(kind: str, lib: Any, story: Any) -> None:
    story.fix_builds_per_block(_makers(lib)[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_is_per_block(kind: str, lib: Any, story: Any) -> None:
    story.chunked_is_per_block(_makers(lib)[kind](), torch.nn.init.orthogonal_)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "LSTMCell", "GRUCell"])
def test_the_meta_flow_builds_what_construction_builds(kind: str, lib: Any, story: Any) -> None:
    """torchrl has no init entry point of its own: meta -> to_empty -> reset_parameters is torch's RNN default."""
    story.meta_flow_matches(_makers(lib, hidden=64)[kind])

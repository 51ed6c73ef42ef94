"""Issue 20 items 5-8: threads with their own generators, odd functions, all-or-nothing at model level."""

from __future__ import annotations

import threading

import torch
from torch import Tensor, nn

import packedinit


class _Own(nn.Module):
    """A module packedinit has no recipe for: its own reset_parameters draws from the default RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(64, 64))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for _ in range(4):
            nn.init.normal_(self.weight)  # each call reads and advances the default generator


def _model() -> nn.Module:
    # reset_parameters routes the generator into _Own's own init through the default CPU RNG
    return nn.Sequential(*[_Own() for _ in range(4)], nn.Linear(16, 16), nn.MultiheadAttention(16, 4))


def _params(m: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def test_reset_parameters_with_own_generators_from_8_threads() -> None:
    """Item 5: each thread's model and generator end exactly as single-threaded; the global RNG is untouched."""
    want = {}
    for s in range(8):
        m, g = _model(), torch.Generator().manual_seed(s)
        packedinit.reset_parameters(m, generator=g)
        want[s] = (_params(m), g.get_state())
    models = {s: _model() for s in range(8)}
    global_before = torch.get_rng_state()
    got: dict[int, tuple[list[Tensor], Tensor]] = {}
    barrier = threading.Barrier(8)

    def work(seed: int) -> None:
        g = torch.Generator()
        barrier.wait()
        for _ in range(3):  # several rounds: give the threads every chance to interleave
            g.manual_seed(seed)
            packedinit.reset_parameters(models[seed], generator=g)
        got[seed] = (_params(models[seed]), g.get_state())

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(torch.get_rng_state(), global_before)
    for s in range(8):
        params, state = got[s]
        assert all(torch.equal(a, b) for a, b in zip(params, want[s][0], strict=True)), s
        assert torch.equal(state, want[s][1]), s

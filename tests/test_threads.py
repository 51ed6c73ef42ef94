"""Issue 20 items 5-8: threads with their own generators, odd functions, all-or-nothing at model level."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.init import xavier_uniform_

import packedinit
from packedinit import PackedInitError, chunked, chunked_init


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


def test_model_level_all_or_nothing_for_a_function_that_cannot_run_on_meta() -> None:
    """Item 7: the function reads values (fails on meta), then raises on the second Linear: nothing stays written."""
    calls = []

    def reads_values(t: Tensor) -> Tensor:
        calls.append(t.shape)
        float(t.sum())  # meta has no values: the dry run proves nothing
        if len(calls) > 1 and not t.is_meta:
            raise ValueError("refuses the second weight")
        return t.uniform_()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    with pytest.raises(PackedInitError, match="Nothing was written") as info:
        packedinit.init_model(model, reads_values)
    assert "as reads_values left it" not in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True)), "0.weight was written"
    assert torch.equal(torch.get_rng_state(), rng), "the RNG advanced"


def _inference_tensor() -> Tensor:
    with torch.inference_mode():
        return torch.zeros(6, 4)


@pytest.mark.parametrize(
    "call",
    [
        lambda t: chunked(xavier_uniform_)(t),
        lambda t: chunked_init(t, None, None, xavier_uniform_),
        lambda t: chunked_init(t, 1, 0, xavier_uniform_),
        lambda t: chunked_init(t, None, None, lambda x: x.uniform_()),
    ],
    ids=["chunked", "chunked_init", "chunks=1", "user_fn"],
)
def test_unpacked_inference_tensor_outside_inference_mode_is_refused_before_any_write(
    call: Callable[[Tensor], object],
) -> None:
    """Item 8: torch writes the tensor and draws before its own error; packedinit refuses first."""
    t = _inference_tensor()
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="inference_mode"):
        call(t)
    assert torch.equal(t, torch.zeros(6, 4)), "the tensor was written"
    assert torch.equal(torch.get_rng_state(), rng), "the RNG advanced"

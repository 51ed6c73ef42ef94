"""The meta twin's fast paths: values known from the example inputs (trace/known), shapes answered (trace/quick)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional

import packedinit
from packedinit.trace.quick import quick_meta
from packedinit.trace.twin import run_read_only

E = 8


class Branchy(nn.Module):
    """Branches on a value computed from its input ids alone (as transformers' mask code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, E)
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, ids: Tensor) -> Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        h = self.emb(ids)
        if not (torch.diff(pos, dim=-1) == 1).all():  # a value of the inputs: known on the meta twin
            h = h * 0
        if int((ids > 0).sum()) > 0:
            h = h + 1
        q, k, v = self.qkv(h).split([E, E + E // 2, E // 2], dim=-1)
        return q.sum() + k.sum() + v.sum()


class Tainted(Branchy):
    """Writes a weight-dependent value into its ids before branching on them: unknown again, so a copy."""

    def forward(self, ids: Tensor) -> Tensor:
        ids = ids.clone()
        ids.add_(self.emb.weight[: ids.shape[1], 0].long())
        if (ids == 0).all():
            return self.qkv.weight.sum()
        return super().forward(ids.clamp(0, 15))


def _device(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    model(*args, **kwargs)
    return str(next(model.parameters()).device)


def test_a_branch_on_values_of_the_inputs_alone_runs_on_the_meta_twin_and_finds_the_split() -> None:
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    assert run_read_only(Branchy(), (ids,), {}, _device) == ("meta", "meta")
    found = packedinit.infer_layouts(Branchy(), ids)
    assert found["qkv.weight"].layout == packedinit.Layout(0, [E, E + E // 2, E // 2])


def test_a_value_written_from_a_weight_is_not_known_and_the_forward_runs_on_a_copy() -> None:
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    before = ids.clone()
    assert run_read_only(Tainted(), (ids,), {}, _device) == ("cpu", "copy")
    assert torch.equal(ids, before)


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


CASES = [
    (torch.add, (_meta(2, 3, E), _meta(E)), {}),
    (torch.mul, (_meta(2, 1, E), _meta(3, 1)), {}),
    (Tensor.__truediv__, (_meta(2, E, dtype=torch.bfloat16), 2.0), {}),
    (torch.sub, (_meta(2, E), _meta(2, E)), {"alpha": 2}),
    (torch.pow, (_meta(4, E), 3.0), {}),
    (torch.tanh, (_meta(4, E),), {}),
    (functional.gelu, (_meta(4, E),), {"approximate": "tanh"}),
    (functional.layer_norm, (_meta(2, 3, E), (E,), _meta(E), _meta(E), 1e-5), {}),
    (functional.layer_norm, (_meta(2, 3, E), (3, E)), {}),
    (torch.addmm, (_meta(3 * E), _meta(5, E), _meta(E, 3 * E)), {}),
    (functional.linear, (_meta(2, 5, E), _meta(3 * E, E), _meta(3 * E)), {}),
    (functional.scaled_dot_product_attention, (_meta(2, 4, 5, E), _meta(2, 4, 7, E), _meta(2, 4, 7, 3)), {}),
    (functional.scaled_dot_product_attention, (_meta(2, 5, 4, E).transpose(1, 2),) * 3, {"is_causal": True}),
]


@pytest.mark.parametrize(("func", "args", "kwargs"), CASES, ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(CASES)])
def test_a_quick_meta_answer_is_torchs_meta_result(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    quick = quick_meta(func, args, kwargs)
    torch_says = func(*args, **kwargs)
    assert quick is not None
    assert (quick.shape, quick.dtype, quick.device) == (torch_says.shape, torch_says.dtype, torch_says.device)
    assert quick.stride() == torch_says.stride()


@pytest.mark.parametrize(
    ("func", "args"),
    [
        (torch.add, (_meta(2, 3), _meta(4))),  # does not broadcast: torch says so
        (torch.add, (_meta(3, 2).t(), _meta(2, 3))),  # not contiguous: torch keeps its strides
        (torch.addmm, (_meta(4), _meta(5, 3), _meta(4, 4))),
        (functional.layer_norm, (_meta(2, 3), (4,))),
        (torch.add, (torch.ones(2), torch.ones(2))),  # not meta
    ],
)
def test_what_is_not_plain_is_left_to_torch(func: Any, args: tuple[Any, ...]) -> None:
    assert quick_meta(func, args, {}) is None


class Overwritten(Branchy):
    """Writes a weight-dependent value into known ids by index assignment, then branches: a copy."""

    def forward(self, ids: Tensor) -> Tensor:
        ids = ids.clone()
        ids[:, 0] = self.emb.weight[0, :2].long()
        if (ids == 0).all():
            return self.qkv.weight.sum()
        return super().forward(ids.clamp(0, 15))


class Huge(Branchy):
    """Makes a huge tensor from its input's shape on the meta twin: its values are not computed."""

    def forward(self, ids: Tensor) -> Tensor:
        big = torch.ones(1 << 15, 1 << 15, device=ids.device)  # 4 GiB of float32 if it were made
        return super().forward(ids) + big[0, 0]


def test_an_index_assignment_from_a_weight_makes_known_values_unknown() -> None:
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    assert run_read_only(Overwritten(), (ids,), {}, _device) == ("cpu", "copy")


def test_a_huge_tensor_made_on_the_meta_twin_gets_no_values() -> None:
    from packedinit.trace.known import KnownValues

    ids = torch.tensor([[1, 2, 3]])
    meta = ids.to("meta")
    mode = KnownValues([(meta, ids.clone())])
    with mode:
        big = torch.ones(1 << 15, 1 << 15, device="meta")
        small = torch.arange(4, device="meta")
    assert id(big) not in mode.values
    assert torch.equal(mode.values[id(small)][1], torch.arange(4))


def test_the_tracer_sees_the_same_forward_as_the_known_values_observer_and_as_a_mode_of_its_own() -> None:
    """On the meta twin the tracer rides in the KnownValues mode (one dispatch per op); on a full copy it is its
    own mode: both see every op of the forward, so both find the same uneven split."""
    from packedinit.trace.known import KnownValues, observed
    from packedinit.trace.tracer import Tracer
    from packedinit.trace.twin import meta_twin

    model, ids = Branchy(), torch.tensor([[1, 2, 3], [4, 5, 0]])
    seen: dict[str, list[frozenset[int]]] = {}
    for how in ("observer", "mode"):
        twin = meta_twin(model) if how == "observer" else model
        tracer = Tracer({id(p): (n, p) for n, p in twin.named_parameters() if p.dim() >= 2})
        with torch.no_grad():
            if how == "observer":
                meta = ids.to("meta")
                with KnownValues([(meta, ids.clone())]) as known, observed(tracer, tracer.observe):
                    assert known.observer is not None  # joined the KnownValues mode, not a mode of its own
                    twin(meta)
                assert known.observer is None
            else:
                with observed(tracer, tracer.observe):  # no KnownValues here: the tracer is entered as a mode
                    twin(ids)
        seen[how] = sorted(tracer.weights["qkv.weight"].pieces, key=min)
    assert seen["observer"] == seen["mode"] == [frozenset(range(8)), frozenset(range(8, 20)), frozenset(range(20, 24))]

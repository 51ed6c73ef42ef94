"""The model and the per-rank worker for tests/test_fingerprint_dist.py.

Run as a script, once per rank: ``python _fp_worker.py RANK WORLD INIT_FILE OUT_FILE``. It joins a gloo
process group (a FileStore: no port), fingerprints the model under FSDP2 (meta -> fully_shard ->
to_empty -> reset_parameters) and under row / column / 2-D tensor-parallel DTensor placements, and
writes each fingerprint's JSON (plus read-only and one-changed-value checks) to one ``.npz`` file.
The test loads this module by path for the single-process reference built by the same code.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import init

import packedinit
from packedinit import Layout, chunked_init

E = 6  # MultiheadAttention(6, 2): in_proj_weight (18, 6) shards 5, 5, 5, 3 over 4 ranks


class Packed(nn.Module):
    """Layouts the built-in adapters do not give: interleaved (GPT-NeoX), transposed (GPT-2 Conv1D), experts."""

    def __init__(self) -> None:
        super().__init__()
        self.neox = nn.Parameter(torch.empty(18, E))  # 2 heads x [q k v] of 3 rows
        self.conv1d = nn.Parameter(torch.empty(E, 3 * E))  # stored (in, out)
        self.experts = nn.Parameter(torch.empty(3, 10, E))  # 3 experts x [gate up] of 5 rows
        self.scale = nn.Parameter(torch.empty(1))  # fully_shard takes no 0-d parameter
        packedinit.annotate(self, neox=NEOX, conv1d=CONV1D, experts=EXPERTS)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        chunked_init(self.neox, NEOX, None, init.xavier_uniform_)
        chunked_init(self.conv1d, CONV1D, None, init.kaiming_uniform_, a=5**0.5)
        chunked_init(self.experts, EXPERTS, None, init.xavier_normal_)
        chunked_init(self.scale, None, None, init.ones_)


NEOX = Layout(0, [1, 1, 1], groups=6, names=("q", "k", "v"))
CONV1D = Layout(1, [E, E, E], transposed=True, names=("q", "k", "v"))
EXPERTS = Layout(1, [5, 5], batch_dims=1, names=("gate", "up"))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, 2)
        self.lstm = nn.LSTM(5, 7)
        self.packed = Packed()
        self.head = nn.Linear(E, 9)


def blocks_of(model: Net) -> list[nn.Module]:
    return [model.attn, model.lstm, model.packed]


def eager() -> Net:
    """The run everyone compares with: built, then re-initialised from seed 0."""
    torch.manual_seed(1)
    model = Net()
    _init(model)
    return model


def _init(model: Net) -> None:
    torch.manual_seed(0)
    for m in (model.attn, model.lstm, model.head):
        packedinit.reset_parameters(m)
    model.packed.reset_parameters()  # its own chunked_init calls (reset_parameters cannot see them on meta)


def meta_then_init(prepare: Any = None) -> Net:
    """meta -> (prepare, e.g. fully_shard) -> to_empty -> reset_parameters from seed 0."""
    with torch.device("meta"):
        model = Net()
    if prepare is not None:
        prepare(model)
    model.to_empty(device="cpu")
    _init(model)
    return model


def placements(spec: str, ndim: int) -> list[Any]:
    """``"S0,S1"``: per mesh dim; a dim a parameter lacks (a bias under S1) becomes Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    out: list[Any] = []
    for p in spec.split(","):
        d = int(p[1:]) if p != "R" else -1
        out.append(Shard(d) if 0 <= d < ndim else Replicate())
    return out


TP_SPECS_1D = ("S0", "S1", "R")
TP_SPECS_2D = ("S0,S1", "S1,S0", "R,S0", "S0,S0")


def distribute(model: nn.Module, mesh: Any, spec: str) -> None:
    from torch.distributed.tensor import distribute_tensor

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            t = distribute_tensor(p.detach(), mesh, placements(spec, p.dim()))
            setattr(module, name, nn.Parameter(t, requires_grad=p.requires_grad))


def locals_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().clone() for p in model.parameters()]  # type: ignore[operator]


def run(world: int) -> dict[str, np.ndarray]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2) if world >= 2 else (1, 1))
    out: dict[str, np.ndarray] = {}

    def shard(model: Net) -> None:
        for block in blocks_of(model):
            fully_shard(block, mesh=mesh1)
        fully_shard(model, mesh=mesh1)

    fsdp = meta_then_init(shard)
    before, rng = locals_of(fsdp), torch.get_rng_state()
    out["fsdp"] = np.array(packedinit.fingerprint(fsdp).to_json())
    same = all(torch.equal(a, b) for a, b in zip(before, locals_of(fsdp), strict=True))
    out["fsdp_read_only"] = np.array(same and torch.equal(rng, torch.get_rng_state()))
    for mesh, specs in ((mesh1, TP_SPECS_1D), (mesh2, TP_SPECS_2D)):
        for spec in specs:
            model = eager()
            distribute(model, mesh, spec)
            out[f"tp|{spec}"] = np.array(packedinit.fingerprint(model).to_json())
    # one changed value, held by the last rank only: global in_proj_weight[17, 2] (v) under Shard(0)
    model = eager()
    distribute(model, mesh1, "S0")
    local = model.attn.in_proj_weight.to_local()  # type: ignore[operator]
    if torch.distributed.get_rank() == world - 1:
        with torch.no_grad():
            local[-1, 2] += 1.0
    out["changed"] = np.array(packedinit.fingerprint(model).to_json())
    # a Partial placement holds pending sums, not the tensor's values: refused on every rank, before any collective
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(torch.ones(4, 2), mesh1, [Partial()])
    try:
        packedinit.fingerprint(partial)
        out["partial"] = np.array("")
    except packedinit.PackedInitError as e:
        out["partial"] = np.array(str(e))
    return out


if __name__ == "__main__":
    from _rank_main import run_rank  # tests/ is sys.path[0] when this file runs as a script

    run_rank(run)

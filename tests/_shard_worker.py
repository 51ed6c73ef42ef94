"""Per-rank worker for tests/test_local_shards.py: init calls handed a tensor-parallel local shard.

Run once per rank: ``python _shard_worker.py RANK WORLD INIT_FILE OUT_FILE``. It joins a gloo group
(a FileStore: no port to race for), builds ``Linear(64, 256)`` sharded by rows (``ColwiseParallel``:
weight ``Shard(0)``) or by columns (``RowwiseParallel``: ``Shard(1)``), or a Megatron-style shard of
the same weight (a plain Parameter with ``tensor_model_parallel``/``partition_dim``/``partition_stride``,
world size and rank from the default group), calls a ``torch.nn.init`` function on the local shard
the way TransformerEngine and Megatron do, with and without ``packedinit.fix_torch_defaults``, and
writes the gathered weights and what ``packedinit.audit`` says to one ``.npz`` (tests/_rank_main.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import packedinit

STYLES = {"rows": 0, "cols": 1}
#: (name, init function name, keyword arguments)
FNS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("xavier", "xavier_uniform_", {}),
    ("xavier_normal_gain", "xavier_normal_", {"gain": 1.5}),
    ("kaiming", "kaiming_normal_", {}),
    ("orthogonal", "orthogonal_", {}),
    ("normal", "normal_", {"std": 0.02}),
    ("zeros", "zeros_", {}),
)
#: How the local shard is reached, and whether the fix is on (and how it knows the parameter).
WAYS = ("local_tensor", "to_local", "registered", "nofix", "megatron", "megatron_stride2", "megatron_nofix")
SEED = 0


def _init(fn: str, t: Tensor, kwargs: dict[str, Any]) -> None:
    getattr(torch.nn.init, fn)(t, **kwargs)  # looked up at call time, as torch's own modules do


def _dtensor_linear(world: int, style: str, way: str, fn: str, kwargs: dict[str, Any]) -> nn.Linear:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    lin = nn.Linear(64, 256, bias=False)
    plan = ColwiseParallel() if style == "rows" else RowwiseParallel()
    if way == "registered":  # the fix on while parallelize_module registers the DTensor parameter
        with packedinit.fix_torch_defaults():
            parallelize_module(lin, mesh, plan)
            torch.manual_seed(SEED)
            _init(fn, lin.weight._local_tensor, kwargs)  # TransformerEngine's reset_parameters
        return lin
    parallelize_module(lin, mesh, plan)
    torch.manual_seed(SEED)
    if way == "nofix":
        _init(fn, lin.weight._local_tensor, kwargs)
        return lin
    with packedinit.fix_torch_defaults(lin):
        local = lin.weight._local_tensor if way == "local_tensor" else lin.weight.to_local()
        _init(fn, local, kwargs)
    return lin


def _megatron_weight(world: int, rank: int, style: str, way: str, fn: str, kwargs: dict[str, Any]) -> nn.Module:
    dim = STYLES[style]
    stride = 2 if way == "megatron_stride2" else 1
    shape = [256, 64]
    shape[dim] //= world
    w = nn.Parameter(torch.empty(shape))
    w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, dim, stride  # type: ignore[attr-defined]
    torch.manual_seed(SEED)
    if way == "megatron_nofix":
        _init(fn, w, kwargs)  # Megatron's _initialize_affine_weight_gpu: init_method on the partition
    else:
        with packedinit.fix_torch_defaults():
            _init(fn, w, kwargs)
    holder = nn.Module()
    holder.weight = w
    return holder


def _gather_megatron(w: Tensor, world: int, dim: int, stride: int) -> Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(w) for _ in range(world)]
    dist.all_gather(parts, w.detach().contiguous())
    c = w.shape[dim] // stride
    chunks = [parts[r].narrow(dim, j * c, c) for j in range(stride) for r in range(world)]
    return torch.cat(chunks, dim)


def one_case(world: int, rank: int, style: str, way: str, fn: str, kwargs: dict[str, Any]) -> dict[str, np.ndarray]:
    """The gathered weight, and the audit's "fans from a local shard" record (ratios; NaN when not flagged)."""
    module: nn.Module
    if way.startswith("megatron"):
        module = _megatron_weight(world, rank, style, way, fn, kwargs)
        full = _gather_megatron(module.weight, world, STYLES[style], 2 if way == "megatron_stride2" else 1)
    else:
        module = _dtensor_linear(world, style, way, fn, kwargs)
        full = module.weight.full_tensor()
    report = packedinit.audit(module)
    found = report.local_fans
    ratios = [found[0].predicted_ratio, found[0].measured_ratio] if found else [float("nan")] * 2
    answer = report.answer()
    return {"value": full.detach().numpy().copy(), "ratios": np.array(ratios), "answer": np.array(answer)}


def packed(world: int) -> dict[str, np.ndarray]:
    """A fused q/k/v ``Linear(8, 24)`` (annotated: 3 blocks of 8 rows), sharded by rows: shards cut across blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    lin = packedinit.annotate(nn.Linear(8, 24, bias=False), weight=packedinit.Layout(0, [8, 8, 8]))
    parallelize_module(lin, mesh, ColwiseParallel())
    torch.manual_seed(SEED)
    with packedinit.fix_torch_defaults(lin):
        _init("xavier_uniform_", lin.weight._local_tensor, {})
    return {"packed|value": lin.weight.full_tensor().detach().numpy().copy()}


def records() -> dict[str, np.ndarray]:
    """The DTensor records of :mod:`packedinit.model.shards`: exact (the local tensor, not a part of it) and weak."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from packedinit.model import shards

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    p = nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]))
    shards.note(p)
    local = p._local_tensor
    found, part = shards.dtensor_of(local) is p, shards.dtensor_of(local[:1]) is None
    ref = weakref.ref(p)
    del p
    gc.collect()
    return {"records|flags": np.array([found, part, ref() is None, shards.dtensor_of(local) is None])}


def run_cases(world: int) -> dict[str, np.ndarray]:
    """Every (style, way, init function) case on this rank, the audit's records and the packed weight."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out: dict[str, np.ndarray] = {}
    for style in STYLES:
        for way in WAYS:
            for name, fn, kw in FNS:
                for k, v in one_case(world, rank, style, way, fn, kw).items():
                    out[f"{style}|{way}|{name}|{k}"] = v
    out.update(records())
    out.update(packed(world))
    return out


if __name__ == "__main__":
    from _rank_main import run_rank  # tests/ is sys.path[0] when this file runs as a script

    run_rank(run_cases)

"""Time and peak extra memory per rank of a sharded packed init, vs one process.

    python benchmarks/distributed_memory.py [--embed 4096] [--world 2] [--fn xavier_uniform_] [--repeat 3]

Initialises an ``nn.MultiheadAttention``-style ``in_proj_weight`` of shape ``(3E, E)``
(float32) with ``chunked_init(w, 3, 0, fn)``: once in a single process on a plain
tensor, then as a DTensor sharded ``Shard(0)`` and ``Shard(1)`` over ``--world`` gloo
ranks on this machine (each rank a fresh process, loopback only). Per run it prints
the wall time of the init call (median of ``--repeat``) and the peak extra resident
memory during the first call (``ru_maxrss`` after minus resident size before, with the
tensor already allocated and touched; an upper bound, tight when ``bound_slack_mib`` is
small), and checks that the gathered DTensor equals the single-process tensor bit for
bit. Ranks share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.nn import init

ROOT = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _measure(t: torch.Tensor, fn: Any, repeat: int) -> dict[str, float]:
    from packedinit import chunked_init

    times = []
    rss0 = _rss_mib()
    peak0 = _maxrss_mib()
    for i in range(repeat):
        torch.manual_seed(0)
        start = time.perf_counter()
        chunked_init(t, 3, 0, fn)
        times.append(time.perf_counter() - start)
        if i == 0:
            peak = _maxrss_mib()
    # ru_maxrss is the lifetime peak: peak - rss0 bounds the extra memory of the init from above;
    # the bound is tight when the lifetime peak before the init (peak0) was close to rss0 (slack).
    return {
        "time_s": round(statistics.median(times), 4),
        "peak_extra_mib": round(peak - rss0, 1),
        "bound_slack_mib": round(max(peak0 - rss0, 0.0), 1),
        "rss_before_mib": round(rss0, 1),
    }


def _worker(rank: int, world: int, store: str, embed: int, fn_name: str, shard_dim: int, repeat: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, empty

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    w = empty((3 * embed, embed), device_mesh=mesh, placements=[Shard(shard_dim)])
    w.to_local().zero_()  # touch the shard: it is resident before we measure
    res = _measure(w, getattr(init, fn_name), repeat)
    res["local_mib"] = w.to_local().numel() * 4 / 2**20
    full = w.full_tensor()
    if rank == 0:
        torch.manual_seed(0)
        from packedinit import chunked_init

        ref = chunked_init(torch.empty(3 * embed, embed), 3, 0, getattr(init, fn_name))
        res["bit_identical"] = float(torch.equal(full, ref))
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, **res}), flush=True)
    os._exit(0)


def _single(embed: int, fn_name: str, repeat: int) -> None:
    torch.set_num_threads(1)
    w = torch.empty(3 * embed, embed).zero_()
    res = _measure(w, getattr(init, fn_name), repeat)
    res["local_mib"] = w.numel() * 4 / 2**20
    print(json.dumps({"rank": "single", **res}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--embed", type=int, default=4096)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--fn", default="xavier_uniform_")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--_role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--_store", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_shard", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._role == "single":
        _single(a.embed, a.fn, a.repeat)
        return
    if a._role == "rank":
        _worker(a._rank, a.world, a._store, a.embed, a.fn, a._shard, a.repeat)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo")
    base = [sys.executable, __file__, "--embed", str(a.embed), "--world", str(a.world), "--fn", a.fn,
            "--repeat", str(a.repeat)]
    print(f"chunked_init(w, 3, 0, {a.fn}) on w of shape (3*{a.embed}, {a.embed}) float32, torch {torch.__version__}")
    out = subprocess.run([*base, "--_role", "single"], env=env, capture_output=True, text=True, check=True)
    print(out.stdout.strip())
    for shard in (0, 1):
        with tempfile.TemporaryDirectory() as tmp:
            store = str(Path(tmp) / "store")
            role = ["--_role", "rank", "--_store", store, "--_shard", str(shard)]
            procs = [
                subprocess.Popen([*base, *role, "--_rank", str(r)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in range(a.world)
            ]
            print(f"world {a.world}, Shard({shard}):")
            for p in procs:
                so, se = p.communicate(timeout=1200)
                if p.returncode:
                    raise SystemExit(se)
                print(so.strip())


if __name__ == "__main__":
    main()

"""The per-rank process shared by the gloo workers (tests/_dist_worker.py, _shard_worker.py, _fp_worker.py).

``run_rank(work)`` joins a gloo group (a FileStore under the test's tmp dir: no port to race for), runs
``work(world)`` and writes what it returns to ``OUT_FILE`` atomically (a ``.part`` file, fsync, rename), then
meets the other ranks at a barrier and leaves with ``os._exit``. It never calls ``destroy_process_group``: on
torch 2.13 a clean destroy followed by a normal interpreter exit aborts about once in 30 runs, and on torch 2.6
one rank of four hung in it for over two minutes after its peers had left (a cold CI run). Saving before the
barrier means a rank's results are on disk before any peer can leave; the exit code still says whether the
barrier was reached.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch


def run_rank(work: Callable[[int], dict[str, np.ndarray]]) -> None:
    """``python WORKER RANK WORLD INIT_FILE OUT_FILE [...]``: run ``work(world)`` on one rank and exit."""
    import torch.distributed as dist

    rank, world, init_file, out_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    code = 1
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
        )
        out = work(world)
        tmp = out_file + ".part.npz"
        with open(tmp, "wb") as f:
            np.savez(f, **out)  # type: ignore[arg-type]  # numpy's stub wants str keys via **kwds
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_file)
        dist.barrier()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

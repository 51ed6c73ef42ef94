"""Waiting for a gloo test's worker processes and reading what each rank saved (shared by the dist tests).

Each test file launches its own worker (tests/_dist_worker.py, _shard_worker.py, _fp_worker.py) with its own
arguments; every rank writes ``rank{r}.log`` and, on success, ``rank{r}.npz`` under the run's folder.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest


def collect(
    procs: list[subprocess.Popen[bytes]], logs: list[IO[bytes]], tmp: Path, timeout: float
) -> list[dict[str, Any]]:
    """Wait for every rank (failing fast on the first that fails, or on ``timeout``); each rank's saved arrays."""
    world = len(procs)
    deadline = time.monotonic() + timeout
    failure = ""
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failure = f"rank {bad[0]} exited with code {codes[bad[0]]}"
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout:.0f}s (exit codes {codes})"
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=30)
        for log in logs:
            log.close()
    if failure:
        text = "\n".join(f"--- rank {r}:\n" + (tmp / f"rank{r}.log").read_text()[-4000:] for r in range(world))
        pytest.fail(f"world size {world}: {failure}\n{text}")
    out = []
    for r in range(world):
        with np.load(tmp / f"rank{r}.npz") as z:
            out.append({k: z[k] for k in z.files})
    return out

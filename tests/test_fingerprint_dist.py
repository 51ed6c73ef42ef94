"""``packedinit.fingerprint`` on DTensor / FSDP2 parameters (gloo, CPU, world sizes 1, 2, 4): each rank hashes
its own shard, one all_gather adds them, and the result equals the single-process fingerprint of the same init
(FSDP2's meta -> fully_shard -> to_empty -> init, row / column / 2-D tensor-parallel placements)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # the tests' private helpers (--import-mode=importlib adds none)
from _ranks import collect

import packedinit
from packedinit import Fingerprint

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

WORKER = Path(__file__).with_name("_fp_worker.py")
TIMEOUT_S = 150.0


def _load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("packedinit_tests_fp_worker", WORKER)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


W = _load_worker()


def launch(world: int, tmp: Path) -> list[dict[str, Any]]:
    """Run the worker on ``world`` ranks; each rank's results. Fails fast on any worker failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    root = str(Path(packedinit.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    if sys.platform.startswith("linux") and Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    logs = [open(tmp / f"rank{r}.log", "wb") for r in range(world)]  # noqa: SIM115  # closed below
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(world), str(tmp / "store"), str(tmp / f"rank{r}.npz")],
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            env=env,
        )
        for r in range(world)
    ]
    return collect(procs, logs, tmp, TIMEOUT_S)


_RUNS: dict[int, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module", params=(1, 2, 4), ids=lambda w: f"world{w}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    world: int = request.param
    if world not in _RUNS:
        _RUNS[world] = launch(world, tmp_path_factory.mktemp(f"fp_world{world}"))
    return _RUNS[world]


@pytest.fixture(scope="module")
def reference() -> Fingerprint:
    return packedinit.fingerprint(W.eager())


def _fp(res: dict[str, Any], key: str) -> Fingerprint:
    return Fingerprint.from_json(str(res[key]))


def test_fsdp2_meta_flow_matches_the_eager_single_process_fingerprint(
    ranks: list[dict[str, Any]], reference: Fingerprint
) -> None:
    for res in ranks:
        got = _fp(res, "fsdp")
        assert got.diff(reference) == [], str(got.diff(reference))
        assert [r.hash for r in got.blocks.values()] == [r.hash for r in reference.blocks.values()]
        assert bool(res["fsdp_read_only"])


@pytest.mark.parametrize("spec", W.TP_SPECS_1D + W.TP_SPECS_2D)
def test_tensor_parallel_placements_match_single_process(
    ranks: list[dict[str, Any]], reference: Fingerprint, spec: str
) -> None:
    for res in ranks:
        got = _fp(res, f"tp|{spec}")
        assert got == reference, str(got.diff(reference))


def test_one_value_changed_on_one_rank_is_named_on_every_rank(
    ranks: list[dict[str, Any]], reference: Fingerprint
) -> None:
    for res in ranks:
        d = _fp(res, "changed").diff(reference)
        assert d == ["attn.in_proj_weight[v]"]
        assert "first: 'attn.in_proj_weight[v]'" in str(d)


def test_a_partial_placement_is_refused_by_name(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        msg = str(res["partial"])
        assert "parameter 'tensor' of shape (4, 2): placement Partial" in msg
        assert "Shard(d)/Replicate() placements" in msg

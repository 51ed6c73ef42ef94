"""DTensor / FSDP2: real gloo process groups on CPU, gathered results vs single-process, bit for bit.

One launch per world size runs every case (tensor cases under every placement on a 1-D
and a 2-D mesh, refused inputs, FSDP2 meta-device flows) and returns all results by
value (one .npz per rank). A worker that fails or hangs fails the test at once: the
launcher polls every process with a deadline, kills the whole launch on the first
non-zero exit or on timeout, and shows that worker's stderr.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn import init

sys.path.insert(0, str(Path(__file__).parent))  # the tests' private helpers (--import-mode=importlib adds none)
from _ranks import collect

import packedinit
from packedinit import PackedInitError, chunked_init

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

WORKER = Path(__file__).with_name("_dist_worker.py")
#: FSDP2's forward on a CPU mesh records events on ``torch.cpu.Stream``, which has ``record_event`` on
#: torch 2.13.0 and 2.15.0 but not on 2.6.0 (AttributeError inside FSDP2's all-gather): there the FSDP2
#: model flows are skipped; packedinit's own DTensor writes (cases, errors) still run.
FSDP2_CPU_FORWARD = hasattr(torch.cpu.Stream, "record_event")
needs_fsdp2_forward = pytest.mark.skipif(
    not FSDP2_CPU_FORWARD,
    reason=f"FSDP2's forward on a CPU mesh needs torch.cpu.Stream.record_event (torch {torch.__version__} lacks it)",
)
LAUNCH_TIMEOUT_S = 150.0


def _load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("packedinit_tests_dist_worker", WORKER)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


W = _load_worker()


def launch(world: int, tmp: Path, groups: list[str], timeout: float = LAUNCH_TIMEOUT_S) -> list[dict[str, Any]]:
    """Run the worker on ``world`` ranks; return each rank's results. Fails fast on any worker failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    # the workers import the very packedinit this process imported (installed or not)
    root = str(Path(packedinit.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    if sys.platform.startswith("linux") and Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    init_file = tmp / "store"
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    for rank in range(world):
        log = open(tmp / f"rank{rank}.log", "wb")  # noqa: SIM115  # closed below, after the processes end
        logs.append(log)
        cmd = [sys.executable, str(WORKER), str(rank), str(world), str(init_file), str(tmp / f"rank{rank}.npz")]
        procs.append(subprocess.Popen([*cmd, ",".join(groups)], stdout=log, stderr=subprocess.STDOUT, env=env))
    return collect(procs, logs, tmp, timeout)


WORLD_SIZES = (1, 2, 4)
GPT2_WORLD = 2  # the transformers model runs at one world size (its import makes start-up slow)
_LAUNCHES: dict[int, list[dict[str, Any]] | str] = {}  # results, or why the launch failed (not retried)


def _launched(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if world not in _LAUNCHES:
        groups = ["cases", "errors"]
        if FSDP2_CPU_FORWARD:
            groups += ["encoder"] + [f"encoder:{way}" for way in ("chunked_model", "own_reset", "reset_parameters")]
            groups += ["mixed:reset_parameters"]
        if world == GPT2_WORLD and FSDP2_CPU_FORWARD:
            groups += ["gpt2", "gpt2:chunked_model", "gpt2:reset_parameters"]
        try:
            _LAUNCHES[world] = launch(world, tmp_path_factory.mktemp(f"world{world}"), groups)
        except pytest.fail.Exception as e:
            _LAUNCHES[world] = str(e)
    got = _LAUNCHES[world]
    if isinstance(got, str):
        pytest.fail(got, pytrace=False)
    return got


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def launched(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    world: int = request.param
    return world, _launched(world, tmp_path_factory)


@pytest.fixture(scope="module")
def launched_gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, Any]]]:
    return GPT2_WORLD, _launched(GPT2_WORLD, tmp_path_factory)


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, np.ndarray]]:
    return W.reference_cases()  # type: ignore[no-any-return]  # module loaded by path


def _fields(res: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in res.items() if k.startswith(prefix)}


def test_every_case_and_placement_matches_single_process(
    launched: tuple[int, list[dict[str, Any]]], reference: dict[str, dict[str, np.ndarray]]
) -> None:
    world, results = launched
    checked = 0
    for case in W.CASES:
        ref = reference[case.name]
        assert ref["same_object"].all()
        specs = list(case.placements_1d) + list(case.placements_2d)
        for spec in specs:
            for rank, res in enumerate(results):
                got = _fields(res, f"cases|{case.name}|{spec}|")
                where = f"{case.name} {spec} world={world} rank={rank}"
                assert set(got) == set(ref), where
                assert got["value"].dtype == ref["value"].dtype, where
                assert np.array_equal(got["value"], ref["value"]), f"{where}: gathered parameter differs"
                assert np.array_equal(got["rng_after"], ref["rng_after"]), f"{where}: global RNG stream differs"
                assert got["same_object"].all(), where
                if case.generator:
                    assert got["global_untouched"].all(), f"{where}: generator= touched the global RNG"
                    assert np.array_equal(got["generator_after"], ref["generator_after"]), where
                checked += 1
    assert checked == world * sum(len(c.placements_1d) + len(c.placements_2d) for c in W.CASES)


def test_reference_is_per_block_init() -> None:
    """The single-process reference itself is per-block: packed init == separate tensors in block order."""
    torch.manual_seed(3)
    packed = chunked_init(torch.empty(18, 6), 3, 0, init.orthogonal_)
    torch.manual_seed(3)
    blocks = [init.orthogonal_(torch.empty(6, 6)) for _ in range(3)]
    assert torch.equal(packed, torch.cat(blocks))


def test_the_values_are_random_and_no_element_is_left_unwritten(
    reference: dict[str, dict[str, np.ndarray]],
) -> None:
    for case in W.CASES:
        value = reference[case.name]["value"]
        floats = torch.from_numpy(value).view(case.dtype).float()
        nan = torch.isnan(floats)
        if case.name == "lstm_bias_named":  # gate "o" has no function: left as it was (NaN)
            assert nan[15:].all()
            assert not nan[:15].any()
        elif case.name == "lstm_weight_list":  # gate "f" has None: left as it was
            assert nan[5:10].all()
            assert not torch.cat([nan[:5], nan[10:]]).any()
        else:
            assert not nan.any(), case.name


def test_gathered_shards_differ_between_ranks_blocks(
    launched: tuple[int, list[dict[str, Any]]],
) -> None:
    """Guard against the 'every rank draws the same numbers' failure: the two halves of a block differ."""
    _, results = launched
    value = torch.from_numpy(results[0]["cases|mha_xavier|S0|value"]).view(torch.float32)
    q = value[: W.E]
    assert not torch.equal(q[: W.E // 2], q[W.E // 2 :])


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("partial", r"Partial placement.*Shard\(d\)/Replicate"),
        ("strided", r"placement .*StridedShard"),
        ("bad_chunks", r"shape \(12, 4\).*5 equal chunks"),
        ("bad_fn", r"rejected block .*nonsense"),
        ("bias_xavier", r"shape \(12,\).*fewer than 2 dimensions"),
        ("int_normal", r"torch.int64"),
        ("meta_bad_chunks", r"5 equal chunks"),
    ],
)
def test_refused_inputs_raise_before_any_write(
    launched: tuple[int, list[dict[str, Any]]], key: str, match: str
) -> None:
    _, results = launched
    for rank, res in enumerate(results):
        raised, unchanged = res[f"errors|{key}|flags"]
        assert raised, f"{key} rank {rank}: no PackedInitError"
        assert unchanged, f"{key} rank {rank}: the local shard or the RNG changed"
        assert re.search(match, str(res[f"errors|{key}|msg"])), str(res[f"errors|{key}|msg"])


def test_meta_dtensor_is_validated_and_left_alone(launched: tuple[int, list[dict[str, Any]]]) -> None:
    _, results = launched
    for res in results:
        rng_untouched, still_meta = res["errors|meta|ok"]
        assert rng_untouched
        assert still_meta


def test_global_params_writes_shards_keeps_the_rest_and_restores(launched: tuple[int, list[dict[str, Any]]]) -> None:
    _, results = launched
    names = ["swapped", "restored", "written", "kept", "failed_restored", "refused"]
    for rank, res in enumerate(results):
        flags = res["errors|global_params|flags"]
        assert flags.all(), (rank, [n for n, f in zip(names, flags, strict=True) if not f])


def _check_model(world: int, results: list[dict[str, Any]], kind: str, way: str) -> None:
    group = kind if way == "by_hand" else f"{kind}:{way}"
    ref = W.reference_model(kind, way)
    for rank, res in enumerate(results):
        got = _fields(res, f"{group}|")
        assert set(got) == set(ref), (rank, set(got) ^ set(ref))
        for name in ref:
            where = f"{group} world={world} rank={rank} {name}"
            if name.startswith("param:") or name == "rng_after":
                assert np.array_equal(got[name], ref[name]), f"{where}: differs from single-process init"
            else:  # forward/backward after FSDP2's all-gather / reduce-scatter: float sums may reorder
                assert np.isfinite(got[name]).all(), where
                np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=where)


@needs_fsdp2_forward
@pytest.mark.parametrize("way", ["by_hand", "chunked_model", "own_reset", "reset_parameters"])
def test_fsdp2_meta_flow_transformer_encoder(launched: tuple[int, list[dict[str, Any]]], way: str) -> None:
    """meta -> fully_shard -> to_empty -> init -> forward/backward equals the single-process model.

    Ways: per parameter through chunked_init; ``chunked(xavier_uniform_)(model)``; each module's
    own ``reset_parameters()`` inside ``global_params``; packedinit's ``reset_parameters(model)``.
    """
    world, results = launched
    _check_model(world, results, "encoder", way)


@needs_fsdp2_forward
def test_fsdp2_reset_parameters_embedding_padding_linear_layernorm(launched: tuple[int, list[dict[str, Any]]]) -> None:
    """packedinit's reset_parameters on FSDP2: Embedding (padding row zeroed), Linear, LayerNorm, uneven rows."""
    world, results = launched
    _check_model(world, results, "mixed", "reset_parameters")


@needs_fsdp2_forward
@pytest.mark.parametrize("way", ["by_hand", "chunked_model", "reset_parameters"])
def test_fsdp2_meta_flow_tiny_gpt2(launched_gpt2: tuple[int, list[dict[str, Any]]], way: str) -> None:
    """The same flow for a tiny transformers GPT-2 (Conv1D c_attn stored transposed, tied embeddings).

    ``reset_parameters``: the model's own ``_init_weights`` on DTensor parameters, tied ``wte``/``lm_head``
    written through one global stand-in.
    """
    world, results = launched_gpt2
    _check_model(world, results, "gpt2", way)


def test_plain_tensor_path_is_untouched_by_distributed_import() -> None:
    """Importing the distributed module changes nothing for plain tensors (no process group needed)."""
    import packedinit.engine.distributed  # noqa: F401  # the import itself is under test

    torch.manual_seed(0)
    a = chunked_init(torch.empty(12, 4), 3, 0, init.xavier_uniform_)
    torch.manual_seed(0)
    b = torch.cat([init.xavier_uniform_(torch.empty(4, 4)) for _ in range(3)])
    assert torch.equal(a, b)
    with pytest.raises(PackedInitError, match="5 equal chunks"):
        chunked_init(torch.empty(12, 4), 5, 0, init.xavier_uniform_)

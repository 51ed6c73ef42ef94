"""Cases and the per-rank worker for tests/test_distributed.py.

Run as a script, once per rank: ``python _dist_worker.py RANK WORLD INIT_FILE OUT_FILE [GROUPS]``.
It joins a gloo process group (a FileStore under the test's tmp dir: no port to race
for; gloo itself talks over loopback), runs every case of the requested groups, writes
all results by value to one ``.npz`` file, and leaves with ``os._exit`` (tests/_rank_main.py
says why). The test file loads this module by path to compute the
single-process reference with the very same recipes on plain tensors.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import init

from packedinit import Layout, PackedInitError, chunked, chunked_init

Results = dict[str, np.ndarray]


def bits(t: Tensor) -> np.ndarray:
    """The raw bits of ``t`` (NaNs and bf16 included) as a numpy integer array."""
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    arr: np.ndarray = t.detach().contiguous().cpu().view(ints).numpy().copy()
    return arr


def gathered(t: Tensor) -> Tensor:
    """The full tensor of a DTensor (a collective), or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# -- tensor cases -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One packed tensor, one init; run under every placement in ``placements_1d``/``placements_2d``."""

    name: str
    shape: tuple[int, ...]
    chunks: Any
    dim: int | None
    fn: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    generator: bool = False
    wrapped: bool = False  # call through chunked(fn, chunks, dim)(t, ...) instead of chunked_init
    placements_1d: tuple[str, ...] = ("S0", "S1", "R")
    placements_2d: tuple[str, ...] = ()


E = 6
H = 5
CASES: tuple[Case, ...] = (
    # MHA in_proj_weight (3E, E): every placement, both mesh ranks.
    Case("mha_xavier", (3 * E, E), 3, 0, init.xavier_uniform_,
         placements_2d=("S0,S1", "S1,S0", "S0,S0", "R,S1", "S1,R", "R,R")),
    Case("mha_wrapped_xavier_gain", (3 * E, E), 3, 0, init.xavier_uniform_, (), {"gain": 1.5}, wrapped=True,
         placements_2d=("S1,S0",)),
    Case("mha_orthogonal", (3 * E, E), 3, 0, init.orthogonal_, placements_2d=("S0,S1", "S0,S0")),
    Case("mha_kaiming_gain", (3 * E, E), [E, E, E], 0, init.kaiming_uniform_, (), {"a": 0.3, "mode": "fan_out"}),
    # GQA: uneven sizes, and uneven shards (14 rows over 4 ranks: 4, 4, 4, 2).
    Case("gqa_kaiming_normal", (14, 7), [6, 4, 4], 0, init.kaiming_normal_, placements_2d=("S0,S1",)),
    # issue 20 item 1: normal_ blocks of 16, 4, 4 elements (a packed GQA bias): torch's small-tensor path
    Case("gqa_bias_normal", (24,), [16, 4, 4], 0, init.normal_, placements_1d=("S0", "R")),
    # GPT-NeoX: q, k, v inside each of 3 heads; shards cut across heads (18 over 4: 5, 5, 5, 3).
    Case("neox_xavier_normal", (18, 5), Layout(0, [2, 2, 2], groups=3), None, init.xavier_normal_,
         placements_2d=("S0,S0", "S1,S0")),
    Case("neox_orthogonal", (18, 5), Layout(0, [2, 2, 2], groups=3), None, init.orthogonal_),
    # GPT-2 Conv1D c_attn (E, 3E) stored (in, out), 15 columns: uneven on both dims.
    Case("gpt2_conv1d", (5, 15), Layout(1, [5, 5, 5], transposed=True), None, init.xavier_uniform_,
         placements_2d=("S0,S1", "S1,S1")),
    Case("gpt2_conv1d_orthogonal", (5, 15), Layout(1, [5, 5, 5], transposed=True), None, init.orthogonal_),
    # Mixtral experts (n, 2I, E), batch dim 0: 3 experts over 4 ranks leaves one rank empty.
    Case("moe_mixtral", (3, 8, 5), Layout(1, [4, 4], batch_dims=1), None, init.xavier_uniform_,
         placements_1d=("S0", "S1", "S2", "R"), placements_2d=("S0,S2", "S2,S1")),
    # GPT-OSS experts (n, E, 2I) with gate/up interleaved on the last dim, transposed.
    Case("moe_gptoss", (2, 5, 8), Layout(2, [1, 1], groups=4, transposed=True, batch_dims=1), None,
         init.kaiming_uniform_, placements_1d=("S0", "S1", "S2", "R"), placements_2d=("S2,S1",)),
    # LSTM bias (4H,): per-gate functions by name, one gate skipped (left as the NaN fill).
    Case("lstm_bias_named", (4 * H,), Layout(0, [H] * 4, names=("i", "f", "g", "o")), None,
         {"i": init.zeros_, "f": init.ones_, "g": init.normal_}, placements_1d=("S0", "R")),
    Case("lstm_weight_list", (4 * H, 3), [H] * 4, 0, [init.orthogonal_, None, init.xavier_uniform_, init.eye_]),
    # generator=: every draw from the caller's generator, the global RNG untouched.
    Case("generator_xavier", (3 * E, E), 3, 0, init.xavier_uniform_, generator=True,
         placements_2d=("S1,S0",)),
    Case("generator_sparse", (12, 4), 2, 0, init.sparse_, (0.5,), generator=True),
    Case("sparse", (12, 4), 2, 0, init.sparse_, (0.3,), {"std": 0.5}),
    Case("trunc_normal", (10, 3), [4, 6], 0, init.trunc_normal_, (0.0, 1.0, -1.5, 1.5)),
    Case("uniform_args", (9, 4), 3, 0, init.uniform_, (-2.0, 3.0)),
    Case("eye", (12, 5), 3, 0, init.eye_),
    Case("partials", (12, 5), 3, 0, [
        functools.partial(init.normal_, std=0.3),
        functools.partial(init.constant_, val=2.0),
        functools.partial(init.kaiming_uniform_, nonlinearity="relu"),
    ]),
    Case("dirac_conv", (12, 4, 3), 3, 0, init.dirac_, placements_1d=("S0", "S1", "S2", "R")),
    Case("conv_kaiming", (12, 4, 3), 3, 0, init.kaiming_normal_, placements_1d=("S0", "S2")),
    Case("unpacked_xavier", (7, 9), None, None, init.xavier_uniform_),
    Case("float64", (3 * E, E), 3, 0, init.xavier_normal_, dtype=torch.float64),
    Case("bf16_orthogonal", (3 * E, E), 3, 0, init.orthogonal_, dtype=torch.bfloat16),
    Case("bf16_xavier", (3 * E, E), 3, 0, init.xavier_uniform_, dtype=torch.bfloat16, placements_1d=("S1",)),
)


def reference_cases() -> dict[str, Results]:
    """Single-process reference: each case on a plain CPU tensor (global RNG restored afterwards)."""
    out: dict[str, Results] = {}
    with torch.random.fork_rng(devices=[]):
        for case in CASES:
            out[case.name] = run_case_tracked(case, _make_plain, lambda t: t)
    return out


def run_case_tracked(case: Case, make: Callable[[Case], Tensor], full: Callable[[Tensor], Tensor]) -> Results:
    """:func:`run_case`, also recording whether ``generator=`` left the global RNG untouched."""
    torch.manual_seed(1000 + sum(map(ord, case.name)))
    t = make(case)
    kwargs = dict(case.kwargs)
    if case.generator:
        kwargs["generator"] = torch.Generator().manual_seed(77)
    before = torch.get_rng_state()
    if case.wrapped:
        out = chunked(case.fn, case.chunks, case.dim)(t, *case.args, **kwargs)
    else:
        out = chunked_init(t, case.chunks, case.dim, case.fn, *case.args, **kwargs)
    after = torch.get_rng_state()
    res: Results = {
        "value": bits(full(out)),
        "rng_after": torch.rand(4).numpy(),
        "global_untouched": np.array([bool(torch.equal(before, after))]),
        "same_object": np.array([out is t]),
    }
    if case.generator:
        res["generator_after"] = torch.rand(4, generator=kwargs["generator"]).numpy()
    return res


def _make_plain(case: Case) -> Tensor:
    return torch.full(case.shape, float("nan"), dtype=case.dtype)


# -- distributed side ---------------------------------------------------------------------------


def placements(spec: str) -> list[Any]:
    """``"S0,R"`` -> ``[Shard(0), Replicate()]``."""
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split(",")]


def mesh_2d_shape(world: int) -> tuple[int, int]:
    """The 2-D mesh used at ``world`` ranks: (2, world // 2), or (1, 1) for one rank."""
    return (2, world // 2) if world >= 2 else (1, 1)


def dist_cases(world: int) -> Results:
    """Every case under every placement, on a 1-D and a 2-D CPU mesh. Keys: ``case|placements|field``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import full

    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", mesh_2d_shape(world))
    out: Results = {}
    for case in CASES:
        runs = [(mesh1, p) for p in case.placements_1d] + [(mesh2, p) for p in case.placements_2d]
        for mesh, spec in runs:

            def make(c: Case, mesh: Any = mesh, spec: str = spec) -> Tensor:
                return full(c.shape, float("nan"), dtype=c.dtype, device_mesh=mesh, placements=placements(spec))

            res = run_case_tracked(case, make, gathered)
            for k, v in res.items():
                out[f"{case.name}|{spec}|{k}"] = v
    return out


def dist_errors(world: int) -> Results:
    """Inputs packedinit must refuse: each entry is [raised PackedInitError, local shard unchanged], and the message."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, full
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,))
    out: Results = {}

    def attempt(key: str, t: Tensor, call: Callable[[Tensor], object]) -> None:
        assert isinstance(t, DTensor)
        local_before = t.to_local().clone()
        state = torch.get_rng_state()
        msg = ""
        raised = False
        try:
            call(t)
        except PackedInitError as e:
            raised, msg = True, str(e)
        local = t.to_local()
        same_local = local.is_meta if local_before.is_meta else torch.equal(local, local_before)
        unchanged = same_local and torch.equal(torch.get_rng_state(), state)
        out[f"{key}|flags"] = np.array([raised, unchanged])
        out[f"{key}|msg"] = np.array(msg)

    partial = DTensor.from_local(torch.full((12, 4), 0.5), mesh, [Partial()])
    attempt("partial", partial, lambda t: chunked_init(t, 3, 0, init.xavier_uniform_))
    strided = DTensor.from_local(torch.full((4, 4), 0.5), mesh, [_StridedShard(0, split_factor=2)], run_check=False)
    attempt("strided", strided, lambda t: chunked_init(t, 2, 0, init.xavier_uniform_))
    sharded = full((12, 4), 0.25, device_mesh=mesh, placements=[Shard(0)])
    attempt("bad_chunks", sharded, lambda t: chunked_init(t, 5, 0, init.xavier_uniform_))
    attempt("bad_fn", sharded, lambda t: chunked_init(t, [6, 6], 0, init.xavier_uniform_, nonsense=1))
    bias = full((12,), 0.25, device_mesh=mesh, placements=[Shard(0)])
    attempt("bias_xavier", bias, lambda t: chunked(init.xavier_uniform_, 3)(t))
    ints = full((12, 4), 3, dtype=torch.int64, device_mesh=mesh, placements=[Shard(1)])
    attempt("int_normal", ints, lambda t: chunked_init(t, 3, 0, init.normal_))
    # A meta DTensor: validated (errors still raised), nothing drawn.
    meta = DTensor.from_local(torch.empty((12 // world if world <= 4 else 1, 4), device="meta"), mesh, [Shard(0)])
    state = torch.get_rng_state()
    chunked_init(meta, 3, 0, init.orthogonal_)
    out["meta|ok"] = np.array([torch.equal(torch.get_rng_state(), state), meta.to_local().is_meta])
    attempt("meta_bad_chunks", meta, lambda t: chunked_init(t, 5, 0, init.orthogonal_))
    out.update(_global_params_checks(mesh))
    return out


def _global_params_checks(mesh: Any) -> Results:
    """``global_params``: writes land in the shard, untouched tensors keep their values, failures restore."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    from packedinit.engine.distributed import global_params

    lin = nn.Linear(4, 6)
    weight = nn.Parameter(distribute_tensor(torch.full((6, 4), 0.5), mesh, [Shard(0)]))
    bias = nn.Parameter(distribute_tensor(torch.arange(6.0), mesh, [Shard(0)]))
    lin.weight, lin.bias = weight, bias
    with global_params(lin):
        swapped = type(lin.weight) is nn.Parameter and lin.weight.shape == (6, 4)
        with torch.no_grad():
            lin.weight.copy_(torch.arange(24.0).view(6, 4))
    restored = lin.weight is weight and lin.bias is bias and isinstance(lin.weight, DTensor)
    written = torch.equal(gathered(weight), torch.arange(24.0).view(6, 4))
    kept = torch.equal(gathered(bias), torch.arange(6.0))
    failed_restored = False
    try:
        with global_params(lin), torch.no_grad():
            lin.weight.fill_(-1.0)
            raise RuntimeError("boom")
    except RuntimeError:
        failed_restored = lin.weight is weight and torch.equal(gathered(weight), torch.arange(24.0).view(6, 4))
    lin.bias = nn.Parameter(DTensor.from_local(torch.zeros(6), mesh, [Partial()]))
    refused = False
    try:
        with global_params(lin):
            pass
    except PackedInitError as e:
        refused = "Partial" in str(e) and lin.weight is weight
    return {"global_params|flags": np.array([swapped, restored, written, kept, failed_restored, refused])}


# -- whole models: meta device -> fully_shard -> to_empty -> packed init -> forward/backward --------


D_MODEL, N_HEAD, D_FF, N_LAYERS = 10, 2, 20, 2


def make_encoder() -> nn.TransformerEncoder:
    """A small torch TransformerEncoder (uneven FSDP shards at 4 ranks: 30 rows -> 8, 8, 8, 6)."""
    layer = nn.TransformerEncoderLayer(D_MODEL, N_HEAD, D_FF, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, N_LAYERS, enable_nested_tensor=False)


def init_encoder_by_hand(model: nn.Module) -> None:
    """Per-parameter packed init through the tensor API (in_proj_weight as 3 blocks)."""
    for name, p in model.named_parameters():
        if name.endswith("in_proj_weight"):
            chunked_init(p, 3, 0, init.xavier_uniform_)
        elif p.dim() >= 2:
            chunked(init.kaiming_uniform_)(p, a=5**0.5)
        elif "norm" in name and name.endswith("weight"):
            chunked(init.ones_)(p)
        else:
            chunked_init(p, None, None, init.uniform_, -0.1, 0.1)


def make_gpt2() -> nn.Module:
    """A tiny transformers GPT-2 (Conv1D c_attn stored (in, out); tied embeddings)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=12, n_layer=2, n_head=3, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def init_gpt2_by_hand(model: nn.Module) -> None:
    """GPT-2's own recipe (normal(0, 0.02)), but c_attn per q/k/v block with xavier_uniform_."""
    for name, p in model.named_parameters():
        if name.endswith("c_attn.weight"):
            e = p.shape[0]
            chunked_init(p, Layout(1, [e, e, e], transposed=True, names=("q", "k", "v")), None, init.xavier_uniform_)
        elif p.dim() >= 2:
            chunked_init(p, None, None, init.normal_, 0.0, 0.02)
        elif "ln" in name and name.endswith("weight"):
            chunked_init(p, None, None, init.ones_)
        else:
            chunked_init(p, None, None, init.zeros_)


def make_mixed() -> nn.Module:
    """Embedding with padding_idx (uneven rows: 11 over 4 ranks), Linear, LayerNorm."""
    return nn.Sequential(nn.Embedding(11, 6, padding_idx=3), nn.Linear(6, 5), nn.LayerNorm(5))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], None]]] = {
    "encoder": (make_encoder, init_encoder_by_hand),
    "mixed": (make_mixed, lambda m: None),
    "gpt2": (make_gpt2, init_gpt2_by_hand),
}


def model_input(kind: str) -> Tensor:
    g = torch.Generator().manual_seed(5)
    if kind == "gpt2":
        return torch.randint(0, 50, (2, 7), generator=g)
    if kind == "mixed":
        return torch.tensor([[3, 1, 10, 3], [0, 3, 5, 7]])
    return torch.randn(3, 4, D_MODEL, generator=g)


def forward_backward(kind: str, model: nn.Module) -> tuple[Tensor, Tensor]:
    """One forward and backward on a fixed batch; returns (output, loss)."""
    x = model_input(kind)
    if kind == "gpt2":
        y = model(input_ids=x, labels=x)
        loss, out = y.loss, y.logits
    else:
        out = model(x)
        loss = out.square().mean()
    loss.backward()
    return out.detach(), loss.detach()


def _blocks_of(model: nn.Module) -> list[nn.Module]:
    enc = getattr(model, "layers", None)
    if isinstance(enc, nn.ModuleList):
        return list(enc)
    if isinstance(model, nn.Sequential):
        return list(model)
    return list(model.transformer.h)  # type: ignore[union-attr, arg-type]  # GPT-2's blocks


def model_result(kind: str, init_fn: Callable[[nn.Module], None], model: nn.Module) -> Results:
    """Init (seeded), then record params (gathered), RNG position, output, loss and grads."""
    torch.manual_seed(321)
    init_fn(model)
    res: Results = {"rng_after": torch.rand(4).numpy()}
    for name, p in model.named_parameters():
        res[f"param:{name}"] = bits(gathered(p))
    out, loss = forward_backward(kind, model)
    res["out"] = out.numpy()
    res["loss"] = loss.numpy()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        res[f"grad:{name}"] = gathered(p.grad).numpy()
    return res


def _retie(model: nn.Module) -> None:
    """``to_empty`` unties tied weights on a plain model (FSDP2 keeps them): tie again, as HF's own loaders do."""
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
        assert model.lm_head.weight is model.transformer.wte.weight  # type: ignore[union-attr]  # GPT-2


def reference_model(kind: str, way: str) -> Results:
    """Single-process: the same model built on the meta device, to_empty, the same init."""
    make, by_hand = MODELS[kind]
    with torch.random.fork_rng(devices=[]):
        with torch.device("meta"):
            model = make()
        model.to_empty(device="cpu")
        _retie(model)
        return model_result(kind, by_hand if way == "by_hand" else WAYS[way], model)


def whole_model_init(model: nn.Module) -> None:
    """``chunked(f)(model)``: the registry's layouts, one init function for every weight; then the 1-D ones."""
    chunked(init.xavier_uniform_)(model)
    for p in model.parameters():
        if p.dim() < 2:
            chunked_init(p, None, None, init.uniform_, -0.1, 0.1)


def modules_own_reset(model: nn.Module) -> None:
    """Each module's own ``reset_parameters()`` inside ``global_params`` (MHA's q/k/v per block instead)."""
    from packedinit.engine.distributed import global_params

    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            chunked_init(m.in_proj_weight, 3, 0, init.xavier_uniform_)
            chunked_init(m.in_proj_bias, None, None, init.zeros_)
        elif callable(getattr(m, "reset_parameters", None)):
            with global_params(m):
                m.reset_parameters()  # type: ignore[operator]  # checked callable above


def packedinit_reset(model: nn.Module) -> None:
    """``packedinit``'s ``reset_parameters(model)``: every module's default init, MHA per q/k/v block."""
    from packedinit.recipes.reset import reset_parameters

    reset_parameters(model)


WAYS: dict[str, Callable[[nn.Module], None]] = {
    "chunked_model": whole_model_init,
    "own_reset": modules_own_reset,
    "reset_parameters": packedinit_reset,
}


def dist_model(world: int, kind: str, way: str) -> Results:
    """FSDP2: meta device -> fully_shard (each block, then the root) -> to_empty -> init -> fwd/bwd."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    make, by_hand = MODELS[kind]
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = make()
    for block in _blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name} is not sharded"
        assert p.to_local().device.type == "cpu", name
    if kind == "gpt2":  # FSDP2 keeps the tie through to_empty: nothing to re-tie
        assert model.lm_head.weight is model.transformer.wte.weight  # type: ignore[union-attr]  # GPT-2
    return model_result(kind, by_hand if way == "by_hand" else WAYS[way], model)


# -- entry point ----------------------------------------------------------------------------------


def run_groups(world: int) -> Results:
    """Every case of the groups named on the command line (``cases,errors,encoder`` by default)."""
    groups = sys.argv[5].split(",") if len(sys.argv) > 5 else ["cases", "errors", "encoder"]
    out: Results = {}
    for group in groups:
        if group == "cases":
            out.update({f"cases|{k}": v for k, v in dist_cases(world).items()})
        elif group == "errors":
            out.update({f"errors|{k}": v for k, v in dist_errors(world).items()})
        else:
            kind, _, way = group.partition(":")
            res = dist_model(world, kind, way or "by_hand")
            out.update({f"{group}|{k}": v for k, v in res.items()})
    return out


if __name__ == "__main__":
    from _rank_main import run_rank  # tests/ is sys.path[0] when this file runs as a script

    run_rank(run_groups)

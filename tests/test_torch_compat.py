"""torch's private surface lives in packedinit/torch_compat.py alone, and each entry there does its job
on the torch this runs on (the compat step of .ci/run runs this on the oldest and newest supported torch)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from packedinit import torch_compat as tc

PKG = Path(__file__).resolve().parent.parent / "packedinit"
COMPAT = PKG / "torch_compat.py"
OTHERS = sorted(p for p in PKG.rglob("*.py") if p != COMPAT)
PRIVATE = re.compile(r"_[A-Za-z][A-Za-z0-9_]*")  # one leading underscore, not a dunder

#: Private names packedinit reads that are not torch's (with the reason), so they may stay where they are.
NOT_TORCH = {
    "_is_hf_initialized": "transformers' flag on a tensor (materialize.hf_flags_cleared)",
    "_init_weights": "a transformers model's own init method (recipes._hf_init)",
    "_initialize_weights": "transformers' PreTrainedModel method that runs _init_weights (construction._INIT_METHODS)",
    "_fields": "a Python namedtuple's field names (trace/twin copies namedtuple inputs)",
    "_mask": "the suffix of transformers' input names such as input_features_mask (trace/inputs)",
}


def _own_names() -> set[str]:
    """Private names packedinit itself defines: its functions, classes, variables, attributes, slots."""
    out: set[str] = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in {"self", "cls"}:
                    out.add(node.attr)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                out |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
            elif isinstance(node, ast.alias) and node.asname:
                out.add(node.asname)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
    return {n for n in out if isinstance(n, str) and PRIVATE.fullmatch(n)}


OWN = _own_names()


def _private_uses(path: Path) -> list[str]:
    """Every torch-private name ``path`` touches: ``x._name``, ``"_name"`` (getattr/setattr), ``torch._x`` imports."""
    found: list[str] = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        name: str | None = None
        if isinstance(node, ast.Attribute) and PRIVATE.fullmatch(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}):
                name = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PRIVATE.fullmatch(node.value):
            name = node.value
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            private = [part for part in node.module.split(".") if PRIVATE.fullmatch(part)]
            name = private[0] if private else None
        elif isinstance(node, ast.Import):
            private = [p for a in node.names for p in a.name.split(".") if PRIVATE.fullmatch(p)]
            name = private[0] if private else None
        if name is None or name in NOT_TORCH or name.startswith("_packedinit"):
            continue
        if isinstance(node, ast.Attribute | ast.Constant) and name in OWN:
            continue
        found.append(f"{path.relative_to(PKG).as_posix()}:{node.lineno}: {name}")  # type: ignore[attr-defined]
    return found


@pytest.mark.parametrize("path", OTHERS, ids=lambda p: p.relative_to(PKG).as_posix())
def test_no_module_but_torch_compat_touches_a_torch_private_name(path: Path) -> None:
    uses = _private_uses(path)
    assert not uses, f"route these through packedinit/torch_compat.py (with the torch versions checked): {uses}"


def test_the_scan_sees_the_private_names_torch_compat_uses() -> None:
    """The scan is not blind: run on torch_compat itself it finds each private name the module documents."""
    seen = {u.rsplit(": ", 1)[1] for u in _private_uses(COMPAT)}
    expected = {"_getframe", "_python_dispatch", "_C", "_set_grad_enabled", "_cdata", "_schema", "_spec"}
    expected |= {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_qkv_same_embed_dim"}
    expected |= {"_reset_parameters", "_fill_padding_idx_with_zero", "_ConvNd"}
    expected |= {"_forward_pre_hooks", "_flat_weights_names", "_SpectralNorm", "_u", "_v", "_power_method"}
    expected |= {"_reshape_weight_to_matrix", "_g"}
    assert expected <= seen, sorted(expected - seen)


def test_set_grad_enabled_sets_the_thread_grad_mode() -> None:
    assert torch.is_grad_enabled()
    tc.set_grad_enabled(False)
    try:
        assert not torch.is_grad_enabled()
    finally:
        tc.set_grad_enabled(True)
    assert torch.is_grad_enabled()


def test_storage_id_tells_meta_storages_apart_and_joins_views() -> None:
    a, b = torch.empty(4, 4, device="meta"), torch.empty(4, 4, device="meta")
    assert tc.storage_id(a) != tc.storage_id(b)
    assert tc.storage_id(a) == tc.storage_id(a[1:]) == tc.storage_id(a.data) == tc.storage_id(a.t())
    w = nn.Parameter(torch.zeros(3))
    assert tc.storage_id(w) == tc.storage_id(w.detach()[0])


def test_written_args_are_the_tensors_an_op_writes_in_place() -> None:
    seen: list[list[bool]] = []
    x, y = torch.zeros(2), torch.ones(2)

    class Record(tc.TorchDispatchMode):  # type: ignore[misc]  # torch leaves the base untyped
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            seen.append([a is x for a in tc.written_args(func, args, kwargs)])
            return func(*args, **kwargs)

    with Record():
        x.add_(y)  # writes x
        torch.add(x, y)  # writes nothing
        torch.add(y, y, out=x)  # writes x through out=
    assert seen == [[True], [], [True]]
    assert x.tolist() == [2.0, 2.0]


def test_module_dicts_are_the_live_stores() -> None:
    m = nn.BatchNorm1d(3)
    m.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert dict(tc.param_dict(m)) == dict(m.named_parameters(recurse=False))
    assert set(tc.buffer_dict(m)) == {"running_mean", "running_var", "num_batches_tracked", "scratch"}
    assert tc.non_persistent_buffers(m) == {"scratch"}
    seq = nn.Sequential(m)
    assert tc.module_dict(seq)["0"] is m
    w = tc.param_dict(m)["weight"]
    tc.param_dict(m)["weight"] = nn.Parameter(torch.full((3,), 2.0))
    try:
        assert m.weight is not w
        assert m.weight.tolist() == [2.0, 2.0, 2.0]
    finally:
        tc.param_dict(m)["weight"] = w
    assert m.weight is w


def test_is_lazy_matches_the_public_lazy_method() -> None:
    lazy, plain = nn.LazyLinear(3), nn.Linear(2, 3)
    assert tc.is_lazy(lazy)
    assert not tc.is_lazy(plain)
    assert callable(getattr(lazy, "has_uninitialized_params", None))  # the documented fallback exists
    assert getattr(plain, "has_uninitialized_params", None) is None


@pytest.mark.parametrize(("kdim", "packed"), [(None, True), (4, False)])
def test_mha_in_proj_packed_matches_the_public_fallback(kdim: int | None, packed: bool) -> None:
    m = nn.MultiheadAttention(8, 2, kdim=kdim, vdim=kdim)
    assert tc.mha_in_proj_packed(m) is packed
    assert (m.in_proj_weight is not None) is packed


def test_private_reset_is_the_default_init_torch_runs() -> None:
    for cls in (nn.MultiheadAttention, nn.Transformer):
        assert callable(cls.__dict__.get(tc.RESET_METHOD)), cls
    m = nn.MultiheadAttention(4, 1)
    with torch.no_grad():
        m.in_proj_weight.zero_()
    tc.private_reset(m)()
    assert m.in_proj_weight.abs().sum() > 0


def test_conv_base_is_every_conv_class() -> None:
    convs = (nn.Conv1d(1, 1, 1), nn.Conv2d(1, 1, 1), nn.Conv3d(1, 1, 1), nn.ConvTranspose2d(1, 1, 1))
    assert all(isinstance(c, tc.ConvNd) for c in convs)
    assert not isinstance(nn.Linear(1, 1), tc.ConvNd)


def test_fill_padding_idx_zeroes_the_padding_row() -> None:
    e = nn.Embedding(5, 3, padding_idx=2)
    with torch.no_grad():
        e.weight.fill_(1.0)
    tc.fill_padding_idx(e)
    assert e.weight[2].tolist() == [0.0, 0.0, 0.0]
    assert e.weight[1].tolist() == [1.0, 1.0, 1.0]
    assert e.weight.requires_grad
    assert e.weight.grad_fn is None


def test_apply_ancestors_sees_the_apply_chain_and_nothing_else() -> None:
    inner = nn.Linear(2, 2)
    mid = nn.Sequential(inner)
    root = nn.Sequential(mid)
    got: dict[int, list[nn.Module] | None] = {}

    def fn(m: nn.Module) -> None:
        got[id(m)] = tc.apply_ancestors(m)

    root.apply(fn)
    assert got[id(inner)] == [mid, root]
    assert got[id(mid)] == [root]
    assert got[id(root)] == []
    assert tc.apply_ancestors(inner) is None  # not called from apply


def test_custom_shard_order_is_none_off_dtensors() -> None:
    assert tc.custom_shard_order(torch.zeros(2), ()) is None


def test_caller_frame_is_the_calling_function() -> None:
    def inner() -> str:
        return tc.caller_frame().f_code.co_name

    assert inner() == "inner"
    assert tc.caller_frame().f_code is test_caller_frame_is_the_calling_function.__code__


def test_forward_pre_hooks_is_the_live_hook_dict() -> None:
    m = nn.Linear(2, 2)

    def hook(module: nn.Module, args: tuple[object, ...]) -> None:
        return None

    handle = m.register_forward_pre_hook(hook)
    assert list(tc.forward_pre_hooks(m).values()) == [hook]
    handle.remove()
    assert not tc.forward_pre_hooks(m)


@pytest.mark.parametrize(
    "rnn",
    [nn.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2), nn.GRU(3, 4, bias=False), nn.RNN(2, 3)],
    ids=["lstm-proj-bi", "gru-nobias", "rnn"],
)
def test_rnn_weight_names_are_torch_flat_order(rnn: nn.RNNBase) -> None:
    names = tc.rnn_weight_names(rnn)
    assert names == [n for n, _ in rnn.named_parameters(recurse=False)]  # torch registers them in flat order
    kinds = ["weight_ih", "weight_hh", *(["bias_ih", "bias_hh"] if rnn.bias else [])]
    kinds += ["weight_hr"] if rnn.proj_size > 0 else []
    suffixes = ["", "_reverse"] if rnn.bidirectional else [""]
    fallback = [f"{k}_l{layer}{s}" for layer in range(rnn.num_layers) for s in suffixes for k in kinds]
    assert names == fallback  # the documented public fallback builds the same list


def test_spectral_norm_vectors_and_power_method() -> None:
    from torch.nn.utils import parametrizations

    m = parametrizations.spectral_norm(nn.Linear(4, 6))
    with torch.no_grad():  # singular values 3, 1, 0.5, 0.2: 15 power iterations converge whatever the seed
        m.parametrizations.weight.original.copy_(torch.eye(6, 4) * torch.tensor([3.0, 1.0, 0.5, 0.2]))
    p = m.parametrizations.weight[0]
    vectors = tc.spectral_norm_vectors(p)
    assert vectors is not None
    u, v = vectors
    assert u.shape == (6,)
    assert v.shape == (4,)
    with torch.no_grad():
        u.fill_(1.0)
        v.fill_(1.0)
        tc.spectral_power_method(p, m.parametrizations.weight.original, 15)
    assert not torch.equal(u, torch.ones(6))  # the iteration wrote the live buffers
    sigma = torch.dot(u, m.parametrizations.weight.original @ v)
    assert torch.allclose(sigma, torch.linalg.matrix_norm(m.parametrizations.weight.original, 2), rtol=1e-3)
    vector = parametrizations.spectral_norm(nn.Linear(4, 1), name="bias")  # a vector: no u, v
    assert tc.spectral_norm_vectors(vector.parametrizations.bias[0]) is None
    assert tc.spectral_norm_vectors(nn.Identity()) is None


def test_weight_norm_suffixes_name_the_old_hooks_parameters() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook-based weight_norm
        m = nn.utils.weight_norm(nn.Linear(3, 4))
    names = {n for n, _ in m.named_parameters()}
    assert {"weight" + tc.WEIGHT_NORM_G, "weight" + tc.WEIGHT_NORM_V} <= names

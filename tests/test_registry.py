"""The adapter registry: registration, MRO and class-path lookup, annotations, layouts(model)."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import packedinit
from packedinit import Layout, PackedInitError, annotate, layouts, register, registered, unregister
from packedinit.adapters import _import_optional
from packedinit.adapters.torch_nn import multihead_attention_layouts, rnn_layouts
from packedinit.model.claims import annotations_of
from packedinit.model.registry import class_path, lookup

E = 4
QKV = Layout(0, [E, E, E], names=("q", "k", "v"))


class FusedBlock(nn.Module):
    """A timm-style block: the packed qkv lives in a child nn.Linear."""

    def __init__(self, d: int = E) -> None:
        super().__init__()
        self.d = d
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(12, 4))


def fused_block_layouts(m: FusedBlock) -> dict[str, Layout]:
    lay = Layout(0, [m.d] * 3, names=("q", "k", "v"))
    return {"qkv.weight": lay, "qkv.bias": lay}


@pytest.fixture
def fused() -> Iterator[None]:
    register(FusedBlock)(fused_block_layouts)
    yield
    unregister(FusedBlock)


def fresh_class(name: str, base: type[nn.Module] = Plain) -> type[nn.Module]:
    return type(name, (base,), {"__module__": __name__, "__qualname__": name})


# -- registration ------------------------------------------------------------------------------------
def test_register_returns_its_argument_and_unregister_returns_what_it_removed() -> None:
    cls = fresh_class("R1")

    def adapter(m: nn.Module) -> dict[str, Layout]:
        return {"w": Layout(0, [4, 4, 4])}

    assert register(cls)(adapter) is adapter
    assert registered()[cls] is adapter
    assert layouts(cls()) == {"w": Layout(0, [4, 4, 4])}
    assert unregister(cls) is adapter
    assert unregister(cls) is None
    assert cls not in registered()
    assert layouts(cls()) == {}


def test_duplicate_registration_is_refused_unless_replace() -> None:
    cls = fresh_class("R2")

    def first(m: nn.Module) -> dict[str, Layout]:
        return {"w": Layout(0, [4, 4, 4])}

    def second(m: nn.Module) -> dict[str, Layout]:
        return {"w": Layout(0, [6, 6])}

    register(cls)(first)
    try:
        with pytest.raises(PackedInitError, match=r"first is already registered for it; pass replace=True"):
            register(cls)(second)
        assert registered()[cls] is first
        register(cls, replace=True)(second)
        assert registered()[cls] is second
        assert layouts(cls()) == {"w": Layout(0, [6, 6])}
    finally:
        unregister(cls)


def test_builtin_adapter_cannot_be_silently_overridden() -> None:
    with pytest.raises(PackedInitError, match=r"rnn_layouts is already registered"):
        register(nn.LSTM)(rnn_layouts)


@pytest.mark.parametrize(
    ("key", "match"),
    [
        (int, r"must be an nn.Module subclass or a class path string, got type"),
        (3, r"got int"),
        ("GPT2Attention", r"a string key must be a full class path"),
        ("transformers.models.", r"a string key must be a full class path"),
    ],
)
def test_bad_keys(key: object, match: str) -> None:
    with pytest.raises(PackedInitError, match=match):
        register(key)(rnn_layouts)  # type: ignore[call-overload]  # wrong on purpose


def test_adapter_must_be_callable() -> None:
    cls = fresh_class("R3")
    with pytest.raises(PackedInitError, match=r"which is not callable"):
        register(cls)(42)  # type: ignore[arg-type]  # wrong on purpose
    assert cls not in registered()


def test_registered_is_a_read_only_snapshot() -> None:
    view = registered()
    assert view[nn.MultiheadAttention] is multihead_attention_layouts
    with pytest.raises(TypeError):
        view[nn.Linear] = rnn_layouts  # type: ignore[index]  # read-only on purpose
    cls = fresh_class("R4")
    register(cls)(rnn_layouts)
    try:
        assert cls not in view
        assert cls in registered()
    finally:
        unregister(cls)


# -- lookup --------------------------------------------------------------------------------------------
def test_mro_lookup_covers_subclasses_and_most_derived_wins() -> None:
    class MyLSTM(nn.LSTM):
        pass

    assert lookup(MyLSTM) == (nn.LSTM, rnn_layouts)
    assert set(layouts(MyLSTM(3, 5))) == set(rnn_layouts(nn.LSTM(3, 5)))

    def mine(m: nn.Module) -> dict[str, Layout]:
        return {}

    register(MyLSTM)(mine)
    try:
        assert lookup(MyLSTM) == (MyLSTM, mine)
        assert layouts(MyLSTM(3, 5)) == {}
        assert lookup(nn.LSTM) == (nn.LSTM, rnn_layouts)
    finally:
        unregister(MyLSTM)
    assert lookup(MyLSTM) == (nn.LSTM, rnn_layouts)  # a new snapshot: no stale cached answer


def test_class_path_key_matches_without_the_type_and_follows_the_mro() -> None:
    cls = fresh_class("ByPath")
    sub = fresh_class("ByPathChild", cls)
    path = f"{__name__}.ByPath"
    assert class_path(cls) == path

    def adapter(m: nn.Module) -> dict[str, Layout]:
        return {"w": Layout(0, [6, 6])}

    register(path)(adapter)
    try:
        assert registered()[path] is adapter
        assert lookup(sub) == (path, adapter)
        assert layouts(sub()) == {"w": Layout(0, [6, 6])}

        def typed(m: nn.Module) -> dict[str, Layout]:
            return {"w": Layout(0, [4, 4, 4])}

        register(cls)(typed)  # a type entry and a path entry for the same class: the type entry wins
        try:
            assert lookup(sub) == (cls, typed)
        finally:
            unregister(cls)
    finally:
        assert unregister(path) is adapter
    assert lookup(sub) is None


def test_third_party_is_never_imported_and_builtins_load_lazily() -> None:
    code = (
        "import sys, torch\n"
        "import packedinit.model.registry as r\n"
        "assert not r._builtins_loaded\n"
        "assert r.lookup(torch.nn.LSTM) is not None and r._builtins_loaded\n"
        "assert len(r.registered()) > 8\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_optional_builtin_module_guard_is_exact(tmp_path: os.PathLike[str]) -> None:
    assert _import_optional("packedinit.adapters.no_such_module") is None
    pkg = os.path.join(tmp_path, "pi_probe_pkg")
    os.makedirs(pkg)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write("")
    with open(os.path.join(pkg, "broken.py"), "w") as f:
        f.write("import pi_probe_missing_dependency\n")
    sys.path.insert(0, os.fspath(tmp_path))
    try:  # a module that exists but misses a dependency is a real error, never hidden
        with pytest.raises(ModuleNotFoundError, match="pi_probe_missing_dependency"):
            _import_optional("pi_probe_pkg.broken")
    finally:
        sys.path.remove(os.fspath(tmp_path))
        for name in ("pi_probe_pkg", "pi_probe_pkg.broken"):
            sys.modules.pop(name, None)


def test_fsdp_style_dynamic_subclass_resolves(fused: None) -> None:
    """FSDP2's fully_shard swaps ``module.__class__`` for ``FSDP<Name>(FSDPModule, <Name>)``."""

    class FSDPModuleLike:
        pass

    for module in (nn.MultiheadAttention(E, 2), FusedBlock(), nn.GRU(3, E)):
        before = layouts(module)
        cls = type(module)
        module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModuleLike, cls), {})
        assert layouts(module) == before != {}


def test_real_fully_shard_keeps_layouts_and_annotations(tmp_path: os.PathLike[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, dim_feedforward=8), nn.Linear(8, 24))
        annotate(model[1], weight=Layout(0, [8, 8, 8]))
        before = layouts(model)
        fully_shard(model[0])
        fully_shard(model)
        assert type(model[0]).__name__ == "FSDPTransformerEncoderLayer"
        assert layouts(model) == before
        assert set(before) == {"0.self_attn.in_proj_weight", "0.self_attn.in_proj_bias", "1.weight"}
    finally:
        dist.destroy_process_group()


def test_register_is_thread_safe() -> None:
    classes = [fresh_class(f"T{i}") for i in range(64)]
    errors: list[BaseException] = []
    dup = fresh_class("TDup")
    wins: list[int] = []
    barrier = threading.Barrier(8)

    def adapter(m: nn.Module) -> dict[str, Layout]:
        return {}

    def work(k: int) -> None:
        try:
            barrier.wait()
            for cls in classes[k::8]:
                register(cls)(adapter)
                assert lookup(cls) == (cls, adapter)
                assert lookup(nn.LSTM) == (nn.LSTM, rnn_layouts)
            try:
                register(dup)(adapter)
                wins.append(k)
            except PackedInitError:
                pass
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert not errors
        assert len(wins) == 1
        view = registered()
        assert all(view[c] is adapter for c in classes)
    finally:
        for cls in [*classes, dup]:
            unregister(cls)


# -- layouts(model) ------------------------------------------------------------------------------------
def test_layouts_fully_qualified_in_named_parameters_order(fused: None) -> None:
    model = nn.Sequential(FusedBlock(), nn.LSTM(3, E), nn.MultiheadAttention(E, 2, kdim=3, vdim=5))
    got = layouts(model)
    assert list(got) == [n for n, _ in model.named_parameters() if n in got]
    assert got["0.qkv.weight"] == got["0.qkv.bias"] == QKV
    assert got["1.weight_ih_l0"] == Layout(0, [E] * 4, names=("i", "f", "g", "o"))
    assert "2.in_proj_bias" in got
    assert "2.q_proj_weight" not in got
    assert "0.proj.weight" not in got


def test_tied_parameter_reported_once_under_its_first_name(fused: None) -> None:
    a, b = FusedBlock(), FusedBlock()
    b.qkv.weight = a.qkv.weight
    model = nn.Sequential(a, b)
    got = layouts(model)
    assert "0.qkv.weight" in got
    assert "1.qkv.weight" not in got
    assert "1.qkv.bias" in got


def test_adapter_claiming_a_missing_parameter() -> None:
    cls = fresh_class("Bad1")

    def bad(m: nn.Module) -> dict[str, Layout]:
        return {"nope": QKV}

    register(cls)(bad)
    try:
        model = nn.Sequential(nn.Linear(2, 2), cls())
        with pytest.raises(
            PackedInitError, match=r"adapter .*bad \(registered for .*Bad1\) at module '1' claims parameter 'nope'"
        ):
            layouts(model)
    finally:
        unregister(cls)


def test_adapter_layout_that_does_not_fit_names_adapter_module_parameter_and_shape() -> None:
    cls = fresh_class("Bad2")

    def bad(m: nn.Module) -> dict[str, Layout]:
        return {"w": Layout(0, [5, 5])}

    register(cls)(bad)
    try:
        model = nn.Sequential(nn.Sequential(cls()))
        w = model.get_parameter("0.0.w").detach().clone()
        with pytest.raises(
            PackedInitError,
            match=r"adapter .*bad .* at module '0.0': parameter '0.0.w' of shape \(12, 4\) .*needs .*= 10",
        ):
            layouts(model)
        with pytest.raises(PackedInitError, match=r"parameter '0.0.w' of shape \(12, 4\)"):
            packedinit.chunked(torch.nn.init.xavier_uniform_)(model)
        assert torch.equal(model.get_parameter("0.0.w"), w)
    finally:
        unregister(cls)


@pytest.mark.parametrize(
    ("result", "match"),
    [
        ({"w": 3}, r"gives int 3 for parameter 'w' of shape \(12, 4\); give a packedinit.Layout"),
        ([("w", QKV)], r"returned list; an adapter returns"),
        ({1: QKV}, r"returned the key 1; parameter names must be strings"),
    ],
)
def test_adapter_returning_garbage(result: object, match: str) -> None:
    cls = fresh_class("Bad3")

    def bad(m: nn.Module) -> object:
        return result

    register(cls)(bad)  # type: ignore[arg-type]  # wrong on purpose
    try:
        with pytest.raises(PackedInitError, match=match):
            layouts(cls())
    finally:
        unregister(cls)


def test_two_adapters_disagreeing_is_an_error_and_annotation_decides(fused: None) -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = FusedBlock()

    def outer(m: nn.Module) -> dict[str, Layout]:
        return {"block.qkv.weight": Layout(0, [6, 6])}

    register(Outer)(outer)
    try:
        model = Outer()
        with pytest.raises(PackedInitError, match=r"'block.qkv.weight' of shape \(12, 4\) gets two different layouts"):
            layouts(model)
        annotate(model.block.qkv, weight=QKV)
        assert layouts(model)["block.qkv.weight"] == QKV
    finally:
        unregister(Outer)


def test_layouts_needs_a_module() -> None:
    with pytest.raises(PackedInitError, match=r"needs an nn.Module, got Tensor"):
        layouts(torch.zeros(3))  # type: ignore[arg-type]  # wrong on purpose


# -- annotate -----------------------------------------------------------------------------------------
def test_annotation_beats_type_adapter_and_none_unmarks() -> None:
    mha = nn.MultiheadAttention(E, 2)
    annotate(mha, in_proj_weight=Layout(0, [2 * E, E]))
    assert layouts(mha)["in_proj_weight"] == Layout(0, [2 * E, E])
    annotate(mha, in_proj_weight=None)
    assert "in_proj_weight" not in layouts(mha)
    assert "in_proj_bias" in layouts(mha)
    assert layouts(nn.MultiheadAttention(E, 2))["in_proj_weight"] == QKV  # other instances unaffected


def test_annotate_checks_before_recording() -> None:
    lin = nn.Linear(4, 12)
    w = lin.weight.detach().clone()
    with pytest.raises(PackedInitError, match=r"annotate\(Linear, ...\): parameter 'weight' of shape \(12, 4\)"):
        annotate(lin, weight=Layout(0, [5, 5]))
    with pytest.raises(PackedInitError, match=r"claims parameter 'wieght'.*its parameters: \['weight', 'bias'\]"):
        annotate(lin, wieght=QKV)
    with pytest.raises(PackedInitError, match=r"gives tuple .* give a packedinit.Layout"):
        annotate(lin, weight=(4, 4, 4))  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(PackedInitError, match=r"needs an nn.Module"):
        annotate(w)  # type: ignore[type-var]  # wrong on purpose
    assert dict(annotations_of(lin)) == {}
    assert torch.equal(lin.weight, w)


def test_dotted_annotation_is_stored_on_the_owner() -> None:
    model = nn.Sequential(nn.Linear(4, 12))
    assert annotate(model, **{"0.weight": QKV}) is model
    assert dict(annotations_of(model[0])) == {"weight": QKV}
    assert dict(annotations_of(model)) == {}
    assert layouts(model) == {"0.weight": QKV}


def test_annotations_survive_to_to_empty_deepcopy_and_pickle() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 12))
    annotate(model[0], weight=QKV)
    model.to_empty(device="cpu")
    model.to(torch.float64)
    assert layouts(model) == {"0.weight": QKV}
    assert layouts(copy.deepcopy(model)) == {"0.weight": QKV}
    assert layouts(pickle.loads(pickle.dumps(model))) == {"0.weight": QKV}


def test_annotate_without_keywords_stamps_every_known_parameter_on_its_owner(fused: None) -> None:
    block, mha = FusedBlock(), nn.MultiheadAttention(E, 2)
    model = nn.Sequential(block, mha)
    before = layouts(model)
    annotate(model)
    assert dict(annotations_of(block.qkv)) == {"weight": QKV, "bias": QKV}
    assert dict(annotations_of(mha)) == {"in_proj_weight": QKV, "in_proj_bias": QKV}
    assert dict(annotations_of(block)) == {}
    unregister(FusedBlock)
    try:
        assert layouts(model) == before  # now carried by the instances alone
    finally:
        register(FusedBlock)(fused_block_layouts)

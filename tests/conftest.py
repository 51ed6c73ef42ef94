"""Shared test configuration: hypothesis profiles (CI keeps the suite fast on 2 cores) and fixtures."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))  # the tests' private helpers (--import-mode=importlib adds none)
from _tv_ops import define_torchvision_ops

import packedinit

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))



#: The transformers release the adapters' class paths were checked against (the sweep's). An older
#: one (5.20 is the newest for Python 3.10) may not ship a newer family yet: that family is passed
#: over there; on this release or newer a missing module is a failure (a typo in a class path).
CHECKED_TRANSFORMERS = (5, 24)


@pytest.fixture
def ships() -> Callable[[str], bool]:
    """``ships(module_name)``: whether the installed transformers has that module (see CHECKED_TRANSFORMERS)."""
    transformers = pytest.importorskip("transformers", reason="needs the test extras: pip install -e '.[test]'")
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])

    def check(module_name: str) -> bool:
        try:
            if importlib.util.find_spec(module_name) is not None:
                return True
        except ModuleNotFoundError:  # the family's package itself is missing
            pass
        assert version < CHECKED_TRANSFORMERS, f"{module_name} is missing from transformers {transformers.__version__}"
        return False

    return check


@pytest.fixture(scope="session")
def lib() -> Callable[[str], ModuleType]:
    """``lib("timm")``: the library module, importing it the way tests/torchvision_shim.py allows, or a skip.

    The libraries of tests/test_libs_*.py are not in the test extras (timm, open_clip and torchtitan install
    only with --no-deps beside a CPU torch; .ci/libs.txt lists them and .ci/run installs them in their own
    venv), so a test that needs one skips, naming it, where it is not installed.
    """
    def load(name: str) -> ModuleType:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            missing = f"{name.split('.')[0]} is not installed (the library tests' venv: bash .ci/libs)"
            if os.environ.get("PACKEDINIT_REQUIRE_LIBS"):  # .ci/libs: a missing library fails
                pytest.fail(missing)
            pytest.skip(missing)
        define_torchvision_ops()  # tests/_tv_ops.py: loads tests/torchvision_shim.py once, keeps it alive
        with warnings.catch_warnings():  # the library's own import warnings (torch.jit deprecations) are not ours
            warnings.simplefilter("ignore")
            return importlib.import_module(name)

    return load


class Story:
    """The checks every library of tests/test_libs_*.py goes through (issue 27, item 4)."""

    @staticmethod
    def rows(layout: object, out: int) -> list[list[int]]:
        """The output-feature rows of each logical block of ``layout`` on an ``(out, 1)`` weight (in block order)."""
        assert isinstance(layout, packedinit.Layout)
        index = torch.arange(out).view(out, 1)
        plain = packedinit.Layout(0, layout.sizes, groups=layout.groups)
        return [plain.storage_view(index, b).flatten().tolist() for b in plain.blocks(index.shape)]

    @staticmethod
    def audit_fix_works(model: nn.Module) -> object:
        """Audit, run the printed fix as printed, audit again: not affected, only the named parameters changed."""
        before = packedinit.audit(model)
        fix = before.fix()
        assert fix is not None, before.answer()
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
        exec(fix, {"packedinit": packedinit, "torch": torch, "model": model})  # the printed line, as printed
        after = packedinit.audit(model)
        assert after.affected == (), after.answer()
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), values[n]) is (n not in before.affected), n
        return before

    @staticmethod
    def fix_builds_per_block(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
        """``with fix_torch_defaults(): make()`` against ``make()`` from one seed: only packed weights differ,
        and the fixed build is not affected. Returns (plain, fixed)."""
        torch.manual_seed(0)
        plain = make()
        torch.manual_seed(0)
        with packedinit.fix_torch_defaults():
            fixed = make()
        packed = packedinit.layouts(fixed)
        for (n, a), (_, b) in zip(plain.named_parameters(), fixed.named_parameters(), strict=True):
            if n not in packed:
                assert torch.equal(a, b), n
        assert packedinit.audit(fixed).affected == ()
        return plain, fixed

    @staticmethod
    def chunked_is_per_block(model: nn.Module, f: Callable[..., object]) -> None:
        """``chunked(f)(model)`` gives every packed weight's blocks their own fans: the audit sees it per block."""
        torch.manual_seed(0)
        packedinit.chunked(f)(model)
        report = packedinit.audit(model)
        assert report.affected == (), report.answer()
        params = dict(model.named_parameters())
        packed = {n for n, lay in packedinit.layouts(model).items() if len(lay.sizes) > 1 and params[n].dim() >= 2}
        assert packed, "the model has no packed weight"
        for n in packed:
            if n in report and report[n].verdict != "undecided":
                assert report[n].verdict == "per-block", (n, report[n].verdict, report[n].detail)

    @staticmethod
    def meta_flow_matches(make: Callable[[], nn.Module], min_numel: int = 512) -> None:
        """meta -> ``to_empty`` -> ``reset_parameters`` against a normal build: every parameter of at least
        ``min_numel`` values within 15% in std (smaller ones are too noisy to compare from one draw),
        and every parameter set (nothing left as ``to_empty``'s garbage: finite everywhere)."""
        torch.manual_seed(0)
        built = make()
        with torch.device("meta"):
            model = make()
        packedinit.to_empty(model, device="cpu")
        packedinit.reset_parameters(model)
        pairs = zip(built.named_parameters(), model.named_parameters(), strict=True)
        for (n, a), (_, b) in pairs:
            assert bool(torch.isfinite(b).all()), n
            if a.numel() >= min_numel:
                sa, sb = float(a.detach().std()), float(b.detach().std())
                assert abs(sb - sa) <= 0.15 * sa + 1e-12, (n, sa, sb)

    @staticmethod
    def same_layout(a: object, b: object) -> bool:
        """Two layouts split the same rows (block names aside)."""
        assert isinstance(a, packedinit.Layout)
        assert isinstance(b, packedinit.Layout)
        return all(getattr(a, k) == getattr(b, k) for k in ("dim", "sizes", "groups", "transposed", "batch_dims"))


@pytest.fixture(scope="session")
def story() -> type[Story]:
    return Story

"""Shared test configuration: hypothesis profiles (CI keeps the suite fast on 2 cores) and fixtures."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings

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

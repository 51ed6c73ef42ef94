"""Inputs tried on a meta twin of the model until its forward accepts one (the example-input builders' trials).

A builder that cannot tell from the config which of a few layouts the forward wants (raw audio with or without
a channel axis, flattened patches or patch images, ...) builds each and calls :func:`first_fitting`: the forward
runs on a meta twin (no value read or written, every random state put back), and the first trial that goes
through is taken. A forward that reads values (which meta cannot give) is tried at once on a real copy where the
model is small; else the first trial that got that far is taken.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from packedinit.trace.twin import meta_twin, random_states_kept

__all__ = ["MASKS", "first_fitting"]

#: The suffixes of a mask input that follows another input (``input_features_mask``, ``..._attention_mask``).
MASKS = tuple("_" + s for s in ("mask", "attention_mask"))  # spelled so: no torch-private-looking literal
_REAL_PROBE = 20_000_000  # a model this small is tried for real where its forward reads values
_VALUES = ("meta tensor", "expected device meta", "not on the expected device", "no data!", "without output_size")


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _outcome(model: nn.Module, kwargs: dict[str, Any]) -> str:
    """``"ok"``, ``"values"`` (it got as far as reading a value, which meta cannot give), ``"bool"`` or ``"no"``."""
    meta = _on_meta(model)
    given = {k: torch.empty_like(v, device="meta") if isinstance(v, Tensor) and meta else v for k, v in kwargs.items()}
    try:
        with random_states_kept(), torch.no_grad():
            model(**given)
    except Exception as e:
        text = str(e)
        return "values" if any(k in text for k in _VALUES) else "bool" if "bool" in text else "no"
    return "ok"


def _tried(model: nn.Module, trial: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """How the forward takes ``trial``, and the trial as taken (its masks made bool where it reads them as such)."""
    outcome = _outcome(model, trial)
    if outcome == "bool":  # the mask is read as a predicate: a bool mask
        mask = {k: v.bool() for k, v in trial.items() if k.endswith(MASKS) and isinstance(v, Tensor)}
        trial = {**trial, **mask}
        outcome = _outcome(model, trial)
    return outcome, trial


def first_fitting(model: nn.Module, trials: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first trial the forward accepts on a meta twin, else the first that got as far as reading a value.

    Where the forward reads values and the model is small (and not on meta), such a trial is run at once on
    a real copy: the first one that runs through there is taken.
    """
    twin = meta_twin(model)
    twin.eval()
    small = sum(p.numel() for p in model.parameters()) <= _REAL_PROBE and not _on_meta(model)
    copied: nn.Module | None = None
    reached: dict[str, Any] | None = None
    for trial in trials:
        outcome, trial = _tried(twin, trial)
        if outcome == "ok":
            return trial
        if outcome == "values" and small:
            copied = copied if copied is not None else copy.deepcopy(model).eval()
            real, trial = _tried(copied, trial)
            if real == "ok":
                return trial
        elif outcome == "values" and reached is None:
            reached = trial
    return reached



"""Example inputs built from a model, for the forward tracer: :func:`example_inputs`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["example_inputs"]


def example_inputs(model: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``(args, kwargs)`` that ``model``'s forward accepts, built from its config; None where none can be built.

    A transformers text model (a ``config`` with ``vocab_size``) gets 2 x 4 token ids (and
    decoder ids for an encoder-decoder). No random number is drawn.

    Examples:
        >>> example_inputs(torch.nn.Linear(2, 2)) is None
        True
    """
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None) if config is not None else None
    if not isinstance(vocab, int) or vocab < 2 or not hasattr(model, "get_input_embeddings"):
        return None
    ids = (torch.arange(8, dtype=torch.long).view(2, 4) * 7 + 1) % vocab
    kwargs: dict[str, Any] = {"input_ids": ids}
    if getattr(config, "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = ids.clone()
    return (), kwargs

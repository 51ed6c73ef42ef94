"""The global CPU RNG, touched by packedinit only under one lock and only where it must be.

Two places need the default CPU generator's state: a module's own ``reset_parameters``
draws from it, so :func:`generator_as_default` swaps a caller's generator in around it;
and a dry run of a user function on meta tensors restores what it may have drawn
(:func:`global_restored`). Both hold :data:`LOCK`, so threads that each pass their own
generator never see each other's states, and the global RNG ends as it was. A thread that
draws from the global RNG itself, outside packedinit, while another thread is inside
:func:`generator_as_default` still interleaves with it: the default generator is one
object for the whole process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["LOCK", "generator_as_default", "global_restored"]

#: Held while packedinit has put another state into the default CPU generator (re-entrant:
#: a module's ``reset_parameters`` may call packedinit again).
LOCK = threading.RLock()


@contextmanager
def generator_as_default(generator: torch.Generator) -> Iterator[None]:
    """Run code that draws from the default CPU RNG as if it drew from ``generator`` (a CPU generator).

    The default generator takes ``generator``'s state, the code runs, ``generator`` takes the
    advanced state and the default generator gets its own state back, all under :data:`LOCK`.

    Examples:
        >>> g = torch.Generator().manual_seed(0)
        >>> before = torch.get_rng_state()
        >>> with generator_as_default(g):
        ...     x = torch.rand(2)
        >>> torch.equal(x, torch.rand(2, generator=torch.Generator().manual_seed(0)))
        True
        >>> torch.equal(before, torch.get_rng_state())
        True
    """
    with LOCK:
        saved = torch.get_rng_state()
        torch.set_rng_state(generator.get_state())
        try:
            yield
        finally:
            generator.set_state(torch.get_rng_state())
            torch.set_rng_state(saved)


@contextmanager
def global_restored() -> Iterator[None]:
    """Put the default CPU generator back as it was, if the code inside changed it (under :data:`LOCK`).

    Only a change is undone: a state nobody touched is not written back, so a dry run never
    rewinds what another thread drew meanwhile unless the code inside drew itself.
    """
    with LOCK:
        saved = torch.get_rng_state()
        try:
            yield
        finally:
            now = torch.get_rng_state()
            if not torch.equal(now, saved):
                torch.set_rng_state(saved)

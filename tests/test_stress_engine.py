"""Issue 20 items 2, 6, 9: cache keys that tell every value apart and keep nothing alive; a dry run
that never rewinds another thread's global RNG."""

from __future__ import annotations

import functools
import gc
import math
import struct
import sys
import threading
import weakref

import torch
from torch import Tensor
from torch.nn.init import constant_, normal_, uniform_, xavier_uniform_

from packedinit import chunked, chunked_init
from packedinit.engine.keys import request_key, value_key
from packedinit.engine.plan import Request


def _bits(t: Tensor) -> set[bytes]:
    return {struct.pack("<f", float(x)) for x in t.flatten().tolist()}


def test_sign_of_zero_is_not_lost_in_the_caches() -> None:
    """constant_(0.0) then constant_(-0.0) on the same shape: the second writes -0.0 (item 2)."""
    w = torch.empty(6, 2)
    chunked_init(w, 3, 0, constant_, 0.0)
    assert _bits(w) == {struct.pack("<f", 0.0)}
    chunked_init(w, 3, 0, constant_, -0.0)
    assert _bits(w) == {struct.pack("<f", -0.0)}
    chunked_init(w, 3, 0, constant_, val=0.0)
    chunked_init(w, 3, 0, constant_, val=-0.0)
    assert _bits(w) == {struct.pack("<f", -0.0)}
    chunked(uniform_, 3)(w, -0.0, 0.0)  # a key per argument, positional too
    assert torch.all(w == 0)


def test_nan_payloads_are_told_apart() -> None:
    one = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
    two = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000002))[0]
    assert math.isnan(one)
    assert math.isnan(two)
    assert value_key(one) != value_key(two)
    assert value_key(one) == value_key(struct.unpack("<d", struct.pack("<d", one))[0])  # same bits: same key
    assert value_key(1) != value_key(1.0) != value_key(True)


def test_key_is_derived_from_every_request_field() -> None:
    """A request differing in any one field has another key; a field of an unknown kind makes it uncacheable."""
    t = torch.empty(6, 2)
    base = Request(t, 3, 0, xavier_uniform_, (), {}, "w")
    variants = [
        Request(torch.empty(6, 3)[:, :2], 3, 0, xavier_uniform_, (), {}, "w"),  # strides
        Request(t, [2, 2, 2], 0, xavier_uniform_, (), {}, "w"),
        Request(t, 3, -2, xavier_uniform_, (), {}, "w"),
        Request(t, 3, 0, normal_, (), {}, "w"),
        Request(t, 3, 0, xavier_uniform_, (1.0,), {}, "w"),
        Request(t, 3, 0, xavier_uniform_, (), {"gain": 1.0}, "w"),
        Request(t, 3, 0, xavier_uniform_, (), {}, "v"),
        Request(t, 3, 0, xavier_uniform_, (), {"generator": torch.Generator()}, "w"),
    ]
    keys = {request_key(r) for r in [base, *variants]}
    assert None not in keys
    assert len(keys) == 1 + len(variants)
    assert request_key(Request(t, 3, 0, lambda x: x)) is None  # a caller's function: not cached
    assert request_key(Request(t, 3, 0, xavier_uniform_, (torch.tensor(1.0),))) is None  # a tensor argument


def _dead(ref: weakref.ref[object]) -> bool:
    gc.collect()
    return ref() is None


def test_caches_keep_no_generator_alive() -> None:
    """Item 9: a generator passed once is not kept by the plan/program caches."""
    for chunks, fn in ((3, xavier_uniform_), ([2, 2, 2], normal_), (3, functools.partial(uniform_, a=-1.0))):
        g = torch.Generator().manual_seed(0)
        held = sys.getrefcount(g)  # torch 2.6's Generator takes no weak reference: count the references
        w = torch.empty(6, 4)
        chunked_init(w, chunks, 0, fn, generator=g)
        chunked_init(w, chunks, 0, fn, generator=g)  # a second call hits the caches
        gc.collect()
        assert sys.getrefcount(g) == held, (chunks, fn)


def test_a_cached_plan_uses_the_calls_own_generator() -> None:
    w1, w2 = torch.empty(6, 4), torch.empty(6, 4)
    chunked_init(w1, 3, 0, xavier_uniform_, generator=torch.Generator().manual_seed(1))
    chunked_init(w2, 3, 0, xavier_uniform_, generator=torch.Generator().manual_seed(2))
    want = torch.empty(6, 4)
    g = torch.Generator().manual_seed(2)
    for part in want.split(2):
        xavier_uniform_(part, generator=g)
    assert torch.equal(w2, want)
    assert not torch.equal(w1, w2)


def test_a_user_function_and_its_closure_are_not_kept_alive() -> None:
    """Item 9: a user init function passed with generator= (a 4 MB closure) is released after the call."""

    def make() -> tuple[object, weakref.ref[Tensor]]:
        big = torch.zeros(1 << 20)

        def init(t: Tensor, generator: torch.Generator | None = None) -> Tensor:
            return t.uniform_(generator=generator).add_(big[0])

        return init, weakref.ref(big)

    fn, big_ref = make()
    fn_ref = weakref.ref(fn)
    chunked_init(torch.empty(6, 4), 3, 0, fn, generator=torch.Generator().manual_seed(0))  # type: ignore[arg-type]
    chunked(fn)(torch.nn.Linear(4, 4), generator=torch.Generator())  # type: ignore[arg-type]
    del fn
    assert _dead(fn_ref)  # type: ignore[arg-type]
    assert _dead(big_ref)  # type: ignore[arg-type]


def test_dry_run_never_rewinds_another_threads_global_rng() -> None:
    """Item 6: only chunked_init(w, 3, 0, user_fn, generator=g) here; another thread draws meanwhile."""
    drawn: list[Tensor] = []

    def other_thread() -> None:
        drawn.append(torch.rand(50))

    def user_fn(t: Tensor, generator: torch.Generator | None = None) -> Tensor:
        if t.is_meta:  # the dry run: let another thread draw from the global RNG now
            th = threading.Thread(target=other_thread)
            th.start()
            th.join()
            return t
        return t.uniform_(generator=generator)

    torch.manual_seed(0)
    chunked_init(torch.empty(6, 4), 3, 0, user_fn, generator=torch.Generator().manual_seed(0))
    after = torch.rand(50)
    torch.manual_seed(0)
    torch.rand(50)  # what the other thread drew
    assert torch.equal(after, torch.rand(50))  # continues after it, not a repeat of it
    assert not torch.equal(after, drawn[0])

"""PrefixIndex.match's per-worker results built in C (``kvstream.index._match_native.fill``
and ``zeros``) equal the Python loops': lower tiers, stale, repeated and unknown candidates
included."""

from __future__ import annotations

import gc
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_support import Producer, tokens

from kvstream.index import DomainKey, PrefixIndex, WorkerKey
from kvstream.index import match_plan as index_module
from kvstream.index.matching import WorkerMatch
from kvstream.index.record import Record

pytestmark = pytest.mark.skipif(index_module._fill is None, reason="the C extension is not built")


def _build(seed: int) -> tuple[PrefixIndex, list[list[int]], list[WorkerKey]]:
    rng = random.Random(seed)
    idx = PrefixIndex()
    prompts = [tokens(4 * rng.randint(1, 12) + 1, seed=s) for s in range(4)]
    keys = []
    for w in range(rng.randint(1, 6)):
        p = Producer(f"w{w}", rank=w % 2)
        keys.append(WorkerKey(f"w{w}", w % 2))
        evs = [p.created(capacity=(1000, 1000))]
        for prompt in rng.sample(prompts, rng.randint(0, 3)):
            chain = p.chain(prompt[:-1])
            cut = rng.randint(1, len(chain))
            # some workers keep part of a prefix on the host tier (weighted below 1)
            evs.append(p.stored(chain[:cut], level=1 if rng.random() < 0.3 else 0))
        idx.apply(p.batch(*evs))
        if rng.random() < 0.2:
            idx.mark_stale(keys[-1], "test")
    return idx, prompts, keys


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 100_000))
def test_c_results_equal_the_python_loop(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    idx, prompts, keys = _build(seed)
    rng = random.Random(seed)
    shapes: list[list[WorkerKey] | None] = [
        None,
        [*keys, keys[0], WorkerKey("nobody", 0)],  # repeated and unknown candidates
        rng.sample(keys, len(keys)),
    ]
    queries = [*prompts, tokens(30, seed=99)]
    native = [idx.match(q, workers=w, tier_weights=(1.0, 0.25)) for w in shapes for q in queries]
    assert index_module._fill is not None
    assert index_module._zeros is not None
    with monkeypatch.context() as mp:  # undone before hypothesis' next example
        mp.setattr(index_module, "_fill", None)
        mp.setattr(index_module, "_zeros", None)
        idx._plans.clear()
        python = [
            idx.match(q, workers=w, tier_weights=(1.0, 0.25)) for w in shapes for q in queries
        ]
    assert native == python
    assert any(m.matched_blocks for r in native for m in r.matches) or not idx.stats().blocks


def test_fill_leaves_lower_tier_tables_to_the_caller() -> None:
    """A table holding host-tier blocks is returned for weighing, not filled."""
    p = Producer("w0")
    idx = PrefixIndex()
    prompt = tokens(41)
    chain = p.chain(prompt[:-1])
    idx.apply(p.batch(p.created(capacity=(100, 100)), p.stored(chain[:5], level=1)))
    got = idx.match(prompt, tier_weights=(1.0, 0.5)).matches[0]
    assert (got.matched_blocks, got.weighted_blocks) == (5, 2.5)
    assert index_module._fill is not None
    out: list[object] = [None]
    found = [(0, 5)]
    plan = idx._plan(0, None, None, None)
    assert index_module._fill(out, found, plan.slots, tuple, 10, 4, "blake3_64", 1.0) == found
    assert out == [None]


def test_fill_rejects_malformed_input() -> None:
    fill = index_module._fill
    assert fill is not None
    with pytest.raises(TypeError):
        fill([], [(0,)], {}, tuple, 1, 1, "a", 1.0)
    with pytest.raises(KeyError):
        fill([], [(0, 1)], {}, tuple, 1, 1, "a", 1.0)


class _InitRecord(Record):
    """A result class with its own ``__init__``: the C loops must call it, not bypass it."""

    __slots__ = ()
    worker: object
    matched_blocks: int
    weighted_blocks: float
    request_blocks: int
    tokens_per_block: int
    hash_algo: str
    trusted: bool
    note: str

    def __init__(self, *args: object) -> None:
        _INIT_CALLS.append(args)


_INIT_CALLS: list[tuple[object, ...]] = []


def test_zeros_builds_what_the_constructor_builds() -> None:
    """Directly allocated records equal the constructor's, GC tracking included, and a class
    that overrides ``__init__`` is called rather than bypassed."""
    idx, _, keys = _build(7)
    plan = idx._plan(0, [*keys, keys[0]], None, None)
    assert index_module._zeros is not None
    n_of = dict.fromkeys(plan.dkeys, 9)
    direct: list[object] = [None] * plan.size
    index_module._zeros(direct, plan.slots, WorkerMatch, n_of)
    expected: list[object] = [None] * plan.size
    for key, _, dk, trusted, note, pos, more in plan.slots.values():
        m = WorkerMatch(key, 0, 0.0, 9, dk.tokens_per_block, dk.hash_algo, trusted, note)
        for i in (pos, *more):
            expected[i] = m
    assert direct == expected
    for got, want in zip(direct, expected, strict=True):
        if got is not None:
            assert type(got) is WorkerMatch
            assert gc.is_tracked(got) == gc.is_tracked(want)
    called: list[object] = [None] * plan.size
    _INIT_CALLS.clear()
    index_module._zeros(called, plan.slots, _InitRecord, n_of)
    assert len(_INIT_CALLS) == len(plan.slots)
    assert all(type(m) is _InitRecord for m in called if m is not None)


def test_zeros_rejects_malformed_input() -> None:
    zeros = index_module._zeros
    assert zeros is not None
    with pytest.raises(TypeError):
        zeros([], {0: (1, 2)}, WorkerMatch, {})
    with pytest.raises(KeyError):
        zeros([None], {0: ("k", None, "dom", True, "", 0, [])}, WorkerMatch, {})
    dom = DomainKey("blake3_64", 16, 0)
    with pytest.raises(IndexError):
        zeros([], {0: ("k", None, dom, True, "", 0, [])}, WorkerMatch, {dom: 1})


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 100_000),
    policy=st.sampled_from(["kv", "kv@2.5", "least-loaded"]),
)
def test_c_scores_equal_the_python_loop(
    seed: int, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Router.route's scores built in C (``_match_native.score``) equal the Python loop's,
    bit for bit, over random loads, stale workers, lower tiers and unknown candidates; so do
    the picks and the adaptive signals that follow from them."""
    from kvstream.index import Router, RouterConfig
    from kvstream.index import router as router_module

    idx, prompts, keys = _build(seed)
    name, _, weight = policy.partition("@")
    cands = [*keys, WorkerKey("nobody", 0)]

    def run() -> list[object]:
        router = Router(
            idx,
            cands,
            RouterConfig(
                policy=name,
                overlap_weight=float(weight) if weight else None,
                tier_weights=(1.0, 0.3),
            ),
        )
        r = random.Random(seed)
        out: list[object] = []
        for i in range(30):
            d = router.route(r.choice(prompts))
            out.append(d)
            router.load.start(f"r{i}", d.worker, r.randint(0, 9), prefill_blocks=r.random() * 5)
            if r.random() < 0.4:
                router.load.prefilled(f"r{r.randrange(i + 1)}")
            if r.random() < 0.3:
                router.load.finish(f"r{r.randrange(i + 1)}")
        out.append(router.signals)
        return out

    assert router_module._score is not None
    native = run()
    with monkeypatch.context() as mp:  # undone before hypothesis' next example
        mp.setattr(router_module, "_score", None)
        python = run()
    assert native == python

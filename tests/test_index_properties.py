"""Property tests: the mask search equals a block-by-block walk under any event sequence, the
index's invariants hold, and the index predicts exactly what a real cache manager reuses."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_support import Producer, tokens

from kvstream.cache import CacheConfig, CacheFullError, KVCacheManager, LayerGroupSpec
from kvstream.events.model import SourceId
from kvstream.index import PrefixIndex, WorkerKey

TPB = 4
# a small tree of requests: prefixes share blocks, so stores and removals interleave
BASES = [tokens(8, seed=s) for s in range(3)]
TAILS = [tokens(12, seed=10 + s) for s in range(4)]
REQUESTS = [b + t for b in BASES for t in TAILS]

op = st.one_of(
    st.tuples(
        st.just("store"), st.integers(0, len(REQUESTS) - 1), st.integers(0, 4), st.integers(0, 2)
    ),
    st.tuples(
        st.just("remove"), st.integers(0, len(REQUESTS) - 1), st.integers(0, 4), st.integers(0, 2)
    ),
    st.tuples(
        st.just("orphan"), st.integers(0, len(REQUESTS) - 1), st.integers(1, 4), st.integers(0, 2)
    ),
    st.tuples(
        st.just("move"), st.integers(0, len(REQUESTS) - 1), st.integers(0, 4), st.integers(0, 2)
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), op), max_size=60))
def test_mask_search_equals_walk_under_any_operations(
    ops: list[tuple[int, tuple[str, int, int, int]]],
) -> None:
    producers = [Producer(f"w{i}", tpb=TPB) for i in range(4)]
    idx = PrefixIndex()
    for p in producers:
        idx.apply(p.batch(p.created()))
    for w, (kind, r, i, level) in ops:
        p = producers[w]
        hs = p.chain(REQUESTS[r])
        if kind == "store":
            ev = p.stored(hs[: i + 1], level=level)
        elif kind == "remove":
            ev = p.removed([hs[i]], level=level if level else None)
        elif kind == "orphan":
            ev = p.stored(hs[i:], parent=hs[i - 1], level=level)
        else:
            ev = p.updated(hs[i], level, (level + 1) % 3)
        idx.apply(p.batch(ev))
    idx.check()
    subset = [WorkerKey("w0"), WorkerKey("w2")]  # a filtered search
    idx.mark_stale(WorkerKey("w3"), "test")
    domain = idx.domain_of(WorkerKey("w0"))
    assert domain is not None
    for r in REQUESTS:
        res = idx.match(r, request=_full())
        walks = {}
        for m, p in zip(res, producers, strict=True):
            table = idx.table(m.worker)
            assert table is not None
            walks[m.worker] = table.walk(p.chain(r))
            assert m.matched_blocks == walks[m.worker], (m, r)
        part = idx.match(r, request=_full(), workers=subset)
        assert [m.matched_blocks for m in part] == [walks[w] for w in subset]
        trusted = idx.match_hashes(domain, producers[0].chain(r))
        assert trusted == {w: d for w, d in walks.items() if d and w != WorkerKey("w3")}


def _full():  # type: ignore[no-untyped-def]
    from kvstream.index import HashRequest

    return HashRequest(drop_last_token=False)


def test_index_predicts_what_a_cache_manager_reuses() -> None:
    """Requests through real metadata-only managers (LRU eviction, leaf-first) with their
    events fed to the index: the index's match is always the manager's reuse boundary."""
    rng = random.Random(7)
    managers = []
    for i in range(3):
        cfg = CacheConfig(
            tokens_per_block=TPB,
            groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=40)],
            hash_algo="v2_sha256_64",
            metadata_only=True,
        )
        managers.append(KVCacheManager(cfg, source=SourceId(instance_id=f"m{i}", incarnation=1)))
    idx = PrefixIndex()
    running: list[tuple[int, str]] = []
    checked = 0
    for n in range(400):
        for w, mgr in enumerate(managers):
            b = mgr.flush_events()
            if b is not None:
                idx.apply(b)
            del w
        w = rng.randrange(3)
        mgr = managers[w]
        prompt = (
            rng.choice(BASES)
            + rng.choice(TAILS)[: rng.randrange(1, 12)]
            + tokens(rng.randrange(0, 9), seed=n)
        )
        predicted = idx.match(prompt, workers=[WorkerKey(f"m{w}")]).matches[0]
        try:
            actual = mgr.add_request(f"r{n}", prompt)
        except CacheFullError:
            continue
        assert predicted.trusted
        assert predicted.matched_tokens == actual.groups[0].matched_tokens, n
        checked += 1
        running.append((w, f"r{n}"))
        if rng.random() < 0.5:
            mgr.append_tokens(f"r{n}", tokens(rng.randrange(1, 9), seed=1000 + n))
        while len(running) > 4 or (running and rng.random() < 0.3):
            ww, rid = running.pop(rng.randrange(len(running)))
            managers[ww].free_request(rid)
    assert checked > 300
    assert idx.stats().counters.removed_blocks > 0  # eviction happened
    assert idx.stats().stale_workers == 0
    idx.check()

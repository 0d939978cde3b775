"""The replay's fast paths change nothing it reports: the cache's whole-request hashing, the
emitter's batches built without re-validation, the replay's garbage-collector thresholds and
one hashing per request (the router matching the cache's hashes), each against the reference
path it replaces."""

from __future__ import annotations

import asyncio
import gc
import random
from typing import Any

import pytest

from kvstream._types import TokenIds
from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.cache.manager import KVCacheManager as Manager
from kvstream.cli import replay_run
from kvstream.cli.replay_run import ReplayOptions, ReplayResult, run_replay
from kvstream.events import emitter
from kvstream.events.deferred import model_input
from kvstream.events.model import EventBatch, SourceId
from kvstream.hashing import available_hashers, get_hasher
from kvstream.hashing.base import ChainState
from kvstream.index import PrefixIndex, Router


def fold_extend(self: Any, chain: ChainState, raw: bytes, first: int, items: Any) -> Any:
    """The reference: one ``extend`` per full block."""
    step = 4 * self._tpb
    out = []
    for j in range(len(raw) // step):
        h, chain = self._hasher.extend(chain, TokenIds.from_bytes(raw[j * step : (j + 1) * step]))
        out.append(h)
    return out, chain


def dropping(fn: Any, kw: str) -> Any:
    """``fn`` ignoring its keyword ``kw`` (the reference: hash the tokens)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop(kw, None)
        return fn(*args, **kwargs)

    return call


def validated(source: SourceId, ts_ns: int, records: Any) -> EventBatch:
    return EventBatch(source=source, ts_ns=ts_ns, events=model_input(records))


@pytest.mark.parametrize("algo", sorted(available_hashers()))
def test_cache_hashes_equal_one_extend_per_block(algo: str) -> None:
    try:
        get_hasher(algo)
    except Exception:  # an algorithm that needs parameters
        pytest.skip(f"{algo} needs parameters")
    tpb = 4
    cfg = CacheConfig(
        tokens_per_block=tpb,
        groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=64)],
        hash_algo=algo,
        metadata_only=True,
    )
    rng = random.Random(algo)
    fast = KVCacheManager(cfg, source=SourceId(instance_id="a"))
    ref = KVCacheManager(cfg, source=SourceId(instance_id="b"))
    ref._hash_blocks = fold_extend.__get__(ref)  # type: ignore[method-assign]
    for i in range(12):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        output = [rng.randrange(50) for _ in range(rng.randrange(0, 11))]
        for m in (fast, ref):
            m.add_request(f"r{i}", prompt)
            if output:
                m.append_tokens(f"r{i}", output)
        assert fast.block_hashes(f"r{i}") == ref.block_hashes(f"r{i}")
        for m in (fast, ref):
            m.free_request(f"r{i}")


def comparable(r: ReplayResult) -> dict[str, Any]:
    d = r.as_dict()
    for k in ("wall_s", "requests_per_s"):
        d.pop(k)
    d["per_request"] = list(r.per_request)  # every request: worker, queue wait, TTFT, hits
    d["timeline"] = list(r.timeline)
    d["ttft"] = list(r.ttft_s)
    return d


@pytest.mark.parametrize("router", ["kv", "round-robin"])
def test_replay_results_equal_the_reference_paths(
    router: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = ReplayOptions(trace="conversation", limit=1000, router=router)
    fast = asyncio.run(run_replay(opts))
    monkeypatch.setattr(Manager, "_hash_blocks", fold_extend)
    monkeypatch.setattr(emitter, "emitted_batch", validated)
    monkeypatch.setattr(replay_run, "_REPLAY_GC_THRESHOLDS", gc.get_threshold())
    # one prompt built and hashed at its turn, not PROMPTS_AHEAD of them in one call
    monkeypatch.setattr(replay_run, "PROMPTS_AHEAD", 1)
    monkeypatch.setattr(Manager, "hash_prompts", lambda m, ps: [m.hash_prompt(p) for p in ps])
    for cls, name, kw in (
        (Router, "route", "block_hashes"),
        (PrefixIndex, "match", "block_hashes"),
        (Manager, "add_request", "hashed"),
    ):
        monkeypatch.setattr(cls, name, dropping(getattr(cls, name), kw))
    ref = asyncio.run(run_replay(opts))
    assert fast.requests == 1000
    assert fast.prediction_accuracy == 1.0
    assert comparable(fast) == comparable(ref)


@pytest.mark.parametrize(("trace", "capacity"), [("conversation", 5859), ("synthetic", 40)])
def test_replay_ceiling_equals_the_reference(trace: str, capacity: int) -> None:
    """The ceiling, counted as prompts are prepared ahead, equals its definition: over the
    served requests in arrival order, each one's leading full blocks (the last prompt token
    excluded) already seen as full blocks of earlier requests."""
    from kvstream.workloads import MooncakeTokens, load_trace

    rows = load_trace(trace, limit=600)
    opts = ReplayOptions(trace=trace, limit=600, capacity_blocks=capacity)
    got = asyncio.run(run_replay(opts, rows=rows))
    toks = MooncakeTokens(seed=opts.seed)
    hasher = get_hasher(opts.hash_algo)
    bs = got.block_size
    seen: set[bytes] = set()
    want = served = 0
    for row in sorted(rows, key=lambda r: r.index):
        if -(-row.input_length // bs) > capacity:
            continue  # unservable: in neither ratio
        served += 1
        raw, chain, hashes = toks.prompt(row).raw, hasher.root(), []
        for j in range(len(raw) // (4 * bs)):  # one extend() per full block
            h, chain = hasher.extend(chain, TokenIds.from_bytes(raw[4 * bs * j : 4 * bs * (j + 1)]))
            hashes.append(h)
        k = 0
        while k < (row.input_length - 1) // bs and hashes[k] in seen:
            k += 1
        want += k
        seen.update(hashes)
    assert got.requests == served
    assert got.unservable == len(rows) - served
    assert got.unservable > 0 or trace == "conversation"
    assert want > 0
    assert got.ceiling_blocks == want


def test_gc_thresholds_are_restored() -> None:
    before = gc.get_threshold()
    asyncio.run(run_replay(ReplayOptions(trace="conversation", limit=5)))
    assert gc.get_threshold() == before


def small_manager(algo: str = "blake3_64") -> KVCacheManager:
    cfg = CacheConfig(
        tokens_per_block=4,
        groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=64)],
        hash_algo=algo,
        metadata_only=True,
    )
    return KVCacheManager(cfg, source=SourceId(instance_id="w"))


def test_add_request_with_hash_prompt_equals_hashing_again() -> None:
    rng = random.Random(1)
    a, b, other = small_manager(), small_manager(), small_manager()
    for i in range(10):
        prompt = [rng.randrange(30) for _ in range(rng.randrange(1, 25))]
        hashed = other.hash_prompt(prompt)  # any manager with the same configuration
        want, _ = fold_extend(a, a._root(None, None, None), hashed.raw, 0, ())
        assert list(hashed.hashes) == want
        assert a.add_request(f"r{i}", prompt, hashed=hashed) == b.add_request(f"r{i}", prompt)
        a.append_tokens(f"r{i}", [1, 2, 3, 4, 5])
        b.append_tokens(f"r{i}", [1, 2, 3, 4, 5])
        assert a.block_hashes(f"r{i}") == b.block_hashes(f"r{i}")
        ea, eb = a.flush_events(), b.flush_events()
        assert ea is not None
        assert eb is not None
        assert ea.events == eb.events
        a.free_request(f"r{i}")
        b.free_request(f"r{i}")


def test_add_request_rejects_a_hashed_prompt_of_other_tokens_or_scope() -> None:
    from kvstream.cache import RequestError

    m = small_manager()
    hashed = m.hash_prompt([1, 2, 3, 4, 5])
    with pytest.raises(RequestError, match="hash_prompt"):
        m.add_request("x", [1, 2, 3, 4, 6], hashed=hashed)
    with pytest.raises(RequestError, match="hash_prompt"):
        m.add_request("x", [1, 2, 3, 4, 5], hashed=hashed, cache_salt="tenant")
    with pytest.raises(RequestError, match="hash_prompt"):
        small_manager("blake3").add_request("x", [1, 2, 3, 4, 5], hashed=hashed)
    assert m.stats().running_requests == 0
    m.add_request("x", [1, 2, 3, 4, 5], hashed=hashed)


def test_router_with_the_caches_hashes_equals_hashing_the_tokens() -> None:
    from kvstream.cache import CacheFullError
    from kvstream.errors import ConfigError
    from kvstream.index import RouterConfig, WorkerKey

    rng = random.Random(2)
    keys = [WorkerKey(f"w{i}") for i in range(3)]
    index = PrefixIndex()
    mgrs = [
        KVCacheManager(
            CacheConfig(
                tokens_per_block=4,
                groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=24)],
                hash_algo="blake3_64",
                metadata_only=True,
            ),
            source=SourceId(instance_id=k.instance_id),
        )
        for k in keys
    ]

    def publish(m: KVCacheManager) -> None:
        batch = m.flush_events()
        if batch is not None:
            index.apply(batch)

    for m in mgrs:
        publish(m)
    router = Router(
        index, keys, RouterConfig(policy="kv", hash_algo="blake3_64", tokens_per_block=4)
    )
    hits = 0
    stems = [[rng.randrange(40) for _ in range(12)] for _ in range(4)]
    for i in range(60):
        prompt = rng.choice(stems)[: rng.randrange(1, 13)] + [
            rng.randrange(40) for _ in range(rng.randrange(0, 9))
        ]
        hashed = mgrs[0].hash_prompt(prompt)
        given = hashed.hashes[: (hashed.num_tokens - 1) // 4]
        got = router.match(prompt, block_hashes=given)
        assert got == router.match(prompt)
        hits += any(m.matched_blocks for m in got)
        w = keys.index(router.route(prompt, block_hashes=given).worker)
        try:
            mgrs[w].add_request(f"r{i}", prompt, hashed=hashed)
        except CacheFullError:
            continue
        publish(mgrs[w])
        if i % 3 == 0:
            mgrs[w].free_request(f"r{i}")
            publish(mgrs[w])
    assert hits > 10  # the matches compared were not all empty
    with pytest.raises(ConfigError, match="block_hashes"):
        index.match([1, 2, 3, 4, 5], block_hashes=[])


# ------------------------------------------------------------ prompts, cache structures


def reference_prompt(toks: Any, row: Any) -> bytes:
    """A hash-id row's prompt as the docstring defines it: its ids' blocks concatenated,
    cut to ``input_length``."""
    raw = b"".join(toks.block(h, row.block_tokens).raw for h in row.hash_ids)
    return raw[: 4 * row.input_length]


@pytest.mark.parametrize("trace", ["conversation", "synthetic"])
def test_prompts_equal_their_blocks_concatenated(trace: str) -> None:
    from kvstream.workloads import MooncakeTokens, load_trace

    toks = MooncakeTokens(seed=3)
    for row in load_trace(trace, limit=400):
        assert toks.prompt(row).raw == reference_prompt(toks, row)


def test_prompts_cut_anywhere_equal_their_blocks_concatenated() -> None:
    from dataclasses import replace

    from kvstream.workloads import MooncakeTokens, TraceRow

    toks = MooncakeTokens(seed=1, vocab_size=1000)
    rng = random.Random(5)
    for bt in (4, 5, 16, 512):
        for _ in range(40):
            ids = tuple(rng.randrange(10**6) for _ in range(rng.randrange(1, 6)))
            row = TraceRow(0, 0.0, 1, 0, ids, block_tokens=bt)
            # every cut: inside the last block's body, inside its stamp, whole blocks
            for n in {len(ids) * bt, len(ids) * bt - 1, (len(ids) - 1) * bt + 1, 1}:
                r = replace(row, input_length=n)
                assert toks.prompt(r).raw == reference_prompt(toks, r)
    with pytest.raises(ValueError, match="too large"):
        toks.prompt(TraceRow(0, 0.0, 4, 0, (1000**3,), block_tokens=4))


def test_free_queue_bulk_operations_equal_one_at_a_time() -> None:
    from kvstream.cache.block import Block
    from kvstream.cache.free_queue import FreeQueue

    rng = random.Random(7)
    blocks = [Block(i) for i in range(40)]
    a, b = FreeQueue(), FreeQueue()
    twins = {id(x): Block(x.block_id) for x in blocks}
    members: list[Block] = []
    for _ in range(200):
        if rng.random() < 0.5:
            new = [x for x in blocks if x not in members][: rng.randrange(0, 5)]
            a.extend(new)
            for x in new:
                b.append(twins[id(x)])
            members += new
        else:
            k = rng.randrange(0, len(members) + 1)
            got = a.popleft_many(k)
            assert [x.block_id for x in got] == [b.popleft().block_id for _ in range(k)]
            members = members[k:]
        assert [x.block_id for x in a] == [x.block_id for x in b] == [x.block_id for x in members]
        assert len(a) == len(b)
    with pytest.raises(IndexError):
        a.popleft_many(len(a) + 1)


def test_transport_keeps_every_batch_with_a_short_sink_log() -> None:
    """The memory sink keeps only max_lag + 256 batches; a burst of publishes longer than
    that is applied before any batch could be evicted unread."""
    from kvstream.cli.replay_transport import Transport

    async def go() -> tuple[int, int, int]:
        index = PrefixIndex()
        t = Transport("memory", index)
        await t.start()
        m = small_manager()
        await t.publish(m.flush_events())
        for i in range(2 * t.retained):
            m.add_request(f"r{i}", [i, i + 1, i + 2, i + 3, 7])
            m.free_request(f"r{i}")
            await t.publish(m.flush_events())
        await t.sync(0)
        await t.aclose()
        src = t.consumer.source
        return t.published, t.consumer.batches, src.stats.missed

    published, applied, missed = asyncio.run(go())
    assert published == applied > 512
    assert missed == 0


@pytest.mark.parametrize(("policy", "weight"), [("kv", None), ("kv", 2.0), ("least-loaded", None)])
def test_router_pick_equals_the_reference_order(policy: str, weight: float | None) -> None:
    """route() picks in one pass what the reference picks with min() over (cost, active
    blocks, active requests, rotation), with ties among equal workers."""
    from kvstream.index import RouterConfig, WorkerKey

    rng = random.Random(policy)
    keys = [WorkerKey(f"w{i}") for i in range(5)]
    index = PrefixIndex()
    cfg = small_manager().config
    mgrs = [KVCacheManager(cfg, source=SourceId(instance_id=k.instance_id)) for k in keys]
    router = Router(
        index,
        keys,
        RouterConfig(
            policy=policy, overlap_weight=weight, hash_algo="blake3_64", tokens_per_block=4
        ),
    )
    stems = [[rng.randrange(9) for _ in range(12)] for _ in range(3)]
    ties = matched = 0
    for i in range(300):
        for m in mgrs:
            batch = m.flush_events()
            if batch is not None:
                index.apply(batch)
        prompt = [*rng.choice(stems)[: rng.randrange(1, 13)], rng.randrange(9)]
        turn = router._turn
        d = router.route(prompt)
        n = len(keys)
        s = d.scores
        if policy == "kv":
            w = d.affinity_weight
            assert w is not None
            for sc in s:
                load = sc.pending_prefill_blocks if weight is None else sc.active_blocks
                assert sc.cost == w * sc.prefill_blocks + load
            want = min(
                range(n),
                key=lambda j: (s[j].cost, s[j].active_blocks, s[j].active_requests, (j - turn) % n),
            )
        else:
            want = min(
                range(n), key=lambda j: (s[j].active_blocks, s[j].active_requests, (j - turn) % n)
            )
        assert d.worker == keys[want]
        ties += sum(1 for sc in s if sc.cost == s[want].cost) > 1
        matched += any(sc.match.matched_blocks for sc in s)
        m = mgrs[want]
        if rng.random() < 0.3 or m.stats().running_requests > 3:
            for rid in m.request_ids():
                m.free_request(rid)
                router.load.finish(rid)
        try:
            m.add_request(f"r{i}", prompt)
        except Exception:
            continue
        router.load.start(f"r{i}", d.worker, -(-len(prompt) // 4), prefill_blocks=rng.randrange(3))
        if rng.random() < 0.5:
            router.load.prefilled(f"r{i}")
    assert ties > 20  # tie-breaking was exercised
    assert matched > 20 or policy == "least-loaded"  # and the prefix terms

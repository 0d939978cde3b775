"""Exact event sequences of the KV-cache manager (DESIGN §2.2 through the real emitter)."""

from __future__ import annotations

from typing import Any

import pytest

from kvstream._types import TokenIds
from kvstream.cache import CacheConfig, CacheFullError, KVCacheManager, LayerGroupSpec, MmItem
from kvstream.clock import ManualClock
from kvstream.events import DeferredBatch, EventBatch, MmKey, SourceId
from kvstream.events.emitter import EventEmitter, NullRecorder
from kvstream.hashing import content_digest, get_hasher
from kvstream.workloads import ChatWorkload, multi_turn_chats

T = 4  # tokens per block
ALGO = "blake3_64"
HASHER = get_hasher(ALGO)


def make(
    *groups: LayerGroupSpec, metadata_only: bool = True, events: bool = True
) -> KVCacheManager:
    cfg = CacheConfig(
        tokens_per_block=T,
        groups=groups,
        hash_algo=ALGO,
        metadata_only=metadata_only,
        device="cpu",
        max_seq_len=4096,
        events=events,
    )
    mgr = KVCacheManager(cfg, source=SourceId(instance_id="test"), clock=ManualClock())
    mgr.flush_events()  # the created events
    return mgr


def full(num_blocks: int) -> LayerGroupSpec:
    return LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=num_blocks)


def swa(num_blocks: int, window: int) -> LayerGroupSpec:
    return LayerGroupSpec(
        num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=num_blocks, window_size=window
    )


def chain(tokens: list[int], **scope: Any) -> list[bytes]:
    blocks = [tokens[i : i + T] for i in range(0, len(tokens) - len(tokens) % T, T)]
    return HASHER.chain_bytes(blocks, **scope)


def summary(batch: EventBatch | None) -> list[tuple[Any, ...]]:
    """Events as (kind, group, ...) tuples: stored -> parent and hashes, removed -> hashes."""
    out: list[tuple[Any, ...]] = []
    for ev in batch.events if batch is not None else ():
        d = ev.data
        if d.type == "stored":
            out.append(
                ("stored", ev.layer_group_id, d.parent_hash, [b.block_hash for b in d.blocks])
            )
        elif d.type == "removed":
            out.append(("removed", ev.layer_group_id, list(d.block_hashes)))
        else:
            out.append((d.type, ev.layer_group_id))
    return out


def test_created_per_group_with_window_and_kind() -> None:
    cfg = CacheConfig(
        tokens_per_block=T,
        groups=[full(8), swa(4, 16)],
        hash_algo=ALGO,
        metadata_only=True,
        max_seq_len=4096,
    )
    mgr = KVCacheManager(cfg, source=SourceId(instance_id="t"), clock=ManualClock(5))
    batch = mgr.flush_events()
    assert batch is not None
    assert batch.ts_ns == 5
    assert [(e.event_id, e.layer_group_id, e.window_size) for e in batch.events] == [
        (0, 0, 4096),
        (1, 1, 16),
    ]
    c0, c1 = (e.data for e in batch.events)
    assert c0.type == "created"
    assert c1.type == "created"
    assert c0.num_blocks_per_cache_level == (8,)
    assert c1.num_blocks_per_cache_level == (4,)
    assert c0.tokens_per_block == T
    assert c0.attention_kind.value == "full_attention"
    assert c1.attention_kind.value == "sliding_window"
    assert all(e.hash_algo == ALGO for e in batch.events)


def test_stored_chain_is_one_event_with_correct_parents_and_tokens() -> None:
    mgr = make(full(16))
    prompt = list(range(1, 15))  # 3 full blocks + 2 tokens
    mgr.add_request("a", prompt, priority=70)
    batch = mgr.flush_events()
    h = chain(prompt)
    assert summary(batch) == [("stored", 0, None, h)]
    assert batch is not None
    blocks = batch.events[0].data.blocks  # type: ignore[union-attr]
    assert [b.token_ids.tolist() for b in blocks] == [prompt[0:4], prompt[4:8], prompt[8:12]]
    assert {b.priority for b in blocks} == {70}
    assert mgr.block_hashes("a") == h

    # Appending fills the partial block: one new stored event whose parent is the last block.
    assert mgr.append_tokens("a", [15, 16, 17]) == 1
    h2 = chain([*prompt, 15, 16, 17])
    assert summary(mgr.flush_events()) == [("stored", 0, h[-1], [h2[3]])]


def test_prefix_reuse_emits_nothing_new() -> None:
    mgr = make(full(16))
    prompt = list(range(100, 113))  # 3 full blocks + 1
    mgr.add_request("a", prompt)
    h = chain(prompt)
    assert summary(mgr.flush_events()) == [("stored", 0, None, h)]
    mgr.free_request("a")
    match = mgr.add_request("b", prompt)
    assert match.groups[0].matched_tokens == 12
    assert mgr.flush_events() is None
    # Concurrent reuse by a running request emits nothing either.
    mgr.add_request("c", prompt)
    assert mgr.flush_events() is None
    # A longer prompt announces only the new block, chained to the reused prefix.
    longer = [*prompt, 1, 2, 3, 4]
    mgr.add_request("d", longer)
    assert summary(mgr.flush_events()) == [("stored", 0, h[-1], [chain(longer)[3]])]


def test_eviction_emits_one_batched_removal_before_the_next_store() -> None:
    mgr = make(full(4))
    a = list(range(1, 17))  # exactly 4 full blocks
    mgr.add_request("a", a)
    ha = chain(a)
    assert summary(mgr.flush_events()) == [("stored", 0, None, ha)]
    mgr.free_request("a")
    b = list(range(50, 66))
    mgr.add_request("b", b)
    # LRU evicts the leaves first: A freed its blocks last position first.
    assert summary(mgr.flush_events()) == [
        ("removed", 0, [ha[3], ha[2], ha[1], ha[0]]),
        ("stored", 0, None, chain(b)),
    ]
    assert mgr.stats().groups[0].evictions == 4


def test_removed_then_restored_block_is_announced_again() -> None:
    mgr = make(full(4))
    a = list(range(1, 9))
    mgr.add_request("a", a)
    mgr.free_request("a")
    mgr.add_request("x", list(range(200, 216)))  # evicts both of A's blocks
    mgr.free_request("x")
    mgr.flush_events()
    mgr.add_request("a2", a)
    ev = summary(mgr.flush_events())
    assert ev[0][0] == "removed"
    assert len(ev[0][2]) == 2
    assert ev[1] == ("stored", 0, None, chain(a))


def test_swa_and_full_groups_interleave_without_fragmenting_batches() -> None:
    mgr = make(full(4), swa(4, 8))
    a = list(range(1, 17))
    mgr.add_request("a", a)
    ha = chain(a)
    assert summary(mgr.flush_events()) == [
        ("stored", 0, None, ha),
        ("stored", 1, None, ha),
    ]
    mgr.free_request("a")
    # Requests shorter than a block commit nothing but each evict one block per group, so
    # the evictions alternate group 0, group 1, group 0, group 1 within the iteration.
    mgr.add_request("p", [900])
    mgr.add_request("q", [901])
    assert summary(mgr.flush_events()) == [
        ("removed", 0, [ha[3], ha[2]]),
        ("removed", 1, [ha[3], ha[2]]),
    ]
    # Evictions plus stores in both groups: each group's removals form one batch that
    # precedes that group's store.
    b = list(range(300, 308))
    mgr.add_request("b", b)
    hb = chain(b)
    assert summary(mgr.flush_events()) == [
        ("removed", 0, [ha[1], ha[0]]),
        ("stored", 0, None, hb),
        ("removed", 1, [ha[1], ha[0]]),
        ("stored", 1, None, hb),
    ]


def test_swa_release_keeps_blocks_cached_and_removal_only_in_that_window() -> None:
    mgr = make(full(32), swa(8, 8))
    prompt = list(range(1, 13))  # 3 blocks
    mgr.add_request("a", prompt)
    mgr.flush_events()
    # Decode 16 tokens one at a time: the SWA group releases blocks leaving the window.
    for t in range(16):
        mgr.append_tokens("a", [500 + t])
    assert mgr.block_ids("a", 1)[:3] == [None, None, None]
    assert all(b is not None for b in mgr.block_ids("a", 0))
    events = summary(mgr.flush_events())
    assert all(e[0] == "stored" for e in events)  # released blocks stay cached: no removal
    # Pressure on the SWA pool evicts the released blocks: removals for group 1 only.
    mgr.add_request("x", list(range(700, 712)))
    events = summary(mgr.flush_events())
    removed = [e for e in events if e[0] == "removed"]
    assert [e[1] for e in removed] == [1]
    assert set(removed[0][2]) <= set(chain(prompt) + mgr.block_hashes("a"))


def test_lora_and_salt_separate_blocks_and_are_published() -> None:
    mgr = make(full(64))
    prompt = list(range(1, 10))
    mgr.add_request("base", prompt)
    m1 = mgr.add_request("lora1", prompt, lora_id=1)
    m2 = mgr.add_request("lora2", prompt, lora_id=2)
    s1 = mgr.add_request("salt-a", prompt, cache_salt="tenant-A")
    s2 = mgr.add_request("salt-b", prompt, cache_salt="tenant-B")
    for m in (m1, m2, s1, s2):
        assert m.groups[0].matched_tokens == 0
    ev = mgr.flush_events()
    assert ev is not None
    stored = [e.data for e in ev.events]
    assert len(stored) == 5  # five distinct chains, nothing shared
    all_hashes = [b.block_hash for s in stored for b in s.blocks]  # type: ignore[union-attr]
    assert len(set(all_hashes)) == 10
    assert [s.blocks[0].lora_id for s in stored] == [None, 1, 2, None, None]  # type: ignore[union-attr]
    assert [s.blocks[0].cache_salt for s in stored] == [  # type: ignore[union-attr]
        None,
        None,
        None,
        "tenant-A",
        "tenant-B",
    ]
    assert mgr.block_hashes("lora1") == chain(prompt, lora_id=1)
    assert mgr.block_hashes("salt-a") == chain(prompt, cache_salt="tenant-A")
    # The same adapter / tenant shares.
    assert mgr.add_request("lora1b", prompt, lora_id=1).groups[0].matched_tokens == 8
    assert mgr.add_request("salt-a2", prompt, cache_salt="tenant-A").groups[0].matched_tokens == 8
    assert mgr.flush_events() is None


def test_multimodal_items_separate_blocks_unless_bytes_are_equal() -> None:
    mgr = make(full(64))
    prompt = [7] * 16  # placeholder tokens: the text alone cannot tell images apart
    img_a, img_b = b"\x89PNG image A", b"\x89PNG image B"
    mgr.add_request("a", prompt, mm_items=[(img_a, 4, 8)])
    ev = mgr.flush_events()
    assert ev is not None
    (stored,) = [e.data for e in ev.events]
    keys = [b.mm_keys for b in stored.blocks]  # type: ignore[union-attr]
    da = content_digest(img_a)
    assert keys == [(), (MmKey(hash=da, start_offset=0),), (MmKey(hash=da, start_offset=4),), ()]

    # A different image behind the same tokens shares only the block before it.
    mb = mgr.add_request("b", prompt, mm_items=[MmItem.from_content(img_b, 4, 8)])
    assert mb.groups[0].matched_tokens == 4
    hb = mgr.block_hashes("b")
    assert summary(mgr.flush_events()) == [("stored", 0, hb[0], hb[1:])]
    assert set(hb[1:]).isdisjoint(mgr.block_hashes("a"))
    # The same bytes (another request, another object) share everything reusable.
    mc = mgr.add_request("c", prompt, mm_items=[(bytes(img_a), 4, 8)])
    assert mc.groups[0].matched_tokens == 12
    assert mgr.block_hashes("c") == mgr.block_hashes("a")
    assert mgr.flush_events() is None
    # A precomputed digest is equivalent to the bytes.
    md = mgr.add_request("d", prompt, mm_items=[MmItem(4, 8, da)])
    assert md.groups[0].matched_tokens == 12


def test_reset_emits_cleared_per_group_after_pending_removals_are_subsumed() -> None:
    mgr = make(full(4), swa(4, 8))
    mgr.add_request("a", list(range(1, 17)))
    mgr.free_request("a")
    mgr.flush_events()
    mgr.add_request("p", [1])  # one pending removal per group
    mgr.reset()
    assert summary(mgr.flush_events()) == [("cleared", 0), ("cleared", 1)]
    assert mgr.request_ids() == []
    assert mgr.cached_hashes(0) == set()
    assert mgr.cached_hashes(1) == set()
    assert mgr.num_free_blocks(0) == 4
    # After a reset the same blocks are announced again.
    mgr.add_request("b", list(range(1, 9)))
    assert summary(mgr.flush_events()) == [
        ("stored", 0, None, chain(list(range(1, 9)))),
        ("stored", 1, None, chain(list(range(1, 9)))),
    ]


def test_take_events_keeps_removals_pending_until_the_iteration_flush() -> None:
    mgr = make(full(2))
    mgr.add_request("a", list(range(1, 9)))
    mgr.free_request("a")
    mgr.flush_events()
    mgr.add_request("b", [1])
    assert mgr.take_events() is None  # the removal is still pending
    assert [e[0] for e in summary(mgr.flush_events())] == ["removed"]


def test_event_ids_are_consecutive_across_batches() -> None:
    mgr = make(full(12), swa(12, 8))
    ids: list[int] = []
    for i in range(6):
        mgr.add_request(f"r{i}", list(range(i * 10, i * 10 + 9)))
        if i >= 2:
            mgr.free_request(f"r{i - 2}")
        batch = mgr.flush_events()
        if batch is not None:
            ids += [e.event_id for e in batch.events]
    assert ids == list(range(2, 2 + len(ids)))


class _ExplodingRecorder(NullRecorder):
    """Events off: any call that would need event arguments is a failure."""

    def stored(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("stored() called with events off")

    def stored_chain(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("stored_chain() called with events off")

    def removed(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("removed() called with events off")

    def removed_many(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("removed_many() called with events off")


def test_events_off_builds_no_event_arguments() -> None:
    cfg = CacheConfig(
        tokens_per_block=T, groups=[full(4), swa(4, 8)], hash_algo=ALGO, metadata_only=True
    )
    mgr = KVCacheManager(cfg, recorder=_ExplodingRecorder())
    for i in range(8):
        mgr.add_request(f"r{i}", list(range(i, i + 10)), mm_items=[(b"img", 0, 2)])
        mgr.append_tokens(f"r{i}", [1, 2, 3])
        mgr.free_request(f"r{i}")
    assert mgr.stats().groups[0].evictions > 0
    assert mgr.flush_events() is None


def test_events_off_config_uses_the_null_recorder() -> None:
    mgr = make(full(4), events=False)
    mgr.add_request("a", list(range(9)))
    assert mgr.recorder.enabled is False
    assert mgr.flush_events() is None
    assert mgr.take_events() is None
    assert mgr.flush_events_deferred() is None
    assert mgr.take_events_deferred() is None


class _OneByOne(EventEmitter):
    """The reference: the batched calls the manager makes, replayed one block at a time."""

    def stored_chain(
        self,
        layer_group_id: int,
        *,
        parent_hash: bytes | None,
        block_hashes: Any,
        token_ids: Any,
        **attrs: Any,
    ) -> None:
        self.calls += 1
        tokens = TokenIds(token_ids).tolist()
        for i, h in enumerate(block_hashes):
            self.stored(
                layer_group_id,
                parent_hash=parent_hash,
                block_hash=h,
                token_ids=tokens[i * T : (i + 1) * T],
                **attrs,
            )
            parent_hash = h

    def removed_many(
        self, layer_group_id: int, block_hashes: Any, *, cache_level: int | None = None
    ) -> None:
        self.calls += 1
        for h in block_hashes:
            self.removed(layer_group_id, h, cache_level=cache_level)

    calls = 0


def drive(mgr: KVCacheManager, flush: Any) -> list[Any]:
    """A small engine run: multi-turn chats with adapters, tenants, priorities, images,
    sliding windows, evictions and a reset; ``flush`` hands each iteration's events over."""
    out = []
    reqs = list(
        multi_turn_chats(
            ChatWorkload(
                num_conversations=6,
                turns=(2, 4),
                num_system_prompts=2,
                system_prompt_tokens=(8, 40),
                user_tokens=(2, 20),
                output_tokens=(2, 14),
                seed=3,
            )
        )
    )
    for k, req in enumerate(reqs):
        kw: dict[str, Any] = {}
        if k % 5 == 1:
            kw = {"lora_id": 7, "lora_name": "ad", "priority": 80}
        elif k % 5 == 2:
            kw = {"cache_salt": "tenant", "mm_items": [(b"img%d" % (k % 2), 2, 5)]}
        if k == len(reqs) // 2:
            mgr.reset()
        try:
            mgr.add_request(req.request_id, req.prompt, **kw)
        except CacheFullError:
            out.append(flush())
            continue
        for i in range(0, len(req.output), 3):
            try:
                mgr.append_tokens(req.request_id, req.output[i : i + 3])
            except CacheFullError:
                break
            out.append(flush())
        mgr.free_request(req.request_id)
        out.append(flush())
    return out


def test_deferred_batched_recording_equals_one_by_one_recording() -> None:
    def manager(recorder: EventEmitter | None = None) -> KVCacheManager:
        cfg = CacheConfig(
            tokens_per_block=T,
            groups=[full(40), swa(24, 12)],
            hash_algo=ALGO,
            metadata_only=True,
            max_seq_len=4096,
        )
        src = SourceId(instance_id="test")
        return KVCacheManager(cfg, source=src, clock=ManualClock(), recorder=recorder)

    ref_rec = _OneByOne(SourceId(instance_id="test"), hash_algo=ALGO, clock=ManualClock())
    ref = manager(ref_rec)
    mgr = manager()
    want = drive(ref, ref.flush_events)
    deferred = drive(mgr, mgr.flush_events_deferred)
    assert ref_rec.calls > 20
    assert all(isinstance(d, DeferredBatch) or d is None for d in deferred)
    got = [None if d is None else d.materialize() for d in deferred]
    assert got == want
    kinds = {ev.data.type for b in want if b is not None for ev in b.events}
    assert kinds == {"created", "stored", "removed", "cleared"}
    assert sum(g.evictions for g in mgr.stats().groups) > 20
    assert mgr.recorder.stats() == ref_rec.stats()  # type: ignore[attr-defined]


@pytest.mark.parametrize("algo", ["v1_block_key", "v2_sha256", "vllm_sha256_cbor_64", "blake3"])
def test_every_registered_algorithm_publishes_its_own_hashes(algo: str) -> None:
    cfg = CacheConfig(tokens_per_block=T, groups=[full(8)], hash_algo=algo, metadata_only=True)
    mgr = KVCacheManager(cfg, source=SourceId(instance_id="t"), clock=ManualClock())
    prompt = list(range(1, 10))
    mgr.add_request("a", prompt)
    batch = mgr.flush_events()
    assert batch is not None
    stored = batch.events[-1]
    assert stored.hash_algo == algo
    want = get_hasher(algo).chain_bytes([prompt[:4], prompt[4:8]])
    assert [b.block_hash for b in stored.data.blocks] == want  # type: ignore[union-attr]


def test_a_pools_evictions_are_one_removed_many_call_in_lru_order() -> None:
    from kvstream.cache.block_pool import BlockPool
    from kvstream.cache.errors import CacheInvariantError

    calls: list[tuple[Any, ...]] = []

    class Spy(NullRecorder):
        enabled = True

        def removed(self, gid: int, h: bytes, *, cache_level: int | None = None) -> None:
            calls.append(("removed", gid, [h], cache_level))

        def removed_many(self, gid: int, hs: Any, *, cache_level: int | None = None) -> None:
            calls.append(("removed_many", gid, list(hs), cache_level))

    pool = BlockPool(3, 6, Spy(), linked=False)
    blocks = pool.allocate_many(6)
    assert [b.block_id for b in blocks] == list(range(6))
    for i, b in enumerate(blocks):
        pool.commit(b, bytes([i]) * 8, None)
    for b in reversed(blocks):
        pool.release(b)  # LRU order: 5, 4, ..., 0
    with pytest.raises(CacheInvariantError, match="only 6 free"):
        pool.allocate_many(7)
    assert (pool.num_free, pool.evictions, calls) == (6, 0, [])
    got = pool.allocate_many(3)
    assert [b.block_id for b in got] == [5, 4, 3]
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in got)
    pool.allocate_many(1)
    assert calls == [
        ("removed_many", 3, [bytes([5]) * 8, bytes([4]) * 8, bytes([3]) * 8], 0),
        ("removed", 3, [bytes([2]) * 8], 0),
    ]
    assert (pool.evictions, pool.num_free) == (4, 2)
    for b in got:
        pool.release(b)  # uncached: reused first, most recently freed first
    assert [b.block_id for b in pool.allocate_many(2)] == [3, 4]

"""The event emitter: TensorRT-LLM's event-manager scenarios, with exact event sequences.

Each scenario names the TensorRT-LLM behaviour it reproduces (reference/trtllm.md §2); where
kvstream deliberately differs (lost markers, partial blocks skipped) the test says so.
"""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from kvstream._types import CacheLevel, TokenIds
from kvstream.clock import ManualClock
from kvstream.errors import ConfigError, EmitterError
from kvstream.events import model
from kvstream.events.emitter import (
    NULL_RECORDER,
    EmitterStats,
    EventEmitter,
    EventRecorder,
    NullRecorder,
    gather_attention_dp,
)
from kvstream.events.model import (
    AttentionKind,
    Cleared,
    Created,
    EventBatch,
    EventDiff,
    KVCacheEvent,
    Lost,
    MmKey,
    Removed,
    SourceId,
    Stored,
    Updated,
)

TPB = 4
FULL, SWA = 0, 1  # layer groups: full attention (window 4096) and sliding window (128)
WINDOWS = {FULL: 4096, SWA: 128}


def h(n: int) -> bytes:
    return n.to_bytes(8, "big")


def toks(n: int, count: int = TPB) -> list[int]:
    return [n * 10 + i for i in range(count)]


def new_emitter(
    *, capacity: int = 1024, groups: tuple[int, ...] = (FULL,), take: bool = True, **kw: Any
) -> EventEmitter:
    """An emitter with ``groups`` created; their ``created`` events taken unless ``take``."""
    em = EventEmitter(
        SourceId(instance_id="worker-0"), capacity=capacity, clock=ManualClock(1000), **kw
    )
    for g in groups:
        em.created(
            g,
            window_size=WINDOWS[g],
            num_blocks_per_cache_level=[64, 0],
            tokens_per_block=TPB,
            attention_kind=AttentionKind.FULL if g == FULL else AttentionKind.SLIDING_WINDOW,
        )
    if take:
        em.take()
    return em


def store(em: EventEmitter, g: int, n: int, parent: int | None = None, **kw: Any) -> None:
    em.stored(
        g,
        parent_hash=None if parent is None else h(parent),
        block_hash=h(n),
        token_ids=kw.pop("token_ids", toks(n)),
        **kw,
    )


def summary(batch: EventBatch | None) -> list[tuple[Any, ...]]:
    """(event_id, kind, layer_group_id, payload...) per event: hashes as the ints of h()."""
    if batch is None:
        return []
    out: list[tuple[Any, ...]] = []
    for ev in batch.events:
        d = ev.data
        head = (ev.event_id, d.type, ev.layer_group_id)
        if isinstance(d, Stored):
            parent = None if d.parent_hash is None else int.from_bytes(d.parent_hash, "big")
            out.append((*head, parent, [int.from_bytes(b.block_hash, "big") for b in d.blocks]))
        elif isinstance(d, Removed):
            out.append((*head, [int.from_bytes(x, "big") for x in d.block_hashes]))
        elif isinstance(d, Updated):
            out.append((*head, int.from_bytes(d.block_hash, "big")))
        elif isinstance(d, Lost):
            out.append((*head, d.first_event_id, d.count))
        else:
            out.append(head)
    return out


def covered_ids(batch: EventBatch) -> list[int]:
    """Every id a batch accounts for: events' own ids, a lost marker's whole range."""
    ids: list[int] = []
    for ev in batch.events:
        if isinstance(ev.data, Lost):
            ids.extend(range(ev.data.first_event_id, ev.data.first_event_id + ev.data.count))
        else:
            ids.append(ev.event_id)
    return ids


# ---------------------------------------------------------------------------- ordering


def test_removals_are_batched_within_a_window() -> None:
    """V2: a group's removals accumulate and become one `removed` event at the flush."""
    em = new_emitter()
    store(em, FULL, 1)
    store(em, FULL, 2, parent=1)
    store(em, FULL, 3, parent=2)
    assert summary(em.flush()) == [(1, "stored", FULL, None, [1, 2, 3])]
    em.removed(FULL, h(3))
    em.removed(FULL, h(2))
    em.removed(FULL, h(1))
    assert em.take() is None  # held back until the iteration flush
    assert em.next_event_id == 2
    assert summary(em.flush()) == [(2, "removed", FULL, [3, 2, 1])]


def test_removed_precedes_stored_of_the_same_window() -> None:
    """V1 #11883 / V2: a store of a group first flushes that group's pending removals."""
    em = new_emitter()
    store(em, FULL, 1)
    em.flush()
    em.removed(FULL, h(1))
    store(em, FULL, 2)
    store(em, FULL, 3, parent=2)
    assert summary(em.flush()) == [
        (2, "removed", FULL, [1]),
        (3, "stored", FULL, None, [2, 3]),
    ]


def test_interleaved_swa_and_full_windows_do_not_fragment_each_others_batches() -> None:
    """The bug TensorRT-LLM PR #11883 fixed: removals of two windows recorded interleaved
    give one batch per window, and a store of one window flushes only that window."""
    em = new_emitter(groups=(FULL, SWA))
    for n in (1, 2, 3):
        store(em, FULL, n)
        store(em, SWA, n)
    em.flush()
    em.removed(SWA, h(1))
    em.removed(FULL, h(1))
    em.removed(SWA, h(2))
    em.removed(FULL, h(2))
    store(em, FULL, 7)  # flushes FULL's removals only; SWA's keep batching
    em.removed(SWA, h(3))
    em.removed(FULL, h(3))
    assert summary(em.flush()) == [
        (8, "removed", FULL, [1, 2]),
        (9, "stored", FULL, None, [7]),
        (10, "removed", SWA, [1, 2, 3]),  # groups flush in first-pending order
        (11, "removed", FULL, [3]),
    ]


def test_flush_drains_every_pending_window() -> None:
    em = new_emitter(groups=(FULL, SWA))
    store(em, FULL, 1)
    store(em, SWA, 2)
    em.flush()
    em.removed(FULL, h(1))
    em.removed(SWA, h(2))
    em.flush_iteration()
    assert em.stats().pending_removals == 0
    assert summary(em.take()) == [(4, "removed", FULL, [1]), (5, "removed", SWA, [2])]


def test_removed_is_flushed_before_an_updated_event_of_another_group() -> None:
    """V2 test "flushes_removed_before_updated_event": [removed, updated]."""
    em = new_emitter(groups=(FULL, SWA))
    store(em, FULL, 1)
    store(em, SWA, 2)
    em.flush()
    em.removed(FULL, h(1))
    em.updated(SWA, h(2), cache_level=(0, 1))
    batch = em.flush()
    assert summary(batch) == [(4, "removed", FULL, [1]), (5, "updated", SWA, 2)]
    assert batch is not None
    upd = batch.events[1].data
    assert isinstance(upd, Updated)
    assert upd.cache_level == EventDiff(old_value=0, new_value=1)
    assert upd.priority is None


def test_created_and_cleared_flush_every_groups_removals() -> None:
    em = new_emitter(groups=(FULL, SWA))
    store(em, FULL, 1)
    store(em, SWA, 2)
    em.flush()
    em.removed(FULL, h(1))
    em.created(
        SWA,
        window_size=128,
        num_blocks_per_cache_level=[32, 8],
        tokens_per_block=TPB,
        attention_kind=AttentionKind.SLIDING_WINDOW,
    )
    assert summary(em.take()) == [(4, "removed", FULL, [1]), (5, "created", SWA)]
    store(em, FULL, 1)
    em.removed(FULL, h(1))
    em.cleared(SWA)
    assert summary(em.take()) == [
        (6, "stored", FULL, None, [1]),
        (7, "removed", FULL, [1]),
        (8, "cleared", SWA),
    ]


def test_removed_cache_level_is_kept_when_shared() -> None:
    em = new_emitter()
    for n in (1, 2, 3, 4):
        store(em, FULL, n)
    em.flush()
    em.removed(FULL, h(1), cache_level=CacheLevel.HOST)
    em.removed(FULL, h(2), cache_level=1)
    batch = em.flush()
    assert batch is not None
    assert batch.events[0].data == Removed(block_hashes=(h(1), h(2)), cache_level=1)
    em.removed(FULL, h(3), cache_level=0)
    em.removed(FULL, h(4), cache_level=1)  # mixed levels: one event, level unknown
    batch = em.flush()
    assert batch is not None
    assert batch.events[0].data == Removed(block_hashes=(h(3), h(4)), cache_level=None)


# ---------------------------------------------------------------------------- stored


def test_chained_stores_coalesce_per_layer_group_without_consuming_ids() -> None:
    """V2 test: blocks b0, b1 stored in two life cycles give 2 events, lg0 [b0, b1] then
    lg1 [b0, b1]; the appended blocks take no id."""
    em = new_emitter(groups=(FULL, SWA))
    assert em.next_event_id == 2
    store(em, FULL, 0)
    store(em, SWA, 0)
    store(em, FULL, 1, parent=0)
    store(em, SWA, 1, parent=0)
    assert em.next_event_id == 4
    batch = em.flush()
    assert summary(batch) == [(2, "stored", FULL, None, [0, 1]), (3, "stored", SWA, None, [0, 1])]
    assert batch is not None
    assert [ev.window_size for ev in batch.events] == [4096, 128]
    assert {ev.hash_algo for ev in batch.events} == {"v1_block_key"}
    assert em.stats().blocks_stored_announced == 4


def test_a_store_not_chained_to_the_target_opens_a_new_event() -> None:
    em = new_emitter()
    store(em, FULL, 1)
    store(em, FULL, 2, parent=1)
    store(em, FULL, 3, parent=1)  # a sibling of 2: new event with its parent
    store(em, FULL, 4)  # a new root
    store(em, FULL, 5, parent=4)
    assert summary(em.flush()) == [
        (1, "stored", FULL, None, [1, 2]),
        (2, "stored", FULL, 1, [3]),
        (3, "stored", FULL, None, [4, 5]),
    ]


def test_coalescing_targets_reset_at_flush_take_and_other_events_of_the_group() -> None:
    em = new_emitter(groups=(FULL, SWA))
    store(em, FULL, 1)
    em.flush_iteration()
    store(em, FULL, 2, parent=1)
    em.take()
    store(em, FULL, 3, parent=2)
    em.updated(FULL, h(3), priority=(35, 80))
    store(em, FULL, 4, parent=3)
    em.updated(SWA, h(1), cache_level=(0, 1))  # unannounced in SWA: ignored, no reset
    store(em, FULL, 5, parent=4)
    assert summary(em.take()) == [
        (4, "stored", FULL, 2, [3]),
        (5, "updated", FULL, 3),
        (6, "stored", FULL, 3, [4, 5]),
    ]


def test_a_reused_prefix_emits_nothing() -> None:
    """V2 test "reused_prefix_does_not_emit_duplicate"."""
    em = new_emitter()
    store(em, FULL, 1)
    store(em, FULL, 2, parent=1)
    em.flush()
    store(em, FULL, 1)
    store(em, FULL, 2, parent=1)
    assert em.flush() is None
    store(em, FULL, 1)  # reused, then extended: the new block hangs off the reused one
    store(em, FULL, 2, parent=1)
    store(em, FULL, 3, parent=2)
    store(em, FULL, 4, parent=3)
    assert summary(em.flush()) == [(2, "stored", FULL, 2, [3, 4])]
    assert em.stats().duplicate_stores_suppressed == 4


def test_the_same_block_is_announced_once_per_group() -> None:
    em = new_emitter(groups=(FULL, SWA))
    store(em, FULL, 1)
    store(em, SWA, 1)
    store(em, SWA, 1)
    assert summary(em.flush()) == [(2, "stored", FULL, None, [1]), (3, "stored", SWA, None, [1])]


def test_a_restore_after_removal_is_announced_again() -> None:
    em = new_emitter()
    store(em, FULL, 1)
    em.flush()
    em.removed(FULL, h(1))
    em.flush()
    store(em, FULL, 1)
    assert summary(em.flush()) == [(3, "stored", FULL, None, [1])]
    # ... also within one iteration: the removal is flushed first
    em.removed(FULL, h(1))
    store(em, FULL, 1)
    assert summary(em.flush()) == [(4, "removed", FULL, [1]), (5, "stored", FULL, None, [1])]


def test_unknown_removals_and_updates_are_ignored_and_counted() -> None:
    """V2: unknown keys are silently ignored; a second removal is a no-op."""
    em = new_emitter()
    store(em, FULL, 1)
    em.flush()
    em.removed(FULL, h(9))
    em.updated(FULL, h(9), cache_level=(0, 1))
    em.removed(FULL, h(1))
    em.removed(FULL, h(1))
    em.updated(FULL, h(1), cache_level=(0, 1))  # its removal is pending: not announced
    assert summary(em.flush()) == [(2, "removed", FULL, [1])]
    stats = em.stats()
    assert stats.unknown_removals_ignored == 2
    assert stats.unknown_updates_ignored == 2


def test_partial_blocks_are_skipped_by_default() -> None:
    """kvstream differs from TensorRT-LLM V1 here: only full blocks are announced."""
    em = new_emitter()
    store(em, FULL, 1)
    store(em, FULL, 2, parent=1, token_ids=toks(2, TPB - 1))
    assert summary(em.flush()) == [(1, "stored", FULL, None, [1])]
    em.removed(FULL, h(2))  # never announced: silent
    em.updated(FULL, h(2), cache_level=(0, 1))
    assert em.flush() is None
    stats = em.stats()
    assert (stats.partial_blocks_skipped, stats.unknown_removals_ignored) == (1, 1)


def test_partial_blocks_are_announced_on_request() -> None:
    em = new_emitter(announce_partial_blocks=True)
    store(em, FULL, 1)
    store(em, FULL, 2, parent=1, token_ids=toks(2, 1))
    em.removed(FULL, h(2))
    batch = em.flush()
    assert summary(batch) == [(1, "stored", FULL, None, [1, 2]), (2, "removed", FULL, [2])]
    assert batch is not None
    stored = batch.events[0].data
    assert isinstance(stored, Stored)
    assert stored.blocks[1].token_ids == toks(2, 1)


def test_a_stored_block_keeps_every_attribute() -> None:
    em = new_emitter(hash_algo="v2_sha256", groups=())
    em.created(0, window_size=8192, num_blocks_per_cache_level=[16], tokens_per_block=2)
    digest = bytes(range(32))
    mm = MmKey(hash=digest, start_offset=3, uuid="img-1")
    em.stored(
        0,
        parent_hash=b"\x01" * 32,
        block_hash=b"\x02" * 32,
        token_ids=TokenIds([5, 6]),
        cache_level=CacheLevel.HOST,
        priority=80,
        lora_id=2**64 - 1,
        lora_name="adapter",
        mm_keys=[mm],
        cache_salt="salt",
        token_extra_ids=[0, 7],
    )
    batch = em.flush()
    assert batch is not None
    created, stored = batch.events
    assert created.data == Created(num_blocks_per_cache_level=(16,), tokens_per_block=2)
    assert stored.hash_algo == "v2_sha256"
    assert stored.window_size == 8192
    assert isinstance(stored.data, Stored)
    assert stored.data.parent_hash == b"\x01" * 32
    (blk,) = stored.data.blocks
    assert blk.block_hash == b"\x02" * 32
    assert blk.token_ids == [5, 6]
    assert blk.token_extra_ids == [0, 7]
    assert (blk.cache_level, blk.priority) == (1, 80)
    assert (blk.lora_id, blk.lora_name, blk.cache_salt) == (2**64 - 1, "adapter", "salt")
    assert blk.mm_keys == (mm,)


def test_the_callers_token_list_is_copied_at_record_time() -> None:
    em = new_emitter()
    tokens = toks(1)
    em.stored(FULL, parent_hash=None, block_hash=h(1), token_ids=tokens)
    tokens[0] = 999
    batch = em.flush()
    assert batch is not None
    assert isinstance(batch.events[0].data, Stored)
    assert batch.events[0].data.blocks[0].token_ids == toks(1)


# ---------------------------------------------------------------------------- cleared


def test_cleared_subsumes_the_groups_pending_removals_and_forgets_its_blocks() -> None:
    em = new_emitter(groups=(FULL, SWA))
    store(em, FULL, 1)
    store(em, SWA, 1)
    store(em, SWA, 2)
    em.flush()
    em.removed(SWA, h(1))
    em.removed(FULL, h(1))
    em.cleared(SWA)
    store(em, SWA, 2)  # forgotten by the clear: announced again
    assert summary(em.flush()) == [
        (5, "removed", FULL, [1]),
        (6, "cleared", SWA),
        (7, "stored", SWA, None, [2]),
    ]
    assert em.stats().removals_subsumed_by_clear == 1


def test_cleared_without_a_group_clears_every_group_in_registration_order() -> None:
    em = new_emitter(groups=(SWA, FULL))
    store(em, FULL, 1)
    store(em, SWA, 1)
    em.flush()
    em.removed(FULL, h(1))
    em.cleared()
    assert summary(em.flush()) == [(4, "cleared", SWA), (5, "cleared", FULL)]
    assert em.stats().pending_removals == 0
    store(em, FULL, 1)
    assert summary(em.flush()) == [(6, "stored", FULL, None, [1])]


# ---------------------------------------------------------------------------- capacity


def test_overflow_keeps_the_newest_and_a_lost_marker_counts_what_was_dropped() -> None:
    """V2 test: cap 2 with created, stored, removed a and removed b keeps ids [1, 2] (the
    removals merged). kvstream replaces the dropped ones with a marker that holds a slot."""
    em = EventEmitter(SourceId(instance_id="w"), capacity=2)
    em.created(0, window_size=64, num_blocks_per_cache_level=[8], tokens_per_block=TPB)
    store(em, 0, 1)
    store(em, 0, 2, parent=1)
    em.removed(0, h(1))
    em.removed(0, h(2))
    batch = em.flush()
    assert summary(batch) == [(1, "lost", 0, 0, 2), (2, "removed", 0, [1, 2])]
    assert batch is not None
    lost = batch.events[0]
    assert lost.data == Lost(first_event_id=0, count=2, reason="overflow")
    assert covered_ids(batch) == [0, 1, 2]
    stats = em.stats()
    assert (stats.events_dropped, stats.lost_markers, stats.events_taken) == (2, 1, 1)


def test_repeated_overflow_extends_the_marker() -> None:
    """V1 C++ test: capacity 3 and 6 events keep ids 3, 4, 5 (0-based); with the marker's
    slot kvstream keeps the newest two and one marker stands for all four dropped."""
    em = new_emitter(capacity=3)  # created (id 0) already taken
    for n in range(6):
        store(em, FULL, n)  # ids 1..6, each a new root
    batch = em.take()
    assert summary(batch) == [
        (4, "lost", FULL, 1, 4),
        (5, "stored", FULL, None, [4]),
        (6, "stored", FULL, None, [5]),
    ]
    assert batch is not None
    assert covered_ids(batch) == list(range(1, 7))
    stats = em.stats()
    assert (stats.events_dropped, stats.lost_markers) == (4, 1)
    assert stats.events_emitted == stats.events_taken + stats.events_dropped


def test_first_overflow_of_a_take_period_starts_a_new_marker() -> None:
    em = new_emitter(capacity=2, take=True)
    for n in range(3):
        store(em, FULL, n)  # ids 1, 2, 3
    assert summary(em.take()) == [(2, "lost", FULL, 1, 2), (3, "stored", FULL, None, [2])]
    for n in range(3, 5):
        store(em, FULL, n)  # ids 4, 5: fits
    assert summary(em.take()) == [(4, "stored", FULL, None, [3]), (5, "stored", FULL, None, [4])]


def test_coalescing_never_appends_to_a_dropped_event() -> None:
    em = new_emitter(capacity=3, groups=(FULL, SWA))
    store(em, FULL, 1)  # id 2, FULL's coalescing target
    store(em, SWA, 1)  # id 3
    store(em, SWA, 2)  # id 4; buffer full
    store(em, SWA, 3)  # id 5: drops 2 and 3, the marker takes a slot
    store(em, FULL, 2, parent=1)  # its target is gone: a new event (id 6) that names it
    assert summary(em.take()) == [
        (4, "lost", SWA, 2, 3),
        (5, "stored", SWA, None, [3]),
        (6, "stored", FULL, 1, [2]),
    ]
    assert em.stats().events_dropped == 3


def test_the_lost_marker_names_the_last_dropped_events_group() -> None:
    em = new_emitter(capacity=2, groups=(FULL, SWA))
    store(em, SWA, 1)  # id 2
    store(em, FULL, 1)  # id 3
    store(em, FULL, 2)  # id 4
    batch = em.take()
    assert batch is not None
    lost = batch.events[0]
    assert (lost.event_id, lost.layer_group_id, lost.window_size) == (3, FULL, 4096)


# ---------------------------------------------------------------------------- take / stats


def test_take_stamps_the_batch_and_returns_none_when_empty() -> None:
    clock = ManualClock(5_000)
    src = SourceId(instance_id="w", attention_dp_rank=2, incarnation=7)
    em = EventEmitter(src, clock=clock, hash_algo="v2_sha256_64")
    assert em.take() is None
    assert em.flush() is None
    em.created(3, window_size=32, num_blocks_per_cache_level=[1, 2, 3], tokens_per_block=TPB)
    clock.advance(10)
    batch = em.take()
    assert batch is not None
    assert (batch.source, batch.ts_ns) == (src, 5_010)
    (ev,) = batch.events
    assert ev == KVCacheEvent(
        event_id=0,
        hash_algo="v2_sha256_64",
        layer_group_id=3,
        window_size=32,
        data=Created(num_blocks_per_cache_level=(1, 2, 3), tokens_per_block=TPB),
    )
    assert em.take() is None
    assert em.stats() == EmitterStats(
        events_emitted=1,
        events_taken=1,
        events_dropped=0,
        lost_markers=0,
        batches_taken=1,
        blocks_stored_announced=0,
        blocks_dropped=0,
        blocks_removed_announced=0,
        duplicate_stores_suppressed=0,
        unknown_removals_ignored=0,
        unknown_updates_ignored=0,
        partial_blocks_skipped=0,
        removals_subsumed_by_clear=0,
        buffered_events=0,
        pending_removals=0,
    )


def test_take_leaves_pending_removals_pending() -> None:
    em = new_emitter()
    store(em, FULL, 1)
    em.removed(FULL, h(1))
    assert summary(em.take()) == [(1, "stored", FULL, None, [1])]
    assert em.stats().pending_removals == 1
    assert summary(em.flush()) == [(2, "removed", FULL, [1])]


def test_recording_builds_no_model_until_take(monkeypatch: pytest.MonkeyPatch) -> None:
    em = new_emitter()

    def no_models(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{cls.__name__} built while recording")

    monkeypatch.setattr(model._RaisesKVStreamErrors, "__call__", no_models)
    store(em, FULL, 1)
    store(em, FULL, 2, parent=1)
    em.updated(FULL, h(1), priority=(35, 90))
    em.removed(FULL, h(2))
    em.flush_iteration()
    with pytest.raises(AssertionError, match="KVCacheEvent built"):  # the updated event
        em.take()
    monkeypatch.undo()
    assert len(summary(em.take())) == 3  # the failed take kept everything


# ---------------------------------------------------------------------------- misuse


def test_calls_for_an_unregistered_group_raise_and_change_nothing() -> None:
    em = new_emitter()
    store(em, FULL, 1)
    with pytest.raises(EmitterError, match="layer group 5 is not registered"):
        store(em, 5, 2)
    with pytest.raises(EmitterError, match="not registered"):
        em.removed(5, h(1))
    with pytest.raises(EmitterError, match="not registered"):
        em.updated(5, h(1), cache_level=(0, 1))
    with pytest.raises(EmitterError, match="not registered"):
        em.cleared(5)
    assert summary(em.flush()) == [(1, "stored", FULL, None, [1])]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_hash": b"\x00" * 7}, "block_hash: v1_block_key hashes are 8 bytes, got 7"),
        ({"block_hash": "00" * 8}, "block_hash must be bytes"),
        ({"parent_hash": b"\x00" * 32}, "parent_hash: v1_block_key hashes are 8 bytes"),
        ({"token_ids": toks(1, TPB + 1)}, "5 tokens exceed"),
        ({"token_ids": [-1, 0, 0, 0]}, "token_ids"),
        ({"token_ids": b"abcd"}, "token_ids must be a sequence of ints"),
        ({"priority": 101}, "priority must be in 0..100"),
        ({"cache_level": -1}, "cache_level must be in"),
        ({"cache_level": True}, "cache_level must be an int"),
        ({"lora_id": 2**64}, "lora_id"),
        ({"lora_name": 3}, "lora_name must be a str"),
        ({"cache_salt": b"x"}, "cache_salt must be a str"),
        ({"mm_keys": [("x", 1)]}, r"mm_keys\[0\] must be an MmKey"),
        ({"token_extra_ids": [0]}, "token_extra_ids has 1 entries for 4 tokens"),
    ],
)
def test_bad_stored_arguments_raise_naming_the_argument_and_change_nothing(
    kwargs: dict[str, Any], match: str
) -> None:
    em = new_emitter()
    store(em, FULL, 1)
    em.flush()
    em.removed(FULL, h(1))
    args: dict[str, Any] = {"parent_hash": None, "block_hash": h(2), "token_ids": toks(2)}
    args.update(kwargs)
    with pytest.raises(EmitterError, match=match):
        em.stored(FULL, **args)
    stats = em.stats()
    assert (stats.pending_removals, stats.events_emitted, stats.buffered_events) == (1, 2, 0)


def test_bad_arguments_of_the_other_calls_raise() -> None:
    em = new_emitter()
    store(em, FULL, 1)
    with pytest.raises(EmitterError, match="block_hash: v1_block_key hashes are 8 bytes"):
        em.removed(FULL, b"\x01" * 32)
    with pytest.raises(EmitterError, match="block_hash must be bytes"):
        em.removed(FULL, bytearray(8))  # type: ignore[arg-type]
    with pytest.raises(EmitterError, match="cache_level must be in"):
        em.removed(FULL, h(1), cache_level=-2)
    with pytest.raises(EmitterError, match="needs a cache_level or a priority change"):
        em.updated(FULL, h(1))
    with pytest.raises(EmitterError, match=r"priority\[1\] \(new\) must be in 0..100"):
        em.updated(FULL, h(1), priority=(35, 200))
    with pytest.raises(EmitterError, match="an \\(old, new\\) tuple"):
        em.updated(FULL, h(1), cache_level=1)  # type: ignore[arg-type]
    with pytest.raises(EmitterError, match="window_size=4096"):
        em.created(FULL, window_size=128, num_blocks_per_cache_level=[1], tokens_per_block=TPB)
    with pytest.raises(EmitterError, match="at least one level"):
        em.created(7, window_size=128, num_blocks_per_cache_level=[], tokens_per_block=TPB)
    with pytest.raises(EmitterError, match="tokens_per_block must be in"):
        em.created(7, window_size=128, num_blocks_per_cache_level=[1], tokens_per_block=0)
    with pytest.raises(EmitterError, match="layer_group_id must be in"):
        em.created(-1, window_size=128, num_blocks_per_cache_level=[1], tokens_per_block=TPB)
    with pytest.raises(EmitterError, match="attention_kind"):
        em.created(
            7,
            window_size=128,
            num_blocks_per_cache_level=[1],
            tokens_per_block=TPB,
            attention_kind="mamba",  # type: ignore[arg-type]
        )
    assert summary(em.flush()) == [(1, "stored", FULL, None, [1])]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": 1},
        {"capacity": True},
        {"hash_algo": ""},
        {"hash_algo": "x" * 65},
    ],
)
def test_bad_constructor_arguments_raise_config_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        EventEmitter(SourceId(instance_id="w"), **kwargs)


def test_an_unknown_hash_algorithm_pins_its_width_on_first_use() -> None:
    em = EventEmitter(SourceId(instance_id="w"), hash_algo="newer_algo_128")
    em.created(0, window_size=64, num_blocks_per_cache_level=[8], tokens_per_block=1)
    with pytest.raises(EmitterError, match=r"\(8, 16, 32\)"):
        em.stored(0, parent_hash=None, block_hash=b"\x00" * 12, token_ids=[1])
    em.stored(0, parent_hash=None, block_hash=b"\x01" * 16, token_ids=[1])
    with pytest.raises(EmitterError, match="newer_algo_128 hashes are 16 bytes, got 8"):
        em.stored(0, parent_hash=None, block_hash=b"\x02" * 8, token_ids=[2])
    batch = em.flush()
    assert batch is not None
    assert batch.events[1].hash_algo == "newer_algo_128"


def test_bytes_subclasses_and_int_likes_are_normalised() -> None:
    class Digest(bytes):
        pass

    em = new_emitter()
    em.stored(
        FULL,
        parent_hash=Digest(h(0)),
        block_hash=Digest(h(1)),
        token_ids=TokenIds(toks(1)),
        cache_level=CacheLevel.DISK,
    )
    batch = em.flush()
    assert batch is not None
    stored = batch.events[0].data
    assert isinstance(stored, Stored)
    assert type(stored.blocks[0].block_hash) is bytes
    assert type(stored.blocks[0].cache_level) is int


def test_token_ids_may_be_any_iterable_of_ints() -> None:
    np = pytest.importorskip("numpy")
    em = new_emitter()
    em.stored(FULL, parent_hash=None, block_hash=h(1), token_ids=np.arange(4, dtype=np.int64))
    em.stored(FULL, parent_hash=h(1), block_hash=h(2), token_ids=(7, 8, 9, 10))
    batch = em.flush()
    assert batch is not None
    stored = batch.events[0].data
    assert isinstance(stored, Stored)
    assert [b.token_ids for b in stored.blocks] == [[0, 1, 2, 3], [7, 8, 9, 10]]


# ---------------------------------------------------------------------------- null recorder


def test_null_recorder_builds_nothing_and_returns_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_models(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a model was built")

    monkeypatch.setattr(model._RaisesKVStreamErrors, "__call__", no_models)
    monkeypatch.setattr(pydantic.BaseModel, "model_validate", no_models)
    rec: EventRecorder = NullRecorder()
    assert rec.enabled is False
    assert isinstance(rec, EventRecorder)
    assert isinstance(NULL_RECORDER, NullRecorder)
    rec.created(0, window_size=1, num_blocks_per_cache_level=[1], tokens_per_block=1)
    rec.stored(0, parent_hash=None, block_hash=h(1), token_ids=[1, 2])
    rec.removed(0, h(1), cache_level=0)
    rec.updated(0, h(1), cache_level=(0, 1))
    rec.cleared()
    rec.flush_iteration()
    assert rec.take() is None
    assert rec.flush() is None


def test_the_emitter_is_an_enabled_recorder() -> None:
    em = new_emitter()
    assert em.enabled is True
    assert isinstance(em, EventRecorder)


# ---------------------------------------------------------------------------- attention DP


def rank_emitter(rank: int | None, *, instance: str = "w", incarnation: int = 0) -> EventEmitter:
    src = SourceId(instance_id=instance, attention_dp_rank=rank, incarnation=incarnation)
    em = EventEmitter(src, clock=ManualClock(100 + (rank or 0)))
    em.created(0, window_size=64, num_blocks_per_cache_level=[8], tokens_per_block=TPB)
    return em


def taken(em: EventEmitter) -> EventBatch:
    batch = em.flush()
    assert batch is not None
    return batch


def test_dp_gather_concatenates_ranks_in_rank_order_keeping_ids() -> None:
    """C++ test "AttentionDpGatherPreservesPayloadsAndPerRankOrder": each rank yields ids
    0 and 1, rank 0's output lists the ranks in order."""
    ems = {r: rank_emitter(r) for r in (2, 0, 1)}
    for r, em in ems.items():
        store(em, 0, 10 + r)
    batches = [em.flush() for em in ems.values()]
    out = gather_attention_dp(b for b in batches if b is not None)
    assert [b.source.attention_dp_rank for b in out] == [0, 1, 2]
    for r, b in enumerate(out):
        assert summary(b) == [(0, "created", 0), (1, "stored", 0, None, [10 + r])]
        assert b is batches[list(ems).index(r)]  # a single batch per rank passes through


def test_dp_gather_merges_batches_of_one_rank_in_input_order() -> None:
    r0, r1 = rank_emitter(0), rank_emitter(1)
    a = r1.take()
    store(r1, 0, 1)
    b = r1.take()
    c = r0.flush()
    assert a is not None
    assert b is not None
    assert c is not None
    out = gather_attention_dp([a, c, b])
    assert [x.source.attention_dp_rank for x in out] == [0, 1]
    assert out[0] is c
    assert summary(out[1]) == [(0, "created", 0), (1, "stored", 0, None, [1])]
    assert out[1].ts_ns == max(a.ts_ns, b.ts_ns)
    assert gather_attention_dp([]) == []


def test_dp_gather_rejects_mismatched_or_repeated_batches() -> None:
    a = taken(rank_emitter(0))
    b = taken(rank_emitter(1, instance="other"))
    c = taken(rank_emitter(1, incarnation=1))
    d = taken(rank_emitter(None))
    e = taken(rank_emitter(1))
    with pytest.raises(EmitterError, match="different instances"):
        gather_attention_dp([a, b])
    with pytest.raises(EmitterError, match="different incarnations"):
        gather_attention_dp([a, c])
    with pytest.raises(EmitterError, match="with and without attention_dp_rank"):
        gather_attention_dp([a, d])
    with pytest.raises(EmitterError, match="rank 1: event id 0 follows 0"):
        gather_attention_dp([a, e, e])
    assert len(gather_attention_dp([d])) == 1


def test_recorded_events_validate_as_the_model_says() -> None:
    em = new_emitter(groups=(FULL, SWA), take=False)
    store(em, FULL, 1)
    em.updated(FULL, h(1), cache_level=(0, 2), priority=(35, 0))
    em.cleared(SWA)
    batch = em.flush()
    assert batch is not None
    assert [type(ev.data) for ev in batch.events] == [Created, Created, Stored, Updated, Cleared]
    assert EventBatch.model_validate_json(batch.model_dump_json()) == batch

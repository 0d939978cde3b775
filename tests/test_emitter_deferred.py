"""Deferred hand-off (take_deferred/DeferredBatch) and the batched recording calls
(stored_chain/removed_many): same events as take()/stored()/removed(), cheaper on the engine
thread."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from test_emitter import FULL, SWA, TPB, h, new_emitter, store, summary, toks

from kvstream._types import TokenIds
from kvstream.clock import ManualClock
from kvstream.errors import EmitterError, EventValidationError
from kvstream.events import model
from kvstream.events.deferred import BlockRun, DeferredBatch, model_input
from kvstream.events.emitter import EventEmitter, EventRecorder, NullRecorder
from kvstream.events.model import EventBatch, Lost, SourceId, Stored


def packed(*ns: int) -> TokenIds:
    """The tokens of blocks h(n) for n in ns, packed."""
    return TokenIds([t for n in ns for t in toks(n)])


def chain(em: EventEmitter, g: int, ns: list[int], parent: int | None = None, **kw: Any) -> None:
    em.stored_chain(
        g,
        parent_hash=None if parent is None else h(parent),
        block_hashes=[h(n) for n in ns],
        token_ids=packed(*ns),
        **kw,
    )


def scenario(em: EventEmitter) -> None:
    """Stores, removals, an update and an overflow (capacity 4): a lost marker heads the
    buffer."""
    store(em, FULL, 1)
    store(em, FULL, 2, parent=1)
    store(em, SWA, 3)
    em.removed(FULL, h(2))
    em.updated(FULL, h(1), priority=(35, 80))
    store(em, SWA, 4, parent=3, lora_id=7)
    em.flush_iteration()
    store(em, FULL, 5, parent=1)
    store(em, FULL, 6, parent=5)


def two_emitters(**kw: Any) -> tuple[EventEmitter, EventEmitter]:
    return new_emitter(groups=(FULL, SWA), **kw), new_emitter(groups=(FULL, SWA), **kw)


# ---------------------------------------------------------------------------- deferred


@pytest.mark.parametrize("capacity", [4, 1024])
def test_take_deferred_materializes_to_what_take_returns(capacity: int) -> None:
    a, b = two_emitters(capacity=capacity)
    scenario(a)
    scenario(b)
    want = a.take()
    d = b.take_deferred()
    assert want is not None
    assert d is not None
    got = d.materialize()
    assert got == want
    assert a.stats() == b.stats()
    assert (a.take(), b.take_deferred()) == (None, None)


def test_deferred_metadata_comes_from_the_records_without_building_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    em = new_emitter(groups=(FULL, SWA), capacity=4)
    scenario(em)

    def no_models(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{cls.__name__} built")

    monkeypatch.setattr(model._RaisesKVStreamErrors, "__call__", no_models)
    d = em.take_deferred()
    assert d is not None
    built = d.materialized
    assert not built
    assert (d.source, d.ts_ns) == (em.source, 1000)
    assert d.num_events == 4  # the marker and the 3 newest events
    assert (d.first_event_id, d.last_event_id) == (2, 6)
    spans = list(d.spans())
    assert spans == [
        (2, 3, "v1_block_key", SWA, 128),  # the marker: the last dropped event's group
        (4, 4, "v1_block_key", FULL, 4096),
        (5, 5, "v1_block_key", FULL, 4096),
        (6, 6, "v1_block_key", FULL, 4096),
    ]
    assert "deferred" in repr(d)
    assert "ids 2..6" in repr(d)
    stats = em.stats()
    assert (stats.buffered_events, stats.batches_taken, stats.events_taken) == (0, 2, 5)
    monkeypatch.undo()
    batch = d.materialize()
    assert list(d.spans()) == spans  # the same, read from the models now
    assert isinstance(batch.events[0].data, Lost)
    assert d.materialized
    assert "materialized" in repr(d)


def test_recording_after_take_deferred_never_touches_the_taken_records() -> None:
    em = new_emitter()
    store(em, FULL, 1)
    d = em.take_deferred()
    assert d is not None
    store(em, FULL, 2, parent=1)  # would coalesce into the taken event: opens a new one
    chain(em, FULL, [3, 4], parent=2)
    em.removed(FULL, h(1))
    assert summary(d.materialize()) == [(1, "stored", FULL, None, [1])]
    assert summary(em.flush_deferred().materialize()) == [  # type: ignore[union-attr]
        (2, "stored", FULL, 1, [2, 3, 4]),
        (3, "removed", FULL, [1]),
    ]


def test_materialize_builds_once_for_all_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    em = new_emitter()
    chain(em, FULL, list(range(1, 40)))
    d = em.flush_deferred()
    assert d is not None
    built = []
    real: Any = model._RaisesKVStreamErrors.__call__

    def counting(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls is EventBatch:
            built.append(threading.get_ident())
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(model._RaisesKVStreamErrors, "__call__", counting)
    results: list[EventBatch] = []
    go = threading.Barrier(8)

    def worker() -> None:
        go.wait()
        results.append(d.materialize())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1
    assert len(results) == 8
    assert all(r is results[0] for r in results)
    assert d.materialize() is results[0]


def test_a_failed_materialize_propagates_and_can_be_retried() -> None:
    src = SourceId(instance_id="w")
    bad = {"event_id": 0, "window_size": 0, "data": {"type": "cleared"}}  # window_size >= 1
    d = DeferredBatch(src, 5, [bad])
    assert (d.num_events, d.first_event_id, d.last_event_id) == (1, 0, 0)
    with pytest.raises(EventValidationError, match="window_size"):
        d.materialize()
    assert not d.materialized
    assert list(d.spans()) == [(0, 0, "v1_block_key", 0, 0)]
    with pytest.raises(EventValidationError):
        d.materialize()


def test_an_empty_deferred_batch_is_valid() -> None:
    d = DeferredBatch(SourceId(instance_id="w"), 1, [])
    assert (d.num_events, d.first_event_id, d.last_event_id) == (0, None, None)
    assert list(d.spans()) == []
    assert d.materialize().events == ()
    assert list(d.spans()) == []


def test_block_runs_expand_into_per_block_dicts() -> None:
    run = BlockRun()
    run.hashes += [h(1), h(2), h(3)]
    run.tokens += [TokenIds(toks(1)), (packed(2, 3), 2)]
    run.attrs[2] = {"priority": 90}
    assert len(run) == 3
    assert run.block_tokens() == [toks(1), toks(2), toks(3)]
    rec: dict[str, Any] = {
        "event_id": 0,
        "window_size": 8,
        "data": {"type": "stored", "blocks": run},
    }
    (out,) = model_input([rec])
    assert out["data"]["blocks"] == [
        {"block_hash": h(1), "token_ids": toks(1)},
        {"block_hash": h(2), "token_ids": toks(2)},
        {"priority": 90, "block_hash": h(3), "token_ids": toks(3)},
    ]
    assert rec["data"]["blocks"] is run  # the record itself is left alone


def test_null_recorder_defers_nothing() -> None:
    rec: EventRecorder = NullRecorder()
    assert isinstance(rec, EventRecorder)
    rec.stored_chain(0, parent_hash=None, block_hashes=[h(1)], token_ids=toks(1))
    rec.removed_many(0, [h(1)], cache_level=0)
    assert rec.take_deferred() is None
    assert rec.flush_deferred() is None


# ---------------------------------------------------------------------------- stored_chain


def test_a_chain_is_one_coalesced_stored_event() -> None:
    em = new_emitter()
    chain(em, FULL, [1, 2, 3])
    chain(em, FULL, [4, 5], parent=3)  # continues the target
    chain(em, FULL, [6], parent=1)  # a branch: a new event
    assert summary(em.flush()) == [
        (1, "stored", FULL, None, [1, 2, 3, 4, 5]),
        (2, "stored", FULL, 1, [6]),
    ]
    assert em.stats().blocks_stored_announced == 6


def test_a_chain_mixes_with_single_stores_and_keeps_attributes() -> None:
    a, b = two_emitters()
    for em, batched in ((a, False), (b, True)):
        store(em, FULL, 1, priority=60)
        if batched:
            chain(em, FULL, [2, 3], parent=1, priority=90, lora_id=3, cache_salt="t")
        else:
            for n, p in ((2, 1), (3, 2)):
                store(em, FULL, n, parent=p, priority=90, lora_id=3, cache_salt="t")
        store(em, FULL, 4, parent=3)
    batch = b.flush()
    assert batch == a.flush()
    assert batch is not None
    stored = batch.events[0].data
    assert isinstance(stored, Stored)
    assert [(x.priority, x.lora_id, x.cache_salt) for x in stored.blocks] == [
        (60, None, None),
        (90, 3, "t"),
        (90, 3, "t"),
        (35, None, None),
    ]
    assert [x.token_ids for x in stored.blocks] == [toks(n) for n in (1, 2, 3, 4)]


def test_a_chain_skips_announced_blocks_exactly_as_single_stores_do() -> None:
    a, b = two_emitters()
    for em in (a, b):
        store(em, FULL, 2)
        em.flush()
        store(em, FULL, 9)
        em.removed(FULL, h(9))
    for n, p in ((1, None), (2, 1), (3, 2), (3, 3), (4, 3)):
        store(a, FULL, n, parent=p)
    b.stored_chain(
        FULL,
        parent_hash=None,
        block_hashes=[h(n) for n in (1, 2, 3, 3, 4)],
        token_ids=packed(1, 2, 3, 3, 4),
    )
    assert (
        summary(b.flush())
        == summary(a.flush())
        == [
            (3, "stored", FULL, None, [9]),
            (4, "removed", FULL, [9]),  # flushed before the group's next store
            (5, "stored", FULL, None, [1]),  # 2 is announced: skipped, so 3 opens an event
            (6, "stored", FULL, 2, [3, 4]),  # the second 3 is a duplicate
        ]
    )
    assert a.stats() == b.stats()
    assert b.stats().duplicate_stores_suppressed == 2


def test_a_chain_flushes_its_groups_removals_first() -> None:
    em = new_emitter(groups=(FULL, SWA))
    store(em, FULL, 1)
    store(em, SWA, 1)
    em.flush()
    em.removed(FULL, h(1))
    em.removed(SWA, h(1))
    chain(em, FULL, [2, 3])
    assert summary(em.flush()) == [
        (4, "removed", FULL, [1]),
        (5, "stored", FULL, None, [2, 3]),
        (6, "removed", SWA, [1]),  # another group's: pending until the iteration ends
    ]


def test_an_empty_chain_records_nothing() -> None:
    em = new_emitter()
    em.stored_chain(FULL, parent_hash=None, block_hashes=[], token_ids=[])
    assert em.flush() is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_hashes": [h(2), h(3)[:7]]}, r"block_hashes\[1\]: v1_block_key hashes are 8"),
        ({"block_hashes": [h(2), "x" * 8]}, r"block_hashes\[1\] must be bytes"),
        ({"block_hashes": h(2)}, "block_hashes must be a sequence of hashes"),
        ({"parent_hash": b"\x00" * 32}, "parent_hash: v1_block_key hashes are 8 bytes"),
        ({"token_ids": packed(2)}, "4 tokens for 2 blocks"),
        ({"token_ids": [*toks(2), *toks(3), 1]}, "9 tokens for 2 blocks"),
        ({"token_ids": [-1] * 8}, "token_ids"),
        ({"token_ids": b"abcd" * 8}, "token_ids must be a sequence of ints"),
        ({"priority": 101}, "priority must be in 0..100"),
        ({"cache_level": -1}, "cache_level must be in"),
        ({"lora_id": 2**64}, "lora_id"),
        ({"lora_name": 3}, "lora_name must be a str"),
        ({"cache_salt": b"x"}, "cache_salt must be a str"),
    ],
)
def test_bad_chain_arguments_raise_naming_the_argument_and_record_nothing(
    kwargs: dict[str, Any], match: str
) -> None:
    em = new_emitter()
    store(em, FULL, 1)
    em.flush()
    em.removed(FULL, h(1))
    args: dict[str, Any] = {
        "parent_hash": None,
        "block_hashes": [h(2), h(3)],
        "token_ids": packed(2, 3),
    }
    args.update(kwargs)
    with pytest.raises(EmitterError, match=match):
        em.stored_chain(FULL, **args)
    stats = em.stats()
    assert (stats.pending_removals, stats.events_emitted, stats.buffered_events) == (1, 2, 0)
    assert stats.blocks_stored_announced == 1
    chain(em, FULL, [2, 3])  # nothing half-recorded: the whole chain is announced now
    assert summary(em.flush()) == [(2, "removed", FULL, [1]), (3, "stored", FULL, None, [2, 3])]


def test_a_chain_of_an_unknown_algorithm_pins_the_width_only_when_valid() -> None:
    em = EventEmitter(SourceId(instance_id="w"), hash_algo="newer_algo_128", clock=ManualClock())
    em.created(0, window_size=64, num_blocks_per_cache_level=[8], tokens_per_block=1)
    with pytest.raises(EmitterError, match=r"block_hashes\[1\]: newer_algo_128 hashes are 16"):
        em.stored_chain(
            0, parent_hash=None, block_hashes=[b"\x01" * 16, b"\x02" * 8], token_ids=[1, 2]
        )
    em.stored_chain(0, parent_hash=None, block_hashes=[b"\x01" * 8, b"\x02" * 8], token_ids=[1, 2])
    with pytest.raises(EmitterError, match="newer_algo_128 hashes are 8 bytes, got 16"):
        em.stored(0, parent_hash=None, block_hash=b"\x03" * 16, token_ids=[3])


def test_chain_hashes_are_normalised_like_single_stores() -> None:
    class Digest(bytes):
        pass

    em = new_emitter()
    em.stored_chain(
        FULL, parent_hash=Digest(h(0)), block_hashes=(Digest(h(1)), h(2)), token_ids=packed(1, 2)
    )
    batch = em.flush()
    assert batch is not None
    stored = batch.events[0].data
    assert isinstance(stored, Stored)
    assert type(stored.parent_hash) is bytes
    assert all(type(b.block_hash) is bytes for b in stored.blocks)


def test_chains_respect_capacity_and_markers() -> None:
    a, b = two_emitters(capacity=3)
    for em, batched in ((a, False), (b, True)):
        for k in range(6):
            ns = [10 * k + 1, 10 * k + 2]
            if batched:
                chain(em, FULL if k % 2 else SWA, ns)
            else:
                store(em, FULL if k % 2 else SWA, ns[0])
                store(em, FULL if k % 2 else SWA, ns[1], parent=ns[0])
    assert a.flush() == b.flush()
    assert a.stats() == b.stats()
    assert b.stats().blocks_dropped == 8  # 4 events of 2 blocks


# ---------------------------------------------------------------------------- removed_many


def test_removed_many_is_removed_one_by_one() -> None:
    a, b = two_emitters()
    for em in (a, b):
        chain(em, FULL, [1, 2, 3, 4])
        em.flush()
    for x, level in ((4, 0), (3, 0), (9, 0), (4, 0), (2, 1)):
        a.removed(FULL, h(x), cache_level=level)
    b.removed_many(FULL, [h(4), h(3), h(9), h(4)], cache_level=0)  # 9 unknown, 4 twice
    b.removed_many(FULL, (h(2),), cache_level=1)
    assert b.stats() == a.stats()
    assert summary(b.flush()) == summary(a.flush()) == [(3, "removed", FULL, [4, 3, 2])]
    assert b.stats().unknown_removals_ignored == 2
    b.removed_many(FULL, [])
    assert b.stats().pending_removals == 0


def test_removed_many_keeps_a_shared_level() -> None:
    em = new_emitter()
    chain(em, FULL, [1, 2, 3])
    em.flush()
    em.removed_many(FULL, [h(3), h(2)], cache_level=1)
    em.removed(FULL, h(1), cache_level=1)
    batch = em.flush()
    assert batch is not None
    assert batch.events[0].data == model.Removed(block_hashes=(h(3), h(2), h(1)), cache_level=1)


@pytest.mark.parametrize(
    ("hashes", "match"),
    [
        ([h(1), b"\x00" * 32], r"block_hashes\[1\]: v1_block_key hashes are 8 bytes"),
        ([h(1), bytearray(8)], r"block_hashes\[1\] must be bytes"),
        ([h(1), ["x"]], r"block_hashes\[1\] must be bytes"),
        (h(1), "block_hashes must be a sequence of hashes"),
    ],
)
def test_bad_removed_many_arguments_record_nothing(hashes: Any, match: str) -> None:
    em = new_emitter()
    chain(em, FULL, [1, 2])
    em.flush()
    with pytest.raises(EmitterError, match=match):
        em.removed_many(FULL, hashes)
    with pytest.raises(EmitterError, match="cache_level must be in"):
        em.removed_many(FULL, [h(1)], cache_level=-1)
    with pytest.raises(EmitterError, match="not registered"):
        em.removed_many(7, [h(1)])
    stats = em.stats()
    assert (stats.pending_removals, stats.unknown_removals_ignored) == (0, 0)
    em.removed_many(FULL, [h(1)])
    assert summary(em.flush()) == [(2, "removed", FULL, [1])]


def test_chain_and_removal_lengths_must_be_blocks() -> None:
    em = new_emitter()
    with pytest.raises(EmitterError, match=f"tokens_per_block={TPB}"):
        em.stored_chain(FULL, parent_hash=None, block_hashes=[h(1)], token_ids=toks(1, TPB - 1))

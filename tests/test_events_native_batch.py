"""The C loop of ``emitted_batch`` (``_trusted_native.EmittedEvents``) builds the same events as
its pure-Python reference (``emitted._py_events``) and as validation, for every record an
emitter buffers: stored runs (packed chains, single blocks, mixed), runs with per-block
attributes and every other kind (which it hands to the validated fallback)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_emitter_trusted_batch import OPS, apply, assert_same, fields_sets, register

from kvstream._types import TokenIds
from kvstream.clock import ManualClock
from kvstream.events import emitted as emitted_mod
from kvstream.events.deferred import BlockRun, model_input
from kvstream.events.emitter import EventEmitter
from kvstream.events.model import EventBatch, KVCacheEvent, SourceId
from kvstream.events.trusted import NATIVE_AVAILABLE, native_events_builder

pytestmark = pytest.mark.skipif(not NATIVE_AVAILABLE, reason="the C extension is not built")

SOURCE = SourceId(instance_id="w")


def _validated(records: list[dict[str, Any]]) -> tuple[KVCacheEvent, ...]:
    return EventBatch(source=SOURCE, ts_ns=7, events=model_input(records)).events


def _assert_events(records: list[dict[str, Any]]) -> None:
    native = emitted_mod._events(records)
    reference = emitted_mod._py_events(records)
    assert native == reference == _validated(records)
    assert fields_sets(native) == fields_sets(reference)
    assert [type(e.data.blocks[0].token_ids) for e in native if e.data.type == "stored"] == [
        type(e.data.blocks[0].token_ids) for e in reference if e.data.type == "stored"
    ]


def test_the_emitter_uses_the_c_loop() -> None:
    assert emitted_mod._events is not emitted_mod._py_events


@settings(max_examples=150, deadline=None)
@given(st.lists(OPS, min_size=1, max_size=60))
def test_c_loop_equals_the_reference_on_recorded_batches(ops: list[tuple[Any, ...]]) -> None:
    em = EventEmitter(SOURCE, clock=ManualClock(7))
    for g in (0, 1):
        register(em, g)
    for op in [*ops, ("flush_iteration",)]:
        if op[0] == "take":
            records = list(em._buf)
            if records:
                _assert_events(records)
            em.take()
        else:
            apply(em, op)
    records = list(em._buf)
    if records:
        _assert_events(records)


def _stored(run: BlockRun, parent: bytes | None = None) -> dict[str, Any]:
    return {
        "event_id": 3,
        "hash_algo": "v1_block_key",
        "layer_group_id": 0,
        "window_size": 64,
        "data": {"type": "stored", "parent_hash": parent, "blocks": run},
    }


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def test_packed_single_and_mixed_token_entries() -> None:
    run = BlockRun()
    run.hashes += [h(1), h(2), h(3), h(4)]
    run.tokens.append((TokenIds(range(8)), 2))  # two blocks of 4, packed
    run.tokens.append(TokenIds([9, 9, 9, 9]))  # one block on its own
    run.tokens.append((TokenIds([5, 6, 7, 8]), 1))  # a packed run of one block
    _assert_events([_stored(run, h(0))])
    blocks = emitted_mod._events([_stored(run, h(0))])[0].data.blocks
    assert [list(b.token_ids) for b in blocks] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [9] * 4,
        [5, 6, 7, 8],
    ]


def test_runs_the_c_loop_does_not_build_go_to_the_fallback() -> None:
    calls: list[dict[str, Any]] = []

    def fallback(rec: dict[str, Any]) -> KVCacheEvent:
        calls.append(rec)
        return emitted_mod._validated_event(rec)

    events = native_events_builder(BlockRun, fallback)
    assert events is not None
    with_attrs = BlockRun()
    with_attrs.hashes.append(h(1))
    with_attrs.tokens.append(TokenIds([1, 2]))
    with_attrs.attrs[0] = {"cache_level": 1, "priority": 35}
    plain = BlockRun()
    plain.hashes.append(h(1))
    plain.tokens.append(TokenIds([1, 2]))
    got = events([_stored(with_attrs), _stored(plain)])
    assert calls == [_stored(with_attrs)]
    assert got == _validated([_stored(with_attrs), _stored(plain)])


def test_take_equals_validation_with_the_c_loop() -> None:
    em = EventEmitter(SOURCE, clock=ManualClock(7))
    register(em, 0)
    em.stored_chain(
        0, parent_hash=None, block_hashes=[h(1), h(2), h(3)], token_ids=TokenIds(range(12))
    )
    em.stored(0, parent_hash=h(3), block_hash=h(4), token_ids=[1, 2, 3, 4])
    em.removed(0, h(1))
    em.flush_iteration()
    records = list(em._buf)
    want = EventBatch(source=SOURCE, ts_ns=7, events=model_input(records))
    assert_same(em.take(), want)

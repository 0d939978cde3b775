"""A deferred emitter batch's columns (DeferredBatch.columns, kvstream.events.deferred_columns)
are what publish_columns makes of its materialised model, column by column, for every event
kind the emitter produces (stored plain, with attributes, chains, removed, updated, created,
cleared, lost markers); they encode to the model's Avro bytes, and their to_batch is the
deferred batch's model, built only when asked."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_emitter_trusted_batch import GROUPS, OPS, apply, assert_same, h, register, toks

from kvstream.clock import ManualClock
from kvstream.codec import AvroCodec
from kvstream.errors import EventValidationError
from kvstream.events import columns as columns_mod
from kvstream.events.columns import ColumnBatch, publish_columns
from kvstream.events.deferred import DeferredBatch
from kvstream.events.emitter import EventEmitter
from kvstream.events.model import EventBatch, MmKey, SourceId

SOURCE = SourceId(instance_id="w", attention_dp_rank=1, incarnation=9)

#: ColumnBatch's public fields and the private ones that decide what it encodes and builds
FIELDS = (
    "instance_id",
    "attention_dp_rank",
    "incarnation",
    "ts_ns",
    "schema_version",
    "event_ids",
    "kinds",
    "hash_algos",
    "group_ids",
    "window_sizes",
    "payloads",
    "tokens",
    "has_blocks",
    "stored_extra",
    "token_layout",
    "source",
    "num_events",
    "first_event_id",
    "last_event_id",
    "stored_blocks",
)

#: stored blocks with multimodal keys and extra token ids (validated, not read from the run)
EXTRA_OPS = st.tuples(st.just("mm"), st.sampled_from(sorted(GROUPS)), st.integers(0, 7))


def apply_any(em: EventEmitter, op: tuple[Any, ...]) -> None:
    if op[0] == "mm":
        _, g, i = op
        em.stored(
            g,
            parent_hash=None,
            block_hash=h(i),
            token_ids=toks(i),
            mm_keys=(MmKey(hash=bytes([i]) * 32, start_offset=i),),
            token_extra_ids=[7] * len(toks(i)),
        )
    else:
        apply(em, op)


def same_columns(got: ColumnBatch, want: ColumnBatch) -> None:
    for name in FIELDS:
        assert getattr(got, name) == getattr(want, name), name
    assert list(got.spans()) == list(want.spans())


@contextlib.contextmanager
def python_model_columns(on: bool) -> Iterator[None]:
    """ColumnBatch.from_batch's pure-Python loop (publish_columns uses it) when ``on``."""
    if not on:
        yield
        return
    saved = columns_mod._model_columns
    columns_mod._model_columns = None
    try:
        yield
    finally:
        columns_mod._model_columns = saved


def twins(capacity: int) -> tuple[EventEmitter, EventEmitter]:
    out = []
    for _ in range(2):
        em = EventEmitter(SOURCE, capacity=capacity, clock=ManualClock(7))
        for g in GROUPS:
            register(em, g)
        out.append(em)
    return out[0], out[1]


def deferred_pairs(ops: list[tuple[Any, ...]], capacity: int) -> Iterator[tuple[Any, Any]]:
    """Drive two twin emitters through ``ops`` (then a flush and a take) and yield each take's
    pair of deferred batches, one from each twin (equal histories: both None or neither)."""
    a, b = twins(capacity)
    for op in [*ops, ("flush_iteration",), ("take",)]:
        for em in (a, b):
            apply_any(em, op)
        if op[0] != "take":
            continue
        da, db = a.take_deferred(), b.take_deferred()
        if da is None:
            assert db is None
            continue
        assert db is not None
        yield da, db


@pytest.mark.parametrize("python_loop", [False, True])
@settings(max_examples=120, deadline=None)
@given(
    ops=st.lists(st.one_of(OPS, EXTRA_OPS), min_size=1, max_size=60),
    capacity=st.sampled_from([3, 1024]),
)
def test_columns_equal_publish_columns_of_the_model(
    python_loop: bool, ops: list[tuple[Any, ...]], capacity: int
) -> None:
    codec = AvroCodec()
    with python_model_columns(python_loop):
        for da, db in deferred_pairs(ops, capacity):
            cols = da.columns()
            assert not da.materialized  # built without the models
            want = db.materialize()
            same_columns(cols, publish_columns(want))
            assert codec.encode(cols) == codec.encode(want)
            same_columns(da.columns(), cols)  # a new, equal set each call
            got = cols.to_batch()
            assert got is da.materialize()  # one model, built on demand
            assert_same(got, want)


def test_columns_after_materialize_are_the_models() -> None:
    a, _ = twins(1024)
    a.stored(0, parent_hash=None, block_hash=h(1), token_ids=toks(1))
    a.removed(1, h(2))
    a.flush_iteration()
    d = a.take_deferred()
    assert d is not None
    batch = d.materialize()
    cols = d.columns()
    same_columns(cols, publish_columns(batch))
    assert cols.to_batch() is batch


def test_a_record_the_model_refuses_raises_its_error() -> None:
    # ts_ns beyond int64 (a broken clock): materialising refuses it, so do the columns
    recs = [{"event_id": 0, "window_size": 16, "data": {"type": "cleared"}}]
    d = DeferredBatch(SOURCE, 1 << 64, recs)
    with pytest.raises(EventValidationError):
        d.materialize()
    with pytest.raises(EventValidationError):
        d.columns()
    bad = DeferredBatch(
        SOURCE, 5, [{"event_id": -1, "window_size": 16, "data": {"type": "cleared"}}]
    )
    with pytest.raises(EventValidationError):
        bad.columns()
    assert not bad.materialized


def test_to_batch_validates_nothing_twice() -> None:
    # the columns' model is exactly the deferred batch's: EventBatch, same fields set
    a, b = twins(1024)
    for em in (a, b):
        em.stored_chain(0, parent_hash=None, block_hashes=[h(1), h(2)], token_ids=toks(1) + toks(2))
        em.flush_iteration()
    da, db = a.take_deferred(), b.take_deferred()
    assert da is not None
    assert db is not None
    got = da.columns().to_batch()
    assert isinstance(got, EventBatch)
    assert_same(got, db.materialize())

"""Lost markers: the ledger's merging rules and, property-based, that whatever a sink queue
drops, the stream it delivers covers every id exactly once in order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_helpers import check_contiguous, make_batch, source, stream_ids

from kvstream.clock import ManualClock
from kvstream.events.model import EventBatch, KVCacheEvent, Lost
from kvstream.pipeline import LossLedger, SinkPolicy, event_span
from kvstream.pipeline.lost import batch_first_id, make_marker_batch
from kvstream.pipeline.queue import SinkQueue


def marker(first: int, count: int) -> KVCacheEvent:
    return KVCacheEvent(
        event_id=first + count - 1,
        window_size=8,
        data=Lost(first_event_id=first, count=count, reason="overflow"),
    )


def test_event_span_of_a_marker_is_its_range() -> None:
    assert event_span(marker(10, 5)) == (10, 14)
    assert batch_first_id(EventBatch(source=source(), ts_ns=0, events=(marker(3, 2),))) == 3
    assert batch_first_id(EventBatch(source=source(), ts_ns=0)) is None


def test_adjacent_and_overlapping_drops_merge_into_one_marker() -> None:
    ledger = LossLedger()
    src = source()
    ledger.record(make_batch(src, 10, 5), "queue_full")
    ledger.record(make_batch(src, 0, 5), "queue_full")  # not adjacent yet
    assert [(g.first, g.last) for g in ledger.gaps()[src]] == [(0, 4), (10, 14)]
    ledger.record(make_batch(src, 5, 5), "retry_exhausted")  # fills the hole
    (gap,) = ledger.gaps()[src]
    assert (gap.first, gap.last, gap.count) == (0, 14, 15)
    ev = gap.to_event()
    assert ev.event_id == 14
    assert ev.data == Lost(first_event_id=0, count=15, reason="queue_full,retry_exhausted")
    assert ledger.pending_ids() == 15


def test_a_dropped_marker_re_enters_as_its_range() -> None:
    ledger = LossLedger()
    src = source()
    batch = EventBatch(source=src, ts_ns=0, events=(marker(0, 7), *make_batch(src, 7, 3).events))
    ledger.record(batch, "permanent_error")
    (gap,) = ledger.gaps()[src]
    assert (gap.first, gap.last) == (0, 9)


def test_take_before_only_takes_gaps_that_precede_the_batch() -> None:
    ledger = LossLedger()
    src, other = source("a"), source("b")
    ledger.record(make_batch(src, 0, 2), "x")
    ledger.record(make_batch(src, 5, 2), "x")
    ledger.record(make_batch(other, 0, 1), "x")
    assert [g.first for g in ledger.take_before(src, 4)] == [0]
    assert ledger.take_before(src, 4) == []
    assert [g.first for g in ledger.take_all(src)] == [5]
    assert ledger.sources() == [other]
    b = make_marker_batch(other, ledger.take_all(other), ts_ns=7)
    assert b.ts_ns == 7
    assert b.events[0].data == Lost(first_event_id=0, count=1, reason="x")
    assert not ledger


def test_incarnations_are_separate_streams() -> None:
    ledger = LossLedger()
    ledger.record(make_batch(source(incarnation=1), 0, 2), "x")
    ledger.record(make_batch(source(incarnation=2), 0, 2), "x")
    assert len(ledger.sources()) == 2


_op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 2), st.integers(1, 6)),
    st.tuples(st.just("deliver"), st.just(0), st.just(0)),
    st.tuples(st.just("fail"), st.sampled_from(["retry_exhausted", "permanent_error"]), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(_op, max_size=80),
    policy=st.sampled_from(["drop_oldest", "drop_newest", "block"]),
    max_batches=st.integers(1, 4),
    max_export=st.integers(1, 3),
)
def test_any_drop_pattern_yields_a_contiguous_stream(
    ops: list[tuple[str, object, int]], policy: str, max_batches: int, max_export: int
) -> None:
    pol = SinkPolicy(
        overflow=policy,  # type: ignore[arg-type]
        max_queue_batches=max_batches,
        max_export_batches=max_export,
        linger_s=0,
    )
    q = SinkQueue(pol, ManualClock())
    sources = [source(f"s{i}") for i in range(3)]
    next_id = [0, 0, 0]
    delivered: list[EventBatch] = []
    for op, arg, n in ops:
        if op == "submit":
            i = int(arg)  # type: ignore[call-overload]
            q.put(make_batch(sources[i], next_id[i], n), None)
            next_id[i] += n
        else:
            chunk = q._take()
            if not chunk.batches:
                continue
            if op == "deliver":
                delivered.extend(chunk.batches)
                q.delivered(chunk)
            else:
                q.failed(chunk, str(arg), 0.0)
    for _ in range(1000):  # drain: deliver everything left, markers included
        chunk = q._take()
        if not chunk.batches:
            break
        delivered.extend(chunk.batches)
        q.delivered(chunk)
    assert q.idle()
    ids = stream_ids(delivered)
    total_lost = 0
    for i, src in enumerate(sources):
        if next_id[i]:
            _, lost = check_contiguous(ids[src], next_id[i])
            total_lost += lost
    assert total_lost == sum(q.counters.dropped.values())
    assert q.counters.events_out + total_lost == sum(next_id)


def test_coarse_recording_equals_exact_recording_for_contiguous_sources() -> None:
    """close's fallback when exact recording would overrun its deadline: per source, one
    range from the batches' ends only; the same gaps (and marker fields) as per event."""
    from kvstream.events.deferred import DeferredBatch

    a, b = source("coarse-a"), source("coarse-b", rank=1)
    batches: list[object] = []
    for i in range(0, 60, 6):
        batches.append(make_batch(a, i, 6))
        raw = make_batch(b, 100 + i, 6)
        batches.append(DeferredBatch(raw.source, raw.ts_ns, [ev.model_dump() for ev in raw.events]))
    batches.append(EventBatch(source=a, ts_ns=0, events=(marker(60, 40),)))  # an upstream loss
    exact, coarse = LossLedger(), LossLedger()
    for batch in batches:
        exact.record(batch, "shutdown")  # type: ignore[arg-type]
    coarse.record_coarse(batches, "shutdown")  # type: ignore[arg-type]
    assert coarse.gaps() == exact.gaps()
    assert [(g.first, g.last) for g in coarse.gaps()[a]] == [(0, 99)]
    assert [(g.first, g.last) for g in coarse.gaps()[b]] == [(100, 159)]

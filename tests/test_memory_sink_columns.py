"""The memory sink holds column batches as exported and builds their models on first read:
every public read returns the models (one per batch, shared by readers), counts are the
models', and a sink made with columns=True gives its subscriptions the columns themselves."""

from __future__ import annotations

from kvstream.sinks.memory import MemorySink
from pipeline_helpers import make_batch, source

from kvstream.events.columns import ColumnBatch, publish_columns
from kvstream.events.deferred import DeferredBatch
from kvstream.sink import create_sink


def _deferred(seed: int) -> DeferredBatch:
    built = make_batch(source(), seed * 10, 3)
    return DeferredBatch(built.source, built.ts_ns, [ev.model_dump() for ev in built.events])


async def test_reads_return_models_built_once() -> None:
    sink = MemorySink()
    deferred = [_deferred(i) for i in range(3)]
    plain = make_batch(source("other"), 0, 2)
    cols = [d.columns() for d in deferred]
    assert (await sink.export([cols[0], plain, cols[1]])).ok
    assert sink.export_now([cols[2]])
    assert not any(d.materialized for d in deferred)
    assert (sink.batches_in, sink.events_in) == (4, 11)
    want = [deferred[0].materialize(), plain, deferred[1].materialize(), deferred[2].materialize()]
    got = sink.batches
    assert got == want
    assert all(a is b for a, b in zip(got, sink.batches, strict=True))  # built once
    assert sink.events() == [(b.source, ev) for b in want for ev in b.events]
    assert await sink.read_back(await sink.position() - 2) == want[2:]
    sub = sink.subscribe(from_start=True)
    assert [sub.poll() for _ in range(4)] == want
    assert sub.poll() is None


async def test_a_columns_sink_hands_its_subscriptions_the_columns() -> None:
    sink = create_sink("memory?columns=1&max_batches=8")
    assert isinstance(sink, MemorySink)
    assert sink.columns
    batch = make_batch(source(), 0, 4)
    cols = publish_columns(batch)
    plain = make_batch(source(), 4, 1)
    await sink.export([cols, plain])
    sub = sink.subscribe(from_start=True)
    first = sub.poll()
    assert isinstance(first, ColumnBatch)
    assert first is cols
    assert sub.poll() is plain
    assert sink.batches == [batch, plain]  # the sink's own reads stay models

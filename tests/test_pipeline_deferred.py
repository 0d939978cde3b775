"""Deferred batches through the pipeline: the engine thread only enqueues, the first sink task
that exports a batch materialises it once for every sink, and a dropped deferred batch is
accounted for exactly (lost markers) without ever being materialised."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from conftest_kafka import KafkaEnv
from kafka_broker import TopicReader
from kvstream.sinks.file import FileSink, _too_big_reason, read_dir
from kvstream.sinks.kafka import KafkaSink
from kvstream.sinks.memory import MemorySink
from pipeline_helpers import batches_for, check_contiguous, make_batch, source, stream_ids

from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.clock import ManualClock
from kvstream.codec import AvroCodec
from kvstream.events.deferred import DeferredBatch
from kvstream.events.emitter import EventEmitter
from kvstream.events.model import EventBatch, Lost, SourceId
from kvstream.pipeline import DropReason, Pipeline, PipelineConfig
from kvstream.pipeline.lost import batch_first_id, batch_len
from kvstream.sink import ExportResult
from kvstream.workloads import ChatWorkload, multi_turn_chats


def config(**defaults: object) -> PipelineConfig:
    base: dict[str, object] = {"linger_s": 0.0}
    base.update(defaults)
    return PipelineConfig.load(defaults=base, close_timeout_s=5.0)


def deferred(batch: EventBatch) -> DeferredBatch:
    """The same events as raw records, as an emitter would hand them over."""
    return DeferredBatch(batch.source, batch.ts_ns, [ev.model_dump() for ev in batch.events])


def deferred_for(src: SourceId, total: int, per_batch: int) -> list[DeferredBatch]:
    return [deferred(b) for b in batches_for(src, total, per_batch)]


def cache_deferred(instance: str, rank: int | None, *, seed: int = 0) -> list[DeferredBatch]:
    """A metadata-only cache manager (full + sliding-window group, under memory pressure) over
    a small chat workload; its deferred batches, one per iteration."""
    cfg = CacheConfig(
        tokens_per_block=16,
        groups=[
            LayerGroupSpec(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=64),
            LayerGroupSpec(
                num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=48, window_size=128
            ),
        ],
        hash_algo="v2_sha256_64",
        metadata_only=True,
    )
    src = SourceId(instance_id=instance, attention_dp_rank=rank, incarnation=3)
    mgr = KVCacheManager(cfg, source=src, clock=ManualClock(1))
    work = ChatWorkload(
        num_conversations=5,
        turns=(2, 4),
        num_system_prompts=2,
        system_prompt_tokens=(64, 200),
        user_tokens=(8, 60),
        output_tokens=(8, 60),
        seed=seed,
    )
    out: list[DeferredBatch] = []
    for req in multi_turn_chats(work):
        mgr.add_request(req.request_id, req.prompt)
        for i in range(0, len(req.output), 16):
            mgr.append_tokens(req.request_id, req.output[i : i + 16])
            d = mgr.flush_events_deferred()
            if d is not None:
                out.append(d)
        mgr.free_request(req.request_id)
        d = mgr.flush_events_deferred()
        if d is not None:
            out.append(d)
    return out


@pytest.fixture
def materializations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread id of every EventBatch built from a deferred batch."""
    calls: list[int] = []
    real = DeferredBatch.materialize

    def spy(self: DeferredBatch) -> EventBatch:
        if not self.materialized:
            calls.append(threading.get_ident())
        return real(self)

    monkeypatch.setattr(DeferredBatch, "materialize", spy)
    return calls


def test_o1_metadata_helpers_read_deferred_batches() -> None:
    b = make_batch(source(), 10, 4)
    d = deferred(b)
    assert (batch_len(d), batch_first_id(d)) == (batch_len(b), batch_first_id(b)) == (4, 10)
    assert d.materialize() == b
    assert (batch_len(d), batch_first_id(d)) == (4, 10)  # the same once built


# ------------------------------------------------------------------------------ delivery


async def test_every_memory_sink_gets_the_same_models_built_once_off_the_engine_thread(
    materializations: list[int],
) -> None:
    """Memory sinks take deferred batches as columns: no model is built in the pipeline; the
    first read builds each batch's models once, shared by both sinks."""
    a, b = MemorySink(name="a"), MemorySink(name="b")
    streams = {
        (i, r): cache_deferred(i, r, seed=k) for k, (i, r) in enumerate([("e", 0), ("e", 1)])
    }
    async with Pipeline([a, b], config()) as pipe:
        loop_thread = threading.get_ident()

        def engine() -> int:
            n = 0
            for i in range(max(len(s) for s in streams.values())):
                for s in streams.values():
                    if i < len(s):
                        assert pipe.submit(s[i])
                        n += 1
            return n

        submitted = await asyncio.to_thread(engine)
        assert await pipe.flush(5)
    assert materializations == []  # the sinks hold columns
    assert len(a.batches) == submitted
    assert set(materializations) == {loop_thread}  # built by the reader, not the engine
    assert len(materializations) == submitted  # once per batch, for both sinks
    assert a.batches == b.batches
    assert all(x is y for x, y in zip(a.batches, b.batches, strict=True))  # shared models
    for stream in streams.values():
        src = stream[0].source
        want = [d.materialize() for d in stream]
        assert [x for x in a.batches if x.source == src] == want
        total = sum(d.num_events for d in stream)
        assert check_contiguous(stream_ids(a.batches)[src], total) == (total, 0)


async def test_deferred_and_built_batches_mix_in_order() -> None:
    sink = MemorySink()
    src = source()
    batches = batches_for(src, 60, 5)
    async with Pipeline([sink], config()) as pipe:
        for k, b in enumerate(batches):
            assert pipe.submit(deferred(b) if k % 2 else b)
        assert await pipe.put(deferred(make_batch(src, 60, 5)))
        assert pipe.submit_nowait(deferred(make_batch(src, 65, 5)))
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    assert sink.batches == [*batches, make_batch(src, 60, 5), make_batch(src, 65, 5)]
    assert (report.events_in, report.events_out) == (70, 70)


@pytest.mark.parametrize("fmt", ["avro", "jsonl"])
async def test_deferred_batches_through_the_file_sink(tmp_path: Path, fmt: str) -> None:
    """The file sink takes columns: Avro files get their records from the columns (no model
    built), JSON Lines files from the models they print."""
    sink = FileSink(tmp_path, format=fmt)  # type: ignore[arg-type]
    stream = cache_deferred("f", None)
    async with Pipeline([sink], config()) as pipe:
        for d in stream:
            assert pipe.submit(d)
        assert await pipe.flush(5)
    assert any(d.materialized for d in stream) is (fmt == "jsonl")
    want = [d.materialize() for d in stream]
    assert list(read_dir(tmp_path)) == want
    assert sink.stats.events == sum(len(b.events) for b in want)


def test_a_too_large_column_batch_is_named_as_its_model_would_be() -> None:
    batch = make_batch(source("big", 3), 40, 5)
    d = deferred(batch)
    cols = d.columns()
    assert _too_big_reason([(cols, 999)], 100) == _too_big_reason([(batch, 999)], 100)
    assert "big rank 3 ids 40..44" in _too_big_reason([(cols, 999)], 100)
    assert not d.materialized


@pytest.mark.kafka
async def test_deferred_batches_through_kafka(kafka: KafkaEnv) -> None:
    topic = kafka.topic("deferred")
    sink = KafkaSink(kafka.bootstrap, topic, create_topic=True, partitions=2)
    stream = cache_deferred("k", 1)
    async with Pipeline([sink], config(overflow="block")) as pipe:
        await asyncio.to_thread(lambda: [pipe.submit(d) for d in stream])
        assert await pipe.flush(10)
    assert not any(d.materialized for d in stream)  # encoded from their columns
    want = [d.materialize() for d in stream]
    total = sum(len(b.events) for b in want)
    reader = await TopicReader(kafka.bootstrap, topic, 2).start()
    try:
        assert await reader.wait_for(
            lambda r: sum(len(AvroCodec().decode(x.value).events) for x in r) >= total, 20
        )
    finally:
        await reader.stop()
    codec = AvroCodec()
    got = [codec.decode(r.value) for r in sorted(reader.records, key=lambda r: r.offset)]
    assert got == want


# ------------------------------------------------------------------------------ drops


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
async def test_dropped_deferred_batches_are_marked_exactly_and_never_built(
    policy: str, materializations: list[int]
) -> None:
    sink = MemorySink()
    src = source()
    stream = deferred_for(src, 500, 5)  # 100 batches
    cfg = config(overflow=policy, max_queue_batches=10, max_export_batches=4)
    async with Pipeline([sink], cfg) as pipe:
        sink.pause()
        for d in stream:
            pipe.submit(d)
        sink.resume()
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    delivered, lost = check_contiguous(stream_ids(sink.batches)[src], 500)
    assert lost == report.dropped[DropReason.QUEUE_FULL] > 0
    assert delivered == report.events_out == sum(d.num_events for d in stream if d.materialized)
    assert len(materializations) == sum(d.materialized for d in stream) == delivered // 5
    assert report.lost_pending_ids == 0
    markers = [(ev.event_id, m) for _, ev in sink.events() if isinstance(m := ev.data, Lost)]
    assert sum(m.count for _, m in markers) == lost
    assert all(eid == m.first_event_id + m.count - 1 for eid, m in markers)


async def test_emitter_overflow_markers_inside_dropped_deferred_batches_stay_exact() -> None:
    em = EventEmitter(source("ovf"), capacity=3, clock=ManualClock())
    em.created(0, window_size=64, num_blocks_per_cache_level=[8], tokens_per_block=1)
    stream: list[DeferredBatch] = []
    for i in range(1, 200):
        em.stored(0, parent_hash=None, block_hash=i.to_bytes(8, "big"), token_ids=[i])
        if i % 5 == 0:  # 5 events (+1 created) into a capacity of 3: a marker heads each batch
            d = em.flush_deferred()
            assert d is not None
            stream.append(d)
    total = em.next_event_id - 4  # the 4 events still buffered are never taken
    sink = MemorySink()
    async with Pipeline([sink], config(overflow="drop_newest", max_queue_batches=4)) as pipe:
        sink.pause()
        for d in stream:
            pipe.submit(d)
        sink.resume()
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    spans = stream_ids(sink.batches)[em.source]
    delivered, lost = check_contiguous(spans, total)
    emitter_lost = sum(
        ev.data.count
        for d in stream
        if d.materialized
        for ev in d.materialize().events
        if isinstance(ev.data, Lost)
    )
    # every id once: delivered events, the emitter's markers, and the pipeline's markers
    assert delivered + lost == total
    assert lost - emitter_lost == sum(
        last - first + 1 for d in stream if not d.materialized for first, last, *_ in d.spans()
    )
    assert report.dropped[DropReason.QUEUE_FULL] == sum(
        d.num_events for d in stream if not d.materialized
    )


async def test_a_block_timeout_drops_a_deferred_batch_with_a_marker() -> None:
    sink = MemorySink()
    src = source()
    cfg = PipelineConfig.load(
        defaults={"overflow": "block", "block_timeout_s": 0.02, "max_queue_batches": 2},
        handoff_timeout_s=1.0,
    )
    stream = deferred_for(src, 30, 3)
    async with Pipeline([sink], cfg) as pipe:
        sink.pause()
        oks = await asyncio.to_thread(lambda: [pipe.submit(d) for d in stream])
        sink.resume()
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    assert not all(oks)
    _, lost = check_contiguous(stream_ids(sink.batches)[src], 30)
    assert lost == report.dropped[DropReason.BLOCK_TIMEOUT] == 3 * oks.count(False)
    assert all(not d.materialized for d, ok in zip(stream, oks, strict=True) if not ok)


async def test_a_deferred_batch_that_cannot_be_built_fails_its_chunk_permanently() -> None:
    sink = MemorySink()
    src = source()
    stored = {"type": "stored", "blocks": [{"block_hash": b"\x01" * 7, "token_ids": [1]}]}
    bad = DeferredBatch(src, 0, [{"event_id": 5, "window_size": 8, "data": stored}])  # 7 bytes
    async with Pipeline([sink], config()) as pipe:
        pipe.submit(deferred(make_batch(src, 0, 5)))
        assert await pipe.flush(5)
        pipe.submit(bad)
        assert await pipe.flush(5)
        failed = pipe.stats()[sink.name].last_error or ""
        pipe.submit(deferred(make_batch(src, 6, 4)))
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    assert report.dropped == {DropReason.PERMANENT_ERROR: 1}
    assert "materialising a deferred batch failed" in failed
    assert report.last_error is None  # data flows again: not stale
    assert check_contiguous(stream_ids(sink.batches)[src], 10) == (9, 1)


async def test_a_permanent_export_failure_marks_a_materialised_deferred_chunk() -> None:
    sink = MemorySink()
    src = source()
    async with Pipeline([sink], config()) as pipe:
        sink.fail_next(1, ExportResult.permanent("bad record"))
        pipe.submit(deferred(make_batch(src, 0, 10)))
        await asyncio.sleep(0.05)
        pipe.submit(deferred(make_batch(src, 10, 10)))
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    assert report.dropped == {DropReason.PERMANENT_ERROR: 10}
    assert check_contiguous(stream_ids(sink.batches)[src], 20) == (10, 10)

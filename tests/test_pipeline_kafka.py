"""Pipeline -> Kafka against a real broker (tansu), read back by an independent consumer.

Outages go through a fault-injecting proxy (cut, reset, stall) or kill the broker and start it
again on the same port. With ``block`` nothing produced during an outage is lost (duplicates
are allowed: event ids tell); with a drop policy memory stays bounded and the ``lost`` markers
count exactly what was dropped.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
from conftest_kafka import KafkaEnv
from kafka_broker import TopicReader, create_topic
from kvstream.sinks.kafka import (
    HEADER_ENCODING,
    HEADER_HASH_ALGO,
    HEADER_SCHEMA_FINGERPRINT,
    HEADER_SCHEMA_VERSION,
    KafkaSink,
    source_key,
)
from pipeline_helpers import (
    batches_for,
    cache_batches,
    check_contiguous,
    source,
    stream_ids,
)

from kvstream.codec import AvroCodec
from kvstream.events.model import EventBatch, SourceId
from kvstream.pipeline import DropReason, Pipeline, PipelineConfig

pytestmark = pytest.mark.kafka

CODEC = AvroCodec()
PARTITIONS = 3


def decode(records: list[Any]) -> list[EventBatch]:
    return [CODEC.decode(r.value) for r in records]


def event_count(records: list[Any]) -> dict[SourceId, int]:
    """Distinct ids seen per source (markers count their whole range)."""
    seen: dict[SourceId, set[int]] = defaultdict(set)
    for b in decode(records):
        for first, last, _ in stream_ids([b])[b.source]:
            seen[b.source].update(range(first, last + 1))
    return {s: len(ids) for s, ids in seen.items()}


def have_all(expected: dict[SourceId, int]) -> Callable[[list[Any]], bool]:
    def done(records: list[Any]) -> bool:
        got = event_count(records)
        return all(got.get(s, 0) >= n for s, n in expected.items())

    return done


def interleaved(emitted: dict[Any, list[Any]]) -> list[Any]:
    """The sources' batches in the order an engine thread interleaves its ranks' iterations."""
    streams = list(emitted.values())
    return [s[i] for i in range(max(len(s) for s in streams)) for s in streams if i < len(s)]


async def read_all(kafka: KafkaEnv, topic: str, expected: dict[SourceId, int]) -> list[Any]:
    """The topic's records once every source's ``expected`` events are in."""
    reader = await TopicReader(kafka.bootstrap, topic, PARTITIONS).start()
    try:
        assert await reader.wait_for(have_all(expected), 20)
    finally:
        await reader.stop()
    return reader.records


def kafka_sink(env: KafkaEnv, topic: str, **kw: Any) -> KafkaSink:
    return KafkaSink(
        env.bootstrap,
        topic,
        create_topic=True,
        partitions=PARTITIONS,
        request_timeout_ms=1500,
        **kw,
    )


OUTAGE_RETRY = {
    "attempt_timeout_s": 2.0,
    "deadline_s": None,
    "initial_backoff_s": 0.05,
    "max_backoff_s": 0.3,
}


# ------------------------------------------------------------------------------ end to end


async def test_cache_manager_to_kafka_and_back(kafka: KafkaEnv) -> None:
    topic = kafka.topic("e2e")
    emitted = {
        (inst, rank): cache_batches(inst, rank, seed=i)
        for i, (inst, rank) in enumerate([("engine-a", 0), ("engine-a", 1), ("engine-b", None)])
    }
    cfg = PipelineConfig.load(defaults={"linger_s": 0.002, "overflow": "block"})
    async with Pipeline([kafka_sink(kafka, topic)], cfg) as pipe:

        def engine() -> None:  # the engine thread interleaves its ranks' iterations
            for b in interleaved(emitted):
                assert pipe.submit(b)

        await asyncio.to_thread(engine)
        assert await pipe.flush(10)
    expected = {bs[0].source: sum(len(b.events) for b in bs) for bs in emitted.values()}
    records = await read_all(kafka, topic, expected)
    partitions: dict[SourceId, set[int]] = defaultdict(set)
    got: dict[SourceId, list[Any]] = defaultdict(list)
    for r in records:
        b = CODEC.decode(r.value)
        partitions[b.source].add(r.partition)
        got[b.source].extend(b.events)
        assert r.key == source_key(b.source)
        headers = dict(r.headers)
        assert headers[HEADER_SCHEMA_VERSION] == str(CODEC.schema_version).encode()
        assert headers[HEADER_SCHEMA_FINGERPRINT] == CODEC.schema.fingerprint_hex.encode()
        assert headers[HEADER_HASH_ALGO] == b"v2_sha256_64"
        assert headers[HEADER_ENCODING] == b"avro-single-object"
    for batches in emitted.values():
        src = batches[0].source
        events = [ev for b in batches for ev in b.events]
        assert [ev.event_id for ev in got[src]] == list(range(len(events)))
        assert got[src] == events  # payloads equal what was emitted
        assert len(partitions[src]) == 1  # one source, one partition: ordered


@pytest.mark.parametrize("fault", [None, "stall"])
async def test_deferred_batches_go_in_steps_and_resume_after_a_fault(
    kafka: KafkaEnv, fault: str | None
) -> None:
    # the managers' own hand-off (DeferredBatch), queued long enough that one export holds
    # several encoding steps (the sink builds the columns itself, in its encoding thread,
    # while earlier steps are sent); a stalled broker mid-export fails it, and the retry
    # resumes where it stopped: every event arrives, in order, equal to the models
    topic = kafka.topic(f"deferred-{fault}")
    emitted = {
        (inst, rank): cache_batches(inst, rank, conversations=16, seed=i, deferred=True)
        for i, (inst, rank) in enumerate([("engine-a", 0), ("engine-a", 1), ("engine-b", None)])
    }
    total = sum(len(bs) for bs in emitted.values())
    assert total > 3 * 64  # more than one step of the sink's
    cfg = PipelineConfig.load(
        defaults={
            "linger_s": 0.3,
            "overflow": "block",
            "max_export_batches": 4096,
            "max_queue_batches": 4096,
            "retry": OUTAGE_RETRY,
        }
    )
    sink = kafka_sink(kafka, topic)
    async with Pipeline([sink], cfg) as pipe:
        for b in interleaved(emitted):
            assert pipe.submit(b)
        if fault == "stall":  # a slow network makes the export long; stall it halfway
            kafka.proxy.delay(0.05)
            await asyncio.sleep(0.5)  # the linger (0.3 s) ended: the export is under way
            kafka.proxy.stall()  # past the request timeout: the export fails, is retried
            await asyncio.sleep(2.5)
            kafka.proxy.restore()
        assert await pipe.flush(30)
        stats = pipe.stats()[sink.name]
    if fault == "stall":
        assert stats.retries >= 1
    assert stats.events_out == sum(b.num_events for bs in emitted.values() for b in bs)
    assert not any(b.materialized for bs in emitted.values() for b in bs)  # no model built
    expected = {bs[0].source: sum(b.num_events for b in bs) for bs in emitted.values()}
    got: dict[SourceId, list[Any]] = defaultdict(list)
    for b in decode(await read_all(kafka, topic, expected)):
        got[b.source].extend(b.events)
    for batches in emitted.values():
        events = [ev for b in batches for ev in b.materialize().events]
        mine = got[batches[0].source]
        if fault is None:
            assert mine == events
        else:  # a resent message may arrive twice (no idempotence): each id once, in order
            first = {}
            for ev in mine:
                first.setdefault(ev.event_id, ev)
            assert list(first.values()) == events


async def test_confluent_wire_format(kafka: KafkaEnv) -> None:
    topic = kafka.topic("confluent")
    sink = kafka_sink(kafka, topic, schema_registry_id=42)
    batches = batches_for(source(), 20, 5, stored=True)
    async with Pipeline([sink]) as pipe:
        for b in batches:
            pipe.submit(b)
        assert await pipe.flush(10)
    reader = await TopicReader(kafka.bootstrap, topic, PARTITIONS).start()
    try:
        assert await reader.wait_for(lambda r: len(r) >= 4, 20)
    finally:
        await reader.stop()
    values = [r.value for r in sorted(reader.records, key=lambda r: r.offset)]
    assert all(v[:5] == b"\x00\x00\x00\x00\x2a" for v in values)
    assert [CODEC.decode_confluent(v, {42: CODEC.schema_version}) for v in values] == batches
    assert dict(reader.records[0].headers)[HEADER_ENCODING] == b"confluent"


# --------------------------------------------------------------------------------- outages


class Engine:
    """A thread submitting batches of two sources; counts progress, can be held."""

    def __init__(self, pipe: Pipeline, total: int, per_batch: int = 5) -> None:
        self.pipe = pipe
        self.sources = [source("out-a"), source("out-b", rank=3)]
        self.batches = [batches_for(s, total, per_batch) for s in self.sources]
        self.submitted = 0
        self.refused = 0
        self.max_depth = 0
        self.go = threading.Event()
        self.go.set()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def expected(self) -> dict[SourceId, int]:
        return {
            s: sum(len(b.events) for b in bs)
            for s, bs in zip(self.sources, self.batches, strict=True)
        }

    def _run(self) -> None:
        queue = self.pipe.metric_queues()[0][1]
        for i in range(len(self.batches[0])):
            for bs in self.batches:
                self.go.wait()
                if not self.pipe.submit(bs[i], timeout_s=30):
                    self.refused += 1
                self.submitted += 1
                self.max_depth = max(self.max_depth, queue.depth()[0])
            time.sleep(0.002)

    def start(self) -> Engine:
        self._thread.start()
        return self

    async def wait_submitted(self, n: int, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while self.submitted < n:
            assert time.monotonic() < deadline, f"engine stuck at {self.submitted}"
            await asyncio.sleep(0.01)

    async def join(self) -> None:
        await asyncio.to_thread(self._thread.join, 60)


def block_config() -> PipelineConfig:
    return PipelineConfig.load(
        defaults={
            "overflow": "block",
            "max_queue_batches": 16,
            "block_timeout_s": 30.0,
            "linger_s": 0.002,
            "retry": OUTAGE_RETRY,
        },
        handoff_timeout_s=30.0,
    )


def assert_everything_arrived(records: list[Any], engine: Engine) -> None:
    ids = stream_ids(decode(records))
    for src, n in engine.expected.items():
        delivered, lost = check_contiguous(ids[src], n, allow_duplicates=True)
        assert (delivered, lost) == (n, 0)


@pytest.mark.parametrize("fault", ["cut", "reset", "stall", "delay"])
async def test_block_loses_nothing_through_a_network_fault(kafka: KafkaEnv, fault: str) -> None:
    topic = kafka.topic(f"outage-{fault}")
    pipe = await Pipeline([kafka_sink(kafka, topic)], block_config()).start()
    engine = Engine(pipe, total=600).start()
    await engine.wait_submitted(40)
    if fault == "reset":  # a blip: reset twice while traffic flows
        kafka.proxy.reset()
        await engine.wait_submitted(120)
        kafka.proxy.reset()
    elif fault == "delay":  # a slow network: 50 ms per chunk each way for a second
        kafka.proxy.delay(0.05)
        await asyncio.sleep(1.0)
        kafka.proxy.restore()
    else:
        getattr(kafka.proxy, fault)()
        await asyncio.sleep(0.6)  # the outage: the queue fills, the engine blocks
        held = engine.submitted
        await asyncio.sleep(0.4)
        assert engine.submitted == held < 600, "the engine must be held back"
        kafka.proxy.restore()
    await engine.join()
    report = await pipe.aclose(timeout_s=20)
    assert report.ok, report.as_dict()
    assert engine.refused == 0
    reader = await TopicReader(kafka.bootstrap, topic, PARTITIONS).start()
    try:
        assert await reader.wait_for(have_all(engine.expected), 20)
    finally:
        await reader.stop()
    assert_everything_arrived(reader.records, engine)


async def test_block_loses_nothing_when_the_broker_restarts(
    kafka_factory: Callable[[], KafkaEnv],
) -> None:
    env = kafka_factory()
    topic = env.topic("restart")
    await create_topic(f"127.0.0.1:{env.broker.port}", topic, PARTITIONS)
    pipe = await Pipeline([kafka_sink(env, topic)], block_config()).start()
    reader = await TopicReader(env.bootstrap, topic, PARTITIONS).start()
    engine = Engine(pipe, total=400).start()
    try:
        await engine.wait_submitted(60)
        # the old broker's data dies with it (memory storage): let the reader catch up first
        engine.go.clear()
        assert await pipe.flush(20)
        sent_so_far = dict.fromkeys(engine.sources, engine.submitted // 2 * 5)
        assert await reader.wait_for(have_all(sent_so_far), 20)
        env.proxy.cut()
        env.broker.kill()
        engine.go.set()  # keep producing during the outage
        await asyncio.sleep(1.0)
        env.broker.start()  # same port, empty memory: re-create the topic before clients return
        await create_topic(f"127.0.0.1:{env.broker.port}", topic, PARTITIONS)
        env.proxy.restore()
        await reader.rewind()
        await engine.join()
        report = await pipe.aclose(timeout_s=20)
        assert report.ok, report.as_dict()
        assert await reader.wait_for(have_all(engine.expected), 20)
    finally:
        engine.go.set()
        await reader.stop()
        await pipe.aclose(timeout_s=1)
    assert env.broker.starts == 2
    assert_everything_arrived(reader.records, engine)


async def test_drop_policy_stays_bounded_and_markers_count_the_drops(kafka: KafkaEnv) -> None:
    topic = kafka.topic("drops")
    cfg = PipelineConfig.load(
        defaults={
            "overflow": "drop_oldest",
            "max_queue_batches": 8,
            "linger_s": 0.002,
            "retry": OUTAGE_RETRY,
        }
    )
    pipe = await Pipeline([kafka_sink(kafka, topic)], cfg).start()
    engine = Engine(pipe, total=1000).start()
    await engine.wait_submitted(40)
    kafka.proxy.cut()
    await engine.wait_submitted(200)
    await asyncio.sleep(0.3)
    kafka.proxy.restore()
    await engine.join()
    report = await pipe.aclose(timeout_s=20)
    sink_report = next(iter(report.sinks.values()))
    dropped = sink_report.dropped.get(DropReason.QUEUE_FULL, 0)
    assert dropped > 0, "a 1 s outage with an 8-batch queue must drop"
    assert set(sink_report.dropped) == {DropReason.QUEUE_FULL}
    assert sink_report.lost_pending_ids == 0
    assert engine.max_depth <= 8  # memory stays bounded
    assert engine.refused == dropped // 5 or engine.refused == 0  # drop_oldest accepts the new
    reader = await TopicReader(kafka.bootstrap, topic, PARTITIONS).start()
    try:
        assert await reader.wait_for(have_all(engine.expected), 20)
    finally:
        await reader.stop()
    ids = stream_ids(decode(reader.records))
    lost_total = 0
    for src, n in engine.expected.items():
        delivered, lost = check_contiguous(ids[src], n, allow_duplicates=True)
        assert delivered + lost == n
        lost_total += lost
    assert lost_total == dropped


async def test_close_with_the_broker_unreachable_returns_in_time(kafka: KafkaEnv) -> None:
    topic = kafka.topic("dead")
    sink = kafka_sink(kafka, topic)
    cfg = PipelineConfig.load(
        defaults={"linger_s": 0.0, "retry": OUTAGE_RETRY}, shutdown_grace_s=0.5
    )
    pipe = await Pipeline([sink], cfg).start()
    pipe.submit(batches_for(source(), 5, 5)[0])
    assert await pipe.flush(10)
    kafka.proxy.cut()
    for b in batches_for(source(), 50, 5)[1:]:
        pipe.submit(b)
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    report = await pipe.aclose(timeout_s=2.0)
    assert time.monotonic() - t0 < 2.0 + 0.75
    r = next(iter(report.sinks.values()))
    assert r.undelivered_events == 45
    assert r.dropped == {DropReason.SHUTDOWN: 45}
    assert r.events_out == 5

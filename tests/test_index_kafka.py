"""The Kafka source against a real broker (tansu): every schema version and framing, a
malformed message in the middle, resuming from a checkpoint, a consumer group committing only
after snapshots."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest_kafka import KafkaEnv
from index_support import Producer, tokens
from kafka_broker import create_topic
from kvstream.sinks.kafka import KafkaSink, source_key

from kvstream.codec import AvroCodec
from kvstream.events.model import EventBatch
from kvstream.index import IndexConsumer, PrefixIndex, WorkerKey, load_snapshot
from kvstream.index.sources.kafka import KafkaSource

pytestmark = pytest.mark.kafka


def stream(name: str, n: int, algo: str = "v2_sha256_64") -> list[EventBatch]:
    p = Producer(name, algo=algo)
    out = [p.batch(p.created())]
    for i in range(n):
        hs = p.chain(tokens(8, seed=1) + tokens(12, seed=i + 2))
        out.append(p.batch(p.stored(hs)))
        if i % 2:
            out.append(p.batch(p.removed(hs[2:][::-1])))
    return out


def reference(batches: list[EventBatch], **kw: object) -> PrefixIndex:
    idx = PrefixIndex(**kw)  # type: ignore[arg-type]
    for b in batches:
        idx.apply(b)
    return idx


async def publish(env: KafkaEnv, topic: str, batches: list[EventBatch], **kw: object) -> None:
    sink = KafkaSink(env.bootstrap, topic, request_timeout_ms=3000, **kw)  # type: ignore[arg-type]
    try:
        assert (await sink.export(batches)).ok
    finally:
        await sink.shutdown(5)


async def raw_send(env: KafkaEnv, topic: str, key: bytes, value: bytes | None) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        bootstrap_servers=env.bootstrap, acks="all", enable_idempotence=False
    )
    await producer.start()
    try:
        await producer.send_and_wait(topic, value=value, key=key, partition=0)
    finally:
        await producer.stop()


async def consume(source: KafkaSource, index: PrefixIndex) -> int:
    consumer = IndexConsumer(source, index)
    async with source:
        report = await asyncio.wait_for(consumer.run(), 30)
    assert report.ended
    return report.batches


async def test_every_version_and_framing_and_a_malformed_message(kafka: KafkaEnv) -> None:
    topic = kafka.topic("idx-mixed")
    await create_topic(kafka.broker.bootstrap, topic, 1)
    a = stream("a", 4)
    b = stream("b", 4, algo="v1_block_key")
    c = stream("c", 4)
    await publish(kafka, topic, a[:3])
    await raw_send(kafka, topic, source_key(a[0].source), b"\xc3\x01not avro at all")
    await raw_send(kafka, topic, source_key(a[0].source), None)
    await publish(kafka, topic, a[3:])
    await publish(kafka, topic, b, codec=AvroCodec(1))  # schema v1 (TensorRT-LLM V1 shape)
    await publish(kafka, topic, c, schema_registry_id=7)  # Confluent framing
    idx = PrefixIndex(default_tokens_per_block=4)
    source = KafkaSource(kafka.bootstrap, topic, partitions=[0], stop_at_end=True)
    n = await consume(source, idx)
    assert n == len(a) + len(b) + len(c)
    assert source.stats.malformed == 2
    wheres = [m.where for m in source.recent_malformed]
    assert wheres == [f"{topic}[0]@3", f"{topic}[0]@4"]
    assert source.stats.skipped_events == 1  # b's v1 created event
    want = reference(a + b + c, default_tokens_per_block=4)
    probe = tokens(8, seed=1) + tokens(12, seed=2)
    assert idx.match(probe).as_list() == want.match(probe).as_list()
    for w in ("a", "b", "c"):
        assert not idx.info(WorkerKey(w)).stale, w
    assert source.checkpoint() == {"kind": "kafka", "topic": topic, "offsets": {"0": n + 2}}


async def test_resume_from_a_checkpoint(kafka: KafkaEnv) -> None:
    topic = kafka.topic("idx-resume")
    await create_topic(kafka.broker.bootstrap, topic, 3)
    batches = [b for name in ("x", "y", "z") for b in stream(name, 5)]
    await publish(kafka, topic, batches)
    first = PrefixIndex()
    source = KafkaSource(kafka.bootstrap, topic, stop_at_end=True)
    async with source:
        consumer = IndexConsumer(source, first)
        await consumer.run(max_batches=7)
    ckpt = source.checkpoint()
    assert sum(ckpt["offsets"].values()) == 7
    second = KafkaSource(kafka.bootstrap, topic, stop_at_end=True, resume_from=ckpt)
    n = await consume(second, first)
    assert n == len(batches) - 7
    assert first.canonical_state() == reference(batches).canonical_state()


@pytest.mark.slow
async def test_consumer_group_commits_only_after_a_snapshot(
    kafka: KafkaEnv, tmp_path: Path
) -> None:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    topic = kafka.topic("idx-group")
    await create_topic(kafka.broker.bootstrap, topic, 1)
    batches = stream("g", 6)
    await publish(kafka, topic, batches)
    group = f"{topic}-indexer"
    snap = tmp_path / "idx.snap"

    async def committed() -> int | None:
        c = AIOKafkaConsumer(
            bootstrap_servers=kafka.bootstrap, group_id=group, enable_auto_commit=False
        )
        await c.start()
        try:
            return await c.committed(TopicPartition(topic, 0))  # type: ignore[no-any-return]
        finally:
            await c.stop()

    source = KafkaSource(kafka.bootstrap, topic, group_id=group, stop_at_end=True)
    consumer = IndexConsumer(source)  # no snapshot path: run() never snapshots
    async with source:
        await asyncio.wait_for(consumer.run(max_batches=4), 30)
        assert await committed() is None  # nothing committed before a snapshot
        await consumer.snapshot(snap)
        assert await committed() == 4
        assert load_snapshot(snap).positions == source.checkpoint()


async def test_stop_at_end_reads_past_a_short_listed_end(kafka: KafkaEnv) -> None:
    """tansu lists a partition's end as its last record batch's base offset + 1; a source
    resumed inside that batch must still read it to the end (the fetch's high watermark)."""
    topic = kafka.topic("idx-short-end")
    await create_topic(kafka.broker.bootstrap, topic, 1)
    batches = stream("e", 6)
    await publish(kafka, topic, batches)  # one send: one record batch
    ckpt = {"kind": "kafka", "topic": topic, "offsets": {"0": 3}}
    idx = reference(batches[:3])
    source = KafkaSource(kafka.bootstrap, topic, stop_at_end=True, resume_from=ckpt)
    assert await consume(source, idx) == len(batches) - 3
    assert idx.canonical_state() == reference(batches).canonical_state()

"""``kvstream events dump kafka://...`` (a topic as JSON Lines) and the Kafka source's
``lag()`` (what the bridge's /metrics exports), against a real broker (tansu)."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest_kafka import KafkaEnv
from index_support import Producer, tokens
from kafka_broker import create_topic
from kvstream.sinks.kafka import KafkaSink
from typer.testing import CliRunner

from kvstream.cli.main import app
from kvstream.events.model import EventBatch
from kvstream.index.sources.kafka import KafkaSource

pytestmark = pytest.mark.kafka


def batches(n: int) -> list[EventBatch]:
    p = Producer("w-dump", algo="v2_sha256_64")
    out = [p.batch(p.created())]
    for i in range(n):
        out.append(p.batch(p.stored(p.chain(tokens(8, seed=1) + tokens(8, seed=i + 2)))))
    return out


async def publish(env: KafkaEnv, topic: str, items: list[EventBatch]) -> None:
    await create_topic(env.broker.bootstrap, topic, 1)
    sink = KafkaSink(env.bootstrap, topic, request_timeout_ms=5000)
    try:
        assert (await sink.export(items)).ok
    finally:
        await sink.shutdown(5)


def test_dump_prints_a_topic_as_json_lines(kafka: KafkaEnv) -> None:
    topic = kafka.topic("dump")
    sent = batches(6)
    asyncio.run(publish(kafka, topic, sent))
    res = CliRunner().invoke(app, ["events", "dump", f"kafka://{kafka.bootstrap}/{topic}"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    want = [ev for b in sent for ev in b.events]
    assert [d["event_id"] for d in lines] == [ev.event_id for ev in want]
    assert [d["data"]["type"] for d in lines] == [ev.data.type for ev in want]
    assert {d["source"]["instance_id"] for d in lines} == {"w-dump"}


def test_lag_counts_the_records_not_yet_read(kafka: KafkaEnv) -> None:
    topic = kafka.topic("lag")
    sent = batches(9)  # 10 records

    async def run() -> tuple[dict[int, int], dict[int, int]]:
        await publish(kafka, topic, sent)
        source = KafkaSource(kafka.bootstrap, topic, partitions=[0], stop_at_end=True)
        async with source:
            for _ in range(4):
                assert await asyncio.wait_for(source.read(), 30) is not None
            part = source.lag()
            while await asyncio.wait_for(source.read(), 30) is not None:
                pass
            return part, source.lag()

    part, done = asyncio.run(run())
    assert part == {0: len(sent) - 4}
    assert done == {0: 0}

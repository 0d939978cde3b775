"""One contract, every sink: memory, file (Avro and JSON Lines) and Kafka (a real broker).

What the pipeline relies on (kvstream.sink.Sink): exported batches come back equal and in
order per source; empty exports succeed; re-exporting is allowed (at-least-once); flush and
shutdown are idempotent and bounded; exporting after shutdown fails permanently.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest_kafka import KafkaEnv
from kafka_broker import consume
from kvstream.sinks.file import FileSink, read_dir
from kvstream.sinks.kafka import KafkaSink
from kvstream.sinks.memory import MemorySink
from pipeline_helpers import batches_for, source

from kvstream.codec import AvroCodec
from kvstream.events.model import EventBatch
from kvstream.sink import ExportStatus, Sink


@dataclass
class Case:
    sink: Sink
    read_back: Callable[[int], Awaitable[list[EventBatch]]]  # expected batch count -> batches


def _memory(_: pytest.FixtureRequest, tmp: Path) -> Case:
    sink = MemorySink()

    async def read(n: int) -> list[EventBatch]:
        return sink.batches

    return Case(sink, read)


def _file(fmt: str) -> Callable[[pytest.FixtureRequest, Path], Case]:
    def make(_: pytest.FixtureRequest, tmp: Path) -> Case:
        sink = FileSink(tmp / "out", format=fmt, rotate_bytes=4096)  # type: ignore[arg-type]

        async def read(n: int) -> list[EventBatch]:
            return list(read_dir(tmp / "out", tolerate_torn_tail=False))

        return Case(sink, read)

    return make


def _kafka(request: pytest.FixtureRequest, tmp: Path) -> Case:
    env: KafkaEnv = request.getfixturevalue("kafka")
    topic = env.topic("contract")
    sink = KafkaSink(env.bootstrap, topic, create_topic=True, partitions=3)
    codec = AvroCodec()

    async def read(n: int) -> list[EventBatch]:
        records = await consume(
            env.bootstrap, topic, partitions=3, done=lambda r: len(r) >= n, timeout_s=20
        )
        return [codec.decode(r.value) for r in records]

    return Case(sink, read)


CASES = {
    "memory": _memory,
    "file-avro": _file("avro"),
    "file-jsonl": _file("jsonl"),
    "kafka": pytest.param(_kafka, marks=pytest.mark.kafka),
}


@pytest.fixture(params=list(CASES.values()), ids=list(CASES))
async def case(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Case]:
    c = request.param(request, tmp_path)
    await c.sink.start()
    yield c
    await c.sink.shutdown(5)


def per_source(batches: list[EventBatch]) -> dict[object, list[EventBatch]]:
    out: dict[object, list[EventBatch]] = {}
    for b in batches:
        out.setdefault(b.source, []).append(b)
    return out


async def test_exported_batches_come_back_equal_and_in_order(case: Case) -> None:
    sources = [source(f"c{i}", rank=i % 2) for i in range(4)]
    sent = [b for s in sources for b in batches_for(s, 60, 6, stored=True)]
    # interleave sources, export in a few calls
    sent.sort(key=lambda b: (b.events[0].event_id, b.source.instance_id))
    for i in range(0, len(sent), 13):
        result = await case.sink.export(sent[i : i + 13])
        assert result.ok, result.reason
    assert await case.sink.force_flush(5)
    got = await case.read_back(len(sent))
    assert len(got) == len(sent)
    assert per_source(got) == per_source(sent)


async def test_empty_export_and_reexport(case: Case) -> None:
    assert (await case.sink.export([])).ok
    batch = batches_for(source(), 3, 3)
    assert (await case.sink.export(batch)).ok
    assert (await case.sink.export(batch)).ok  # a retry after success: a duplicate, not an error
    got = await case.read_back(2)
    assert got == batch * 2


async def test_start_flush_and_shutdown_are_idempotent(case: Case) -> None:
    await case.sink.start()
    assert await case.sink.force_flush(5)
    assert await case.sink.force_flush(5)
    await case.sink.shutdown(5)
    await case.sink.shutdown(5)
    result = await case.sink.export(batches_for(source(), 1, 1))
    assert result.status is ExportStatus.PERMANENT


async def test_abandon_after_a_delivered_export_reports_nothing_in_flight(case: Case) -> None:
    """After a successful export nothing is held: abandoning it is a synchronous no-op that
    says nothing is in doubt, and the sink keeps working."""
    batch = batches_for(source(), 4, 2)
    assert (await case.sink.export(batch)).ok
    outcome = case.sink.abandon()
    assert list(outcome.in_doubt) == []
    assert (await case.sink.export(batches_for(source(), 2, 2))).ok

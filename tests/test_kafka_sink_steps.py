"""The Kafka sink's stepped exports: a large export is encoded in steps, each step's encoding
overlapping the previous steps' sends, against a real broker (tansu behind the fault proxy).

What must hold whatever the steps: every batch arrives, each source's events in order; an
export cancelled mid-way (some steps sent, one being encoded) and retried with the same
batches resumes the chunk (nothing left out, no batch encoded twice).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest_kafka import KafkaEnv
from kafka_broker import create_topic
from kvstream.sinks.kafka import _ENCODE_STEP, KafkaSink
from pipeline_helpers import batches_for, source
from test_kafka_faults import PARTITIONS, read_all, sink_for

from kvstream.events.model import EventBatch, SourceId

pytestmark = pytest.mark.kafka


def _stream(n_sources: int, per_source: int) -> tuple[list[SourceId], list[EventBatch]]:
    srcs = [source(f"steps-{i}", rank=i) for i in range(n_sources)]
    streams = [batches_for(s, per_source, 1) for s in srcs]
    interleaved = [bs[i] for i in range(per_source) for bs in streams]
    return srcs, interleaved


def _ids_by_source(batches: list[EventBatch]) -> dict[SourceId, list[int]]:
    out: dict[SourceId, list[int]] = {}
    for b in batches:
        out.setdefault(b.source, []).extend(ev.event_id for ev in b.events)
    return out


class _Steps:
    """Counts the sink's encode steps (white-box: that the stepped path ran)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ends: list[int] = []
        step = KafkaSink._encode_step

        async def counting(sink: KafkaSink, chunk: Any, end: int) -> None:
            await step(sink, chunk, end)
            self.ends.append(chunk.encoded)

        monkeypatch.setattr(KafkaSink, "_encode_step", counting)


async def test_a_large_export_arrives_whole_and_in_order(
    kafka: KafkaEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = _Steps(monkeypatch)
    topic = kafka.topic("steps")
    await create_topic(f"127.0.0.1:{kafka.broker.port}", topic, PARTITIONS)
    srcs, batches = _stream(3, 250)  # 750 batches: several steps
    sink = sink_for(kafka, topic)
    try:
        assert (await sink.export(batches)).ok
    finally:
        await sink.shutdown(10)
    assert len(steps.ends) >= 3
    assert steps.ends[-1] == len(batches)
    assert steps.ends[0] == _ENCODE_STEP
    got = _ids_by_source(await read_all(kafka, topic))
    assert got == {s: list(range(250)) for s in srcs}


async def test_a_cancelled_stepped_export_resumes_on_retry(
    kafka: KafkaEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = _Steps(monkeypatch)
    topic = kafka.topic("steps-retry")
    await create_topic(f"127.0.0.1:{kafka.broker.port}", topic, PARTITIONS)
    srcs, batches = _stream(2, 400)
    sink = sink_for(kafka, topic)
    try:
        export = asyncio.ensure_future(sink.export(batches))
        while not steps.ends:  # the first step is encoded; its sends are under way
            await asyncio.sleep(0.001)
        kafka.proxy.stall()
        await asyncio.sleep(0.3)
        export.cancel()
        with pytest.raises(asyncio.CancelledError):
            await export
        chunk = sink._pending
        assert chunk is not None
        assert chunk.encoded < len(batches)  # cancelled before the whole export was encoded
        kafka.proxy.restore()
        assert (await sink.export(batches)).ok  # the same batches: the chunk resumes
        assert sink._pending is None
    finally:
        kafka.heal()
        await sink.shutdown(10)
    assert steps.ends[-1] == len(batches)
    got = _ids_by_source(await read_all(kafka, topic))
    assert set(got) == set(srcs)
    for ids in got.values():  # at least once (a send in flight at the cut may repeat), in order
        assert sorted(set(ids)) == list(range(400))
        first = list(dict.fromkeys(ids))
        assert first == sorted(first)

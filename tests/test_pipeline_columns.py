"""Column batches (an engine bridge's ``ColumnBatch``) through the pipeline: a sink that
encodes columns (``accepts_columns``: Kafka) gets them as they are, every other sink gets the
validated model; dropped column batches are accounted for exactly (lost markers) without ever
building their model; their metadata equals their model's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from conftest_kafka import KafkaEnv
from hypothesis import HealthCheck, given, settings
from kafka_broker import TopicReader
from kvstream.sinks.kafka import KafkaSink
from kvstream.sinks.memory import MemorySink
from pipeline_helpers import batches_for, check_contiguous, source, stream_ids
from test_codec_strategies import batches

from kvstream.codec import AvroCodec
from kvstream.events.columns import ColumnBatch, publish_columns
from kvstream.events.model import EventBatch, Lost
from kvstream.pipeline import DropReason, Pipeline, PipelineConfig
from kvstream.pipeline.lost import batch_first_id, batch_last_id, batch_len, batch_spans
from kvstream.sink import ExportResult


def config(**defaults: object) -> PipelineConfig:
    base: dict[str, object] = {"linger_s": 0.0}
    base.update(defaults)
    return PipelineConfig.load(defaults=base, close_timeout_s=5.0)


def columns(batch: EventBatch) -> ColumnBatch:
    cols = publish_columns(batch)
    cols._batch = None  # the columns alone, as a bridge hands them over
    return cols


class ColumnSink(MemorySink):
    """A memory sink that takes columns (records what it was handed)."""

    accepts_columns = True

    def __init__(self) -> None:
        super().__init__()
        self.handed: list[Any] = []

    async def export(self, batches: Sequence[Any]) -> ExportResult:
        self.handed.extend(batches)
        return await super().export(
            [b.to_batch() if isinstance(b, ColumnBatch) else b for b in batches]
        )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches())
def test_column_metadata_equals_the_model_s(batch: EventBatch) -> None:
    cols = columns(batch)
    assert cols.source == batch.source
    assert batch_len(cols) == batch_len(batch)
    assert batch_first_id(cols) == batch_first_id(batch)
    if batch.events:
        assert batch_last_id(cols) == batch_last_id(batch)
    assert list(batch_spans(cols)) == list(batch_spans(batch))
    assert not cols.materialized
    assert cols.materialize() == batch


async def test_columns_reach_a_column_sink_as_columns_and_others_as_models() -> None:
    plain, col_sink = MemorySink(), ColumnSink()
    src = source()
    stream = [columns(b) for b in batches_for(src, 60, 6)]
    async with Pipeline([plain, col_sink], config()) as pipe:
        for c in stream:
            assert await pipe.put(c)
        assert await pipe.flush(5)
    assert all(type(b) is ColumnBatch for b in col_sink.handed)
    assert [type(b) for b in plain.batches] == [EventBatch] * len(stream)
    assert plain.batches == [c.to_batch() for c in stream]
    assert col_sink.batches == plain.batches


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
async def test_dropped_column_batches_are_marked_exactly_and_never_built(policy: str) -> None:
    sink = MemorySink()
    src = source()
    stream = [columns(b) for b in batches_for(src, 500, 5)]
    cfg = config(overflow=policy, max_queue_batches=10, max_export_batches=4)
    async with Pipeline([sink], cfg) as pipe:
        sink.pause()
        for c in stream:
            pipe.submit(c)
        sink.resume()
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    delivered, lost = check_contiguous(stream_ids(sink.batches)[src], 500)
    assert lost == report.dropped[DropReason.QUEUE_FULL] > 0
    assert delivered == sum(c.num_events for c in stream if c.materialized)
    assert report.lost_pending_ids == 0
    markers = [ev.data for _, ev in sink.events() if isinstance(ev.data, Lost)]
    assert sum(m.count for m in markers) == lost


@pytest.mark.kafka
async def test_columns_through_kafka_are_the_model_s_bytes(kafka: KafkaEnv) -> None:
    topic = kafka.topic("columns")
    sink = KafkaSink(kafka.bootstrap, topic, create_topic=True)
    src = source()
    models = batches_for(src, 40, 4)
    async with Pipeline([sink], config()) as pipe:
        for b in models:
            assert await pipe.put(columns(b))
        assert await pipe.flush(10)
    reader = await TopicReader(kafka.bootstrap, topic, 1).start()
    try:
        assert await reader.wait_for(lambda r: len(r) >= len(models), 20)
    finally:
        await reader.stop()
    values = [r.value for r in sorted(reader.records, key=lambda r: r.offset)]
    codec = AvroCodec()
    assert values == [codec.encode(b) for b in models]
    assert [codec.decode(v) for v in values] == models

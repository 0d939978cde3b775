"""Pipeline -> Kafka against raw producers sending the same bytes, every id read back.

The stream is a fleet's (``_pipeline_common.fleet_batches``: 64 metadata-only cache managers,
8k-token prompts prefilled in chunks, decode, LRU evictions; with the defaults ~2,560
batches, ~31.6k events, ~1.1M blocks, ~32 MiB), fresh for every round (seed = round). Rows,
each on a fresh topic of the same tansu broker (started here on a free loopback port,
stopped by PID), same partitions, ``acks=all``:

* ``pipeline``: what a user writes: ``Pipeline([KafkaSink(bootstrap, topic)])`` with the
  default policy (queue sized to hold the stream: nothing may be dropped), the model
  batches ``submit()``-ted from an engine thread; timed from the first submit until
  ``flush()`` returns (every ack in). Encoding is part of it: its batches are fresh models,
  never encoded before: ``--models flush`` (default) what the managers' ``flush_events()``
  returns (a second run of the same fleet; blocks are views of their chain's bytes),
  ``--models deferred`` their ``flush_events_deferred()`` batches themselves (the cache
  manager's hand-off: the pipeline gives them to the Kafka sink as columns, no model built),
  ``--models deferred-models`` the models those batches materialise into.
* ``aiokafka send()``, ``aiokafka send_batch``: the sink's messages (key, value, headers,
  partition), encoded before the timer, through ``AIOKafkaProducer.send`` per message and
  through ``create_batch``/``send_batch`` per partition (builders of ``max_batch_bytes``);
  timed until every future is done. The pipeline's ratio is against the better of the two.
* ``confluent-kafka``: the same messages through ``confluent_kafka.Producer.produce`` +
  ``flush`` (reference; skipped when confluent-kafka is not installed).

The rows run in a rotated order each round. After each row the topic is read back from the
start (an assigned consumer) and every message's (source, event ids) are checked against
the stream: a row that lost or changed anything fails the benchmark. Printed: per row the
median events/s and the pipeline / row ratio per round (median, min-max).

Goal (issue 23): pipeline >= 0.8x the better raw aiokafka row.

Usage: python benchmarks/bench_pipeline_kafka.py [--rounds 5] [--workers 64]
       [--batches-per-worker 40] [--partitions 4] [--compression none|gzip|lz4|zstd]
       [--models flush|deferred|deferred-models]
       [--bootstrap HOST:PORT (an existing broker instead of tansu)]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from _pipeline_common import ROOT, count_events, fleet_batches, fresh_models, table

sys.path.insert(0, str(ROOT / "tests"))

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from kafka_broker import KafkaBroker, create_topic  # the test suite's tansu runner
from kvstream.sinks.kafka import HEADER_HASH_ALGO, KafkaSink, partition_for, source_key

from kvstream.codec import AvroCodec
from kvstream.codec.columnar import decode_columns_message
from kvstream.events.deferred import DeferredBatch
from kvstream.events.model import EventBatch
from kvstream.pipeline import Pipeline, PipelineConfig

try:
    import confluent_kafka
except ImportError:  # the reference row is skipped
    confluent_kafka = None

#: the sink's default builder size, used by the raw rows too
MAX_BATCH_BYTES = 1024 * 1024

Msg = tuple[bytes, bytes, list[tuple[str, bytes]], int, int]  # key, value, headers, ts, part


class Lost(RuntimeError):
    """A row's topic did not hold exactly the stream's events."""


def messages(batches: list[EventBatch], partitions: int) -> list[Msg]:
    """The messages the Kafka sink makes of ``batches`` (same bytes, headers, partition)."""
    sink = KafkaSink("unused:1", "unused")
    codec = AvroCodec()
    out: list[Msg] = []
    for b in batches:
        key = source_key(b.source)
        algos = sorted({ev.hash_algo for ev in b.events})
        headers = [*sink._base_headers, (HEADER_HASH_ALGO, ",".join(algos).encode())]
        value = codec.encode(b)
        out.append((key, value, headers, b.ts_ns // 1_000_000, partition_for(key, partitions)))
    return out


def expected_ids(batches: list[EventBatch]) -> dict[bytes, list[int]]:
    ids: dict[bytes, list[int]] = defaultdict(list)
    for b in batches:
        ids[source_key(b.source)].extend(ev.event_id for ev in b.events)
    return ids


async def pipeline_row(
    bootstrap: str,
    topic: str,
    batches: list[EventBatch] | list[DeferredBatch],
    n_ev: int,
    producer_options: dict[str, Any],
) -> float:
    sink = KafkaSink(bootstrap, topic, producer_options=producer_options)
    cfg = PipelineConfig.load(
        defaults={"max_queue_batches": len(batches) + 1, "max_queue_events": n_ev + 1}
    )
    pipe = Pipeline([sink], cfg)
    async with pipe:
        await sink.start()  # connected before the timer, as the raw producers are

        def engine() -> None:
            for b in batches:
                pipe.submit(b)

        t0 = time.perf_counter()
        await asyncio.to_thread(engine)
        if not await pipe.flush(300):
            raise Lost("the pipeline did not flush within 300 s")
        dt = time.perf_counter() - t0
    stats = pipe.stats()[sink.name]
    if stats.events_out != n_ev:
        raise Lost(f"the pipeline delivered {stats.events_out} of {n_ev} events")
    return dt


def _producer(bootstrap: str, options: dict[str, Any]) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=False,
        max_batch_size=MAX_BATCH_BYTES,
        max_request_size=MAX_BATCH_BYTES,
        **options,
    )


async def send_row(bootstrap: str, topic: str, msgs: list[Msg], options: dict[str, Any]) -> float:
    producer = _producer(bootstrap, options)
    await producer.start()
    try:
        t0 = time.perf_counter()
        send = producer.send
        futs = [
            await send(topic, value=v, key=k, headers=h, timestamp_ms=ts, partition=p)
            for k, v, h, ts, p in msgs
        ]
        await asyncio.gather(*futs)
        return time.perf_counter() - t0
    finally:
        await producer.stop()


async def send_batch_row(
    bootstrap: str, topic: str, msgs: list[Msg], options: dict[str, Any]
) -> float:
    by_part: dict[int, list[Msg]] = defaultdict(list)
    for m in msgs:
        by_part[m[4]].append(m)
    producer = _producer(bootstrap, options)
    await producer.start()
    try:

        async def one_partition(p: int, items: list[Msg]) -> list[Any]:
            futs = []
            builder = producer.create_batch()
            for key, value, headers, ts, _ in items:
                if builder.append(key=key, value=value, timestamp=ts, headers=headers) is None:
                    futs.append(await producer.send_batch(builder, topic, partition=p))
                    builder = producer.create_batch()
                    builder.append(key=key, value=value, timestamp=ts, headers=headers)
            futs.append(await producer.send_batch(builder, topic, partition=p))
            return futs

        t0 = time.perf_counter()
        groups = await asyncio.gather(*(one_partition(p, m) for p, m in by_part.items()))
        await asyncio.gather(*(f for g in groups for f in g))
        return time.perf_counter() - t0
    finally:
        await producer.stop()


async def confluent_row(
    bootstrap: str, topic: str, msgs: list[Msg], options: dict[str, Any]
) -> float:
    assert confluent_kafka is not None
    conf = {
        "bootstrap.servers": bootstrap,
        "acks": "all",
        "enable.idempotence": False,
        "message.max.bytes": MAX_BATCH_BYTES + 4096,
        "batch.size": MAX_BATCH_BYTES,
        "compression.type": options.get("compression_type") or "none",
    }
    errors: list[Any] = []

    def run() -> float:
        producer = confluent_kafka.Producer(conf)
        producer.list_topics(topic, timeout=10)  # connected before the timer

        def acked(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(err)

        t0 = time.perf_counter()
        produce = producer.produce
        for k, v, h, ts, p in msgs:
            while True:
                try:
                    produce(topic, v, k, partition=p, on_delivery=acked, timestamp=ts, headers=h)
                    break
                except BufferError:  # its queue is full: serve callbacks, then retry
                    producer.poll(0.01)
        left = producer.flush(300)
        dt = time.perf_counter() - t0
        if left or errors:
            raise Lost(f"confluent-kafka: {left} messages unsent, errors {errors[:3]}")
        return dt

    return await asyncio.to_thread(run)


async def read_back(
    bootstrap: str, topic: str, partitions: int, want: dict[bytes, list[int]]
) -> None:
    """Read ``topic`` from the start; raise Lost unless every source's ids are there, once,
    in order."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        registry = AvroCodec().registry
        got: dict[bytes, list[int]] = defaultdict(list)
        deadline = time.monotonic() + 120
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            if time.monotonic() > deadline:
                raise Lost(f"reading {topic} back timed out")
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    cols = decode_columns_message(r.value, registry).columns
                    got[r.key].extend(cols.event_ids)
    finally:
        await consumer.stop()
    if got != want:
        missing = sum(len(set(v) - set(got.get(k, ()))) for k, v in want.items())
        extra = sum(len(v) for v in got.values()) - sum(len(v) for v in want.values())
        raise Lost(f"{topic}: {missing} ids missing, {extra:+d} ids beyond the stream")


Row = Callable[[str, str, list[Msg], dict[str, Any]], Awaitable[float]]
RAW_ROWS: dict[str, Row] = {
    "aiokafka send()": send_row,
    "aiokafka send_batch": send_batch_row,
    "confluent-kafka": confluent_row,
}


async def run(args: argparse.Namespace, bootstrap: str) -> int:
    options: dict[str, Any] = {}
    if args.compression != "none":
        options["compression_type"] = args.compression
    names = ["pipeline", "aiokafka send()", "aiokafka send_batch"]
    if confluent_kafka is not None:
        names.append("confluent-kafka")
    times: dict[str, list[float]] = defaultdict(list)
    shape = ""
    for r in range(args.rounds):
        size = {"workers": args.workers, "batches_per_worker": args.batches_per_worker, "seed": r}
        if args.models == "flush":  # two runs of the same fleet: two sets of new models
            for_raw = fleet_batches(**size, deferred=False)
            for_pipe = fleet_batches(**size, deferred=False)
        else:
            deferred = fleet_batches(**size)
            for_raw = fresh_models(deferred)
            # deferred: the hand-off as the managers made it; else models never encoded before
            for_pipe = deferred if args.models == "deferred" else fresh_models(deferred)
            del deferred
        msgs = messages(for_raw, args.partitions)
        want = expected_ids(for_raw)
        n_ev = count_events(for_raw)
        # the raw rows' models are not kept: a process that publishes does not hold a second
        # copy of its stream as models, whose objects would weigh on every full GC pass of
        # the rows (the pipeline's allocations trigger such passes; the raw rows' do not)
        del for_raw
        gc.collect()
        mib = sum(len(m[1]) for m in msgs) / 2**20
        shape = f"{len(msgs)} batches, {n_ev} events, {mib:.1f} MiB (round 0's)" if not r else shape
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            topic = f"bench-{r}-{names.index(name)}"
            await create_topic(bootstrap, topic, args.partitions)
            if name == "pipeline":
                dt = await pipeline_row(bootstrap, topic, for_pipe, n_ev, options)
            else:
                dt = await RAW_ROWS[name](bootstrap, topic, msgs, options)
            await read_back(bootstrap, topic, args.partitions, want)
            times[name].append(n_ev / dt)
            print(f"round {r}: {name:<20} {n_ev / dt / 1e3:7.1f}k events/s", flush=True)
        del for_pipe, msgs
    print(
        f"\n{shape}; {args.workers} workers, {args.partitions} partitions, acks=all, "
        f"compression {args.compression}, {args.models} models, {args.rounds} rounds; "
        "every id read back"
    )
    pipe = times["pipeline"]
    best_raw = [
        max(a, b)
        for a, b in zip(times["aiokafka send()"], times["aiokafka send_batch"], strict=True)
    ]
    out = []
    for name in names:
        ratios = [p / x for p, x in zip(pipe, times[name], strict=True)]
        out.append(
            [
                name,
                f"{statistics.median(times[name]) / 1e3:.1f}k",
                f"{statistics.median(ratios):.2f}x",
                f"{min(ratios):.2f}-{max(ratios):.2f}",
            ]
        )
    print(table(out, ["row", "events/s (median)", "pipeline / row", "spread"]))
    ratios = [p / x for p, x in zip(pipe, best_raw, strict=True)]
    print(
        f"\npipeline / the better raw aiokafka row: {statistics.median(ratios):.2f}x "
        f"(rounds {min(ratios):.2f}-{max(ratios):.2f}; goal >= 0.8x)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--batches-per-worker", type=int, default=40)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--compression", default="none", choices=["none", "gzip", "lz4", "zstd"])
    ap.add_argument(
        "--models",
        default="flush",
        choices=["flush", "deferred", "deferred-models"],
        help="the pipeline's batches: flush_events() models (default), the "
        "flush_events_deferred() batches themselves, or the models they materialise into",
    )
    ap.add_argument("--bootstrap", default=None, help="use this broker instead of starting tansu")
    args = ap.parse_args(argv)
    if args.bootstrap:
        return asyncio.run(run(args, args.bootstrap))
    with KafkaBroker() as broker:
        return asyncio.run(run(args, broker.bootstrap))


if __name__ == "__main__":
    sys.exit(main())

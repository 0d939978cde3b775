"""Kafka under faults, against a real broker: deadlines, shutdown, exact loss accounting.

* Deadlines are promises: ``Pipeline.aclose(timeout_s)`` and ``KafkaSink.shutdown(timeout_s)``
  return within the budget + 0.5 s whatever the broker does (frozen with SIGSTOP, or a proxy
  that stops forwarding), and ``shutdown`` is safe to cancel.
* ``shutdown`` never raises (aiokafka's ``reenqueue`` KeyError), the report names the broker
  error.
* Markers equal exactly the missing ids: a chunk given up is never delivered afterwards, and
  a send whose fate is unknown is read back before it is declared lost.
* A seeded schedule of broker kills (-9, durable storage), freezes and outages while a
  pipeline streams: after each, ids are contiguous per source once markers count, markers
  are exactly what is missing, duplicates are counted. ``KVSTREAM_FAULT_SEEDS=N`` runs N
  seeds instead of the default few, ``KVSTREAM_FAULT_SEED=12`` one seed and
  ``KVSTREAM_FAULT_STEPS=10`` more faults per seed.
* The broker's side is checked too: an :class:`AckLedger` records every offset the broker
  acknowledged (``acks=all``) and the reader records which offsets below the high-water mark
  it could not read (holes). A hole the broker acknowledged would be a loss *by the broker*
  and is reported as such; every other id must be delivered, marked or pending. See
  docs/pipeline.md, "Holes after kill -9", for what tansu on S3 does.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest_kafka import KafkaEnv
from kafka_broker import create_topic
from kvstream.sinks.kafka import KafkaSink
from pipeline_helpers import batches_for, source

from kvstream.codec import AvroCodec
from kvstream.events.model import EventBatch, Lost, SourceId
from kvstream.pipeline import DropReason, Pipeline, PipelineConfig
from kvstream.sink import ExportResult

pytestmark = pytest.mark.kafka

CODEC = AvroCodec()
PARTITIONS = 2
SLACK_S = 0.5  # the promise: budget + 0.5 s


# ------------------------------------------------------------------------------ reading


@dataclass
class Accounting:
    """What a consumer saw of one source: data ids (with repeats) and marker ranges."""

    data: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    markers: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def marked(self) -> set[int]:
        return {i for first, last, _ in self.markers for i in range(first, last + 1)}

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in self.data.values())


def account(batches: list[EventBatch]) -> dict[SourceId, Accounting]:
    out: dict[SourceId, Accounting] = defaultdict(Accounting)
    for b in batches:
        acc = out[b.source]
        for ev in b.events:
            if isinstance(ev.data, Lost):
                acc.markers.append(
                    (
                        ev.data.first_event_id,
                        ev.data.first_event_id + ev.data.count - 1,
                        ev.data.reason,
                    )
                )
            else:
                acc.data[ev.event_id] += 1
    return out


@dataclass
class BrokerLog:
    """What a read of a topic found, per partition: every record value by offset, the
    high-water mark, and the offsets the reader gave up on (stuck below the mark)."""

    served: dict[int, dict[int, bytes]] = field(default_factory=lambda: defaultdict(dict))
    high: dict[int, int] = field(default_factory=dict)
    skipped: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))

    def holes(self, partition: int) -> list[int]:
        """Offsets below the high-water mark with no record (a hole mid-log is never
        stuck on: tansu answers a fetch there with the next records)."""
        got = self.served[partition]
        return [o for o in range(self.high.get(partition, 0)) if o not in got]


class AckLedger:
    """Every record the broker acknowledged to any aiokafka producer of the test: the
    record values by (topic, partition, offset). It wraps aiokafka's batch API (the Kafka
    sink's send path), observing the acks without changing what is sent."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from aiokafka import AIOKafkaProducer

        self.acked: dict[tuple[str, int, int], set[bytes]] = defaultdict(set)
        create, send = AIOKafkaProducer.create_batch, AIOKafkaProducer.send_batch
        ledger = self

        def create_batch(producer: Any) -> Any:
            builder = create(producer)
            values: list[bytes] = []
            append = builder.append

            def recording_append(**kw: Any) -> Any:
                meta = append(**kw)
                if meta is not None:
                    values.append(kw["value"])
                return meta

            builder.append = recording_append
            builder.kvstream_values = values
            return builder

        async def send_batch(producer: Any, builder: Any, topic: str, *, partition: int) -> Any:
            fut = await send(producer, builder, topic, partition=partition)
            values = builder.kvstream_values

            def acked(f: asyncio.Future[Any]) -> None:
                if not f.cancelled() and f.exception() is None:
                    for i, value in enumerate(values):
                        ledger.acked[(topic, partition, f.result().offset + i)].add(value)

            fut.add_done_callback(acked)
            return fut

        monkeypatch.setattr(AIOKafkaProducer, "create_batch", create_batch)
        monkeypatch.setattr(AIOKafkaProducer, "send_batch", send_batch)

    def offsets(self, topic: str) -> dict[tuple[int, int], set[bytes]]:
        """(partition, offset) -> the values acknowledged there, for ``topic``."""
        return {(p, o): v for (t, p, o), v in self.acked.items() if t == topic}


async def read_all(
    env: KafkaEnv,
    topic: str,
    *,
    quiet_s: float = 1.0,
    log: BrokerLog | None = None,
    acked: set[tuple[int, int]] = frozenset(),  # type: ignore[assignment]
) -> list[EventBatch]:
    """Every record of ``topic``, read until each partition's position reached the fetch
    high-water mark and nothing new came for ``quiet_s``.

    tansu's S3 storage can leave an offset without a record after a kill -9 mid-produce
    (the high-water mark is stored before the records, see docs/pipeline.md), and then
    answers fetches at exactly that offset with nothing: a partition stuck below its
    high-water mark for 3 s skips one offset, unless the broker acknowledged that offset
    (``acked``: (partition, offset)): then it waits 30 s. ``log`` collects what was read
    and what was skipped."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    log = BrokerLog() if log is None else log
    consumer = AIOKafkaConsumer(
        bootstrap_servers=env.bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        request_timeout_ms=5000,
        retry_backoff_ms=50,
        fetch_max_wait_ms=500,  # tansu's S3 storage answers a shorter wait with nothing
    )
    await consumer.start()
    out: list[EventBatch] = []
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        now = time.monotonic()
        quiet_until, deadline = now + quiet_s, now + 90 + 30 * len(acked)
        moved = dict.fromkeys(tps, now)
        while time.monotonic() < deadline:
            got = await consumer.getmany(timeout_ms=100)
            now = time.monotonic()
            for tp, records in got.items():
                for r in records:
                    out.append(CODEC.decode(r.value))
                    log.served[tp.partition][r.offset] = r.value
                moved[tp] = now
            if got:
                quiet_until = now + quiet_s
                continue
            caught_up = True
            for tp in tps:
                hw, pos = consumer.highwater(tp), await consumer.position(tp)
                if hw is not None:
                    log.high[tp.partition] = hw
                if hw is None or pos < hw:
                    caught_up = False
                    patience = 30.0 if (tp.partition, pos) in acked else 3.0
                    if hw is not None and now - moved[tp] > patience:
                        log.skipped[tp.partition].append(pos)
                        consumer.seek(tp, pos + 1)  # a hole left by a kill -9
                        moved[tp] = now
            if caught_up and now >= quiet_until:
                return out
        state = {tp.partition: (await consumer.position(tp), consumer.highwater(tp)) for tp in tps}
        raise AssertionError(f"could not read {topic} to its end: (position, high) {state}")
    finally:
        await consumer.stop()


def broker_losses(ledger: AckLedger, topic: str, log: BrokerLog) -> list[EventBatch]:
    """The batches the broker acknowledged and no longer serves (lost by the broker: with
    ``acks=all`` an acknowledged record must stay). Also checks that the broker never
    acknowledged two different records at one offset."""
    lost = []
    for (partition, offset), values in sorted(ledger.offsets(topic).items()):
        assert len(values) == 1, f"partition {partition} offset {offset} acked twice, differently"
        if offset not in log.served[partition]:
            lost.append(CODEC.decode(next(iter(values))))
    return lost


def check_exact(
    batches: list[EventBatch],
    expected: dict[SourceId, int],
    report: Any,
    broker_lost: list[EventBatch] = (),  # type: ignore[assignment]
) -> tuple[int, int, int]:
    """Per source: ids contiguous once markers count, markers exactly the missing ids (none
    marked that arrived, unless the sink reported sends in doubt); ids neither delivered nor
    marked (leaving out ``broker_lost``: acknowledged, then lost by the broker) are the
    report's ``lost_pending_ids`` (markers that could not go out before close's deadline),
    less the ids in doubt that did arrive. Returns (delivered ids, marked ids, duplicates)."""
    acc = account(batches)
    lost_by_broker = {(b.source, e.event_id) for b in broker_lost for e in b.events}
    sink_report = next(iter(report.sinks.values()))
    in_doubt = sink_report.dropped.get("unknown", 0)
    delivered = marked_total = dups = 0
    missing_total = unmarked_total = 0
    for src, n in expected.items():
        a = acc.get(src, Accounting())
        ids = set(a.data)
        assert ids <= set(range(n)), f"{src}: ids outside 0..{n - 1}"
        marked = a.marked
        missing = set(range(n)) - ids
        unmarked_total += len(missing - marked - {i for s, i in lost_by_broker if s == src})
        both = marked & ids
        assert not both or in_doubt, f"{src}: {len(both)} ids marked lost but delivered"
        delivered += len(ids)
        marked_total += len(marked)
        missing_total += len(missing)
        dups += a.duplicates
    pending = sink_report.lost_pending_ids
    assert pending - in_doubt <= unmarked_total <= pending, (
        f"{unmarked_total} ids neither delivered nor marked nor lost by the broker, the "
        f"report says {pending} ids pending markers ({in_doubt} in doubt): "
        f"{sink_report.as_dict()}"
    )
    undelivered = sink_report.undelivered_events
    assert undelivered - in_doubt <= missing_total <= undelivered, sink_report.as_dict()
    return delivered, marked_total, dups


# ------------------------------------------------------------------------------ helpers


def sink_for(env: KafkaEnv, topic: str, **kw: Any) -> KafkaSink:
    kw.setdefault("request_timeout_ms", 30_000)  # aiokafka's default: the long wait at issue
    return KafkaSink(env.bootstrap, topic, create_topic=True, partitions=PARTITIONS, **kw)


async def delivered_once(pipe: Pipeline, batches: list[EventBatch]) -> None:
    for b in batches:
        assert pipe.submit(b)
    assert await pipe.flush(20)


async def in_flight(sink: KafkaSink, export: asyncio.Future[ExportResult]) -> None:
    """Wait until the sink has a send out to the broker (and a little longer, so it is
    written); white-box, so the deadline tests do not depend on the machine's speed.
    ``export`` is the export expected to hang on the frozen broker: if it ends first, the
    test's premise failed, and its result says why."""
    deadline = time.monotonic() + 10
    while not (sink._pending and any(p.inflight for p in sink._pending.parts)):
        if export.done():
            pytest.fail(f"the export ended before a send went out: {export.result()!r}")
        assert time.monotonic() < deadline, "no send went out"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)


# ------------------------------------------------------------------------------ deadlines


@pytest.mark.parametrize("fault", ["sigstop", "stall"])
async def test_aclose_keeps_its_deadline_with_a_frozen_broker(
    kafka_factory: Callable[..., KafkaEnv], fault: str
) -> None:
    env = kafka_factory()
    topic = env.topic("frozen")
    cfg = PipelineConfig.load(defaults={"linger_s": 0.0, "retry": {"attempt_timeout_s": 60}})
    pipe = await Pipeline([sink_for(env, topic)], cfg).start()
    src = source()
    batches = batches_for(src, 200, 5)
    await delivered_once(pipe, batches[:4])
    env.broker.freeze() if fault == "sigstop" else env.proxy.stall()
    for b in batches[4:]:
        pipe.submit(b)
    await asyncio.sleep(0.3)  # sends are in flight to the frozen broker
    t0 = time.monotonic()
    report = await pipe.aclose(timeout_s=3.0)
    elapsed = time.monotonic() - t0
    env.heal()
    assert elapsed <= 3.0 + SLACK_S, f"aclose(3.0) took {elapsed:.2f}s"
    r = next(iter(report.sinks.values()))
    assert r.events_out == 20
    assert r.undelivered_events == 180
    assert r.shut_down is True  # the sink gave its producer up in time, it did not hang


async def test_shutdown_is_safe_to_cancel(kafka_factory: Callable[..., KafkaEnv]) -> None:
    env = kafka_factory()
    topic = env.topic("cancel")
    sink = sink_for(env, topic)
    assert (await sink.export(batches_for(source(), 5, 5))).ok
    env.broker.freeze()
    export = asyncio.ensure_future(sink.export(batches_for(source(), 50, 5)[1:]))
    await in_flight(sink, export)
    t0 = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(sink.shutdown(timeout_s=10), 1.0)
    elapsed = time.monotonic() - t0
    env.heal()
    assert elapsed <= 1.0 + SLACK_S, f"a cancelled shutdown took {elapsed:.2f}s"
    result = await asyncio.wait_for(export, 2.0)  # the export in flight ends too
    assert not result.ok
    assert not (await sink.export(batches_for(source(), 5, 5))).ok  # shut down: permanent


async def test_shutdown_within_its_budget_with_a_frozen_broker(
    kafka_factory: Callable[..., KafkaEnv],
) -> None:
    env = kafka_factory()
    sink = sink_for(env, env.topic("budget"))
    assert (await sink.export(batches_for(source(), 5, 5))).ok
    env.broker.freeze()
    export = asyncio.ensure_future(sink.export(batches_for(source(), 50, 5)[1:]))
    await in_flight(sink, export)
    t0 = time.monotonic()
    await sink.shutdown(timeout_s=1.5)
    elapsed = time.monotonic() - t0
    env.heal()
    assert elapsed <= 1.5 + SLACK_S, f"shutdown(1.5) took {elapsed:.2f}s"
    assert not (await asyncio.wait_for(export, 2.0)).ok


# ------------------------------------------------------------------------------ shutdown


async def test_shutdown_never_raises_when_the_broker_dies_mid_send(
    kafka_factory: Callable[..., KafkaEnv],
) -> None:
    """The broker is killed with sends in flight; aiokafka retries them; shutdown fails them
    at its deadline. Before: KeyError from message_accumulator.reenqueue."""
    for attempt in range(4):  # the race needs a produce retry in progress at the deadline
        env = kafka_factory()
        topic = env.topic("dies")
        sink = sink_for(env, topic, request_timeout_ms=2000)
        cfg = PipelineConfig.load(
            defaults={"linger_s": 0.0, "retry": {"attempt_timeout_s": 0.5}},
            shutdown_grace_s=1.0,
        )
        pipe = await Pipeline([sink], cfg).start()
        batches = batches_for(source(), 400, 5)
        await delivered_once(pipe, batches[:2])
        for b in batches[2:]:
            pipe.submit(b)
        await asyncio.sleep(0.01 * attempt)
        env.broker.kill()
        await asyncio.sleep(0.3)
        report = await pipe.aclose(timeout_s=1.5)
        r = next(iter(report.sinks.values()))
        assert r.shut_down is True, r.as_dict()
        assert r.undelivered_events + r.events_out == 400
        if r.undelivered_events:
            assert r.last_error is not None
            assert "KeyError" not in r.last_error, r.last_error


async def test_sink_shutdown_never_raises_with_a_retry_in_flight(
    kafka_factory: Callable[..., KafkaEnv],
) -> None:
    """The broker dies under a send: aiokafka's produce task retries it (backoff, then
    re-enqueue) while shutdown's deadline passes. Failing the batches first made that
    re-enqueue raise KeyError out of producer.stop()."""
    for attempt in range(5):
        env = kafka_factory()
        sink = sink_for(env, env.topic("keyerror"), producer_options={"retry_backoff_ms": 300})
        assert (await sink.export(batches_for(source(), 5, 5))).ok
        export = asyncio.ensure_future(sink.export(batches_for(source(), 500, 5)[1:]))
        await asyncio.sleep(0.02 * attempt)
        env.broker.kill()
        await asyncio.sleep(0.15)
        t0 = time.monotonic()
        await sink.shutdown(timeout_s=0.5)  # must not raise
        assert time.monotonic() - t0 <= 0.5 + SLACK_S
        await asyncio.wait_for(export, 2.0)  # the export ends too (delivered or failed)


# ------------------------------------------------------------------------------ accounting


async def _given_up_then_restored(env: KafkaEnv, fault: str) -> Any:
    topic = env.topic(f"giveup-{fault}")
    await create_topic(f"127.0.0.1:{env.broker.port}", topic, PARTITIONS)
    cfg = PipelineConfig.load(
        defaults={
            "linger_s": 0.0,
            "retry": {
                "attempt_timeout_s": 0.5,
                "deadline_s": 1.5,
                "initial_backoff_s": 0.05,
                "max_backoff_s": 0.2,
            },
        }
    )
    sink = sink_for(env, topic, request_timeout_ms=30_000)
    pipe = await Pipeline([sink], cfg).start()
    srcs = [source("give-a"), source("give-b", rank=1)]
    streams = [batches_for(s, 300, 5) for s in srcs]
    await delivered_once(pipe, [bs[0] for bs in streams])
    getattr(env.proxy, fault)()
    for i in range(1, 20):
        for bs in streams:
            pipe.submit(bs[i])
    await asyncio.sleep(2.5)  # longer than the retry deadline: chunks are given up
    env.proxy.restore()
    for i in range(20, 60):
        for bs in streams:
            pipe.submit(bs[i])
    assert await pipe.flush(20)
    report = await pipe.aclose(timeout_s=10)
    r = next(iter(report.sinks.values()))
    assert r.retries > 0, r.as_dict()
    assert r.lost_pending_ids == 0, r.as_dict()
    batches = await read_all(env, topic)
    expected = dict.fromkeys(srcs, 300)
    delivered, marked, _ = check_exact(batches, expected, report)
    assert r.dropped.get("unknown", 0) == 0  # the broker came back: all resolved
    assert marked == r.undelivered_events == 600 - delivered
    return r


async def test_a_chunk_given_up_is_never_delivered_later(kafka: KafkaEnv) -> None:
    """The proxy refuses connections longer than the retry deadline: aiokafka keeps the
    given-up batches queued and sent them once the broker was back (before the fix)."""
    r = await _given_up_then_restored(kafka, "cut")
    assert r.dropped.get(DropReason.RETRY_EXHAUSTED, 0) > 0, r.as_dict()


async def test_a_send_in_doubt_is_read_back_before_it_is_declared_lost(kafka: KafkaEnv) -> None:
    """The proxy forwards requests but no answers: whether a send arrived is unknown until
    the sink reads the partition back."""
    await _given_up_then_restored(kafka, "stall")


async def test_block_loses_nothing_across_a_kill_9_of_a_durable_broker(
    kafka_factory: Callable[..., KafkaEnv],
) -> None:
    """kill -9 mid-stream, restart on the same port and storage: what was acknowledged
    before is still there (no re-created topic, no rewind) and nothing is lost."""
    env = kafka_factory(durable=True)
    topic = env.topic("durable")
    await create_topic(f"127.0.0.1:{env.broker.port}", topic, PARTITIONS)
    cfg = PipelineConfig.load(
        defaults={
            "overflow": "block",
            "max_queue_batches": 16,
            "block_timeout_s": 30.0,
            "linger_s": 0.002,
            "retry": {"attempt_timeout_s": 2.0, "deadline_s": None, "max_backoff_s": 0.3},
        },
        handoff_timeout_s=30.0,
    )
    pipe = await Pipeline([sink_for(env, topic, request_timeout_ms=3000)], cfg).start()
    srcs = [source("durable-a"), source("durable-b", rank=1)]
    streams = [batches_for(s, 1000, 5) for s in srcs]
    for i in range(60):
        for bs in streams:
            assert await pipe.put(bs[i], timeout_s=30)
    assert await pipe.flush(20)
    before = account(await read_all(env, topic))
    env.broker.kill()

    async def restart_later() -> None:
        await asyncio.sleep(1.0)
        await asyncio.to_thread(env.broker.start)  # same port, same storage

    restart = asyncio.ensure_future(restart_later())
    for i in range(60, 200):  # the first ones while the broker is down: put() waits
        for bs in streams:
            assert await pipe.put(bs[i], timeout_s=30)
    await restart
    report = await pipe.aclose(timeout_s=30)
    assert report.ok, report.as_dict()
    after = account(await read_all(env, topic))
    assert env.broker.starts == 2
    for s in srcs:
        assert set(before[s].data) == set(range(300))  # acknowledged before the kill: kept
        assert set(after[s].data) == set(range(1000))
        assert after[s].markers == []


# ---------------------------------------------------------------------- seeded schedule

FAULT_SEEDS = int(os.environ.get("KVSTREAM_FAULT_SEEDS", "0") or 0)
SEEDS = list(range(FAULT_SEEDS)) if FAULT_SEEDS else [0, 2]  # together: all five faults
if os.environ.get("KVSTREAM_FAULT_SEED"):
    SEEDS = [int(os.environ["KVSTREAM_FAULT_SEED"])]
STEPS = int(os.environ.get("KVSTREAM_FAULT_STEPS", "3") or 3)
FAULTS = ("kill", "freeze", "cut", "stall", "reset")


class Feeder:
    """Submits the next batch of every stream in turn, like an engine's iterations."""

    def __init__(self, pipe: Pipeline, streams: list[list[EventBatch]]) -> None:
        self.pipe = pipe
        self.streams = streams
        self.sent = 0

    async def produce(self, n: int) -> None:
        for i in range(self.sent, self.sent + n):
            for batches in self.streams:
                self.pipe.submit(batches[i])
            await asyncio.sleep(0.004)
        self.sent += n


@dataclass
class Outcome:
    fault: str
    delivered: int
    marked: int
    duplicates: int
    undelivered: int
    in_doubt: int
    holes: int = 0  # offsets below the high-water mark without a record (never acknowledged)
    broker_lost: int = 0  # ids the broker acknowledged and then did not serve


async def run_schedule(
    env: KafkaEnv, seed: int, *, steps: int = 3, ledger: AckLedger | None = None
) -> list[Outcome]:
    """``steps`` faults drawn from ``seed``, each hitting a pipeline while it streams two
    sources (a new incarnation per step); after each, the pipeline is closed, the topic read
    to its end and the accounting of that step's sources checked exactly. With ``ledger``
    the broker's acknowledgements are held against what it serves (see :class:`AckLedger`)."""
    rng = random.Random(seed)
    topic = env.topic(f"sched-{seed}")
    await create_topic(f"127.0.0.1:{env.broker.port}", topic, PARTITIONS)
    cfg = PipelineConfig.load(
        defaults={
            "linger_s": 0.002,
            "overflow": "drop_oldest",
            "max_queue_batches": 64,
            "retry": {
                "attempt_timeout_s": 0.5,
                "deadline_s": 1.2,
                "initial_backoff_s": 0.05,
                "max_backoff_s": 0.2,
                "resolve_timeout_s": 5.0,
            },
        }
    )
    outcomes = []
    for step in range(steps):
        fault = rng.choice(FAULTS)
        outage_s = rng.uniform(0.3, 2.5)
        sink = sink_for(env, topic, request_timeout_ms=3000)
        pipe = await Pipeline([sink], cfg, rng=random.Random(seed * 100 + step)).start()
        srcs = [source(f"sched-{seed}-a", incarnation=step), source(f"sched-{seed}-b", 2, step)]
        engine = Feeder(pipe, [batches_for(s, 600, 5) for s in srcs])
        produce = engine.produce
        await produce(rng.randrange(10, 50))
        if fault == "kill":
            env.broker.kill()
        elif fault == "freeze":
            env.broker.freeze()
        elif fault == "reset":
            env.proxy.reset()
        else:
            getattr(env.proxy, fault)()
        await produce(rng.randrange(10, 40))
        await asyncio.sleep(outage_s)
        if fault == "kill":
            env.broker.start()  # same port, same (durable) storage
        env.heal()
        await produce(120 - engine.sent)
        await pipe.flush(15)
        report = await pipe.aclose(timeout_s=15)
        r = next(iter(report.sinks.values()))
        log = BrokerLog()
        acked = set(ledger.offsets(topic)) if ledger is not None else set()
        assert ledger is None or acked, "the ledger saw no acknowledgement (aiokafka changed?)"
        batches = await read_all(env, topic, log=log, acked=acked)
        mine = [b for b in batches if b.source in srcs]
        expected = dict.fromkeys(srcs, engine.sent * 5)
        lost = [b for b in broker_losses(ledger, topic, log) if b.source in srcs] if ledger else []
        delivered, marked, dups = check_exact(mine, expected, report, lost)
        holes = {(p, o) for p in range(PARTITIONS) for o in log.holes(p)}
        assert not holes & acked or lost, "a hole at an acknowledged offset, not counted"
        outcomes.append(
            Outcome(
                f"{fault}:{outage_s:.1f}s",
                delivered,
                marked,
                dups,
                r.undelivered_events,
                r.dropped.get("unknown", 0),
                len(holes),
                sum(len(b.events) for b in lost),
            )
        )
    return outcomes


@pytest.mark.parametrize("seed", SEEDS)
async def test_seeded_fault_schedule(
    kafka_factory: Callable[..., KafkaEnv], monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Every id is delivered, marked lost or reported pending, whatever the faults; and
    the durable broker keeps everything it acknowledged (so far, in every run, holes were
    only ever at offsets it never acknowledged: docs/pipeline.md, "Holes after kill -9")."""
    env = kafka_factory(durable=True)
    for outcome in await run_schedule(env, seed, steps=STEPS, ledger=AckLedger(monkeypatch)):
        print(f"seed {seed}: {outcome}")
        assert outcome.delivered > 0
        assert outcome.broker_lost == 0, outcome

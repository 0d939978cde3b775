"""The fan-out pipeline against the memory sink: ordering, batching, overflow, retries,
lost markers, lifecycle and metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest
from kvstream.sinks.memory import MemorySink
from pipeline_helpers import batches_for, check_contiguous, make_batch, source, stream_ids
from prometheus_client import CollectorRegistry, generate_latest

from kvstream.errors import ConfigError
from kvstream.events.model import EventBatch
from kvstream.pipeline import (
    DropReason,
    Pipeline,
    PipelineClosedError,
    PipelineConfig,
    PipelineNotStartedError,
)
from kvstream.sink import ExportResult


def config(**defaults: object) -> PipelineConfig:
    base: dict[str, object] = {"linger_s": 0.0}
    base.update(defaults)
    return PipelineConfig.load(defaults=base, close_timeout_s=5.0)


class RecordingSink(MemorySink):
    """A memory sink that remembers how many batches each export call carried."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.calls: list[int] = []

    async def export(self, batches: Sequence[EventBatch]) -> ExportResult:
        self.calls.append(len(batches))
        return await super().export(batches)


async def wait_for_events(sink: MemorySink, n: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sink.events_in < n:
        assert time.monotonic() < deadline, f"{sink.name} got {sink.events_in}/{n} events"
        await asyncio.sleep(0.005)


# ----------------------------------------------------------------------------- delivery


async def test_every_sink_gets_every_source_in_order() -> None:
    a, b = MemorySink(name="a"), MemorySink(name="b")
    sources = [source(f"e{i}") for i in range(3)]
    streams = [batches_for(s, 300, 7) for s in sources]
    async with Pipeline([a, b], config()) as pipe:
        for i in range(max(len(s) for s in streams)):
            for stream in streams:
                if i < len(stream):
                    assert pipe.submit(stream[i])
        assert await pipe.flush(5)
        stats = pipe.stats()
    for sink in (a, b):
        ids = stream_ids(sink.batches)
        for s in sources:
            assert check_contiguous(ids[s], 300) == (300, 0)
        assert stats[sink.name].events_out == 900
        assert stats[sink.name].ok


async def test_submit_from_many_threads() -> None:
    sink = MemorySink()
    sources = [source(f"t{i}") for i in range(4)]
    async with Pipeline([sink], config(overflow="block", block_timeout_s=5.0)) as pipe:

        def produce(s: object) -> None:
            for b in batches_for(s, 500, 5):  # type: ignore[arg-type]
                assert pipe.submit(b, timeout_s=5.0)

        threads = [threading.Thread(target=produce, args=(s,)) for s in sources]
        for t in threads:
            t.start()
        await asyncio.to_thread(lambda: [t.join() for t in threads])
        assert await pipe.flush(5)
    ids = stream_ids(sink.batches)
    for s in sources:
        check_contiguous(ids[s], 500)


async def test_export_chunks_respect_batch_and_event_limits() -> None:
    sink = RecordingSink()
    cfg = config(max_export_batches=7, max_export_events=50, linger_s=0.05)
    async with Pipeline([sink], cfg) as pipe:
        sink.pause()
        for b in batches_for(source(), 400, 4):  # 100 batches of 4 events
            pipe.submit(b)
        sink.resume()
        assert await pipe.flush(5)
    assert sum(sink.calls) == 100
    assert max(sink.calls) <= 7
    assert all(n * 4 <= 50 for n in sink.calls)


async def test_linger_gathers_batches_into_one_export() -> None:
    sink = RecordingSink()
    async with Pipeline([sink], config(linger_s=0.2, max_export_batches=10)) as pipe:
        for b in batches_for(source(), 10, 1):
            pipe.submit(b)
        await wait_for_events(sink, 10)
    assert sink.calls == [10]  # the 10th batch filled the chunk before the linger ran out


async def test_a_batch_bigger_than_the_queue_is_still_accepted() -> None:
    sink = MemorySink()
    async with Pipeline([sink], config(max_queue_events=3)) as pipe:
        assert pipe.submit(make_batch(source(), 0, 10))
        assert await pipe.flush(5)
    assert sink.events_in == 10


# ----------------------------------------------------------------------------- overflow


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
async def test_drop_policies_stay_bounded_and_mark_every_drop(policy: str) -> None:
    sink = MemorySink()
    src = source()
    cfg = config(overflow=policy, max_queue_batches=10, max_export_batches=4)
    async with Pipeline([sink], cfg) as pipe:
        sink.pause()
        for b in batches_for(src, 500, 5):  # 100 batches
            pipe.submit(b)
            nb, _ = pipe.metric_queues()[0][1].depth()
            assert nb <= 10
        sink.resume()
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    delivered, lost = check_contiguous(stream_ids(sink.batches)[src], 500)
    assert lost == report.dropped[DropReason.QUEUE_FULL] > 0
    assert delivered + lost == 500
    assert report.events_out == delivered
    assert report.lost_pending_ids == 0
    markers = [ev for ev in sink.events() if ev[1].kind.value == "lost"]
    assert report.lost_markers_out == len(markers)
    assert all(ev.data.reason == "queue_full" for _, ev in markers)  # type: ignore[union-attr]


async def test_drop_newest_tail_gets_a_standalone_marker() -> None:
    sink = MemorySink()
    src = source()
    async with Pipeline([sink], config(overflow="drop_newest", max_queue_batches=2)) as pipe:
        sink.pause()
        for b in batches_for(src, 40, 4):
            pipe.submit(b)
        sink.resume()
        assert await pipe.flush(5)
    spans = stream_ids(sink.batches)[src]
    assert spans[-1][2], "the stream must end with the marker of the dropped tail"
    check_contiguous(spans, 40)


async def test_block_waits_for_room_then_gives_up_within_its_bound() -> None:
    sink = MemorySink()
    src = source()
    cfg = PipelineConfig.load(
        defaults={"overflow": "block", "block_timeout_s": 0.05, "max_queue_batches": 2},
        handoff_timeout_s=1.0,
    )
    async with Pipeline([sink], cfg) as pipe:
        sink.pause()
        batches = batches_for(src, 30, 3)

        def engine() -> list[tuple[bool, float]]:
            out = []
            for b in batches:
                t0 = time.monotonic()
                ok = pipe.submit(b)
                out.append((ok, time.monotonic() - t0))
            return out

        results = await asyncio.to_thread(engine)
        sink.resume()
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    refused = [r for r in results if not r[0]]
    assert refused, "a stalled sink with a 2-batch queue must refuse some batches"
    assert all(elapsed < 1.0 for _, elapsed in results)  # never beyond the hand-off bound
    # after the first timeout the queue is marked blocked-out: later refusals do not wait
    assert sum(1 for ok, e in refused if e >= 0.04) == 1
    _delivered, lost = check_contiguous(stream_ids(sink.batches)[src], 30)
    assert lost == report.dropped[DropReason.BLOCK_TIMEOUT] == 3 * len(refused)


async def test_block_loses_nothing_when_the_sink_keeps_up_within_the_bound() -> None:
    sink = MemorySink(latency_s=0.002)
    src = source()
    cfg = PipelineConfig.load(
        defaults={"overflow": "block", "block_timeout_s": 5.0, "max_queue_batches": 4},
        handoff_timeout_s=5.0,
    )
    async with Pipeline([sink], cfg) as pipe:
        batches = batches_for(src, 600, 3)
        oks = await asyncio.to_thread(lambda: [pipe.submit(b) for b in batches])
        assert all(oks)
        assert await pipe.flush(5)
    assert check_contiguous(stream_ids(sink.batches)[src], 600) == (600, 0)


async def test_put_from_a_coroutine_waits_for_room() -> None:
    sink = MemorySink(latency_s=0.001)
    src = source()
    cfg = PipelineConfig.load(
        defaults={"overflow": "block", "block_timeout_s": 5.0, "max_queue_batches": 2},
        handoff_timeout_s=5.0,
    )
    async with Pipeline([sink], cfg) as pipe:
        for b in batches_for(src, 100, 2):
            assert await pipe.put(b)
        assert await pipe.flush(5)
    assert check_contiguous(stream_ids(sink.batches)[src], 100) == (100, 0)


async def test_submit_on_the_loop_thread_never_blocks() -> None:
    sink = MemorySink()
    cfg = PipelineConfig.load(
        defaults={"overflow": "block", "block_timeout_s": 10.0, "max_queue_batches": 1},
        handoff_timeout_s=10.0,
    )
    async with Pipeline([sink], cfg) as pipe:
        sink.pause()
        t0 = time.monotonic()
        results = [pipe.submit(b) for b in batches_for(source(), 10, 1)]
        assert time.monotonic() - t0 < 5.0
        assert results.count(False) >= 1
        sink.resume()


# ------------------------------------------------------------------------------ retries


async def test_retriable_failures_are_retried_until_delivered() -> None:
    sink = MemorySink()
    cfg = config(retry={"initial_backoff_s": 0.001, "max_backoff_s": 0.005})
    async with Pipeline([sink], cfg) as pipe:
        sink.fail_next(3)
        for b in batches_for(source(), 50, 5):
            pipe.submit(b)
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    assert report.retries == 3
    assert report.undelivered_events == 0
    check_contiguous(stream_ids(sink.batches)[source()], 50)


async def test_raised_sink_errors_are_classified() -> None:
    from kvstream.errors import PermanentSinkError, RetriableSinkError

    sink = MemorySink()
    cfg = config(retry={"initial_backoff_s": 0.001, "max_backoff_s": 0.002})
    async with Pipeline([sink], cfg) as pipe:
        sink.fail_next(1, RetriableSinkError("flaky"))
        sink.fail_next(1, PermanentSinkError("broken"))
        pipe.submit(make_batch(source(), 0, 5))
        assert await pipe.flush(5)
        assert "broken" in (pipe.stats()[sink.name].last_error or "")
        pipe.submit(make_batch(source(), 5, 5))
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    assert report.retries == 1
    assert report.dropped == {DropReason.PERMANENT_ERROR: 5}
    assert report.last_error is None  # delivered again since
    assert check_contiguous(stream_ids(sink.batches)[source()], 10) == (5, 5)


async def test_permanent_failure_drops_the_chunk_and_marks_it() -> None:
    sink = MemorySink()
    src = source()
    async with Pipeline([sink], config()) as pipe:
        sink.fail_next(1, ExportResult.permanent("bad record"))
        pipe.submit(make_batch(src, 0, 10))
        await asyncio.sleep(0.05)
        pipe.submit(make_batch(src, 10, 10))
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    assert report.dropped == {DropReason.PERMANENT_ERROR: 10}
    assert report.retries == 0
    assert check_contiguous(stream_ids(sink.batches)[src], 20) == (10, 10)


async def test_retry_deadline_gives_up_and_marks() -> None:
    sink = MemorySink()
    src = source()
    retry = {"initial_backoff_s": 0.01, "max_backoff_s": 0.02, "deadline_s": 0.1}
    async with Pipeline([sink], config(retry=retry)) as pipe:
        sink.fail_next(1000)
        pipe.submit(make_batch(src, 0, 4))
        deadline = time.monotonic() + 5
        while not pipe.stats()[sink.name].dropped:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        sink._faults.clear()
        pipe.submit(make_batch(src, 4, 4))
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    assert report.dropped == {DropReason.RETRY_EXHAUSTED: 4}
    assert check_contiguous(stream_ids(sink.batches)[src], 8) == (4, 4)


async def test_hung_export_is_cancelled_and_retried() -> None:
    sink = MemorySink()
    retry = {"attempt_timeout_s": 0.05, "initial_backoff_s": 0.001, "max_backoff_s": 0.01}
    async with Pipeline([sink], config(retry=retry)) as pipe:
        sink.pause()
        pipe.submit(make_batch(source(), 0, 3))
        while pipe.stats()[sink.name].retries < 2:
            await asyncio.sleep(0.01)
        sink.resume()
        assert await pipe.flush(5)
    assert sink.events_in == 3


async def test_a_failing_sink_is_not_hammered_with_marker_only_exports() -> None:
    sink = MemorySink()
    src = source()
    retry = {"initial_backoff_s": 0.05, "max_backoff_s": 0.05, "jitter": 0.0}
    async with Pipeline([sink], config(retry=retry)) as pipe:
        sink.fail_next(10_000, ExportResult.permanent("down"))
        pipe.submit(make_batch(src, 0, 2))
        await asyncio.sleep(0.3)
        calls = sink.export_calls
        assert calls <= 10  # ~one marker attempt per backoff period, not a busy loop
        sink._faults.clear()
        assert await pipe.flush(5)
    assert check_contiguous(stream_ids(sink.batches)[src], 2) == (0, 2)


# ---------------------------------------------------------------------------- isolation


async def test_a_stalled_sink_does_not_slow_the_others() -> None:
    fast, stalled = MemorySink(name="fast"), MemorySink(name="stalled")
    src = source()
    cfg = PipelineConfig.load(
        defaults={"linger_s": 0.0}, sinks={"stalled": {"max_queue_batches": 50}}
    )
    pipe = await Pipeline([fast, stalled], cfg).start()
    stalled.pause()
    batches = batches_for(src, 2000, 4)
    await asyncio.to_thread(lambda: [pipe.submit(b) for b in batches])
    await wait_for_events(fast, 2000)  # while the other sink is still stalled
    assert stalled.events_in == 0
    report = await pipe.aclose(timeout_s=0.5)
    assert check_contiguous(stream_ids(fast.batches)[src], 2000) == (2000, 0)
    assert report.sinks["fast"].ok
    dead = report.sinks["stalled"]
    assert dead.undelivered_events == 2000
    assert dead.dropped[DropReason.QUEUE_FULL] + dead.dropped[DropReason.SHUTDOWN] == 2000


async def test_close_with_a_dead_sink_returns_within_its_deadline() -> None:
    good, dead = MemorySink(name="good"), MemorySink(name="dead")
    cfg = PipelineConfig.load(
        defaults={"linger_s": 0.0, "retry": {"attempt_timeout_s": 60.0, "deadline_s": None}},
        shutdown_grace_s=0.2,
    )
    pipe = await Pipeline([good, dead], cfg).start()
    dead.pause()
    for b in batches_for(source(), 100, 10):
        pipe.submit(b)
    await wait_for_events(good, 100)
    t0 = time.monotonic()
    report = await pipe.aclose(timeout_s=0.8)
    elapsed = time.monotonic() - t0
    assert elapsed < 0.8 + 0.5, elapsed
    assert report.timed_out
    assert report.sinks["good"].ok
    assert report.sinks["dead"].undelivered_events == 100
    assert report.sinks["dead"].dropped == {DropReason.SHUTDOWN: 100}
    assert report.sinks["dead"].lost_pending_ids == 100
    assert report.undelivered_events == 100
    assert not report.ok
    assert report.as_dict()["sinks"]["dead"]["undelivered_events"] == 100


# ---------------------------------------------------------------------------- lifecycle


async def test_close_drains_flushes_and_shuts_down() -> None:
    sink = MemorySink()
    pipe = Pipeline([sink], config(linger_s=1.0))
    async with pipe:
        for b in batches_for(source(), 20, 2):
            pipe.submit(b)
    report = await pipe.aclose()  # idempotent: the same report
    assert report.ok
    assert report.sinks[sink.name].flushed
    assert report.sinks[sink.name].shut_down
    assert sink.events_in == 20
    assert sink.is_shut_down
    assert sink.flushes >= 1
    assert not pipe.submit(make_batch(source(), 20, 1))
    assert pipe.stats()[sink.name].dropped == {DropReason.CLOSED: 1}
    with pytest.raises(PipelineClosedError):
        await pipe.start()


async def test_flush_under_continuous_load_waits_only_for_earlier_batches() -> None:
    sink = MemorySink(latency_s=0.001)
    src = source()
    stop = threading.Event()
    async with Pipeline([sink], config(max_queue_batches=100_000)) as pipe:

        def engine() -> int:
            i = 0
            while not stop.is_set():
                pipe.submit(make_batch(src, i, 1))
                i += 1
                time.sleep(0.0002)
            return i

        fut = asyncio.ensure_future(asyncio.to_thread(engine))
        await asyncio.sleep(0.05)
        before = pipe.stats()[sink.name].events_in
        assert await pipe.flush(5)  # returns although the engine keeps submitting
        assert sink.events_in >= before
        stop.set()
        total = await fut
        assert await pipe.flush(5)
    assert check_contiguous(stream_ids(sink.batches)[src], total) == (total, 0)


async def test_submissions_before_start_are_delivered() -> None:
    sink = MemorySink()
    pipe = Pipeline([sink], config())
    pipe.submit(make_batch(source(), 0, 3))
    with pytest.raises(PipelineNotStartedError):
        await pipe.flush()
    report = await pipe.aclose()
    assert report.ok
    assert sink.events_in == 3


async def test_subscription_sees_batches_as_they_arrive() -> None:
    sink = MemorySink()
    sub = sink.subscribe()
    async with Pipeline([sink], config()) as pipe:
        for b in batches_for(source(), 10, 2):
            pipe.submit(b)

        async def read_all() -> list[EventBatch]:
            return [b async for b in sub]

        reader = asyncio.ensure_future(read_all())
        assert await pipe.flush(5)
    got = await asyncio.wait_for(reader, 5)  # ends when the pipeline shuts the sink down
    assert sum(len(b.events) for b in got) == 10


def test_pipeline_needs_sinks_and_known_overrides() -> None:
    with pytest.raises(ConfigError):
        Pipeline([])
    with pytest.raises(ConfigError, match="unknown sink"):
        Pipeline([MemorySink()], PipelineConfig.load(sinks={"nope": {"linger_s": 1}}))
    with pytest.raises(ConfigError):
        Pipeline([object()])  # type: ignore[list-item]


async def test_duplicate_sink_names_are_suffixed() -> None:
    pipe = Pipeline([MemorySink(), MemorySink()])
    assert list(pipe.sinks) == ["memory", "memory-2"]
    await pipe.aclose()


# ------------------------------------------------------------------------------ metrics


async def test_metrics_report_flow_drops_and_latency() -> None:
    registry = CollectorRegistry()
    sink = MemorySink(name="mem")
    cfg = config(overflow="drop_newest", max_queue_batches=1)
    cfg = cfg.model_copy(update={"name": "p1"})
    async with Pipeline([sink], cfg, registry=registry) as pipe:
        sink.pause()
        for b in batches_for(source(), 30, 3):
            pipe.submit(b)
        sink.resume()
        assert await pipe.flush(5)
        labels = {"pipeline": "p1", "sink": "mem"}
        value = registry.get_sample_value
        stats = pipe.stats()["mem"]
        markers = sum(1 for _, ev in sink.events() if ev.kind.value == "lost")
        assert value("kvstream_pipeline_events_in_total", labels) == stats.events_in
        assert value("kvstream_pipeline_events_out_total", labels) == sink.events_in - markers
        dropped = value(
            "kvstream_pipeline_events_dropped_total", {**labels, "reason": "queue_full"}
        )
        assert dropped
        assert dropped > 0
        assert value("kvstream_pipeline_lost_markers_total", labels) >= 1  # type: ignore[operator]
        assert value("kvstream_pipeline_queue_depth_batches", labels) == 0
        assert value("kvstream_pipeline_export_latency_seconds_count", labels) >= 1  # type: ignore[operator]
    text = generate_latest(registry).decode()
    assert 'kvstream_pipeline_export_retries_total{pipeline="p1",sink="mem"}' in text


async def test_pipelines_can_share_a_registry() -> None:
    registry = CollectorRegistry()
    p1 = Pipeline([MemorySink()], PipelineConfig(name="one"), registry=registry)
    p2 = Pipeline([MemorySink()], PipelineConfig(name="two"), registry=registry)
    text = generate_latest(registry).decode()
    assert 'pipeline="one"' in text
    assert 'pipeline="two"' in text
    await p1.aclose()
    await p2.aclose()


async def test_close_records_drops_outside_the_queue_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recording what close drops (ledger ranges of every queued batch) used to hold the
    queue lock, so a concurrent submit() waited behind it (672 ms seen, bound 50 ms)."""
    from kvstream.pipeline.lost import LossLedger

    sink = MemorySink()
    cfg = PipelineConfig.load(
        defaults={"linger_s": 0.0, "max_queue_batches": 100_000},
        shutdown_grace_s=0.1,
    )
    pipe = await Pipeline([sink], cfg).start()
    queue = pipe.metric_queues()[0][1]
    sink.pause()
    for b in batches_for(source(), 20_000, 2):
        pipe.submit(b)
    held: list[bool] = []
    record = LossLedger.record

    def spy(self: LossLedger, batch: object, reason: str) -> None:
        held.append(queue._lock.locked())
        record(self, batch, reason)  # type: ignore[arg-type]

    monkeypatch.setattr(LossLedger, "record", spy)
    report = await pipe.aclose(timeout_s=1.0)
    r = report.sinks[sink.name]
    assert r.dropped[DropReason.SHUTDOWN] + r.events_out == 20_000
    assert r.lost_pending_ids == r.dropped[DropReason.SHUTDOWN]
    assert held
    assert not any(held), f"{sum(held)} of {len(held)} drops recorded under the queue lock"


async def test_last_error_clears_after_recovery() -> None:
    sink = MemorySink()
    pipe = await Pipeline([sink], config(retry={"initial_backoff_s": 0.01})).start()
    sink.fail_next(2)
    pipe.submit(make_batch(source(), 0, 3))
    assert await pipe.flush(5)
    assert pipe.stats()[sink.name].last_error is None
    sink.fail_next(1, ExportResult.permanent("broken"))
    pipe.submit(make_batch(source(), 3, 3))
    assert await pipe.flush(5)
    assert pipe.stats()[sink.name].last_error == "broken"
    pipe.submit(make_batch(source(), 6, 3))
    assert await pipe.flush(5)
    assert pipe.stats()[sink.name].last_error is None  # delivered again: not stale
    await pipe.aclose()


async def test_aclose_does_not_wait_for_a_sink_that_ignores_cancellation() -> None:
    class Stubborn(MemorySink):
        async def shutdown(self, timeout_s: float | None = None) -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(1.5)  # keeps going after the cancel

    sink = Stubborn()
    pipe = await Pipeline([sink], config()).start()
    pipe.submit(make_batch(source(), 0, 3))
    t0 = time.monotonic()
    report = await pipe.aclose(timeout_s=0.5)
    assert time.monotonic() - t0 <= 0.5 + 0.5
    assert report.sinks[sink.name].shut_down is False
    assert report.sinks[sink.name].events_out == 3

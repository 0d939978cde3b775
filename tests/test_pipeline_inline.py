"""``Pipeline.put`` delivering to an idle memory sink at once (``SinkWorker.deliver_now`` with
``MemorySink.export_now``): what a pipeline user observes must be what the sink task's
path gives (same batches in the same order, same counters and metrics), and the fast path
must step aside whenever the task path could behave differently."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvstream.sinks.memory import MemorySink
from pipeline_helpers import check_contiguous, make_batch, source, stream_ids
from prometheus_client import CollectorRegistry

from kvstream.events.deferred import DeferredBatch
from kvstream.events.model import EventBatch
from kvstream.pipeline import Pipeline, PipelineConfig
from kvstream.sink import ExportResult


def config(**defaults: object) -> PipelineConfig:
    base: dict[str, object] = {"linger_s": 0.0, "overflow": "block", "block_timeout_s": 5.0}
    base.update(defaults)
    return PipelineConfig.load(defaults=base, close_timeout_s=5.0)


class TaskOnlySink(MemorySink):
    """A memory sink without the synchronous export: every batch goes through the sink task
    (the reference the fast path is compared with)."""

    export_now = None  # type: ignore[assignment]


class CountingSink(MemorySink):
    """Counts export_now calls that delivered, to see which path a batch took."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.now_calls = 0

    def export_now(self, batches: Sequence[EventBatch]) -> bool:
        done = super().export_now(batches)
        self.now_calls += done
        return done


def _observed(pipe: Pipeline, sink: MemorySink, registry: CollectorRegistry) -> dict[str, object]:
    """Everything a pipeline user can see of one run, timing aside."""
    report = pipe.stats()[sink.name]
    labels = {"pipeline": pipe.config.name, "sink": sink.name}

    def sample(name: str) -> float | None:
        return registry.get_sample_value(name, labels)

    return {
        "ids": dict(stream_ids(sink.batches)),
        "batches": [(b.source, b.ts_ns, len(b.events)) for b in sink.batches],
        "events_in": sink.events_in,
        "batches_in": sink.batches_in,
        "report": (
            report.events_in,
            report.events_out,
            report.batches_out,
            report.dropped,
            report.lost_markers_out,
            report.queued_batches,
            report.last_error,
        ),
        "metric_events_in": sample("kvstream_pipeline_events_in_total"),
        "metric_events_out": sample("kvstream_pipeline_events_out_total"),
        "metric_batches_out": sample("kvstream_pipeline_batches_out_total"),
        # one latency observation per delivered chunk (one batch each when it is alone)
        "metric_latency_count": sample("kvstream_pipeline_export_latency_seconds_count"),
    }


async def _run(sink: MemorySink, script: list[tuple[str, int]]) -> dict[str, object]:
    registry = CollectorRegistry()
    srcs = [source(f"engine-{i}") for i in range(3)]
    next_id = [0, 0, 0]
    async with Pipeline([sink], config(), registry=registry) as pipe:
        for op, arg in script:
            if op == "put":
                s = arg % 3
                n = 1 + arg % 4
                assert await pipe.put(make_batch(srcs[s], next_id[s], n, stored=bool(arg & 1)))
                next_id[s] += n
            elif op == "yield":
                for _ in range(arg % 3):
                    await asyncio.sleep(0)
            else:  # flush: everything so far delivered
                assert await pipe.flush(5)
        assert await pipe.flush(5)
        observed = _observed(pipe, sink, registry)
    for s, src in enumerate(srcs):
        if next_id[s]:
            assert check_contiguous(stream_ids(sink.batches)[src], next_id[s]) == (next_id[s], 0)
    return observed


_SCRIPT = st.lists(
    st.tuples(st.sampled_from(["put", "put", "put", "yield", "flush"]), st.integers(0, 99)),
    max_size=40,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=_SCRIPT)
def test_put_delivers_what_the_sink_task_would(script: list[tuple[str, int]]) -> None:
    # Chunks are one batch each in both runs: the sink task runs only when the producer
    # yields, and every put that finds it idle with nothing queued is the next chunk alone.
    # Compare runs where every put is followed by a yield (so the task path also exports
    # one batch per chunk), and the raw script for order and contents.
    paced: list[tuple[str, int]] = []
    for op in script:
        paced.append(op)
        if op[0] == "put":
            paced.append(("yield", 1))
    fast = asyncio.run(_run(MemorySink(), paced))
    slow = asyncio.run(_run(TaskOnlySink(), paced))
    assert fast == slow
    unpaced_fast = asyncio.run(_run(MemorySink(), script))
    unpaced_slow = asyncio.run(_run(TaskOnlySink(), script))
    for key in ("ids", "batches", "events_in", "batches_in", "report", "metric_events_in"):
        assert unpaced_fast[key] == unpaced_slow[key], key


async def test_the_fast_path_is_taken_only_while_the_sink_task_is_idle() -> None:
    sink = CountingSink()
    src = source()
    async with Pipeline([sink], config()) as pipe:
        assert await pipe.put(make_batch(src, 0, 1))  # the task has not started the sink yet
        assert sink.now_calls == 0
        assert await pipe.flush(5)
        assert await pipe.put(make_batch(src, 1, 1))  # idle, started: delivered right here
        assert sink.now_calls == 1
        assert sink.events_in == 2
        sink.pause()  # a stalled sink: export_now refuses, the task exports (and waits)
        assert await pipe.put(make_batch(src, 2, 1))
        await asyncio.sleep(0.01)
        assert await pipe.put(make_batch(src, 3, 2))  # the task is busy: queued behind
        assert sink.now_calls == 1
        assert sink.events_in == 2
        sink.resume()
        assert await pipe.flush(5)
        assert sink.events_in == 5
        assert await pipe.put(make_batch(src, 5, 1))
        assert sink.now_calls == 2
    assert check_contiguous(stream_ids(sink.batches)[src], 6) == (6, 0)


async def test_pending_failures_and_lost_markers_go_through_the_sink_task() -> None:
    sink = CountingSink()
    src = source()
    retry = {"initial_backoff_s": 0.001, "max_backoff_s": 0.001, "deadline_s": 0.05}
    async with Pipeline([sink], config(retry=retry)) as pipe:
        assert await pipe.put(make_batch(src, 0, 1))
        assert await pipe.flush(5)
        sink.fail_next(1000)  # injected failures: export_now refuses
        assert await pipe.put(make_batch(src, 1, 2))
        assert sink.now_calls == 0
        while not pipe.stats()[sink.name].dropped:
            await asyncio.sleep(0.01)
        sink._faults.clear()
        # a marker is owed for ids 1-2: the next batch must follow it, through the task
        assert await pipe.put(make_batch(src, 3, 1))
        assert sink.now_calls == 0
        assert await pipe.flush(5)
        assert await pipe.put(make_batch(src, 4, 1))  # clean again: fast
        assert sink.now_calls == 1
    assert check_contiguous(stream_ids(sink.batches)[src], 5) == (3, 2)


async def test_lingering_deferred_batches_and_overridden_exports_use_the_task() -> None:
    lingering = CountingSink(name="lingering")
    async with Pipeline([lingering], config(linger_s=0.001)) as pipe:
        for i in range(3):
            assert await pipe.put(make_batch(source(), i, 1))
            assert await pipe.flush(5)
    assert lingering.now_calls == 0
    assert lingering.events_in == 3

    class Overriding(MemorySink):
        async def export(self, batches: Sequence[EventBatch]) -> ExportResult:
            self.seen = getattr(self, "seen", 0) + len(batches)
            return await super().export(batches)

    over = Overriding()
    async with Pipeline([over], config()) as pipe:
        for i in range(3):
            assert await pipe.put(make_batch(source(), i, 1))
            assert await pipe.flush(5)
    assert over.seen == 3
    assert not over.export_now([make_batch(source(), 9, 1)])

    class ModelsOnly(CountingSink):
        accepts_columns = False

    # a deferred batch goes through the task to a sink that needs its models, straight to
    # one that takes columns (as its columns: nothing built)
    for sink, fast in ((ModelsOnly(), 0), (CountingSink(), 1)):
        src = source()
        async with Pipeline([sink], config()) as pipe:
            assert await pipe.put(make_batch(src, 0, 1))
            assert await pipe.flush(5)
            built = make_batch(src, 1, 2)
            deferred = DeferredBatch(src, built.ts_ns, [ev.model_dump() for ev in built.events])
            assert await pipe.put(deferred)
            assert sink.now_calls == fast
            assert await pipe.flush(5)
            assert deferred.materialized != bool(fast)
        assert check_contiguous(stream_ids(sink.batches)[src], 3) == (3, 0)
        assert sink.batches[-1] == built


async def test_a_thread_submitting_meanwhile_keeps_per_source_order() -> None:
    sink = MemorySink()
    loop_src, thread_src = source("loop"), source("thread")
    async with Pipeline([sink], config()) as pipe:
        assert await pipe.put(make_batch(loop_src, 0, 1))
        assert await pipe.flush(5)
        rng = random.Random(7)

        def produce() -> None:
            for i in range(300):
                assert pipe.submit(make_batch(thread_src, i, 1))

        t = threading.Thread(target=produce)
        t.start()
        for i in range(1, 301):
            assert await pipe.put(make_batch(loop_src, i, 1))
            if rng.random() < 0.3:
                await asyncio.sleep(0)
        await asyncio.to_thread(t.join)
        assert await pipe.flush(5)
        report = pipe.stats()[sink.name]
    ids = stream_ids(sink.batches)
    assert check_contiguous(ids[loop_src], 301) == (301, 0)
    assert check_contiguous(ids[thread_src], 300) == (300, 0)
    assert report.events_in == report.events_out == 601


@pytest.mark.parametrize("closed_first", [True, False])
async def test_after_close_nothing_is_delivered_at_once(closed_first: bool) -> None:
    sink = CountingSink()
    pipe = await Pipeline([sink], config()).start()
    assert await pipe.put(make_batch(source(), 0, 1))
    assert await pipe.flush(5)
    if closed_first:
        await pipe.aclose()
        assert not await pipe.put(make_batch(source(), 1, 1))
        assert sink.now_calls == 0
        assert pipe.stats()[sink.name].dropped == {"closed": 1}
    else:
        assert await pipe.put(make_batch(source(), 1, 1))
        assert sink.now_calls == 1
        await pipe.aclose()
    assert sink.events_in == (1 if closed_first else 2)

"""kvstream.engines.trtllm.pump: the in-process TensorRT-LLM poll loop feeding a pipeline.

The ``llm`` here is a scripted stand-in for ``tensorrt_llm.LLM``: each
``get_kv_cache_events_async(timeout)`` call hands out the next scripted drain the way the real
``IterationResult`` does (an async iterable of event dicts that may end in ``TimeoutError``).
The pipeline and its memory sink are real.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from kvstream.sinks.memory import MemorySink

from kvstream.engines.trtllm import PumpStats, TrtllmEventReader, pump
from kvstream.errors import ConfigError
from kvstream.events.model import EventBatch
from kvstream.pipeline import Pipeline, PipelineConfig

SHAPES = Path(__file__).parent / "data" / "trtllm" / "shapes"


def shape(name: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = json.loads((SHAPES / f"{name}.json").read_text())
    return events


def stored(block_hash: int, **envelope: Any) -> dict[str, Any]:
    return {
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [{"block_hash": block_hash, "tokens": [{"token_id": 1}]}],
        },
        **envelope,
    }


class Raise:
    """A scripted drain that yields ``events`` and then raises ``error``."""

    def __init__(self, error: BaseException, events: list[Any] | None = None) -> None:
        self.error = error
        self.events = events or []


class CallFails:
    """A scripted poll whose call itself raises."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ScriptedLLM:
    """Hands out one scripted drain per call; calls ``when_done`` once the script is spent."""

    def __init__(self, script: list[Any], when_done: Callable[[], None] | None = None) -> None:
        self.script = deque(script)
        self.when_done = when_done
        self.timeouts: list[float | None] = []

    def get_kv_cache_events_async(self, timeout: float | None) -> Any:
        self.timeouts.append(timeout)
        step = self.script.popleft() if self.script else []
        if not self.script and self.when_done is not None:
            self.when_done()
        if isinstance(step, CallFails):
            raise step.error
        return self._drain(step)

    @staticmethod
    async def _drain(step: Any) -> AsyncIterator[Any]:
        events = step.events if isinstance(step, Raise) else step
        for event in events:
            yield event
        if isinstance(step, Raise):
            raise step.error


def config() -> PipelineConfig:
    return PipelineConfig.load(defaults={"linger_s": 0.0}, close_timeout_s=5.0)


def key(batches: list[EventBatch]) -> list[tuple[Any, ...]]:
    return [(b.source, b.events) for b in batches]


def expected(*drains: list[Any], **options: Any) -> list[tuple[Any, ...]]:
    reader = TrtllmEventReader(instance_id="trt-0", **options)
    return key([b for d in drains for b in reader.read_tolerant(d, ts_ns=0).batches])


async def run(llm: ScriptedLLM, stop: asyncio.Event, **kw: Any) -> tuple[PumpStats, MemorySink]:
    sink = MemorySink(max_batches=None)
    async with Pipeline([sink], config()) as pipe:
        stats = await asyncio.wait_for(pump(llm, pipe, instance_id="trt-0", stop=stop, **kw), 10)
        assert await pipe.flush(5)
    return stats, sink


async def test_drains_become_batches_in_the_pipeline() -> None:
    a = shape("v1_ser_ed53795b_created_stored_removed")
    b = shape("dynamo_adapter_minimal_tokens")
    c = shape("openengine_no_event_id_no_window")
    stop = asyncio.Event()
    # the real IterationResult may end a drain with TimeoutError once the queue is empty
    llm = ScriptedLLM([a, [], Raise(TimeoutError(), b), [], c], when_done=stop.set)
    stats, sink = await run(llm, stop, tokens_per_block=32)
    assert key(sink.batches) == expected(a, b, c, tokens_per_block=32)
    assert (stats.polls, stats.events, stats.batches) == (5, 7, 4)
    assert (stats.malformed, stats.poll_errors, stats.refused) == (0, 0, 0)
    assert set(llm.timeouts) == {0.0}  # Dynamo's non-blocking poll


async def test_bad_input_and_failing_polls_never_end_the_pump() -> None:
    good = [stored(1), stored(2)]
    bad = [stored(3), {"event_id": 9, "data": 5}, "not an event", stored(4)]
    stop = asyncio.Event()
    llm = ScriptedLLM(
        [
            good,
            CallFails(RuntimeError("KV cache events are disabled")),
            bad,
            Raise(ValueError("engine hiccup"), [stored(5)]),  # what came before it is kept
            [stored(6)],
        ],
        when_done=stop.set,
    )
    stats, sink = await run(llm, stop)
    ids = [e.event_id for batch in sink.batches for e in batch.events]
    assert ids == [0, 1, 2, 3, 4, 5]
    assert (stats.malformed, stats.poll_errors, stats.events) == (2, 2, 8)
    assert [m.split(":")[0] for m in stats.recent_malformed] == ["event[1].data", "event[2]"]


async def test_a_long_drain_is_read_in_parts() -> None:
    drain = [stored(i) for i in range(10)]
    stop = asyncio.Event()
    stats, sink = await run(ScriptedLLM([drain], when_done=stop.set), stop, max_events_per_read=4)
    assert [len(b.events) for b in sink.batches] == [4, 4, 2]
    assert [e.event_id for b in sink.batches for e in b.events] == list(range(10))
    assert stats.batches == 3


async def test_an_awaitable_list_is_a_drain_too() -> None:
    class ProxyLLM:
        def __init__(self) -> None:
            self.left = [[stored(1, attention_dp_rank=1)], None]

        async def _get(self) -> Any:
            return self.left.pop(0) if self.left else []

        def get_kv_cache_events_async(self, timeout: float | None) -> Any:
            return self._get()

    stop = asyncio.Event()
    sink = MemorySink(max_batches=None)
    async with Pipeline([sink], config()) as pipe:
        task = asyncio.create_task(pump(ProxyLLM(), pipe, instance_id="p", stop=stop))
        while not sink.batches:
            await asyncio.sleep(0.005)
        stop.set()
        stats = await asyncio.wait_for(task, 5)
    assert [b.source.attention_dp_rank for b in sink.batches] == [1]
    assert stats.events == 1


async def test_stop_ends_an_idle_pump_and_backs_off() -> None:
    stop = asyncio.Event()
    llm = ScriptedLLM([])
    sink = MemorySink()
    async with Pipeline([sink], config()) as pipe:
        task = asyncio.create_task(
            pump(llm, pipe, instance_id="i", stop=stop, min_sleep_s=0.01, max_sleep_s=0.04)
        )
        await asyncio.sleep(0.3)
        stop.set()
        stats = await asyncio.wait_for(task, 1)
    # sleeping 0.01, 0.015, 0.0225, then 0.04 per idle poll: well under one poll per 10 ms
    assert 3 <= stats.polls <= 30
    assert sink.batches == []


async def test_cancellation_submits_what_was_already_drained() -> None:
    first_out = asyncio.Event()
    never = asyncio.Event()

    class HangingLLM:
        async def _drain(self) -> AsyncIterator[Any]:
            yield stored(1)
            first_out.set()
            await never.wait()
            yield stored(2)

        def get_kv_cache_events_async(self, timeout: float | None) -> Any:
            return self._drain()

    sink = MemorySink(max_batches=None)
    async with Pipeline([sink], config()) as pipe:
        task = asyncio.create_task(pump(HangingLLM(), pipe, instance_id="c"))
        await asyncio.wait_for(first_out.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await pipe.flush(5)
    assert [[e.event_id for e in b.events] for b in sink.batches] == [[0]]


async def test_refused_batches_are_counted() -> None:
    class FullPipeline:
        def __init__(self) -> None:
            self.seen: list[EventBatch] = []

        def submit(self, batch: EventBatch) -> bool:
            self.seen.append(batch)
            return len(self.seen) == 1

    stop = asyncio.Event()
    target = FullPipeline()
    llm = ScriptedLLM([[stored(1)], [stored(2)], [stored(3)]], when_done=stop.set)
    stats = await asyncio.wait_for(pump(llm, target, instance_id="f", stop=stop), 5)
    assert (stats.batches, stats.refused) == (3, 2)
    assert len(target.seen) == 3


async def test_a_given_reader_keeps_numbering_and_stats_accumulate() -> None:
    reader = TrtllmEventReader(instance_id="r")
    reader.read([stored(1, event_id=41)], ts_ns=0)
    stats = PumpStats()
    stop = asyncio.Event()
    sink = MemorySink(max_batches=None)
    async with Pipeline([sink], config()) as pipe:
        llm = ScriptedLLM([[stored(2)]], when_done=stop.set)
        out = await pump(llm, pipe, instance_id="ignored", reader=reader, stop=stop, stats=stats)
        assert await pipe.flush(5)
    assert out is stats
    assert stats.events == 1
    assert [(b.source.instance_id, b.events[0].event_id) for b in sink.batches] == [("r", 42)]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"min_sleep_s": -1}, "min_sleep_s"),
        ({"max_sleep_s": "1"}, "max_sleep_s"),
        ({"backoff": 0.5}, "backoff"),
        ({"max_events_per_read": 0}, "max_events_per_read"),
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"instance_id": ""}, "bad source"),
    ],
)
async def test_bad_arguments(kw: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"instance_id": "x", **kw}
    with pytest.raises(ConfigError, match=match):
        await pump(ScriptedLLM([]), MemorySink(), stop=asyncio.Event(), **args)  # type: ignore[arg-type]

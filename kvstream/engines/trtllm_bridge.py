"""The in-process TensorRT-LLM bridge: :func:`pump` polls a live ``LLM``'s KV-cache events, as
NVIDIA Dynamo's TensorRT-LLM worker does, reads them with a
:class:`~kvstream.engines.trtllm.TrtllmEventReader` and hands the batches to a pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from kvstream.engines.trtllm_reader import TrtllmEventReader
from kvstream.errors import ConfigError
from kvstream.events.model import EventBatch

__all__ = ["BatchSubmitter", "KvEventsLLM", "PumpStats", "pump"]

log = logging.getLogger("kvstream.engines.trtllm")

_RECENT_MALFORMED: Final = 100


class BatchSubmitter(Protocol):
    """What :func:`pump` uses of a pipeline: :meth:`kvstream.pipeline.Pipeline.submit`
    (thread-safe; True when every sink's queue took the batch)."""

    def submit(self, batch: EventBatch) -> bool: ...


class KvEventsLLM(Protocol):
    """What :func:`pump` uses of TensorRT-LLM's ``LLM``: ``get_kv_cache_events_async(timeout)``,
    which returns an async iterable of event dicts (an ``IterationResult``, or an async
    generator in proxies and tests); an awaitable list is accepted too."""

    def get_kv_cache_events_async(self, timeout: float | None) -> Any: ...


@dataclass
class PumpStats:
    """What :func:`pump` did: ``polls`` of the engine, ``events`` received, ``batches``
    submitted, ``refused`` batches (``submit`` returned False: a sink's queue dropped them and
    the pipeline put a ``lost`` marker in their place), ``malformed`` events skipped (the most
    recent messages in ``recent_malformed``) and ``poll_errors`` (polls that raised; logged)."""

    polls: int = 0
    events: int = 0
    batches: int = 0
    refused: int = 0
    malformed: int = 0
    poll_errors: int = 0
    recent_malformed: deque[str] = field(default_factory=lambda: deque(maxlen=_RECENT_MALFORMED))


class _Pump:
    """One :func:`pump` run: polls, converts, submits."""

    def __init__(
        self,
        llm: KvEventsLLM,
        pipeline: BatchSubmitter,
        reader: TrtllmEventReader,
        stats: PumpStats,
        *,
        poll_timeout_s: float | None,
        max_events_per_read: int,
    ) -> None:
        self.llm = llm
        self.pipeline = pipeline
        self.reader = reader
        self.stats = stats
        self.poll_timeout_s = poll_timeout_s
        self.max_events_per_read = max_events_per_read

    def flush(self, events: list[Any]) -> None:
        """Convert one drain's events (malformed ones counted, never raised) and submit."""
        if not events:
            return
        self.stats.events += len(events)
        result = self.reader.read_tolerant(events)
        for error in result.errors:
            self.stats.malformed += 1
            self.stats.recent_malformed.append(str(error))
            log.warning("TensorRT-LLM pump: skipping a malformed event: %s", error)
        for batch in result.batches:
            self.stats.batches += 1
            if not self.pipeline.submit(batch):
                self.stats.refused += 1

    async def poll(self) -> int:
        """One ``get_kv_cache_events_async`` drain; returns how many events it brought."""
        self.stats.polls += 1
        events: list[Any] = []
        received = 0
        try:
            result = self.llm.get_kv_cache_events_async(self.poll_timeout_s)
            if hasattr(result, "__aiter__"):
                async for event in result:
                    events.append(event)
                    received += 1
                    if len(events) >= self.max_events_per_read:
                        self.flush(events)
                        events = []
            else:
                drained = await result
                events.extend(drained or ())
                received += len(events)
        except (asyncio.TimeoutError, TimeoutError, asyncio.QueueEmpty):
            pass  # nothing (more) arrived within the timeout
        except asyncio.CancelledError:
            self.flush(events)  # what was drained is the engine's only copy
            raise
        except Exception as exc:  # a failing poll must not end the pump
            self.stats.poll_errors += 1
            log.warning("TensorRT-LLM pump: get_kv_cache_events_async failed: %r", exc)
        self.flush(events)
        return received


async def _idle(stop: asyncio.Event | None, seconds: float) -> None:
    if stop is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def pump(
    llm: KvEventsLLM,
    pipeline: BatchSubmitter,
    *,
    instance_id: str,
    incarnation: int = 0,
    tokens_per_block: int | None = None,
    mm_token_id_offset: int | None = None,
    default_window_size: int | None = None,
    stop: asyncio.Event | None = None,
    poll_timeout_s: float | None = 0.0,
    min_sleep_s: float = 0.005,
    max_sleep_s: float = 0.02,
    backoff: float = 1.5,
    max_events_per_read: int = 4096,
    reader: TrtllmEventReader | None = None,
    stats: PumpStats | None = None,
) -> PumpStats:
    """Stream a live TensorRT-LLM ``LLM``'s KV-cache events into ``pipeline``, in-process.

    The loop is NVIDIA Dynamo's TensorRT-LLM publisher's: call
    ``llm.get_kv_cache_events_async(poll_timeout_s)`` (default 0: return at once), iterate the
    result asynchronously, treat ``TimeoutError``/``QueueEmpty`` as "nothing more", and when a
    poll brought nothing sleep ``min_sleep_s``, growing by ``backoff`` up to ``max_sleep_s``
    (reset by the next event). Each drain (at most ``max_events_per_read`` events) is converted
    by one :class:`TrtllmEventReader` (``instance_id``, ``incarnation``, ``tokens_per_block``,
    ``mm_token_id_offset``, ``default_window_size``; or pass ``reader``) with
    :meth:`~TrtllmEventReader.read_tolerant` and each resulting batch is handed to
    ``pipeline.submit`` (any object with ``submit(batch) -> bool``;
    :class:`kvstream.pipeline.Pipeline` is one). Called on the pipeline's own event loop,
    ``Pipeline.submit`` never waits, so a ``block`` sink's full queue drops (and the pipeline
    accounts for it) rather than stalling; run the pump on another loop or thread to get
    backpressure.

    Never ended by bad input: a malformed event is counted and logged and the rest of its
    drain delivered; a poll that raises is counted and logged, and polling goes on. Ends when
    ``stop`` is set (checked between polls and during the idle sleep) and returns the
    :class:`PumpStats` (``stats`` if given, updated live); on cancellation the events already
    drained are submitted before ``CancelledError`` propagates.

    Raises :class:`~kvstream.errors.ConfigError` for bad arguments.
    """
    for name, value in (
        ("min_sleep_s", min_sleep_s),
        ("max_sleep_s", max_sleep_s),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
    if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not backoff >= 1:
        raise ConfigError(f"backoff must be a number >= 1, got {backoff!r}")
    if (
        isinstance(max_events_per_read, bool)
        or not isinstance(max_events_per_read, int)
        or max_events_per_read < 1
    ):
        raise ConfigError(f"max_events_per_read must be an int >= 1, got {max_events_per_read!r}")
    if reader is None:
        reader = TrtllmEventReader(
            instance_id=instance_id,
            incarnation=incarnation,
            tokens_per_block=tokens_per_block,
            mm_token_id_offset=mm_token_id_offset,
            default_window_size=default_window_size,
        )
    stats = PumpStats() if stats is None else stats
    run = _Pump(
        llm,
        pipeline,
        reader,
        stats,
        poll_timeout_s=poll_timeout_s,
        max_events_per_read=max_events_per_read,
    )
    sleep_s = float(min_sleep_s)
    while stop is None or not stop.is_set():
        if await run.poll():
            sleep_s = float(min_sleep_s)
            continue
        await _idle(stop, sleep_s)
        sleep_s = min(float(max_sleep_s), sleep_s * backoff)
    return stats

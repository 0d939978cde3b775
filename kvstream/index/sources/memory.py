"""Read batches straight from a :class:`~kvstream.sinks.memory.MemorySink` (no decoding).

The position is the sink's absolute log offset, so a consumer that restarts in the same
process (tests, simulations) resumes where it stopped; batches evicted from the sink's bounded
log before they were read are counted in ``stats.missed`` (the index then sees the gap in
event ids and marks the source stale).
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any, Protocol

from kvstream.events.model import EventBatch
from kvstream.index.errors import SourceError
from kvstream.index.sources.base import EventSource, SourceItem


class _Sink(Protocol):
    """What is used of :class:`kvstream.sinks.memory.MemorySink`."""

    @property
    def batches(self) -> list[EventBatch]: ...
    @property
    def is_shut_down(self) -> bool: ...
    async def position(self) -> int: ...


class _Cursor(Protocol):
    """What is used of :class:`kvstream.sinks.memory.MemorySubscription`."""

    missed: int

    def poll(self) -> EventBatch | None: ...
    async def get(self, timeout_s: float | None = None) -> EventBatch | None: ...


def _cursor(sink: _Sink, offset: int) -> _Cursor:
    # the sink adapters are found by name (kvstream.sinks maps to the top-level sinks/ dir)
    module = importlib.import_module("kvstream.sinks.memory")
    cursor: _Cursor = module.MemorySubscription(sink, offset)
    return cursor


__all__ = ["MemorySource"]


class MemorySource(EventSource):
    """Batches of ``sink`` from its oldest retained batch (``from_start``, default) or from
    now, or from ``resume_from`` (a :meth:`checkpoint`). With ``follow`` (default) it waits
    for new batches until the sink shuts down; without, it ends once caught up."""

    name = "memory"

    def __init__(
        self,
        sink: _Sink,
        *,
        from_start: bool = True,
        follow: bool = True,
        resume_from: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.sink = sink
        self.follow = follow
        self._from_start = from_start
        self._resume: int | None = None
        if resume_from is not None:
            if resume_from.get("kind") != "memory":
                raise SourceError(f"not a memory-source checkpoint: {resume_from!r}")
            self._resume = int(resume_from["offset"])
        self._sub: _Cursor | None = None
        self._start = 0
        self._read = 0

    async def start(self) -> None:
        """Place the cursor (the sink's log offsets are read here)."""
        if self._sub is not None:
            return
        end = await self.sink.position()
        if self._resume is not None:
            offset = self._resume
        elif self._from_start:
            offset = end - len(self.sink.batches)
        else:
            offset = end
        self._start = offset
        self._sub = _cursor(self.sink, offset)

    @property
    def offset(self) -> int:
        """Log offset of the next batch to read."""
        missed = 0 if self._sub is None else self._sub.missed
        return self._start + self._read + missed

    def poll(self) -> SourceItem | None:
        """The next batch if one is there (never waits; call :meth:`start` first)."""
        batch = self.poll_batch()
        return None if batch is None else SourceItem(batch)

    def poll_batch(self) -> EventBatch | None:
        """:meth:`poll`'s batch itself rather than an item (a memory source's items never
        skip events), with the same bookkeeping; for :meth:`IndexConsumer.drain
        <kvstream.index.consumer.IndexConsumer.drain>`."""
        sub = self._sub
        if sub is None:
            raise RuntimeError("start() the memory source before polling it")
        before = sub.missed
        batch = sub.poll()
        if sub.missed != before:
            self.stats.missed += sub.missed - before
        if batch is None:
            if not self.follow or self.sink.is_shut_down:
                self.ended = True
            return None
        self._read += 1
        self.stats.batches += 1
        return batch

    async def read(self, timeout_s: float | None = None) -> SourceItem | None:
        """The next batch, waiting up to ``timeout_s`` in follow mode."""
        await self.start()
        sub = self._sub
        assert sub is not None
        item = self.poll()
        if item is not None or self.ended:
            return item
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            remaining = None if deadline is None else max(deadline - loop.time(), 0.0)
            if remaining == 0.0:
                return None
            before = sub.missed
            batch = await sub.get(remaining)
            self.stats.missed += sub.missed - before
            if batch is not None:
                self._read += 1
                self.stats.batches += 1
                return SourceItem(batch)
            if self.sink.is_shut_down:
                self.ended = True
                return None
            if deadline is not None:
                return None

    def checkpoint(self) -> dict[str, Any]:
        """``{"kind": "memory", "offset": N}``."""
        return {"kind": "memory", "offset": self.offset}

"""How a replay's workers' events reach the router's index: pipeline -> sink -> source ->
:class:`~kvstream.index.IndexConsumer` (a memory sink by default, or Kafka)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from kvstream.events.deferred import AnyBatch
from kvstream.index import IndexConsumer, MemorySource, PrefixIndex
from kvstream.pipeline import Pipeline, PipelineConfig
from kvstream.sink import Sink, create_sink

__all__ = ["Transport"]


class Transport:
    """Batches from the workers -> pipeline -> sink -> source -> index consumer.

    ``sink`` is ``memory`` or ``kafka://HOST:PORT/TOPIC``. :meth:`publish` hands a batch to
    the pipeline (RuntimeError when it refuses one), :meth:`sync` applies delivered batches
    until the index is at most ``lag`` batches behind.

    The memory sink retains only the last :attr:`retained` batches (``max_lag`` + 256): once
    the index has applied a batch nothing needs it, and a log holding every batch of a
    replay keeps millions of event objects alive for the garbage collector to walk. So that
    no batch is ever evicted unread, :meth:`publish` first brings a backlog of ``max_lag`` +
    128 batches back to ``max_lag`` (128 publishes between two routing decisions: never seen
    in the shipped traces; with ``max_lag=0`` it changes nothing anyway, as routing catches
    up first). :meth:`sync` discards what the index applied at once, so a batch is freed
    while its objects are still in the CPU's caches.

    With the memory sink the pipeline hands a batch to the idle sink within
    :meth:`publish` (``Pipeline.put``'s fast path), so a routing step needs no trip through
    the event loop to see its workers' events applied.
    """

    def __init__(self, sink: str, index: PrefixIndex, *, max_lag: int = 0) -> None:
        self.index = index
        self.published = 0
        self.max_lag = max_lag
        self.retained = max_lag + 256
        self.sink: Sink
        self.consumer: IndexConsumer
        self.memory = sink == "memory"
        if self.memory:
            # (a kvstream.sinks.memory.MemorySink: sinks are found by name, not imported)
            # columns=1: the source reads the columns a deferred batch was handed over as, so
            # the index applies them and no model is built per block
            self._memory: Any = cast(
                Any, create_sink(f"memory?max_batches={self.retained}&columns=1")
            )
            self.sink = self._memory
            self._source = MemorySource(self._memory, from_start=False)
            self.consumer = IndexConsumer(self._source, index)
        else:
            self.sink = create_sink(_kafka_sink_url(sink))
            self.consumer = IndexConsumer(_kafka_source(sink), index)
        cfg = PipelineConfig.load(
            defaults={"linger_s": 0.0, "overflow": "block", "block_timeout_s": 30.0},
            handoff_timeout_s=60.0,
            close_timeout_s=60.0,
        )
        self.pipe = Pipeline([self.sink], cfg)

    async def start(self) -> None:
        """Start the sink, the pipeline and the source (30 s to reach the sink)."""
        await asyncio.wait_for(self.sink.start(), 30)
        await self.pipe.start()
        await self.consumer.source.start()

    async def publish(self, batch: AnyBatch | None) -> None:
        """Hand ``batch`` (None: nothing; a worker's deferred batch goes to the sink as its
        columns) to the pipeline."""
        if batch is None:
            return
        if self.memory and self.published - self.consumer.batches >= self.max_lag + 128:
            await self.sync(self.max_lag)  # see the class docstring
        if not await self.pipe.put(batch):
            raise RuntimeError("the pipeline refused a batch (sink down?)")
        self.published += 1

    async def sync(self, lag: int) -> None:
        """Apply delivered batches until the index is at most ``lag`` batches behind."""
        consumer = self.consumer
        if self.memory:
            spins = 0
            while True:
                if consumer.drain():
                    # applied: free them now, while their objects are still in the CPU's
                    # caches (the bounded log would free each one 256 batches later)
                    self._memory.discard_before(self._source.offset)
                if self.published - consumer.batches <= lag:
                    return
                spins += 1
                await asyncio.sleep(0 if spins < 100 else 0.001)
        while self.published - consumer.batches > lag:
            await consumer.catch_up(0.01)
        if lag:
            await consumer.catch_up(0.0)

    async def aclose(self) -> None:
        """Close the pipeline (delivering what it holds) and the source."""
        await self.pipe.aclose()
        await self.consumer.source.aclose()


def _kafka_sink_url(url: str) -> str:
    if "create_topic" in url or "partitions" in url:
        return url
    return f"{url}{'&' if '?' in url else '?'}partitions=1"


def _kafka_source(url: str) -> Any:
    """A reader of the sink URL's topic, with the sink's TLS/SASL settings (the sink's other
    options, partitions and the like, are not a reader's)."""
    from kvstream.index.sources.kafka import KafkaSource
    from kvstream.kafka_security import KafkaSecurity
    from kvstream.sink import parse_sink_url

    base = url.split("?", 1)[0]
    parsed = parse_sink_url(url)
    security = KafkaSecurity.from_options(parsed.params, where=parsed.raw)
    return KafkaSource.from_url(base, security=security)

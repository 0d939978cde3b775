"""``IndexConsumer.drain`` over a memory source applies the batches themselves
(``MemorySource.poll_batch``): the index, the consumer's counts and the source's position and
stats must be what applying ``poll()``'s items one by one gives."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from index_support import Producer, tokens
from kvstream.sinks.memory import MemorySink

from kvstream.events.model import EventBatch
from kvstream.index import IndexConsumer, MemorySource, PrefixIndex, WorkerKey
from kvstream.index.sources.base import SourceItem


def _stream(seed: int, n: int) -> list[EventBatch]:
    rng = random.Random(seed)
    producers = [Producer(f"w{i}", algo="blake3_64") for i in range(3)]
    out = [p.batch(p.created()) for p in producers]
    for i in range(n):
        p = rng.choice(producers)
        hs = p.chain(tokens(8, seed=1) + tokens(4 * rng.randint(1, 6), seed=i + 2))
        if rng.random() < 0.3:
            out.append(p.batch(p.removed(hs[rng.randint(0, len(hs) - 1) :][::-1])))
        else:
            out.append(p.batch(p.stored(hs)))
    return out


class ItemConsumer(IndexConsumer):
    """Applies through ``apply(item)``, as drain does for sources without ``poll_batch``
    (overriding apply turns the batch path off)."""

    def apply(self, item: SourceItem) -> None:
        super().apply(item)


def _state(c: IndexConsumer) -> tuple[object, ...]:
    src = c.source
    assert isinstance(src, MemorySource)
    matches = [
        [m.usable_blocks for m in c.index.match(tokens(8, seed=1) + tokens(24, seed=s)).matches]
        for s in range(2, 12)
    ]
    info = []
    for i in range(3):
        try:
            w = c.index.info(WorkerKey(f"w{i}"))
        except KeyError:  # its batches were evicted before anything of it was read
            info.append(None)
        else:
            info.append((w.stale, w.stale_reason))
    return (
        c.batches,
        src.offset,
        src.stats.batches,
        src.stats.missed,
        src.ended,
        c.index.stats().as_dict(),
        matches,
        info,
    )


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(0, 40),
    cut=st.lists(st.integers(1, 12), max_size=6),
    retained=st.sampled_from([None, 3, 8]),
)
async def test_drain_applies_what_the_items_would(
    seed: int, n: int, cut: list[int], retained: int | None
) -> None:
    stream = _stream(seed, n)
    sinks = [MemorySink(max_batches=retained) for _ in range(2)]
    consumers = [
        IndexConsumer(MemorySource(sinks[0], from_start=False), PrefixIndex()),
        ItemConsumer(MemorySource(sinks[1], from_start=False), PrefixIndex()),
    ]
    for c in consumers:
        await c.source.start()
    pos = 0
    for k in [*cut, len(stream)]:  # export a slice, drain, repeat (evictions in between)
        part = stream[pos : pos + k]
        pos += k
        got = []
        for sink, c in zip(sinks, consumers, strict=True):
            await sink.export(part)
            got.append(c.drain())
        assert got[0] == got[1]
        assert _state(consumers[0]) == _state(consumers[1])
    for sink in sinks:
        await sink.shutdown()
    assert [c.drain() for c in consumers] == [0, 0]
    assert _state(consumers[0]) == _state(consumers[1])
    assert consumers[0].source.ended


async def test_poll_batch_and_poll_read_the_same_batches() -> None:
    stream = _stream(1, 10)
    sink = MemorySink(max_batches=None)
    await sink.export(stream)
    a, b = MemorySource(sink), MemorySource(sink)
    await a.start()
    await b.start()
    got_a = [a.poll_batch() for _ in stream]
    got_b = [item.batch if (item := b.poll()) is not None else None for _ in stream]
    assert got_a == got_b == stream
    assert a.poll_batch() is None
    assert b.poll() is None
    assert a.checkpoint() == b.checkpoint() == {"kind": "memory", "offset": len(stream)}

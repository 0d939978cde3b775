"""The index's fast path: columns from the sources, the C store loop, and the model path they
replace give identical index state."""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_support import Producer, tokens

from kvstream.codec import AvroCodec, ContainerWriter, read_container
from kvstream.codec.columnar import ColumnarContainerReader
from kvstream.events.columns import ColumnBatch
from kvstream.events.model import (
    Cleared,
    Created,
    EventBatch,
    EventDiff,
    KVCacheEvent,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
    Updated,
)
from kvstream.index import FileSource, IndexConsumer, PrefixIndex
from kvstream.index import table as table_module
from kvstream.index.sources import SourceItem, decode_message

POOL = [bytes([i]) * 8 for i in range(1, 13)]
_hash = st.sampled_from(POOL)


@st.composite
def _event(draw: st.DrawFn, eid: int) -> KVCacheEvent:
    kind = draw(st.sampled_from(["stored", "stored", "stored", "removed", "updated", "cleared"]))
    data: Any
    if kind == "stored":
        n = draw(st.integers(1, 6))
        levels = draw(
            st.one_of(
                st.integers(0, 4).map(lambda lv: [lv] * n),
                st.lists(st.integers(0, 4), min_size=n, max_size=n),
            )
        )
        blocks = tuple(
            StoredBlock(block_hash=draw(_hash), token_ids=[1, 2, 3, 4], cache_level=lv)
            for lv in levels
        )
        data = Stored(parent_hash=draw(st.one_of(st.none(), _hash)), blocks=blocks)
    elif kind == "removed":
        data = Removed(
            block_hashes=tuple(draw(st.lists(_hash, min_size=1, max_size=4))),
            cache_level=draw(st.one_of(st.none(), st.integers(0, 4))),
        )
    elif kind == "updated":
        diff = EventDiff(old_value=draw(st.integers(0, 4)), new_value=draw(st.integers(0, 4)))
        data = Updated(block_hash=draw(_hash), cache_level=diff)
    else:
        data = Cleared()
    return KVCacheEvent(
        event_id=eid,
        hash_algo="blake3_64",
        layer_group_id=draw(st.integers(0, 1)),
        window_size=64,
        data=data,
    )


@st.composite
def streams(draw: st.DrawFn) -> list[EventBatch]:
    out = []
    eid = 0
    for w in range(draw(st.integers(1, 3))):
        src = SourceId(instance_id=f"w{w}", incarnation=1)
        created = KVCacheEvent(
            event_id=0,
            hash_algo="blake3_64",
            window_size=64,
            data=Created(num_blocks_per_cache_level=(8, 4), tokens_per_block=4),
        )
        evs = [created]
        eid = 1
        for _ in range(draw(st.integers(0, 30))):
            evs.append(draw(_event(eid)))
            eid += 1
        for i in range(0, len(evs), 4):
            out.append(EventBatch(source=src, ts_ns=1, events=tuple(evs[i : i + 4])))
    return draw(st.permutations(out)) if draw(st.booleans()) else out


def _state(batches: list[Any], native: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    with monkeypatch.context() as m:
        if not native:
            m.setattr(table_module, "_native", None)
        idx = PrefixIndex()
        idx.apply_many(batches)
        idx.check()
        return idx.canonical_state()


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(stream=streams())
def test_columns_native_and_python_loops_build_the_same_index(
    stream: list[EventBatch], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Model batches (Python loop), their columns decoded from Avro (C loop when built, and
    the Python loop): identical state, counters included."""
    codec = AvroCodec()
    decoded = [decode_message(codec, codec.encode(b)).columns for b in stream]
    want = _state(stream, False, monkeypatch)
    assert _state(decoded, True, monkeypatch) == want
    assert _state(decoded, False, monkeypatch) == want
    assert _state([ColumnBatch.from_batch(b) for b in stream], True, monkeypatch) == want


def test_native_loop_is_built() -> None:
    """The native table is part of a normal build (the fallback is only for machines without
    a compiler)."""
    if os.environ.get("KVSTREAM_NO_NATIVE", "") not in ("", "0"):
        pytest.skip("KVSTREAM_NO_NATIVE: the Python twin by request")
    assert table_module.native_table_type() is not None


def worker_stream(p: Producer, n: int) -> list[EventBatch]:
    out = [p.batch(p.created(capacity=(64,)))]
    for i in range(n):
        hs = p.chain(tokens(8, seed=1) + tokens(16, seed=i + 2))
        if i % 3 == 2:
            out.append(p.batch(p.removed(hs[3:][::-1]), p.stored(hs[2:], parent=hs[1])))
        else:
            out.append(p.batch(p.stored(hs)))
    return out


async def test_file_source_hands_columns_to_the_consumer(tmp_path: Path) -> None:
    stream = worker_stream(Producer("a"), 10) + worker_stream(Producer("b", rank=1), 10)
    path = tmp_path / "kvstream-0001.avro"
    with ContainerWriter(path, sync_interval=2000) as w:
        w.write_many(stream)
    consumer = IndexConsumer(FileSource(tmp_path))
    async with consumer.source:
        await consumer.run()
    ref = PrefixIndex()
    ref.apply_many(stream)
    assert consumer.index.canonical_state() == ref.canonical_state()
    source = FileSource(tmp_path)
    async with source:
        item = await source.read()
    assert item is not None
    assert item.columns is not None
    assert item.batch == stream[0]
    assert item == SourceItem(stream[0])


def test_token_mode_applies_columns_through_the_model() -> None:
    p = Producer("t", algo="v2_sha256_64")
    stream = worker_stream(p, 8)
    buf = io.BytesIO()
    with ContainerWriter(buf) as w:
        w.write_many(stream)
    cols = list(ColumnarContainerReader(io.BytesIO(buf.getvalue())))
    a = PrefixIndex(key_mode="tokens")
    a.apply_many(cols)
    b = PrefixIndex(key_mode="tokens")
    b.apply_many(read_container(io.BytesIO(buf.getvalue())))
    assert a.canonical_state() == b.canonical_state()
    hs = p.chain(tokens(8, seed=1) + tokens(16, seed=9))
    assert a.match(tokens(8, seed=1) + tokens(16, seed=9)).best is not None
    assert len(hs) == 6


def test_token_table_needs_blocks() -> None:
    from kvstream.index.stats import SourceStats
    from kvstream.index.token_table import TokenGroupTable

    with pytest.raises(TypeError, match="tokens"):
        TokenGroupTable(1).store_hashes(None, [POOL[0]], 0, SourceStats())


def test_memory_and_event_loop_unaffected() -> None:
    """Model batches still apply as before (sources without bytes hand models over)."""
    stream = worker_stream(Producer("m"), 5)
    idx = PrefixIndex()
    for b in stream:
        idx.apply(SourceItem(b).data)
    assert asyncio.iscoroutinefunction(IndexConsumer.run)
    assert idx.stats().counters.stored_blocks == sum(
        len(ev.data.blocks)  # type: ignore[union-attr]
        for b in stream
        for ev in b.events
        if ev.data.type == "stored"
    )

"""Sources: file-sink files (every schema version, files still being written, damage),
the memory sink, and a consumer that snapshots and resumes."""

from __future__ import annotations

import asyncio
import io
from collections import deque
from pathlib import Path

import pytest
from index_support import Producer, tokens
from kvstream.sinks.file import FileSink
from kvstream.sinks.memory import MemorySink

from kvstream.codec import ContainerWriter
from kvstream.events.model import CURRENT_SCHEMA_VERSION, EventBatch
from kvstream.index import (
    FileSource,
    IndexConsumer,
    MemorySource,
    PrefixIndex,
    WorkerKey,
    open_source,
)
from kvstream.index.sources import attribute_skipped


def worker_stream(name: str = "w0", n: int = 12, algo: str = "v2_sha256_64") -> list[EventBatch]:
    """A plausible stream: created, then stores and removals of growing requests."""
    p = Producer(name, algo=algo)
    out = [p.batch(p.created())]
    for i in range(n):
        hs = p.chain(tokens(8, seed=1) + tokens(16, seed=i + 2))
        if i % 3 == 2:
            out.append(p.batch(p.removed(hs[3:][::-1]), p.stored(hs[2:], parent=hs[1])))
        else:
            out.append(p.batch(p.stored(hs)))
    return out


def reference(batches: list[EventBatch], **kw: object) -> PrefixIndex:
    idx = PrefixIndex(**kw)  # type: ignore[arg-type]
    for b in batches:
        idx.apply(b)
    return idx


def write_blocks(
    path: Path,
    batches: list[EventBatch],
    per_block: int = 2,
    version: int = CURRENT_SCHEMA_VERSION,
) -> list[int]:
    """A container file with ``per_block`` batches per block; returns each block's end."""
    ends = []
    w = ContainerWriter(path, schema_version=version, append=False, sync_interval=1 << 30)
    for i, b in enumerate(batches, 1):
        w.write(b)
        if i % per_block == 0 or i == len(batches):
            w.flush()
            ends.append(path.stat().st_size)
    w.close()
    return ends


async def drain(
    source: FileSource | MemorySource, index: PrefixIndex | None = None
) -> list[EventBatch]:
    out = []
    async for item in source:
        out.append(item.batch)
        if index is not None:
            index.apply(item.batch, item.skipped_ids)
    return out


@pytest.mark.parametrize("version", [1, 2, 3, 4])
async def test_file_source_reads_every_schema_version(tmp_path: Path, version: int) -> None:
    algo = "v1_block_key" if version == 1 else "v2_sha256_64"
    stream = worker_stream(algo=algo)
    write_blocks(tmp_path / "kvstream-a.avro", stream, per_block=3, version=version)
    idx = PrefixIndex(default_tokens_per_block=4)
    src = FileSource(tmp_path)
    got = await drain(src, idx)
    assert len(got) == len(stream)
    assert src.ended
    want = reference(stream, default_tokens_per_block=4)
    probe = tokens(8, seed=1) + tokens(16, seed=3)
    assert idx.match(probe).as_list()[0]["matched_blocks"] == 5  # 23 tokens: 5 full blocks
    if version >= 2:
        assert idx.canonical_state() == want.canonical_state()
    else:  # v1 has no block size in created events: the decoder skips them, not a gap
        assert src.stats.skipped_events == 1
        info = idx.info(WorkerKey("w0"))
        assert not info.stale
        assert info.stats.skipped_events == 1
        assert idx.match(probe).as_list() == want.match(probe).as_list()


async def test_file_source_follows_a_file_while_it_is_written(tmp_path: Path) -> None:
    """Bytes of a finished file are copied over in odd-sized pieces, cutting blocks anywhere;
    a following source yields every batch exactly once, in order."""
    stream = worker_stream(n=20)
    full = tmp_path / "full.avro"
    write_blocks(full, stream, per_block=3)
    data = full.read_bytes()
    live = tmp_path / "live" / "kvstream-1.avro"
    live.parent.mkdir()
    live.write_bytes(b"")
    src = FileSource(live.parent, follow=True, poll_interval_s=0.001)
    got: list[EventBatch] = []
    for i in range(0, len(data), 97):
        with open(live, "ab") as f:
            f.write(data[i : i + 97])
        while (item := await src.read(0.0)) is not None:
            got.append(item.batch)
    assert got == stream
    assert src.stats.malformed == 0
    assert src.stats.torn == 0
    assert not src.ended
    src2 = FileSource(live.parent, follow=True, poll_interval_s=0.001, idle_timeout_s=0.01)
    assert len(await drain(src2)) == len(stream)
    assert src2.ended


async def test_file_source_follows_the_file_sink_across_rotations(tmp_path: Path) -> None:
    sink = FileSink(tmp_path, rotate_bytes=600, rotate_s=None)
    await sink.start()
    stream = worker_stream(n=30)
    src = FileSource(tmp_path, follow=True, poll_interval_s=0.001)
    idx = PrefixIndex()
    seen = 0
    for i in range(0, len(stream), 4):
        assert (await sink.export(stream[i : i + 4])).ok
        while (item := await src.read(0.0)) is not None:
            idx.apply(item.batch, item.skipped_ids)
            seen += 1
    await sink.shutdown()
    assert len(sink.paths) > 3  # it rotated
    assert seen == len(stream)
    assert idx.canonical_state() == reference(stream).canonical_state()


async def test_resume_from_a_checkpoint_inside_a_block(tmp_path: Path) -> None:
    stream = worker_stream(n=14)
    write_blocks(tmp_path / "kvstream-1.avro", stream[:8], per_block=3)
    write_blocks(tmp_path / "kvstream-2.avro", stream[8:], per_block=3)
    for cut in range(len(stream) + 1):
        src = FileSource(tmp_path)
        first = [(await src.read()) for _ in range(cut)]
        ckpt = src.checkpoint()
        rest = await drain(FileSource(tmp_path, resume_from=ckpt))
        assert [i.batch for i in first if i] + rest == stream, cut


async def test_corrupt_block_is_skipped_and_counted(tmp_path: Path) -> None:
    stream = worker_stream(n=9)
    path = tmp_path / "kvstream-1.avro"
    ends = write_blocks(path, stream, per_block=2)
    raw = bytearray(path.read_bytes())
    mid = (ends[1] + ends[2]) // 2  # inside the third block
    raw[mid - 20 : mid] = b"\xff" * 20
    path.write_bytes(bytes(raw))
    src = FileSource(tmp_path)
    got = await drain(src)
    assert got == stream[:4] + stream[6:]
    assert src.stats.malformed == 1
    assert src.recent_malformed[0].where == f"kvstream-1.avro@{ends[1]}"


async def test_torn_tail_of_a_finished_file_is_counted(tmp_path: Path) -> None:
    stream = worker_stream(n=5)
    path = tmp_path / "kvstream-1.avro"
    ends = write_blocks(path, stream, per_block=2)
    with open(path, "r+b") as f:
        f.truncate(ends[-2] + 5)
    src = FileSource(tmp_path)
    assert await drain(src) == stream[:4]
    assert src.stats.torn == 1


async def test_jsonl_files_and_bad_lines(tmp_path: Path) -> None:
    stream = worker_stream(n=4)
    lines = [b.model_dump_json().encode() for b in stream]
    lines.insert(2, b'{"not": "a batch"}')
    (tmp_path / "kvstream-1.jsonl").write_bytes(b"\n".join(lines) + b"\n" + lines[-1][:10])
    src = FileSource(tmp_path)
    assert await drain(src) == stream
    assert src.stats.malformed == 1
    assert src.stats.torn == 1


async def test_not_a_container_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "kvstream-0.avro").write_bytes(b"garbage that is not avro at all")
    write_blocks(tmp_path / "kvstream-1.avro", worker_stream(n=2))
    src = FileSource(tmp_path)
    assert len(await drain(src)) == 3
    assert src.stats.malformed == 1


async def test_memory_source_from_start_follow_and_resume() -> None:
    sink = MemorySink(max_batches=None)
    stream = worker_stream(n=6)
    await sink.export(stream[:3])
    src = MemorySource(sink)
    await src.start()
    assert [src.poll().batch for _ in range(3)] == stream[:3]  # type: ignore[union-attr]
    assert src.poll() is None
    assert not src.ended
    ckpt = src.checkpoint()
    assert ckpt == {"kind": "memory", "offset": 3}
    reader = asyncio.ensure_future(drain(MemorySource(sink, resume_from=ckpt)))
    await sink.export(stream[3:])
    await asyncio.sleep(0.01)
    await sink.shutdown()
    assert await reader == stream[3:]


async def test_memory_source_counts_evicted_batches() -> None:
    sink = MemorySink(max_batches=2)
    stream = worker_stream(n=5)
    src = MemorySource(sink, follow=False)
    await src.start()
    await sink.export(stream)
    idx = PrefixIndex()
    got = await drain(src, idx)
    assert got == stream[-2:]
    assert src.stats.missed == len(stream) - 2
    assert idx.info(WorkerKey("w0")).stale  # the index saw the id gap


def test_attribute_skipped_ids_to_batches() -> None:
    p = Producer()
    created = p.created()  # id 0, skipped by the decoder
    b1 = p.batch(p.stored(p.chain(tokens(8))))  # id 1
    pending = deque([0])
    assert attribute_skipped(b1, pending) == (0,)
    assert not pending
    p.skip()  # id 2 skipped inside the next batch
    b2 = p.batch(p.stored(p.chain(tokens(8))), p.cleared())  # ids 3, 4 (hole at 2)
    q = Producer("other")
    b3 = q.batch()  # empty: all its events skipped (ids 0, 1)
    pending = deque([2, 0, 1])
    assert attribute_skipped(b2, pending) == (2,)
    assert attribute_skipped(b3, pending) == (0, 1)
    assert not pending
    del created


async def test_consumer_snapshots_and_a_restarted_consumer_resumes(tmp_path: Path) -> None:
    streams = [worker_stream(f"w{i}", n=10) for i in range(3)]
    merged = [b for group in zip(*streams, strict=True) for b in group]
    data = tmp_path / "data"
    data.mkdir()
    write_blocks(data / "kvstream-1.avro", merged[:17], per_block=4)
    write_blocks(data / "kvstream-2.avro", merged[17:], per_block=4)
    snap = tmp_path / "idx.snap"

    def make(ckpt: dict[str, object] | None) -> FileSource:
        return FileSource(data, resume_from=ckpt)

    first = IndexConsumer.resume(snap, make)
    report = await first.run(max_batches=13, snapshot_every_batches=5)
    assert report.batches == 13
    assert report.snapshots == 3
    second = IndexConsumer.resume(snap, make)
    assert second.index.canonical_state() == first.index.canonical_state()
    report = await second.run()
    assert report.ended
    assert report.batches == len(merged) - 13
    assert second.index.canonical_state() == reference(merged).canonical_state()


def test_open_source_chooses_by_spec(tmp_path: Path) -> None:
    assert isinstance(open_source(tmp_path), FileSource)
    assert isinstance(open_source(f"file://{tmp_path}"), FileSource)
    from kvstream.index import SourceError

    with pytest.raises(SourceError):
        open_source("s3://bucket/x")
    k = open_source("kafka://127.0.0.1:1/topic?partitions=0,2&schema_ids=7:2")
    assert k.name == "kafka:topic"
    assert k.partitions == [0, 2]
    assert k.schema_ids == {7: 2}


def test_spliced_reader_reads_across_the_header() -> None:
    from kvstream.index.sources.file import _Spliced

    raw = io.BufferedReader(_Spliced(b"head", io.BytesIO(b"xxbody"), 2))
    assert raw.read() == b"headbody"

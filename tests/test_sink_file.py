"""The file sink: Avro container files any Avro tool reads, rotation, durability, torn files."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from pathlib import Path

import fastavro
import pytest
from kvstream.sinks import file as file_sink
from kvstream.sinks.file import FileSink, ReadReport, list_files, read_dir, read_file
from pipeline_helpers import batches_for, check_contiguous, source, stream_ids

from kvstream.clock import ManualClock
from kvstream.errors import DecodeError, PermanentSinkError
from kvstream.events.model import CURRENT_SCHEMA_VERSION, EventBatch
from kvstream.pipeline import Pipeline, PipelineConfig
from kvstream.sink import ExportStatus


async def write_blocks(sink: FileSink, blocks: list[list[EventBatch]]) -> list[int]:
    """Export each list as one block; returns the file size after each export."""
    await sink.start()
    sizes = []
    for block in blocks:
        assert (await sink.export(block)).ok
        sizes.append(sink.paths[-1].stat().st_size)
    return sizes


async def test_files_are_plain_avro_containers(tmp_path: Path) -> None:
    sink = FileSink(tmp_path, codec="deflate")
    batches = batches_for(source(), 50, 5, stored=True)
    await write_blocks(sink, [batches[:4], batches[4:]])
    await sink.shutdown()
    (path,) = list_files(tmp_path)
    with open(path, "rb") as fh:
        reader = fastavro.reader(fh)
        records = list(reader)
        assert reader.metadata["avro.codec"] == "deflate"
        assert reader.metadata["kvstream.schema_version"] == str(CURRENT_SCHEMA_VERSION)
    assert len(records) == 10
    assert list(read_dir(tmp_path, tolerate_torn_tail=False)) == batches


async def test_rotation_by_size_and_time_and_names_sort_by_time(tmp_path: Path) -> None:
    clock = ManualClock(start_ns=1_700_000_000_000_000_000)
    sink = FileSink(tmp_path, rotate_bytes=2000, rotate_s=3600, clock=clock)
    batches = batches_for(source(), 400, 4, stored=True)
    await sink.start()
    for b in batches:
        clock.advance(1_000_000)
        assert (await sink.export([b])).ok
    assert len(sink.paths) > 3
    assert sink.paths == list_files(tmp_path)  # creation order == name order
    assert list(read_dir(tmp_path)) == batches
    assert sink.paths[0].name.startswith("kvstream-20231114T221320.001000Z-")
    await sink.shutdown()

    timed = FileSink(tmp_path / "t", rotate_bytes=None, rotate_s=0.05)
    await timed.start()
    assert (await timed.export(batches[:1])).ok
    await asyncio.sleep(0.06)
    assert (await timed.export(batches[1:2])).ok
    assert len(timed.paths) == 2
    await timed.shutdown()


@pytest.mark.parametrize("fmt", ["avro", "jsonl"])
async def test_a_file_torn_anywhere_in_its_last_block_keeps_every_earlier_batch(
    tmp_path: Path, fmt: str
) -> None:
    """(JSON Lines recovers every complete line of the torn export too.)"""
    sink = FileSink(tmp_path / "src", format=fmt)  # type: ignore[arg-type]
    batches = batches_for(source(), 26, 3, stored=True)
    blocks = [batches[:4], batches[4:7], batches[7:]]  # the last block: 2 batches, 5 events
    sizes = await write_blocks(sink, blocks)
    await sink.shutdown()
    (path,) = list_files(tmp_path / "src")
    data = path.read_bytes()
    assert len(data) == sizes[-1]
    earlier = blocks[0] + blocks[1]
    torn_dir = tmp_path / "torn"
    torn_dir.mkdir()
    torn = torn_dir / path.name
    for cut in range(sizes[1], sizes[2]):
        torn.write_bytes(data[:cut])
        report = ReadReport()
        got = list(read_dir(torn_dir, report=report))
        assert got[: len(earlier)] == earlier, f"cut at byte {cut}"
        assert got == batches[: len(got)]  # never a garbled or reordered batch
        if fmt == "avro":  # a block is all or nothing
            assert len(got) == len(earlier)
            if cut > sizes[1]:
                assert report.torn == {path.name: cut - sizes[1]}
                with pytest.raises(DecodeError):
                    list(read_file(torn, tolerate_torn_tail=False))


async def test_a_torn_header_yields_nothing_and_does_not_raise(tmp_path: Path) -> None:
    sink = FileSink(tmp_path)
    await write_blocks(sink, [batches_for(source(), 3, 3)])
    await sink.shutdown()
    (path,) = list_files(tmp_path)
    path.write_bytes(path.read_bytes()[:10])
    assert list(read_dir(tmp_path)) == []


async def test_failed_write_is_cut_back_and_the_next_export_starts_a_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(test_file_faults does this with a real file-size limit and a full tmpfs.)"""
    sink = FileSink(tmp_path)
    batches = batches_for(source(), 40, 4, stored=True)
    (size,) = await write_blocks(sink, [batches[:3]])
    real_write_all = file_sink._write_all

    def half_write(fd: int, data: bytes) -> None:
        real_write_all(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_sink, "_write_all", half_write)
    result = await sink.export(batches[3:6])
    assert result.status is ExportStatus.RETRIABLE
    assert "No space" in result.reason
    assert sink.paths[0].stat().st_size == size  # cut back to its last complete block
    assert not (await sink.export(batches[3:])).ok  # a new file cannot be created either
    assert list(tmp_path.iterdir()) == sink.paths  # and leaves nothing behind
    monkeypatch.setattr(file_sink, "_write_all", real_write_all)
    assert (await sink.export(batches[3:])).ok  # the pipeline's retry
    await sink.shutdown()
    assert len(list_files(tmp_path)) == 2
    assert list(read_dir(tmp_path, tolerate_torn_tail=False)) == batches


async def test_flush_and_close_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    sink = FileSink(tmp_path)
    await write_blocks(sink, [batches_for(source(), 2, 2)])
    assert synced == []  # exports flush to the OS only
    assert await sink.force_flush()
    assert len(synced) == 2  # the file and the directory
    await sink.shutdown()
    assert len(synced) >= 3
    per_export = FileSink(tmp_path / "x", fsync_every_export=True)
    await write_blocks(per_export, [batches_for(source(), 2, 2)])
    assert len(synced) >= 5
    await per_export.shutdown()


async def test_unusable_directory_is_a_permanent_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    sink = FileSink(blocker / "sub")
    with pytest.raises(PermanentSinkError):
        await sink.start()
    result = await sink.export(batches_for(source(), 1, 1))
    assert result.status is ExportStatus.PERMANENT


async def test_pipeline_into_files_survives_a_crash_mid_write(tmp_path: Path) -> None:
    src = source()
    sink = FileSink(tmp_path / "kv", rotate_bytes=3000)
    async with Pipeline([sink], PipelineConfig.load(defaults={"linger_s": 0})) as pipe:
        for b in batches_for(src, 300, 3, stored=True):
            pipe.submit(b)
            await asyncio.sleep(0)
        assert await pipe.flush(5)
    files = list_files(tmp_path / "kv")
    assert len(files) > 1
    check_contiguous(stream_ids(read_dir(tmp_path / "kv"))[src], 300)
    # "crash" in the middle of the last file's last block: every earlier batch survives
    crashed = tmp_path / "crashed"
    shutil.copytree(tmp_path / "kv", crashed)
    last = list_files(crashed)[-1]
    last.write_bytes(last.read_bytes()[:-7])
    spans = stream_ids(read_dir(crashed))[src]
    assert spans == stream_ids(read_dir(tmp_path / "kv"))[src][: len(spans)]
    assert len(spans) > 0

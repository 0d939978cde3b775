"""The file sink under real faults: a full disk, a file-size limit, kill -9 of the writer, and
flipped bytes. Every file left behind must be a complete Avro container that fastavro and
Apache avro read (a killed writer's last file may end in a torn block that readers skip), and
every batch an export acknowledged must be in it; a flipped byte is damage, never data."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import avro.datafile
import avro.io
import fastavro
import pytest
from kvstream.sinks.file import FileSink, read_file
from pipeline_helpers import batches_for, check_contiguous, source, stream_ids

from kvstream.codec import read_container
from kvstream.errors import DecodeError
from kvstream.events.model import EventBatch
from kvstream.index.sources.file import FileSource

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def _fastavro_count(path: Path) -> int:
    with path.open("rb") as fo:
        return sum(1 for _ in fastavro.reader(fo))


def _apache_avro_count(path: Path) -> int:
    with path.open("rb") as fo, avro.datafile.DataFileReader(fo, avro.io.DatumReader()) as r:
        return sum(1 for _ in r)


def _check_files(
    directory: Path, torn_ok: set[str] | None = None, apache: set[str] | None = None
) -> list[EventBatch]:
    """Every entry in ``directory`` is a non-empty, complete container readable by kvstream,
    fastavro and Apache avro (only the files in ``apache``, when given; files in ``torn_ok``
    may end in a torn block instead); returns the batches in file-name order."""
    out: list[EventBatch] = []
    for path in sorted(directory.iterdir()):
        assert path.name.startswith("kvstream-"), path.name
        assert path.suffix == ".avro", path.name
        assert path.stat().st_size > 0, f"{path.name} is empty"
        if torn_ok is not None and path.name in torn_ok:
            out += read_file(path)
            continue
        batches = list(read_file(path, tolerate_torn_tail=False))
        assert batches, f"{path.name} holds no batch"
        assert _fastavro_count(path) == len(batches), path.name
        if apache is None or path.name in apache:
            assert _apache_avro_count(path) == len(batches), path.name
        out += batches
    return out


# ----------------------------------------------------------------------------- flipped bytes


async def _three_exports(directory: Path) -> list[EventBatch]:
    """A default file sink file of three blocks (2, 1 and 2 batches)."""
    sink = FileSink(directory)
    await sink.start()
    batches = batches_for(source(), 10, 2, stored=True)
    for chunk in (batches[:2], batches[2:3], batches[3:]):
        assert (await sink.export(chunk)).ok
    await sink.shutdown()
    return batches


def _flips(data: bytes, header: int) -> Iterator[tuple[int, bytes]]:
    """Every byte of the blocks and 100 sampled bytes of the (12 KB, mostly schema) header,
    each flipped with a random mask (one bit or several)."""
    rng = random.Random(5)
    for pos in sorted(rng.sample(range(header), 100)) + list(range(header, len(data))):
        flipped = bytearray(data)
        flipped[pos] ^= rng.choice((1 << rng.randrange(8), rng.randrange(1, 256)))
        yield pos, bytes(flipped)


async def test_every_flipped_byte_is_damage_or_harmless(tmp_path: Path) -> None:
    """The file sink's default files are checksummed: a flipped byte anywhere in a
    multi-block file makes the reader stop at that block and report it (the strict reader
    raises DecodeError there), or leaves every decoded batch identical."""
    batches = await _three_exports(tmp_path)
    (path,) = tmp_path.iterdir()
    data = path.read_bytes()
    with read_container(path) as reader:
        header = reader.valid_end
    silent = []
    tried = 0
    for pos, flipped in _flips(data, header):
        tried += 1
        try:
            reader = read_container(io.BytesIO(flipped), tolerate_torn_tail=True)
            got = list(reader)
        except DecodeError:  # a damaged header: nothing is decoded
            continue
        if got != batches[: len(got)] or (len(got) < len(batches) and reader.torn_reason is None):
            silent.append(pos)
        elif reader.torn_reason is not None:
            with pytest.raises(DecodeError):
                list(read_container(io.BytesIO(flipped)))
    assert silent == [], f"{len(silent)} of {tried} flips decoded as other batches"


async def test_the_file_source_counts_a_flipped_block_as_damage(tmp_path: Path) -> None:
    """A flip inside the middle block: the source skips exactly that block and counts it."""
    batches = await _three_exports(tmp_path)
    (path,) = tmp_path.iterdir()
    data = bytearray(path.read_bytes())
    ends = []
    with read_container(path) as reader:
        for _ in reader:
            ends.append(reader.valid_end)
    rng = random.Random(14)
    for pos in rng.sample(range(ends[1] + 2, ends[2] - 16), 10):  # the data of block 2
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        path.write_bytes(bytes(flipped))
        src = FileSource(tmp_path)
        got = [item.batch async for item in src]
        assert got == batches[:2] + batches[3:], pos
        assert src.stats.malformed == 1, pos


# -------------------------------------------------------------------------- full disk, EFBIG

_LIMITED_WRITER = r"""
import asyncio, json, resource, signal, sys
sys.path.insert(0, sys.argv[1])
from pipeline_helpers import batches_for, check_contiguous, source, stream_ids
from kvstream.sinks.file import FileSink

async def main(directory, limit, retries):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    sink = FileSink(directory, rotate_bytes=None)
    await sink.start()
    batches = batches_for(source(), 900, 3, stored=True)
    acked, failures = [], 0
    for i in range(0, len(batches), 5):
        for _ in range(retries):
            result = await sink.export(batches[i : i + 5])
            if result.ok:
                acked.append(i)
                break
            failures += 1
    await sink.shutdown()
    print(json.dumps({"acked": acked, "failures": failures}))

asyncio.run(main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""


def _run_limited(directory: Path, limit: int, retries: int) -> dict[str, list[int] | int]:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _LIMITED_WRITER,
            str(TESTS),
            str(directory),
            str(limit),
            str(retries),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    result: dict[str, list[int] | int] = json.loads(out.stdout)
    return result


def _acked_batches(acked: list[int]) -> list[EventBatch]:
    batches = batches_for(source(), 900, 3, stored=True)
    return [b for i in acked for b in batches[i : i + 5]]


def test_a_write_past_the_file_size_limit_is_cut_back_and_rotated(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel write part of a block and then fail with EFBIG: the file
    must be cut back to its last complete block (every tool reads it) and the export goes on
    in a new file, without failing; exactly the acknowledged batches are on disk."""
    result = _run_limited(tmp_path, 20_000, retries=3)
    acked = result["acked"]
    assert isinstance(acked, list)
    assert result["failures"] == 0  # EFBIG is per file: rotating fixes it
    assert len(acked) == 60
    assert len(list(tmp_path.iterdir())) > 2
    assert all(p.stat().st_size <= 20_000 for p in tmp_path.iterdir())
    assert _check_files(tmp_path) == _acked_batches(acked)


_LIMITED_PIPELINE = r"""
import asyncio, json, resource, signal, sys
sys.path.insert(0, sys.argv[1])
from pipeline_helpers import batches_for, make_batch, source
from kvstream.pipeline import Pipeline, PipelineConfig
from kvstream.sinks.file import FileSink

async def main(directory, limit, huge_at):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    batches = batches_for(source(), 3_000, 5, stored=True)
    if huge_at >= 0:  # one batch of 3,000 events, too large for any file under the limit
        first = 5 * huge_at
        batches[huge_at:] = [make_batch(source(), first, 3_000, stored=True)] + [
            make_batch(source(), i, 5, stored=True) for i in range(first + 3_000, 6_000, 5)
        ]
    config = PipelineConfig.load({"defaults": {"retry": {"deadline_s": 3.0}}})
    pipe = Pipeline([FileSink(directory, rotate_bytes=None)], config)
    await pipe.start()
    for b in batches:  # queued faster than written: exports of hundreds of batches
        assert await pipe.put(b)
    await pipe.flush()
    report = await pipe.aclose()
    total = sum(len(b.events) for b in batches)
    print(json.dumps({"total": total, "report": report.as_dict()["sinks"]["file"]}))

asyncio.run(main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""


def _run_limited_pipeline(directory: Path, limit: int, huge_at: int) -> dict[str, Any]:
    """A pipeline into a file sink under RLIMIT_FSIZE=``limit``; its total and close report."""
    out = subprocess.run(
        [sys.executable, "-c", _LIMITED_PIPELINE, *map(str, (TESTS, directory, limit, huge_at))],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    result["stderr"] = out.stderr
    return result


def test_a_pipeline_under_a_file_size_limit_rotates_and_loses_nothing(tmp_path: Path) -> None:
    """Exports far larger than RLIMIT_FSIZE (the pipeline queues hundreds of batches per
    export): the sink spreads them over files under the limit instead of retrying one file
    until the retry deadline drops them; every event arrives, in order, in readable files."""
    result = _run_limited_pipeline(tmp_path, 20_000, huge_at=-1)
    report = result["report"]
    assert report["dropped"] == {}, report
    assert report["events_out"] == result["total"] == 3_000
    assert all(p.stat().st_size <= 20_000 for p in tmp_path.iterdir())
    assert len(list(tmp_path.iterdir())) > 5
    spans = stream_ids(_check_files(tmp_path))[source()]
    assert check_contiguous(spans, 3_000) == (3_000, 0)


def test_a_batch_larger_than_the_file_size_limit_is_the_only_loss(tmp_path: Path) -> None:
    """One batch no file under the limit can hold: exactly its 3,000 events are dropped, as a
    permanent error that names the limit, and a lost marker covers exactly their ids; every
    other batch of the same exports is on disk."""
    result = _run_limited_pipeline(tmp_path, 20_000, huge_at=200)
    report = result["report"]
    assert report["dropped"] == {"permanent_error": 3_000}, report
    assert report["lost_pending_ids"] == 0
    assert "(3000 events; the first: engine-0 rank 0 ids 1000..3999" in result["stderr"]
    assert "exceed the file size limit (20000 bytes)" in result["stderr"]
    assert all(p.stat().st_size <= 20_000 for p in tmp_path.iterdir())
    spans = stream_ids(_check_files(tmp_path))[source()]
    # The marker follows the export's later batches (they are on disk before the loss is
    # known), so ids are covered exactly once but not in order.
    assert [s for s in spans if s[2]] == [(1_000, 3_999, True)]
    delivered = [first for first, _, marker in spans if not marker]
    assert sorted(delivered) == [*range(1_000), *range(4_000, 6_000)] == delivered
    assert result["total"] == 6_000


def test_a_file_that_cannot_even_hold_its_header_leaves_nothing(tmp_path: Path) -> None:
    """Every export fails (the limit is below the header size): no file may be left behind,
    neither an empty one per retry nor a temporary one."""
    result = _run_limited(tmp_path, 4_000, retries=2)
    assert result["acked"] == []
    assert result["failures"] == 120
    assert list(tmp_path.iterdir()) == []


@contextlib.contextmanager
def _tmpfs(size: str) -> Iterator[Path]:
    """A size-limited tmpfs mounted for the test (needs root; skips the test otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="kvstream-tmpfs-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
        mnt.rmdir()


async def test_a_full_disk_loses_nothing_acknowledged_and_leaves_no_empty_files() -> None:
    """A real ENOSPC (a 128 KiB tmpfs): exports fail while the disk is full, retries leave no
    files behind, and once space is freed the stream continues with nothing torn."""
    with _tmpfs("128k") as mnt:
        ballast = mnt / "ballast"
        ballast.write_bytes(os.urandom(48 * 1024))
        out = mnt / "kv"
        sink = FileSink(out, rotate_bytes=32 * 1024)
        await sink.start()
        batches = batches_for(source(), 30_000, 10, stored=True)
        acked: list[EventBatch] = []
        failed = 0
        i = 0
        while i < len(batches):
            chunk = batches[i : i + 20]
            if (await sink.export(chunk)).ok:
                acked += chunk
                i += 20
                continue
            failed += 1
            if failed == 5:
                ballast.unlink()  # the operator frees space; the retry goes through
            elif failed > 5:
                break
        await sink.shutdown()
        assert failed >= 5
        assert acked[: len(batches)] == batches[: len(acked)]
        assert _check_files(out) == acked


# ----------------------------------------------------------------------------- kill -9

_FOREVER_WRITER = r"""
import asyncio, sys, time
sys.path.insert(0, sys.argv[1])
from pipeline_helpers import batches_for, check_contiguous, source, stream_ids
from kvstream.sinks.file import FileSink

async def main(directory, name):
    sink = FileSink(directory, rotate_bytes=1)  # a new file for every export
    await sink.start()
    batches = batches_for(source(name), 4_000, 2, stored=True)
    for i in range(0, len(batches), 2):
        assert (await sink.export(batches[i : i + 2])).ok
        print(i, flush=True)
        time.sleep(0.005)

asyncio.run(main(sys.argv[2], sys.argv[3]))
"""


def test_kill_9_of_the_writer_leaves_no_empty_or_unreadable_file(tmp_path: Path) -> None:
    """kill -9 at random moments of a writer that starts a new file per export: no empty
    file, every acknowledged batch on disk; the next sink in the directory removes the dead
    writers' temporary files. (kill -9 can cut a write short, so a writer's last file may
    end in a torn block; Apache avro checks those last two files of each writer.)"""
    rng = random.Random(9)
    acked: dict[str, int] = {}
    for k in range(5):
        name = f"w{k}"
        with subprocess.Popen(
            [sys.executable, "-c", _FOREVER_WRITER, str(TESTS), str(tmp_path), name],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        ) as proc:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            assert first.strip() == "0"
            time.sleep(rng.uniform(0.0, 0.1))
            proc.send_signal(signal.SIGKILL)
            lines = [first, *proc.stdout.read().splitlines()]
        acked[name] = int(lines[-1]) + 2
    by_writer: dict[str, list[str]] = {}
    for path in sorted(p for p in tmp_path.iterdir() if p.suffix == ".avro"):
        by_writer.setdefault(path.name.rsplit("-", 2)[1], []).append(path.name)
    asyncio.run(FileSink(tmp_path).start())  # removes the dead writers' temporary files
    got = _check_files(
        tmp_path,
        torn_ok={names[-1] for names in by_writer.values()},
        apache={n for names in by_writer.values() for n in names[-3:-1]},
    )
    for name, n in acked.items():
        mine = [b for b in got if b.source.instance_id == name]
        assert mine[:n] == batches_for(source(name), 2 * n, 2, stored=True)

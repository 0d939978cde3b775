"""The file sink: event batches in Avro object container files (or JSON Lines), rotated.

* One record per batch; every export becomes one container block written with a single
  ``write`` and flushed to the OS, so an export that returned success survives a process
  crash. :meth:`FileSink.force_flush` and :meth:`FileSink.shutdown` also ``fsync`` the file
  and its directory (durable against power loss).
* Files rotate by size (``rotate_bytes``) and age (``rotate_s``); names sort by creation
  time: ``{prefix}-{YYYYmmddTHHMMSS.ffffff}Z-{pid}-{seq}.avro`` (``.jsonl`` for JSON Lines).
* The files are plain Avro containers (any Avro tool reads them); the writer schema and its
  version are in the header.
* :func:`read_dir` reads a directory back in file-name order and, by default, recovers every
  complete block of a file torn by a crash mid-write (the torn tail is skipped).
* Avro files use the ``snappy`` codec by default: every block carries a CRC32 of its data,
  so a damaged byte is reported as damage by every reader, never decoded as another batch.
* A file appears under its final name only once it holds its header and first block (they
  are written to a hidden ``.<name>.part`` file that is then renamed), so neither a full
  disk nor kill -9 leaves an empty or header-only file; :meth:`FileSink.start` removes the
  ``.part`` files of writers that died.
* Later blocks are appended with unbuffered ``write`` calls. A failed write (full disk, file
  size limit) truncates the file back to its last complete block (nothing buffered is
  flushed first) and the next export starts a new file, so a torn block never hides later
  data.
* A file size limit (``EFBIG``: ``RLIMIT_FSIZE``, or the file system's largest file) is a
  limit per file, so the sink rotates instead of failing: the full file is sealed (cut back
  and fsynced) and the export goes on in new files, one block per batch, each file kept under
  the size that failed. A batch that cannot fit in a file of its own even then is dropped
  with a permanent error naming it; :meth:`FileSink.abandon` reports the export's other
  batches as delivered, so exactly the oversized batches are accounted as lost. A full disk
  (``ENOSPC``) stays retriable: a new file on the same disk would not help.

Disk I/O and encoding run in a worker thread, so a slow disk does not stall the event loop
(and with it other sinks).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import errno
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from kvstream.clock import SYSTEM_CLOCK, Clock
from kvstream.codec import read_container
from kvstream.codec.container import CODECS, DEFAULT_CODEC, ContainerEncoder
from kvstream.errors import (
    CodecError,
    ConfigError,
    DecodeError,
    EventValidationError,
    PermanentSinkError,
    RetriableSinkError,
)
from kvstream.events.columns import ColumnBatch
from kvstream.events.model import EventBatch
from kvstream.sink import Abandoned, ExportResult, Sink, SinkURL

__all__ = ["FileSink", "FileStats", "ReadReport", "list_files", "read_dir", "read_file"]

FileFormat = Literal["avro", "jsonl"]
_SUFFIX: Final[dict[str, str]] = {"avro": ".avro", "jsonl": ".jsonl"}
#: errno values retrying cannot fix.
_PERMANENT_ERRNOS: Final = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.ENAMETOOLONG,
    errno.EINVAL,
}


@dataclass(slots=True)
class FileStats:
    """What the sink wrote: files opened, batches, events, bytes, fsyncs."""

    files: int = 0
    batches: int = 0
    events: int = 0
    bytes: int = 0
    fsyncs: int = 0


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the file's end (a short write is continued; an error
    raises OSError with whatever part was written left in the file)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # pragma: no cover - POSIX reports the error instead
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


class _OpenFile:
    """One output file: its descriptor (unbuffered, append only), encoder (avro), size, age."""

    def __init__(self, path: Path, fd: int, size: int, enc: ContainerEncoder | None) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        self.enc = enc
        self.opened = time.monotonic()

    @classmethod
    def create(
        cls, path: Path, first: bytes, enc: ContainerEncoder | None, fsync: bool
    ) -> _OpenFile:
        """Write ``first`` (header and first block) to ``.<name>.part``, then rename it to
        ``path``: the name only ever shows a complete file. On error nothing is left."""
        part = _part_path(path)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            _write_all(fd, first)
            if fsync:
                os.fsync(fd)
            os.rename(part, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
        return cls(path, fd, len(first), enc)

    def close(self, fsync: bool) -> None:
        try:
            if fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


def _part_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.part")


class FileSink(Sink):
    """Writes batches to rotating files in ``directory`` (created if missing).

    ``format``: ``avro`` (container files, default) or ``jsonl`` (one JSON batch per line,
    for humans; no checksums). ``codec``: the container compression: ``snappy`` (default,
    CRC32 per block), ``null`` and ``deflate`` (no checksum), ``bzip2``, ``xz``.
    ``rotate_bytes``/``rotate_s``: start a new file once the current one is that big or that
    old (None: never). ``fsync_every_export``: fsync after each export, not only on
    flush/close (slower, durable per export).

    It takes column batches too (``accepts_columns``): an Avro file gets their records straight
    from the columns (the bytes their models would give), without a model per event or block;
    a JSON Lines file builds the models it prints.
    """

    scheme = "file"
    accepts_columns = True

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        format: FileFormat = "avro",
        codec: str | None = None,
        schema_version: int | None = None,
        rotate_bytes: int | None = 256 * 1024 * 1024,
        rotate_s: float | None = 3600.0,
        prefix: str = "kvstream",
        fsync_every_export: bool = False,
        clock: Clock = SYSTEM_CLOCK,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        if format not in _SUFFIX:
            raise ConfigError(f"file sink format must be avro or jsonl, got {format!r}")
        if format == "jsonl" and codec not in (None, "null"):
            raise ConfigError("a codec applies to avro files only")
        if format == "avro" and codec is not None and codec not in CODECS:
            raise ConfigError(f"unsupported container codec {codec!r}; supported: {CODECS}")
        if rotate_bytes is not None and rotate_bytes < 1:
            raise ConfigError(f"rotate_bytes must be >= 1, got {rotate_bytes}")
        if rotate_s is not None and rotate_s <= 0:
            raise ConfigError(f"rotate_s must be > 0, got {rotate_s}")
        if not prefix or "/" in prefix or prefix.startswith("."):
            raise ConfigError(f"bad file prefix {prefix!r}")
        self.directory = Path(directory)
        self.format: FileFormat = format
        self.codec = (DEFAULT_CODEC if format == "avro" else "null") if codec is None else codec
        self.schema_version = schema_version
        self.rotate_bytes = rotate_bytes
        self.rotate_s = rotate_s
        self.prefix = prefix
        self.fsync_every_export = fsync_every_export
        self._clock = clock
        self._lock = threading.Lock()  # the writer is used from worker threads
        self._file: _OpenFile | None = None
        self._seq = 0
        self._closed = False
        self._dir_dirty = False
        #: The largest file size seen to succeed before an EFBIG (None: no limit met yet).
        self._size_limit: int | None = None
        #: The batches of the latest export that are in a file (see :meth:`abandon`).
        self._written: list[EventBatch] = []
        self.stats = FileStats()
        self.paths: list[Path] = []

    @classmethod
    def from_url(cls, url: SinkURL) -> FileSink:
        """``file:///abs/dir?format=avro|jsonl&rotate_bytes=64MiB&rotate_s=600&codec=snappy``.

        Also ``prefix``, ``schema_version``, ``fsync`` (``export`` to fsync every export),
        ``name``. ``rotate_bytes=0``/``rotate_s=0`` disable that rotation.
        """
        url.check_keys(
            [
                "format",
                "rotate_bytes",
                "rotate_s",
                "codec",
                "prefix",
                "schema_version",
                "fsync",
                "name",
            ]
        )
        if url.netloc not in ("", "localhost"):
            raise ConfigError(f"file URLs name a local directory (file:///dir), got {url.raw!r}")
        if not url.path:
            raise ConfigError(f"file sink URL {url.raw!r} has no directory")
        fmt = url.get("format", "avro")
        if fmt not in _SUFFIX:
            raise ConfigError(f"format must be avro or jsonl in {url.raw!r}, got {fmt!r}")
        fsync = url.get("fsync", "flush")
        if fsync not in ("flush", "export"):
            raise ConfigError(f"fsync must be flush or export in {url.raw!r}, got {fsync!r}")
        rotate_bytes = url.get_int("rotate_bytes", 256 * 1024 * 1024)
        rotate_s = url.get_float("rotate_s", 3600.0)
        return cls(
            url.path,
            format=fmt,  # type: ignore[arg-type]
            codec=url.get("codec") or None,
            schema_version=url.get_int("schema_version"),
            rotate_bytes=rotate_bytes or None,
            rotate_s=rotate_s or None,
            prefix=url.get("prefix", "kvstream") or "kvstream",
            fsync_every_export=fsync == "export",
            name=url.get("name"),
        )

    # ------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Create the directory and remove the ``.part`` files of writers that died."""
        try:
            await asyncio.to_thread(self.directory.mkdir, parents=True, exist_ok=True)
        except OSError as exc:
            raise _classify_os_error(exc, f"cannot create {self.directory}") from exc
        await asyncio.to_thread(self._remove_stale_parts)

    def _remove_stale_parts(self) -> None:
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if not (name.startswith(f".{self.prefix}-") and name.endswith(".part")):
                continue
            try:  # .{prefix}-{stamp}Z-{pid}-{seq}{suffix}.part
                pid = int(name.rsplit("-", 2)[1])
            except (IndexError, ValueError):
                continue
            if not _alive(pid):
                with contextlib.suppress(OSError):
                    os.unlink(self.directory / name)

    async def export(self, batches: Sequence[EventBatch]) -> ExportResult:
        """Append ``batches`` as one block (one line each for JSON Lines) and flush it.

        On a file size limit (EFBIG) the export continues in new files (see the module
        docstring); a batch too large for any file fails the export permanently, and
        :meth:`abandon` then reports every other batch of it as delivered.
        """
        self._written = []
        if self._closed:
            return ExportResult.permanent("the file sink is shut down")
        if not batches:
            return ExportResult.success()
        try:
            too_big = await asyncio.to_thread(self._write, batches)
        except OSError as exc:
            return ExportResult.from_exception(_classify_os_error(exc, "write failed"))
        except (CodecError, EventValidationError) as exc:
            return ExportResult.permanent(f"cannot encode a batch: {exc}", exc)
        if too_big:
            error = PermanentSinkError(_too_big_reason(too_big, self._size_limit))
            return ExportResult.from_exception(error)
        return ExportResult.success()

    def abandon(self) -> Abandoned:
        """The batches of the latest export that are in a file (all but the oversized ones
        after a file size limit; those written before an error that failed the export)."""
        return Abandoned(delivered=tuple(self._written))

    async def force_flush(self, timeout_s: float | None = None) -> bool:
        """fsync the current file and the directory."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self._fsync), timeout_s)
        except (OSError, asyncio.TimeoutError):
            return False
        return True

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Flush, fsync and close the current file; later exports fail permanently."""
        self._closed = True
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.to_thread(self._close_file), timeout_s)

    async def position(self) -> int:
        """How many files this sink has opened (see :meth:`read_back`)."""
        return len(self.paths)

    async def read_back(self, since: object = None) -> list[EventBatch]:
        """The batches in the files this sink opened after ``since`` (a :meth:`position`;
        None: all of this sink's files), torn tails tolerated."""
        start = since if isinstance(since, int) else 0
        paths = self.paths[start:]

        def read() -> list[EventBatch]:
            return [b for p in paths for b in read_file(p)]

        return await asyncio.to_thread(read)

    # ------------------------------------------------------------------ worker-thread I/O

    def _new_path(self) -> Path:
        now = _dt.datetime.fromtimestamp(self._clock.time_ns() / 1e9, tz=_dt.timezone.utc)
        self._seq += 1
        stamp = now.strftime("%Y%m%dT%H%M%S.%f")
        name = f"{self.prefix}-{stamp}Z-{os.getpid()}-{self._seq:06d}{_SUFFIX[self.format]}"
        return self.directory / name

    def _rotate(self) -> None:
        """Close the current file when it is big or old enough (the next export opens one)."""
        f = self._file
        if f is None:
            return
        too_big = self.rotate_bytes is not None and f.size >= self.rotate_bytes
        too_old = self.rotate_s is not None and time.monotonic() - f.opened >= self.rotate_s
        if too_big or too_old:
            self._file = None
            f.close(fsync=True)

    def _encode(self, batches: Sequence[EventBatch], enc: ContainerEncoder | None) -> bytes:
        if enc is None:
            return b"".join(_model(b).model_dump_json().encode() + b"\n" for b in batches)
        return enc.block(batches)

    def _write(self, batches: Sequence[EventBatch]) -> list[tuple[EventBatch, int]]:
        """Write ``batches``; returns the ones too large for any file (with their size)."""
        with self._lock:
            self._written = []  # a timed-out attempt's thread may have finished meanwhile
            self._rotate()
            too_big: list[tuple[EventBatch, int]] = []
            try:
                self._write_block(batches)
            except OSError as exc:
                if exc.errno != errno.EFBIG:
                    raise
                too_big = self._write_each(batches)
            if self.fsync_every_export:
                self._fsync_dir()
            return too_big

    def _write_block(self, batches: Sequence[EventBatch]) -> None:
        """Append ``batches`` as one block to the current file, or to a new one when there is
        none or the block would pass a size limit met before. On an error nothing of the block
        is left in any file (the current file is cut back, sealed and dropped)."""
        f = self._file
        if f is None:
            self._create(batches)
        else:
            data = self._encode(batches, f.enc)
            if self._size_limit is not None and f.size + len(data) > self._size_limit:
                self._seal(f, f.size)
                self._create(batches)
            else:
                good = f.size
                try:
                    _write_all(f.fd, data)
                    if self.fsync_every_export:
                        os.fsync(f.fd)
                except OSError as exc:
                    if exc.errno == errno.EFBIG:
                        self._learn_limit(f.fd)
                    self._seal(f, good)
                    raise
                except BaseException:
                    self._seal(f, good)
                    raise
                f.size += len(data)
                self.stats.bytes += len(data)
        self._written += batches
        self.stats.batches += len(batches)
        self.stats.events += sum(_events(b) for b in batches)

    def _write_each(self, batches: Sequence[EventBatch]) -> list[tuple[EventBatch, int]]:
        """After an EFBIG: write each batch as its own block, starting a new file whenever
        the current one is full; a batch that fails even alone in a new file is too big."""
        too_big: list[tuple[EventBatch, int]] = []
        for batch in batches:
            for fresh in (self._file is None, True):
                try:
                    self._write_block([batch])
                    break
                except OSError as exc:
                    if exc.errno != errno.EFBIG:
                        raise
                    if fresh:  # alone in a new file and still too large
                        too_big.append((batch, self._encoded_size(batch)))
                        break
        return too_big

    def _encoded_size(self, batch: EventBatch) -> int:
        """The bytes a file holding only ``batch`` needs (header included)."""
        enc = None
        if self.format == "avro":
            enc = ContainerEncoder.new(schema_version=self.schema_version, codec=self.codec)
        return len(self._encode([batch], enc)) + (len(enc.header) if enc is not None else 0)

    def _learn_limit(self, fd: int) -> None:
        # The kernel wrote up to the limit before failing (or failed right at it): the size
        # the file has now is the most a file may hold.
        with contextlib.suppress(OSError):
            size = os.fstat(fd).st_size
            if self._size_limit is None or size < self._size_limit:
                self._size_limit = size

    def _create(self, batches: Sequence[EventBatch]) -> None:
        enc = None
        if self.format == "avro":
            enc = ContainerEncoder.new(schema_version=self.schema_version, codec=self.codec)
        first = self._encode(batches, enc)
        if enc is not None:
            first = enc.header + first
        self.directory.mkdir(parents=True, exist_ok=True)
        f = _OpenFile.create(self._new_path(), first, enc, self.fsync_every_export)
        self._file = f
        self._dir_dirty = True
        self.paths.append(f.path)
        self.stats.files += 1
        self.stats.bytes += f.size

    def _seal(self, f: _OpenFile, good: int) -> None:
        # Cut the file back to its last complete block (a descriptor-level truncate: there
        # is no buffer to flush first), make what it holds durable (a later flush fsyncs only
        # the current file) and start a new file next time.
        self._file = None
        with contextlib.suppress(OSError):
            os.ftruncate(f.fd, good)
        with contextlib.suppress(OSError):
            f.close(fsync=True)
        self.stats.fsyncs += 1

    def _fsync(self) -> None:
        with self._lock:
            f = self._file
            if f is not None:
                os.fsync(f.fd)
            self._fsync_dir()
            self.stats.fsyncs += 1

    def _fsync_dir(self) -> None:
        if not self._dir_dirty:
            return
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._dir_dirty = False

    def _close_file(self) -> None:
        with self._lock:
            f, self._file = self._file, None
            if f is not None:
                f.close(fsync=True)
                self.stats.fsyncs += 1
            self._fsync_dir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _model(batch: EventBatch | ColumnBatch) -> EventBatch:
    return batch.to_batch() if isinstance(batch, ColumnBatch) else batch


def _events(batch: EventBatch | ColumnBatch) -> int:
    return len(batch) if isinstance(batch, ColumnBatch) else len(batch.events)


def _event_ids(batch: EventBatch | ColumnBatch) -> list[int]:
    if isinstance(batch, ColumnBatch):
        return list(batch.event_ids)
    return [e.event_id for e in batch.events]


def _too_big_reason(too_big: list[tuple[EventBatch, int]], limit: int | None) -> str:
    events = sum(_events(b) for b, _ in too_big)
    first, size = too_big[0]
    ids = _event_ids(first)
    src = first.source
    rank = "" if src.attention_dp_rank is None else f" rank {src.attention_dp_rank}"
    where = f"{src.instance_id}{rank} ids {min(ids)}..{max(ids)}" if ids else src.instance_id
    cap = "the file size limit" if limit is None else f"the file size limit ({limit} bytes)"
    return (
        f"{len(too_big)} batch(es) ({events} events; the first: {where}, {size} bytes as a "
        f"file of its own) exceed {cap}: EFBIG (RLIMIT_FSIZE or the file system's largest "
        "file); they cannot be written to any file"
    )


def _classify_os_error(exc: OSError, what: str) -> RetriableSinkError | PermanentSinkError:
    message = f"{what}: {exc}"
    if exc.errno in _PERMANENT_ERRNOS:
        return PermanentSinkError(message)
    return RetriableSinkError(message)


# ---------------------------------------------------------------------------------- reading


@dataclass(slots=True)
class ReadReport:
    """What :func:`read_dir` found: files read, batches, and torn files with skipped bytes."""

    files: int = 0
    batches: int = 0
    torn: dict[str, int] | None = None  # file name -> ignored bytes

    def note_torn(self, path: Path, ignored: int) -> None:
        """Record a torn file."""
        if self.torn is None:
            self.torn = {}
        self.torn[path.name] = ignored


def list_files(directory: str | os.PathLike[str], prefix: str = "kvstream") -> list[Path]:
    """The sink's files in ``directory``, oldest first (names sort by creation time)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(
        p
        for p in d.iterdir()
        if p.name.startswith(prefix + "-") and p.suffix in (".avro", ".jsonl") and p.is_file()
    )


def read_file(
    path: str | os.PathLike[str],
    *,
    tolerate_torn_tail: bool = True,
    report: ReadReport | None = None,
) -> Iterator[EventBatch]:
    """The batches of one file (Avro container or JSON Lines).

    With ``tolerate_torn_tail`` (default) a file cut short by a crash yields every complete
    block (or line) and stops; otherwise a torn file raises :class:`DecodeError`.
    """
    p = Path(path)
    if p.suffix == ".jsonl":
        yield from _read_jsonl(p, tolerate_torn_tail, report)
        return
    reader = read_container(p, tolerate_torn_tail=tolerate_torn_tail)
    with reader:
        yield from reader
    if reader.torn_reason is not None and report is not None:
        report.note_torn(p, reader.ignored_bytes)


def _read_jsonl(p: Path, tolerant: bool, report: ReadReport | None) -> Iterator[EventBatch]:
    with open(p, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    for i, line in enumerate(complete):
        if not line.strip():
            continue
        try:  # a complete (newline-terminated) line that does not parse is corruption
            batch = EventBatch.model_validate_json(line)
        except EventValidationError as exc:
            raise DecodeError(f"{p.name} line {i + 1} is not a batch: {exc}") from exc
        yield batch
    if tail:
        if not tolerant:
            raise DecodeError(f"{p.name} ends in a partial line ({len(tail)} bytes)")
        if report is not None:
            report.note_torn(p, len(tail))


def read_dir(
    directory: str | os.PathLike[str],
    *,
    prefix: str = "kvstream",
    tolerate_torn_tail: bool = True,
    report: ReadReport | None = None,
) -> Iterator[EventBatch]:
    """Every batch the file sink wrote to ``directory``, in write order.

    A torn file (crash mid-write) yields all its complete blocks; pass a :class:`ReadReport`
    to learn which files were torn and how many bytes were skipped.
    """
    for path in list_files(directory, prefix):
        if report is not None:
            report.files += 1
        for batch in read_file(path, tolerate_torn_tail=tolerate_torn_tail, report=report):
            if report is not None:
                report.batches += 1
            yield batch

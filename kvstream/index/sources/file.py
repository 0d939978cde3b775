"""Read batches from the file sink's files: Avro container files (any schema version) or
JSON Lines, in name (= creation) order, including the file still being written.

Positions are ``(file name, byte offset of a container block or line, batches of that block
already read)``: a consumer that restarts re-opens that file, seeks to the block and skips
what it had read. Reading works on a file that another process is appending to: a block (or
line) cut short at the end is left for the next poll, and with ``follow=True`` the source
keeps polling for new blocks and new files until it is closed (or ``idle_timeout_s`` passes
without new data).

Damage is skipped, not fatal: a corrupt container block followed by more data (its sync
marker is found further on) is counted in ``stats.malformed`` and reading resumes after it;
a torn tail of a file that is no longer the newest (the writer moved on) is counted in
``stats.torn``; a JSON line that does not parse is counted as malformed.
"""

from __future__ import annotations

import asyncio
import io
import os
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvstream.codec import read_container
from kvstream.codec.columnar import ColumnarContainerReader
from kvstream.errors import DecodeError, EventValidationError
from kvstream.events.columns import ColumnBatch
from kvstream.events.model import EventBatch
from kvstream.index.errors import SourceError
from kvstream.index.sources.base import EventSource, SourceItem, attribute_skipped

__all__ = ["FileSource"]

_SYNC = 16
_SCAN_CHUNK = 1 << 20
_SUFFIXES = (".avro", ".jsonl")


def list_files(directory: Path, prefix: str) -> list[Path]:
    """The file sink's files in ``directory`` (``{prefix}-*.avro|.jsonl``), oldest first:
    the sink names files by creation time, so name order is write order."""
    if not directory.is_dir():
        return []
    return sorted(
        p
        for p in directory.iterdir()
        if p.name.startswith(prefix + "-") and p.suffix in _SUFFIXES and p.is_file()
    )


class _Spliced(io.RawIOBase):
    """A container header followed by a file's bytes from ``start`` (a block boundary)."""

    def __init__(self, header: bytes, fo: BinaryIO, start: int) -> None:
        self._h = header
        self._hpos = 0
        self._fo = fo
        fo.seek(start)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._hpos < len(self._h):
            n = min(len(b), len(self._h) - self._hpos)
            b[:n] = self._h[self._hpos : self._hpos + n]
            self._hpos += n
            return n
        got: int | None = self._fo.readinto(b)  # type: ignore[attr-defined]
        return got or 0


@dataclass
class _Header:
    data: bytes
    sync: bytes


@dataclass
class _Pass:
    """How a pass over one file ended: the byte offset where good data ends and whether an
    incomplete (or corrupt) block or line starts there."""

    end: int
    torn: str | None = None


def _read_header(path: Path) -> _Header | None:
    """The container header (None while it is still incomplete); DecodeError if the file
    is not an Avro container."""
    reader = read_container(path, tolerate_torn_tail=True)
    with reader:
        if reader.writer_schema is None:
            return None
        end = reader.valid_end
    with open(path, "rb") as f:
        data = f.read(end)
    return _Header(data, data[-_SYNC:])


def _find_sync(path: Path, start: int, sync: bytes) -> int | None:
    """Offset just past the first ``sync`` marker at or after ``start`` (None: none)."""
    with open(path, "rb") as f:
        f.seek(start)
        carry = b""
        base = start
        while True:
            chunk = f.read(_SCAN_CHUNK)
            if not chunk:
                return None
            buf = carry + chunk
            i = buf.find(sync)
            if i >= 0:
                return base - len(carry) + i + _SYNC
            carry = buf[-(_SYNC - 1) :]
            base += len(chunk)


def _container_items(
    path: Path, header: _Header, start: int, skip: int
) -> Generator[tuple[ColumnBatch, int, int, tuple[int, ...]], None, _Pass]:
    """Batches of the blocks from ``start`` (skipping ``skip`` batches of the first block):
    ``(batch, block offset, index in block, skipped ids)``; returns how the pass ended."""
    hl = len(header.data)
    with open(path, "rb") as fo:
        stream = io.BufferedReader(_Spliced(header.data, fo, start), buffer_size=1 << 16)
        reader = ColumnarContainerReader(stream, tolerate_torn_tail=True)
        blocks = 0
        block_start = block_end = start
        idx = 0
        seen_skipped = 0
        pending: deque[int] = deque()
        for batch in reader:
            if reader.blocks_read != blocks:
                blocks = reader.blocks_read
                block_start = block_end
                block_end = start + reader.valid_end - hl
                idx = 0
                pending = deque(s.event_id for s in reader.skipped[seen_skipped:])
                seen_skipped = len(reader.skipped)
            ids = attribute_skipped(batch, pending) if pending else ()
            i = idx
            idx += 1
            if block_start == start and i < skip:
                continue
            yield batch, block_start, i, ids
        return _Pass(start + reader.valid_end - hl, reader.torn_reason)


def _jsonl_items(
    path: Path, start: int, bad: list[tuple[int, str]]
) -> Generator[tuple[EventBatch, int], None, _Pass]:
    """Batches of complete lines from ``start``: ``(batch, offset after the line)``;
    lines that do not parse go to ``bad``."""
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        for line in f:
            if not line.endswith(b"\n"):
                return _Pass(pos, f"partial line at byte {pos}")
            here = pos
            pos += len(line)
            if not line.strip():
                continue
            try:
                batch = EventBatch.model_validate_json(line)
            except (EventValidationError, ValueError) as exc:
                bad.append((here, f"{type(exc).__name__}: {exc}"))
                continue
            yield batch, pos
        return _Pass(pos)


class FileSource(EventSource):
    """Batches from ``path``: a file sink directory (files named ``{prefix}-*``) or one file.

    ``follow``: keep polling every ``poll_interval_s`` for new data (the newest file is the
    one being written); ``idle_timeout_s`` ends a following source after that long without
    new data. ``resume_from``: a :meth:`checkpoint`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        prefix: str = "kvstream",
        follow: bool = False,
        poll_interval_s: float = 0.1,
        idle_timeout_s: float | None = None,
        resume_from: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.prefix = prefix
        self.follow = follow
        self.poll_interval_s = poll_interval_s
        self.idle_timeout_s = idle_timeout_s
        self.name = f"file:{self.path}"
        self._file: str | None = None  # name of the file being read
        self._offset = 0
        self._skip = 0
        if resume_from is not None:
            if resume_from.get("kind") != "file":
                raise SourceError(f"not a file-source checkpoint: {resume_from!r}")
            self._file = resume_from.get("file")
            self._offset = int(resume_from.get("offset", 0))
            self._skip = int(resume_from.get("skip", 0))
        self._headers: dict[str, _Header] = {}
        self._gen: Iterator[SourceItem] | None = None
        self._idle_since: float | None = None

    # ------------------------------------------------------------------ positions

    def checkpoint(self) -> dict[str, Any]:
        """``{"kind": "file", "path", "file", "offset", "skip"}``."""
        return {
            "kind": "file",
            "path": str(self.path),
            "file": self._file,
            "offset": self._offset,
            "skip": self._skip,
        }

    def _files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        if not self.path.exists():
            if self.follow:
                return []
            raise SourceError(f"no such file or directory: {self.path}")
        return list_files(self.path, self.prefix)

    # ------------------------------------------------------------------ reading

    async def read(self, timeout_s: float | None = None) -> SourceItem | None:
        """The next batch; polls in follow mode (see the class docstring)."""
        if self.ended:
            return None
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            if self._gen is None:
                self._gen = self._scan()
            item = next(self._gen, None)
            if item is not None:
                self._idle_since = None
                return item
            self._gen = None  # the pass reached the end of the data there is
            if not self.follow:
                self.ended = True
                return None
            now = loop.time()
            if self._idle_since is None:
                self._idle_since = now
            if self.idle_timeout_s is not None and now - self._idle_since >= self.idle_timeout_s:
                self.ended = True
                return None
            if deadline is not None and now >= deadline:
                return None
            wait = self.poll_interval_s
            if deadline is not None:
                wait = min(wait, max(deadline - now, 0.0))
            await asyncio.sleep(wait)

    def _scan(self) -> Iterator[SourceItem]:
        """One pass over the files from the current position to the end of their data,
        yielding items (and updating the position)."""
        files = self._files()
        for i, p in enumerate(files):
            if self._file is not None and p.name < self._file:
                continue
            if p.name != self._file:
                self._file, self._offset, self._skip = p.name, 0, 0
            # the newest file may still be written to (only when following)
            newest = self.follow and i == len(files) - 1
            if p.suffix == ".jsonl":
                done = yield from self._scan_jsonl(p, newest)
            else:
                done = yield from self._scan_container(p, newest)
            if not done:
                return

    def _scan_container(self, p: Path, newest: bool) -> Generator[SourceItem, None, bool]:
        header = self._headers.get(p.name)
        if header is None:
            try:
                header = _read_header(p)
            except (DecodeError, OSError) as exc:
                self._malformed(f"{p.name}@0", exc)
                return True  # not a container: skip the whole file
            if header is None:  # header still being written
                if not newest:
                    self.stats.torn += 1
                    return True
                return False
            self._headers[p.name] = header
        while True:
            if self._offset == 0:
                self._offset = len(header.data)
            gen = _container_items(p, header, self._offset, self._skip)
            try:
                while True:
                    batch, block, idx, ids = next(gen)
                    self._offset, self._skip = block, idx + 1
                    self.stats.batches += 1
                    self.stats.skipped_events += len(ids)
                    yield SourceItem(batch, ids)
            except StopIteration as stop:
                end: _Pass = stop.value
            except (DecodeError, OSError) as exc:  # pragma: no cover - tolerant reader
                end = _Pass(self._offset, str(exc))
            if end.end != self._offset:
                self._offset, self._skip = end.end, 0
            if end.torn is None:
                return not newest
            resume = _find_sync(p, end.end, header.sync)
            if resume is not None and resume > end.end:
                self._malformed(f"{p.name}@{end.end}", f"corrupt container block ({end.torn})")
                self._offset, self._skip = resume, 0
                continue
            if newest:
                return False  # an incomplete block: wait for the writer
            self.stats.torn += 1
            return True

    def _scan_jsonl(self, p: Path, newest: bool) -> Generator[SourceItem, None, bool]:
        bad: list[tuple[int, str]] = []
        gen = _jsonl_items(p, self._offset, bad)
        try:
            while True:
                batch, after = next(gen)
                for where, err in bad:
                    self._malformed(f"{p.name}@{where}", err)
                bad.clear()
                self._offset, self._skip = after, 0
                self.stats.batches += 1
                yield SourceItem(batch)
        except StopIteration as stop:
            end: _Pass = stop.value
        for where, err in bad:
            self._malformed(f"{p.name}@{where}", err)
        self._offset = end.end
        if end.torn is None or newest:
            return not newest
        self.stats.torn += 1
        return True

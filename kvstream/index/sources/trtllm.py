"""Read TensorRT-LLM's JSON KV-cache events from a file or stdin as an event source.

The input is what ``LLM.get_kv_cache_events()`` and ``POST /kv_cache_events`` return, saved
as any stream of JSON values: a file holding one JSON array (pretty-printed or not), JSON
Lines with one event object per line, JSON Lines with one array per line (one POST drain per
line), or arrays simply concatenated (``curl ... >> events.jsonl``). ``-`` reads stdin to its
end. Each JSON value is one read of a :class:`~kvstream.engines.trtllm.TrtllmEventReader`
(one batch per attention-DP rank; events without ids are numbered on across values, see
:mod:`kvstream.engines.trtllm`).

Specs for :func:`~kvstream.index.sources.open_source`: a path ending in ``.json``,
``.jsonl`` or ``.ndjson`` (a directory, or a file named as the file sink names its files,
stays a file-sink source), ``-``, ``trtllm+file://PATH`` or ``trtllm:-`` (stdin), each with
optional query options ``instance_id``, ``incarnation``, ``tokens_per_block``,
``default_window_size``, ``mm_token_id_offset``, ``poll_interval_s``, ``idle_timeout_s``.
``instance_id`` defaults to the file's name without its suffix (``stdin`` for stdin).

``follow=True`` keeps polling a file for appended data (a value cut short at the end is left
for the next poll; ``idle_timeout_s`` ends the source after that long without new data).
Bad input never ends the source: a value that is not JSON is counted in ``stats.malformed``
as ``FILE:LINE`` with the parser's reason and reading resumes on the line after the one it
started on; an event that does not convert is counted as ``FILE:LINE`` (the line its value
starts on) with the converter's ``event[i]...`` reason and the rest of its value delivered.

Positions: :meth:`TrtllmSource.checkpoint` is ``{"kind": "trtllm", "path", "offset",
"line", "skip", "numbering"}``: the byte offset and line of the value being read (or just
past the last one), how many of its batches were already returned, and the reader's event
numbering at that point (:meth:`~kvstream.engines.trtllm.TrtllmEventReader.numbering_state`).
A source built with ``resume_from`` re-reads that value, skips what was returned and goes
on numbering exactly as before. The reader's multimodal chain memory is not checkpointed: a
V2 multimodal block whose ``mm_keys`` are empty and which continues an item from before the
resume point is then counted as malformed. Stdin cannot be resumed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Final
from urllib.parse import parse_qsl, unquote

from kvstream.engines.trtllm import TrtllmEventReader
from kvstream.errors import ConfigError
from kvstream.events.model import EventBatch
from kvstream.index.errors import SourceError
from kvstream.index.sources.base import EventSource, SourceItem

__all__ = ["TrtllmSource", "is_trtllm_spec"]

_SUFFIXES: Final = (".json", ".jsonl", ".ndjson")
#: How the file sink names its files: ``{prefix}-{YYYYmmddTHHMMSS.ffffff}Z-{pid}-{seq}.jsonl``.
_FILE_SINK_NAME: Final = re.compile(r".+-\d{8}T\d{6}\.\d{6}Z-\d+-\d+\.jsonl")
_READ_CHUNK: Final = 1 << 20
_MAX_READ_PER_POLL: Final = 16 << 20
_WHITESPACE: Final = " \t\n\r"
_DECODER: Final = json.JSONDecoder()
_INT_OPTIONS: Final = (
    "incarnation",
    "tokens_per_block",
    "default_window_size",
    "mm_token_id_offset",
)
_FLOAT_OPTIONS: Final = ("poll_interval_s", "idle_timeout_s")


def is_trtllm_spec(spec: str) -> bool:
    """True when :func:`~kvstream.index.sources.open_source` reads ``spec`` as TensorRT-LLM
    JSON (module docstring)."""
    if spec == "-" or spec.startswith(("trtllm+file://", "trtllm:")):
        return True
    if "://" in spec and not spec.startswith("file://"):
        return False
    path = Path(spec.removeprefix("file://"))
    return (
        path.suffix.lower() in _SUFFIXES
        and not path.is_dir()
        and _FILE_SINK_NAME.fullmatch(path.name) is None
    )


def _utf8_complete(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 sequence."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80 or byte >= 0xF8:  # ASCII, or never part of UTF-8: nothing to wait for
            return len(data)
        if byte >= 0xC0:  # a lead byte: complete when its sequence fits
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) if need <= back else len(data) - back
    return len(data)


class _StdinPump:
    """Reads a binary stream on a daemon thread (a blocked read must not hold up shutdown)
    and hands chunks to the event loop; ``b""`` marks the end."""

    def __init__(self, stream: IO[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._stream = stream
        self._loop = loop
        threading.Thread(target=self._run, name="kvstream-trtllm-stdin", daemon=True).start()

    def _run(self) -> None:
        read = getattr(self._stream, "read1", self._stream.read)
        while True:
            try:
                chunk = read(_READ_CHUNK)
            except (OSError, ValueError):
                chunk = b""
            self._loop.call_soon_threadsafe(self.queue.put_nowait, chunk or b"")
            if not chunk:
                return


class TrtllmSource(EventSource):
    """TensorRT-LLM KV-event JSON from ``path`` (``-``: stdin); see the module docstring.

    Raises :class:`~kvstream.index.errors.SourceError` for a checkpoint of another kind and
    :class:`~kvstream.errors.ConfigError` for bad reader options.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        instance_id: str | None = None,
        incarnation: int = 0,
        tokens_per_block: int | None = None,
        default_window_size: int | None = None,
        mm_token_id_offset: int | None = None,
        follow: bool = False,
        poll_interval_s: float = 0.1,
        idle_timeout_s: float | None = None,
        resume_from: Mapping[str, Any] | None = None,
        stdin: IO[bytes] | None = None,
    ) -> None:
        super().__init__()
        text = os.fspath(path)
        self.is_stdin = text == "-"
        self.path = Path(text)
        self.where = "<stdin>" if self.is_stdin else text
        self.name = f"trtllm:{self.where}"
        self.follow = follow and not self.is_stdin
        self.poll_interval_s = poll_interval_s
        self.idle_timeout_s = idle_timeout_s
        if instance_id is None:
            instance_id = "stdin" if self.is_stdin else (self.path.stem or "trtllm")
        self.reader = TrtllmEventReader(
            instance_id=instance_id,
            incarnation=incarnation,
            tokens_per_block=tokens_per_block,
            mm_token_id_offset=mm_token_id_offset,
            default_window_size=default_window_size,
        )
        self._stdin_stream = stdin
        self._stdin: _StdinPump | None = None
        self._eof = False  # stdin: the stream ended
        self._file: IO[bytes] | None = None
        self._file_eof = False  # the last read of the file reached its end
        # The decoded text from byte offset self._offset (line self._line) on; self._i indexes
        # the current position in it; self._tail holds bytes of an incomplete UTF-8 sequence.
        self._text = ""
        self._i = 0
        self._tail = b""
        self._offset = 0
        self._line = 1
        self._skip = 0  # batches of the value at self._offset still to skip (resuming)
        self._queue: deque[tuple[SourceItem, dict[str, Any]]] = deque()
        self._checkpoint = self._position(0, 1, 0, self.reader.numbering_state())
        self._idle_since: float | None = None
        if resume_from is not None:
            self._resume(resume_from)

    @classmethod
    def from_spec(cls, spec: str, **kwargs: Any) -> TrtllmSource:
        """A source for ``-``, a path, ``trtllm+file://PATH?...`` or ``trtllm:-?...``.

        Query options (module docstring) are overridden by the same keyword arguments.
        """
        text = spec
        if text.startswith("trtllm+file://"):
            text = text.removeprefix("trtllm+file://")
        elif text.startswith("trtllm:"):
            text = text.removeprefix("trtllm:")
        else:
            text = text.removeprefix("file://")
        base, _, query = text.partition("?")
        options: dict[str, Any] = {}
        for key, value in parse_qsl(query, keep_blank_values=True):
            name = "instance_id" if key == "instance" else key
            try:
                if name in _INT_OPTIONS:
                    options[name] = int(value)
                elif name in _FLOAT_OPTIONS:
                    options[name] = float(value)
                elif name == "instance_id":
                    options[name] = value
                else:
                    raise SourceError(f"{spec!r}: unknown option {key!r}")
            except ValueError:
                raise SourceError(f"{spec!r}: option {key}={value!r} is not a number") from None
        if not base:
            raise SourceError(f"{spec!r}: no path (use '-' for stdin)")
        options.update(kwargs)
        return cls(unquote(base), **options)

    # ------------------------------------------------------------------ positions

    def _position(
        self, offset: int, line: int, skip: int, numbering: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "kind": "trtllm",
            "path": self.where,
            "offset": offset,
            "line": line,
            "skip": skip,
            "numbering": numbering,
        }

    def checkpoint(self) -> dict[str, Any]:
        """The position just past the last batch returned (module docstring)."""
        return dict(self._checkpoint)

    def _resume(self, checkpoint: Mapping[str, Any]) -> None:
        if checkpoint.get("kind") != "trtllm":
            raise SourceError(f"not a TensorRT-LLM source checkpoint: {dict(checkpoint)!r}")
        if self.is_stdin:
            raise SourceError("stdin cannot be resumed from a checkpoint")
        try:
            offset, line, skip = (int(checkpoint[k]) for k in ("offset", "line", "skip"))
            self.reader.restore_numbering(checkpoint["numbering"])
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise SourceError(f"bad TensorRT-LLM source checkpoint: {exc}") from exc
        self._offset, self._line, self._skip = offset, line, skip
        self._checkpoint = dict(checkpoint)

    # ------------------------------------------------------------------ reading

    async def read(self, timeout_s: float | None = None) -> SourceItem | None:
        """The next batch; polls a followed file, waits for stdin (see the module docs)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not self.ended:
            if self._queue:
                item, position = self._queue.popleft()
                self._checkpoint = position
                self.stats.batches += 1
                self._idle_since = None
                return item
            if self.is_stdin:
                if not await self._fill_stdin(deadline, loop):
                    return None  # timed out
                self._decode(final=self._eof)
                if self._eof and not self._queue:
                    self.ended = True
                continue
            got = self._fill_file()
            self._decode(final=not self.follow and self._file_eof)
            if self._queue or got:
                continue
            if not self.follow:
                self.ended = True
                break
            now = loop.time()
            if self._idle_since is None:
                self._idle_since = now
            if self.idle_timeout_s is not None and now - self._idle_since >= self.idle_timeout_s:
                self._decode(final=True)  # whatever is left will not be completed
                if not self._queue:
                    self.ended = True
                continue
            if deadline is not None and now >= deadline:
                return None
            wait = self.poll_interval_s
            if deadline is not None:
                wait = min(wait, max(deadline - now, 0.0))
            await asyncio.sleep(wait)
        return None

    async def aclose(self) -> None:
        """Close the file (a stdin reader thread ends with the stream)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _append(self, data: bytes) -> None:
        data = self._tail + data
        keep = _utf8_complete(data) if not self._eof else len(data)
        self._tail = data[keep:]
        self._text += data[:keep].decode("utf-8", "surrogateescape")

    def _fill_file(self) -> bool:
        """Read what was appended to the file; True when there was anything."""
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 - kept open across polls
            except FileNotFoundError:
                if self.follow:
                    return False
                raise SourceError(f"no such file: {self.path}") from None
            except OSError as exc:
                raise SourceError(f"cannot read {self.path}: {exc}") from exc
            self._file.seek(self._offset)
        got = 0
        self._file_eof = False
        while got < _MAX_READ_PER_POLL:
            chunk = self._file.read(_READ_CHUNK)
            if not chunk:
                self._file_eof = True
                break
            got += len(chunk)
            self._append(chunk)
        return got > 0

    async def _fill_stdin(self, deadline: float | None, loop: asyncio.AbstractEventLoop) -> bool:
        """Wait for the next stdin chunk; False when ``deadline`` passed first."""
        if self._stdin is None:
            import sys

            stream = self._stdin_stream if self._stdin_stream is not None else sys.stdin.buffer
            self._stdin = _StdinPump(stream, loop)
        timeout = None if deadline is None else max(deadline - loop.time(), 0.0)
        try:
            chunk = await asyncio.wait_for(self._stdin.queue.get(), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            return False
        if not chunk:
            self._eof = True
        self._append(chunk)
        return True

    def _consume(self, end: int) -> None:
        """Advance the position to text index ``end``."""
        segment = self._text[self._i : end]
        self._offset += len(segment.encode("utf-8", "surrogateescape"))
        self._line += segment.count("\n")
        self._i = end

    def _compact(self) -> None:
        """Drop consumed text once it is most of the buffer (indexes stay O(1) per value)."""
        if self._i > (1 << 16) and self._i * 2 > len(self._text):
            self._text = self._text[self._i :]
            self._i = 0

    def _decode(self, *, final: bool) -> None:
        """Turn every complete JSON value after the position into queued batches.

        Not ``final`` (more data may come), an error in the last, unterminated line means
        "not written yet"; anywhere else (or when ``final``) it is malformed input.
        """
        text = self._text
        limit = text.rfind("\n") + 1
        while True:
            start = self._i
            while start < len(text) and text[start] in _WHITESPACE:
                start += 1
            if start >= len(text):
                self._consume(start)
                self._compact()
                return
            self._consume(start)
            try:
                value, end = _DECODER.raw_decode(text, start)
            except json.JSONDecodeError as exc:
                if not final and exc.pos >= limit:
                    self._compact()
                    return  # the value runs into the line still being written
                newline = text.find("\n", start)
                self._malformed(f"{self.where}:{self._line}", f"not JSON: {exc.msg}")
                self._consume(len(text) if newline < 0 else newline + 1)
                self._checkpoint = self._position(
                    self._offset, self._line, 0, self.reader.numbering_state()
                )
                continue
            self._value(value, end)

    def _value(self, value: Any, end: int) -> None:
        """Convert one JSON value at the position (ending at text index ``end``)."""
        offset, line = self._offset, self._line
        before = self.reader.numbering_state()
        if isinstance(value, Mapping):
            value = [value]
        if isinstance(value, list):
            result = self.reader.read_tolerant(value)
            for error in result.errors:
                self._malformed(f"{self.where}:{line}", error)
            batches: list[EventBatch] = result.batches
        else:
            self._malformed(
                f"{self.where}:{line}",
                f"expected an event object or a list of them, got {type(value).__name__}",
            )
            batches = []
        self._consume(end)
        after = self._position(self._offset, self._line, 0, self.reader.numbering_state())
        skip, self._skip = self._skip, 0
        for n, batch in enumerate(batches):
            if n < skip:
                continue
            last = n == len(batches) - 1
            position = after if last else self._position(offset, line, n + 1, before)
            self._queue.append((SourceItem(batch), position))
        if not batches[skip:]:
            self._checkpoint = after

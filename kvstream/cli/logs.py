"""Library logs on the command line: one stderr handler, repeats collapsed.

Without a handler, Python prints every warning of every library as a bare line (its "last
resort" handler): a dead broker gave a dozen identical aiokafka lines per run. The CLI
installs :class:`CliLogHandler` on the root logger for the length of a command
(:func:`cli_logging`): warnings and errors of kvstream and of the libraries it drives
(aiokafka, asyncio...) are printed as ``warning: aiokafka: <message>``, and
:class:`RepeatFilter` lets the first of identical messages through, counts the others, and
says how many there were when the message changes, when the repeat window ends, or when the
command ends. Secrets in URLs (``sasl_password=...``) are masked in every line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, TextIO

from kvstream.kafka_security import redact_url

__all__ = ["CliLogHandler", "RepeatFilter", "cli_logging"]

#: Loggers shown by their family name (``aiokafka.conn`` -> ``aiokafka``).
_SHORT: Final = ("aiokafka", "asyncio", "kvstream")


@dataclass
class _Seen:
    since: float  # when the message was last let through
    suppressed: int  # identical ones dropped since
    record: logging.LogRecord  # the last one dropped


class RepeatFilter(logging.Filter):
    """Let a message through once per ``window_s`` seconds; count identical ones between.

    Messages are identical when logger, level and text are. The next copy let through after
    the window carries ``(N similar messages suppressed)``; :meth:`pending` returns a record
    for every message with copies still uncounted (call it at exit). At most ``max_keys``
    distinct messages are remembered (the oldest is forgotten first).
    """

    def __init__(
        self,
        window_s: float = 60.0,
        *,
        max_keys: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.window_s = window_s
        self.max_keys = max_keys
        self._clock = clock
        self._seen: OrderedDict[tuple[str, int, str], _Seen] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen.since < self.window_s:
            seen.suppressed += 1
            seen.record = record
            return False
        if seen is not None and seen.suppressed:
            _note_repeats(record, seen.suppressed)
        self._seen[key] = _Seen(now, 0, record)
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        return True

    def pending(self) -> list[logging.LogRecord]:
        """One record per message with uncounted copies, saying how many; resets them."""
        out = []
        for seen in self._seen.values():
            if seen.suppressed:
                record = logging.makeLogRecord(seen.record.__dict__)
                _note_repeats(record, seen.suppressed, last=True)
                out.append(record)
                seen.suppressed = 0
        return out


def _note_repeats(record: logging.LogRecord, count: int, *, last: bool = False) -> None:
    what = "more time" if count == 1 else "more times"
    record.msg = f"{record.getMessage()} (repeated {count} {what}{'' if last else ' before'})"
    record.args = None


class CliLogHandler(logging.Handler):
    """Writes ``level: logger: message`` lines to the current ``sys.stderr`` (looked up at
    each write, so a test runner's captured stream is honoured), repeats collapsed by a
    :class:`RepeatFilter`. A logged exception shows as ``(Name: message)``; its traceback
    only with ``verbose`` (``KVSTREAM_LOG_TRACEBACKS=1`` for the CLI)."""

    def __init__(self, *, window_s: float = 60.0, verbose: bool = False) -> None:
        super().__init__(logging.WARNING)
        self.repeats = RepeatFilter(window_s)
        self.addFilter(self.repeats)
        self.verbose = verbose

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    def format(self, record: logging.LogRecord) -> str:
        name = record.name
        for family in _SHORT:
            if name == family or name.startswith(family + "."):
                name = family
                break
        line = f"{record.levelname.lower()}: {name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            if self.verbose:
                line += "\n" + logging.Formatter().formatException(record.exc_info)
            else:
                exc = record.exc_info[1]
                line += (
                    f" ({type(exc).__name__}: {exc})" if str(exc) else f" ({type(exc).__name__})"
                )
        return redact_url(line)  # a library may log a URL holding a password

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + "\n")
            self.stream.flush()
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        """Say how often the collapsed messages repeated, then close."""
        for record in self.repeats.pending():
            self.emit(record)
        super().close()


@contextlib.contextmanager
def cli_logging(*, verbose: bool = False) -> Iterator[CliLogHandler]:
    """Install a :class:`CliLogHandler` on the root logger for the block (replacing one a
    previous command left), and report collapsed repeats when it ends."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, CliLogHandler)]:
        root.removeHandler(old)
    handler = CliLogHandler(
        verbose=verbose or os.environ.get("KVSTREAM_LOG_TRACEBACKS", "") not in ("", "0")
    )
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        handler.close()

"""What every command prints when it stops: one-line errors, exit codes, progress off a TTY.

Exit codes (docs/cli.md):

- ``0`` done;
- ``1`` :data:`EXIT_RUNTIME`: failed while running (a broker or sink failed, data was lost or
  differs, an output could not be written);
- ``2`` :data:`EXIT_USAGE`: could not start with what was given (a bad option or URL, a
  missing input file, an input that is not an event stream, an output path that cannot be
  written) — click's own usage errors use 2 as well;
- ``130`` :data:`EXIT_INTERRUPTED`: Ctrl-C (SIGINT), after printing what was done so far.

Messages are printed with rich markup escaped: an exception's text or a hint such as
``pip install 'kvstream[kafka]'`` is shown as is, never eaten as a markup tag.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Final, NoReturn

import typer

from kvstream.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_RUNTIME",
    "EXIT_USAGE",
    "PROGRESS_EVERY_S",
    "PlainProgress",
    "check_input_path",
    "check_output_path",
    "error",
    "fail",
    "interruptible",
]

EXIT_RUNTIME: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130
#: Seconds between plain progress lines when stderr is not a terminal.
PROGRESS_EVERY_S: Final = 5.0


def error(console: Console | None, message: str) -> None:
    """Print ``error: <message>`` on one line of stderr (``console``: a stderr Console; None
    prints without rich). The message is escaped, so brackets in it are shown as is."""
    if console is None:
        typer.echo(f"error: {message}", err=True)
        return
    from rich.markup import escape

    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)


def fail(console: Console | None, message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``message`` as :func:`error` does, then exit with ``code``."""
    error(console, message)
    raise typer.Exit(code)


def check_input_path(spec: str) -> None:
    """ConfigError (a usage error) when ``spec`` names a local path (not a URL, not ``-``)
    that does not exist: a missing input is reported before anything starts."""
    if spec == "-" or ("://" in spec and not spec.startswith("file://")):
        return
    if spec.startswith(("trtllm:", "vllm:", "sglang:")):
        return
    path = Path(spec.removeprefix("file://"))
    if not path.exists():
        raise ConfigError(f"{path}: no such file or directory")


def check_output_path(path: Path, *, what: str = "output", directory: bool = False) -> None:
    """ConfigError unless ``path`` can be written: a file whose directory exists and is
    writable, that is not itself a directory (``directory``: a directory that exists or can
    be created in an existing one). Checked before a long run, so a typo fails at once."""
    if directory:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{what} {path} is not a directory")
        parent = path if path.exists() else path.parent
    else:
        if path.is_dir():
            raise ConfigError(f"{what} {path} is a directory; give a file name")
        parent = path.parent
    parent = parent if str(parent) else Path()
    if not parent.is_dir():
        raise ConfigError(f"{what} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: directory {parent} is not writable")


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within: Ctrl-C raises KeyboardInterrupt at once, wherever the main thread is.

    ``asyncio.run`` answers the first Ctrl-C by cancelling its main task, which takes effect
    only at the task's next suspension: a replay or a demo computing for seconds between
    awaits would go on (and a run that never suspends again ends as if nothing happened).
    A SIGINT handler of our own raising KeyboardInterrupt keeps asyncio's out of the way.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):  # not ours to change (e.g. SIGINT ignored by the parent)
        yield
        return

    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class PlainProgress:
    """Progress for a log or a pipe: a plain line on ``console`` at most every ``every_s``
    seconds (the first one at once). :meth:`__call__` takes the line to print."""

    def __init__(self, console: Console, every_s: float = PROGRESS_EVERY_S) -> None:
        self.console = console
        self.every_s = every_s
        self._last = float("-inf")

    def __call__(self, line: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.every_s:
            self._last = now
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)

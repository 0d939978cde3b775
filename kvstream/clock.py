"""Clocks: the only place kvstream reads time, so tests can control it."""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "ManualClock", "SystemClock", "SYSTEM_CLOCK"]


@runtime_checkable
class Clock(Protocol):
    """Wall time for timestamps on the wire, monotonic time for durations and deadlines."""

    def time_ns(self) -> int:
        """Nanoseconds since the Unix epoch (wall clock; may jump)."""
        ...

    def monotonic_ns(self) -> int:
        """Nanoseconds from an arbitrary origin that never goes backwards."""
        ...


class SystemClock:
    """The process clock."""

    def time_ns(self) -> int:
        return time.time_ns()

    def monotonic_ns(self) -> int:
        return time.monotonic_ns()


SYSTEM_CLOCK: Clock = SystemClock()


class ManualClock:
    """A clock that only moves when told to; for tests and deterministic replays."""

    def __init__(self, start_ns: int = 0) -> None:
        self._wall = start_ns
        self._mono = 0

    def time_ns(self) -> int:
        return self._wall

    def monotonic_ns(self) -> int:
        return self._mono

    def advance(self, ns: int) -> None:
        """Move both clocks forward by ``ns`` nanoseconds (``ns`` >= 0)."""
        if ns < 0:
            raise ValueError("a ManualClock cannot go backwards")
        self._wall += ns
        self._mono += ns

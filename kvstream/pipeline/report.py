"""What a pipeline reports per sink: live stats and the result of closing it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CloseReport", "SinkReport"]


@dataclass(frozen=True, slots=True)
class SinkReport:
    """Counts for one sink. ``dropped`` maps a drop reason to a number of events.

    ``undelivered_events`` is every event accepted for this sink that it never received
    (dropped for any reason, including ``shutdown`` at close); ``lost_pending_ids`` is how many
    of the dropped ids no delivered ``lost`` marker covers (non-zero only when the sink failed
    until the end). ``in_doubt_events`` (reason ``unknown``) are among them but may have
    arrived after all: sent, never acknowledged, and the sink could not read them back
    (e.g. the broker never came back). The events really missing are at least
    ``undelivered_events - in_doubt_events`` and at most ``undelivered_events``; with
    ``in_doubt_events == 0`` exactly ``undelivered_events``.
    """

    sink: str
    events_in: int
    events_out: int
    batches_out: int
    dropped: Mapping[str, int]
    lost_markers_out: int
    lost_pending_ids: int
    retries: int
    queued_batches: int
    queued_events: int
    flushed: bool | None = None
    shut_down: bool | None = None
    last_error: str | None = None

    @property
    def undelivered_events(self) -> int:
        """Events accepted or offered for this sink that it never received."""
        return sum(self.dropped.values())

    @property
    def in_doubt_events(self) -> int:
        """Undelivered events that may have arrived after all (drop reason ``unknown``)."""
        return self.dropped.get("unknown", 0)

    @property
    def ok(self) -> bool:
        """Nothing undelivered and (after close) flushed and shut down cleanly."""
        return (
            self.undelivered_events == 0
            and self.lost_pending_ids == 0
            and self.flushed is not False
            and self.shut_down is not False
        )

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "sink": self.sink,
            "events_in": self.events_in,
            "events_out": self.events_out,
            "batches_out": self.batches_out,
            "dropped": dict(self.dropped),
            "undelivered_events": self.undelivered_events,
            "in_doubt_events": self.in_doubt_events,
            "lost_markers_out": self.lost_markers_out,
            "lost_pending_ids": self.lost_pending_ids,
            "retries": self.retries,
            "queued_batches": self.queued_batches,
            "queued_events": self.queued_events,
            "flushed": self.flushed,
            "shut_down": self.shut_down,
            "last_error": self.last_error,
        }


@dataclass(frozen=True, slots=True)
class CloseReport:
    """The outcome of :meth:`Pipeline.aclose`: one :class:`SinkReport` per sink."""

    sinks: Mapping[str, SinkReport] = field(default_factory=dict)
    elapsed_s: float = 0.0
    #: True when the drain did not finish before the close deadline.
    timed_out: bool = False

    @property
    def undelivered_events(self) -> int:
        """Events some sink never received, summed over sinks."""
        return sum(r.undelivered_events for r in self.sinks.values())

    @property
    def ok(self) -> bool:
        """Every sink received everything and shut down cleanly."""
        return not self.timed_out and all(r.ok for r in self.sinks.values())

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "ok": self.ok,
            "elapsed_s": round(self.elapsed_s, 6),
            "timed_out": self.timed_out,
            "undelivered_events": self.undelivered_events,
            "sinks": {name: r.as_dict() for name, r in self.sinks.items()},
        }

"""Active load per worker, as a router sees it: the requests it sent and not yet finished,
and the prefill work among them not yet done (the queue an adaptive router weighs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from kvstream.index.types import WorkerKey

__all__ = ["LoadTracker", "WorkerLoad"]


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """``active_requests`` routed and unfinished; ``active_blocks`` the KV blocks they hold
    (Dynamo's "decode blocks"); ``pending_prefill_blocks`` the blocks still to prefill among
    them (queued or prefilling: what a new request would wait behind)."""

    active_requests: int = 0
    active_blocks: int = 0
    pending_prefill_blocks: float = 0.0


class LoadTracker:
    """Counts what each worker is busy with. The router (or its caller) calls
    :meth:`start` when a request is sent, :meth:`prefilled` when its first token is out,
    :meth:`update` as it grows, :meth:`finish` when it completes; unknown request ids in
    ``prefilled``/``update``/``finish`` are ignored (idempotent)."""

    def __init__(self) -> None:
        self._requests: dict[str, tuple[WorkerKey, int]] = {}
        self._prefill: dict[str, float] = {}  # request -> blocks it still has to prefill
        #: worker -> [active requests, active blocks, pending prefill blocks, requests with
        #: pending prefill]: one row per worker, so a router's read is one probe per worker
        self._loads: dict[WorkerKey, list[Any]] = {}

    def _row(self, worker: WorkerKey) -> list[Any]:
        row = self._loads.get(worker)
        if row is None:
            row = self._loads[worker] = [0, 0, 0.0, 0]
        return row

    def start(
        self,
        request_id: str,
        worker: WorkerKey,
        blocks: int,
        *,
        prefill_blocks: float | None = None,
    ) -> None:
        """Record ``request_id`` as running on ``worker`` holding ``blocks`` blocks, with
        ``prefill_blocks`` of them still to compute (default: all ``blocks``) until
        :meth:`prefilled`; a request id already running is moved, not double counted."""
        if request_id in self._requests:
            self.finish(request_id)
        self._requests[request_id] = (worker, blocks)
        row = self._row(worker)
        row[0] += 1
        row[1] += blocks
        todo = float(blocks if prefill_blocks is None else max(prefill_blocks, 0.0))
        if todo:
            self._prefill[request_id] = todo
            row[2] += todo
            row[3] += 1

    def prefilled(self, request_id: str) -> None:
        """The request's prompt is computed (its first token is out): its blocks no longer
        count as pending prefill."""
        todo = self._prefill.pop(request_id, None)
        if todo is None:
            return
        row = self._loads[self._requests[request_id][0]]
        n = row[3] = row[3] - 1
        # exactly 0.0 once nothing is pending, whatever the float sums left behind
        row[2] = row[2] - todo if n else 0.0

    def update(self, request_id: str, blocks: int) -> None:
        """The request now holds ``blocks`` blocks."""
        cur = self._requests.get(request_id)
        if cur is None:
            return
        worker, old = cur
        self._requests[request_id] = (worker, blocks)
        self._loads[worker][1] += blocks - old

    def finish(self, request_id: str) -> WorkerKey | None:
        """The request completed; returns the worker it ran on (None if unknown)."""
        if request_id not in self._requests:
            return None
        self.prefilled(request_id)
        worker, blocks = self._requests.pop(request_id)
        row = self._loads[worker]
        row[0] -= 1
        row[1] -= blocks
        return worker

    def load(self, worker: WorkerKey) -> WorkerLoad:
        """The current load of ``worker`` (zero when it has none)."""
        row = self._loads.get(worker, _IDLE)
        return WorkerLoad(row[0], row[1], row[2])

    def pending_prefill_blocks(self, worker: WorkerKey) -> float:
        """Blocks ``worker`` still has to prefill for its active requests."""
        return float(self._loads.get(worker, _IDLE)[2])

    def active_blocks(self, worker: WorkerKey) -> int:
        """Blocks held by ``worker``'s active requests."""
        return int(self._loads.get(worker, _IDLE)[1])

    def active_requests(self, worker: WorkerKey) -> int:
        """``worker``'s active requests."""
        return int(self._loads.get(worker, _IDLE)[0])

    def columns(
        self, workers: Sequence[WorkerKey]
    ) -> tuple[Sequence[float], Sequence[int], Sequence[int]]:
        """Per worker of ``workers``, in order: :meth:`pending_prefill_blocks`,
        :meth:`active_blocks` and :meth:`active_requests` (what a router reads per
        decision, in one probe per worker)."""
        if not workers:
            return (), (), ()
        # every row has the same four fields: the transpose needs no strict check
        rows = map(self._loads.get, workers, repeat(_IDLE))
        requests, blocks, pending, _ = zip(*rows, strict=False)
        return pending, blocks, requests

    def __len__(self) -> int:
        return len(self._requests)


#: the row of a worker without load
_IDLE: tuple[int, int, float, int] = (0, 0, 0.0, 0)

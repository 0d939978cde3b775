"""Active load per worker, as a router sees it: the requests it sent and not yet finished."""

from __future__ import annotations

from dataclasses import dataclass

from kvstream.index.types import WorkerKey

__all__ = ["LoadTracker", "WorkerLoad"]


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """``active_requests`` routed and unfinished; ``active_blocks`` the KV blocks they hold
    (Dynamo's "decode blocks")."""

    active_requests: int = 0
    active_blocks: int = 0


class LoadTracker:
    """Counts what each worker is busy with. The router (or its caller) calls
    :meth:`start` when a request is sent, :meth:`update` as it grows, :meth:`finish` when it
    completes; unknown request ids in ``update``/``finish`` are ignored (idempotent)."""

    def __init__(self) -> None:
        self._requests: dict[str, tuple[WorkerKey, int]] = {}
        self._blocks: dict[WorkerKey, int] = {}
        self._count: dict[WorkerKey, int] = {}

    def start(self, request_id: str, worker: WorkerKey, blocks: int) -> None:
        """Record ``request_id`` as running on ``worker`` holding ``blocks`` blocks (a
        request id already running is moved, not double counted)."""
        self.finish(request_id)
        self._requests[request_id] = (worker, blocks)
        self._blocks[worker] = self._blocks.get(worker, 0) + blocks
        self._count[worker] = self._count.get(worker, 0) + 1

    def update(self, request_id: str, blocks: int) -> None:
        """The request now holds ``blocks`` blocks."""
        cur = self._requests.get(request_id)
        if cur is None:
            return
        worker, old = cur
        self._requests[request_id] = (worker, blocks)
        self._blocks[worker] += blocks - old

    def finish(self, request_id: str) -> WorkerKey | None:
        """The request completed; returns the worker it ran on (None if unknown)."""
        cur = self._requests.pop(request_id, None)
        if cur is None:
            return None
        worker, blocks = cur
        self._blocks[worker] -= blocks
        self._count[worker] -= 1
        return worker

    def load(self, worker: WorkerKey) -> WorkerLoad:
        """The current load of ``worker`` (zero when it has none)."""
        return WorkerLoad(self._count.get(worker, 0), self._blocks.get(worker, 0))

    def active_blocks(self, worker: WorkerKey) -> int:
        """Blocks held by ``worker``'s active requests."""
        return self._blocks.get(worker, 0)

    def active_requests(self, worker: WorkerKey) -> int:
        """``worker``'s active requests."""
        return self._count.get(worker, 0)

    def __len__(self) -> int:
        return len(self._requests)

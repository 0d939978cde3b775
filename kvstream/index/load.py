"""Active load per worker, as a router sees it: the requests it sent and not yet finished,
and the prefill work among them not yet done (the queue an adaptive router weighs)."""

from __future__ import annotations

from dataclasses import dataclass

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
        self._blocks: dict[WorkerKey, int] = {}
        self._count: dict[WorkerKey, int] = {}
        self._prefill: dict[str, float] = {}  # request -> blocks it still has to prefill
        self._pending: dict[WorkerKey, float] = {}
        self._pending_count: dict[WorkerKey, int] = {}

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
        self.finish(request_id)
        self._requests[request_id] = (worker, blocks)
        self._blocks[worker] = self._blocks.get(worker, 0) + blocks
        self._count[worker] = self._count.get(worker, 0) + 1
        todo = float(blocks if prefill_blocks is None else max(prefill_blocks, 0.0))
        if todo:
            self._prefill[request_id] = todo
            self._pending[worker] = self._pending.get(worker, 0.0) + todo
            self._pending_count[worker] = self._pending_count.get(worker, 0) + 1

    def prefilled(self, request_id: str) -> None:
        """The request's prompt is computed (its first token is out): its blocks no longer
        count as pending prefill."""
        todo = self._prefill.pop(request_id, None)
        if todo is None:
            return
        worker = self._requests[request_id][0]
        n = self._pending_count[worker] - 1
        self._pending_count[worker] = n
        # exactly 0.0 once nothing is pending, whatever the float sums left behind
        self._pending[worker] = self._pending[worker] - todo if n else 0.0

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
        if request_id not in self._requests:
            return None
        self.prefilled(request_id)
        cur = self._requests.pop(request_id)
        worker, blocks = cur
        self._blocks[worker] -= blocks
        self._count[worker] -= 1
        return worker

    def load(self, worker: WorkerKey) -> WorkerLoad:
        """The current load of ``worker`` (zero when it has none)."""
        return WorkerLoad(
            self._count.get(worker, 0),
            self._blocks.get(worker, 0),
            self._pending.get(worker, 0.0),
        )

    def pending_prefill_blocks(self, worker: WorkerKey) -> float:
        """Blocks ``worker`` still has to prefill for its active requests."""
        return self._pending.get(worker, 0.0)

    def active_blocks(self, worker: WorkerKey) -> int:
        """Blocks held by ``worker``'s active requests."""
        return self._blocks.get(worker, 0)

    def active_requests(self, worker: WorkerKey) -> int:
        """``worker``'s active requests."""
        return self._count.get(worker, 0)

    def __len__(self) -> int:
        return len(self._requests)

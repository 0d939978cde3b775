"""A consumer: reads a source into a prefix index, snapshots both, commits after snapshots.

::

    consumer = IndexConsumer.resume("idx.snap", lambda ckpt: open_source(url, resume_from=ckpt))
    async with consumer.source:
        await consumer.run(snapshot_every_batches=10_000)

Offsets are committed only together with the index state they produced: a snapshot stores
the index and the source's checkpoint in one atomic file, and only after that file is written
is the checkpoint committed to the stream (Kafka consumer groups). A consumer that crashes
restarts from its last snapshot and re-reads what came after; re-read events are recognised
by their ids and skipped by the index.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstream.index.index import PrefixIndex
from kvstream.index.snapshot import encode_snapshot, load_snapshot, write_atomic
from kvstream.index.sources.base import EventSource, SourceItem

__all__ = ["ConsumerReport", "IndexConsumer"]


@dataclass(frozen=True, slots=True)
class ConsumerReport:
    """What a :meth:`IndexConsumer.run` call did."""

    batches: int
    snapshots: int
    elapsed_s: float
    ended: bool


class IndexConsumer:
    """Applies a source's batches to ``index`` (a new one by default).

    ``snapshot_path``: where :meth:`snapshot` writes; ``meta``: stored with every snapshot.
    """

    def __init__(
        self,
        source: EventSource,
        index: PrefixIndex | None = None,
        *,
        snapshot_path: str | os.PathLike[str] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.source = source
        self.index = index if index is not None else PrefixIndex()
        self.snapshot_path = None if snapshot_path is None else Path(snapshot_path)
        self.meta = dict(meta or {})
        self.batches = 0
        self.snapshots = 0
        self._since_snapshot = 0

    @classmethod
    def resume(
        cls,
        snapshot_path: str | os.PathLike[str],
        make_source: Callable[[dict[str, Any] | None], EventSource],
        *,
        index_factory: Callable[[], PrefixIndex] | None = None,
        hasher_params: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> IndexConsumer:
        """A consumer restored from ``snapshot_path`` when it exists (its source resumes at
        the stored checkpoint), else a fresh one (``make_source(None)``). SnapshotError when
        the file exists but cannot be read."""
        path = Path(snapshot_path)
        if path.exists():
            snap = load_snapshot(path, hasher_params=hasher_params)
            return cls(make_source(snap.positions), snap.index, snapshot_path=path, meta=snap.meta)
        index = index_factory() if index_factory is not None else PrefixIndex()
        return cls(make_source(None), index, snapshot_path=path)

    def apply(self, item: SourceItem) -> None:
        """Apply one item to the index."""
        self.index.apply(item.data, item.skipped_ids)
        self.batches += 1
        self._since_snapshot += 1

    def drain(self) -> int:
        """Apply what a memory source has buffered without waiting; returns how many."""
        poll_batch = getattr(self.source, "poll_batch", None)
        if poll_batch is not None and type(self).apply is IndexConsumer.apply:
            # the batches themselves: what apply() would do with their items, without them
            index = self.index
            n = 0
            while True:
                batch = poll_batch()
                if batch is None:
                    return n
                index.apply(batch)
                self.batches += 1
                self._since_snapshot += 1
                n += 1
        poll = getattr(self.source, "poll", None)
        if poll is None:
            return 0
        n = 0
        while True:
            item = poll()
            if item is None:
                return n
            self.apply(item)
            n += 1

    async def catch_up(self, timeout_s: float = 0.0) -> int:
        """Apply every item that arrives within ``timeout_s`` of the previous one."""
        n = 0
        while True:
            item = await self.source.read(timeout_s)
            if item is None:
                return n
            self.apply(item)
            n += 1

    async def run(
        self,
        *,
        max_batches: int | None = None,
        snapshot_every_batches: int | None = None,
        snapshot_every_s: float | None = None,
        stop: asyncio.Event | None = None,
    ) -> ConsumerReport:
        """Apply batches until the source ends, ``max_batches`` were applied or ``stop`` is
        set; snapshot (then commit) every so many batches or seconds when a snapshot path is
        configured, and once more at the end if anything changed."""
        t0 = time.monotonic()
        last_snap = t0
        done = 0
        snaps = self.snapshots
        while max_batches is None or done < max_batches:
            if stop is not None and stop.is_set():
                break
            item = await self.source.read(0.2 if stop is not None else None)
            if item is None:
                if self.source.ended:
                    break
                continue
            self.apply(item)
            done += 1
            if self.snapshot_path is not None:
                due = (
                    snapshot_every_batches is not None
                    and self._since_snapshot >= snapshot_every_batches
                )
                if (
                    snapshot_every_s is not None
                    and time.monotonic() - last_snap >= snapshot_every_s
                ):
                    due = True
                if due:
                    await self.snapshot()
                    last_snap = time.monotonic()
        if self.snapshot_path is not None and self._since_snapshot:
            await self.snapshot()
        return ConsumerReport(
            done, self.snapshots - snaps, time.monotonic() - t0, self.source.ended
        )

    async def snapshot(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the index and the source checkpoint atomically, then commit the checkpoint.
        Returns the path written (ValueError without a path)."""
        target = Path(path) if path is not None else self.snapshot_path
        if target is None:
            raise ValueError("no snapshot path configured")
        checkpoint = self.source.checkpoint()
        data = encode_snapshot(self.index, checkpoint, self.meta)  # consistent: no await yet
        await asyncio.to_thread(write_atomic, target, data)
        self.snapshots += 1
        self._since_snapshot = 0
        await self.source.commit(checkpoint)
        return target

"""What feeds the service's indexes: one task per registered engine rank or stream source.

- :class:`EngineFeed` follows one registered ZMQ publisher (vLLM or SGLang wire format) with
  :class:`~kvstream.index.sources.engine.EngineSource`: replay on start and on every gap, a
  new incarnation on an engine restart, each batch attributed to the DP rank it names.
- :class:`StreamFeed` follows a ``kafka://`` topic or a file-sink directory
  (:func:`~kvstream.index.sources.open_source` with ``follow=True``); an elastic Kafka
  group member forgets the workers of the partitions the group takes away.

A feed applies what it reads to its model's index and never raises out of its task: a
source that fails is retried with backoff, and its error is kept for ``/workers``. Each feed
says when it has caught up (``/ready``): an engine once its start-up replay is done (or,
without replay, once it delivered a batch or ``grace_s`` passed), Kafka once it has read up
to the end offsets it saw first, a file directory once it read everything already written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any, Final

from kvstream.errors import KVStreamError
from kvstream.index.sources import EventSource, open_source
from kvstream.kafka_security import redact_url
from kvstream.serve.config import SourceSpec
from kvstream.serve.models import ModelIndex, Registration

__all__ = ["EngineFeed", "Feed", "StreamFeed"]

log = logging.getLogger("kvstream.serve")

_READ_TIMEOUT_S: Final = 0.25
_READY_BATCHES: Final = 64  # batches applied in one turn of the event loop at most
_MAX_BACKOFF_S: Final = 10.0


class Feed:
    """A task that reads one source into one model's index (see the module docstring)."""

    #: a short unique name (the key of its checkpoint in snapshots)
    name: str

    def __init__(self, name: str, model: ModelIndex, grace_s: float = 2.0) -> None:
        self.name = name
        self.model = model
        self.grace_s = grace_s
        self.source: EventSource | None = None
        self.batches = 0
        self.events = 0
        self.blocks = 0
        self.errors = 0
        self.last_error = ""
        self.last_batch_at: float | None = None
        self.started_at = time.monotonic()
        self._caught_up = False
        self._task: asyncio.Task[None] | None = None
        self._resume: Mapping[str, Any] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, resume_from: Mapping[str, Any] | None = None) -> None:
        """Start reading (from ``resume_from``, a checkpoint of this feed, when given)."""
        self._resume = resume_from
        self.started_at = time.monotonic()
        self._task = asyncio.create_task(self._run(), name=f"kvstream-serve-feed:{self.name}")

    async def aclose(self) -> None:
        """Stop reading and close the source (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.source is not None:
            with contextlib.suppress(Exception):
                await self.source.aclose()

    def checkpoint(self) -> dict[str, Any] | None:
        """Where a restart resumes (None before the source opened)."""
        if self.source is None:
            return dict(self._resume) if self._resume else None
        return self.source.checkpoint()

    @property
    def caught_up(self) -> bool:
        """Whatever the source held when the feed started has been applied."""
        return self._caught_up

    # ------------------------------------------------------------------ reading

    def _open(self, resume_from: Mapping[str, Any] | None) -> EventSource:
        raise NotImplementedError

    async def _check_caught_up(self, idle: bool) -> bool:
        """Whether the feed has caught up (``idle``: the last read returned nothing)."""
        return idle

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            try:
                if self.source is None:
                    self.source = self._open(self._resume)
                await self._read_loop(self.source)
                return
            except asyncio.CancelledError:
                raise
            except (KVStreamError, OSError, ValueError) as exc:
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("%s: %s (retrying in %.1f s)", self.name, self.last_error, backoff)
                if self.source is not None:
                    self._resume = self.source.checkpoint()
                    with contextlib.suppress(Exception):
                        await self.source.aclose()
                    self.source = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)

    async def _read_loop(self, source: EventSource) -> None:
        apply = self.model.index.apply
        check_every = 0
        while True:
            item = await source.read(_READ_TIMEOUT_S)
            if item is None:
                if source.ended:
                    self._caught_up = True
                    return
                if not self._caught_up:
                    self._caught_up = await self._check_caught_up(True)
                continue
            # what else is ready now is applied in the same turn (no await per batch), up
            # to _READY_BATCHES, then the loop's other tasks get theirs
            ready = 0  # the source's batches (an engine source reads a burst into one item)
            while item is not None:
                data = item.data
                apply(data, item.skipped_ids)
                ids = getattr(data, "event_ids", None)  # columns; a model batch has events
                self.events += len(ids) if ids is not None else len(getattr(data, "events", ()))
                ready += item.count
                item = source.read_ready() if ready < _READY_BATCHES else None
            self.batches += ready
            self.last_batch_at = time.monotonic()
            if not self._caught_up:
                check_every += 1
                if check_every >= 64:
                    check_every = 0
                    self._caught_up = await self._check_caught_up(False)


class EngineFeed(Feed):
    """One registered engine rank (see the module docstring)."""

    def __init__(self, reg: Registration, model: ModelIndex, grace_s: float = 2.0) -> None:
        spec = reg.spec
        super().__init__(f"zmq:{spec.instance_id}:{spec.dp_rank}", model, grace_s)
        self.reg = reg

    def url(self) -> str:
        """The engine URL of the registration (:mod:`kvstream.engines.endpoint`)."""
        spec = self.reg.spec
        host_port = spec.endpoint.removeprefix("tcp://")
        opts = [f"instance={spec.instance_id}"]
        if spec.replay_endpoint is not None:
            rhost, _, rport = spec.replay_endpoint.removeprefix("tcp://").rpartition(":")
            if rhost != host_port.rpartition(":")[0]:
                raise ValueError(
                    f"replay endpoint {spec.replay_endpoint} must be on the publisher's host"
                )
            opts.append(f"replay={rport}")
        if self.reg.hash_algo:
            opts.append(f"hash_algo={self.reg.hash_algo}")
        return f"{self.reg.engine}://{host_port}?{'&'.join(opts)}"

    def _open(self, resume_from: Mapping[str, Any] | None) -> EventSource:
        from kvstream.index.sources.engine import EngineSource

        return EngineSource(
            self.url(),
            resume_from=resume_from,
            base_rank=self.reg.spec.dp_rank,
            rank_from_events=True,
            columns=True,  # no event model per batch: the token table reads the columns
        )

    def rank_stats(self) -> Any:
        """The subscriber's counters of the one socket (None before it opened)."""
        source = self.source
        sub = getattr(source, "subscriber", None)
        return None if sub is None else sub.stats.get(0)

    async def _check_caught_up(self, idle: bool) -> bool:
        st = self.rank_stats()
        if st is None:
            return False
        if self.reg.spec.replay_endpoint is not None:
            return bool(st.caught_up)
        return self.batches > 0 or time.monotonic() - self.started_at >= self.grace_s

    def status(self) -> tuple[str, str]:
        """``(status, note)`` for ``/workers``: pending (nothing heard yet), active, stale
        (the publisher went away, or a rank's index state is untrusted; the note says
        which), failed (the source keeps failing)."""
        st = self.rank_stats()
        if self.last_error and self.source is None:
            return "failed", self.last_error
        if st is not None and st.connected is False:
            return "stale", "disconnected: the engine's publisher went away"
        for w in self.model.workers_of(self.reg.spec.instance_id):
            info = self.model.index.info(w)
            if info.stale:
                return "stale", f"rank {w.dp_rank}: {info.stale_reason}"
        if self.batches == 0 and (st is None or st.connected is not True):
            return "pending", "waiting for the engine"
        return "active", ""


class StreamFeed(Feed):
    """A Kafka topic or a file-sink directory (see the module docstring)."""

    def __init__(self, spec: SourceSpec, model: ModelIndex) -> None:
        # the name shows in /workers, /metrics and snapshots: never a password in it
        super().__init__(f"source:{redact_url(spec.url)}", model)
        self.spec = spec

    def _open(self, resume_from: Mapping[str, Any] | None) -> EventSource:
        extra: dict[str, Any] = {}
        if self.spec.elastic:
            extra = {"elastic": True, "on_drop": self._drop}
        return open_source(self.spec.url, follow=True, resume_from=resume_from, **extra)

    def _drop(self, partitions: set[int], num_partitions: int) -> None:
        """An elastic shard lost ``partitions``: their workers leave the index."""
        from kvstream.index.shards import worker_partition

        index = self.model.index
        for w in index.workers():
            if worker_partition(w, num_partitions) in partitions:
                index.forget(w)

    async def _check_caught_up(self, idle: bool) -> bool:
        caught_up = getattr(self.source, "caught_up", None)
        if caught_up is not None:  # Kafka: up to the end offsets it saw first
            return bool(await caught_up())
        return idle

"""The vLLM export sink: kvstream batches published in vLLM's ZMQ wire format.

NVIDIA Dynamo, llm-d and anything else that subscribes to a vLLM engine's KV events can
subscribe to this sink instead, and so read kvstream streams: kvstream's own cache manager,
TensorRT-LLM or SGLang bridged through kvstream, a Kafka topic replayed by ``kvstream bridge``.

URL: ``vllm://HOST:PORT?replay=RPORT&dp_size=N|auto&instance=ID&ranks=0,1&topic=T&...``
(see :meth:`VllmSink.from_url`). The sink is the engine side of the connection, as vLLM is:

* rank r's PUB socket binds ``tcp://HOST:PORT+r``, its replay ROUTER ``tcp://HOST:RPORT+r``
  (:mod:`kvstream.engines.zmq_pub`): three frames ``[topic, seq, payload]`` per batch, ``seq``
  from 0, the last ``buffer_steps`` batches replayable;
* the payload is vLLM's msgpack ``KVEventBatch`` (:mod:`kvstream.engines.vllm_export` says
  what each kvstream event kind becomes); a batch with nothing to say is not sent;
* a source's ``attention_dp_rank`` (None: 0) picks its rank.

**Ranks.** ``dp_size=auto`` (the default) takes the ranks from the stream: rank 0 is bound at
start and rank r (with every rank below it) when its first batch comes. ``dp_size=N`` binds N
ranks at start and refuses batches of a rank ``>= N``.

**One sink = one engine.** A vLLM endpoint belongs to one engine. ``instance=ID`` selects the
engine instance to publish out of a stream that holds several (a fleet's Kafka topic), and
``ranks=0,1`` its ranks; batches of other instances or ranks are *skipped*: left out on
purpose, counted in :attr:`VllmSink.skipped`, not a loss. Without ``instance`` the sink
publishes the first ``instance_id`` it sees and refuses batches of any other (run one sink
per worker, on its own ports, or select one). A new ``incarnation`` of the instance looks
to subscribers exactly like a restarted vLLM: the rank's ``seq`` starts again at 0 with an
empty replay buffer (llm-d's restart detection), and the first batch begins with
``AllBlocksCleared`` (for consumers that ignore ``seq``, such as Dynamo), so every consumer
drops the old process's blocks.

**Refused batches are lost, and reported exactly.** A batch that cannot be published on this
endpoint — its rank is ``>= dp_size`` or cannot be bound, it is of a second instance (no
``instance`` selected), of an incarnation older than one already published, or a second
source on one rank — is counted in :attr:`VllmSink.rejected` (by reason) and logged. An
export that refused any batch fails permanently, its reason saying why (in the same words
for every export refused for the same reason); :meth:`VllmSink.abandon` then names the
batches that were published (or skipped), so the pipeline records exactly the refused ones
as lost (their ``lost`` markers are refused too, so the ids stay pending and the run is not
ok).
:meth:`VllmSink.details` sums it all up for reports (``kvstream bridge --json``).

**Delivery.** As with vLLM, PUB has no acknowledgement and drops a subscriber's messages at
its high-water mark; gaps are visible in ``seq`` and recoverable through replay while the
batches are buffered. ``export`` hands each batch to ZMQ without blocking, so
``force_flush`` has nothing to wait for; ``shutdown`` lets the PUB sockets spend at most
``linger_s`` (bounded by its deadline) sending what they still queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from kvstream.engines.vllm_export import HASH_FORMATS, HashFormat, VllmExporter
from kvstream.engines.zmq_pub import PublisherGroup
from kvstream.errors import (
    ConfigError,
    InteropError,
    PermanentSinkError,
    RetriableSinkError,
    SinkError,
)
from kvstream.events.model import EventBatch
from kvstream.sink import Abandoned, ExportResult, Sink, SinkURL

__all__ = ["VllmSink"]

log = logging.getLogger("kvstream.sinks.vllm")

_MAX_PORT: Final = 65535
_MAX_RANKS: Final = 1024
#: Batches published between two yields to the event loop.
_YIELD_EVERY: Final = 64

#: Reasons a batch is rejected (keys of :attr:`VllmSink.rejected`).
RANK_OUT_OF_RANGE: Final = "rank_out_of_range"
RANK_UNBINDABLE: Final = "rank_unbindable"
OTHER_INSTANCE: Final = "other_instance"
OTHER_SOURCE: Final = "other_source_on_rank"
STALE_INCARNATION: Final = "stale_incarnation"
#: Reasons a batch is skipped on purpose (keys of :attr:`VllmSink.skipped`).
UNSELECTED_INSTANCE: Final = "unselected_instance"
UNSELECTED_RANK: Final = "unselected_rank"


@dataclass(slots=True)
class _Export:
    """One export's progress: where it is (a cancelled export retried with the same batches
    resumes there), the batches that reached the endpoint (published, or skipped on purpose)
    and why the others were refused (the first reason of each kind)."""

    batches: Sequence[EventBatch]
    done: int = 0
    delivered: list[EventBatch] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)

    def same(self, batches: Sequence[EventBatch]) -> bool:
        mine = self.batches
        return len(mine) == len(batches) and all(
            a is b for a, b in zip(mine, batches, strict=False)
        )

    def summary(self) -> str:
        """Why batches of this export were not published, one clause per reason. The same
        words for every export refused for the same reason (so repeated log lines collapse);
        the pipeline counts the refused batches exactly, :meth:`VllmSink.details` sums them."""
        return "batches not published: " + "; ".join(
            f"{kind}: {first}" for kind, first in self.refused.items()
        )


class VllmSink(Sink):
    """Publish batches as a vLLM engine publishes KV events; see the module docstring."""

    scheme = "vllm"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 5557,
        *,
        replay_port: int | None = None,
        dp_size: int | None = None,
        instance: str | None = None,
        ranks: Collection[int] | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        hash_format: HashFormat = "int",
        track_blocks: int = 100_000,
        linger_s: float = 1.0,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        if not host:
            raise ConfigError("a vllm sink needs a host to bind (e.g. 127.0.0.1 or *)")
        if dp_size is not None and not 1 <= dp_size <= _MAX_RANKS:
            raise ConfigError(f"dp_size must be in 1..{_MAX_RANKS} or auto, got {dp_size}")
        selected = None if ranks is None else frozenset(ranks)
        if selected is not None and (
            not selected or any(not 0 <= r < (dp_size or _MAX_RANKS) for r in selected)
        ):
            raise ConfigError(
                f"ranks must be ranks in 0..{(dp_size or _MAX_RANKS) - 1}"
                f"{f' (dp_size={dp_size})' if dp_size else ''}, got {sorted(ranks or ())}"
            )
        if instance is not None and not instance:
            raise ConfigError("instance must be a non-empty instance_id")
        problem = _port_problem(port, replay_port, dp_size or 1)
        if problem is not None:
            raise ConfigError(problem)
        if linger_s < 0:
            raise ConfigError(f"linger_s must be >= 0, got {linger_s}")
        self.host = host
        self.port = port
        self.replay_port = replay_port
        #: Ranks bound at start and refused beyond; None: taken from the stream (``auto``).
        self.fixed_dp_size = dp_size
        #: The instance and ranks selected (None: the first instance seen; every rank).
        self.instance = instance
        self.ranks = selected
        self.linger_s = linger_s
        self._exporter = VllmExporter(hash_format=hash_format, track_blocks=track_blocks)
        self._group = PublisherGroup(
            host,
            port,
            replay_port=replay_port,
            dp_size=dp_size or 1,
            topic=topic,
            buffer_steps=buffer_steps,
            hwm=hwm,
        )
        self._start_lock = asyncio.Lock()
        self._started = False
        self._closed = False
        self._instance: str | None = instance
        self._rank_source: dict[int, int | None] = {}
        self._unbindable: dict[int, str] = {}  # rank -> why it cannot be bound (auto)
        self._bound = 0  # ranks bound (kept after shutdown, for details())
        self._export: _Export | None = None  # the last export (abandon() reports on it)
        #: Batches and vLLM events published, incarnation restarts; batches refused and
        #: skipped on purpose, by reason (each time they were offered: a refused source's
        #: ``lost`` markers are refused too), with the events they held.
        self.published_batches = 0
        self.published_events = 0
        self.restarts = 0
        self.rejected: dict[str, int] = {}
        self.rejected_events: dict[str, int] = {}
        self.last_rejection: str | None = None
        self.skipped: dict[str, int] = {}
        self.skipped_events: dict[str, int] = {}

    # ------------------------------------------------------------------------ from_url

    _URL_KEYS: Final = (
        "replay",
        "dp_size",
        "instance",
        "ranks",
        "topic",
        "buffer_steps",
        "hwm",
        "hash_format",
        "track_blocks",
        "linger_s",
        "name",
    )

    @classmethod
    def from_url(cls, url: SinkURL) -> VllmSink:
        """``vllm://HOST:PORT?replay=RPORT&dp_size=N|auto&instance=ID&ranks=0,1&topic=T&...``.

        ``HOST`` is the interface to bind (``*`` or ``0.0.0.0``: all, ``[::1]``: IPv6),
        ``PORT`` rank 0's PUB port. Keys: ``replay`` (rank 0's replay ROUTER port; none
        without it), ``dp_size`` (ranks: ``auto``, the default, takes them from the stream;
        a number binds that many and refuses higher ranks), ``instance`` (the engine
        instance to publish; others are skipped), ``ranks`` (comma-separated ranks to
        publish; others are skipped), ``topic`` (default empty; llm-d expects
        ``kv@POD@MODEL``), ``buffer_steps`` (batches kept for replay, default 10000),
        ``hwm`` (PUB high-water mark, default 100000), ``hash_format`` (``int``, the default,
        or ``bytes`` for 256-bit hashes), ``track_blocks`` (stored blocks remembered per
        source to republish tier moves, default 100000), ``linger_s`` (how long shutdown
        lets queued frames go out, default 1), ``name``.
        """
        url.check_keys(cls._URL_KEYS)
        if url.path not in ("", "/"):
            raise ConfigError(f"expected vllm://HOST:PORT?..., got {url.raw!r}")
        try:
            parts = urlsplit(f"//{url.netloc}")
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise ConfigError(f"bad HOST:PORT in {url.raw!r}: {exc}") from None
        if not host or port is None:
            raise ConfigError(f"expected vllm://HOST:PORT?..., got {url.raw!r}")
        hash_format = url.get("hash_format", "int")
        if hash_format not in HASH_FORMATS:
            raise ConfigError(
                f"hash_format must be one of {', '.join(HASH_FORMATS)} in {url.raw!r}, "
                f"got {hash_format!r}"
            )
        dp_raw = url.get("dp_size", "auto")
        return cls(
            host,
            port,
            replay_port=url.get_int("replay"),
            dp_size=None if dp_raw == "auto" else url.get_int("dp_size"),
            instance=url.get("instance"),
            ranks=_ranks(url),
            topic=url.get("topic", "") or "",
            buffer_steps=_int(url, "buffer_steps", 10_000),
            hwm=_int(url, "hwm", 100_000),
            hash_format=hash_format,
            track_blocks=_int(url, "track_blocks", 100_000),
            linger_s=url.get_float("linger_s", 1.0) or 0.0,
            name=url.get("name"),
        )

    # ----------------------------------------------------------------------- endpoints

    def endpoint(self, rank: int) -> str:
        """Rank ``rank``'s PUB address (``tcp://HOST:PORT+rank``)."""
        return self._group.endpoint(rank)

    def replay_endpoint(self, rank: int) -> str | None:
        """Rank ``rank``'s replay ROUTER address, or None without replay."""
        return self._group.replay_endpoint(rank)

    def next_seq(self, rank: int) -> int:
        """The seq rank ``rank``'s next batch gets (0 before the first)."""
        ranks = self._group.ranks
        return ranks[rank].next_seq if ranks else 0

    @property
    def is_shut_down(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._closed

    @property
    def exporter(self) -> VllmExporter:
        """The kvstream -> vLLM mapping (its ``unmapped`` counts events with no wire form)."""
        return self._exporter

    # ----------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Bind every rank's PUB and replay sockets.

        Raises :class:`RetriableSinkError` when a port is in use and
        :class:`PermanentSinkError` when an address cannot be bound at all.
        """
        async with self._start_lock:
            if self._closed:
                raise PermanentSinkError("the vllm sink is shut down")
            if self._started:
                return
            try:
                await self._group.start()
            except ConfigError as exc:
                raise PermanentSinkError(str(exc)) from exc
            except OSError as exc:
                raise RetriableSinkError(str(exc)) from exc
            self._started = True
            self._bound = len(self._group.ranks)
            log.info(
                "vllm sink publishing on %s (replay %s), %s rank(s)",
                self.endpoint(0),
                self.replay_endpoint(0),
                self.fixed_dp_size or "auto: the stream's",
            )

    @property
    def dp_size(self) -> int:
        """The ranks bound so far (with ``dp_size=auto``, grows with the stream)."""
        return len(self._group.ranks) or self._group.dp_size

    async def export(self, batches: Sequence[EventBatch]) -> ExportResult:
        """Publish ``batches`` in order (module docstring: ranks, selection, refusals).

        Each batch is encoded and sent synchronously; the loop is yielded between groups of
        batches, and an export cancelled there and retried with the same batches resumes
        after the last one sent (nothing is published twice). An export that refused any
        batch fails permanently, saying why; the rest went out (:meth:`abandon` names it).
        """
        if self._closed:
            return ExportResult.permanent("the vllm sink is shut down")
        if not self._started:
            try:
                await self.start()
            except SinkError as exc:
                return ExportResult.from_exception(exc)
        state = self._export
        if state is None or not state.same(batches) or state.done >= len(batches):
            state = self._export = _Export(batches)
        first = state.done
        for i in range(first, len(batches)):
            if i > first and (i - first) % _YIELD_EVERY == 0:
                await asyncio.sleep(0)
                if self.is_shut_down:
                    return ExportResult.permanent("the vllm sink was shut down mid-export")
            batch = batches[i]
            try:
                refusal = await self._offer(batch)
            except ConnectionError as exc:
                return ExportResult.permanent(f"the vllm sink cannot publish: {exc}", exc)
            if refusal is None:
                state.delivered.append(batch)
            else:
                kind, reason = refusal
                self.rejected_events[kind] = self.rejected_events.get(kind, 0) + len(batch.events)
                state.refused.setdefault(kind, reason)
            state.done = i + 1
        if state.refused:
            reason = state.summary()
            return ExportResult.permanent(reason, PermanentSinkError(reason))
        return ExportResult.success()

    def abandon(self) -> Abandoned:
        """The batches of the last export that reached the endpoint: published, or skipped
        on purpose (every other one was refused, or not reached before a cancellation)."""
        state = self._export
        return Abandoned(delivered=tuple(state.delivered) if state is not None else ())

    def details(self) -> dict[str, Any]:
        """What this sink did, for reports (JSON-ready; ``kvstream bridge --json``)."""
        return {
            "dp_size": self.fixed_dp_size or "auto",
            "ranks_bound": self._bound,
            "instance": self._instance,
            "ranks": sorted(self.ranks) if self.ranks is not None else "all",
            "published_batches": self.published_batches,
            "published_events": self.published_events,
            "restarts": self.restarts,
            "rejected_batches": dict(self.rejected),
            "rejected_events": dict(self.rejected_events),
            "last_rejection": self.last_rejection,
            "skipped_batches": dict(self.skipped),
            "skipped_events": dict(self.skipped_events),
            "unmapped_events": dict(self._exporter.unmapped),
        }

    async def force_flush(self, timeout_s: float | None = None) -> bool:
        """Every exported batch is already with ZMQ, which acknowledges nothing: True."""
        return True

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop publishing and serving replays; the PUB sockets get ``linger_s`` (at most
        ``timeout_s``) to send what they queue. Later exports fail permanently."""
        self._closed = True
        async with self._start_lock:
            started, self._started = self._started, False
        if not started:
            return
        linger = self.linger_s if timeout_s is None else min(self.linger_s, max(timeout_s, 0.0))
        try:
            await self._group.close(linger)
        except Exception:  # releasing must not raise; the sockets are gone either way
            log.exception("closing the vllm sink's sockets failed")

    # -------------------------------------------------------------------------- publish

    async def _offer(self, batch: EventBatch) -> tuple[str, str] | None:
        """Publish or skip one batch; (reason, why) when it is refused."""
        source = batch.source
        rank = source.attention_dp_rank or 0
        if self.instance is not None and source.instance_id != self.instance:
            self._skip(UNSELECTED_INSTANCE, batch)
            return None
        if self.ranks is not None and rank not in self.ranks:
            self._skip(UNSELECTED_RANK, batch)
            return None
        if rank >= self.dp_size:
            problem = await self._bind_rank(rank, source.instance_id)
            if problem is not None:
                return problem
        if self._instance is None:
            self._instance = source.instance_id
        elif source.instance_id != self._instance:
            return self._reject(
                OTHER_INSTANCE,
                f"instance {source.instance_id!r}: this endpoint publishes {self._instance!r} "
                "(one vllm sink per engine instance: select one with instance=ID)",
            )
        owner = self._rank_source.setdefault(rank, source.attention_dp_rank)
        if owner != source.attention_dp_rank:
            return self._reject(
                OTHER_SOURCE,
                f"rank {rank} already carries the source with attention_dp_rank={owner}, "
                f"not {source.attention_dp_rank}",
            )
        try:
            out = self._exporter.encode(batch, dp_rank=rank)
        except InteropError as exc:
            return self._reject(STALE_INCARNATION, str(exc))
        publisher = self._group.ranks[rank]
        if out.restarted:
            publisher.restart()
            self.restarts += 1
        if out.payload is not None:
            publisher.publish(out.payload)
            self.published_batches += 1
            self.published_events += out.events
        return None

    async def _bind_rank(self, rank: int, instance: str) -> tuple[str, str] | None:
        """Bind ranks up to ``rank`` (``dp_size=auto``); the refusal when it cannot be."""
        if self.fixed_dp_size is not None:
            return self._reject(
                RANK_OUT_OF_RANGE,
                f"rank {rank} of {instance!r} is outside dp_size={self.fixed_dp_size} "
                "(dp_size=auto takes the ranks from the stream)",
            )
        why = self._unbindable.get(rank)
        if why is None:
            why = _port_problem(self.port, self.replay_port, rank + 1)
        if why is None:
            try:
                await self._group.grow(rank + 1)
            except (ConfigError, OSError) as exc:
                why = str(exc)
            else:
                self._bound = len(self._group.ranks)
                log.info("vllm sink %s: rank %d bound on %s", self.name, rank, self.endpoint(rank))
                return None
        self._unbindable[rank] = why
        return self._reject(
            RANK_UNBINDABLE, f"rank {rank} of {instance!r} cannot be published: {why}"
        )

    def _reject(self, kind: str, reason: str) -> tuple[str, str]:
        first = kind not in self.rejected
        self.rejected[kind] = self.rejected.get(kind, 0) + 1
        self.last_rejection = reason
        (log.warning if first else log.debug)("vllm sink %s: batch refused: %s", self.name, reason)
        return kind, reason

    def _skip(self, kind: str, batch: EventBatch) -> None:
        if kind not in self.skipped:
            log.info(
                "vllm sink %s: skipping %s (instance=%s, ranks=%s selected)",
                self.name,
                f"instance {batch.source.instance_id!r} rank {batch.source.attention_dp_rank}",
                self.instance or "any",
                sorted(self.ranks) if self.ranks is not None else "all",
            )
        self.skipped[kind] = self.skipped.get(kind, 0) + 1
        self.skipped_events[kind] = self.skipped_events.get(kind, 0) + len(batch.events)

    def __repr__(self) -> str:
        return f"<VllmSink {self.name!r} {self.endpoint(0)} x{self.fixed_dp_size or 'auto'}>"


def _int(url: SinkURL, key: str, default: int) -> int:
    value = url.get_int(key, default)
    return default if value is None else value


def _ranks(url: SinkURL) -> list[int] | None:
    raw = url.get("ranks")
    if raw is None:
        return None
    try:
        return [int(r) for r in raw.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(
            f"ranks must be comma-separated ranks (e.g. ranks=0,1) in {url.raw!r}, got {raw!r}"
        ) from None


def _port_problem(port: int, replay_port: int | None, dp_size: int) -> str | None:
    """Why ranks ``0..dp_size-1`` cannot use these ports (None: they can)."""
    if dp_size > _MAX_RANKS:
        return f"{dp_size} ranks: at most {_MAX_RANKS}"
    for what, base in (("port", port), ("replay", replay_port)):
        if base is not None and not (base >= 1 and base + dp_size - 1 <= _MAX_PORT):
            return f"{what} {base}: ports {base}..{base + dp_size - 1} must lie in 1..{_MAX_PORT}"
    if replay_port is not None and (
        port <= replay_port < port + dp_size or replay_port <= port < replay_port + dp_size
    ):
        return (
            f"replay ports {replay_port}..{replay_port + dp_size - 1} overlap the publisher "
            f"ports {port}..{port + dp_size - 1} (rank r publishes on PORT+r and replays on "
            "RPORT+r: leave at least as many ports as ranks between the two)"
        )
    return None

"""The vLLM export sink: kvstream batches published in vLLM's ZMQ wire format.

NVIDIA Dynamo, llm-d and anything else that subscribes to a vLLM engine's KV events can
subscribe to this sink instead, and so read kvstream streams: kvstream's own cache manager,
TensorRT-LLM or SGLang bridged through kvstream, a Kafka topic replayed by ``kvstream bridge``.

URL: ``vllm://HOST:PORT?replay=RPORT&dp_size=N&topic=T&buffer_steps=N&hwm=N&hash_format=int``
(see :meth:`VllmSink.from_url`). The sink is the engine side of the connection, as vLLM is:

* rank r's PUB socket binds ``tcp://HOST:PORT+r``, its replay ROUTER ``tcp://HOST:RPORT+r``
  (:mod:`kvstream.engines.zmq_pub`): three frames ``[topic, seq, payload]`` per batch, ``seq``
  from 0, the last ``buffer_steps`` batches replayable;
* the payload is vLLM's msgpack ``KVEventBatch`` (:mod:`kvstream.engines.vllm_export` says
  what each kvstream event kind becomes); a batch with nothing to say is not sent;
* a source's ``attention_dp_rank`` (None: 0) picks its rank.

**One sink = one engine.** A vLLM endpoint belongs to one engine, so the sink publishes the
first ``instance_id`` it sees and rejects batches of any other (run one sink per worker, on
its own ports). A new ``incarnation`` of the instance looks to subscribers exactly like a
restarted vLLM: the rank's ``seq`` starts again at 0 with an empty replay buffer (llm-d's
restart detection), and the first batch begins with ``AllBlocksCleared`` (for consumers that
ignore ``seq``, such as Dynamo), so every consumer drops the old process's blocks.

**Rejected batches.** A batch whose rank is ``>= dp_size``, of a second instance, or of an
incarnation older than one already published cannot be published on this endpoint. It is
counted in :attr:`VllmSink.rejected` (by reason) and logged; when every batch of an export is
rejected the export fails permanently (a :class:`~kvstream.errors.PermanentSinkError`), so the
pipeline counts the drop and writes ``lost`` markers. Batches of other sources in the same
export are still published and the export succeeds: a permanent failure would have the
pipeline put ``lost`` markers (``AllBlocksCleared`` here) in front of sources that lost
nothing.

**Delivery.** As with vLLM, PUB has no acknowledgement and drops a subscriber's messages at
its high-water mark; gaps are visible in ``seq`` and recoverable through replay while the
batches are buffered. ``export`` hands each batch to ZMQ without blocking, so
``force_flush`` has nothing to wait for; ``shutdown`` lets the PUB sockets spend at most
``linger_s`` (bounded by its deadline) sending what they still queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final
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
from kvstream.sink import ExportResult, Sink, SinkURL

__all__ = ["VllmSink"]

log = logging.getLogger("kvstream.sinks.vllm")

_MAX_PORT: Final = 65535
#: Batches published between two yields to the event loop.
_YIELD_EVERY: Final = 64

#: Reasons a batch is rejected (keys of :attr:`VllmSink.rejected`).
RANK_OUT_OF_RANGE: Final = "rank_out_of_range"
OTHER_INSTANCE: Final = "other_instance"
OTHER_SOURCE: Final = "other_source_on_rank"
STALE_INCARNATION: Final = "stale_incarnation"


@dataclass(slots=True)
class _Progress:
    """How far an export got before it was cancelled (a retry resumes there)."""

    batches: Sequence[EventBatch]
    done: int
    accepted: int

    def same(self, batches: Sequence[EventBatch]) -> bool:
        mine = self.batches
        return len(mine) == len(batches) and all(
            a is b for a, b in zip(mine, batches, strict=False)
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
        dp_size: int = 1,
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
        if not 1 <= dp_size <= 1024:
            raise ConfigError(f"dp_size must be in 1..1024, got {dp_size}")
        for what, base in (("port", port), ("replay", replay_port)):
            if base is not None and not (base >= 1 and base + dp_size - 1 <= _MAX_PORT):
                raise ConfigError(
                    f"{what} {base}: ports {base}..{base + dp_size - 1} must lie in 1..{_MAX_PORT}"
                )
        if replay_port is not None and (
            port <= replay_port < port + dp_size or replay_port <= port < replay_port + dp_size
        ):
            raise ConfigError(
                f"replay ports {replay_port}..{replay_port + dp_size - 1} overlap the "
                f"publisher ports {port}..{port + dp_size - 1}"
            )
        if linger_s < 0:
            raise ConfigError(f"linger_s must be >= 0, got {linger_s}")
        self.host = host
        self.port = port
        self.replay_port = replay_port
        self.dp_size = dp_size
        self.linger_s = linger_s
        self._exporter = VllmExporter(hash_format=hash_format, track_blocks=track_blocks)
        self._group = PublisherGroup(
            host,
            port,
            replay_port=replay_port,
            dp_size=dp_size,
            topic=topic,
            buffer_steps=buffer_steps,
            hwm=hwm,
        )
        self._start_lock = asyncio.Lock()
        self._started = False
        self._closed = False
        self._instance: str | None = None
        self._rank_source: dict[int, int | None] = {}
        self._progress: _Progress | None = None
        #: Batches and vLLM events published, incarnation restarts, rejected batches by reason.
        self.published_batches = 0
        self.published_events = 0
        self.restarts = 0
        self.rejected: dict[str, int] = {}
        self.last_rejection: str | None = None

    # ------------------------------------------------------------------------ from_url

    _URL_KEYS: Final = (
        "replay",
        "dp_size",
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
        """``vllm://HOST:PORT?replay=RPORT&dp_size=N&topic=T&buffer_steps=N&hwm=N&...``.

        ``HOST`` is the interface to bind (``*`` or ``0.0.0.0``: all, ``[::1]``: IPv6),
        ``PORT`` rank 0's PUB port. Keys: ``replay`` (rank 0's replay ROUTER port; none
        without it), ``dp_size`` (ranks, default 1), ``topic`` (default empty; llm-d expects
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
        return cls(
            host,
            port,
            replay_port=url.get_int("replay"),
            dp_size=_int(url, "dp_size", 1),
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
            log.info(
                "vllm sink publishing on %s (replay %s), %d rank(s)",
                self.endpoint(0),
                self.replay_endpoint(0),
                self.dp_size,
            )

    async def export(self, batches: Sequence[EventBatch]) -> ExportResult:
        """Publish ``batches`` in order (see the module docstring for rejected batches).

        Each batch is encoded and sent synchronously; the loop is yielded between groups of
        batches, and an export cancelled there and retried with the same batches resumes
        after the last one sent (nothing is published twice).
        """
        if self._closed:
            return ExportResult.permanent("the vllm sink is shut down")
        if not self._started:
            try:
                await self.start()
            except SinkError as exc:
                return ExportResult.from_exception(exc)
        progress = self._progress
        first, accepted = 0, 0
        if progress is not None and progress.same(batches):
            first, accepted = progress.done, progress.accepted
        self._progress = None
        rejected: list[str] = []
        for i in range(first, len(batches)):
            if i > first and (i - first) % _YIELD_EVERY == 0:
                self._progress = _Progress(batches, i, accepted)
                await asyncio.sleep(0)
                self._progress = None
                if self.is_shut_down:
                    return ExportResult.permanent("the vllm sink was shut down mid-export")
            try:
                reason = self._publish(batches[i])
            except ConnectionError as exc:
                return ExportResult.permanent(f"the vllm sink cannot publish: {exc}", exc)
            if reason is None:
                accepted += 1
            else:
                rejected.append(reason)
        if rejected and not accepted:
            reason = f"{len(rejected)} batch(es) rejected: {rejected[0]}"
            return ExportResult.permanent(reason, PermanentSinkError(reason))
        return ExportResult.success()

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

    def _publish(self, batch: EventBatch) -> str | None:
        """Publish one batch; the rejection reason when it cannot be published here."""
        source = batch.source
        rank = source.attention_dp_rank or 0
        if rank >= self.dp_size:
            return self._reject(
                RANK_OUT_OF_RANGE,
                f"rank {rank} of {source.instance_id!r} is outside dp_size={self.dp_size}",
            )
        if self._instance is None:
            self._instance = source.instance_id
        elif source.instance_id != self._instance:
            return self._reject(
                OTHER_INSTANCE,
                f"instance {source.instance_id!r}: this endpoint publishes {self._instance!r} "
                "(run one vllm sink per engine instance)",
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

    def _reject(self, kind: str, reason: str) -> str:
        first = kind not in self.rejected
        self.rejected[kind] = self.rejected.get(kind, 0) + 1
        self.last_rejection = reason
        (log.warning if first else log.debug)("vllm sink %s: batch rejected: %s", self.name, reason)
        return reason

    def __repr__(self) -> str:
        return f"<VllmSink {self.name!r} {self.endpoint(0)} x{self.dp_size}>"


def _int(url: SinkURL, key: str, default: int) -> int:
    value = url.get_int(key, default)
    return default if value is None else value

"""The Kafka sink: one Kafka message per event batch, through aiokafka's batch API.

* **Key = source** (``instance_id/rank``), partition = murmur2(key) over all partitions (the
  Java client's default), so each source's batches stay ordered in one partition.
* ``acks="all"``; ``enable_idempotence`` stays off (tansu and some managed brokers have no
  InitProducerId). Duplicates after retries are possible: consumers dedupe by
  (source, rank, incarnation, event_id).
* Messages go out with ``producer.create_batch()`` / ``send_batch()``, one partition's
  builders in order, each awaited before the next, so a failed builder is resent before
  anything after it (order survives retries). A retried export of the same chunk resumes
  where the last attempt stopped instead of enqueueing everything again.
* Value: Avro single-object encoding (``C3 01`` + fingerprint + body); with
  ``schema_registry_id`` the Confluent wire format (``00`` + id + body) instead.
* Headers: ``kvstream-schema-version``, ``kvstream-schema-fingerprint`` (16 hex digits),
  ``kvstream-hash-algo`` (comma-joined when a batch mixes algorithms), ``kvstream-encoding``.
* TLS/SASL settings (:class:`kvstream.kafka_security.KafkaSecurity`, shared with the Kafka
  index source: URL, ``KVSTREAM_KAFKA_*`` environment or a config file) apply to the
  producer and to the sink's admin and read-back clients; ``create_topic`` creates the topic with
  ``partitions`` partitions through aiokafka's admin client (an existing topic is fine).
* aiokafka errors map to retriable/permanent results (:func:`classify_kafka_error`).
* Deadlines: ``shutdown(timeout_s)`` returns within its budget whatever the broker does, and
  is safe to cancel. When time runs out the producer is *abandoned* synchronously (its
  connections closed, its queued and in-flight batches failed, its sender task cancelled),
  never awaited: aiokafka would wait out ``request_timeout_ms`` per request.
* Exact loss accounting (:meth:`KafkaSink.abandon`, :meth:`KafkaSink.resolve`): when the
  pipeline gives a chunk up, the producer holding its unacknowledged sends is abandoned, so
  aiokafka cannot deliver them later; the messages that were handed to aiokafka but never
  acknowledged are *in doubt* (a broker may have appended them and lost the answer) and are
  read back from their partitions, from the last acknowledged offset on, before the pipeline
  declares them lost.

URL form: ``kafka://host:9092[,host2:9092]/topic?partitions=8&security_protocol=SASL_SSL&...``
(see :meth:`KafkaSink.from_url`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiokafka.errors as kerr
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.conn import CloseReason
from aiokafka.partitioner import murmur2

from kvstream.codec import AvroCodec
from kvstream.errors import (
    ConfigError,
    EncodeError,
    PermanentSinkError,
    RetriableSinkError,
    SinkError,
)
from kvstream.events.columns import ColumnBatch
from kvstream.events.deferred import DeferredBatch
from kvstream.events.model import EventBatch, SourceId
from kvstream.kafka_security import OPTIONS as SECURITY_OPTIONS
from kvstream.kafka_security import KafkaSecurity, describe_error
from kvstream.sink import Abandoned, ExportResult, Sink, SinkURL

__all__ = [
    "HEADER_ENCODING",
    "HEADER_HASH_ALGO",
    "HEADER_SCHEMA_FINGERPRINT",
    "HEADER_SCHEMA_VERSION",
    "KafkaSink",
    "classify_kafka_error",
    "describe_error",
    "partition_for",
    "source_key",
]

HEADER_SCHEMA_VERSION: Final = "kvstream-schema-version"
HEADER_SCHEMA_FINGERPRINT: Final = "kvstream-schema-fingerprint"
HEADER_HASH_ALGO: Final = "kvstream-hash-algo"
#: ``avro-single-object`` or ``confluent``.
HEADER_ENCODING: Final = "kvstream-encoding"

_FORCED: Final = ("acks", "enable_idempotence", "transactional_id", "bootstrap_servers")


def source_key(source: SourceId) -> bytes:
    """The message key of a source: ``instance_id/rank`` (``-`` without a rank), UTF-8."""
    rank = "-" if source.attention_dp_rank is None else str(source.attention_dp_rank)
    return f"{source.instance_id}/{rank}".encode()


def partition_for(key: bytes, num_partitions: int) -> int:
    """The partition of ``key`` among ``num_partitions`` (the Java client's murmur2 rule)."""
    return int(murmur2(key) & 0x7FFFFFFF) % num_partitions


# --------------------------------------------------------------------------------- errors

_PERMANENT_ERRORS: Final = (
    kerr.MessageSizeTooLargeError,
    kerr.RecordTooLargeError,
    kerr.RecordListTooLargeError,
    kerr.InvalidTopicError,
    kerr.TopicAuthorizationFailedError,
    kerr.ClusterAuthorizationFailedError,
    kerr.SaslAuthenticationFailed,
    kerr.AuthenticationFailedError,
    kerr.AuthenticationMethodNotSupported,
    kerr.UnsupportedSaslMechanismError,
    kerr.UnsupportedVersionError,
    kerr.UnsupportedForMessageFormatError,
    kerr.InvalidRequiredAcksError,
    kerr.KafkaConfigurationError,
    kerr.UnsupportedCodecError,
    kerr.ProducerClosed,
    kerr.PolicyViolationError,
)


def classify_kafka_error(exc: BaseException) -> ExportResult:
    """Map an aiokafka (or socket) error to a retriable or permanent result.

    Permanent: record/request too large, invalid topic, authorisation/authentication,
    unsupported versions or codecs, bad configuration, a closed producer, and any other broker
    error aiokafka does not flag retriable. Retriable: errors aiokafka flags ``retriable``,
    client-side timeouts and connection failures (broker down), and OS-level socket errors.
    """
    reason = describe_error(exc)
    if isinstance(exc, SinkError | EncodeError):
        return ExportResult.from_exception(exc)
    if isinstance(exc, _PERMANENT_ERRORS):
        return ExportResult.permanent(reason, exc)
    if isinstance(exc, kerr.KafkaError):
        if getattr(exc, "retriable", False) or not isinstance(exc, kerr.BrokerResponseError):
            return ExportResult.retry(reason, exc)
        return ExportResult.permanent(reason, exc)
    if isinstance(exc, OSError | asyncio.TimeoutError):
        return ExportResult.retry(reason, exc)
    return ExportResult.permanent(reason, exc)


def _raise_classified(exc: BaseException, what: str) -> None:
    result = classify_kafka_error(exc)
    cls = RetriableSinkError if result.retriable else PermanentSinkError
    raise cls(f"{what}: {result.reason}") from exc


def _retrieve(fut: asyncio.Future[Any]) -> None:
    # a send future nobody awaits any more (superseded chunk): mark its exception retrieved
    if not fut.cancelled():
        fut.exception()


# --------------------------------------------------------------------------- the sink

_Msg = tuple[bytes, bytes, list[tuple[str, bytes]], int]
#: Steps with fewer batches are encoded on the event loop (a thread hop costs more).
_INLINE_ENCODE: Final = 32
#: An export is encoded in steps of this many batches, in a worker thread; what the steps
#: before it made is sent (and acknowledged) meanwhile.
_ENCODE_STEP: Final = 64


@dataclass(slots=True)
class _PartitionSend:
    partition: int
    msgs: list[_Msg] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)  # per message: its batch's index
    done: int = 0  # messages acknowledged
    inflight: asyncio.Future[Any] | None = None
    inflight_end: int = 0
    scan_from: int | None = None  # the partition's next offset when msgs[done] was first sent
    unacked: list[tuple[Any, int]] = field(default_factory=list)  # (builder, end) sent, no ack


@dataclass(slots=True)
class _Doubt:
    """Messages handed to an abandoned producer and never acknowledged: they may be in the
    partition (at or after ``scan_from``; None: from the start) or not."""

    partition: int
    scan_from: int | None  # read back from here (progress is kept between attempts)
    msgs: dict[tuple[bytes, bytes], int]  # (key, value) -> the batch's index
    batches: list[EventBatch]
    seen: set[tuple[bytes, bytes]] = field(default_factory=set)  # found so far


@dataclass(slots=True)
class _Chunk:
    batches: Sequence[EventBatch]
    partitions: list[int]  # the topic's, when the chunk was first exported
    parts: list[_PartitionSend] = field(default_factory=list)
    by_partition: dict[int, _PartitionSend] = field(default_factory=dict)
    encoded: int = 0  # batches[:encoded] have their messages in parts

    def same(self, batches: Sequence[EventBatch]) -> bool:
        mine = self.batches
        return len(mine) == len(batches) and all(
            a is b for a, b in zip(mine, batches, strict=False)
        )


class KafkaSink(Sink):
    """Publish event batches to ``topic``; see the module docstring for the guarantees.

    ``producer_options`` are passed to :class:`aiokafka.AIOKafkaProducer` (e.g.
    ``compression_type``, ``max_request_size``); ``acks``, ``enable_idempotence``,
    ``transactional_id`` and ``bootstrap_servers`` are fixed by the sink.
    """

    scheme = "kafka"
    #: ColumnBatch (an engine bridge's) is encoded from its columns, no models built
    accepts_columns = True
    #: a DeferredBatch (an emitter's) is turned into columns by the sink itself, in the
    #: thread that encodes it, while what was encoded before is sent
    accepts_deferred = True

    def __init__(
        self,
        bootstrap_servers: str | Sequence[str],
        topic: str,
        *,
        codec: AvroCodec | None = None,
        schema_registry_id: int | None = None,
        create_topic: bool = False,
        partitions: int = 1,
        replication_factor: int = 1,
        linger_ms: int = 0,
        max_batch_bytes: int = 1024 * 1024,
        request_timeout_ms: int = 30_000,
        client_id: str = "kvstream",
        security: KafkaSecurity | None = None,
        producer_options: Mapping[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        if not topic:
            raise ConfigError("a Kafka sink needs a topic")
        if partitions < 1 or replication_factor < 1:
            raise ConfigError("partitions and replication_factor must be >= 1")
        forced = sorted(set(producer_options or {}) & set(_FORCED))
        if forced:
            raise ConfigError(f"the Kafka sink sets {', '.join(forced)} itself")
        servers = (
            bootstrap_servers if isinstance(bootstrap_servers, str) else ",".join(bootstrap_servers)
        )
        if not servers:
            raise ConfigError("a Kafka sink needs bootstrap servers (host:port)")
        self.bootstrap_servers = servers
        self.topic = topic
        self.codec = codec or AvroCodec()
        self.schema_registry_id = schema_registry_id
        self.create_topic = create_topic
        self.partitions = partitions
        self.replication_factor = replication_factor
        #: TLS/SASL settings (PLAINTEXT by default); their secrets never print.
        self.security = security or KafkaSecurity()
        self._security: dict[str, Any] = self.security.client_kwargs()
        self._producer_options: dict[str, Any] = {
            "client_id": client_id,
            "linger_ms": linger_ms,
            "max_batch_size": max_batch_bytes,
            "max_request_size": max(max_batch_bytes, 1024 * 1024),
            "request_timeout_ms": request_timeout_ms,
            **self._security,
            **dict(producer_options or {}),
        }
        schema = self.codec.schema
        self._encoding = b"confluent" if schema_registry_id is not None else b"avro-single-object"
        self._base_headers: list[tuple[str, bytes]] = [
            (HEADER_SCHEMA_VERSION, str(schema.version).encode()),
            (HEADER_SCHEMA_FINGERPRINT, schema.fingerprint_hex.encode()),
            (HEADER_ENCODING, self._encoding),
        ]
        self._producer: AIOKafkaProducer | None = None
        self._start_lock = asyncio.Lock()
        self._closed = False
        self._pending: _Chunk | None = None
        self._routes: dict[tuple[str, int | None], tuple[bytes, int]] = {}
        self._routes_for = 0
        self._next_offset: dict[int, int] = {}  # per partition: after the last acked message
        self._doubts: list[_Doubt] = []
        self._written: set[int] = set()  # ids of record buffers written to a connection
        #: Wait this long after the broker answers again before reading sends in doubt back:
        #: a request a frozen broker (or a stalled network) still holds lands when it thaws.
        self.resolve_grace_s = 0.5

    # ------------------------------------------------------------------------ from_url

    _URL_KEYS: Final = (
        "partitions",
        "create_topic",
        "replication_factor",
        "schema_registry_id",
        "schema_version",
        "linger_ms",
        "max_batch_bytes",
        "request_timeout_ms",
        "compression",
        "client_id",
        "name",
        *SECURITY_OPTIONS,
    )

    @classmethod
    def from_url(cls, url: SinkURL) -> KafkaSink:
        """``kafka://host:port[,host:port]/topic?key=value&...``.

        Keys: ``partitions`` (creates the topic with that many unless ``create_topic=false``),
        ``create_topic``, ``replication_factor``, ``schema_registry_id`` (Confluent framing),
        ``schema_version``, ``linger_ms``, ``max_batch_bytes``, ``request_timeout_ms``,
        ``compression`` (gzip/snappy/lz4/zstd), ``client_id``, ``name``, and the TLS/SASL
        options of :mod:`kvstream.kafka_security` (``security_protocol``, ``ssl_cafile``,
        ``sasl_mechanism``, ``sasl_username``, ``sasl_password_file``...), which also come
        from ``KVSTREAM_KAFKA_*`` variables or a ``kafka_config`` file.
        """
        url.check_keys(cls._URL_KEYS)
        topic = url.path.strip("/")
        if not url.hosts or not topic or "/" in topic:
            raise ConfigError(f"expected kafka://HOST:PORT/TOPIC, got {url.raw!r}")
        security = KafkaSecurity.from_options(url.params, where=url.raw)
        version = url.get_int("schema_version")
        options: dict[str, Any] = {}
        if url.get("compression"):
            options["compression_type"] = url.get("compression")
        partitions = url.get_int("partitions")
        return cls(
            url.hosts,
            topic,
            codec=AvroCodec(version) if version is not None else None,
            schema_registry_id=url.get_int("schema_registry_id"),
            create_topic=url.get_bool("create_topic", partitions is not None),
            partitions=partitions or 1,
            replication_factor=url.get_int("replication_factor", 1) or 1,
            linger_ms=url.get_int("linger_ms", 0) or 0,
            max_batch_bytes=url.get_int("max_batch_bytes", 1024 * 1024) or 1024 * 1024,
            request_timeout_ms=url.get_int("request_timeout_ms", 30_000) or 30_000,
            client_id=url.get("client_id") or "kvstream",
            security=security,
            producer_options=options,
            name=url.get("name"),
        )

    # ------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Create the topic (if asked) and start the producer.

        Raises :class:`RetriableSinkError` while the brokers cannot be reached and
        :class:`PermanentSinkError` for configuration/authorisation problems.
        """
        async with self._start_lock:
            if self._closed:
                raise PermanentSinkError("the Kafka sink is shut down")
            if self._producer is not None:
                return
            if self.create_topic:
                await self._create_topic()
            producer = AIOKafkaProducer(
                bootstrap_servers=self.bootstrap_servers,
                acks="all",
                enable_idempotence=False,
                **self._producer_options,
            )
            try:
                await producer.start()
            except BaseException as exc:
                _abandon(producer, kerr.KafkaConnectionError("the producer did not start"))
                if isinstance(exc, KeyError) and self.security.uses_sasl:
                    raise PermanentSinkError(
                        f"cannot connect to {self.bootstrap_servers}: {self.security.explain(exc)}"
                    ) from exc
                if isinstance(exc, Exception):
                    _raise_classified(exc, f"cannot connect to {self.bootstrap_servers}")
                raise
            if self.is_shut_down:  # shut down while starting
                _abandon(producer, kerr.ProducerClosed())
                raise PermanentSinkError("the Kafka sink is shut down")
            _track_writes(producer, self._written)
            self._producer = producer

    @property
    def is_shut_down(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._closed

    async def _create_topic(self) -> None:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self.bootstrap_servers,
            client_id=f"{self._producer_options['client_id']}-admin",
            request_timeout_ms=self._producer_options["request_timeout_ms"],
            **self._security,
        )
        try:
            await admin.start()
            topic = NewTopic(self.topic, self.partitions, self.replication_factor)
            response = await admin.create_topics([topic])
        except Exception as exc:
            _raise_classified(exc, f"cannot create topic {self.topic!r}")
        finally:
            await admin.close()
        for item in response.topic_errors:
            code, message = item[1], item[2] if len(item) > 2 else None
            error = kerr.for_code(code)
            if code and error is not kerr.TopicAlreadyExistsError:
                _raise_classified(error(message), f"cannot create topic {self.topic!r}")

    async def force_flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything handed to the producer is acknowledged."""
        producer = self._producer
        return True if producer is None else await _flush(producer, timeout_s)

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Flush and stop the producer within ``timeout_s``; never raises.

        When the budget runs out (or the call is cancelled) the producer is abandoned at
        once: its connections are closed and whatever it still holds fails, so nothing it
        held is sent afterwards. A start still in progress is not waited for (it finds the
        sink shut down and abandons its own producer).
        """
        self._closed = True
        producer, self._producer = self._producer, None
        self._pending = None
        if producer is None:
            return
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        try:
            if await _flush(producer, None if deadline is None else deadline - loop.time()):
                remaining = None if deadline is None else max(deadline - loop.time(), 0.0)
                await asyncio.wait_for(producer.stop(), remaining)
                return
        except asyncio.CancelledError:
            _abandon(producer, kerr.KafkaTimeoutError("the kvstream sink shut down"))
            raise
        except (asyncio.TimeoutError, Exception):
            pass  # a stop that failed or overran: abandon below
        _abandon(producer, kerr.KafkaTimeoutError("the kvstream sink shut down before delivery"))

    # ------------------------------------------------------------------- loss accounting

    def abandon(self) -> Abandoned:
        """The pipeline gives up the batches of the last export (failed or cancelled).

        If aiokafka still holds any of their messages, the producer is abandoned (its
        connections closed, its batches failed; the next export starts a new one), so none
        of them can be delivered later. Returns the batches the broker acknowledged, and
        those with a message handed to aiokafka and never acknowledged: they may have
        reached the partition (pass them to :meth:`resolve`). Never raises.
        """
        chunk, self._pending = self._pending, None
        if chunk is None:
            return Abandoned()
        batches = list(chunk.batches)
        acked = sorted({o for p in chunk.parts for o in p.owners[: p.done]})
        held = [p for p in chunk.parts if p.unacked]
        if not held:
            return Abandoned(delivered=[batches[i] for i in acked])
        producer, self._producer = self._producer, None
        if producer is not None:
            _abandon(producer, kerr.KafkaTimeoutError("the kvstream pipeline gave this send up"))
        doubtful: set[int] = set()
        for part in held:
            # a builder never written to a connection cannot have arrived
            written_end = part.done
            for builder, end in part.unacked:
                buffer = getattr(builder, "_buffer", None)
                if buffer is not None and (
                    id(buffer) in self._written or _ANY_WRITE in self._written
                ):
                    self._written.discard(id(buffer))
                    written_end = max(written_end, end)
            part.unacked.clear()
            if written_end == part.done:
                continue
            msgs = {}
            for i in range(part.done, written_end):
                key, value, _, _ = part.msgs[i]
                msgs[(key, value)] = part.owners[i]
            doubtful.update(msgs.values())
            self._doubts.append(_Doubt(part.partition, part.scan_from, msgs, batches))
        return Abandoned(
            delivered=[batches[i] for i in acked if i not in doubtful],
            in_doubt=[batches[i] for i in sorted(doubtful)],
        )

    async def resolve(self, batches: Sequence[EventBatch]) -> list[bool]:
        """For batches :meth:`abandon` returned: which did reach their partition (every one
        of its messages was found). Reads each partition in doubt back from its last
        acknowledged offset (the start when none was acknowledged yet) to the high-water
        mark, after the broker has answered again for ``resolve_grace_s``.

        Raises :class:`RetriableSinkError` while the brokers cannot be reached (ask again
        later) and :class:`PermanentSinkError` when the topic cannot be read (e.g. a
        producer-only credential): the batches then stay in doubt.
        """
        wanted = {id(b) for b in batches}
        doubts = [d for d in self._doubts if any(id(b) in wanted for b in d.batches)]
        if not doubts:
            return [False] * len(batches)
        consumer = self._consumer()
        try:
            await consumer.start()
            await asyncio.sleep(self.resolve_grace_s)
            found: set[tuple[int, int]] = set()  # (doubt index, batch index) seen
            missing: set[tuple[int, int]] = set()
            for n, doubt in enumerate(doubts):
                seen = await self._scan(consumer, doubt)
                for keyval, owner in doubt.msgs.items():
                    (found if keyval in seen else missing).add((n, owner))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not classify_kafka_error(exc).retriable:  # never resolvable: forget them
                self._doubts = [d for d in self._doubts if d not in doubts]
            if isinstance(exc, SinkError):
                raise
            _raise_classified(exc, f"cannot read {self.topic} back")
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(consumer.stop(), 5.0)
        arrived: set[int] = set()
        for n, doubt in enumerate(doubts):
            for owner in {o for d, o in found if d == n} - {o for d, o in missing if d == n}:
                arrived.add(id(doubt.batches[owner]))
        self._doubts = [d for d in self._doubts if d not in doubts]
        return [id(b) in arrived for b in batches]

    async def _scan(self, consumer: AIOKafkaConsumer, doubt: _Doubt) -> set[tuple[bytes, bytes]]:
        """Read ``doubt``'s partition from ``scan_from`` to the high-water mark, collecting the
        messages in doubt found; progress survives a failed attempt."""
        tp = TopicPartition(self.topic, doubt.partition)
        consumer.assign([tp])
        if doubt.scan_from is None:
            await consumer.seek_to_beginning(tp)
        else:
            consumer.seek(tp, doubt.scan_from)
        seen = doubt.seen
        loop = asyncio.get_running_loop()
        stuck_s = self._producer_options["request_timeout_ms"] / 1000
        last, moved = -1, loop.time()
        while True:
            got = await consumer.getmany(tp, timeout_ms=200)
            for record in got.get(tp, ()):
                keyval = (record.key, record.value)
                if keyval in doubt.msgs:
                    seen.add(keyval)
            high = consumer.highwater(tp)
            position = await consumer.position(tp)
            doubt.scan_from = position
            if high is not None and position >= high:
                return seen
            now = loop.time()
            if position != last:
                last, moved = position, now
            elif high is None:
                if now - moved > stuck_s:
                    raise RetriableSinkError(f"cannot read partition {doubt.partition} back")
            elif now - moved > 1.5:
                # an offset the broker cannot serve (tansu's S3 storage leaves holes after a
                # crash mid-produce): what no consumer can read did not arrive
                consumer.seek(tp, position + 1)
                moved = now

    # ------------------------------------------------------------------------ read back

    async def end_offsets(self) -> dict[int, int]:
        """The topic's current end offset per partition (mark where a run starts)."""
        consumer = self._consumer()
        await consumer.start()
        try:
            tps = await self._partitions(consumer)
            ends = await consumer.end_offsets(tps) if tps else {}
            return {tp.partition: off for tp, off in ends.items()}
        finally:
            await consumer.stop()

    async def position(self) -> dict[int, int]:
        """The end offsets now (see :meth:`read_back`)."""
        return await self.end_offsets()

    async def read_back(self, since: object = None, *, timeout_s: float = 30.0) -> list[EventBatch]:
        """Decode the topic's messages from ``since`` (partition -> offset, a
        :meth:`position`; default: the start) up to the end offsets at call time, partition by
        partition (so per source in order). An independent consumer (``assign()``, no group,
        no commits)."""
        consumer = self._consumer()
        await consumer.start()
        out: list[EventBatch] = []
        try:
            tps = await self._partitions(consumer)
            if not tps:
                return out
            ends = await consumer.end_offsets(tps)
            consumer.assign(tps)
            start: Mapping[int, int] = since if isinstance(since, Mapping) else {}
            for tp in tps:
                consumer.seek(tp, start.get(tp.partition, 0))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            by_tp: dict[Any, list[EventBatch]] = {tp: [] for tp in tps}
            while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
                if loop.time() > deadline:
                    raise RetriableSinkError(f"reading {self.topic} back timed out")
                got = await consumer.getmany(timeout_ms=200)
                for tp, records in got.items():
                    by_tp[tp].extend(self._decode(r.value) for r in records)
            for tp in tps:
                out.extend(by_tp[tp])
            return out
        finally:
            await consumer.stop()

    def _decode(self, value: bytes) -> EventBatch:
        if self.schema_registry_id is not None:
            return self.codec.decode_confluent(
                value, {self.schema_registry_id: self.codec.schema_version}
            )
        return self.codec.decode(value)

    def _consumer(self) -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            client_id=f"{self._producer_options['client_id']}-reader",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            request_timeout_ms=self._producer_options["request_timeout_ms"],
            **self._security,
        )

    async def _partitions(self, consumer: AIOKafkaConsumer) -> list[TopicPartition]:
        parts = consumer.partitions_for_topic(self.topic)
        if parts is None:
            await consumer.topics()  # refresh metadata
            parts = consumer.partitions_for_topic(self.topic) or set()
        return [TopicPartition(self.topic, p) for p in sorted(parts)]

    # --------------------------------------------------------------------------- export

    async def export(self, batches: Sequence[EventBatch]) -> ExportResult:
        """Publish ``batches`` and wait for the brokers' acks (``acks=all``)."""
        if self._closed:
            return ExportResult.permanent("the Kafka sink is shut down")
        try:
            if self._producer is None:
                await self.start()
            producer = self._producer
            assert producer is not None
            chunk = self._pending
            if chunk is None or not chunk.same(batches):
                partitions = sorted(await producer.partitions_for(self.topic))
                chunk = self._pending = _Chunk(batches, partitions)
            results = await self._publish(producer, chunk)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return classify_kafka_error(exc)
        failures = [classify_kafka_error(r) for r in results if isinstance(r, BaseException)]
        if not failures:
            self._pending = None
            return ExportResult.success()
        permanent = [f for f in failures if not f.retriable]
        if permanent:
            self._pending = None
            return permanent[0]
        return failures[0]

    async def _publish(self, producer: AIOKafkaProducer, chunk: _Chunk) -> list[BaseException]:
        """Encode what of ``chunk`` is not yet, step by step, each step's messages handed to
        the partitions' senders as soon as it is encoded (the next step is encoded while
        they are sent); then wait for every sender. Returns the senders' failures. A retry
        of the same chunk resumes where this one stopped (encoding and sending)."""
        senders: dict[int, asyncio.Task[None]] = {}
        done: list[asyncio.Task[None]] = []

        def send_more() -> bool:
            # a sender for every partition with messages left; False once one has failed
            for part in chunk.parts:
                task = senders.get(part.partition)
                if task is not None and task.done():
                    done.append(task)
                    del senders[part.partition]
                    if task.cancelled() or task.exception() is not None:
                        return False
                if part.partition not in senders and part.done < len(part.msgs):
                    senders[part.partition] = asyncio.create_task(
                        self._send_partition(producer, part)
                    )
            return True

        try:
            n = len(chunk.batches)
            while send_more() and chunk.encoded < n:
                start = chunk.encoded
                step = chunk.batches[start : start + _ENCODE_STEP]
                if len(step) < _INLINE_ENCODE:
                    out = self._encode(step, start, chunk.partitions)
                else:  # in a worker thread: the loop sends what is encoded meanwhile
                    out = await asyncio.to_thread(self._encode, step, start, chunk.partitions)
                for part in out:
                    mine = chunk.by_partition.get(part.partition)
                    if mine is None:
                        chunk.by_partition[part.partition] = part
                        chunk.parts.append(part)
                    else:
                        mine.msgs += part.msgs
                        mine.owners += part.owners
                chunk.encoded = start + len(step)
        except BaseException:
            for task in senders.values():
                task.cancel()
            await asyncio.gather(*senders.values(), return_exceptions=True)
            raise
        results = await asyncio.gather(*done, *senders.values(), return_exceptions=True)
        return [r for r in results if isinstance(r, BaseException)]

    def _encode(
        self, batches: Sequence[EventBatch], first: int, partitions: list[int]
    ) -> list[_PartitionSend]:
        """The messages of ``batches`` (the chunk's from index ``first`` on) by partition; a
        deferred batch is turned into its columns here (off the loop, in the worker thread
        of a big step)."""
        n = len(partitions)
        if n != self._routes_for:
            self._routes.clear()
            self._routes_for = n
        routes = self._routes
        by_partition: dict[int, _PartitionSend] = {}
        codec, schema_id = self.codec, self.schema_registry_id
        base = self._base_headers
        given: Sequence[Any] = batches  # with accepts_deferred: DeferredBatch objects too
        for index, item in enumerate(given, first):
            # a deferred batch's columns, no model built (accepts_deferred)
            b: EventBatch | ColumnBatch = (
                item.columns() if type(item) is DeferredBatch else item
            )  # fmt: skip
            src = b.source
            route = routes.get(src.key)
            if route is None:
                key = source_key(src)
                route = routes[src.key] = (key, partitions[partition_for(key, n)])
            key, partition = route
            value = codec.encode(b) if schema_id is None else codec.encode_confluent(b, schema_id)
            headers = base
            # a ColumnBatch when the pipeline hands columns over (accepts_columns)
            names: list[str] = (
                b.hash_algos if isinstance(b, ColumnBatch) else [ev.hash_algo for ev in b.events]
            )
            if names:
                algos = set(names)
                algo = next(iter(algos)) if len(algos) == 1 else ",".join(sorted(algos))
                headers = [*base, (HEADER_HASH_ALGO, algo.encode())]
            part = by_partition.get(partition)
            if part is None:
                part = by_partition[partition] = _PartitionSend(partition)
            part.msgs.append((key, value, headers, b.ts_ns // 1_000_000))
            part.owners.append(index)
        return list(by_partition.values())

    async def _send_partition(self, producer: AIOKafkaProducer, part: _PartitionSend) -> None:
        msgs = part.msgs
        while part.done < len(msgs):
            if part.inflight is None:
                builder = producer.create_batch()
                end = part.done
                while end < len(msgs):
                    key, value, headers, ts = msgs[end]
                    if builder.append(key=key, value=value, timestamp=ts, headers=headers) is None:
                        break
                    end += 1
                if not part.unacked:  # the first send of msgs[done]
                    part.scan_from = self._next_offset.get(part.partition)
                fut = await producer.send_batch(builder, self.topic, partition=part.partition)
                fut.add_done_callback(_retrieve)
                part.inflight, part.inflight_end = fut, end
                part.unacked.append((builder, end))
            fut = part.inflight
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                if fut.cancelled():  # the producer gave the batch up, not our caller
                    part.inflight = None
                    raise RetriableSinkError("the producer cancelled a send") from None
                raise
            except BaseException:
                part.inflight = None
                raise
            meta = fut.result()
            if meta is not None:
                nxt = meta.offset + part.inflight_end - part.done
                self._next_offset[part.partition] = max(
                    self._next_offset.get(part.partition, 0), nxt
                )
            for sent, _ in part.unacked:
                self._written.discard(id(getattr(sent, "_buffer", None)))
            part.unacked.clear()
            part.done, part.inflight = part.inflight_end, None


async def _flush(producer: AIOKafkaProducer, timeout_s: float | None) -> bool:
    try:
        await asyncio.wait_for(asyncio.shield(producer.flush()), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


def _track_writes(producer: AIOKafkaProducer, written: set[int]) -> None:
    """Record which record buffers a produce request was written to a connection with.

    A batch aiokafka holds but never wrote (the broker unreachable all along) cannot have
    arrived; only written ones are in doubt. The check is conservative: the buffers count as
    written once the connection is ready, right before aiokafka writes the request (no await
    in between on a ready connection). Where aiokafka's internals differ (not 0.10-0.14),
    every produce request counts as written: more doubt, never less.
    """
    client = getattr(producer, "client", None)
    send = getattr(client, "send", None)
    if client is None or send is None:
        return

    async def tracked_send(node_id: Any, request: Any, **kw: Any) -> Any:
        topics = getattr(request, "_topics", None)
        if getattr(request, "API_KEY", None) == 0 and topics is not None:  # ProduceRequest
            if await client.ready(node_id, **kw):
                for _topic, parts in topics:
                    for _partition, buffer in parts:
                        written.add(id(buffer))
        elif getattr(request, "API_KEY", None) == 0:
            written.add(_ANY_WRITE)
        return await send(node_id, request, **kw)

    client.send = tracked_send


_ANY_WRITE: Final = -1  # a produce request whose buffers could not be told apart


class _NoConnections(dict[Any, Any]):
    """An abandoned client's connection table: a connection that was still being opened is
    closed at once, so no request (a produce retry in particular) goes out on it."""

    def __setitem__(self, key: Any, conn: Any) -> None:
        conn.close(reason=CloseReason.SHUTDOWN)
        raise kerr.KafkaConnectionError("the kvstream sink abandoned this producer")


def _abandon(producer: AIOKafkaProducer, exc: Exception) -> None:
    """Give ``producer`` up now, synchronously and for good.

    ``producer.stop()`` waits for every queued batch and its request timeouts; at a deadline
    that is not an option, and a given-up send must not be retried later. This (written
    against aiokafka 0.10-0.14 internals, each step guarded) stops new sends (closed
    accumulator, nothing drained), turns a retry's re-enqueue into a failure (the KeyError
    of failing batches first and letting ``reenqueue`` remove them again cannot happen),
    closes every connection (requests in flight fail now; a connection being opened is
    closed on arrival), cancels the metadata and sender tasks and fails every batch left.
    """
    with contextlib.suppress(Exception):
        producer._closed = True  # stop() is a no-op now, and no "unclosed" warning
    acc = getattr(producer, "_message_accumulator", None)
    client = getattr(producer, "client", None)
    if acc is not None:
        with contextlib.suppress(Exception):
            acc._closed = True

            def no_resend(batch: Any) -> None:
                if not batch.future.done():
                    batch.failure(exception=exc)

            acc.reenqueue = no_resend
            acc.drain_by_nodes = lambda *a, **kw: ({}, False)
    if client is not None:
        with contextlib.suppress(Exception):
            conns, client._conns = client._conns, _NoConnections()
            for conn in list(conns.values()):
                conn.close(reason=CloseReason.SHUTDOWN)
        with contextlib.suppress(Exception):
            if client._sync_task is not None:
                client._sync_task.cancel()
                client._sync_task = None
            md = client._md_update_fut
            if md is not None and not md.done():
                md.set_result(False)  # a produce retry waiting for metadata goes on (to fail)
    sender = getattr(producer, "_sender", None)
    task = getattr(sender, "sender_task", None)
    if task is not None and not task.done():
        task.cancel()
    if acc is not None:
        with contextlib.suppress(Exception):
            acc.fail_all(exc)

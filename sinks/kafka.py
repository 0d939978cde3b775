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
* TLS/SASL options are passed through to aiokafka; ``create_topic`` creates the topic with
  ``partitions`` partitions through aiokafka's admin client (an existing topic is fine).
* aiokafka errors map to retriable/permanent results (:func:`classify_kafka_error`).

URL form: ``kafka://host:9092[,host2:9092]/topic?partitions=8&security_protocol=SASL_SSL&...``
(see :meth:`KafkaSink.from_url`).
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiokafka.errors as kerr
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.helpers import create_ssl_context
from aiokafka.partitioner import murmur2

from kvstream.codec import AvroCodec
from kvstream.errors import (
    ConfigError,
    EncodeError,
    PermanentSinkError,
    RetriableSinkError,
    SinkError,
)
from kvstream.events.model import EventBatch, SourceId
from kvstream.sink import ExportResult, Sink, SinkURL

__all__ = [
    "HEADER_ENCODING",
    "HEADER_HASH_ALGO",
    "HEADER_SCHEMA_FINGERPRINT",
    "HEADER_SCHEMA_VERSION",
    "KafkaSink",
    "classify_kafka_error",
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
    reason = f"{type(exc).__name__}: {exc}"
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
#: Chunks with fewer batches are encoded on the event loop (a thread hop costs more).
_INLINE_ENCODE: Final = 32


@dataclass(slots=True)
class _PartitionSend:
    partition: int
    msgs: list[_Msg] = field(default_factory=list)
    done: int = 0  # messages acknowledged
    inflight: asyncio.Future[Any] | None = None
    inflight_end: int = 0


@dataclass(slots=True)
class _Chunk:
    batches: Sequence[EventBatch]
    parts: list[_PartitionSend]

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
        security_protocol: str = "PLAINTEXT",
        ssl_context: ssl.SSLContext | None = None,
        sasl_mechanism: str = "PLAIN",
        sasl_plain_username: str | None = None,
        sasl_plain_password: str | None = None,
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
        self._security: dict[str, Any] = {
            "security_protocol": security_protocol,
            "ssl_context": ssl_context,
            "sasl_mechanism": sasl_mechanism,
            "sasl_plain_username": sasl_plain_username,
            "sasl_plain_password": sasl_plain_password,
        }
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
        "security_protocol",
        "sasl_mechanism",
        "sasl_plain_username",
        "sasl_plain_password",
        "sasl_plain_password_env",
        "ssl_cafile",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password_env",
        "ssl_check_hostname",
        "name",
    )

    @classmethod
    def from_url(cls, url: SinkURL) -> KafkaSink:
        """``kafka://host:port[,host:port]/topic?key=value&...``.

        Keys: ``partitions`` (creates the topic with that many unless ``create_topic=false``),
        ``create_topic``, ``replication_factor``, ``schema_registry_id`` (Confluent framing),
        ``schema_version``, ``linger_ms``, ``max_batch_bytes``, ``request_timeout_ms``,
        ``compression`` (gzip/snappy/lz4/zstd), ``client_id``, ``security_protocol``
        (PLAINTEXT/SSL/SASL_PLAINTEXT/SASL_SSL), ``sasl_mechanism``, ``sasl_plain_username``,
        ``sasl_plain_password`` or ``sasl_plain_password_env`` (the name of an environment
        variable holding it), ``ssl_cafile``/``ssl_certfile``/``ssl_keyfile``,
        ``ssl_password_env``, ``ssl_check_hostname``, ``name``.
        """
        url.check_keys(cls._URL_KEYS)
        topic = url.path.strip("/")
        if not url.hosts or not topic or "/" in topic:
            raise ConfigError(f"expected kafka://HOST:PORT/TOPIC, got {url.raw!r}")
        password = url.get("sasl_plain_password")
        pw_env = url.get("sasl_plain_password_env")
        if pw_env:
            password = _env(pw_env, url.raw)
        ssl_ctx = None
        protocol = (url.get("security_protocol") or "PLAINTEXT").upper()
        if protocol in ("SSL", "SASL_SSL") or url.get("ssl_cafile"):
            key_pw_env = url.get("ssl_password_env")
            ssl_ctx = create_ssl_context(
                cafile=url.get("ssl_cafile"),
                certfile=url.get("ssl_certfile"),
                keyfile=url.get("ssl_keyfile"),
                password=_env(key_pw_env, url.raw) if key_pw_env else None,
            )
            ssl_ctx.check_hostname = url.get_bool("ssl_check_hostname", True)
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
            security_protocol=protocol,
            ssl_context=ssl_ctx,
            sasl_mechanism=url.get("sasl_mechanism") or "PLAIN",
            sasl_plain_username=url.get("sasl_plain_username"),
            sasl_plain_password=password,
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
                await producer.stop()
                if isinstance(exc, Exception):
                    _raise_classified(exc, f"cannot connect to {self.bootstrap_servers}")
                raise
            self._producer = producer

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
        """Flush for up to ``timeout_s``, fail whatever is still unsent, stop the producer."""
        self._closed = True
        async with self._start_lock:
            producer, self._producer = self._producer, None
        self._pending = None
        if producer is None:
            return
        try:
            if not await _flush(producer, timeout_s):
                _fail_pending(producer)
        finally:
            await producer.stop()

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
                chunk = self._pending = await self._prepare(producer, batches)
            results = await asyncio.gather(
                *(self._send_partition(producer, p) for p in chunk.parts if p.done < len(p.msgs)),
                return_exceptions=True,
            )
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

    async def _prepare(self, producer: AIOKafkaProducer, batches: Sequence[EventBatch]) -> _Chunk:
        partitions = sorted(await producer.partitions_for(self.topic))
        if len(batches) < _INLINE_ENCODE:
            return self._encode(batches, partitions)
        # a big chunk is encoded in a worker thread so the event loop (and with it the other
        # sinks' tasks) keeps running meanwhile
        return await asyncio.to_thread(self._encode, batches, partitions)

    def _encode(self, batches: Sequence[EventBatch], partitions: list[int]) -> _Chunk:
        n = len(partitions)
        if n != self._routes_for:
            self._routes.clear()
            self._routes_for = n
        routes = self._routes
        by_partition: dict[int, _PartitionSend] = {}
        codec, schema_id = self.codec, self.schema_registry_id
        base = self._base_headers
        for b in batches:
            src = b.source
            route = routes.get(src.key)
            if route is None:
                key = source_key(src)
                route = routes[src.key] = (key, partitions[partition_for(key, n)])
            key, partition = route
            value = codec.encode(b) if schema_id is None else codec.encode_confluent(b, schema_id)
            headers = base
            if b.events:
                algos = {ev.hash_algo for ev in b.events}
                algo = next(iter(algos)) if len(algos) == 1 else ",".join(sorted(algos))
                headers = [*base, (HEADER_HASH_ALGO, algo.encode())]
            part = by_partition.get(partition)
            if part is None:
                part = by_partition[partition] = _PartitionSend(partition)
            part.msgs.append((key, value, headers, b.ts_ns // 1_000_000))
        return _Chunk(batches, list(by_partition.values()))

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
                fut = await producer.send_batch(builder, self.topic, partition=part.partition)
                fut.add_done_callback(_retrieve)
                part.inflight, part.inflight_end = fut, end
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
            part.done, part.inflight = part.inflight_end, None


async def _flush(producer: AIOKafkaProducer, timeout_s: float | None) -> bool:
    try:
        await asyncio.wait_for(asyncio.shield(producer.flush()), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


def _fail_pending(producer: AIOKafkaProducer) -> None:
    # aiokafka's stop() waits for every queued batch; at a shutdown deadline fail them instead
    accumulator = getattr(producer, "_message_accumulator", None)
    fail_all = getattr(accumulator, "fail_all", None)
    if callable(fail_all):
        fail_all(kerr.KafkaTimeoutError("the kvstream sink shut down before delivery"))


def _env(name: str, url: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(f"environment variable {name} (named in {url!r}) is not set")
    return value

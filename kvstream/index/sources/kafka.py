"""Read batches from a Kafka topic written by the Kafka sink (aiokafka, imported lazily).

Two modes:

- **Assigned partitions** (no ``group_id``): the consumer reads the given partitions (default:
  all) from the checkpoint's offsets, or from the start. Nothing is committed to Kafka; the
  snapshot holding the checkpoint is the only record of progress.
- **A shard** (``shard="K/N"``, :class:`~kvstream.index.types.ShardSpec`): the partitions ``p``
  with ``p % N == K``, assigned as above. Its checkpoints record the shard and the topic's
  partition count; resuming one with another shard, an unsharded checkpoint, or after the
  topic was re-partitioned (workers moved between partitions) raises SourceError. See
  ``docs/scaling.md``.
- **Elastic shards** (``group_id`` with ``elastic=True``): index shards that are members of
  one consumer group. A partition the group moves to this member is read from its start
  (its committed offset belongs to the previous owner's index, not to this one); when the
  group takes a partition away, its offsets leave the checkpoint and ``on_drop(partitions,
  num_partitions)`` is called so the consumer forgets that partition's workers
  (:func:`kvstream.index.shards.open_group_shard` wires it). See ``docs/scaling.md``.
- **Consumer group** (``group_id``): partitions are assigned by the group. Offsets are never
  auto-committed: :meth:`KafkaSource.commit` commits a checkpoint's offsets, and a consumer
  calls it only after the snapshot holding that checkpoint is on disk, so Kafka never claims
  more progress than the stored index state. When partitions are assigned, offsets from the
  checkpoint the source was resumed from take precedence over committed ones.

Every message is decoded whatever its schema version and framing (Avro single-object, or
Confluent with ``schema_ids`` or the ``kvstream-schema-version`` header). A message that does
not decode is skipped, counted and logged with its ``topic[partition]@offset``.

TLS and SASL: ``security`` (a :class:`~kvstream.kafka_security.KafkaSecurity`), or in a URL
the options of :mod:`kvstream.kafka_security` (``security_protocol=SASL_SSL&ssl_cafile=...``),
which also come from ``KVSTREAM_KAFKA_*`` variables or a ``kafka_config`` file: the same
settings, parsed by the same code, as the Kafka sink's.

``stop_at_end``: end once every assigned partition reaches the end offset it had when the
source started reading (catch up, then stop).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from kvstream.codec import AvroCodec
from kvstream.errors import CodecError, ConfigError, EventValidationError
from kvstream.index.errors import SourceError
from kvstream.index.sources.base import EventSource, SourceItem, decode_message, skipped_ids
from kvstream.index.types import ShardSpec
from kvstream.kafka_security import OPTIONS as SECURITY_OPTIONS
from kvstream.kafka_security import KafkaSecurity
from kvstream.sink import parse_sink_url

__all__ = ["KafkaSource"]

HEADER_SCHEMA_VERSION: Final = "kvstream-schema-version"
#: Polls a stop-at-end source waits for a fetch's high watermark before it trusts a listed end.
_END_CHECKS: Final = 10
_URL_KEYS: Final = (
    "group_id",
    "partitions",
    "shard",
    "stop_at_end",
    "client_id",
    "schema_ids",
    "request_timeout_ms",
    *SECURITY_OPTIONS,
)


class KafkaSource(EventSource):
    """Batches of ``topic`` on ``bootstrap_servers``; see the module docstring.

    ``partitions``: the partitions to assign (no group; default all). ``shard``: read only
    that shard's partitions (``"K/N"``; no group, no ``partitions``). ``elastic`` (with a
    ``group_id``): a member of a group of index shards, ``on_drop`` called with the partitions
    the group took away (module docstring). ``resume_from``: a :meth:`checkpoint`.
    ``schema_ids``: Confluent schema id -> kvstream schema version. ``consumer_options`` go
    to :class:`aiokafka.AIOKafkaConsumer` (``fetch_max_wait_ms``...). ``security``: TLS/SASL
    settings (default PLAINTEXT).
    """

    def __init__(
        self,
        bootstrap_servers: str | Sequence[str],
        topic: str,
        *,
        group_id: str | None = None,
        partitions: Sequence[int] | None = None,
        shard: ShardSpec | str | tuple[int, int] | None = None,
        resume_from: Mapping[str, Any] | None = None,
        stop_at_end: bool = False,
        schema_ids: Mapping[int, int] | None = None,
        client_id: str = "kvstream-index",
        codec: AvroCodec | None = None,
        consumer_options: Mapping[str, Any] | None = None,
        max_records: int = 1000,
        elastic: bool = False,
        on_drop: Callable[[set[int], int], None] | None = None,
        security: KafkaSecurity | None = None,
    ) -> None:
        super().__init__()
        if not topic:
            raise ConfigError("a Kafka source needs a topic")
        if group_id is not None and partitions is not None:
            raise ConfigError("a Kafka source uses either a consumer group or partitions")
        if elastic and group_id is None:
            raise ConfigError("elastic index shards are members of a consumer group: set group_id")
        if shard is not None and (group_id is not None or partitions is not None):
            raise ConfigError(
                "a Kafka shard reads its own partitions: no consumer group, no partitions"
            )
        servers = (
            bootstrap_servers if isinstance(bootstrap_servers, str) else ",".join(bootstrap_servers)
        )
        if not servers:
            raise ConfigError("a Kafka source needs bootstrap servers (host:port)")
        self.bootstrap_servers = servers
        self.topic = topic
        self.group_id = group_id
        self.partitions = None if partitions is None else sorted(set(partitions))
        self.shard = None if shard is None else ShardSpec.parse(shard)
        self.elastic = elastic
        self.on_drop = on_drop
        #: The topic's partition count (known once a sharded source started).
        self.num_partitions: int | None = None
        self.stop_at_end = stop_at_end
        self.schema_ids = dict(schema_ids or {})
        self.client_id = client_id
        self.codec = codec or AvroCodec()
        self.consumer_options = dict(consumer_options or {})
        #: TLS/SASL settings; their secrets never print.
        self.security = security or KafkaSecurity()
        self.max_records = max_records
        self.name = f"kafka:{topic}" if self.shard is None else f"kafka:{topic}#{self.shard}"
        self._resume: dict[int, int] = {}
        self._resume_partitions: int | None = None
        if resume_from is not None:
            if resume_from.get("kind") != "kafka" or resume_from.get("topic") != topic:
                raise SourceError(f"not a checkpoint of Kafka topic {topic!r}: {resume_from!r}")
            self._resume = {int(p): int(o) for p, o in resume_from.get("offsets", {}).items()}
            self._check_shard(resume_from)
            count = resume_from.get("num_partitions")
            self._resume_partitions = None if count is None else int(count)
        self._next: dict[int, int] = dict(self._resume)
        self._consumer: Any = None
        self._buf: deque[Any] = deque()
        self._ends: dict[int, int] | None = None
        self._fetched_end: set[int] = set()
        self._end_checks = 0
        self._lock = asyncio.Lock()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> KafkaSource:
        """``kafka://host:port[,host:port]/topic?group_id=G&partitions=0,1&stop_at_end=1``
        (or ``shard=K/N`` instead of a group or partitions).

        Also ``client_id``, ``request_timeout_ms``, ``schema_ids=ID:VERSION,...`` and the
        TLS/SASL options (module docstring); ``kwargs`` override/extend the constructor
        arguments. Error messages show the URL with its secrets masked.
        """
        u = parse_sink_url(url)
        where = u.raw  # secrets masked
        if u.scheme != "kafka":
            raise ConfigError(f"expected a kafka:// URL, got {where!r}")
        u.check_keys(_URL_KEYS)
        topic = u.path.strip("/")
        if not u.hosts or not topic or "/" in topic:
            raise ConfigError(f"expected kafka://HOST:PORT/TOPIC, got {where!r}")
        args: dict[str, Any] = {
            "security": KafkaSecurity.from_options(u.params, where=where),
            "group_id": u.get("group_id"),
            "stop_at_end": u.get_bool("stop_at_end", False),
            "client_id": u.get("client_id") or "kvstream-index",
        }
        parts = u.get("partitions")
        if parts:
            try:
                args["partitions"] = [int(p) for p in parts.split(",") if p.strip()]
            except ValueError:
                raise ConfigError(f"partitions must be ints in {where!r}") from None
        shard = u.get("shard")
        if shard:
            args["shard"] = ShardSpec.parse(shard)
        ids = u.get("schema_ids")
        if ids:
            try:
                args["schema_ids"] = {
                    int(k): int(v) for k, v in (item.split(":") for item in ids.split(","))
                }
            except ValueError:
                raise ConfigError(f"schema_ids must be ID:VERSION,... in {where!r}") from None
        timeout = u.get_int("request_timeout_ms")
        if timeout:
            args["consumer_options"] = {"request_timeout_ms": timeout}
        args.update(kwargs)
        return cls(u.hosts, topic, **args)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Connect, then assign partitions (seeking to the checkpoint) or join the group."""
        async with self._lock:
            if self._consumer is not None:
                return
            try:
                from aiokafka import AIOKafkaConsumer, TopicPartition
            except ImportError as exc:
                raise SourceError(
                    f"reading Kafka needs aiokafka ({exc}): pip install 'kvstream[kafka]'"
                ) from None

            options: dict[str, Any] = {
                "enable_auto_commit": False,
                "auto_offset_reset": "earliest",
                "fetch_max_wait_ms": 100,
                **self.security.client_kwargs(),
                **self.consumer_options,
            }
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap_servers,
                group_id=self.group_id,
                client_id=self.client_id,
                **options,
            )
            try:
                await consumer.start()
                if self.group_id is not None:
                    if self.elastic:
                        count = len(await self._topic_partitions(consumer))
                        self._check_partition_count(count)
                        self.num_partitions = count
                    consumer.subscribe([self.topic], listener=self._listener(consumer))
                else:
                    parts = self.partitions
                    if parts is None:
                        parts = await self._topic_partitions(consumer)
                    if self.shard is not None:
                        self._check_partition_count(len(parts))
                        self.num_partitions = len(parts)
                        try:
                            parts = self.shard.partitions(len(parts))
                        except ConfigError as exc:
                            raise SourceError(str(exc)) from None
                    tps = [TopicPartition(self.topic, p) for p in parts]
                    consumer.assign(tps)
                    for tp in tps:
                        off = self._resume.get(tp.partition)
                        if off is None:
                            await consumer.seek_to_beginning(tp)
                        else:
                            consumer.seek(tp, off)
            except BaseException as exc:
                # let aiokafka's coordinator task start: stopping a consumer before it ran
                # once makes stop() raise CancelledError instead of closing
                await asyncio.sleep(0)
                await consumer.stop()
                if isinstance(exc, Exception) and not isinstance(exc, SourceError):
                    raise SourceError(
                        f"cannot read {self.topic} from {self.bootstrap_servers}: "
                        f"{self.security.explain(exc)}"
                    ) from exc
                raise
            self._consumer = consumer

    def _check_shard(self, ckpt: Mapping[str, Any]) -> None:
        """A sharded source resumes only its own shard's checkpoints (another shard's index
        holds other workers; an unsharded one holds every worker)."""
        if self.shard is None:
            return  # partitions missing from a shard's checkpoint are read from the start
        theirs = ckpt.get("shard")
        if theirs != str(self.shard):
            what = "an unsharded consumer" if theirs is None else f"shard {theirs}"
            raise SourceError(
                f"checkpoint of {what} of {self.topic!r} cannot resume shard {self.shard}"
            )

    def _check_partition_count(self, count: int) -> None:
        before = self._resume_partitions
        if before is not None and before != count:
            raise SourceError(
                f"topic {self.topic!r} has {count} partitions, the checkpoint was taken with "
                f"{before}: workers moved between partitions, rebuild the shards from scratch"
            )

    async def _topic_partitions(self, consumer: Any) -> list[int]:
        for _ in range(50):
            parts = consumer.partitions_for_topic(self.topic)
            if parts:
                return sorted(parts)
            await consumer.topics()  # refresh metadata
            await asyncio.sleep(0.1)
        raise SourceError(f"topic {self.topic!r} does not exist on {self.bootstrap_servers}")

    def _listener(self, consumer: Any) -> Any:
        from aiokafka.abc import ConsumerRebalanceListener

        source = self

        class _Seek(ConsumerRebalanceListener):  # type: ignore[misc]
            async def on_partitions_revoked(self, revoked: Any) -> None:
                source._buf.clear()  # records of revoked partitions must not be yielded
                source._ends = None
                source._fetched_end.clear()

            async def on_partitions_assigned(self, assigned: Any) -> None:
                if source.elastic:
                    source._drop({tp.partition for tp in assigned})
                fresh = []
                for tp in assigned:
                    off = source._next.get(tp.partition)
                    if off is not None:
                        consumer.seek(tp, off)
                    elif source.elastic:
                        fresh.append(tp)
                if fresh:  # no state for them here: build it from the start
                    # seek() to the listed start, not seek_to_beginning(): that one only asks
                    # for a reset, which the previous owner's committed offset can overtake
                    starts = await consumer.beginning_offsets(fresh)
                    for tp in fresh:
                        consumer.seek(tp, starts[tp])

        return _Seek()

    def _drop(self, kept: set[int]) -> None:
        """Forget the positions of partitions this member no longer owns, and tell
        ``on_drop`` (elastic mode)."""
        dropped = set(self._next) - kept
        if not dropped:
            return
        for p in dropped:
            del self._next[p]
        if self.on_drop is not None:
            self.on_drop(dropped, self.num_partitions or 0)

    async def aclose(self) -> None:
        """Stop the consumer (nothing is committed here)."""
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await consumer.stop()

    # ------------------------------------------------------------------ reading

    async def read(self, timeout_s: float | None = None) -> SourceItem | None:
        """The next decodable batch (malformed messages are skipped and counted)."""
        await self.start()
        consumer = self._consumer
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            while self._buf:
                record = self._buf.popleft()
                item = self._decode(record)
                self._next[record.partition] = record.offset + 1
                if item is not None:
                    self.stats.batches += 1
                    self.stats.skipped_events += len(item.skipped_ids)
                    return item
            if self.stop_at_end and await self._at_end():
                self.ended = True
                return None
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            wait_ms = 200 if remaining is None else max(int(remaining * 1000), 0)
            got = await consumer.getmany(timeout_ms=min(wait_ms, 200), max_records=self.max_records)
            for tp in sorted(got, key=lambda t: t.partition):
                self._buf.extend(got[tp])

    def lag(self) -> dict[int, int]:
        """Records between the next one this source delivers and each assigned partition's
        high watermark (records fetched but not yet read count as behind), as of the last
        fetch; only partitions with both known. Call it on the event loop's thread."""
        consumer = self._consumer
        if consumer is None:
            return {}
        out: dict[int, int] = {}
        for tp in consumer.assignment():
            hw = consumer.highwater(tp)
            nxt = self._next.get(tp.partition)
            if hw is not None and nxt is not None:
                out[tp.partition] = max(hw - nxt, 0)
        return out

    async def caught_up(self) -> bool:
        """True once every assigned partition has been read up to the end offset it had when
        this was first asked (what a service waits for before it reports ready)."""
        if self._consumer is None:
            return False
        async with self._lock:
            return await self._at_end()

    async def _at_end(self) -> bool:
        consumer = self._consumer
        tps = consumer.assignment()
        if not tps:
            return self.group_id is None
        if self._ends is None:
            ends = await consumer.end_offsets(list(tps))
            self._ends = {tp.partition: off for tp, off in ends.items()}
            self._end_checks = 0
        self._end_checks += 1
        for tp in tps:
            end = self._ends.get(tp.partition)
            if end is None:
                self._ends = None
                return False
            if tp.partition not in self._fetched_end:
                # Some brokers (tansu) list a partition's end as its last record batch's base
                # offset + 1; a fetch reports the true high watermark. Wait for one (a few
                # polls at most) before trusting the listed end.
                hw = consumer.highwater(tp)
                if hw is None and self._end_checks <= _END_CHECKS:
                    return False
                self._fetched_end.add(tp.partition)
                if hw is not None and hw > end:
                    self._ends[tp.partition] = end = hw
            if await consumer.position(tp) < end:
                return False
        return True

    def _decode(self, record: Any) -> SourceItem | None:
        where = f"{record.topic}[{record.partition}]@{record.offset}"
        value = record.value
        if not value:
            self._malformed(where, "empty message")
            return None
        version = None
        for key, raw in record.headers or ():
            if key == HEADER_SCHEMA_VERSION:
                try:
                    version = int(raw)
                except (TypeError, ValueError):
                    version = None
        try:
            result = decode_message(
                self.codec, value, schema_ids=self.schema_ids, header_version=version
            )
        except (CodecError, EventValidationError, ValueError) as exc:
            self._malformed(where, exc)
            return None
        return SourceItem(result.columns, skipped_ids(result.skipped))

    # ------------------------------------------------------------------ positions

    def checkpoint(self) -> dict[str, Any]:
        """``{"kind": "kafka", "topic": T, "offsets": {"partition": next offset}}``; a
        shard's also holds ``"shard": "K/N"`` and ``"num_partitions"`` (the topic's), an
        elastic member's ``"num_partitions"``."""
        out: dict[str, Any] = {
            "kind": "kafka",
            "topic": self.topic,
            "offsets": {str(p): o for p, o in sorted(self._next.items())},
        }
        if self.shard is not None:
            out["shard"] = str(self.shard)
        if self.shard is not None or self.elastic:
            out["num_partitions"] = self.num_partitions or self._resume_partitions
        return out

    async def commit(self, checkpoint: Mapping[str, Any]) -> None:
        """Commit ``checkpoint``'s offsets to the consumer group (no-op without a group)."""
        if self.group_id is None or self._consumer is None:
            return
        from aiokafka import TopicPartition

        assigned = {tp.partition for tp in self._consumer.assignment()}
        offsets = {
            TopicPartition(self.topic, int(p)): int(o)
            for p, o in checkpoint.get("offsets", {}).items()
            if int(p) in assigned
        }
        if offsets:
            await self._consumer.commit(offsets)

"""Index shards past one core: partition by worker, one consumer process per shard, fan-out.

The Kafka sink keys every message by its source (``instance_id/rank``) and places it with the
Java client's murmur2 rule, so each worker's batches stay ordered in one partition. A worker's
index state depends only on its own batches, so the partitions can be split among shards:

- :class:`ShardSpec` ``K/N`` owns the partitions ``p`` with ``p % N == K`` (``KafkaSource(...,
  shard="K/N")`` or ``kafka://host:port/topic?shard=K/N`` reads exactly those, with
  ``assign()``); :func:`worker_partition` and :meth:`ShardSpec.owns_worker` say where a worker's
  events land. Each shard is an :class:`~kvstream.index.consumer.IndexConsumer` (in a
  library, :func:`open_shard`) or an index service reading ``?shard=K/N`` (``kvstream
  shard``) in its own process, snapshotting its index with its offsets; a replica restores
  that snapshot and reads on from the stored offsets.
- :class:`ShardedIndex` fans a match out to the shards (anything with ``workers()`` and
  ``match()``: a :class:`~kvstream.index.index.PrefixIndex` in this process, or, for a shard
  served by an index service in another process, ``kvstream.serve.shards.RemoteShard``, an
  HTTP client of the service's ``POST /match``) and merges the per-worker results;
  :func:`sharded_router` puts a :class:`~kvstream.index.router.Router` on top, so the
  Dynamo-style scoring is the router's own and its decision equals that of one unsharded
  index given the same candidates in the same order (property-tested).

A worker held by two shards (a shard resumed with another split, or reading partitions it
does not own) is reported untrusted rather than matched from either copy. Re-partitioning
the topic moves workers between partitions: shards must then be rebuilt, and a sharded
:class:`~kvstream.index.sources.kafka.KafkaSource` refuses a checkpoint taken with another
partition count. See ``docs/scaling.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from kvstream.errors import ConfigError
from kvstream.index.errors import PrefixIndexError
from kvstream.index.index import PrefixIndex
from kvstream.index.load import LoadTracker
from kvstream.index.matching import HashRequest, MatchResult, WorkerMatch
from kvstream.index.router import Router, RouterConfig
from kvstream.index.types import DEFAULT_TIER_WEIGHTS, ShardSpec, WorkerKey, worker_partition

if TYPE_CHECKING:
    from kvstream.index.consumer import IndexConsumer

__all__ = [
    "IndexShard",
    "ShardUnavailableError",
    "ShardSpec",
    "ShardedIndex",
    "open_group_shard",
    "open_shard",
    "sharded_router",
    "worker_partition",
]

_Worker = WorkerKey | tuple[str, int | None]


class ShardUnavailableError(PrefixIndexError):
    """A shard did not answer (refused, timed out, closed) or answered garbage."""


class IndexShard(Protocol):
    """What :class:`ShardedIndex` needs from a shard: a :class:`PrefixIndex`, or
    ``kvstream.serve.shards.RemoteShard`` for a shard served by an index service in another
    process (which also has ``submit_match``: send now, wait later, so remote shards work in
    parallel)."""

    def workers(self) -> list[WorkerKey]:
        """The workers the shard holds."""
        ...

    def match(
        self,
        tokens: Any,
        *,
        layer_group_id: int = 0,
        workers: Sequence[_Worker] | None = None,
        request: HashRequest | None = None,
        tier_weights: Sequence[float] = DEFAULT_TIER_WEIGHTS,
        hash_algo: str | None = None,
        tokens_per_block: int | None = None,
    ) -> MatchResult:
        """Per-candidate matches, as :meth:`PrefixIndex.match`."""
        ...


def _order(w: WorkerKey) -> tuple[str, int]:
    return (w.instance_id, -1 if w.dp_rank is None else w.dp_rank)


class ShardedIndex:
    """A read-only fan-out over shard indexes, answering ``workers()`` and ``match()`` as one
    :class:`PrefixIndex` holding every shard's workers would.

    ``workers()`` lists every shard's workers sorted by (instance id, rank), so the candidate
    order (which breaks exact ties in a router) does not depend on how the fleet is sharded.
    ``match()`` sends each shard only the candidates it holds and puts the answers back in
    candidate order; a candidate no shard holds is reported as an unknown worker, one held by
    several shards as untrusted (note ``held by shards i, j``). Errors a shard raises (e.g.
    HashConfigMismatchError) propagate, after every other shard's answer was read.

    A shard that does not answer (:class:`ShardUnavailableError`) does not stop the others:
    with ``tolerate_unavailable`` (the default) its workers, as it last listed them, are
    matched as untrusted (note ``shard unavailable: ...``), so a router still routes, without
    counting on their caches; otherwise the error propagates. Reads only: shards keep being
    fed by their consumers.
    """

    def __init__(self, shards: Sequence[IndexShard], *, tolerate_unavailable: bool = True) -> None:
        if not shards:
            raise ConfigError("a sharded index needs at least one shard")
        self.shards = list(shards)
        self.tolerate_unavailable = tolerate_unavailable
        self._down: dict[int, str] = {}  # shard -> why it did not answer (this call)
        self._last: list[list[WorkerKey]] = [[] for _ in self.shards]
        # the placement as of the shards' last answers, recomputed only when one changes
        self._seen: list[list[WorkerKey]] | None = None
        self._owners: dict[WorkerKey, list[int]] = {}
        self._sorted: list[WorkerKey] = []

    def _unavailable(self, i: int, exc: ShardUnavailableError) -> None:
        if not self.tolerate_unavailable:
            raise exc
        self._down[i] = str(exc)

    def _placement(self) -> tuple[dict[WorkerKey, list[int]], list[WorkerKey]]:
        self._down = {}
        lists = []
        for i, shard in enumerate(self.shards):
            try:
                self._last[i] = shard.workers()
            except ShardUnavailableError as exc:
                self._unavailable(i, exc)  # keep its last list: its workers stay known
            lists.append(self._last[i])
        if lists != self._seen:
            out: dict[WorkerKey, list[int]] = {}
            for i, ws in enumerate(lists):
                for w in ws:
                    out.setdefault(WorkerKey(w[0], w[1]), []).append(i)
            self._seen, self._owners = lists, out
            self._sorted = sorted(out, key=_order)
        return self._owners, self._sorted

    def owners(self) -> dict[WorkerKey, list[int]]:
        """Worker -> the shards (positions in :attr:`shards`) holding it."""
        return {w: list(held) for w, held in self._placement()[0].items()}

    def workers(self) -> list[WorkerKey]:
        """Every shard's workers, sorted by (instance id, rank)."""
        return list(self._placement()[1])

    def __contains__(self, worker: object) -> bool:
        if not isinstance(worker, tuple) or len(worker) != 2:
            return False
        return any(worker in shard.workers() for shard in self.shards)

    def match(
        self,
        tokens: Any,
        *,
        layer_group_id: int = 0,
        workers: Sequence[_Worker] | None = None,
        request: HashRequest | None = None,
        tier_weights: Sequence[float] = DEFAULT_TIER_WEIGHTS,
        hash_algo: str | None = None,
        tokens_per_block: int | None = None,
    ) -> MatchResult:
        """How much of ``tokens`` each candidate holds (``workers``, default
        :meth:`workers`), as :meth:`PrefixIndex.match` on the union of the shards."""
        owners, ordered = self._placement()
        cands = ordered if workers is None else [WorkerKey(w[0], w[1]) for w in workers]
        per_shard: dict[int, list[WorkerKey]] = {}
        for w in cands:
            held = owners.get(w)
            if held is not None and len(held) == 1:
                per_shard.setdefault(held[0], []).append(w)
        args: dict[str, Any] = {
            "layer_group_id": layer_group_id,
            "request": request,
            "tier_weights": tier_weights,
            "hash_algo": hash_algo,
            "tokens_per_block": tokens_per_block,
        }
        results = self._fan_out(tokens, per_shard, args)
        found: dict[WorkerKey, WorkerMatch] = {}
        num_tokens: int | None = None
        for res in results:
            num_tokens = res.num_tokens
            for m in res.matches:
                found[m.worker] = m
        if num_tokens is None:
            num_tokens = _count_tokens(tokens)
        out: list[WorkerMatch] = []
        for w in cands:
            got = found.get(w)
            if got is None:
                held = owners.get(w)
                if held is None:
                    note = "unknown worker"
                elif len(held) > 1:
                    note = "held by shards " + ", ".join(map(str, held))
                else:
                    note = f"shard unavailable: {self._down.get(held[0], '')}"
                got = WorkerMatch(w, 0, 0.0, 0, None, None, False, note)
            out.append(got)
        return MatchResult(tuple(out), num_tokens)

    def _fan_out(
        self, tokens: Any, per_shard: dict[int, list[WorkerKey]], args: dict[str, Any]
    ) -> list[MatchResult]:
        """Every shard's answer for its candidates. Remote shards get their requests first
        and work in parallel with the local ones; every reply is read before an error is
        raised (a reply left unread would answer the connection's next request)."""
        pending: list[tuple[int, Callable[[], MatchResult]]] = []
        results: list[MatchResult] = []
        error: BaseException | None = None
        for i, subset in per_shard.items():
            if i in self._down:
                continue
            submit = getattr(self.shards[i], "submit_match", None)
            if submit is None:
                continue
            try:
                pending.append((i, submit(tokens, workers=subset, **args)))
            except ShardUnavailableError as exc:
                self._down[i] = str(exc)
                error = error or (None if self.tolerate_unavailable else exc)
        calls = [
            (i, lambda i=i, subset=subset: self.shards[i].match(tokens, workers=subset, **args))
            for i, subset in per_shard.items()
            if i not in self._down and not hasattr(self.shards[i], "submit_match")
        ]
        for i, call in [*calls, *pending]:
            try:
                results.append(call())
            except ShardUnavailableError as exc:
                self._down[i] = str(exc)
                error = error or (None if self.tolerate_unavailable else exc)
            except Exception as exc:  # re-raised once every reply is read
                error = error or exc
        if error is not None:
            raise error
        return results


def sharded_router(
    shards: ShardedIndex | Sequence[IndexShard],
    workers: Sequence[_Worker] | None = None,
    config: RouterConfig | None = None,
    *,
    load: LoadTracker | None = None,
) -> Router:
    """A :class:`Router` whose matches fan out to ``shards`` (see :class:`ShardedIndex`):
    scoring, policies and load tracking are the router's own."""
    view = shards if isinstance(shards, ShardedIndex) else ShardedIndex(shards)
    # The router reads an index through workers() and match() only; ShardedIndex answers
    # both as one PrefixIndex over the shards would (tests/test_index_scaleout.py).
    return Router(cast(PrefixIndex, view), workers, config, load=load)


def open_shard(
    snapshot_path: str | os.PathLike[str] | None,
    bootstrap_servers: str | Sequence[str],
    topic: str,
    shard: ShardSpec | str | tuple[int, int],
    *,
    index_factory: Callable[[], PrefixIndex] | None = None,
    hasher_params: Mapping[str, Mapping[str, Any]] | None = None,
    **source_options: Any,
) -> IndexConsumer:
    """The consumer of ``shard`` of ``topic``: restored from ``snapshot_path`` when it exists
    (a replica joining: the index as snapshotted, reading on from the stored offsets), else
    a fresh index reading the shard's partitions from the start (``snapshot_path`` None: one
    that never snapshots). Snapshots it writes carry
    the shard; one of another shard or split raises SourceError (from the source's
    checkpoint check). ``source_options`` go to
    :class:`~kvstream.index.sources.kafka.KafkaSource` (``stop_at_end``, ``client_id``...).
    """
    from kvstream.index.sources.kafka import KafkaSource

    spec = ShardSpec.parse(shard)

    def make(ckpt: dict[str, Any] | None) -> KafkaSource:
        return KafkaSource(bootstrap_servers, topic, shard=spec, resume_from=ckpt, **source_options)

    consumer = _consumer(snapshot_path, make, index_factory, hasher_params)
    consumer.meta.setdefault("shard", str(spec))
    return consumer


def open_group_shard(
    snapshot_path: str | os.PathLike[str] | None,
    bootstrap_servers: str | Sequence[str],
    topic: str,
    group_id: str,
    *,
    index_factory: Callable[[], PrefixIndex] | None = None,
    hasher_params: Mapping[str, Mapping[str, Any]] | None = None,
    **source_options: Any,
) -> IndexConsumer:
    """An elastic shard: a member of consumer group ``group_id`` whose partitions the group
    assigns and moves. A partition it gains is read from the start; when it loses one, the
    workers of that partition leave its index (so no two members keep the same worker for
    long) and its offsets leave the checkpoint. Restored from ``snapshot_path`` when it
    exists. Rebalances cost a group re-join and the rebuild of every moved partition; see
    ``docs/scaling.md`` for when to prefer the fixed split of :func:`open_shard`.
    """
    from kvstream.index.sources.kafka import KafkaSource

    def drop(partitions: set[int], num_partitions: int) -> None:
        index = consumer.index
        for w in index.workers():
            if worker_partition(w, num_partitions) in partitions:
                index.forget(w)

    def make(ckpt: dict[str, Any] | None) -> KafkaSource:
        return KafkaSource(
            bootstrap_servers,
            topic,
            group_id=group_id,
            elastic=True,
            on_drop=drop,
            resume_from=ckpt,
            **source_options,
        )

    consumer = _consumer(snapshot_path, make, index_factory, hasher_params)
    consumer.meta.setdefault("group_id", group_id)
    return consumer


def _consumer(
    snapshot_path: str | os.PathLike[str] | None,
    make: Callable[[dict[str, Any] | None], Any],
    index_factory: Callable[[], PrefixIndex] | None,
    hasher_params: Mapping[str, Mapping[str, Any]] | None,
) -> IndexConsumer:
    """Resumed from the snapshot when there is one; without a path, a fresh index that
    never snapshots."""
    from kvstream.index.consumer import IndexConsumer

    if snapshot_path is not None:
        return IndexConsumer.resume(
            snapshot_path, make, index_factory=index_factory, hasher_params=hasher_params
        )
    index = index_factory() if index_factory is not None else PrefixIndex()
    return IndexConsumer(make(None), index)


def _count_tokens(tokens: Any) -> int:
    try:
        return len(tokens)
    except TypeError:
        return 0

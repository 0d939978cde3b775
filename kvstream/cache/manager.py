"""The instrumented paged KV-cache manager.

:class:`KVCacheManager` is what an inference engine embeds: per layer group a block pool
(optionally backed by a torch tensor), requests that match their longest cached prefix,
append tokens and commit full blocks, and every cache change recorded as a KV-cache event.

Lifecycle of a block (per layer group): allocated to a request -> committed once full (its
chained hash registered, a ``stored`` event) -> released when no request holds it (kept as an
evictable cached block) -> reused by a later prefix hit, or evicted least recently freed
first when a pool runs out (a ``removed`` event; the emitter batches them).

Rules worth knowing:

- **Commit timing.** A full block is committed as soon as its tokens are known (the prompt's
  at :meth:`~KVCacheManager.add_request`, later ones at
  :meth:`~KVCacheManager.append_tokens`); the engine writes its K/V in the same iteration.
- **Duplicates.** A block whose hash another block already carries is not committed twice:
  the request keeps writing its own (uncommitted) block and, in a full-attention group, also
  holds the committed one, so every committed block's parent stays committed.
- **Leaf-first eviction.** Requests release their blocks last position first and hold their
  whole chain in full-attention groups, so the LRU order always evicts descendants before
  ancestors; the prefix tree checks it.
- **Sliding windows.** At each :meth:`~KVCacheManager.append_tokens` a sliding-window group
  releases the request's blocks that lie entirely before the window of the next token. They
  stay cached and evictable (their ``removed`` event comes when they are evicted), so later
  requests can still reuse them. Each group has its own reuse boundary (see
  :class:`~kvstream.cache.request.PrefixMatch`).
- **All or nothing.** Every operation checks that every pool can serve it before changing
  anything; :class:`~kvstream.cache.errors.CacheFullError` leaves the manager as it was.
  Operations never touch blocks held by other requests beyond sharing committed ones.
- **Events off.** With a recorder whose ``enabled`` is False nothing event-related is built.
- **Handing events over.** Once per iteration the engine calls :meth:`~KVCacheManager.
  flush_events` (the :class:`EventBatch` models are built on the engine thread) or, cheaper,
  :meth:`~KVCacheManager.flush_events_deferred` (O(1): a
  :class:`~kvstream.events.deferred.DeferredBatch` that the pipeline materialises on its own
  thread into the same batch). Blocks committed together are recorded with one
  ``stored_chain`` call and a pool's evictions with one ``removed_many`` call.

Not thread-safe: call it from the engine thread.

The manager's roles live in their own modules, each a layer of the one class:
:mod:`.manager_state` (the shared state, lookups and request hashing), :mod:`.commit`
(commit, append, release), :mod:`.admission` (prefix match, planning, onboarding, admission)
and :mod:`.kv_io` (per-layer K/V, export and import). This module builds the state and keeps
the lifecycle, statistics, event hand-over and invariant checks.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvstream.cache.admission import HashedPrompt
from kvstream.cache.block import Block
from kvstream.cache.block_pool import BlockPool
from kvstream.cache.config import CacheConfig
from kvstream.cache.errors import CacheInvariantError
from kvstream.cache.kv_io import KVIO
from kvstream.cache.manager_state import TrustedChain
from kvstream.cache.request import GroupMatch, RequestState
from kvstream.cache.stats import CacheStats, GroupStats
from kvstream.cache.storage import KVStorage, resolve_device
from kvstream.cache.tiering import Tiers, build_tiers
from kvstream.clock import SYSTEM_CLOCK, Clock
from kvstream.events.deferred import DeferredBatch
from kvstream.events.emitter import NULL_RECORDER, EventEmitter, EventRecorder
from kvstream.events.model import EventBatch, SourceId
from kvstream.hashing import ChainState

if TYPE_CHECKING:
    import torch

__all__ = ["HashedPrompt", "KVCacheManager"]


class KVCacheManager(KVIO):
    """A paged KV cache over the layer groups of ``config`` that records KV-cache events.

    ``recorder`` overrides the event recorder; by default it is an
    :class:`~kvstream.events.emitter.EventEmitter` for ``source`` (default: instance
    ``"kvstream-cache"``, incarnation = the clock's time in ns) when ``config.events`` is
    true, else a null recorder. The constructor records one ``created`` event per group.
    Request ids are strings.
    """

    def __init__(
        self,
        config: CacheConfig,
        *,
        recorder: EventRecorder | None = None,
        source: SourceId | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        self.config = config
        self._hasher = config.make_hasher()
        self._tpb = config.tokens_per_block
        if recorder is None:
            if config.events:
                if source is None:
                    source = SourceId(instance_id="kvstream-cache", incarnation=clock.time_ns())
                # dedup=False: the prefix tree (and the tiers) hold exactly what was announced,
                # so the emitter need not keep a second set of it (tests/test_emitter_trusted_
                # chain.py holds the batches equal to a deduplicating emitter's).
                recorder = EventEmitter(
                    source,
                    hash_algo=self._hasher.name,
                    capacity=config.event_capacity,
                    clock=clock,
                    dedup=False,
                )
            else:
                recorder = NULL_RECORDER
        self._recorder: EventRecorder = recorder
        # Chains of new blocks and batches of evictions go to the emitter without its
        # per-hash checks when it is an EventEmitter (not a subclass) publishing hashes of our
        # hasher's width.
        trusted = type(recorder) is EventEmitter and recorder.accepts_trusted(self._hasher.width)
        self._trusted_chain: TrustedChain | None = (
            recorder.stored_chain_trusted if trusted else None  # type: ignore[attr-defined]
        )
        removed_trusted = recorder.removed_many_trusted if trusted else None  # type: ignore[attr-defined]
        self._windows = [g.window_size for g in config.groups]
        self._swa = [i for i, w in enumerate(self._windows) if w is not None]
        self._layers: list[tuple[int, int]] = [
            (gid, local) for gid, g in enumerate(config.groups) for local in range(g.num_layers)
        ]
        self._storage: KVStorage | None = None
        self.device: torch.device | None = None
        if not config.metadata_only:
            self.device = resolve_device(config.device)
            self._storage = KVStorage(config, self.device)
        self._tiers: Tiers | None = build_tiers(config, recorder, self._storage)
        on_evict = None if self._tiers is None else self._tiers.evict
        self._pools = [
            BlockPool(
                i,
                g.num_blocks,
                recorder,
                linked=g.window_size is None,
                on_evict=on_evict,
                removed_trusted=removed_trusted,
            )
            for i, g in enumerate(config.groups)
        ]
        self._requests: dict[str, RequestState] = {}
        self._added = 0
        self._rejected = 0
        self._prompt_tokens = 0
        self._reusable_tokens = 0
        self._hit_blocks = [0] * len(self._pools)
        self._queried_blocks = [0] * len(self._pools)
        self._plain_root: ChainState | None = None  # the root without LoRA or salt
        #: One full-attention group on the GPU alone: requests are admitted by _admit_plain.
        self._plain = len(self._pools) == 1 and not self._swa and self._tiers is None
        self._plain_matches: dict[int, GroupMatch] = {}  # _admit_plain's, by boundary
        self._announce_created()

    def _announce_created(self) -> None:
        for gid, spec in enumerate(self.config.groups):
            levels = (
                [spec.num_blocks]
                if self._tiers is None
                else self._tiers.levels(gid, spec.num_blocks)
            )
            self._recorder.created(
                gid,
                window_size=self.config.window_of(gid),
                num_blocks_per_cache_level=levels,
                tokens_per_block=self._tpb,
                attention_kind=spec.attention_kind,
            )

    # ------------------------------------------------------------------ queries

    @property
    def recorder(self) -> EventRecorder:
        """The event recorder (an EventEmitter, a null recorder, or the one passed in)."""
        return self._recorder

    @property
    def num_groups(self) -> int:
        """Number of layer groups."""
        return len(self._pools)

    def request_ids(self) -> list[str]:
        """Ids of the running requests, in the order they were added."""
        return list(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def num_tokens(self, request_id: str) -> int:
        """Tokens of a running request (prompt plus appended)."""
        return self._get(request_id).num_tokens

    def block_hashes(self, request_id: str) -> list[bytes]:
        """Published hashes of a running request's full blocks, in order."""
        return list(self._get(request_id).hashes)

    def block_ids(self, request_id: str, layer_group_id: int) -> list[int | None]:
        """Physical block ids of a request in one group (None: released or never held)."""
        gs = self._get(request_id).groups[self._gid(layer_group_id)]
        return [None if b is None else b.block_id for b in gs.blocks]

    def num_free_blocks(self, layer_group_id: int) -> int:
        """Free blocks of a group (uncached free plus evictable cached)."""
        return self._pools[self._gid(layer_group_id)].num_free

    def cached_hashes(self, layer_group_id: int) -> set[bytes]:
        """Hashes of every committed block of a group (held or evictable)."""
        return set(self._pools[self._gid(layer_group_id)].tree.hashes())

    def stats(self) -> CacheStats:
        """A snapshot of the counters and gauges."""
        groups = tuple(
            GroupStats(
                layer_group_id=gid,
                window_size=self._windows[gid],
                num_blocks=p.num_blocks,
                free_blocks=p.num_free,
                evictable_blocks=p.num_evictable,
                cached_blocks=p.num_cached,
                used_blocks=p.num_blocks - p.num_free,
                evictions=p.evictions,
                hit_blocks=self._hit_blocks[gid],
                queried_blocks=self._queried_blocks[gid],
                tier=None if self._tiers is None else self._tiers.stats(gid),
            )
            for gid, p in enumerate(self._pools)
        )
        return CacheStats(
            running_requests=len(self._requests),
            requests_added=self._added,
            requests_rejected=self._rejected,
            prompt_tokens=self._prompt_tokens,
            reusable_tokens=self._reusable_tokens,
            groups=groups,
            disk=None
            if self._tiers is None or self._tiers.disk is None
            else self._tiers.disk.stats(),
        )

    def reset(self) -> None:
        """Drop every request and every cached block; records ``cleared`` for every group.

        Cumulative counters (stats) are kept; K/V tensor contents are left as they are.
        """
        self._requests.clear()
        for pool in self._pools:
            pool.clear()
        if self._tiers is not None:
            self._tiers.clear()
        # One call for every group, so the clear subsumes every group's pending removals.
        self._recorder.cleared(None)

    # ------------------------------------------------------------------ tiers

    def persist(self) -> int:
        """Write-through (``disk_tier.write_through``): write every block committed since the
        last call to the disk store, skipping files that exist; returns how many were
        written. Call it once the iteration's K/V is written (e.g. before
        :meth:`flush_events`). Without write-through it writes nothing and returns 0."""
        return 0 if self._tiers is None else self._tiers.persist()

    def host_hashes(self, layer_group_id: int) -> list[bytes]:
        """Hashes of a group's host-tier blocks, least recently offloaded first."""
        gid = self._gid(layer_group_id)
        return [] if self._tiers is None else self._tiers.host_hashes(gid)

    def disk_hashes(self, layer_group_id: int) -> set[bytes]:
        """Hashes of a group's blocks this manager moved to the disk tier (and announced at
        level 2); the store may hold more, written by other processes."""
        gid = self._gid(layer_group_id)
        return set() if self._tiers is None else self._tiers.disk_hashes(gid)

    def close(self) -> None:
        """Finish pending tier copies, close the disk store and drop the block metadata
        (idempotent; no event is recorded). The manager must not be used afterwards.

        Dropping the metadata unlinks the LRU queue's doubly linked blocks, so a closed
        manager is freed by reference counting alone instead of waiting for a full pass of
        the cyclic garbage collector (which walks every block of every pool)."""
        if self._tiers is not None:
            self._tiers.close()
        self._requests.clear()
        for pool in self._pools:
            pool.clear()

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ events

    def take_events(self) -> EventBatch | None:
        """The events materialised so far (pending removals stay pending), or None."""
        return self._recorder.take()

    def flush_events(self) -> EventBatch | None:
        """End of an engine iteration: materialise pending removals and hand every event
        over as one batch (None when there is none)."""
        return self._recorder.flush()

    def take_events_deferred(self) -> DeferredBatch | None:
        """:meth:`take_events`, handed over as a :class:`DeferredBatch` (see
        :meth:`flush_events_deferred`)."""
        return self._recorder.take_deferred()

    def flush_events_deferred(self) -> DeferredBatch | None:
        """:meth:`flush_events` without building the models on the engine thread.

        Costs O(1) whatever the number of events: the recorder's raw records are handed over
        as a :class:`~kvstream.events.deferred.DeferredBatch`. Give it to
        :meth:`Pipeline.submit <kvstream.pipeline.Pipeline.submit>` (its sink tasks build the
        :class:`EventBatch` once, off the engine thread) or call its ``materialize()`` where
        the batch is needed: the result equals what :meth:`flush_events` would have returned.
        None when there is nothing to hand over (and always with events off).
        """
        return self._recorder.flush_deferred()

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Verify every internal invariant (for tests and debugging); CacheInvariantError.

        Reference counts equal the holdings of running requests; each pool's free count,
        LRU membership and prefix-tree links are consistent; no block is held twice by one
        request position.
        """
        for gid, pool in enumerate(self._pools):
            holdings: Counter[int] = Counter()
            blocks: dict[int, Block] = {}
            for req in self._requests.values():
                gs = req.groups[gid]
                for i, b in enumerate(gs.blocks):
                    if (b is None) != (i < gs.released):
                        raise CacheInvariantError(
                            f"request {req.request_id!r} group {gid}: position {i} is "
                            f"{'empty' if b is None else 'held'} with released={gs.released}"
                        )
                    if b is not None:
                        holdings[b.block_id] += 1
                        blocks[b.block_id] = b
                for p in gs.pins.values():
                    holdings[p.block_id] += 1
                    blocks[p.block_id] = p
            pool.check(holdings, blocks)
        if self._tiers is not None:
            self._tiers.check()

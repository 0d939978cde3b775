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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstream._types import PRIORITY_DEFAULT, PRIORITY_MAX, PRIORITY_MIN, TokenIds
from kvstream.cache.block import Block
from kvstream.cache.block_pool import BlockPool
from kvstream.cache.config import CacheConfig
from kvstream.cache.errors import (
    CacheFullError,
    CacheInvariantError,
    DuplicateRequestError,
    KVAccessError,
    RequestError,
    TransferError,
    UnknownRequestError,
)
from kvstream.cache.plan import (
    Plan,
    full_cost,
    plan_append,
    plan_full,
    plan_import,
    plan_prompt,
)
from kvstream.cache.request import (
    GroupMatch,
    GroupState,
    MmItem,
    PrefixMatch,
    RequestState,
    block_mm_keys,
    normalize_mm_items,
)
from kvstream.cache.stats import CacheStats, GroupStats
from kvstream.cache.storage import KVStorage, copy_blocks, resolve_device
from kvstream.cache.tiering import DISK, GPU, HOST, Tiers, build_tiers
from kvstream.cache.transfer import (
    GroupTransfer,
    ImportResult,
    ImportTicket,
    KVTransfer,
    TokenRange,
)
from kvstream.cache.windows import first_needed_block
from kvstream.clock import SYSTEM_CLOCK, Clock
from kvstream.errors import HashingError
from kvstream.events.deferred import DeferredBatch
from kvstream.events.emitter import NULL_RECORDER, EventEmitter, EventRecorder
from kvstream.events.model import EventBatch, MmKey, SourceId
from kvstream.hashing import ChainState
from kvstream.hashing.blocks import coerce_tokens

if TYPE_CHECKING:
    import torch

__all__ = ["HashedPrompt", "KVCacheManager"]


@dataclass(frozen=True, slots=True, eq=False)
class HashedPrompt:
    """A prompt hashed once by :meth:`KVCacheManager.hash_prompt`: ``hashes`` are the
    published hashes of its full blocks, in order (the request's blocks a router matches are
    ``hashes[: (num_tokens - 1) // tokens_per_block]``). Pass it to
    :meth:`~KVCacheManager.add_request` (``hashed=``) of any manager with the same hash
    configuration so the prompt is not hashed again. Treat the other fields as opaque."""

    raw: bytes
    root: ChainState
    hashes: tuple[bytes, ...]
    chain: ChainState

    @property
    def num_tokens(self) -> int:
        """The prompt's length in tokens."""
        return len(self.raw) >> 2


class KVCacheManager:
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
                recorder = EventEmitter(
                    source, hash_algo=self._hasher.name, capacity=config.event_capacity, clock=clock
                )
            else:
                recorder = NULL_RECORDER
        self._recorder: EventRecorder = recorder
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
            BlockPool(i, g.num_blocks, recorder, linked=g.window_size is None, on_evict=on_evict)
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

    def kv_tensor(self, layer_group_id: int) -> torch.Tensor | None:
        """A group's K/V tensor (``[blocks, layers, 2, tokens_per_block, heads, head_dim]``),
        None in metadata-only mode."""
        gid = self._gid(layer_group_id)
        return None if self._storage is None else self._storage.tensors[gid]

    def layer_location(self, layer: int) -> tuple[int, int]:
        """``(layer_group_id, index within the group)`` of a global layer id."""
        if (
            isinstance(layer, bool)
            or not isinstance(layer, int)
            or not 0 <= layer < len(self._layers)
        ):
            raise KVAccessError(
                f"layer must be an int in 0..{len(self._layers) - 1}, got {layer!r}"
            )
        return self._layers[layer]

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

    def match_prefix(
        self,
        prompt_tokens: Any,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_items: Iterable[MmItem | tuple[bytes, int, int]] = (),
    ) -> PrefixMatch:
        """What :meth:`add_request` would reuse for this prompt, without changing anything."""
        raw, items = self._check_prompt(prompt_tokens, mm_items)
        root = self._root(lora_id, lora_name, cache_salt)
        hashes, _ = self._hash_blocks(root, raw, 0, items)
        n = len(raw) >> 2
        tiers = self._tiers
        plans = [
            plan_prompt(
                pool,
                w,
                tokens_per_block=self._tpb,
                hashes=hashes,
                n=n,
                lower=None if tiers is None else partial(tiers.level_of, gid),
            )
            for gid, (pool, w) in enumerate(zip(self._pools, self._windows, strict=True))
        ]
        return self._match_of(n, plans)

    # ------------------------------------------------------------------ requests

    def hash_prompt(
        self,
        prompt_tokens: Any,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> HashedPrompt:
        """Hash a prompt's full blocks as :meth:`add_request` would (same arguments, no
        multimodal items), without changing anything: for a caller that needs the hashes
        before choosing a manager (a router), then passes the result to ``add_request``.
        Raises RequestError/HashingError for bad tokens."""
        raw, _ = self._check_prompt(prompt_tokens, ())
        root = self._root(lora_id, lora_name, cache_salt)
        hashes, chain = self._hash_blocks(root, raw, 0, ())
        return HashedPrompt(raw, root, tuple(hashes), chain)

    def hash_prompts(self, prompts: Sequence[Any]) -> list[HashedPrompt]:
        """:meth:`hash_prompt` of several prompts (no LoRA, salt or multimodal items): equal
        to ``[hash_prompt(p) for p in prompts]``, with the requests' chains hashed side by
        side where the hasher can (:meth:`~kvstream.hashing.BlockHasher.chain_raw_many`).
        Raises RequestError/HashingError for bad tokens, before hashing any."""
        raws = [self._check_prompt(p, ())[0] for p in prompts]
        root = self._root(None, None, None)
        hasher, tpb = self._hasher, self._tpb
        out: list[HashedPrompt] = []
        for raw, (hashes, keys) in zip(raws, hasher.chain_raw_many(root, raws, tpb), strict=True):
            chain = hasher.resume(root, keys[-1], root.depth + len(hashes)) if hashes else root
            out.append(HashedPrompt(raw, root, tuple(hashes), chain))
        return out

    def add_request(
        self,
        request_id: str,
        prompt_tokens: Any,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_items: Iterable[MmItem | tuple[bytes, int, int]] = (),
        priority: int = PRIORITY_DEFAULT,
        hashed: HashedPrompt | None = None,
    ) -> PrefixMatch:
        """Start a request: reuse its longest cached prefix per group, allocate the rest,
        commit its full prompt blocks.

        ``prompt_tokens``: any token container (list, ``TokenIds``, numpy array, ...), at
        least one token. ``lora_id``/``lora_name`` (the adapter), ``cache_salt`` (the tenant)
        and ``mm_items`` (multimodal items: :class:`MmItem` or ``(content bytes, offset,
        length)``) all enter the block hashes, so different adapters, tenants and item
        contents never share blocks. ``priority`` (0..100) is published with the blocks.
        ``hashed``: this prompt's :meth:`hash_prompt` result (from any manager with the same
        hash configuration), so it is not hashed again; RequestError when it belongs to other
        tokens, another LoRA/salt scope or another hasher, or with ``mm_items``.

        At least the last prompt token is never reused (the engine needs its logits), so a
        boundary is at most ``(len(prompt) - 1) // tokens_per_block`` blocks.
        Returns the per-group :class:`PrefixMatch`. Raises DuplicateRequestError,
        RequestError/HashingError for bad arguments and CacheFullError when a pool cannot
        hold the request even after evicting every evictable block; on error nothing changed.
        """
        raw, items, hashes, chain = self._check_hashed(
            request_id,
            prompt_tokens,
            mm_items,
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=cache_salt,
            priority=priority,
            hashed=hashed,
        )
        req = self._new_request(
            request_id,
            items,
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=cache_salt,
            priority=priority,
        )
        if self._plain and not items:
            return self._admit_plain(req, raw, hashes, chain)
        _, match = self._admit(req, raw, hashes, chain, importing=False)
        return match

    def _check_new(
        self, request_id: object, prompt_tokens: Any, mm_items: Iterable[Any], priority: object
    ) -> tuple[bytes, tuple[MmItem, ...]]:
        if not isinstance(request_id, str):
            raise RequestError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise DuplicateRequestError(f"request {request_id!r} is already running")
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not (PRIORITY_MIN <= priority <= PRIORITY_MAX)
        ):
            raise RequestError(f"priority must be an int in {PRIORITY_MIN}..{PRIORITY_MAX}")
        return self._check_prompt(prompt_tokens, mm_items)

    def _check_hashed(
        self,
        request_id: str,
        prompt_tokens: Any,
        mm_items: Iterable[Any],
        *,
        lora_id: int | None,
        lora_name: str | None,
        cache_salt: str | None,
        priority: int,
        hashed: HashedPrompt | None,
    ) -> tuple[bytes, tuple[MmItem, ...], list[bytes], ChainState]:
        # A new request's checked arguments: its packed prompt, multimodal items, block
        # hashes (``hashed``'s, once checked to be this prompt's) and chain state after them.
        raw, items = self._check_new(request_id, prompt_tokens, mm_items, priority)
        root = self._root(lora_id, lora_name, cache_salt)
        if hashed is None:
            hashes, chain = self._hash_blocks(root, raw, 0, items)
            return raw, items, hashes, chain
        if type(hashed) is HashedPrompt and not items and hashed.root == root and hashed.raw == raw:
            return raw, items, list(hashed.hashes), hashed.chain
        raise RequestError(
            "hashed is not this prompt's hash_prompt() result (other tokens, LoRA or salt "
            "scope, hasher, or multimodal items given)"
        )

    def _new_request(
        self,
        request_id: str,
        items: tuple[MmItem, ...],
        *,
        lora_id: int | None,
        lora_name: str | None,
        cache_salt: str | None,
        priority: int,
    ) -> RequestState:
        req = RequestState(
            request_id,
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=cache_salt,
            mm_items=items,
            priority=priority,
        )
        if self._recorder.enabled and not (
            lora_id is None
            and lora_name is None
            and cache_salt is None
            and priority == PRIORITY_DEFAULT
        ):  # (else the defaults: no extra stored-event arguments)
            extra: dict[str, Any] = {
                "lora_id": lora_id,
                "lora_name": lora_name,
                "cache_salt": cache_salt,
                "priority": None if priority == PRIORITY_DEFAULT else priority,
            }
            req.event_extra = {k: v for k, v in extra.items() if v is not None}
        return req

    def _admit_plain(
        self, req: RequestState, raw: bytes, hashes: list[bytes], chain: ChainState
    ) -> PrefixMatch:
        # _admit in the common case: one full-attention group, GPU only, no multimodal items,
        # not importing. The same plan (plan_full), checks, changes, events and counters,
        # without the per-group lists, Plan objects and loops of the general path
        # (tests/test_cache_plain_admit.py runs both on the same operations).
        tpb = self._tpb
        pool = self._pools[0]
        n = len(raw) >> 2
        nb = -(-n // tpb)
        k, table, pins = plan_full(pool.tree.lookup(hashes), (n - 1) // tpb)
        free = pool.num_free
        if nb + len(pins) > free:  # (else it fits whatever the hits' references: no count)
            cost = full_cost(nb, table, pins)
            if cost > free:
                self._rejected += 1
                raise CacheFullError(req.request_id, 0, cost, free)
        if k:
            pool.touch_many(table)  # the hits, the table's first k positions
        if pins:
            pool.touch_many(pins.values())
        table += pool.allocate_many(nb - k)
        req.groups.append(GroupState(table, k * tpb, 0, pins))
        nh = len(hashes)
        if nh > k:
            self._commit(
                req=req, gid=0, table=table, hashes=hashes, tokens=raw, lo=k, hi=nh, tokens_base=0
            )
        req.num_tokens = n
        req.token_parts.append(raw)
        req.tail = raw[nh * tpb * 4 :]
        req.chain = chain
        req.hashes = hashes
        self._requests[req.request_id] = req
        self._added += 1
        self._prompt_tokens += n
        self._reusable_tokens += k * tpb
        self._hit_blocks[0] += k
        self._queried_blocks[0] += nh
        group = self._plain_matches.get(k)
        if group is None:  # (immutable: one per boundary, built once)
            group = self._plain_matches[k] = GroupMatch(0, k * tpb, k, 0)
        return PrefixMatch(n, (group,))

    def _admit(
        self,
        req: RequestState,
        raw: bytes,
        hashes: list[bytes],
        chain: ChainState,
        *,
        importing: bool,
    ) -> tuple[list[Plan], PrefixMatch]:
        # Plan every group, stage disk hits, then take hits, onboard lower-tier blocks,
        # allocate the rest and (unless importing) commit the full blocks.
        request_id = req.request_id
        n = len(raw) >> 2
        tpb = self._tpb
        planner = plan_import if importing else plan_prompt
        tiers = self._tiers
        pools = self._pools
        while True:
            if tiers is None:
                plans = [
                    planner(pool, w, tokens_per_block=tpb, hashes=hashes, n=n)
                    for pool, w in zip(pools, self._windows, strict=True)
                ]
            else:
                plans = [
                    planner(
                        pool,
                        w,
                        tokens_per_block=tpb,
                        hashes=hashes,
                        n=n,
                        lower=partial(tiers.level_of, gid),
                    )
                    for gid, (pool, w) in enumerate(zip(pools, self._windows, strict=True))
                ]
            for gid, plan in enumerate(plans):
                if plan.cost > pools[gid].num_free:
                    self._rejected += 1
                    raise CacheFullError(request_id, gid, plan.cost, pools[gid].num_free)
            if tiers is None:
                staged: dict[tuple[int, int], Any] = {}
                break
            staged_disk = self._stage_disk_hits(plans)
            if staged_disk is not None:
                staged = staged_disk
                break

        nb = -(-n // tpb)
        for gid, plan in enumerate(plans):
            pool = pools[gid]
            hits = plan.hits
            pool.touch_many(hits)
            if plan.pins:
                pool.touch_many(plan.pins.values())
            if not plan.onboard:
                fresh = pool.allocate_many(nb - max(plan.k, plan.first))
                table: list[Block | None] = [None] * plan.first
                table += hits
                table += fresh
            else:
                slots = {}
                if tiers is not None:  # out of the host tier before an eviction can reuse them
                    slots = {i: tiers.take_host(gid, h) for i, h, lv in plan.onboard if lv == HOST}
                fresh = pool.allocate_many(nb - max(plan.k, plan.first) + len(plan.onboard))
                onboarded = iter(self._onboard_targets(plan, fresh[: len(plan.onboard)], slots))
                table = [None] * plan.first
                table += [b if b is not None else next(onboarded) for b in hits]
                table += fresh[len(plan.onboard) :]
                self._onboard(
                    req=req,
                    gid=gid,
                    plan=plan,
                    table=table,
                    hashes=hashes,
                    raw=raw,
                    slots=slots,
                    staged=staged,
                )
            req.groups.append(GroupState(table, plan.k * tpb, plan.first, plan.pins))
            if not importing:
                self._commit(
                    req=req,
                    gid=gid,
                    table=table,
                    hashes=hashes,
                    tokens=raw,
                    lo=plan.k,
                    hi=len(hashes),
                    tokens_base=0,
                )
        req.num_tokens = n
        req.token_parts.append(raw)
        req.tail = raw[len(hashes) * tpb * 4 :]
        req.chain = chain
        req.hashes = hashes
        self._requests[request_id] = req
        match = self._match_of(n, plans)
        self._added += 1
        self._prompt_tokens += n
        self._reusable_tokens += match.reusable_tokens
        for gid, plan in enumerate(plans):
            self._hit_blocks[gid] += plan.k
            self._queried_blocks[gid] += len(hashes)
        return plans, match

    @staticmethod
    def _onboard_targets(plan: Plan, blocks: list[Block], slots: dict[int, int]) -> list[Block]:
        # Which fresh block each onboarded position gets (any assignment is correct): block
        # ids in the order of the host slots they are copied from, so consecutive slots land
        # in consecutive blocks and copy_blocks moves them with one copy per run.
        if len(slots) < 2:
            return blocks
        order = sorted(range(len(blocks)), key=lambda j: slots.get(plan.onboard[j][0], -1))
        by_id = sorted(blocks, key=lambda b: b.block_id)
        out = list(blocks)
        for rank, j in enumerate(order):
            out[j] = by_id[rank]
        return out

    def _stage_disk_hits(self, plans: list[Plan]) -> dict[tuple[int, int], Any] | None:
        # Read every planned disk hit ahead of any change; None (after forgetting the bad
        # blocks) when one was missing or corrupt, so the caller plans again.
        staged: dict[tuple[int, int], Any] = {}
        tiers = self._tiers
        if tiers is None:
            return staged
        for gid, plan in enumerate(plans):
            for i, h, level in plan.onboard:
                if level != DISK:
                    continue
                t = tiers.stage(gid, h)
                if t is None:
                    for (g, _), held in staged.items():
                        tiers.unstage(g, held)
                    return None
                staged[gid, i] = t
        return staged

    def _onboard(
        self,
        *,
        req: RequestState,
        gid: int,
        plan: Plan,
        table: list[Block | None],
        hashes: list[bytes],
        raw: bytes,
        slots: dict[int, int],
        staged: dict[tuple[int, int], Any],
    ) -> None:
        # Commit the blocks onboarded from lower tiers (position order, so parents first),
        # copy their K/V in, and announce those this manager had never announced.
        tiers = self._tiers
        assert tiers is not None
        pool = self._pools[gid]
        moves = []
        for i, h, level in plan.onboard:
            block = self._held(table, i, gid)
            pool.commit(block, h, hashes[i - 1] if i else None)
            moves.append((block, h, level, slots[i] if level == HOST else staged[gid, i]))
        known = tiers.onboard(gid, moves)
        rec = self._recorder
        if not rec.enabled or all(known):
            return
        step = 4 * self._tpb
        for (i, h, _), was_known in zip(plan.onboard, known, strict=True):
            if not was_known:
                rec.stored(
                    gid,
                    parent_hash=hashes[i - 1] if i else None,
                    block_hash=h,
                    token_ids=TokenIds.from_bytes(raw[i * step : (i + 1) * step]),
                    mm_keys=self._mm_keys(req, i),
                    **req.event_extra,
                )

    def append_tokens(self, request_id: str, tokens: Any) -> int:
        """Append generated tokens to a running request; returns how many blocks filled.

        First, each sliding-window group releases the request's blocks that the next token's
        window no longer covers (the K/V of every token so far is taken to be computed). Then
        blocks are allocated as needed and every block that became full is committed
        (``stored`` events). CacheFullError (nothing changed) when a pool cannot serve it.
        """
        req = self._get(request_id)
        if req.importing is not None:
            raise RequestError(f"request {request_id!r} is still importing its K/V")
        try:
            raw = coerce_tokens(tokens, "tokens")
        except HashingError as exc:
            raise RequestError(str(exc)) from None
        m = len(raw) >> 2
        if not m:
            return 0
        if self._plain:
            return self._append_plain(req, raw)
        tpb = self._tpb
        s = req.num_tokens
        total = s + m
        swa = self._swa
        if s % tpb > 0 and s % tpb + m < tpb:  # fast path: stays inside the tail block
            windows = self._windows
            groups = req.groups
            if not any(first_needed_block(s, windows[g], tpb) > groups[g].released for g in swa):
                req.tail += raw
                req.token_parts.append(raw)
                req.num_tokens = total
                return 0

        done = len(req.hashes)
        pending = req.tail + raw
        assert req.chain is not None
        hashes, chain = self._hash_blocks(req.chain, pending, done, req.mm_items)
        nb_before = -(-s // tpb)
        new_blocks = -(-total // tpb) - nb_before
        plans: list[Plan] = []
        for gid, pool in enumerate(self._pools):
            plan = plan_append(
                pool,
                self._windows[gid],
                tokens_per_block=tpb,
                gs=req.groups[gid],
                num_tokens=s,
                hashes=hashes,
                new_blocks=new_blocks,
            )
            if plan.cost > pool.num_free + plan.frees:
                self._rejected += 1
                raise CacheFullError(request_id, gid, plan.cost, pool.num_free + plan.frees)
            plans.append(plan)

        filled = len(hashes)
        req.hashes += hashes
        for gid, plan in enumerate(plans):
            pool = self._pools[gid]
            gs = req.groups[gid]
            if plan.release_to > gs.released:
                for i in range(plan.release_to - 1, gs.released - 1, -1):
                    b = gs.blocks[i]
                    if b is not None:
                        pool.release(b)
                        gs.blocks[i] = None
                gs.released = plan.release_to
            for b in plan.pins.values():
                pool.touch(b)
            if plan.pins:
                gs.pins.update(plan.pins)
            if new_blocks:
                gs.blocks += pool.allocate_many(new_blocks)
            self._commit_appended(req, gid, pending, done, filled)
        return self._appended(req, raw, pending, filled, chain)

    def _append_plain(self, req: RequestState, raw: bytes) -> int:
        # append_tokens for one full-attention group on the GPU alone (nothing leaves a
        # window): the same plan (plan_append), checks, changes and events as the general
        # path, without its per-group loops (tests/test_cache_plain_admit.py runs both).
        tpb = self._tpb
        s = req.num_tokens
        total = s + (len(raw) >> 2)
        new_blocks = -(-total // tpb) + s // -tpb  # (blocks after) - (blocks before)
        done = len(req.hashes)
        if not new_blocks and total // tpb == done:  # stays inside the tail block
            req.tail += raw
            req.token_parts.append(raw)
            req.num_tokens = total
            return 0
        pending = req.tail + raw
        assert req.chain is not None
        hashes, chain = self._hash_blocks(req.chain, pending, done, req.mm_items)
        pool = self._pools[0]
        gs = req.groups[0]
        plan = plan_append(
            pool,
            None,
            tokens_per_block=tpb,
            gs=gs,
            num_tokens=s,
            hashes=hashes,
            new_blocks=new_blocks,
        )
        if plan.cost > pool.num_free:
            self._rejected += 1
            raise CacheFullError(req.request_id, 0, plan.cost, pool.num_free)
        filled = len(hashes)
        req.hashes += hashes
        pins = plan.pins
        if pins:
            pool.touch_many(pins.values())
            gs.pins.update(pins)
        if new_blocks:
            gs.blocks += pool.allocate_many(new_blocks)
        if filled:
            self._commit_appended(req, 0, pending, done, filled)
        return self._appended(req, raw, pending, filled, chain)

    def _commit_appended(
        self,
        req: RequestState,
        gid: int,
        pending: bytes,
        done: int,
        filled: int,
    ) -> None:
        # commit the `filled` blocks an append completed after the `done` committed ones
        # (`req.hashes` holds theirs already; `pending` is their tokens)
        self._commit(
            req=req,
            gid=gid,
            table=req.groups[gid].blocks,
            hashes=req.hashes,
            tokens=pending,
            lo=done,
            hi=done + filled,
            tokens_base=done,
        )

    def _appended(
        self, req: RequestState, raw: bytes, pending: bytes, filled: int, chain: ChainState
    ) -> int:
        # an append's bookkeeping once its blocks are committed; returns `filled`
        req.num_tokens += len(raw) >> 2
        req.token_parts.append(raw)
        req.tail = pending[filled * self._tpb * 4 :]
        req.chain = chain
        return filled

    def free_request(self, request_id: str) -> None:
        """Finish a request: release its blocks, last position first (so descendants become
        evictable before their ancestors). Committed blocks stay cached until evicted."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(request_id)
        for gid, gs in enumerate(req.groups):
            pool = self._pools[gid]
            pins = gs.pins
            blocks = gs.blocks
            if not pins:
                pool.release_many(reversed(blocks[gs.released :] if gs.released else blocks))
                continue
            for i in range(len(blocks) - 1, gs.released - 1, -1):
                b = blocks[i]
                if b is not None:
                    pool.release(b)
                if pins:
                    p = pins.get(i)
                    if p is not None:
                        pool.release(p)

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

    # ------------------------------------------------------------------ transfer

    def export_kv(
        self,
        request_id: str,
        start: int = 0,
        end: int | None = None,
        *,
        ranges: Mapping[int, TokenRange] | None = None,
    ) -> KVTransfer:
        """The K/V of a running request's positions ``[start, end)`` (default: all of them),
        as whole blocks per layer group, to give to another manager's :meth:`finish_import`.

        ``ranges`` (an :class:`ImportTicket`'s) replaces ``start``/``end`` per group and
        exports only the groups it names; all its ranges must end at the same position. A
        sliding-window group exports only the window that position needs. TransferError
        when positions are outside the request or left the group's window here.
        """
        req = self._get(request_id)
        if req.importing is not None:
            raise TransferError(f"request {request_id!r} is still importing its K/V")
        tpb = self._tpb
        if ranges is None:
            stop = req.num_tokens if end is None else end
            span = TokenRange(start, stop)
            wanted = dict.fromkeys(range(len(self._pools)), span)
        else:
            wanted = {self._gid(g): r for g, r in ranges.items()}
            ends = {r.end for r in wanted.values()}
            if len(ends) > 1:
                raise TransferError(f"ranges end at different positions: {sorted(ends)}")
            stop = ends.pop() if ends else req.num_tokens
        if stop > req.num_tokens:
            raise TransferError(
                f"positions up to {stop} requested but request {request_id!r} has "
                f"{req.num_tokens} tokens"
            )
        groups = []
        for gid, span in sorted(wanted.items()):
            gs = req.groups[gid]
            first = max(span.start // tpb, first_needed_block(stop, self._windows[gid], tpb))
            last = -(-stop // tpb)
            if first < last and first < gs.released:
                raise TransferError(
                    f"positions before {gs.released * tpb} of request {request_id!r} left layer "
                    f"group {gid}'s sliding window here and cannot be exported"
                )
            ids = [self._held(gs.blocks, i, gid).block_id for i in range(first, last)]
            kv = None
            if self._storage is not None and ids:
                kv = self._storage.tensors[gid][ids]
            hashes = tuple(
                req.hashes[i] if (i + 1) * tpb <= stop else None for i in range(first, last)
            )
            groups.append(
                GroupTransfer(gid, TokenRange(min(first * tpb, stop), stop), first, hashes, kv)
            )
        return KVTransfer(
            request_id=request_id,
            layout=self.config.layout_fingerprint(),
            token_ids=req.token_bytes()[: 4 * stop],
            groups=tuple(groups),
            lora_id=req.lora_id,
            lora_name=req.lora_name,
            cache_salt=req.cache_salt,
            priority=req.priority,
            mm_items=req.mm_items,
        )

    def begin_import(
        self,
        request_id: str,
        prompt_tokens: Any,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_items: Iterable[MmItem | tuple[bytes, int, int]] = (),
        priority: int = PRIORITY_DEFAULT,
    ) -> ImportTicket:
        """Start a request whose K/V another manager computed: reuse this manager's own
        cached prefix per layer group (host and disk tiers included), reserve blocks for the
        rest and return the :class:`ImportTicket` naming, per group, the token range to
        receive. Arguments and errors as :meth:`add_request` (CacheFullError: nothing
        changed). Blocks are committed (``stored`` events) only by :meth:`finish_import`;
        until then the request cannot append tokens or be exported."""
        raw, items, hashes, chain = self._check_hashed(
            request_id,
            prompt_tokens,
            mm_items,
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=cache_salt,
            priority=priority,
            hashed=None,
        )
        req = self._new_request(
            request_id,
            items,
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=cache_salt,
            priority=priority,
        )
        plans, match = self._admit(req, raw, hashes, chain, importing=True)
        n = req.num_tokens
        req.importing = [max(p.k, p.first) for p in plans]
        ranges = {gid: TokenRange(min(b * self._tpb, n), n) for gid, b in enumerate(req.importing)}
        return ImportTicket(request_id, ranges, match)

    def finish_import(self, request_id: str, transfer: KVTransfer) -> ImportResult:
        """Write the received K/V into the request's reserved blocks and commit them: a
        ``stored`` event for exactly the blocks this manager did not have.

        TransferError, changing nothing (the request stays importing), when the transfer's
        layout, tokens or block hashes differ from this request's, it lacks blocks the
        ticket asked for, or its tensors have the wrong shape or dtype.
        """
        req = self._get(request_id)
        need = req.importing
        if need is None:
            raise RequestError(f"request {request_id!r} is not importing")
        parts = self._check_transfer(req, need, transfer)
        tpb = self._tpb
        nb = -(-req.num_tokens // tpb)
        received: list[int] = []
        nbytes = 0
        for gid, gt in enumerate(parts):
            gs = req.groups[gid]
            lo = need[gid]
            received.append(nb - lo)
            if self._storage is not None and gt is not None and gt.kv is not None and lo < nb:
                dst = [self._held(gs.blocks, i, gid).block_id for i in range(lo, nb)]
                rows = list(range(lo - gt.first_block, nb - gt.first_block))
                kv = gt.kv.to(self._storage.device)
                copy_blocks(self._storage.tensors[gid], dst, kv, rows)
                nbytes += len(rows) * kv[0].numel() * kv.element_size()
            if self._windows[gid] is None:  # blocks another request committed meanwhile
                pool = self._pools[gid]
                for i in range(lo, len(req.hashes)):
                    b = pool.tree.get(req.hashes[i])
                    if b is not None and b is not gs.blocks[i] and i not in gs.pins:
                        pool.touch(b)
                        gs.pins[i] = b
            self._commit(
                req=req,
                gid=gid,
                table=gs.blocks,
                hashes=req.hashes,
                tokens=req.token_bytes(),
                lo=lo,
                hi=len(req.hashes),
                tokens_base=0,
            )
        req.importing = None
        return ImportResult(request_id, tuple(received), nbytes)

    def abort_import(self, request_id: str) -> None:
        """Give up an import: free the request (its reused blocks stay cached)."""
        self.free_request(request_id)

    def import_kv(self, request_id: str, transfer: KVTransfer) -> ImportResult:
        """:meth:`begin_import` from the transfer's own request, then :meth:`finish_import`:
        for a transfer that already covers whatever this manager lacks (e.g. a full export).
        The layout is checked before anything changes; if the transfer is refused after
        that (missing blocks, other hashes or tensors), the import is aborted and the
        TransferError raised."""
        if transfer.layout != self.config.layout_fingerprint():
            raise TransferError(self._layout_mismatch(transfer))
        self.begin_import(
            request_id,
            transfer.tokens,
            lora_id=transfer.lora_id,
            lora_name=transfer.lora_name,
            cache_salt=transfer.cache_salt,
            mm_items=transfer.mm_items,
            priority=transfer.priority,
        )
        try:
            return self.finish_import(request_id, transfer)
        except BaseException:
            self.abort_import(request_id)
            raise

    def _layout_mismatch(self, transfer: KVTransfer) -> str:
        return (
            f"transfer layout {transfer.layout} differs from this manager's "
            f"{self.config.layout_fingerprint()} (tokens_per_block, hash configuration or "
            "layer groups differ)"
        )

    def _check_transfer(
        self, req: RequestState, need: list[int], transfer: KVTransfer
    ) -> list[GroupTransfer | None]:
        if not isinstance(transfer, KVTransfer):
            raise TransferError(f"expected a KVTransfer, got {type(transfer).__name__}")
        if transfer.layout != self.config.layout_fingerprint():
            raise TransferError(self._layout_mismatch(transfer))
        if transfer.token_ids != req.token_bytes():
            raise TransferError(
                f"transfer carries {transfer.num_tokens} tokens that differ from request "
                f"{req.request_id!r}'s {req.num_tokens}"
            )
        tpb = self._tpb
        nb = -(-req.num_tokens // tpb)
        parts: list[GroupTransfer | None] = []
        for gid, lo in enumerate(need):
            gt = transfer.group(gid)
            parts.append(gt)
            if lo >= nb:
                continue
            if gt is None:
                raise TransferError(f"transfer has no blocks for layer group {gid}")
            if gt.first_block > lo or gt.first_block + gt.num_blocks < nb:
                raise TransferError(
                    f"layer group {gid}: transfer carries blocks [{gt.first_block}, "
                    f"{gt.first_block + gt.num_blocks}) but blocks [{lo}, {nb}) are needed"
                )
            for i in range(lo, nb):
                want = req.hashes[i] if i < len(req.hashes) else None
                if gt.block_hashes[i - gt.first_block] != want:
                    raise TransferError(
                        f"layer group {gid}: block {i}'s hash differs from the one its tokens "
                        "give here (another hash configuration, adapter, salt or item)"
                    )
            if self._storage is None:
                continue
            if gt.kv is None:
                raise TransferError(f"layer group {gid}: transfer has no K/V (metadata-only)")
            t = self._storage.tensors[gid]
            want_shape = (gt.num_blocks, *t.shape[1:])
            if tuple(gt.kv.shape) != want_shape or gt.kv.dtype != t.dtype:
                raise TransferError(
                    f"layer group {gid}: K/V is {tuple(gt.kv.shape)} {gt.kv.dtype}, expected "
                    f"{want_shape} {t.dtype}"
                )
        return parts

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

    # ------------------------------------------------------------------ K/V

    def write_kv(
        self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor, *, start: int = 0
    ) -> None:
        """Store the K and V (``[n, num_kv_heads, head_dim]`` each) of global layer ``layer``
        for the request's positions ``[start, start + n)``.

        The positions must be appended already, at or after the group's reuse boundary (the
        reused prefix is shared and read-only) and not released by a sliding window.
        Tensors are converted to the pool's dtype and device. KVAccessError otherwise.
        """
        storage = self._need_storage()
        req = self._get(request_id)
        if req.importing is not None:
            raise KVAccessError(f"request {request_id!r} is still importing its K/V")
        gid, local = self.layer_location(layer)
        spec = self.config.groups[gid]
        gs = req.groups[gid]
        shape = (spec.num_kv_heads, spec.head_dim)
        if k.dim() != 3 or tuple(k.shape[1:]) != shape or k.shape != v.shape:
            raise KVAccessError(
                f"k and v must both be [n, {shape[0]}, {shape[1]}], got {tuple(k.shape)} and "
                f"{tuple(v.shape)}"
            )
        n = int(k.shape[0])
        self._check_range(req, gid, start, start + n)
        if start < gs.boundary:
            raise KVAccessError(
                f"positions [{start}, {min(start + n, gs.boundary)}) of layer group {gid} are "
                "reused from the cache and read-only"
            )
        if n:
            storage.write(
                gid,
                self._ids(gs, start, start + n),
                layer=local,
                offset=start % self._tpb,
                k=k,
                v=v,
            )

    def read_kv(
        self, request_id: str, layer: int, *, start: int | None = None, end: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V (``[end - start, num_kv_heads, head_dim]``) of global layer
        ``layer`` for the request's positions ``[start, end)``.

        Defaults: ``end`` = the request's token count; ``start`` = its first held position
        (0, or for a sliding-window group the first position it has not released).
        """
        storage = self._need_storage()
        req = self._get(request_id)
        gid, local = self.layer_location(layer)
        gs = req.groups[gid]
        lo = gs.released * self._tpb if start is None else start
        hi = req.num_tokens if end is None else end
        self._check_range(req, gid, lo, hi)
        if hi == lo:
            spec = self.config.groups[gid]
            t = storage.tensors[gid]
            empty = t.new_empty((0, spec.num_kv_heads, spec.head_dim))
            return empty, empty.clone()
        return storage.read(
            gid, self._ids(gs, lo, hi), layer=local, offset=lo % self._tpb, n=hi - lo
        )

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

    # ------------------------------------------------------------------ internals

    def _get(self, request_id: str) -> RequestState:
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id)
        return req

    def _gid(self, layer_group_id: int) -> int:
        if (
            isinstance(layer_group_id, bool)
            or not isinstance(layer_group_id, int)
            or not 0 <= layer_group_id < len(self._pools)
        ):
            raise KVAccessError(
                f"layer_group_id must be in 0..{len(self._pools) - 1}, got {layer_group_id!r}"
            )
        return layer_group_id

    def _need_storage(self) -> KVStorage:
        if self._storage is None:
            raise KVAccessError("this manager is metadata-only: it holds no K/V tensors")
        return self._storage

    def _check_range(self, req: RequestState, gid: int, lo: int, hi: int) -> None:
        for name, v in (("start", lo), ("end", hi)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise KVAccessError(f"{name} must be an int, got {v!r}")
        if not 0 <= lo <= hi <= req.num_tokens:
            raise KVAccessError(
                f"positions [{lo}, {hi}) are outside request {req.request_id!r}'s "
                f"{req.num_tokens} tokens"
            )
        released = req.groups[gid].released * self._tpb
        if lo < released and hi > lo:
            raise KVAccessError(
                f"positions before {released} of request {req.request_id!r} left layer group "
                f"{gid}'s sliding window and were released"
            )

    def _ids(self, gs: GroupState, lo: int, hi: int) -> list[int]:
        tpb = self._tpb
        out: list[int] = []
        for b in gs.blocks[lo // tpb : (hi - 1) // tpb + 1]:
            if b is None:  # excluded by _check_range
                raise CacheInvariantError("a held position has no block")
            out.append(b.block_id)
        return out

    def _check_prompt(
        self, prompt_tokens: Any, mm_items: Iterable[Any]
    ) -> tuple[bytes, tuple[MmItem, ...]]:
        try:
            raw = coerce_tokens(prompt_tokens, "prompt_tokens")
        except HashingError as exc:
            raise RequestError(str(exc)) from None
        if not raw:
            raise RequestError("a request needs at least one prompt token")
        return raw, normalize_mm_items(mm_items, len(raw) >> 2) if mm_items else ()

    def _root(
        self, lora_id: int | None, lora_name: str | None, cache_salt: str | None
    ) -> ChainState:
        if lora_id is None and lora_name is None and cache_salt is None:
            # every request without a scope starts here: computed once (a root is a pure
            # function of the hasher and the scope, and ChainState is immutable)
            root = self._plain_root
            if root is None:
                root = self._plain_root = self._hasher.root()
            return root
        return self._hasher.root(lora_id=lora_id, cache_salt=cache_salt, lora_name=lora_name)

    def _hash_blocks(
        self, chain: ChainState, raw: bytes, first_index: int, items: tuple[MmItem, ...]
    ) -> tuple[list[bytes], ChainState]:
        # Hash the full blocks of `raw` (whose first block is the request's block
        # `first_index`); returns their hashes and the new state.
        step = 4 * self._tpb
        n = len(raw) // step
        if not items:
            # the whole-request chain (in C for the BLAKE3/SHA-256 algorithms), equal to
            # folding extend() over the blocks; its last chain key resumes the state
            if not n:
                return [], chain
            hasher = self._hasher
            out, resume_at = hasher.chain_raw(chain, raw, self._tpb, every=n)
            return out, hasher.resume(chain, resume_at[-1], chain.depth + n)
        extend = self._hasher.extend
        hashes: list[bytes] = []
        for j in range(n):
            blk = TokenIds.from_bytes(raw[j * step : (j + 1) * step])
            keys = block_mm_keys(items, first_index + j, self._tpb)
            h, chain = extend(chain, blk, [(m.digest, off) for m, off in keys])
            hashes.append(h)
        return hashes, chain

    def _match_of(self, n: int, plans: Sequence[Plan]) -> PrefixMatch:
        tpb = self._tpb
        if len(plans) == 1:
            p = plans[0]
            return PrefixMatch(n, (GroupMatch(0, p.k * tpb, len(p.hits), len(p.onboard)),))
        return PrefixMatch(
            n,
            tuple(
                GroupMatch(gid, p.k * tpb, len(p.hits), len(p.onboard))
                for gid, p in enumerate(plans)
            ),
        )

    def _mm_keys(self, req: RequestState, index: int) -> tuple[MmKey, ...]:
        items = req.mm_items
        if not items:
            return ()
        return tuple(
            MmKey(hash=m.digest, start_offset=off, uuid=m.uuid)
            for m, off in block_mm_keys(items, index, self._tpb)
        )

    def _commit(
        self,
        *,
        req: RequestState,
        gid: int,
        table: list[Block | None],
        hashes: list[bytes],
        tokens: bytes,
        lo: int,
        hi: int,
        tokens_base: int,
    ) -> None:
        # Commit the request's full positions [lo, hi) of group `gid`: hashes[i] is position
        # i's hash; `tokens` are the packed tokens of positions tokens_base.. (for the events).
        # A hash already committed is a duplicate: pinned (full attention) or left
        # uncommitted. With tiers, a block this manager holds below the GPU is promoted
        # (``updated`` level -> 0: it was announced already) instead of stored, and with
        # write-through every committed block is queued for the disk.
        pool = self._pools[gid]
        by_hash = pool.tree
        commit = pool.commit
        rec = self._recorder
        tiers = self._tiers
        skipped: list[int] = []  # positions that get no stored event
        promoted: dict[int, int] = {}  # position -> the lower level it came up from
        if tiers is None:
            skipped = by_hash.insert_run(table, hashes, lo, hi)
        else:
            for i in range(lo, hi):
                h = hashes[i]
                if h in by_hash:
                    skipped.append(i)
                    continue
                block = self._held(table, i, gid)
                commit(block, h, hashes[i - 1] if i else None)
                if tiers.write_through:
                    tiers.queue_persist(gid, block, h)
                level = tiers.claim(gid, h)
                if level:
                    skipped.append(i)
                    promoted[i] = level
        if not rec.enabled:
            return
        step = 4 * self._tpb
        extra = req.event_extra
        if req.mm_items:  # per-block multimodal keys: one stored() per block
            gone = set(skipped)
            for i in range(lo, hi):
                if i in promoted:
                    rec.updated(gid, hashes[i], cache_level=(promoted[i], GPU))
                elif i not in gone:
                    at = (i - tokens_base) * step
                    rec.stored(
                        gid,
                        parent_hash=hashes[i - 1] if i else None,
                        block_hash=hashes[i],
                        token_ids=TokenIds.from_bytes(tokens[at : at + step]),
                        mm_keys=self._mm_keys(req, i),
                        **extra,
                    )
            return
        # Record each run of consecutive stored positions with one stored_chain() call
        # (usually the whole range: a duplicate or a promotion splits it).
        start = lo
        for end in (*skipped, hi):
            if end > start:
                parent = hashes[start - 1] if start else None
                packed = TokenIds.from_bytes(
                    tokens[(start - tokens_base) * step : (end - tokens_base) * step]
                )
                if end - start == 1:  # a decode step: the single-block call is cheaper
                    rec.stored(
                        gid, parent_hash=parent, block_hash=hashes[start], token_ids=packed, **extra
                    )
                else:
                    rec.stored_chain(
                        gid,
                        parent_hash=parent,
                        block_hashes=hashes[start:end],
                        token_ids=packed,
                        **extra,
                    )
            if end in promoted:
                rec.updated(gid, hashes[end], cache_level=(promoted[end], GPU))
            start = end + 1

    @staticmethod
    def _held(table: list[Block | None], i: int, gid: int) -> Block:
        b = table[i]
        if b is None:
            raise CacheInvariantError(f"position {i} of group {gid} has no block to commit")
        return b

"""Admitting requests: :class:`Admission`, the role of
:class:`~kvstream.cache.manager.KVCacheManager` that hashes a prompt once
(:class:`HashedPrompt`), matches its longest cached prefix per layer group, plans what every
pool must give (all or nothing: :class:`~kvstream.cache.errors.CacheFullError` changes
nothing), onboards hits from the host and disk tiers and commits the prompt's full blocks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvstream._types import PRIORITY_DEFAULT, PRIORITY_MAX, PRIORITY_MIN, TokenIds
from kvstream.cache.block import Block
from kvstream.cache.commit import Commit
from kvstream.cache.errors import CacheFullError, DuplicateRequestError, RequestError
from kvstream.cache.plan import Plan, full_cost, plan_full, plan_import, plan_prompt
from kvstream.cache.request import GroupMatch, GroupState, MmItem, PrefixMatch, RequestState
from kvstream.cache.tiering import DISK, HOST
from kvstream.hashing import ChainState

__all__ = ["Admission", "HashedPrompt"]


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


class Admission(Commit):
    """Prefix matching and admission (see the module docstring)."""

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

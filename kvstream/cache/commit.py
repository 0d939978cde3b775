"""Committing and releasing blocks: :class:`Commit`, the role of
:class:`~kvstream.cache.manager.KVCacheManager` that registers a request's full blocks
(``stored`` events, duplicates held rather than committed twice), appends decode tokens
(sliding-window groups releasing what falls out of the window) and frees a request's blocks
last position first (leaf-first eviction order)."""

from __future__ import annotations

from typing import Any

from kvstream._types import TokenIds
from kvstream.cache.block import Block
from kvstream.cache.errors import CacheFullError, RequestError, UnknownRequestError
from kvstream.cache.manager_state import ManagerState
from kvstream.cache.plan import Plan, plan_append
from kvstream.cache.request import RequestState
from kvstream.cache.tiering import GPU
from kvstream.cache.windows import first_needed_block
from kvstream.errors import HashingError
from kvstream.hashing import ChainState
from kvstream.hashing.blocks import coerce_tokens

__all__ = ["Commit"]


class Commit(ManagerState):
    """Commit, append and release (see the module docstring)."""

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
        trusted = None if extra else self._trusted_chain
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
                if trusted is not None:
                    trusted(gid, parent, hashes[start:end], packed)
                elif end - start == 1:  # a decode step: the single-block call is cheaper
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

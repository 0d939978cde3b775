"""A bounded LRU of requests' chain hashes, so a recurring prefix (a system prompt) is hashed once.

:meth:`PrefixCache.chain` returns what ``hasher.chain_raw(root, raw, tokens_per_block)`` returns
(the published hashes of the request's full blocks), reusing the chain of the longest cached
request that shares a prefix with this one and hashing only the rest.

How: the request's token bytes are cut into checkpoints of ``every`` blocks (``every`` =
``checkpoint_tokens // tokens_per_block``, at least 1). Each cached request is indexed under the
fingerprint of its token bytes up to each of its checkpoints, per context ``(hasher, block
size, root chain state)`` (the root state holds the algorithm's parameters that shape its
chain, e.g. vLLM's seed, and the request scope: LoRA, salt). A lookup fingerprints the new
request at its checkpoints, finds the longest indexed one, **confirms it by comparing the
token bytes** (a fingerprint is a filter, never trusted), takes the cached hashes up to there
and resumes the chain from the cached key (:meth:`BlockHasher.resume`). The result is then
cached in its turn, so a prefix stays cached while requests keep using it (a multi-turn
conversation reuses its whole previous turn). Admission: a request that shares no cached
prefix is cached only once its first checkpoint has been seen before (it recurs), so one-off
requests pay a fingerprint pass and a set lookup, not an insertion and an eviction.

Memory bound: the cache holds at most ``max_bytes`` of accounted memory: per request its token
bytes (4 per token) and published hashes (the width per block), per checkpoint 200 bytes (its
index entry and chain key). An 8k-token request
with 32-token blocks costs about 40 KiB, so the default 32 MiB keeps ~800 of them; the
admission filter adds at most 65,536 fingerprints (~4 MiB). A request
larger than ``max_bytes`` is hashed without being cached. Thread-safe (one lock).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Final

from kvstream.errors import HashingError
from kvstream.hashing.accel import fingerprints, same_prefix, split
from kvstream.hashing.base import BlockHasher, ChainState

__all__ = ["DEFAULT_CHECKPOINT_TOKENS", "DEFAULT_MAX_BYTES", "PrefixCache", "PrefixCacheStats"]

#: Default bound of a cache's accounted memory.
DEFAULT_MAX_BYTES: Final = 32 << 20
#: Default distance between checkpoints, in tokens (rounded down to whole blocks).
DEFAULT_CHECKPOINT_TOKENS: Final = 512
#: Bound of the admission filter (first-checkpoint fingerprints seen once; cleared when full).
_DOORKEEPER_MAX: Final = 1 << 16
_CHECKPOINT_COST: Final = 200


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counters of a :class:`PrefixCache`: requests that reused a cached prefix (``hits``) or
    not (``misses``), blocks taken from the cache (``reused_blocks``) or hashed
    (``hashed_blocks``), and the current ``entries`` and accounted ``bytes``."""

    hits: int
    misses: int
    reused_blocks: int
    hashed_blocks: int
    entries: int
    bytes: int


@dataclass(eq=False, slots=True)  # eq=False: hashed by identity (the LRU's keys)
class _Entry:
    # The published hashes as one blob (``n * width`` bytes), not n objects: a hit copies
    # them out of contiguous memory instead of touching n cold objects, and the garbage
    # collector has nothing to traverse. Tuples: untracked by the collector once seen.
    ctx: tuple[Any, ...]
    raw: bytes
    published: bytes
    width: int
    keys: tuple[Any, ...]
    fps: tuple[int, ...]
    size: int


class PrefixCache:
    """Per-prefix chain hashes of recent requests (see the module docstring).

    ``max_bytes``: bound of the accounted memory (0 disables caching: every call hashes the
    whole request). ``checkpoint_tokens``: tokens between checkpoints (the reuse granularity:
    a shared prefix is reused up to its last checkpoint, the rest is hashed).
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        checkpoint_tokens: int = DEFAULT_CHECKPOINT_TOKENS,
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise HashingError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        if (
            isinstance(checkpoint_tokens, bool)
            or not isinstance(checkpoint_tokens, int)
            or checkpoint_tokens < 1
        ):
            raise HashingError(f"checkpoint_tokens must be an int >= 1, got {checkpoint_tokens!r}")
        self.max_bytes = max_bytes
        self.checkpoint_tokens = checkpoint_tokens
        self._lock = threading.Lock()
        self._entries: OrderedDict[_Entry, None] = OrderedDict()
        # ctx -> {fingerprint of a checkpointed prefix: an entry with that prefix}; the
        # fingerprint of checkpoint k depends on k (the whole prefix is hashed), and a hit is
        # confirmed by comparing bytes, so no checkpoint number is needed in the key
        self._index: dict[tuple[Any, ...], dict[int, _Entry]] = {}
        self._bytes = 0
        # admission: a request sharing no cached prefix is cached only when its first
        # checkpoint was seen before (a prefix that recurs); one-off requests then cost a
        # set lookup instead of an insertion and an eviction
        self._seen: set[int] = set()
        self._hits = self._misses = self._reused = self._hashed = 0

    def chain_tokens(
        self,
        hasher: BlockHasher,
        root: ChainState,
        tokens: Any,
        tokens_per_block: int,
        drop_last_token: bool,
    ) -> list[bytes] | None:
        """:meth:`chain` of ``pack_request(tokens, drop_last_token)``, packed and hashed in
        one C pass when caching is off (``max_bytes`` 0) and the hasher's C chain takes the
        request; None (nothing raised, nothing counted) when it does not: the caller then
        packs and calls :meth:`chain`."""
        if self.max_bytes != 0:
            return None
        got = hasher._chain_ints(root, tokens, tokens_per_block, drop_last_token)
        if got is None:
            return None
        out = got[1]
        with self._lock:
            self._misses += 1
            self._hashed += len(out)
        return out

    def chain(
        self, hasher: BlockHasher, root: ChainState, raw: bytes, tokens_per_block: int
    ) -> list[bytes]:
        """``hasher.chain_raw(root, raw, tokens_per_block)[0]``, reusing cached prefixes.

        ``root`` must be ``hasher``'s root state of the request; ``raw`` its token ids as u32
        little-endian bytes (see :func:`kvstream.hashing.accel.pack_request`).
        """
        step = 4 * tokens_per_block
        n = len(raw) // step
        every = max(1, self.checkpoint_tokens // tokens_per_block)
        if n < every or self.max_bytes == 0:
            out, _ = hasher.chain_raw(root, raw, tokens_per_block)
            with self._lock:
                self._misses += 1
                self._hashed += len(out)
            return out
        stride = every * step
        fps = fingerprints(raw, stride, True)
        # the fingerprint of the whole request (the last checkpoint's when it ends on one)
        whole = fps.pop() if len(raw) % stride else fps[-1]
        ctx = (hasher, tokens_per_block, root)
        with self._lock:
            index = self._index.get(ctx)
            same = None if index is None else index.get(whole)
            if (
                same is not None
                and len(same.published) >= n * same.width
                and same_prefix(same.raw, raw, len(raw))
            ):
                # a request starting with all of this one was cached: no hashing at all
                self._entries.move_to_end(same)
                self._hits += 1
                self._reused += n
                return split(same.published, same.width, n)
            hit, k = self._lookup(index, raw, fps, stride)
            if hit is not None:
                # the prefix's entry stays as recent as the prefix is used: its index entries
                # serve the next request that shares it
                self._entries.move_to_end(hit)
        if hit is None:
            published, keys = hasher.chain_raw(root, raw, tokens_per_block, every=every)
        else:
            state = hasher.resume(root, hit.keys[k - 1], k * every)
            tail, tail_keys = hasher.chain_raw(
                state, raw, tokens_per_block, start=k * every, every=every
            )
            published = split(hit.published, hit.width, k * every)
            published += tail
            keys = [*hit.keys[:k], *tail_keys]
        size = len(raw) + len(published) * hasher.width
        size += len(fps) * _CHECKPOINT_COST
        entry = _Entry(
            ctx, raw, b"".join(published), hasher.width, tuple(keys), (*fps, whole), size
        )
        with self._lock:
            if hit is None:
                self._misses += 1
            else:
                self._hits += 1
                self._reused += k * every
            self._hashed += len(published) - (0 if hit is None else k * every)
            admit = hit is not None or fps[0] in self._seen
            if not admit:
                if len(self._seen) >= _DOORKEEPER_MAX:
                    self._seen.clear()
                self._seen.add(fps[0])
            elif size <= self.max_bytes:
                # the checkpoints up to the hit stay with the hit's entry (just refreshed)
                self._insert(entry, k)
        return published

    def _lookup(
        self, index: dict[int, _Entry] | None, raw: bytes, fps: list[int], stride: int
    ) -> tuple[_Entry | None, int]:
        """The cached entry sharing the longest checkpointed prefix with ``raw``, and that
        prefix in checkpoints.

        A binary search over the fingerprints (the indexed checkpoints of a request form a
        prefix of its checkpoints), then one byte comparison of the candidate; should that
        fail (a fingerprint collision), shorter checkpoints are tried one by one.
        """
        if index is None:
            return None, 0
        lo, hi = 0, len(fps)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fps[mid - 1] in index:
                lo = mid
            else:
                hi = mid - 1
        for k in range(lo, 0, -1):
            e = index.get(fps[k - 1])
            if e is not None and same_prefix(e.raw, raw, k * stride):
                return e, k
        return None, 0

    def _insert(self, e: _Entry, skip: int) -> None:
        """Add ``e``, indexed under its checkpoints after the first ``skip`` and its whole
        fingerprint (``e.fps[-1]``); evict the least recently used entries beyond the bound."""
        index = self._index.setdefault(e.ctx, {})
        index.update(zip(e.fps[skip:], repeat(e)))
        index[e.fps[-1]] = e
        self._entries[e] = None
        self._bytes += e.size
        while self._bytes > self.max_bytes:
            old, _ = self._entries.popitem(last=False)
            self._bytes -= old.size
            idx = self._index[old.ctx]
            for fp in old.fps:
                if idx.get(fp) is old:
                    del idx[fp]
            if not idx:
                del self._index[old.ctx]

    def clear(self) -> None:
        """Drop every cached request (the counters stay)."""
        with self._lock:
            self._entries.clear()
            self._index.clear()
            self._seen.clear()
            self._bytes = 0

    def stats(self) -> PrefixCacheStats:
        """The current counters (see :class:`PrefixCacheStats`)."""
        with self._lock:
            return PrefixCacheStats(
                self._hits,
                self._misses,
                self._reused,
                self._hashed,
                len(self._entries),
                self._bytes,
            )

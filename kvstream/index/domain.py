"""Hash domains: the matchable blocks of every worker that hashes the same way, in one dict.

Workers whose layer group advertises the same ``(hash_algo, tokens_per_block,
layer_group_id)`` share a :class:`HashDomain`. Its ``masks`` maps a block hash to the bitmask
of workers holding that block *rooted* (the block and its whole chain cached, see
:mod:`kvstream.index.table`). Along one request's hash chain the masks can only shrink: a
worker holding block i rooted holds blocks 0..i-1 too. So the depth of every worker is found
by locating where the mask changes, bisecting between positions whose masks differ
(:func:`prefix_depths`): O(k log n) dict lookups for k distinct depths among the workers and
n request blocks, instead of one walk per worker (O(workers x n)).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import TypeVar

from kvstream.index.types import DomainKey

__all__ = ["HashDomain", "expand_depths", "prefix_depths"]

K = TypeVar("K")
_depth = itemgetter(1)


class HashDomain:
    """The shared block -> workers bitmask map of one :class:`DomainKey`.

    ``members`` is the bitmask of workers whose table is attached here.
    """

    __slots__ = ("key", "masks", "members")

    def __init__(self, key: DomainKey) -> None:
        self.key = key
        self.masks: dict[bytes, int] = {}
        self.members = 0

    def depths(self, hashes: Sequence[bytes], allowed: int) -> list[tuple[int, int]]:
        """``(workers bitmask, depth)`` pairs for the workers in ``allowed`` that hold a
        prefix of ``hashes``; see :func:`prefix_depths`."""
        allowed &= self.members
        # the masks hold members' bits only: with every member allowed, nothing to filter
        return prefix_depths(hashes, self.masks, None if allowed == self.members else allowed)

    def __repr__(self) -> str:
        return f"<HashDomain {tuple(self.key)} blocks={len(self.masks)}>"


def prefix_depths(
    hashes: Sequence[bytes], masks: dict[bytes, int], allowed: int | None = None
) -> list[tuple[int, int]]:
    """Where each worker's cached prefix of ``hashes`` ends.

    Returns ``(bitmask, depth)`` pairs: the workers in ``bitmask`` hold exactly the first
    ``depth`` blocks (``depth >= 1``). Workers holding none are in no pair; only workers in
    ``allowed`` are considered (None: all). Assumes the masks shrink along the chain (true
    for rooted blocks); if they do not (a hash collision), a worker may appear in several
    pairs and the caller keeps its largest depth.
    """
    n = len(hashes)
    if not n or allowed == 0:
        return []
    raw = masks.get
    get: Callable[[bytes, int], int]
    if allowed is None:
        get = raw
    else:
        keep = allowed

        def get(h: bytes, default: int) -> int:
            return raw(h, default) & keep

    first = get(hashes[0], 0)
    if not first:
        return []
    last = get(hashes[n - 1], 0)
    out: list[tuple[int, int]] = []
    if last:
        out.append((last, n))
    if first == last:
        return out
    emit = out.append

    # bisect between positions whose masks differ; masks only shrink, so equal masks at
    # both ends of a range mean no change inside it (recursion: cheaper than a stack here)
    def split(lo: int, mlo: int, hi: int, mhi: int) -> None:
        mid = (lo + hi) >> 1
        if mid == lo:
            emit((mlo & ~mhi, hi))
            return
        mm = get(hashes[mid], 0)
        if mm != mlo:
            split(lo, mlo, mid, mm)
        if mm != mhi:
            split(mid, mm, hi, mhi)

    split(0, first, n - 1, last)
    return out


def _positions(byte_index: int) -> tuple[tuple[int, ...], ...]:
    """Bit positions (absolute) of every value of byte ``byte_index`` of a mask."""
    while len(_POS) <= byte_index:
        j = len(_POS)
        _POS.append(tuple(tuple(8 * j + i for i in range(8) if b >> i & 1) for b in range(256)))
    return _POS[byte_index]


_POS: list[tuple[tuple[int, ...], ...]] = []
_positions(7)  # 64 workers without growing the table


def expand_depths(
    pairs: list[tuple[int, int]],
    keys: Sequence[K],
    cache: dict[int, list[K]] | None = None,
) -> dict[K, int]:
    """``keys[slot] -> depth`` for every worker slot in ``pairs`` (the largest depth wins
    when a slot is in several pairs). Masks are split into bytes and each byte's bit
    positions come from a table, so a 64-worker mask costs a handful of operations.
    ``cache`` (mask -> keys) remembers expansions of masks with several workers; it must only
    be shared between calls with the same ``keys`` (which may grow, never change)."""
    out: dict[K, int] = {}
    for mask, d in sorted(pairs, key=_depth):
        if not mask & (mask - 1):  # one worker
            out[keys[mask.bit_length() - 1]] = d
            continue
        ks = None if cache is None else cache.get(mask)
        if ks is None:
            raw = mask.to_bytes((mask.bit_length() + 7) >> 3, "little")
            if len(raw) > len(_POS):
                _positions(len(raw) - 1)
            pos = _POS
            ks = [keys[p] for j, b in enumerate(raw) if b for p in pos[j][b]]
            if cache is not None:
                if len(cache) >= _CACHE_MAX:
                    cache.clear()
                cache[mask] = ks
        out.update(dict.fromkeys(ks, d))
    return out


_CACHE_MAX = 4096

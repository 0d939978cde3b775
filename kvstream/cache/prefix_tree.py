"""The committed blocks of one layer group, keyed by block hash (a radix tree of blocks).

In a full-attention group every committed block's parent (the block before it in its
request) is committed too, and the tree keeps the parent/child links: a prefix is reusable
exactly as far as the chain of its hashes is present, and a block may leave the tree only as
a leaf, so no committed block is ever left unreachable from the root.

In a sliding-window group a request releases the blocks that leave its window while it keeps
their descendants, so ancestors may be evicted first; the tree is then an unlinked map
(``linked=False``) and reuse is decided per block (see :mod:`kvstream.cache.windows`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from kvstream.cache.block import Block
from kvstream.cache.errors import CacheInvariantError

__all__ = ["PrefixTree"]


class PrefixTree:
    """Committed blocks by hash; with ``linked``, parent/child links that enforce leaf-first
    removal."""

    __slots__ = ("_by_hash", "linked")

    def __init__(self, *, linked: bool) -> None:
        self.linked = linked
        self._by_hash: dict[bytes, Block] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def get(self, block_hash: bytes) -> Block | None:
        """The committed block with this hash, or None."""
        return self._by_hash.get(block_hash)

    def lookup(self, hashes: Iterable[bytes]) -> list[Block | None]:
        """The committed block of each hash (None where there is none), in order."""
        return list(map(self._by_hash.get, hashes))

    def insert_run(
        self, table: Sequence[Block | None], hashes: Sequence[bytes], lo: int, hi: int
    ) -> list[int]:
        """Commit position ``i``'s block ``table[i]`` under ``hashes[i]`` for each ``i`` in
        ``[lo, hi)``, in order, as :meth:`insert` would (the parent of position ``i`` is
        ``hashes[i - 1]``); a position whose hash is committed already is skipped. Returns
        the skipped positions. A position without a block raises CacheInvariantError."""
        by_hash = self._by_hash
        linked = self.linked
        skipped: list[int] = []
        prev: Block | None = None  # the block committed at position i - 1 by this call
        for i in range(lo, hi):
            h = hashes[i]
            if h in by_hash:
                skipped.append(i)
                prev = None
                continue
            block = table[i]
            if block is None:
                raise CacheInvariantError(f"position {i} has no block to commit")
            if block.block_hash is not None:
                raise CacheInvariantError(f"{block!r} is already committed")
            if linked and i:
                # the parent is the block just committed (no lookup), else the tree's
                parent = prev if prev is not None else by_hash.get(hashes[i - 1])
                if parent is None:
                    raise CacheInvariantError(
                        f"parent {hashes[i - 1].hex()} of {h.hex()} is not committed"
                    )
                block.parent = parent
                parent.num_children += 1
            block.block_hash = h
            by_hash[h] = block
            prev = block
        return skipped

    def hashes(self) -> Iterator[bytes]:
        """Every committed hash (do not mutate the tree while iterating)."""
        return iter(self._by_hash)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are committed (the longest cached prefix, in blocks)."""
        by_hash = self._by_hash
        n = 0
        for h in hashes:
            if h not in by_hash:
                break
            n += 1
        return n

    def insert(self, block: Block, block_hash: bytes, parent_hash: bytes | None) -> None:
        """Commit ``block`` under ``block_hash``; in a linked tree ``parent_hash`` (None at the
        root) must be committed. The hash must not be committed yet."""
        if block_hash in self._by_hash or block.block_hash is not None:
            raise CacheInvariantError(f"hash {block_hash.hex()} is already committed")
        if self.linked and parent_hash is not None:
            parent = self._by_hash.get(parent_hash)
            if parent is None:
                raise CacheInvariantError(
                    f"parent {parent_hash.hex()} of {block_hash.hex()} is not committed"
                )
            block.parent = parent
            parent.num_children += 1
        block.block_hash = block_hash
        self._by_hash[block_hash] = block

    def remove(self, block: Block) -> bytes:
        """Uncommit ``block`` and return its hash; in a linked tree it must be a leaf."""
        h = block.block_hash
        if h is None or self._by_hash.get(h) is not block:
            raise CacheInvariantError(f"{block!r} is not committed")
        if block.num_children:
            raise CacheInvariantError(
                f"{block!r} still has {block.num_children} committed children (leaf-first "
                "eviction violated)"
            )
        parent = block.parent
        if parent is not None:
            parent.num_children -= 1
            block.parent = None
        block.block_hash = None
        del self._by_hash[h]
        return h

    def remove_many(self, blocks: Iterable[Block]) -> list[bytes]:
        """:meth:`remove` each of ``blocks`` in order; returns their hashes. On a violation
        (CacheInvariantError) the blocks before the bad one stay removed."""
        by_hash = self._by_hash
        out: list[bytes] = []
        for block in blocks:
            h = block.block_hash
            if h is None or by_hash.get(h) is not block or block.num_children:
                self.remove(block)  # raises, naming the reason
                continue  # not reached
            parent = block.parent
            if parent is not None:
                parent.num_children -= 1
                block.parent = None
            block.block_hash = None
            del by_hash[h]
            out.append(h)
        return out

    def clear(self) -> None:
        """Uncommit every block."""
        for b in self._by_hash.values():
            b.block_hash = None
            b.parent = None
            b.num_children = 0
        self._by_hash.clear()

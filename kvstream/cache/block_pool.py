"""The block pool of one layer group: allocation, reference counts, commit and eviction."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kvstream.cache.block import Block
from kvstream.cache.errors import CacheInvariantError
from kvstream.cache.free_queue import FreeQueue
from kvstream.cache.prefix_tree import PrefixTree
from kvstream.events.emitter import EventRecorder

__all__ = ["BlockPool", "EvictHandler"]

#: Takes a pool's evicted blocks (their ids about to be reused) and their hashes, in order.
EvictHandler = Callable[[int, list[Block], list[bytes]], None]


class BlockPool:
    """``num_blocks`` blocks of layer group ``layer_group_id``.

    A block is in exactly one of three states:

    - *in use*: ``ref_cnt > 0`` (held by requests, committed or not);
    - *free uncached*: ``ref_cnt == 0`` and not committed (never used, or released without a
      hash); reused first, in any order;
    - *free cached*: ``ref_cnt == 0`` and committed; kept for prefix reuse in the LRU
      :class:`FreeQueue` and evicted (a ``removed`` event) only when no uncached block is left.

    Block metadata is created on first use, so a large pool costs nothing up front; every
    operation is O(1). Evictions go to ``recorder.removed`` (the recorder batches them) or,
    when given, to ``on_evict(layer_group_id, blocks, hashes)``, which moves them to a lower
    tier before their ids are handed out again. ``removed_trusted`` (the manager's own
    emitter's ``removed_many_trusted``), when given, takes a batch of evictions instead of
    ``recorder.removed_many``: the tree's hashes need no checks.
    """

    __slots__ = (
        "_created",
        "_on_evict",
        "_recorder",
        "_removed_trusted",
        "_stack",
        "evictions",
        "layer_group_id",
        "lru",
        "num_blocks",
        "tree",
    )

    def __init__(
        self,
        layer_group_id: int,
        num_blocks: int,
        recorder: EventRecorder,
        *,
        linked: bool,
        on_evict: EvictHandler | None = None,
        removed_trusted: Callable[[int, list[bytes], int | None], None] | None = None,
    ) -> None:
        self.layer_group_id = layer_group_id
        self._on_evict = on_evict
        self._removed_trusted = removed_trusted
        self.num_blocks = num_blocks
        self._recorder = recorder
        self.tree = PrefixTree(linked=linked)
        self.lru = FreeQueue()
        self._stack: list[Block] = []  # free uncached blocks already created
        self._created = 0  # blocks ids 0.._created-1 have metadata
        #: Blocks evicted from the cache so far (monotonic).
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free uncached plus free cached (evictable)."""
        return self.num_blocks - self._created + len(self._stack) + len(self.lru)

    @property
    def num_evictable(self) -> int:
        """Free cached blocks (committed, held by nobody)."""
        return len(self.lru)

    @property
    def num_cached(self) -> int:
        """Committed blocks, in use or evictable."""
        return len(self.tree)

    def allocate(self) -> Block:
        """A block for a new position, with ``ref_cnt`` 1 and no hash.

        Takes a free uncached block when there is one, else evicts the least recently freed
        cached block (recording its removal). Callers check :attr:`num_free` first; an empty
        pool raises CacheInvariantError.
        """
        if self._stack:
            block = self._stack.pop()
        elif self._created < self.num_blocks:
            block = Block(self._created)
            self._created += 1
        else:
            try:
                block = self.lru.popleft()
            except IndexError:
                raise CacheInvariantError(
                    f"layer group {self.layer_group_id}: allocate() on a full pool"
                ) from None
            self._evict(block)
        block.ref_cnt = 1
        return block

    def allocate_many(self, n: int) -> list[Block]:
        """``n`` blocks as :meth:`allocate` would give them one by one, the evictions this
        takes recorded in one ``recorder.removed_many`` call (``removed`` for one). Raises
        CacheInvariantError, changing nothing, when fewer than ``n`` blocks are free."""
        if n > self.num_free:
            raise CacheInvariantError(
                f"layer group {self.layer_group_id}: allocate_many({n}) with only "
                f"{self.num_free} free blocks"
            )
        if n == 1:
            return [self.allocate()]  # (a decode step's block: the single-block path is cheaper)
        out: list[Block] = []
        stack = self._stack
        take = min(n, len(stack))
        if take:
            out += stack[-take:][::-1]  # what stack.pop() would give, in that order
            del stack[-take:]
        new = min(n - take, self.num_blocks - self._created)
        if new:
            start = self._created
            out += [Block(i) for i in range(start, start + new)]
            self._created = start + new
        evict = n - take - new
        if evict:
            evicted = self.lru.popleft_many(evict)
            hashes = self.tree.remove_many(evicted)
            self.evictions += evict
            out += evicted
            rec = self._recorder
            if self._on_evict is not None:
                self._on_evict(self.layer_group_id, evicted, hashes)
            elif rec.enabled:
                if evict == 1:  # the single-block call is cheaper
                    rec.removed(self.layer_group_id, hashes[0], cache_level=0)
                elif self._removed_trusted is not None:
                    self._removed_trusted(self.layer_group_id, hashes, 0)
                else:
                    rec.removed_many(self.layer_group_id, hashes, cache_level=0)
        for b in out:
            b.ref_cnt = 1
        return out

    def _evict(self, block: Block) -> None:
        h = self.tree.remove(block)
        self.evictions += 1
        rec = self._recorder
        if self._on_evict is not None:
            self._on_evict(self.layer_group_id, [block], [h])
        elif rec.enabled:
            rec.removed(self.layer_group_id, h, cache_level=0)

    def touch(self, block: Block) -> None:
        """Take one more reference on a committed block (a prefix hit); a free cached block
        leaves the LRU queue."""
        if block.ref_cnt == 0:
            self.lru.remove(block)
        block.ref_cnt += 1

    def touch_many(self, blocks: Iterable[Block | None]) -> None:
        """:meth:`touch` each block of ``blocks`` that is not None."""
        remove = self.lru.remove
        for block in blocks:
            if block is not None:
                if not block.ref_cnt:
                    remove(block)
                block.ref_cnt += 1

    def release_many(self, blocks: Iterable[Block | None]) -> None:
        """:meth:`release` each block of ``blocks`` that is not None, in order."""
        stack = self._stack
        freed: list[Block] = []
        for block in blocks:
            if block is None:
                continue
            ref = block.ref_cnt - 1
            if ref < 0:
                self.lru.extend(freed)
                raise CacheInvariantError(f"{block!r} released more often than taken")
            block.ref_cnt = ref
            if not ref:
                if block.block_hash is None:
                    stack.append(block)
                else:
                    freed.append(block)
        self.lru.extend(freed)

    def release(self, block: Block) -> None:
        """Drop one reference; at zero the block becomes free (cached blocks join the LRU
        tail, so callers release a request's blocks last position first)."""
        ref = block.ref_cnt - 1
        if ref < 0:
            raise CacheInvariantError(f"{block!r} released more often than taken")
        block.ref_cnt = ref
        if ref == 0:
            if block.block_hash is None:
                self._stack.append(block)
            else:
                self.lru.append(block)

    def commit(self, block: Block, block_hash: bytes, parent_hash: bytes | None) -> None:
        """Register a held, full block under ``block_hash`` (not committed yet)."""
        self.tree.insert(block, block_hash, parent_hash)

    def clear(self) -> None:
        """Forget every block (callers drop every request first): all become free uncached."""
        self.tree.clear()
        self.lru.clear()
        self._stack.clear()
        self._created = 0

    def check(self, holdings: Mapping[int, int], held: Mapping[int, Block]) -> None:
        """Verify the pool against ``holdings`` (block id -> references requests hold) and
        ``held`` (block id -> that block); CacheInvariantError on any inconsistency."""
        gid = self.layer_group_id
        lru_ids = set()
        for b in self.lru:
            if b.ref_cnt or b.block_hash is None or b.block_id in lru_ids:
                raise CacheInvariantError(f"group {gid}: bad LRU member {b!r}")
            lru_ids.add(b.block_id)
        if len(lru_ids) != len(self.lru):
            raise CacheInvariantError(f"group {gid}: LRU length {len(self.lru)} is wrong")
        stack_ids = {b.block_id for b in self._stack}
        if len(stack_ids) != len(self._stack) or stack_ids & lru_ids:
            raise CacheInvariantError(f"group {gid}: a free block is listed twice")
        for b in self._stack:
            if b.ref_cnt or b.block_hash is not None or b.prev_free is not None:
                raise CacheInvariantError(f"group {gid}: bad uncached free block {b!r}")
        for bid, refs in holdings.items():
            b = held[bid]
            if b.ref_cnt != refs:
                raise CacheInvariantError(
                    f"group {gid}: {b!r} has ref_cnt {b.ref_cnt} but {refs} holders"
                )
            if bid in lru_ids or bid in stack_ids:
                raise CacheInvariantError(f"group {gid}: held {b!r} is on a free list")
        if self.num_free != self.num_blocks - len(holdings):
            raise CacheInvariantError(
                f"group {gid}: {self.num_free} free blocks + {len(holdings)} held != "
                f"{self.num_blocks}"
            )
        children: dict[int, int] = {}
        committed: list[Block] = []
        for h in self.tree.hashes():
            c = self.tree.get(h)
            if c is None or c.block_hash != h:
                raise CacheInvariantError(f"group {gid}: tree entry {h.hex()} is inconsistent")
            committed.append(c)
            if c.ref_cnt == 0 and c.block_id not in lru_ids:
                raise CacheInvariantError(f"group {gid}: free committed {c!r} is not in the LRU")
            p = c.parent
            if p is not None:
                if p.block_hash is None or self.tree.get(p.block_hash) is not p:
                    raise CacheInvariantError(f"group {gid}: {c!r} has an uncommitted parent")
                children[p.block_id] = children.get(p.block_id, 0) + 1
        for c in committed:
            if c.num_children != children.get(c.block_id, 0):
                raise CacheInvariantError(f"group {gid}: {c!r} has a wrong child count")

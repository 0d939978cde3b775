"""Building blocks of the cache: the free queue, the prefix tree, the pool, window maths."""

from __future__ import annotations

from collections import Counter

import pytest

from kvstream.cache.block import Block
from kvstream.cache.block_pool import BlockPool
from kvstream.cache.errors import CacheInvariantError
from kvstream.cache.free_queue import FreeQueue
from kvstream.cache.prefix_tree import PrefixTree
from kvstream.cache.windows import first_needed_block, reuse_boundary
from kvstream.events.emitter import NULL_RECORDER


def test_free_queue_is_lru_with_o1_remove() -> None:
    q = FreeQueue()
    blocks = [Block(i) for i in range(5)]
    for b in blocks:
        q.append(b)
    assert len(q) == 5
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert [b.block_id for b in q] == [1, 3]
    assert blocks[2] not in q
    assert blocks[1] in q
    q.append(blocks[0])
    assert q.peek() is blocks[1]
    assert q.popleft() is blocks[1]
    assert [b.block_id for b in q] == [3, 0]
    with pytest.raises(CacheInvariantError):
        q.append(blocks[3])
    with pytest.raises(CacheInvariantError):
        q.remove(blocks[2])
    q.clear()
    assert len(q) == 0
    assert q.peek() is None
    assert blocks[3] not in q
    with pytest.raises(IndexError):
        q.popleft()


def test_prefix_tree_links_and_leaf_first_removal() -> None:
    tree = PrefixTree(linked=True)
    a, b, c = Block(0), Block(1), Block(2)
    tree.insert(a, b"A", None)
    tree.insert(b, b"B", b"A")
    tree.insert(c, b"C", b"A")
    assert a.num_children == 2
    assert b.parent is a
    assert tree.match([b"A", b"B", b"X", b"C"]) == 2
    with pytest.raises(CacheInvariantError, match="leaf-first"):
        tree.remove(a)
    with pytest.raises(CacheInvariantError, match="not committed"):
        tree.insert(Block(3), b"D", b"nope")
    with pytest.raises(CacheInvariantError, match="already"):
        tree.insert(Block(4), b"B", b"A")
    assert tree.remove(b) == b"B"
    assert tree.remove(c) == b"C"
    assert a.num_children == 0
    assert b.block_hash is None
    assert tree.remove(a) == b"A"
    assert len(tree) == 0


def test_unlinked_tree_allows_orphans() -> None:
    tree = PrefixTree(linked=False)
    a, b = Block(0), Block(1)
    tree.insert(a, b"A", None)
    tree.insert(b, b"B", b"A")
    assert tree.remove(a) == b"A"  # an ancestor may go first in a sliding-window group
    assert tree.get(b"B") is b


def test_block_pool_states_and_eviction_order() -> None:
    pool = BlockPool(0, 3, NULL_RECORDER, linked=True)
    assert pool.num_free == 3
    x, y, z = pool.allocate(), pool.allocate(), pool.allocate()
    assert pool.num_free == 0
    assert {x.block_id, y.block_id, z.block_id} == {0, 1, 2}
    pool.commit(x, b"x", None)
    pool.commit(y, b"y", b"x")
    for b in (z, y, x):  # last position first
        pool.release(b)
    assert pool.num_free == 3
    assert pool.num_evictable == 2
    pool.check(Counter(), {})
    w = pool.allocate()
    assert w is z  # the uncached block is reused before any eviction
    v = pool.allocate()
    assert v is y
    assert pool.evictions == 1
    pool.touch(x)
    assert pool.num_free == 0
    with pytest.raises(CacheInvariantError):
        pool.allocate()
    pool.check(Counter({0: 1, 1: 1, 2: 1}), {b.block_id: b for b in (x, v, w)})
    for b in (w, v, x):
        pool.release(b)
    with pytest.raises(CacheInvariantError, match="released more often"):
        pool.release(x)
    pool.clear()
    assert pool.num_free == 3
    assert pool.num_cached == 0


def test_first_needed_block() -> None:
    assert first_needed_block(100, None, 4) == 0
    assert first_needed_block(8, 8, 4) == 0
    assert first_needed_block(11, 8, 4) == 0  # needs [3, 11): block 0 holds 3
    assert first_needed_block(12, 8, 4) == 1
    assert first_needed_block(13, 8, 4) == 1
    assert first_needed_block(16, 8, 4) == 2


def test_reuse_boundary_full_and_window() -> None:
    c = [True, True, False, True, True, True]
    assert reuse_boundary(c, None, 4, 10) == 2
    assert reuse_boundary(c, None, 4, 1) == 1
    # window 8 = two blocks: k needs blocks k-2, k-1 (all from 0 while k <= 2).
    assert reuse_boundary(c, 8, 4, 10) == 6
    assert reuse_boundary(c, 8, 4, 5) == 5
    assert reuse_boundary(c, 8, 4, 4) == 2  # k=4 needs blocks 2, 3: block 2 is missing
    assert reuse_boundary([False, True, True], 4, 4, 3) == 3
    assert reuse_boundary([False, True, False], 4, 4, 3) == 2
    assert reuse_boundary([], 4, 4, 3) == 0

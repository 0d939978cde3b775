"""An O(1) LRU queue of evictable cached blocks (vLLM's ``FreeKVCacheBlockQueue``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvstream.cache.block import Block
from kvstream.cache.errors import CacheInvariantError

__all__ = ["FreeQueue"]


class FreeQueue:
    """A doubly linked list of blocks, least recently freed first.

    ``append`` (most recent at the tail), ``remove`` (any member) and ``popleft`` (the least
    recent) are O(1). The queue owns the ``prev_free``/``next_free`` links of its members;
    a block is a member exactly when its ``prev_free`` is not None.
    """

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self) -> None:
        self._head = Block(-1)  # sentinels: never members, never None-linked while alive
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: Block) -> bool:
        return block.prev_free is not None

    def append(self, block: Block) -> None:
        """Make ``block`` the most recent member. It must not be a member already."""
        if block.prev_free is not None:
            raise CacheInvariantError(f"{block!r} is already in the free queue")
        tail = self._tail
        last = tail.prev_free
        assert last is not None
        block.prev_free = last
        block.next_free = tail
        last.next_free = block
        tail.prev_free = block
        self._len += 1

    def remove(self, block: Block) -> None:
        """Take ``block`` out of the queue. It must be a member."""
        prev = block.prev_free
        nxt = block.next_free
        if prev is None or nxt is None:
            raise CacheInvariantError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def extend(self, blocks: Iterable[Block]) -> None:
        """:meth:`append` each of ``blocks`` in order (none may be a member)."""
        tail = self._tail
        last = tail.prev_free
        assert last is not None
        n = 0
        for block in blocks:
            if block.prev_free is not None:
                # keep the queue consistent up to here before raising
                last.next_free = tail
                tail.prev_free = last
                self._len += n
                raise CacheInvariantError(f"{block!r} is already in the free queue")
            block.prev_free = last
            last.next_free = block
            last = block
            n += 1
        last.next_free = tail
        tail.prev_free = last
        self._len += n

    def popleft_many(self, n: int) -> list[Block]:
        """Remove and return the ``n`` least recent members, least recent first; IndexError
        (nothing removed) when there are fewer."""
        if n > self._len:
            raise IndexError(f"pop {n} from a free queue of {self._len}")
        out: list[Block] = []
        append = out.append
        node = self._head.next_free
        for _ in range(n):
            assert node is not None
            nxt = node.next_free
            node.prev_free = node.next_free = None
            append(node)
            node = nxt
        assert node is not None
        self._head.next_free = node
        node.prev_free = self._head
        self._len -= n
        return out

    def popleft(self) -> Block:
        """Remove and return the least recent member; IndexError when empty."""
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("pop from an empty free queue")
        self.remove(first)
        return first

    def peek(self) -> Block | None:
        """The least recent member, or None."""
        first = self._head.next_free
        return None if first is self._tail else first

    def __iter__(self) -> Iterator[Block]:
        """Members from least to most recent (do not mutate while iterating)."""
        node = self._head.next_free
        tail = self._tail
        while node is not None and node is not tail:
            yield node
            node = node.next_free

    def clear(self) -> None:
        """Unlink every member."""
        node = self._head.next_free
        tail = self._tail
        while node is not None and node is not tail:
            nxt = node.next_free
            node.prev_free = node.next_free = None
            node = nxt
        self._head.next_free = tail
        tail.prev_free = self._head
        self._len = 0

"""The host tier of one layer group: slots of CPU memory holding blocks evicted from the GPU.

Pure bookkeeping (which block hash lives in which slot, least recently offloaded first); the
tensors live in :class:`~kvstream.cache.storage.KVStorage` and the moves are made by
:mod:`kvstream.cache.tiering`.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstream.cache.errors import CacheInvariantError

__all__ = ["HostTier"]


class HostTier:
    """``capacity`` slots; each is *free*, *resident* (holds a block, by hash) or *taken*.

    A resident block leaves by :meth:`pop_lru` (the oldest, to make room) or :meth:`take` (a
    prefix hit). Either way its slot is *taken*: the data stays valid until the caller has
    copied it out and calls :meth:`release`. Every operation is O(1).
    """

    __slots__ = ("_free", "_resident", "_taken", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._resident: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        # pop() hands out the highest slot first: a pool evicts a request's blocks last
        # position first (descending ids), so the slots step the same way and one slice copy
        # moves the whole run (see storage.copy_blocks).
        self._free = list(range(capacity))
        self._taken: set[int] = set()

    def __len__(self) -> int:
        """Resident blocks."""
        return len(self._resident)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._resident

    @property
    def num_free(self) -> int:
        """Slots holding nothing."""
        return len(self._free)

    def slot_of(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash``, or None."""
        return self._resident.get(block_hash)

    def hashes(self) -> list[bytes]:
        """Resident hashes, least recently added first."""
        return list(self._resident)

    def add(self, block_hash: bytes) -> int:
        """Make ``block_hash`` resident (the most recent) in a free slot and return the slot.
        CacheInvariantError when no slot is free or the hash is already resident."""
        if block_hash in self._resident:
            raise CacheInvariantError(f"block {block_hash.hex()} is already in the host tier")
        if not self._free:
            raise CacheInvariantError("host tier: add() with no free slot")
        slot = self._free.pop()
        self._resident[block_hash] = slot
        return slot

    def pop_lru(self) -> tuple[bytes, int] | None:
        """Take the least recently added resident block: ``(hash, slot)``, or None if none."""
        if not self._resident:
            return None
        h, slot = self._resident.popitem(last=False)
        self._taken.add(slot)
        return h, slot

    def take(self, block_hash: bytes) -> int:
        """Take a resident block out of the tier; its slot stays valid until :meth:`release`.
        CacheInvariantError when it is not resident."""
        slot = self._resident.pop(block_hash, None)
        if slot is None:
            raise CacheInvariantError(f"block {block_hash.hex()} is not in the host tier")
        self._taken.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """Free a taken slot."""
        try:
            self._taken.remove(slot)
        except KeyError:
            raise CacheInvariantError(f"host slot {slot} was not taken") from None
        self._free.append(slot)

    def clear(self) -> None:
        """Free every slot (taken ones included)."""
        self._resident.clear()
        self._taken.clear()
        self._free = list(range(self.capacity))

    def check(self) -> None:
        """CacheInvariantError unless every slot is in exactly one state."""
        resident = set(self._resident.values())
        free = set(self._free)
        if len(resident) != len(self._resident) or len(free) != len(self._free):
            raise CacheInvariantError("host tier: a slot is listed twice")
        if resident & free or resident & self._taken or free & self._taken:
            raise CacheInvariantError("host tier: a slot is in two states")
        if len(resident) + len(free) + len(self._taken) != self.capacity:
            raise CacheInvariantError("host tier: slots went missing")

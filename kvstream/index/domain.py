"""Hash domains: the matchable blocks of every worker that hashes the same way, in one dict.

Workers whose layer group advertises the same ``(hash_algo, tokens_per_block,
layer_group_id)`` share a :class:`HashDomain`. Its ``masks`` maps a block hash to the bitmask
of workers holding that block *rooted* (the block and its whole chain cached, see
:mod:`kvstream.index.table`). Along one request's hash chain the masks can only shrink: a
worker holding block i rooted holds blocks 0..i-1 too. So the depth of every worker is found
by locating where the mask changes, bisecting between positions whose masks differ
(:func:`prefix_depths`): O(k log n) dict lookups for k distinct depths among the workers and
n request blocks, instead of one walk per worker (O(workers x n)).

The masks live in a :class:`MaskMap`: block key -> an entry of fixed-width bit words, so
adding or dropping a worker's bit changes bytes in place (no new int per update, one dict
probe) and the optional C loops (:mod:`kvstream.index._table_native`) read them directly.
With the extension built a domain keeps the extension's ``MaskMap`` instead: the same
contract in one open-addressing table whose slots hold the key and its bits together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Final, TypeVar

from kvstream._native import load
from kvstream.index.types import DomainKey

if TYPE_CHECKING:  # typed by its stub; None at run time when not loaded
    from kvstream.index import _table_native as _native
else:
    _native = load("kvstream.index._table_native")

__all__ = ["HashDomain", "MaskMap", "expand_depths", "prefix_depths"]

K = TypeVar("K")
_depth = itemgetter(1)


class MaskMap:
    """Block key -> bitmask of worker slots (bit ``slot`` set: that worker holds the block
    rooted). Keys without a bit set are absent.

    Storage, read and written in place by the C loops: ``index`` maps a key to its entry,
    ``words`` holds ``width`` bytes per entry (bit ``slot`` is bit ``slot % 8`` of byte
    ``entry * width + slot // 8``), ``free`` lists entries to reuse. :meth:`reserve` widens
    the entries before a slot beyond ``width * 8`` is written.
    """

    __slots__ = ("free", "index", "width", "words")

    def __init__(self) -> None:
        self.index: dict[bytes, int] = {}
        self.words = bytearray()
        self.free: list[int] = []
        self.width = 8

    def reserve(self, slot: int) -> None:
        """Make room for bit ``slot`` in every entry (widening is O(entries), once per
        64 more workers)."""
        if slot < 8 * self.width:
            return
        old = self.width
        new = ((slot >> 6) + 1) * 8
        pad = bytes(new - old)
        w = self.words
        self.words = bytearray().join(w[i : i + old] + pad for i in range(0, len(w), old))
        self.width = new

    def add(self, key: bytes, slot: int) -> None:
        """Set bit ``slot`` of ``key``'s mask (``slot`` must be reserved)."""
        e = self.index.get(key)
        if e is None:
            e = self._new_entry(key)
        self.words[e * self.width + (slot >> 3)] |= 1 << (slot & 7)

    def add_many(self, keys: Iterable[bytes], slot: int) -> None:
        """:meth:`add` of every key in ``keys`` (``slot`` must be reserved)."""
        get = self.index.get
        new = self._new_entry
        words = self.words  # _new_entry extends it in place; only reserve() rebinds it
        at = slot >> 3
        bit = 1 << (slot & 7)
        width = self.width
        for key in keys:
            e = get(key)
            if e is None:
                e = new(key)
            words[e * width + at] |= bit

    def _new_entry(self, key: bytes) -> int:
        width = self.width
        if self.free:
            e = self.free.pop()
            self.words[e * width : (e + 1) * width] = bytes(width)
        else:
            e = len(self.words) // width
            self.words.extend(bytes(width))
        self.index[key] = e
        return e

    def discard(self, key: bytes, slot: int) -> None:
        """Clear bit ``slot`` of ``key``'s mask; a key left without bits is dropped."""
        e = self.index.get(key)
        if e is None:
            return
        width = self.width
        at = e * width
        if (slot >> 3) >= width:
            return
        self.words[at + (slot >> 3)] &= ~(1 << (slot & 7)) & 0xFF
        if not any(self.words[at : at + width]):
            del self.index[key]
            self.free.append(e)

    def get(self, key: bytes, default: int = 0) -> int:
        """The mask of ``key`` as an int (``default`` when no bit is set)."""
        e = self.index.get(key)
        if e is None:
            return default
        width = self.width
        return int.from_bytes(self.words[e * width : (e + 1) * width], "little")

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def as_dict(self) -> dict[bytes, int]:
        """Every key's mask as an int."""
        return {k: self.get(k) for k in self.index}

    def __repr__(self) -> str:
        return f"<MaskMap keys={len(self.index)} width={self.width}>"


#: The mask map a domain keeps: the C extension's ``MaskMap`` when built (one open-addressing
#: table with the bits inline: an update is one probe sequence, no int object; fixed at import,
#: so tests that switch ``_native`` off run the Python loops on the same maps), else
#: :class:`MaskMap`. Both have this class's methods and contract (bytes keys).
_MASK_MAP: Final[Any] = _native.MaskMap if _native is not None else MaskMap


def _index_masks() -> Any:
    """The index core's ``MaskMap`` (keys inline, no object per key; it answers the prefix
    search itself and the native block tables write it directly), or None when not built or
    ``KVSTREAM_NO_NATIVE=1``."""
    core = load("kvstream._native._index")
    return None if core is None else core.MaskMap


#: what a new domain keeps: the index core's map when built, else :data:`_MASK_MAP`
_INDEX_MASKS: Final[Any] = _index_masks()


class HashDomain:
    """The shared block -> workers bitmask map of one :class:`DomainKey`.

    ``members`` is the bitmask of workers whose table is attached here.
    """

    __slots__ = ("key", "masks", "members")

    def __init__(self, key: DomainKey) -> None:
        self.key = key
        self.masks: MaskMap = (_INDEX_MASKS or _MASK_MAP)()
        self.members = 0

    def depths(self, hashes: Sequence[bytes], allowed: int) -> list[tuple[int, int]]:
        """``(workers bitmask, depth)`` pairs for the workers in ``allowed`` that hold a
        prefix of ``hashes``; see :func:`prefix_depths`."""
        allowed &= self.members
        # the masks hold members' bits only: with every member allowed, nothing to filter
        keep = None if allowed == self.members else allowed
        masks = self.masks
        if type(masks) is _INDEX_MASKS and _native is not None and type(hashes) is list:
            a = None if keep is None else keep.to_bytes(masks.width, "little")
            return masks.prefix_depths(hashes, a)  # type: ignore[attr-defined,no-any-return]
        if _native is not None and type(hashes) is list:
            # members are reserved slots (attach), so ``keep`` fits the entries' width
            a = None if keep is None else keep.to_bytes(masks.width, "little")
            return _native.prefix_depths(masks, hashes, a)
        return prefix_depths(hashes, masks, keep)

    def slot_depths(self, hashes: Sequence[bytes], allowed: int) -> list[tuple[int, int]]:
        """``(worker slot, depth)`` for the workers in ``allowed`` holding a prefix of
        ``hashes`` (each slot once, with its deepest depth; in slot order)."""
        if _native is not None and type(hashes) is list:
            allowed &= self.members
            a = None if allowed == self.members else allowed.to_bytes(self.masks.width, "little")
            if type(self.masks) is _INDEX_MASKS:
                return self.masks.slot_depths(hashes, a)  # type: ignore[attr-defined,no-any-return]
            return _native.slot_depths(self.masks, hashes, a)
        return sorted(expand_depths(self.depths(hashes, allowed), _SLOTS).items())

    def __repr__(self) -> str:
        return f"<HashDomain {tuple(self.key)} blocks={len(self.masks)}>"


def prefix_depths(
    hashes: Sequence[bytes], masks: MaskMap | dict[bytes, int], allowed: int | None = None
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
    # bisect between positions whose masks differ; masks only shrink, so equal masks at
    # both ends of a range mean no change inside it. An explicit stack, depth first and left
    # first (the order the C search emits too); a recursive closure would be a reference
    # cycle per call for the cyclic GC.
    stack = [(0, first, n - 1, last)]
    pop, push = stack.pop, stack.append
    while stack:
        lo, mlo, hi, mhi = pop()
        mid = (lo + hi) >> 1
        if mid == lo:
            out.append((mlo & ~mhi, hi))
            continue
        mm = get(hashes[mid], 0)
        if mm != mhi:
            push((mid, mm, hi, mhi))
        if mm != mlo:
            push((lo, mlo, mid, mm))
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
        if not mask:  # masks that grow along the chain (a collision) can leave a pair empty
            continue
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
#: slot -> slot (expand_depths' keys for per-slot results)
_SLOTS = range(1 << 40)

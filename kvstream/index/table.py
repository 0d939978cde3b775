"""One worker's cached blocks of one layer group: a prefix tree kept in flat arrays.

A node per block hash, addressed by an integer id; parallel columns hold its hash, parent id,
first child (further children of a branching node live in a side dict of sets, so unlinking is
O(1)), packed per-tier reference counts and a "rooted" flag. With the C extension built the
integer columns are its ``Column`` (64-bit ints in one array: no int object per node, never
walked by the cyclic GC), else lists; nothing else is allocated per block beyond the dict entry.
This class is the pure-Python twin: where the extension is built, engine-keyed indexes use the
native type :func:`native_table_type` returns (same interface and semantics, its state in C).

Semantics (DESIGN §7):

- **Reference counts per tier.** ``refs`` packs a 16-bit count per cache level (0 GPU,
  1 host, 2 disk, 3 deeper). A store adds one at its level, a removal takes one away (from
  its level when given and held there, else from the deepest level holding it), an update
  moves one. A block is *present* while any count is non-zero, so a duplicate store needs a
  second removal before the block is gone.
- **Ghosts.** A block that is gone but still has present descendants stays as a *ghost*
  (all counts zero) so the descendants keep their place; the parent named by a store that
  the table does not know becomes a ghost with an unknown parent. A ghost is stored again
  (it becomes present) or disappears with its last descendant.
- **Rooted.** A present block is *rooted* when every ancestor up to a root block is present.
  Only rooted blocks are matchable: a request's prefix is reusable only if the whole chain is
  cached. Removing a block with cached descendants unroots them; storing a ghost again (or
  the missing parent of an orphan) roots them again. The table mirrors its rooted blocks
  into the domain's ``masks`` (block hash -> bitmask of workers), which the matcher walks;
  :class:`~kvstream.index.token_table.TokenGroupTable` mirrors token-derived keys instead.

Not thread-safe; the owning :class:`~kvstream.index.index.PrefixIndex` serialises access.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, Final, Protocol

from kvstream._native import load
from kvstream.events.model import StoredBlock
from kvstream.index.domain import MaskMap
from kvstream.index.stats import SourceStats
from kvstream.index.types import MAX_TIERS

__all__ = ["NATIVE_AVAILABLE", "ROOT", "UNKNOWN", "GroupTable", "best_tier", "native_table_type"]

if TYPE_CHECKING:  # typed by its stub; None at run time when not loaded
    from kvstream.index import _table_native as _native
else:
    _native = load("kvstream.index._table_native")

#: True when this twin's integer columns are the C extension's ``Column`` (its loops are
#: Python: the native table is :func:`native_table_type`, a type of its own).
NATIVE_AVAILABLE: Final[bool] = _native is not None
#: The extension whose ``Column`` holds the tables' integer columns, fixed at import (tests
#: set ``_native`` to None to run the Python loops on the same tables).
_COLUMNS: Final[Any] = _native


class IntColumn(Protocol):
    """The list operations a table uses on its integer columns (``parent``, ``refs``,
    ``kid``, ``free``): a list, or the C extension's ``Column`` (64-bit ints, no object per
    element, not walked by the cyclic GC)."""

    def __len__(self) -> int: ...
    def __getitem__(self, i: int, /) -> int: ...
    def __setitem__(self, i: int, v: int, /) -> None: ...
    def __iter__(self) -> Iterator[int]: ...
    def append(self, v: int, /) -> None: ...
    def extend(self, vs: Iterable[int], /) -> None: ...
    def pop(self) -> int: ...


def _ints(values: Iterable[int] = (), *, unsigned: bool = False) -> IntColumn:
    """A table's integer column (``unsigned``: packed reference counts, up to 64 bits)."""
    if _COLUMNS is not None:
        col: IntColumn = _COLUMNS.Column(values, unsigned=unsigned)
        return col
    return list(values)


def _atoms(hashes: list[bytes]) -> list[bytes]:
    """``hashes`` (a table's node hashes: bytes only), out of the cyclic GC's walks when the
    extension is built (a list of atoms cannot be part of a cycle)."""
    return _COLUMNS.untrack_atoms(hashes) if _COLUMNS is not None else hashes


#: Parent id of a block stored at the root (``parent_hash`` null).
ROOT: Final = -1
#: Parent id of a ghost whose own parent was never announced.
UNKNOWN: Final = -2
_NIL: Final = -1
_FIELD: Final = 0xFFFF
_INC: Final = tuple(1 << (16 * t) for t in range(MAX_TIERS))
_LAST: Final = MAX_TIERS - 1
#: the packed-count bits of levels 0..t, per t
_TIERS_UP_TO: Final = tuple((1 << (16 * (t + 1))) - 1 for t in range(MAX_TIERS))


def best_tier(refs: int) -> int:
    """The lowest cache level with a non-zero count in packed ``refs`` (-1 when none)."""
    for t in range(MAX_TIERS):
        if (refs >> (16 * t)) & _FIELD:
            return t
    return -1


def _deepest(refs: int) -> int:
    for t in range(_LAST, -1, -1):
        if (refs >> (16 * t)) & _FIELD:
            return t
    return -1  # pragma: no cover - callers pass non-zero refs


def native_table_type() -> Callable[[int], GroupTable] | None:
    """The native block table (``kvstream._native._index.GroupTable``: this interface and
    these semantics, its state in C arrays) when built and not switched off by
    ``KVSTREAM_NO_NATIVE=1``; None otherwise (use :class:`GroupTable`)."""
    core = load("kvstream._native._index")
    # the same interface, not a subclass: callers see the twin's type
    return None if core is None else core.GroupTable


def native_apply_plain() -> tuple[Callable[..., Any], tuple[type, ...]] | None:
    """The native core's ``apply_plain`` (a batch of plain stores and removals applied to
    the tables the caller chose, in one call; see ``kvstream/_native/src/index_apply.h``)
    and the table types it takes, or None where :func:`native_table_type` is None."""
    core = load("kvstream._native._index")
    if core is None:
        return None
    return core.apply_plain, (core.GroupTable, core.TokenTable)


class GroupTable:
    """The blocks of one (worker, layer group); see the module docstring.

    ``bit`` is the worker's bit in the domain masks (``1 << slot``); ``masks`` is None until
    the table is attached to a domain (:meth:`attach`), e.g. while the group's block size is
    unknown.
    """

    __slots__ = (
        "bit",
        "free",
        "hashes",
        "ids",
        "kdup",
        "kid",
        "lower",
        "masks",
        "mkeys",
        "more",
        "parent",
        "present",
        "refs",
        "rooted",
        "slot",
    )

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.slot = bit.bit_length() - 1
        self.masks: MaskMap | None = None
        self.ids: dict[bytes, int] = {}
        self.hashes: list[bytes] = _atoms([])
        #: node -> the key it is mirrored under in ``masks``: its hash (this list is
        #: ``hashes``), or a derived key (:class:`~kvstream.index.token_table.TokenGroupTable`)
        self.mkeys: list[bytes] = self.hashes
        #: mirror key -> nodes beyond the first sharing it (only derived keys can repeat)
        self.kdup: dict[bytes, set[int]] = {}
        self.parent = _ints()
        self.refs = _ints(unsigned=True)
        self.kid = _ints()
        #: parent id -> its children beyond ``kid[parent]`` (only branching nodes have one)
        self.more: dict[int, set[int]] = {}
        self.rooted = bytearray()
        self.free = _ints()
        #: Present blocks, and present blocks not held on the GPU (level 0).
        self.present = 0
        self.lower = 0

    # ------------------------------------------------------------------ gauges

    def __len__(self) -> int:
        """Nodes (present blocks and ghosts)."""
        return len(self.ids)

    @property
    def ghosts(self) -> int:
        """Nodes kept only for their descendants."""
        return len(self.ids) - self.present

    @property
    def rooted_count(self) -> int:
        """Present blocks whose whole chain is present (the matchable ones)."""
        return self.rooted.count(1)

    def __contains__(self, block_hash: object) -> bool:
        n = self.ids.get(block_hash)  # type: ignore[call-overload]
        return n is not None and self.refs[n] != 0

    def knows(self, block_hash: bytes) -> bool:
        """True when the table has a node for ``block_hash`` (present or a ghost)."""
        return block_hash in self.ids

    def tiers_of(self, block_hash: bytes) -> tuple[int, ...]:
        """Reference count per tier of a block (all zero when absent or a ghost)."""
        n = self.ids.get(block_hash)
        r = 0 if n is None else self.refs[n]
        return tuple((r >> (16 * t)) & _FIELD for t in range(MAX_TIERS))

    def is_rooted(self, block_hash: bytes) -> bool:
        """True when the block is present with its whole chain."""
        n = self.ids.get(block_hash)
        return n is not None and self.rooted[n] == 1

    # ------------------------------------------------------------------ stores

    def store(
        self, parent_hash: bytes | None, blocks: Sequence[StoredBlock], st: SourceStats
    ) -> None:
        """Apply a ``stored`` event: ``blocks[0]``'s parent is ``parent_hash``, block i's is
        block i-1. New blocks are linked and, when their parent is rooted, rooted."""
        self.store_hashes(
            parent_hash, [b.block_hash for b in blocks], [b.cache_level for b in blocks], st
        )

    def store_hashes(
        self,
        parent_hash: bytes | None,
        hashes: Sequence[bytes],
        level: int | Sequence[int],
        st: SourceStats,
    ) -> None:
        """:meth:`store` from columns: the blocks' hashes and their cache level (one for all,
        or one per block)."""
        ids = self.ids
        p, ok = self._store_parent(parent_hash, st)
        if type(level) is int and self._store_new(p, ok, hashes, level):
            self.present += len(hashes)
            if level:
                self.lower += len(hashes)
            self._drop_bare_ghost(parent_hash)
            return
        levels: Iterable[int] = repeat(level, len(hashes)) if isinstance(level, int) else level
        masks = self.masks
        nodes = self.hashes
        parent = self.parent
        refs = self.refs
        kid = self.kid
        rooted = self.rooted
        free = self.free
        add_hash = nodes.append
        add_parent = parent.append
        add_refs = refs.append
        add_kid = kid.append
        add_rooted = rooted.append
        setdefault = ids.setdefault
        madd = masks.add if masks is not None else None
        slot = self.slot
        nexti = len(nodes)
        last = -1
        inc = 0
        off_gpu = False
        added = lowered = 0
        for h, c in zip(hashes, levels, strict=True):
            cand = free[-1] if free else nexti
            n = setdefault(h, cand)
            if n != cand:
                self._store_existing(n, p, c, st)
                ok = rooted[n]
                p = n
                continue
            if c != last:
                last = c
                inc = _INC[c if c < _LAST else _LAST]
                off_gpu = c != 0
            if p >= 0:
                if kid[p] < 0:
                    kid[p] = n
                else:
                    self._add_more(p, n)
            if n == nexti:
                nexti += 1
                add_hash(h)
                add_parent(p)
                add_refs(inc)
                add_kid(_NIL)
                add_rooted(ok)
            else:
                free.pop()
                nodes[n] = h
                parent[n] = p
                refs[n] = inc
                kid[n] = _NIL
                rooted[n] = ok
            if ok and madd is not None:
                madd(h, slot)
            added += 1
            if off_gpu:
                lowered += 1
            p = n
        self.present += added
        self.lower += lowered
        self._drop_bare_ghost(parent_hash)

    def _store_new(self, p: int, ok: int, hashes: Sequence[bytes], level: int) -> bool:
        """The common store, in bulk: every block new to the table (and distinct), all at
        ``level``, linked as a chain under node ``p`` (rooted ``ok``); node ids as the loop
        of :meth:`store_hashes` assigns them (freed ids first, last freed first, then new
        ones). False (nothing changed) when the blocks are not all new: the caller's loop
        then stores them one by one."""
        ids = self.ids
        k = len(hashes)
        if not k or not ids.keys().isdisjoint(hashes):
            return False
        free = self.free
        first = len(self.hashes)
        nf = min(len(free), k)
        reuse = [free[-1 - j] for j in range(nf)]
        new_ids = reuse + list(range(first, first + k - nf)) if nf else range(first, first + k)
        size = len(ids)
        ids.update(zip(hashes, new_ids, strict=True))
        if len(ids) != size + k:  # a hash repeated within the event: undo, take the loop
            for h in hashes:
                ids.pop(h, None)
            return False
        for _ in range(nf):
            free.pop()
        kid = self.kid
        n0 = new_ids[0]
        if p >= 0:
            if kid[p] < 0:
                kid[p] = n0
            else:
                self._add_more(p, n0)
        inc = _INC[level if level < _LAST else _LAST]
        parents = [p, *new_ids[:-1]]
        kids = [*new_ids[1:], _NIL]
        nodes, parent, refs, rooted = self.hashes, self.parent, self.refs, self.rooted
        for j, n in enumerate(reuse):
            nodes[n] = hashes[j]
            parent[n] = parents[j]
            refs[n] = inc
            kid[n] = kids[j]
            rooted[n] = ok
        nodes.extend(hashes[nf:] if nf else hashes)
        parent.extend(parents[nf:])
        refs.extend(repeat(inc, k - nf))
        kid.extend(kids[nf:])
        rooted.extend(bytes((ok,)) * (k - nf))
        if ok and self.masks is not None:
            self.masks.add_many(hashes, self.slot)
        return True

    def _drop_bare_ghost(self, h: bytes | None) -> None:
        """Delete ``h``'s node when it is a ghost without children: the unknown parent of a
        store whose blocks the table already held (none was linked under it)."""
        if h is None:
            return
        n = self.ids.get(h)
        if n is not None and not self.refs[n] and self.kid[n] < 0:
            self._delete_up(n)

    def _store_parent(self, parent_hash: bytes | None, st: SourceStats) -> tuple[int, int]:
        """``(node, rooted)`` of a store's parent: ROOT, the known node, or a new ghost."""
        if parent_hash is None:
            return ROOT, 1
        q = self.ids.get(parent_hash)
        if q is None:
            st.unknown_parent_stores += 1
            return self._new_ghost(parent_hash), 0
        if not self.refs[q]:
            st.unknown_parent_stores += 1  # the parent is a ghost: not cached
        return q, self.rooted[q]

    def _adopt_parent(self, n: int, p: int, st: SourceStats) -> None:
        """A ghost ``n`` stored again under ``p``: learn its parent if it had none (unless that
        would close a cycle), count a disagreement otherwise."""
        q = self.parent[n]
        if q == UNKNOWN:
            if p >= 0 and self._is_ancestor(n, p):
                st.parent_mismatches += 1  # would close a cycle: keep the parent unknown
            else:
                self.parent[n] = p
                if p >= 0:
                    self._link(n, p)
        elif q != p:
            st.parent_mismatches += 1

    def _store_existing(self, n: int, p: int, level: int, st: SourceStats) -> None:
        refs = self.refs
        r = refs[n]
        t = level if level < _LAST else _LAST
        shift = 16 * t
        if r:
            st.duplicate_stores += 1
            if self.parent[n] != p:
                st.parent_mismatches += 1
            if (r >> shift) & _FIELD == _FIELD:
                st.refcount_saturated += 1
                return
            self._set_refs(n, r, r + (1 << shift))
            return
        # a ghost is stored again
        self._adopt_parent(n, p, st)
        self._set_refs(n, 0, 1 << shift)
        q = self.parent[n]
        if q == ROOT or (q >= 0 and self.rooted[q]):
            self._root_subtree(n)

    def _new_ghost(self, h: bytes) -> int:
        return self._alloc(h, UNKNOWN)

    def _alloc(self, h: bytes, p: int) -> int:
        if self.free:
            n = self.free.pop()
            self.hashes[n] = h
            self.parent[n] = p
            self.refs[n] = 0
            self.kid[n] = _NIL
            self.rooted[n] = 0
        else:
            n = len(self.hashes)
            self.hashes.append(h)
            self.parent.append(p)
            self.refs.append(0)
            self.kid.append(_NIL)
            self.rooted.append(0)
        self.ids[h] = n
        if p >= 0:
            self._link(n, p)
        return n

    def _add_more(self, p: int, n: int) -> None:
        s = self.more.get(p)
        if s is None:
            self.more[p] = {n}
        else:
            s.add(n)

    def _link(self, n: int, p: int) -> None:
        if self.kid[p] < 0:
            self.kid[p] = n
        else:
            self._add_more(p, n)

    def _unlink(self, n: int) -> None:
        p = self.parent[n]
        if p < 0:
            return
        s = self.more.get(p)
        if self.kid[p] == n:
            if s:
                self.kid[p] = s.pop()
                if not s:
                    del self.more[p]
            else:
                self.kid[p] = _NIL
        elif s is not None:
            s.discard(n)
            if not s:
                del self.more[p]

    def children(self, n: int) -> list[int]:
        """Node ids of ``n``'s children."""
        first = self.kid[n]
        if first < 0:
            return []
        s = self.more.get(n)
        return [first, *s] if s else [first]

    def _is_ancestor(self, n: int, p: int) -> bool:
        """True when ``n`` is ``p`` or one of its ancestors (bounded by the node count)."""
        parent = self.parent
        x = p
        for _ in range(len(parent) + 1):
            if x == n:
                return True
            if x < 0:
                return False
            x = parent[x]
        return True  # pragma: no cover - a cycle already exists: refuse

    def _set_refs(self, n: int, old: int, new: int) -> None:
        """Write packed counts, keeping the ``present``/``lower`` gauges right."""
        self.refs[n] = new
        self.present += (new != 0) - (old != 0)
        self.lower += (new != 0 and not new & _FIELD) - (old != 0 and not old & _FIELD)

    # ------------------------------------------------------------------ rooting

    def _root_subtree(self, n: int) -> None:
        masks = self.masks
        slot = self.slot
        refs = self.refs
        rooted = self.rooted
        kid = self.kid
        more = self.more
        mkeys = self.mkeys
        stack = [n]
        while stack:
            x = stack.pop()
            if rooted[x] or not refs[x]:
                continue
            rooted[x] = 1
            if masks is not None:
                masks.add(mkeys[x], slot)
            c = kid[x]
            if c >= 0:
                stack.append(c)
                extra = more.get(x)
                if extra:
                    stack.extend(extra)

    def _unroot_subtree(self, n: int) -> None:
        masks = self.masks
        slot = self.slot
        rooted = self.rooted
        kid = self.kid
        more = self.more
        mkeys = self.mkeys
        kdup = self.kdup
        stack = [n]
        while stack:
            x = stack.pop()
            if not rooted[x]:
                continue
            rooted[x] = 0
            if masks is not None:
                h = mkeys[x]
                if kdup and h in kdup and self._shared_rooted(h, x):
                    pass  # another rooted node of this table has the key: keep the bit
                else:
                    masks.discard(h, slot)
            c = kid[x]
            if c >= 0:
                stack.append(c)
                extra = more.get(x)
                if extra:
                    stack.extend(extra)

    # ------------------------------------------------------------------ removals

    def remove(self, block_hashes: Iterable[bytes], level: int | None, st: SourceStats) -> None:
        """Apply a ``removed`` event: one reference per hash leaves ``level`` (or the deepest
        level holding the block when ``level`` is None or does not hold it)."""
        self._remove_py(block_hashes, level, st)

    def _remove_py(self, block_hashes: Iterable[bytes], level: int | None, st: SourceStats) -> None:
        get = self.ids.get
        refs = self.refs
        kid = self.kid
        rooted = self.rooted
        for h in block_hashes:
            n = get(h)
            r = 0 if n is None else refs[n]
            if n is None or not r:
                st.unknown_removes += 1
                continue
            if r == 1 and not level and kid[n] < 0 and not self.kdup:
                # the common eviction, inline: a leaf's only reference, on the GPU
                refs[n] = 0
                self.present -= 1
                if rooted[n]:
                    rooted[n] = 0
                    if self.masks is not None:
                        self.masks.discard(self.mkeys[n], self.slot)
                self._delete_up(n)
                continue
            if level is None:
                t = _deepest(r) if r >> 16 else 0
            else:
                t = level if level < _LAST else _LAST
                if not (r >> (16 * t)) & _FIELD:
                    st.tier_mismatches += 1
                    t = _deepest(r)
            new = r - (1 << (16 * t))
            if new:
                st.refcounted_removes += 1
                self._set_refs(n, r, new)
                continue
            self._set_refs(n, r, 0)
            if self.rooted[n]:
                if self.kid[n] < 0:
                    self.rooted[n] = 0
                    masks = self.masks
                    if masks is not None:
                        k = self.mkeys[n]
                        if self.kdup and k in self.kdup and self._shared_rooted(k, n):
                            pass  # another rooted node of this table has the key
                        else:
                            masks.discard(k, self.slot)
                else:
                    self._unroot_subtree(n)
            if self.kid[n] < 0:
                self._delete_up(n)

    def _delete_up(self, n: int) -> None:
        """Delete childless non-present node ``n`` and then any ghost ancestors it leaves
        childless."""
        refs = self.refs
        kid = self.kid
        while True:
            p = self.parent[n]
            self._unlink(n)
            del self.ids[self.hashes[n]]
            self.hashes[n] = b""
            self.parent[n] = UNKNOWN
            self.rooted[n] = 0
            self.free.append(n)
            if p < 0 or refs[p] or kid[p] >= 0:
                return
            n = p

    # ------------------------------------------------------------------ updates

    def update(self, block_hash: bytes, old: int, new: int, st: SourceStats) -> None:
        """Apply an ``updated`` event's tier move: one reference goes from ``old`` to ``new``
        (from the deepest level holding it when ``old`` holds none)."""
        n = self.ids.get(block_hash)
        r = 0 if n is None else self.refs[n]
        if n is None or not r:
            st.unknown_updates += 1
            return
        t_old = old if old < _LAST else _LAST
        t_new = new if new < _LAST else _LAST
        if not (r >> (16 * t_old)) & _FIELD:
            st.tier_mismatches += 1
            t_old = _deepest(r)
        moved = r - (1 << (16 * t_old))
        if (moved >> (16 * t_new)) & _FIELD == _FIELD:
            st.refcount_saturated += 1
            return
        self._set_refs(n, r, moved + (1 << (16 * t_new)))

    # ------------------------------------------------------------------ whole table

    def clear(self) -> None:
        """Forget every block (and take this worker's bits out of the domain masks)."""
        self.detach()
        self.ids = {}
        self.hashes = _atoms([])
        self.mkeys = self.hashes
        self.kdup = {}
        self.parent = _ints()
        self.refs = _ints(unsigned=True)
        self.kid = _ints()
        self.more = {}
        self.rooted = bytearray()
        self.free = _ints()
        self.present = 0
        self.lower = 0

    def attach(self, masks: MaskMap) -> None:
        """Mirror the rooted blocks into ``masks`` (a domain's) from now on."""
        if self.masks is masks:
            return
        self.detach()
        masks.reserve(self.slot)
        self.masks = masks
        slot = self.slot
        for h in self.mirrored():
            masks.add(h, slot)

    def detach(self) -> None:
        """Take this worker's bits out of its domain's masks and stop mirroring."""
        masks = self.masks
        if masks is None:
            return
        self.masks = None
        slot = self.slot
        for h in self.mirrored():
            masks.discard(h, slot)

    def mirrored(self) -> list[bytes]:
        """The mirror keys of the rooted nodes (what the table puts in a domain's masks;
        a key shared by several nodes appears once per node)."""
        mkeys = self.mkeys
        rooted = self.rooted
        return [mkeys[n] for n in self.ids.values() if rooted[n]]

    def _shared_rooted(self, key: bytes, n: int) -> bool:
        """True when a rooted node other than ``n`` is mirrored under ``key`` (derived keys
        only: hashes are unique per table, so :attr:`kdup` stays empty)."""
        return False

    # ------------------------------------------------------------------ matching

    def weighted(self, hashes: Sequence[bytes], depth: int, weights: Sequence[float]) -> float:
        """Sum over ``hashes[:depth]`` of the weight of the best tier holding each block."""
        if not self.lower:
            return depth * weights[0]
        get = self.ids.get
        refs = self.refs
        w0 = weights[0]
        total = 0.0
        for h in hashes[:depth]:
            n = get(h)
            r = 0 if n is None else refs[n]
            if r & _FIELD:
                total += w0
            elif r:
                total += weights[min(best_tier(r), len(weights) - 1)]
        return total

    def _refs_of(self, key: bytes) -> int:
        """The packed tier counts of the block matched under ``key`` (0: none)."""
        n = self.ids.get(key)
        return 0 if n is None else self.refs[n]

    def tier_depths(self, hashes: Sequence[bytes], depth: int) -> tuple[int, int, int]:
        """How far the first ``depth`` (matched) blocks of ``hashes`` reach when only GPU
        copies count, GPU or host, and GPU, host or disk: ``(gpu, host, disk)`` in blocks."""
        if not self.lower:
            return depth, depth, depth
        gpu = host = disk = depth
        refs_of = self._refs_of
        for i, h in enumerate(hashes[:depth]):
            r = refs_of(h)
            if gpu == depth and not r & _TIERS_UP_TO[0]:
                gpu = i
            if host == depth and not r & _TIERS_UP_TO[1]:
                host = i
            if not r & _TIERS_UP_TO[2]:
                disk = i
                break
        return gpu, host, disk

    def walk(self, hashes: Sequence[bytes]) -> int:
        """Rooted prefix length of ``hashes`` in this table, walked block by block (the
        reference the mask search is checked against)."""
        get = self.ids.get
        rooted = self.rooted
        d = 0
        for h in hashes:
            n = get(h)
            if n is None or not rooted[n]:
                break
            d += 1
        return d

    # ------------------------------------------------------------------ state

    def nodes(self) -> list[tuple[bytes, bytes | int | None, int]]:
        """Every node as ``(hash, parent, refs)``: parent is a hash, None at the root, or
        :data:`UNKNOWN` for a ghost whose parent was never announced. Sorted by hash."""
        hashes = self.hashes
        out: list[tuple[bytes, bytes | int | None, int]] = []
        for h, n in self.ids.items():
            p = self.parent[n]
            ref: bytes | int | None = None if p == ROOT else UNKNOWN if p == UNKNOWN else hashes[p]
            out.append((h, ref, self.refs[n]))
        out.sort(key=lambda t: t[0])
        return out

    def load_nodes(self, nodes: Sequence[tuple[bytes, int, int]]) -> None:
        """Replace the contents with ``nodes``: ``(hash, parent index into nodes or ROOT or
        UNKNOWN, refs)``; rooted flags (and mask bits, when attached) are recomputed."""
        masks = self._load_structure(nodes)
        self.masks = masks
        self._root_all()

    def _load_structure(self, nodes: Sequence[tuple[bytes, int, int]]) -> MaskMap | None:
        """Replace the contents with ``nodes``, unrooted and detached; returns the masks the
        table was attached to."""
        masks = self.masks
        self.clear()
        n_nodes = len(nodes)
        self.hashes = _atoms([h for h, _, _ in nodes])
        self.mkeys = self.hashes
        self.parent = _ints([p for _, p, _ in nodes])
        self.refs = _ints([r for _, _, r in nodes], unsigned=True)
        self.kid = _ints([_NIL] * n_nodes)
        self.more = {}
        self.rooted = bytearray(n_nodes)
        self.ids = {h: i for i, h in enumerate(self.hashes)}
        if len(self.ids) != n_nodes:
            raise ValueError("duplicate block hashes in a table")
        for i, p in enumerate(self.parent):
            if p >= n_nodes or p < UNKNOWN:
                raise ValueError(f"node {i} has parent index {p} outside the table")
            if p >= 0:
                self._link(i, p)
        for r in self.refs:
            if r:
                self.present += 1
                if not r & _FIELD:
                    self.lower += 1
        return masks

    def _root_all(self) -> None:
        for i, p in enumerate(self.parent):
            if p == ROOT and self.refs[i]:
                self._root_subtree(i)

    def dump_nodes(self) -> tuple[list[bytes], list[int], list[int]]:
        """Compact ``(hashes, parent indices, refs)`` for :meth:`load_nodes` (snapshots)."""
        order = list(self.ids.values())
        index = {n: i for i, n in enumerate(order)}
        parent = self.parent
        out_p: list[int] = []
        for n in order:
            p = parent[n]
            out_p.append(index[p] if p >= 0 else p)
        return [self.hashes[n] for n in order], out_p, [self.refs[n] for n in order]

    def check(self) -> None:
        """Verify the internal invariants (tests): links, gauges, rooted flags, masks."""
        present = lower = 0
        mirrored = set(self.mirrored())
        for h, n in self.ids.items():
            assert self.hashes[n] == h
            r = self.refs[n]
            if r:
                present += 1
                lower += not r & _FIELD
            else:
                assert self.kid[n] >= 0, "a ghost without children"
            p = self.parent[n]
            want = bool(r) and (p == ROOT or (p >= 0 and self.rooted[p] == 1))
            assert self.rooted[n] == want, f"rooted flag of node {n}"
            k = self.mkeys[n]
            if self.masks is not None and k:
                assert bool(self.masks.get(k, 0) & self.bit) == (k in mirrored), "mask bit"
            for c in self.children(n):
                assert self.parent[c] == n, "child link"
                assert self.hashes[c] in self.ids, "child is a live node"
            if p >= 0:
                assert n in self.children(p), "parent link"
        assert present == self.present, (present, self.present)
        assert lower == self.lower, (lower, self.lower)

    def __repr__(self) -> str:
        return f"<GroupTable nodes={len(self.ids)} present={self.present}>"

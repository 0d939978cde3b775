"""One worker's blocks of one layer group, navigated by token-derived keys.

A :class:`TokenGroupTable` is a :class:`~kvstream.index.table.GroupTable` (the same tree of
engine hashes, reference counts per tier, ghosts and rooting rules) whose blocks are mirrored
into the domain's masks under their canonical key (:mod:`kvstream.index.keys`) instead of
the engine's hash. The engine hash stays the block's id: ``removed`` and ``updated`` events,
which carry only engine hashes, find the node through ``ids`` and so resolve to the key
(``engine hash -> canonical key`` per worker and layer group, as Dynamo and llm-d keep it).

Keys: a block's key needs its parent's key. A block stored under a parent whose key is
unknown (a store with an unknown parent) keeps its key *pending* (its payload is kept) and
gets it when the chain above becomes known, exactly when it could become rooted; so every
rooted block has a key and only rooted blocks are matchable, as in engine mode.

Stores without token ids (vLLM offload placeholders: ``token_ids=[]``) cannot be keyed. A
placeholder for a block the table knows (it holds the block's key or payload: a tier change)
adds a reference at its level like any store (counted in ``tokenless_resolved``); one for an
unknown block is skipped and counted (``tokenless_skipped``), never guessed, and a block
after it in the same event hangs off it as off an unknown parent.

With ``dynamo=True`` a block's content is Dynamo's local hash of its tokens instead of the
tokens themselves (:func:`~kvstream.index.keys.dynamo_payload`, ``key_mode="dynamo"``); every
rule above is the same.

Two engine hashes may map to one key in a table (an engine hashing something the events do
not carry, e.g. vLLM's LoRA path): the worker's bit stays in the masks while any rooted node
holds the key (:attr:`kdup` lists the extra nodes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, TypeGuard

from kvstream._native import load as load_native
from kvstream.events.model import StoredBlock
from kvstream.hashing.xxh3 import xxh3_64, xxh3_128
from kvstream.index.keys import (
    KEY_SIZE,
    ROOT_KEY,
    block_payload,
    chain_key,
    dynamo_key,
    dynamo_payload,
)
from kvstream.index.stats import SourceStats
from kvstream.index.table import _FIELD, _INC, _LAST, _NIL, ROOT, UNKNOWN, GroupTable, best_tier

__all__ = [
    "TOKEN_TABLE_TYPES",
    "TokenGroupTable",
    "event_payloads",
    "is_token_table",
    "token_payloads",
    "token_table_type",
]

_DEFERRED: Final = -3  # the parent is a skipped placeholder: resolve it by hash when needed
_LOCAL: Final = 8  # bytes of a Dynamo local hash
_xxh3_be: Final = xxh3_64  # local_hash (seeded) and link_hash, for the per-block loops


def event_payloads(
    blocks: Sequence[StoredBlock], parent_hash: bytes | None, dynamo: bool
) -> tuple[list[bytes], list[int], list[bytes], list[bool] | None]:
    """A stored event's ``(hashes, levels, payloads, scoped)`` from its model blocks, as
    :meth:`TokenGroupTable.store_payloads` takes them: each block's payload is its raw u32 LE
    tokens (plain), its CBOR scope (scoped: :func:`~kvstream.index.keys.block_payload`), its
    Dynamo local hash (``dynamo``), or b"" when it has no tokens; ``scoped`` is None when no
    block is scoped. The cache salt counts on the first block of a chain (``parent_hash``
    None) only."""
    hashes: list[bytes] = []
    levels: list[int] = []
    payloads: list[bytes] = []
    scoped: list[bool] | None = None
    first = parent_hash is None
    for i, b in enumerate(blocks):
        # the model's fields, read from its __dict__ (pydantic keeps them there): a third
        # cheaper than attribute access, which matters at ~10 reads per block
        d = b.__dict__
        hashes.append(d["block_hash"])
        levels.append(d["cache_level"])
        raw = d["token_ids"].raw
        sc = False
        if not raw:
            payload = b""
        elif dynamo:
            payload = dynamo_payload(d, raw)
        elif (  # the common case, checked inline: token ids and nothing else
            d["extra_keys"] is None
            and d["lora_name"] is None
            and d["lora_id"] is None
            and d["token_extra_ids"] is None
            and not d["mm_keys"]
            and (d["cache_salt"] is None or not first)
        ):
            payload = raw
        else:
            payload, sc = block_payload(b, first)
        first = False
        payloads.append(payload)
        if sc:
            if scoped is None:
                scoped = [False] * i
            scoped.append(True)
        elif scoped is not None:
            scoped.append(False)
    return hashes, levels, payloads, scoped


def token_payloads(
    tokens: bytes | memoryview, sizes: Sequence[int], seed: int, dynamo: bool
) -> list[bytes]:
    """The payloads of plain blocks from their u32 LE ``tokens`` and token counts ``sizes``
    (b"" for a block of 0 tokens): the raw tokens, or their Dynamo local hash under
    ``seed``. ValueError when the sizes do not cover ``tokens`` exactly."""
    view = memoryview(tokens)
    if 4 * sum(sizes) != len(view) or min(sizes, default=0) < 0:
        raise ValueError(f"store_tokens: the sizes need {4 * sum(sizes)} bytes of tokens")
    out: list[bytes] = []
    append = out.append
    off = 0
    if dynamo:  # local_hash inlined: XXH3-64 of each block's bytes, read in place
        xxh3 = _xxh3_be
        for size in sizes:
            end = off + 4 * size
            append(xxh3(view[off:end], seed) if size else b"")
            off = end
        return out
    data = view.tobytes()
    for size in sizes:
        end = off + 4 * size
        append(data[off:end])
        off = end
    return out


class TokenGroupTable(GroupTable):
    """The blocks of one (worker, layer group), mirrored under canonical keys."""

    __slots__ = ("ckeys", "dynamo", "kmap", "pending")

    def __init__(self, bit: int, dynamo: bool = False) -> None:
        super().__init__(bit)
        #: key blocks by Dynamo's local hash of their tokens (``key_mode="dynamo"``)
        self.dynamo = dynamo
        #: node -> its canonical key (b"" while unknown); the table's mirror keys
        self.ckeys: list[bytes] = []
        self.mkeys = self.ckeys
        #: canonical key -> a node holding it (others in ``kdup``)
        self.kmap: dict[bytes, int] = {}
        #: node -> (payload, scoped) of a block whose parent's key is not known yet
        self.pending: dict[int, tuple[bytes, bool]] = {}

    # ------------------------------------------------------------------ keys

    def key_of(self, block_hash: bytes) -> bytes | None:
        """The canonical key of the block the engine calls ``block_hash`` (None when the
        block is unknown or its key is not known yet)."""
        n = self.ids.get(block_hash)
        return (self.ckeys[n] or None) if n is not None else None

    def _known(self, n: int) -> bool:
        """True when node ``n`` has content (a key or a pending payload)."""
        return bool(self.ckeys[n]) or n in self.pending

    def _set_key(self, n: int, key: bytes) -> None:
        self.ckeys[n] = key
        first = self.kmap.setdefault(key, n)
        if first != n:
            dup = self.kdup.get(key)
            if dup is None:
                self.kdup[key] = {n}
            else:
                dup.add(n)

    def _drop_key(self, n: int) -> None:
        key = self.ckeys[n]
        if not key:
            self.pending.pop(n, None)
            return
        self.ckeys[n] = b""
        dup = self.kdup.get(key)
        if self.kmap.get(key) == n:
            if dup:
                self.kmap[key] = dup.pop()
                if not dup:
                    del self.kdup[key]
            else:
                del self.kmap[key]
        elif dup is not None:
            dup.discard(n)
            if not dup:
                del self.kdup[key]

    def _resolve(self, n: int) -> None:
        """Key ``n`` and its pending descendants whose parent keys are now known."""
        pending = self.pending
        if n not in pending:
            return
        ckeys = self.ckeys
        parent = self.parent
        stack = [n]
        while stack:
            x = stack.pop()
            item = pending.get(x)
            if item is None:
                continue
            q = parent[x]
            pk = ROOT_KEY if q == ROOT else ckeys[q] if q >= 0 else b""
            if not pk:
                continue
            del pending[x]
            self._set_key(x, dynamo_key(pk, item[0]) if self.dynamo else chain_key(pk, *item))
            stack.extend(self.children(x))

    def _shared_rooted(self, key: bytes, n: int) -> bool:
        rooted = self.rooted
        x = self.kmap.get(key)
        if x is not None and x != n and rooted[x]:
            return True
        return any(y != n and rooted[y] for y in self.kdup.get(key, ()))

    # ------------------------------------------------------------------ stores

    def _parent(self, parent_hash: bytes | None, st: SourceStats) -> tuple[int, int, bytes]:
        """``(node, rooted, key)`` of a store's parent (a new ghost when unknown)."""
        if parent_hash is None:
            return ROOT, 1, ROOT_KEY
        q = self.ids.get(parent_hash)
        if q is None:
            st.unknown_parent_stores += 1
            return self._alloc(parent_hash, UNKNOWN), 0, b""
        if not self.refs[q]:
            st.unknown_parent_stores += 1  # the parent is a ghost: not cached
        return q, self.rooted[q], self.ckeys[q]

    def store_hashes(
        self,
        parent_hash: bytes | None,
        hashes: Sequence[bytes],
        level: int | Sequence[int],
        st: SourceStats,
    ) -> None:
        """Not available: a token-keyed table keys blocks by their tokens (use :meth:`store`
        with the blocks); TypeError."""
        raise TypeError("a token-keyed table needs the stored blocks' tokens: call store()")

    def store(
        self, parent_hash: bytes | None, blocks: Sequence[StoredBlock], st: SourceStats
    ) -> None:
        """Apply a ``stored`` event (see :meth:`GroupTable.store`), keying each block by its
        tokens and its parent's key; placeholders are resolved or skipped (module doc)."""
        self.store_payloads(parent_hash, *event_payloads(blocks, parent_hash, self.dynamo), st)

    def store_tokens(  # noqa: PLR0917  (positional: the native twin's call)
        self,
        parent_hash: bytes | None,
        hashes: Sequence[bytes],
        level: int | Sequence[int],
        tokens: bytes | memoryview,
        sizes: Sequence[int],
        seed: int,
        st: SourceStats,
    ) -> None:
        """Apply a ``stored`` event of plain blocks (token ids only: no LoRA, salt,
        multimodal or extra keys) from columns: ``tokens`` every block's u32 LE token ids in
        order, ``sizes`` each block's token count (0: a placeholder without tokens), ``seed``
        the Dynamo local-hash seed (``dynamo`` tables). ValueError when the sizes do not
        cover ``tokens``."""
        self.store_payloads(
            parent_hash, hashes, level, token_payloads(tokens, sizes, seed, self.dynamo), None, st
        )

    def store_payloads(  # noqa: PLR0917  (positional: the native twin's call)
        self,
        parent_hash: bytes | None,
        hashes: Sequence[bytes],
        level: int | Sequence[int],
        payloads: Sequence[bytes],
        scoped: Sequence[bool] | None,
        st: SourceStats,
    ) -> None:
        """Apply a ``stored`` event given each block's payload (:func:`event_payloads`): b""
        for a placeholder without tokens; ``scoped`` None when no block is scoped. The rules
        of the module docstring; ValueError for a Dynamo payload that is not 8 bytes."""
        ids = self.ids
        get = ids.get
        hashes_ = self.hashes
        parent = self.parent
        refs = self.refs
        kid = self.kid
        rooted = self.rooted
        ckeys = self.ckeys
        free = self.free
        kmap_set = self.kmap.setdefault
        masks = self.masks
        slot = self.slot
        xxh = xxh3_128
        xxh3_be = _xxh3_be
        dyn = self.dynamo
        one = level if isinstance(level, int) else None
        p, ok, pkey = self._parent(parent_hash, st)
        skipped = b""
        added = lowered = 0
        for i, h in enumerate(hashes):
            c = one if one is not None else level[i]  # type: ignore[index]
            payload = payloads[i]
            if not payload:
                n = get(h)
                if n is None or not (refs[n] or self._known(n)):
                    st.tokenless_skipped += 1
                    p, ok, pkey, skipped = _DEFERRED, 0, b"", h
                else:
                    st.tokenless_resolved += 1
                    self._store_known(n, c, st)
                    p, ok, pkey = n, rooted[n], ckeys[n]
                continue
            if dyn and len(payload) != _LOCAL:
                raise ValueError(
                    f"a Dynamo-keyed payload is an {_LOCAL}-byte local hash, got {len(payload)}"
                )
            sc = bool(scoped[i]) if scoped is not None else False
            deferred = p == _DEFERRED
            if deferred:
                p, ok, pkey = self._parent(skipped, st)
            n = get(h)
            if n is not None:
                self._store_existing_keyed(n, p, c, (payload, sc), st)
                p, ok, pkey = n, rooted[n], ckeys[n]
                if deferred:  # the skipped parent's ghost, if nothing hangs off it
                    self._drop_bare_ghost(skipped)
                continue
            # a new node, allocated inline (as GroupTable.store does: ~a microsecond a block)
            inc = _INC[c if c < _LAST else _LAST]
            if free:
                n = free.pop()
                hashes_[n] = h
                parent[n] = p
                refs[n] = inc
                kid[n] = _NIL
                rooted[n] = ok
                ckeys[n] = b""
            else:
                n = len(hashes_)
                hashes_.append(h)
                parent.append(p)
                refs.append(inc)
                kid.append(_NIL)
                rooted.append(ok)
                ckeys.append(b"")
            ids[h] = n
            if p >= 0:
                if kid[p] < 0:
                    kid[p] = n
                else:
                    self._add_more(p, n)
            if pkey:
                if dyn:  # link_hash(pkey, payload) + payload, inlined
                    pkey = xxh3_be(pkey + payload) + payload
                elif sc:
                    pkey = chain_key(pkey, payload, True)
                else:
                    pkey = xxh(pkey + payload)
                ckeys[n] = pkey
                if kmap_set(pkey, n) != n:
                    self._set_key(n, pkey)  # a second node with this key
                if ok and masks is not None:
                    masks.add(pkey, slot)
            else:
                self.pending[n] = (payload, sc)
            added += 1
            if c:
                lowered += 1
            p = n
        self.present += added
        self.lower += lowered
        self._drop_bare_ghost(parent_hash)
        if skipped:
            self._drop_bare_ghost(skipped)

    def _alloc(self, h: bytes, p: int) -> int:
        n = super()._alloc(h, p)
        if n == len(self.ckeys):
            self.ckeys.append(b"")
        else:
            self.ckeys[n] = b""
        return n

    def _store_existing_keyed(
        self, n: int, p: int, level: int, content: tuple[bytes, bool], st: SourceStats
    ) -> None:
        """A store of a block the table has: a reference more, or a ghost stored again (which
        gets the payload if it had none, then its key once the parent's is known)."""
        r = self.refs[n]
        if r:
            self._store_existing(n, p, level, st)  # a duplicate: reference counted
            return
        t = level if level < _LAST else _LAST
        self._adopt_parent(n, p, st)
        if not self._known(n):
            self.pending[n] = content
        self._resolve(n)
        self._set_refs(n, 0, 1 << (16 * t))
        q = self.parent[n]
        if q == ROOT or (q >= 0 and self.rooted[q]):
            self._root_subtree(n)

    def _store_known(self, n: int, level: int, st: SourceStats) -> None:
        """A placeholder store of a known block: one reference more at ``level``."""
        r = self.refs[n]
        shift = 16 * (level if level < _LAST else _LAST)
        if (r >> shift) & _FIELD == _FIELD:
            st.refcount_saturated += 1
            return
        self._set_refs(n, r, r + (1 << shift))
        if not r:
            q = self.parent[n]
            if q == ROOT or (q >= 0 and self.rooted[q]):
                self._root_subtree(n)

    # ------------------------------------------------------------------ removals

    def _delete_up(self, n: int) -> None:
        refs = self.refs
        kid = self.kid
        while True:
            p = self.parent[n]
            self._unlink(n)
            self._drop_key(n)
            del self.ids[self.hashes[n]]
            self.hashes[n] = b""
            self.parent[n] = UNKNOWN
            self.rooted[n] = 0
            self.free.append(n)
            if p < 0 or refs[p] or kid[p] >= 0:
                return
            n = p

    def clear(self) -> None:
        """Forget every block (and take this worker's bits out of the domain masks)."""
        super().clear()
        self.ckeys = []
        self.mkeys = self.ckeys
        self.kmap = {}
        self.pending = {}

    # ------------------------------------------------------------------ matching

    def _nodes_of(self, key: bytes) -> list[int]:
        n = self.kmap.get(key)
        if n is None:
            return []
        dup = self.kdup.get(key) if self.kdup else None
        return [n, *dup] if dup else [n]

    def weighted(self, hashes: Sequence[bytes], depth: int, weights: Sequence[float]) -> float:
        """Like :meth:`GroupTable.weighted`, for canonical keys (a key held by several
        nodes counts its best tier among the rooted ones)."""
        if not self.lower:
            return depth * weights[0]
        refs = self.refs
        rooted = self.rooted
        total = 0.0
        for k in hashes[:depth]:
            r = 0
            for n in self._nodes_of(k):
                if rooted[n]:
                    r |= refs[n]
            if r & _FIELD:
                total += weights[0]
            elif r:
                total += weights[min(best_tier(r), len(weights) - 1)]
        return total

    def _refs_of(self, key: bytes) -> int:
        r = 0
        rooted = self.rooted
        for n in self._nodes_of(key):
            if rooted[n]:
                r |= self.refs[n]
        return r

    def walk(self, hashes: Sequence[bytes]) -> int:
        """Rooted prefix length of the canonical keys ``hashes``, block by block."""
        rooted = self.rooted
        d = 0
        for k in hashes:
            if not any(rooted[n] for n in self._nodes_of(k)):
                break
            d += 1
        return d

    # ------------------------------------------------------------------ state

    def cached_blocks(self) -> list[tuple[bytes, bytes | None, bytes, int]]:
        """Every cached, keyed block as ``(engine hash, parent's engine hash or None at the
        root, key, packed tier counts)``, parents before children (a full-state dump)."""
        hashes = self.hashes
        parent = self.parent
        refs = self.refs
        ckeys = self.ckeys
        out: list[tuple[bytes, bytes | None, bytes, int]] = []
        stack = [n for n in self.ids.values() if parent[n] in (ROOT, UNKNOWN)]
        while stack:
            n = stack.pop()
            if refs[n] and ckeys[n]:
                p = parent[n]
                out.append((hashes[n], hashes[p] if p >= 0 else None, ckeys[n], refs[n]))
            stack.extend(self.children(n))
        return out

    def keys(self) -> list[tuple[bytes, bytes, tuple[bytes, bool] | None]]:
        """Every node as ``(hash, key or b"", pending payload or None)``, sorted by hash."""
        out = [(h, self.ckeys[n], self.pending.get(n)) for h, n in self.ids.items()]
        out.sort(key=lambda t: t[0])
        return out

    def dump_keys(self) -> tuple[list[bytes], list[tuple[int, bytes, bool]]]:
        """``(keys, pending)`` in :meth:`dump_nodes` order: each node's key (b"" when
        unknown) and ``(node index, payload, scoped)`` of every pending payload."""
        order = list(self.ids.values())
        keys = [self.ckeys[n] for n in order]
        pending = self.pending
        return keys, [(i, *pending[n]) for i, n in enumerate(order) if n in pending]

    def load_nodes(self, nodes: Sequence[tuple[bytes, int, int]]) -> None:
        """Not for a token-keyed table (its keys cannot be recomputed without the tokens):
        ValueError; use :meth:`load_keyed`."""
        raise ValueError("a token-keyed table is loaded with its keys: use load_keyed()")

    def load_keyed(
        self,
        nodes: Sequence[tuple[bytes, int, int]],
        keys: Sequence[bytes],
        pending: Sequence[tuple[int, bytes, bool]],
    ) -> None:
        """Replace the contents (:meth:`load_nodes` plus :meth:`dump_keys` output).
        ValueError when the keys contradict the tree (a cached block without content, a key
        under a parent without one, a wrong key size)."""
        masks = self._load_structure(nodes)
        n_nodes = len(nodes)
        if len(keys) != n_nodes:
            raise ValueError(f"{len(keys)} keys for {n_nodes} nodes")
        self.ckeys = [b""] * n_nodes
        self.mkeys = self.ckeys
        self.kmap = {}
        self.kdup = {}
        self.pending = {}
        for i, k in enumerate(keys):
            if k:
                if len(k) != KEY_SIZE:
                    raise ValueError(f"node {i} has a {len(k)}-byte key")
                self._set_key(i, bytes(k))
        for i, payload, scoped in pending:
            if not 0 <= i < n_nodes or self.ckeys[i] or i in self.pending:
                raise ValueError(f"pending payload for node {i} is out of place")
            self.pending[i] = (bytes(payload), bool(scoped))
        for i in range(n_nodes):
            q = self.parent[i]
            if self.refs[i] and not self._known(i):
                raise ValueError(f"cached node {i} has neither a key nor a payload")
            if self.ckeys[i] and q != ROOT and (q < 0 or not self.ckeys[q]):
                raise ValueError(f"node {i} has a key but its parent has none")
            if i in self.pending and (q == ROOT or (q >= 0 and self.ckeys[q])):
                raise ValueError(f"node {i} is pending under a keyed parent")
        self.masks = masks
        self._root_all()

    def check(self) -> None:
        """:meth:`GroupTable.check` plus the key invariants: every cached block has content,
        keys chain from keyed parents, pending blocks wait for an unkeyed parent, rooted
        blocks are keyed, and the key map lists exactly the keyed nodes."""
        super().check()
        assert len(self.ckeys) == len(self.hashes), "keys out of step with nodes"
        listed: dict[bytes, set[int]] = {}
        for k, n in self.kmap.items():
            listed.setdefault(k, set()).add(n)
        for k, dup in self.kdup.items():
            assert dup, "an empty duplicate set"
            assert k in self.kmap, "duplicates of an unmapped key"
            listed[k] |= dup
        keyed: dict[bytes, set[int]] = {}
        for n in self.ids.values():
            k = self.ckeys[n]
            q = self.parent[n]
            if self.refs[n]:
                assert self._known(n), f"cached node {n} without content"
            if self.rooted[n]:
                assert k, f"rooted node {n} without a key"
            if k:
                assert n not in self.pending, f"node {n} keyed and pending"
                assert q == ROOT or (q >= 0 and self.ckeys[q]), f"node {n} keyed under no key"
                keyed.setdefault(k, set()).add(n)
            elif n in self.pending:
                assert q == UNKNOWN or (q >= 0 and not self.ckeys[q]), f"node {n} not resolved"
        assert keyed == listed, "key map differs from the nodes' keys"

    def __repr__(self) -> str:
        return (
            f"<TokenGroupTable nodes={len(self.ids)} present={self.present} "
            f"pending={len(self.pending)}>"
        )


def _native_token_table() -> type | None:
    """``kvstream._native._index.TokenTable`` (this interface and these semantics, its state
    in C) with :meth:`TokenGroupTable.store` for model blocks; None when not built or
    switched off by ``KVSTREAM_NO_NATIVE=1``."""
    base: Any = getattr(load_native("kvstream._native._index"), "TokenTable", None)
    if base is None:
        return None

    class NativeTokenTable(base):  # type: ignore[misc]
        """The native token-keyed table (see :class:`TokenGroupTable`)."""

        __slots__ = ()

        def store(
            self, parent_hash: bytes | None, blocks: Sequence[StoredBlock], st: SourceStats
        ) -> None:
            """:meth:`TokenGroupTable.store`."""
            payloads = event_payloads(blocks, parent_hash, self.dynamo)
            self.store_payloads(parent_hash, *payloads, st)

    NativeTokenTable.__qualname__ = "NativeTokenTable"
    return NativeTokenTable


_NATIVE_TABLE: Final = _native_token_table()
#: Every token-keyed table type (for isinstance): the Python twin and the native one.
TOKEN_TABLE_TYPES: Final[tuple[type, ...]] = (TokenGroupTable,) + (
    () if _NATIVE_TABLE is None else (_NATIVE_TABLE,)
)


def token_table_type() -> Callable[[int, bool], TokenGroupTable]:
    """The token-keyed table a new index uses: the native one when built (and not switched
    off), else :class:`TokenGroupTable` (same interface and semantics)."""
    native: Any = _NATIVE_TABLE
    return native or TokenGroupTable


def is_token_table(table: object) -> TypeGuard[TokenGroupTable]:
    """True for a token-keyed table, the Python twin or the native one (same interface)."""
    return isinstance(table, TOKEN_TABLE_TYPES)

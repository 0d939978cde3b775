"""The event emitter: what a paged KV-cache manager records into on the engine thread.

The cache manager depends only on :class:`EventRecorder`. :class:`EventEmitter` implements
it with the semantics of DESIGN §2.2 (TensorRT-LLM V2's event manager, plus explicit loss
markers); :class:`NullRecorder` implements it as nothing at all, for events off. Once per
engine iteration the engine calls :meth:`EventRecorder.flush` (or ``flush_iteration`` then,
whenever it likes, ``take``) and hands the returned :class:`EventBatch` to the pipeline. To
keep model building off the engine thread it calls :meth:`EventRecorder.flush_deferred` /
``take_deferred`` instead: they hand the raw records over in O(1) as a
:class:`~kvstream.events.deferred.DeferredBatch`, which the pipeline materialises later (once,
on its own thread) into exactly the batch ``take`` would have returned.

Recording is synchronous, does no I/O and is not thread-safe: call one emitter from one
thread (the engine's). Recording methods only validate their arguments and append to cheap
internal records (plain dicts); the pydantic models are built, and validated once, by
:meth:`EventEmitter.take` (or :meth:`DeferredBatch.materialize
<kvstream.events.deferred.DeferredBatch.materialize>`). Every recording method validates *all*
its arguments first and raises :class:`~kvstream.errors.EmitterError` (naming the argument)
without changing any state, so ``take`` never fails on something a recording call accepted.
:meth:`EventEmitter.stored_chain` and :meth:`EventEmitter.removed_many` record several blocks
in one call, exactly as the same ``stored``/``removed`` calls one by one would (but all or
nothing on bad arguments), at a fraction of the per-block cost.

Rules, per layer group ("group", registered by ``created``):

* **Windowing.** Every event carries its group's ``layer_group_id`` and ``window_size`` and
  the emitter's ``hash_algo``; hashes must have ``hash_algo``'s width (8 or 32 bytes; an
  algorithm unknown to :data:`kvstream._types.BLOCK_HASH_WIDTHS` may use 8, 16 or 32 bytes,
  the same for the emitter's whole life). Calls for a group that was never created raise.
* **Removal coalescing.** ``removed`` is held back; a group's pending removals become ONE
  ``removed`` event (in call order). They are flushed (a) before a ``stored`` event of the
  same group (that group only), (b) before any ``updated``/``created``/``cleared`` event of
  any group (all groups, in the order their first pending removal was recorded), and (c) by
  ``flush_iteration``. The event's ``cache_level`` is the level every coalesced removal named
  when they all named the same one, else None (mixed or unknown levels: one event, not one
  per level, so a removal batch is never split).
* **Stored coalescing.** A stored block whose ``parent_hash`` is the last block of the
  group's latest materialised event, when that event is a ``stored`` event still buffered
  (not taken, not dropped) and no removal of the group is pending, is appended to it (no new
  event id). Targets reset at ``flush_iteration`` and ``take``, and whenever another event of
  the group is materialised.
* **Dedup.** A block already announced in a group is not announced again (a reused prefix
  emits nothing). Once its removal is recorded, a later store announces it again. Removing
  or updating a block that is not announced in the group is ignored (as TensorRT-LLM V2
  does). ``cleared`` forgets every announced block of the group(s) and discards their
  pending removals: the clear subsumes them, and a consumer that applies it is left in the
  same state.
* **Partial blocks** (fewer tokens than the group's ``tokens_per_block``) are skipped unless
  ``announce_partial_blocks=True``; a skipped block was never announced, so its removal is
  ignored too. More tokens than ``tokens_per_block`` is an error.
* **Event ids** start at 0 and grow by one per materialised event (a removal batch gets its
  id when flushed; a coalesced block gets none). "Materialised" here means placed in the
  buffer as a record, not built as a model.
* **Capacity.** At most ``capacity`` materialised events wait for ``take``. On overflow the
  oldest are dropped and one ``lost`` marker (reason ``"overflow"``) takes their place at
  the head of the buffer, occupying one slot: it covers the dropped ids
  ``[first_event_id, first_event_id + count)`` and carries the last of them as its own
  ``event_id``, so every id reaches the consumer exactly once, as an event or inside a
  marker's range. Drops while a marker heads the buffer extend it. The marker's
  ``layer_group_id``/``window_size`` are those of the last dropped event; it concerns the
  whole source.

Modules: :mod:`.recorder` (the :class:`EventRecorder` interface and :class:`NullRecorder`),
:mod:`.emitter_checks` (the recording methods' argument checks), :mod:`.emitted` (records ->
:class:`EventBatch`); this module keeps the emitter and its rules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Final, TypeAlias

from kvstream._types import (
    ALLOWED_UNKNOWN_WIDTHS,
    PRIORITY_DEFAULT,
    PRIORITY_MAX,
    PRIORITY_MIN,
    TokenIds,
    hash_width,
)
from kvstream.clock import SYSTEM_CLOCK, Clock
from kvstream.errors import ConfigError, EmitterError
from kvstream.events.deferred import BlockRun, DeferredBatch
from kvstream.events.dp_gather import gather_attention_dp
from kvstream.events.emitted import emitted_batch
from kvstream.events.emitter_checks import (
    _I32_MAX,
    _I64_MAX,
    _add_block_extras,
    _as_int,
    _as_tokens,
    _block_attrs,
    _diff,
    _hash_list,
)
from kvstream.events.model import AttentionKind, EventBatch, MmKey, SourceId
from kvstream.events.recorder import NULL_RECORDER, EventRecorder, NullRecorder

__all__ = [
    "DeferredBatch",
    "EmitterStats",
    "EventEmitter",
    "EventRecorder",
    "NULL_RECORDER",
    "NullRecorder",
    "gather_attention_dp",
]

# An event as the model will validate it: {"event_id", "hash_algo", "layer_group_id",
# "window_size", "data": {...}}, except that a stored event's "blocks" is a BlockRun, appended
# to in place while the event is its group's coalescing target (deferred.model_input expands it).
_Rec: TypeAlias = dict[str, Any]
_BYTES: Final = frozenset({bytes})


@dataclass(frozen=True, slots=True)
class EmitterStats:
    """A snapshot of an :class:`EventEmitter`'s counters (monotonic unless noted)."""

    #: Event ids assigned so far (== ``next_event_id``); lost markers reuse dropped ids.
    events_emitted: int
    #: Events handed over by ``take`` (lost markers not included).
    events_taken: int
    #: Events dropped on overflow; equals the sum of every lost marker's ``count``.
    events_dropped: int
    #: Lost markers created (each handed over by a later ``take``, or still buffered).
    lost_markers: int
    #: Non-empty batches returned by ``take``.
    batches_taken: int
    #: Blocks placed in ``stored`` events (coalesced ones included).
    blocks_stored_announced: int
    #: Blocks of ``stored`` events dropped on overflow (announced, never delivered).
    blocks_dropped: int
    #: Hashes placed in materialised ``removed`` events.
    blocks_removed_announced: int
    #: Stores of a block already announced in its group (nothing emitted).
    duplicate_stores_suppressed: int
    #: Removals of a block not announced in its group (nothing emitted).
    unknown_removals_ignored: int
    #: Updates of a block not announced in its group (nothing emitted).
    unknown_updates_ignored: int
    #: Stores of a partial block skipped (``announce_partial_blocks=False``).
    partial_blocks_skipped: int
    #: Pending removals discarded because ``cleared`` subsumed them.
    removals_subsumed_by_clear: int
    #: Gauge: events (lost marker included) waiting for ``take``.
    buffered_events: int
    #: Gauge: removals recorded but not yet materialised.
    pending_removals: int


class _Group:
    """Per-layer-group state."""

    __slots__ = (
        "announced",
        "attention_kind",
        "gid",
        "last_hash",
        "pending",
        "pending_level",
        "target",
        "token_bytes",
        "tokens_per_block",
        "window_size",
    )

    def __init__(
        self, gid: int, window_size: int, tokens_per_block: int, attention_kind: AttentionKind
    ) -> None:
        self.gid = gid
        self.window_size = window_size
        self.tokens_per_block = tokens_per_block
        self.token_bytes = 4 * tokens_per_block  # a full block's TokenIds.raw length
        self.attention_kind = attention_kind
        self.announced: set[bytes] = set()
        self.pending: list[bytes] = []
        # The cache level shared by every pending removal, None once they disagree.
        self.pending_level: int | None = None
        # Blocks of the coalescing target (a buffered stored event) and its last hash.
        self.target: BlockRun | None = None
        self.last_hash: bytes | None = None


class EventEmitter:
    """Records one source's KV-cache events with the semantics of DESIGN §2.2.

    See the module docstring for the rules. ``source`` names the producer (one emitter per
    attention-DP rank, each with its own ids); ``hash_algo`` is published on every event and
    fixes the hash width; ``capacity`` (>= 2) bounds the events waiting for :meth:`take`;
    ``clock`` stamps batches; ``announce_partial_blocks`` announces blocks shorter than the
    group's ``tokens_per_block`` instead of skipping them.

    ``dedup=False`` is for a caller that already knows what it announced (the cache
    manager's own emitter: its prefix tree holds exactly the announced blocks): the caller
    guarantees that every stored block is not announced in its group and every removed or
    updated block is, and the emitter keeps no set of announced blocks (the rule "Dedup"
    is then the caller's; ``duplicate_stores_suppressed`` and the ``unknown_*`` counters stay
    0). Everything else (coalescing, ids, capacity, argument checks) is unchanged.

    Not thread-safe: record and take from one thread.
    """

    enabled: bool = True

    def __init__(
        self,
        source: SourceId,
        *,
        hash_algo: str = "v1_block_key",
        capacity: int = 8192,
        clock: Clock = SYSTEM_CLOCK,
        announce_partial_blocks: bool = False,
        dedup: bool = True,
    ) -> None:
        if not isinstance(source, SourceId):
            raise ConfigError(f"source must be a SourceId, got {type(source).__name__}")
        if not isinstance(hash_algo, str) or not 1 <= len(hash_algo) <= 64:
            raise ConfigError(f"hash_algo must be a str of 1..64 characters, got {hash_algo!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2:
            raise ConfigError(f"capacity must be an int >= 2, got {capacity!r}")
        self._source = source
        self._hash_algo = hash_algo
        # None: an algorithm of unknown width, pinned by the first hash recorded.
        self._width: int | None = hash_width(hash_algo)
        self._capacity = capacity
        self._clock = clock
        self._announce_partial = bool(announce_partial_blocks)
        self._dedup = bool(dedup)
        self._groups: dict[int, _Group] = {}
        self._pending_groups: list[_Group] = []  # groups with pending removals, first-pending order
        self._buf: deque[_Rec] = deque()
        self._marker: _Rec | None = None  # the lost marker heading _buf, if any
        self._next_id = 0
        # Counters (see EmitterStats).
        self._taken = 0
        self._dropped = 0
        self._markers = 0
        self._batches = 0
        self._blocks_stored = 0
        self._blocks_dropped = 0
        self._blocks_removed = 0
        self._dup_stores = 0
        self._unknown_removals = 0
        self._unknown_updates = 0
        self._partial_skipped = 0
        self._subsumed = 0

    # ------------------------------------------------------------------ properties

    @property
    def source(self) -> SourceId:
        """The producer every batch is stamped with."""
        return self._source

    @property
    def hash_algo(self) -> str:
        """The hash algorithm published on every event."""
        return self._hash_algo

    @property
    def capacity(self) -> int:
        """The most events (lost marker included) that wait for :meth:`take`."""
        return self._capacity

    @property
    def next_event_id(self) -> int:
        """The id the next materialised event will get."""
        return self._next_id

    def stats(self) -> EmitterStats:
        """A snapshot of the counters."""
        return EmitterStats(
            events_emitted=self._next_id,
            events_taken=self._taken,
            events_dropped=self._dropped,
            lost_markers=self._markers,
            batches_taken=self._batches,
            blocks_stored_announced=self._blocks_stored,
            blocks_dropped=self._blocks_dropped,
            blocks_removed_announced=self._blocks_removed,
            duplicate_stores_suppressed=self._dup_stores,
            unknown_removals_ignored=self._unknown_removals,
            unknown_updates_ignored=self._unknown_updates,
            partial_blocks_skipped=self._partial_skipped,
            removals_subsumed_by_clear=self._subsumed,
            buffered_events=len(self._buf),
            pending_removals=sum(len(g.pending) for g in self._pending_groups),
        )

    # ------------------------------------------------------------------ recording

    def created(
        self,
        layer_group_id: int,
        *,
        window_size: int,
        num_blocks_per_cache_level: Sequence[int],
        tokens_per_block: int,
        attention_kind: AttentionKind = AttentionKind.FULL,
    ) -> None:
        """Register layer group ``layer_group_id`` and emit ``created``.

        Calling it again for a registered group re-emits ``created`` (e.g. a new capacity)
        and keeps the group's announced blocks; its ``window_size``, ``tokens_per_block``
        and ``attention_kind`` are fixed at registration (a different one raises
        EmitterError). Flushes every group's pending removals first.
        """
        gid = _as_int(layer_group_id, 0, _I32_MAX, "layer_group_id")
        ws = _as_int(window_size, 1, _I64_MAX, "window_size")
        tpb = _as_int(tokens_per_block, 1, _I32_MAX, "tokens_per_block")
        if isinstance(num_blocks_per_cache_level, (str, bytes)) or not isinstance(
            num_blocks_per_cache_level, Sequence
        ):
            raise EmitterError("num_blocks_per_cache_level must be a sequence of ints")
        levels = tuple(
            _as_int(n, 0, _I64_MAX, f"num_blocks_per_cache_level[{i}]")
            for i, n in enumerate(num_blocks_per_cache_level)
        )
        if not levels:
            raise EmitterError("num_blocks_per_cache_level must name at least one level")
        try:
            kind = AttentionKind(attention_kind)
        except ValueError:
            raise EmitterError(f"attention_kind: unknown kind {attention_kind!r}") from None
        g = self._groups.get(gid)
        if g is None:
            g = _Group(gid, ws, tpb, kind)
        elif (g.window_size, g.tokens_per_block, g.attention_kind) != (ws, tpb, kind):
            raise EmitterError(
                f"layer group {gid} was created with window_size={g.window_size}, "
                f"tokens_per_block={g.tokens_per_block}, attention_kind={g.attention_kind.value}"
                f"; got {ws}, {tpb}, {kind.value}"
            )
        self._groups[gid] = g
        if self._pending_groups:
            self._flush_all_removals()
        self._emit(
            g,
            {
                "type": "created",
                "num_blocks_per_cache_level": levels,
                "tokens_per_block": tpb,
                "attention_kind": kind,
            },
        )
        g.target = None

    def stored(
        self,
        layer_group_id: int,
        *,
        parent_hash: bytes | None,
        block_hash: bytes,
        token_ids: TokenIds | Sequence[int],
        cache_level: int = 0,
        priority: int = PRIORITY_DEFAULT,
        lora_id: int | None = None,
        lora_name: str | None = None,
        mm_keys: Sequence[MmKey] = (),
        cache_salt: str | None = None,
        token_extra_ids: TokenIds | Sequence[int] | None = None,
    ) -> None:
        """Record one block stored in group ``layer_group_id``.

        Nothing is emitted for a block already announced in the group, or for a partial
        block unless ``announce_partial_blocks``. Otherwise the group's pending removals are
        flushed first, then the block is appended to the group's coalescing target when
        ``parent_hash`` is that event's last block, else it opens a new ``stored`` event.
        """
        g = self._groups.get(layer_group_id)
        if g is None:
            raise self._unknown_group(layer_group_id)
        if type(block_hash) is not bytes or len(block_hash) != self._width:
            block_hash = self._check_hash(block_hash, "block_hash")
        if parent_hash is not None and (
            type(parent_hash) is not bytes or len(parent_hash) != self._width
        ):
            parent_hash = self._check_hash(parent_hash, "parent_hash")
        if type(token_ids) is not TokenIds:
            token_ids = _as_tokens(token_ids, "token_ids")
        attrs: dict[str, Any] | None = None
        if not (
            cache_level == 0
            and priority == PRIORITY_DEFAULT
            and lora_id is None
            and lora_name is None
            and not mm_keys
            and cache_salt is None
            and token_extra_ids is None
        ):
            attrs = _block_attrs(cache_level, priority, lora_id, lora_name, cache_salt)
            _add_block_extras(attrs, token_ids, mm_keys, token_extra_ids)
        nbytes = len(token_ids._raw)
        if nbytes != g.token_bytes:
            if nbytes > g.token_bytes:
                raise EmitterError(
                    f"token_ids: {nbytes >> 2} tokens exceed layer group {g.gid}'s "
                    f"tokens_per_block={g.tokens_per_block}"
                )
            if not self._announce_partial:
                self._partial_skipped += 1
                return
        if self._dedup:
            announced = g.announced
            if block_hash in announced:
                self._dup_stores += 1
                return
            announced.add(block_hash)
        if g.pending:
            self._flush_group_removals(g)
        run = g.target
        if run is None or parent_hash != g.last_hash:
            run = self._open_run(g, parent_hash)
        if attrs is not None:
            run.attrs[len(run.hashes)] = attrs
        run.hashes.append(block_hash)
        run.tokens.append(token_ids)
        g.last_hash = block_hash
        self._blocks_stored += 1

    def stored_chain(
        self,
        layer_group_id: int,
        *,
        parent_hash: bytes | None,
        block_hashes: Sequence[bytes],
        token_ids: TokenIds | Sequence[int],
        cache_level: int = 0,
        priority: int = PRIORITY_DEFAULT,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Record consecutive full blocks stored in group ``layer_group_id``.

        Block i has hash ``block_hashes[i]`` and the i-th ``tokens_per_block`` tokens of
        ``token_ids`` (the chain's tokens, packed: exactly ``len(block_hashes) *
        tokens_per_block`` of them); its parent is block i-1, block 0's is ``parent_hash``;
        every block has the same attributes (``cache_level``...).

        Records exactly what ``stored`` called once per block, in order, would (dedup,
        pending-removal flush, coalescing, ids, counters), at a fraction of the per-block
        cost: a chain of new blocks costs a few set and list operations in C, and the
        per-block token lists are only cut when the batch is materialised. Unlike such a loop
        it is all or nothing: every argument is validated first and a bad one raises
        EmitterError (naming it, with the block's index) before anything is recorded. Partial
        blocks, multimodal keys and extra token ids go through ``stored``.
        """
        g = self._groups.get(layer_group_id)
        if g is None:
            raise self._unknown_group(layer_group_id)
        hashes = block_hashes if type(block_hashes) is list else _hash_list(block_hashes)
        n = len(hashes)
        # Hashes (the parent's first): C-level passes when they are all fine.
        width = self._width
        if parent_hash is not None and (
            type(parent_hash) is not bytes or len(parent_hash) != width
        ):
            parent_hash, width = self._hash_of(parent_hash, "parent_hash", width)
        if n == 1:  # a decode step: cheaper inline
            h = hashes[0]
            if type(h) is not bytes or len(h) != width:
                hashes, width = self._hashes_of(hashes, "block_hashes", width)
        elif n and (
            width is None or set(map(type, hashes)) != _BYTES or set(map(len, hashes)) != {width}
        ):
            hashes, width = self._hashes_of(hashes, "block_hashes", width)
        if type(token_ids) is not TokenIds:
            token_ids = _as_tokens(token_ids, "token_ids")
        if len(token_ids._raw) != n * g.token_bytes:
            raise EmitterError(
                f"token_ids: {len(token_ids)} tokens for {n} blocks of layer group {g.gid}'s "
                f"tokens_per_block={g.tokens_per_block} (a chain holds full blocks only)"
            )
        attrs: dict[str, Any] | None = None
        if not (
            cache_level == 0
            and priority == PRIORITY_DEFAULT
            and lora_id is None
            and lora_name is None
            and cache_salt is None
        ):
            attrs = _block_attrs(cache_level, priority, lora_id, lora_name, cache_salt)
        # Everything is valid: record.
        if not n:
            return
        if width is not None:
            self._width = width
        self._record_chain(g, parent_hash, hashes, token_ids, attrs)

    def stored_chain_trusted(
        self,
        layer_group_id: int,
        parent_hash: bytes | None,
        block_hashes: list[bytes],
        token_ids: TokenIds,
    ) -> None:
        """:meth:`stored_chain` with the default block attributes, for a caller that
        vouches for its arguments: the cache manager, whose own hasher (of this emitter's
        ``hash_algo``) made the hashes.

        The caller's contract: ``block_hashes`` is a non-empty list of ``bytes`` of the
        emitter's hash width (pinned: :meth:`accepts_trusted` is True) and ``parent_hash``
        one too, or None. What is recorded is exactly what :meth:`stored_chain` records for
        the same arguments (dedup, pending-removal flush, coalescing, ids, counters); only
        the per-hash type and width checks are skipped (two passes over the hashes, as long
        as the recording itself). The group and the token count are still checked
        (EmitterError, nothing recorded)."""
        g = self._groups.get(layer_group_id)
        if g is None:
            raise self._unknown_group(layer_group_id)
        n = len(block_hashes)
        if len(token_ids._raw) != n * g.token_bytes or not n:
            raise EmitterError(
                f"token_ids: {len(token_ids)} tokens for {n} blocks of layer group {g.gid}'s "
                f"tokens_per_block={g.tokens_per_block} (a chain holds full blocks only)"
            )
        if n == 1 and not self._dedup and not g.pending:
            # A decode step's block (the manager's commonest call): _record_chain, _open_run
            # and _emit inlined (a decode block's parent is rarely the target's last block).
            h = block_hashes[0]
            run = g.target
            if run is None or parent_hash != g.last_hash:
                run = BlockRun()
                if len(self._buf) >= self._capacity:
                    self._make_room()
                self._buf.append(
                    {
                        "event_id": self._next_id,
                        "hash_algo": self._hash_algo,
                        "layer_group_id": g.gid,
                        "window_size": g.window_size,
                        "data": {"type": "stored", "parent_hash": parent_hash, "blocks": run},
                    }
                )
                self._next_id += 1
                g.target = run
            run.hashes.append(h)
            run.tokens.append(token_ids)
            g.last_hash = h
            self._blocks_stored += 1
            return
        self._record_chain(g, parent_hash, block_hashes, token_ids, None)

    def accepts_trusted(self, hash_width: int) -> bool:
        """True when :meth:`stored_chain_trusted` may be given hashes of ``hash_width``
        bytes: the emitter's width is known (pinned) and equal to it."""
        return self._width == hash_width

    def _record_chain(
        self,
        g: _Group,
        parent_hash: bytes | None,
        hashes: list[bytes],
        token_ids: TokenIds,
        attrs: dict[str, Any] | None,
    ) -> None:
        # stored_chain's recording, its arguments valid (n >= 1, the width pinned).
        n = len(hashes)
        if self._dedup:
            announced = g.announced
            if n == 1:
                if hashes[0] in announced:
                    self._dup_stores += 1
                    return
                announced.add(hashes[0])
            elif not announced.isdisjoint(hashes):
                self._record_each(g, parent_hash, hashes, token_ids, attrs)
                return
            else:  # the common case, all in C: every block new (none announced, none repeated)
                before = len(announced)
                announced.update(hashes)
                if len(announced) - before != n:  # a hash repeats: undo, go one by one
                    announced.difference_update(hashes)
                    self._record_each(g, parent_hash, hashes, token_ids, attrs)
                    return
        if g.pending:
            self._flush_group_removals(g)
        run = g.target
        if run is None or parent_hash != g.last_hash:
            run = self._open_run(g, parent_hash)
        if attrs is not None:
            base = len(run.hashes)
            run.attrs.update(zip(range(base, base + n), repeat(attrs)))
        run.hashes += hashes
        # (a decode step's one block as stored() records it; a chain packed, cut when built)
        run.tokens.append(token_ids if n == 1 else (token_ids, n))
        g.last_hash = hashes[-1]
        self._blocks_stored += n

    def _record_each(
        self,
        g: _Group,
        parent_hash: bytes | None,
        hashes: list[bytes],
        token_ids: TokenIds,
        attrs: dict[str, Any] | None,
    ) -> None:
        # _record_chain block by block (dedup on): some blocks are announced already (or
        # repeated) and skipped.
        n = len(hashes)
        announced = g.announced
        raw, tb = token_ids._raw, g.token_bytes
        flush_pending = bool(g.pending)
        run = g.target
        last = g.last_hash
        parent = parent_hash
        recorded = 0
        for i, h in enumerate(hashes):
            if h not in announced:
                if flush_pending:
                    self._flush_group_removals(g)
                    flush_pending = False
                    run = None
                if run is None or parent != last:
                    run = self._open_run(g, parent)
                if attrs is not None:
                    run.attrs[len(run.hashes)] = attrs
                run.hashes.append(h)
                run.tokens.append(TokenIds.from_bytes(raw[i * tb : (i + 1) * tb]))
                last = h
                announced.add(h)
                recorded += 1
            parent = h
        g.last_hash = last
        self._blocks_stored += recorded
        self._dup_stores += n - recorded

    def removed(
        self, layer_group_id: int, block_hash: bytes, *, cache_level: int | None = None
    ) -> None:
        """Record that a block left group ``layer_group_id`` (from ``cache_level`` if known).

        The removal is held back and coalesced with the group's other pending removals (see
        the module docstring); removing a block not announced in the group is ignored.
        """
        g = self._groups.get(layer_group_id)
        if g is None:
            raise self._unknown_group(layer_group_id)
        if cache_level is not None and (
            type(cache_level) is not int or not 0 <= cache_level <= _I32_MAX
        ):
            cache_level = _as_int(cache_level, 0, _I32_MAX, "cache_level")
        if not self._dedup:
            if type(block_hash) is not bytes or len(block_hash) != self._width:
                block_hash = self._check_hash(block_hash, "block_hash")
        else:
            try:
                g.announced.remove(block_hash)
            except (KeyError, TypeError):  # TypeError: unhashable, so not a hash at all
                self._check_hash(block_hash, "block_hash")
                self._unknown_removals += 1
                return
        pending = g.pending
        if not pending:
            self._pending_groups.append(g)
            g.pending_level = cache_level
        elif g.pending_level != cache_level:
            g.pending_level = None
        pending.append(block_hash)

    def removed_many(
        self, layer_group_id: int, block_hashes: Sequence[bytes], *, cache_level: int | None = None
    ) -> None:
        """Record that blocks left group ``layer_group_id`` (all from ``cache_level`` if known).

        Records exactly what ``removed`` called once per hash, in order, would; all or
        nothing: a bad hash raises EmitterError before anything is recorded.
        """
        g = self._groups.get(layer_group_id)
        if g is None:
            raise self._unknown_group(layer_group_id)
        if cache_level is not None and (
            type(cache_level) is not int or not 0 <= cache_level <= _I32_MAX
        ):
            cache_level = _as_int(cache_level, 0, _I32_MAX, "cache_level")
        hashes = block_hashes if type(block_hashes) is list else _hash_list(block_hashes)
        if not hashes:
            return
        if not self._dedup:
            width = self._width
            if (
                width is None
                or set(map(type, hashes)) != _BYTES
                or set(map(len, hashes)) != {width}
            ):
                hashes, self._width = self._hashes_of(hashes, "block_hashes", width)
            self._pend_removals(g, hashes, cache_level)
            return
        announced = g.announced
        if len(hashes) == 1:  # one eviction: as removed() does it
            try:
                announced.remove(hashes[0])
                fast = True
            except (KeyError, TypeError):  # unknown, or unhashable: the slow path says
                fast = False
        else:
            before = len(announced)
            try:
                fast = announced.issuperset(hashes)
            except TypeError:  # unhashable: not a hash; the slow path says why
                fast = False
            if fast:  # every hash announced (so valid): set operations, all in C
                announced.difference_update(hashes)
                if before - len(announced) != len(hashes):  # a hash repeats: undo
                    announced.update(hashes)
                    fast = False
        if not fast:
            hashes, width = self._hashes_of(hashes, "block_hashes", self._width)
            self._width = width
            known: list[bytes] = []
            for h in hashes:
                if h in announced:
                    announced.remove(h)
                    known.append(h)
            self._unknown_removals += len(hashes) - len(known)
            if not known:
                return
            hashes = known
        self._pend_removals(g, hashes, cache_level)

    def removed_many_trusted(
        self, layer_group_id: int, block_hashes: list[bytes], cache_level: int | None
    ) -> None:
        """:meth:`removed_many` for a caller that vouches for its arguments (the cache
        manager's block pool: its prefix tree gave the hashes): a non-empty list of ``bytes``
        of the emitter's pinned width, and ``cache_level`` None or an int in range. Records
        exactly what :meth:`removed_many` records; without dedup (``dedup=False``) it skips
        the per-hash checks, else it is :meth:`removed_many`."""
        if self._dedup:
            self.removed_many(layer_group_id, block_hashes, cache_level=cache_level)
            return
        g = self._groups.get(layer_group_id)
        if g is None:
            raise self._unknown_group(layer_group_id)
        self._pend_removals(g, block_hashes, cache_level)

    def _pend_removals(self, g: _Group, hashes: list[bytes], cache_level: int | None) -> None:
        # Hold valid, announced hashes back as g's pending removals (coalesced, see module doc).
        pending = g.pending
        if not pending:
            self._pending_groups.append(g)
            g.pending_level = cache_level
        elif g.pending_level != cache_level:
            g.pending_level = None
        pending += hashes

    def updated(
        self,
        layer_group_id: int,
        block_hash: bytes,
        *,
        cache_level: tuple[int, int] | None = None,
        priority: tuple[int, int] | None = None,
    ) -> None:
        """Record a tier move and/or priority change, each ``(old, new)``; at least one.

        Ignored for a block not announced in the group. Otherwise every group's pending
        removals are flushed first, then an ``updated`` event is emitted.
        """
        g = self._groups.get(layer_group_id)
        if g is None:
            raise self._unknown_group(layer_group_id)
        level_diff = _diff(cache_level, 0, _I32_MAX, "cache_level")
        prio_diff = _diff(priority, PRIORITY_MIN, PRIORITY_MAX, "priority")
        if level_diff is None and prio_diff is None:
            raise EmitterError("updated needs a cache_level or a priority change")
        if not self._dedup:
            if type(block_hash) is not bytes or len(block_hash) != self._width:
                block_hash = self._check_hash(block_hash, "block_hash")
        elif not self._is_announced(g.announced, block_hash):
            self._check_hash(block_hash, "block_hash")
            self._unknown_updates += 1
            return
        if self._pending_groups:
            self._flush_all_removals()
        self._emit(
            g,
            {
                "type": "updated",
                "block_hash": block_hash,
                "cache_level": level_diff,
                "priority": prio_diff,
            },
        )
        g.target = None

    def cleared(self, layer_group_id: int | None = None) -> None:
        """Every block of group ``layer_group_id`` (None: of every group) is gone.

        Emits one ``cleared`` event per group (registration order for None). The groups'
        announced blocks are forgotten and their pending removals discarded (the clear
        subsumes them); other groups' pending removals are flushed first.
        """
        if layer_group_id is None:
            groups = list(self._groups.values())
        else:
            g = self._groups.get(layer_group_id)
            if g is None:
                raise self._unknown_group(layer_group_id)
            groups = [g]
        for g in groups:
            if g.pending:
                self._subsumed += len(g.pending)
                g.pending = []
                self._pending_groups.remove(g)
        if self._pending_groups:
            self._flush_all_removals()
        for g in groups:
            g.announced.clear()
            self._emit(g, {"type": "cleared"})
            g.target = None

    def flush_iteration(self) -> None:
        """End of an engine iteration: materialise every pending removal (one ``removed``
        event per group, in first-pending order) and reset every coalescing target."""
        if self._pending_groups:
            self._flush_all_removals()
        for g in self._groups.values():
            g.target = None

    def take(self) -> EventBatch | None:
        """Hand over every materialised event as one batch, in id order (a lost marker
        first), stamped with ``clock.time_ns()``; None when there is none. Pending removals
        stay pending. Clears the buffer and resets every coalescing target.

        The same as ``take_deferred().materialize()``, built on the calling thread (if
        building fails, which a valid recording never makes it do, nothing is taken)."""
        buf = self._buf
        if not buf:
            return None
        batch = emitted_batch(self._source, self._clock.time_ns(), buf)
        self._hand_over(len(buf))
        buf.clear()
        return batch

    def flush(self) -> EventBatch | None:
        """``flush_iteration()`` then ``take()``."""
        self.flush_iteration()
        return self.take()

    def take_deferred(self) -> DeferredBatch | None:
        """Like :meth:`take`, but the records are handed over as they are, in O(1): the
        :class:`~kvstream.events.deferred.DeferredBatch` builds the ``EventBatch`` (the same
        one ``take`` would have returned now, timestamp included) when a consumer calls its
        ``materialize``, on any thread. None when there is nothing to take."""
        buf = self._buf
        if not buf:
            return None
        ts_ns = self._clock.time_ns()
        self._buf = deque()  # the old one now belongs to the DeferredBatch
        self._hand_over(len(buf))
        return DeferredBatch(self._source, ts_ns, buf)

    def flush_deferred(self) -> DeferredBatch | None:
        """``flush_iteration()`` then ``take_deferred()``: the engine's end of iteration."""
        if self._pending_groups:
            self._flush_all_removals()
        buf = self._buf
        if buf:
            return self.take_deferred()  # resets every coalescing target
        for g in self._groups.values():
            g.target = None
        return None

    # ------------------------------------------------------------------ internals

    def _hand_over(self, n: int) -> None:
        # The buffer's n events were taken: count them, forget the marker and every coalescing
        # target (so nothing taken is ever mutated again). The caller empties the buffer.
        if self._marker is not None:
            n -= 1
            self._marker = None
        self._taken += n
        self._batches += 1
        for g in self._groups.values():
            g.target = None

    def _open_run(self, g: _Group, parent_hash: bytes | None) -> BlockRun:
        # A new stored event of group g (empty until the caller appends), its coalescing target.
        run = BlockRun()
        self._emit(g, {"type": "stored", "parent_hash": parent_hash, "blocks": run})
        g.target = run
        return run

    def _emit(self, g: _Group, data: dict[str, Any]) -> None:
        # Materialise one event: the next id, at the tail of the buffer.
        if len(self._buf) >= self._capacity:
            self._make_room()
        self._buf.append(
            {
                "event_id": self._next_id,
                "hash_algo": self._hash_algo,
                "layer_group_id": g.gid,
                "window_size": g.window_size,
                "data": data,
            }
        )
        self._next_id += 1

    def _make_room(self) -> None:
        buf = self._buf
        while len(buf) >= self._capacity:
            if self._marker is not None:
                victim = buf[1]
                del buf[1]
            else:
                victim = buf.popleft()
            self._dropped += 1
            data = victim["data"]
            if data["type"] == "stored":
                self._blocks_dropped += len(data["blocks"])
                g = self._groups[victim["layer_group_id"]]
                if g.target is data["blocks"]:
                    g.target = None
            marker = self._marker
            if marker is None:
                marker = {
                    "event_id": victim["event_id"],
                    "hash_algo": self._hash_algo,
                    "layer_group_id": victim["layer_group_id"],
                    "window_size": victim["window_size"],
                    "data": {
                        "type": "lost",
                        "first_event_id": victim["event_id"],
                        "count": 1,
                        "reason": "overflow",
                    },
                }
                self._marker = marker
                self._markers += 1
                buf.appendleft(marker)
            else:
                marker["event_id"] = victim["event_id"]
                marker["layer_group_id"] = victim["layer_group_id"]
                marker["window_size"] = victim["window_size"]
                marker["data"]["count"] += 1

    def _flush_group_removals(self, g: _Group) -> None:
        self._pending_groups.remove(g)
        self._emit_removals(g)

    def _flush_all_removals(self) -> None:
        groups = self._pending_groups
        self._pending_groups = []
        for g in groups:
            self._emit_removals(g)

    def _emit_removals(self, g: _Group) -> None:
        hashes = g.pending
        g.pending = []
        self._blocks_removed += len(hashes)
        self._emit(g, {"type": "removed", "block_hashes": hashes, "cache_level": g.pending_level})
        g.target = None

    @staticmethod
    def _is_announced(announced: set[bytes], block_hash: object) -> bool:
        try:
            return block_hash in announced
        except TypeError:  # unhashable: certainly not a valid hash; _check_hash says why
            return False

    def _check_hash(self, value: object, what: str) -> bytes:
        # Slow path of the inline width check: normalise bytes subclasses, pin the width of an
        # unknown algorithm on first use, or raise.
        h, self._width = self._hash_of(value, what, self._width)
        return h

    def _hash_of(self, value: object, what: str, width: int | None) -> tuple[bytes, int]:
        # Validate and normalise one hash against `width` (None: not pinned yet); returns it
        # with the width it pins. Changes no state: callers pin once everything is valid.
        if not isinstance(value, bytes):
            raise EmitterError(f"{what} must be bytes, got {type(value).__name__}")
        h = bytes(value)
        if width is None:
            if len(h) not in ALLOWED_UNKNOWN_WIDTHS:
                raise EmitterError(
                    f"{what}: hashes must be {ALLOWED_UNKNOWN_WIDTHS} bytes, got {len(h)}"
                )
        elif len(h) != width:
            raise EmitterError(f"{what}: {self._hash_algo} hashes are {width} bytes, got {len(h)}")
        return h, len(h)

    def _hashes_of(
        self, values: list[Any], what: str, width: int | None
    ) -> tuple[list[bytes], int | None]:
        # _hash_of for every element of a list (what[i] in errors); no state changes.
        out: list[bytes] = []
        for i, v in enumerate(values):
            h, width = self._hash_of(v, f"{what}[{i}]", width)
            out.append(h)
        return out, width

    def _unknown_group(self, layer_group_id: object) -> EmitterError:
        known = ", ".join(map(str, self._groups)) or "none"
        return EmitterError(
            f"layer group {layer_group_id!r} is not registered (call created() first; "
            f"registered: {known})"
        )

"""The prefix index: every worker's cached blocks, built from KV-cache event batches.

::

    index = PrefixIndex()
    for batch in batches:                   # from a source: Kafka, files, memory
        index.apply(batch)
    result = index.match(tokens)            # per-worker cached prefix of a request

State per worker (an event source: instance and attention-DP rank) and layer group: a
:class:`~kvstream.index.table.GroupTable` of blocks, and the group's advertised hash algorithm
(from every event's ``hash_algo``) and block size (from its ``created`` event). Groups with
the same algorithm, block size and group id share a :class:`~kvstream.index.domain.HashDomain`
that answers matches for all their workers at once.

Key modes (``key_mode``):

- ``"engine"`` (default): blocks are keyed by the engine's hash, and a request is hashed with
  each worker's advertised algorithm (which must be reproducible from a request).
- ``"tokens"``: blocks are keyed by a canonical hash of their tokens, their parent's key and
  their scope (:mod:`kvstream.index.keys`); the engine's hash is only the id that removals
  and updates resolve through (:mod:`kvstream.index.token_table`). Workers of every engine
  and algorithm with the same block size and group id share one domain, and a request is
  hashed once per block size, without knowing any worker's algorithm. Exact when events
  carry token ids (see ``docs/index.md``).

Rules (DESIGN §7), per worker:

- **Sequencing.** Event ids must follow one another. An id already applied is a duplicate
  (at-least-once delivery) and is skipped. A jump (ids missing) or a ``lost`` marker makes the
  worker *stale*: its state may be wrong, so matches report it untrusted and routers ignore
  its overlap. Ids the decoder could not represent (``skipped_ids``) are not gaps. The first
  event of an incarnation must be id 0, else the index joined mid-stream: stale.
- **Resync.** A stale worker is trusted again after a new incarnation, a ``cleared`` of every
  group it has (each clear empties its group, so the state is exact again), or an explicit
  :meth:`PrefixIndex.resync`.
- **Purges.** A new (higher) incarnation forgets the worker's state; batches of an older
  incarnation are ignored. ``cleared`` empties its group. A change of a group's hash
  algorithm or block size empties the group (its hashes mean something else now).
- **Capacity.** A group holding more blocks than its ``created`` event advertised (all tiers
  together) has missed removals: the worker becomes stale.
- **Blocks.** Duplicate stores and removals are reference counted per tier; a store whose
  parent is unknown keeps its blocks unmatchable until the parent appears; a removal or
  update of an unknown block is counted and ignored (see :mod:`kvstream.index.table`).

Every rule is counted in :class:`~kvstream.index.stats.SourceStats`. Not thread-safe: feed
it from one task or thread (the consumer's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvstream.errors import ConfigError, HashingError
from kvstream.events.columns import (
    CLEARED,
    CREATED,
    LOST,
    REMOVED,
    STORED,
    UPDATED,
    ColumnBatch,
    StoredExtra,
)
from kvstream.events.model import EventBatch
from kvstream.hashing.dynamo import LOCAL_HASH_SEED
from kvstream.index.domain import HashDomain
from kvstream.index.errors import HashConfigMismatchError
from kvstream.index.keys import (
    KeyMode,
    dynamo_request_keys,
    keys_from_local,
    lora_scopes,
    request_keys,
    request_mm,
    request_raw,
)
from kvstream.index.match_plan import MatchPlan, PlanCache, count_tokens
from kvstream.index.matching import (
    HashRequest,
    MatchResult,
    RequestHasher,
    WorkerMatch,
    new_match_result,
)
from kvstream.index.stats import IndexStats, SourceStats
from kvstream.index.table import GroupTable, native_apply_plain
from kvstream.index.token_table import is_token_table
from kvstream.index.types import DEFAULT_TIER_WEIGHTS, DomainKey, WorkerKey
from kvstream.index.worker_state import GroupInfo, GroupState, SourceState, WorkerInfo

__all__ = ["GroupInfo", "PrefixIndex", "WorkerInfo"]

#: the native core's batch apply and the table types it takes (None: the Python loops)
_NATIVE_APPLY = native_apply_plain()


class _TokenFeed:
    """How a token-keyed index stores one batch's stored events: straight from the columns'
    token ids when the decoder gave each block's size and the blocks are plain (no LoRA,
    salt, multimodal or extra keys: the table hashes the tokens itself, in C when native),
    else from the model's blocks (built once per batch, only when an event needs them)."""

    __slots__ = ("cols", "models", "spans", "view")

    def __init__(self, cols: ColumnBatch) -> None:
        self.cols = cols
        #: per stored event of a publisher's columns: its tokens' (offset, end), None when
        #: not plain (built on first use)
        self.spans: list[tuple[int, int] | None] | None = None
        self.models: list[Any] | None = None
        self.view: memoryview | None = None

    def store(self, table: GroupTable, i: int, j: int, data: Any, st: SourceStats) -> None:
        """Apply the stored event in column ``i``, the batch's ``j``-th stored event (its
        payload ``data``), to the token-keyed ``table``."""
        assert is_token_table(table)
        cols = self.cols
        if cols.has_blocks:
            table.store(data[0], data[4], st)
            return
        given = cols.token_layout
        span: tuple[int, int] | None = None
        sizes: list[int] = []
        if given is not None:  # a consumer decoder's layout, in token ids
            entry = given[j]
            if entry is not None:
                first, sizes = entry
                span = (4 * first, 4 * (first + sum(sizes)))
        elif cols.stored_extra is not None:  # a publisher's columns
            spans = self.spans
            if spans is None:
                spans = self.spans = _publisher_spans(cols.stored_extra)
            span = spans[j]
            sizes = cols.stored_extra[j][0]
        if span is not None:
            view = self.view
            if view is None:
                view = self.view = memoryview(cols.tokens)
            tokens = view[span[0] : span[1]]
            table.store_tokens(data[0], data[1], data[2], tokens, sizes, LOCAL_HASH_SEED, st)
            return
        if self.models is None:
            self.models = self._models()
        table.store(data[0], self.models[i].data.blocks, st)

    def _models(self) -> list[Any]:
        """The model event of each column: the columns are the model's events in order,
        less the ones the decoder skipped (ids may repeat: matched in order)."""
        events = self.cols.to_batch().events
        out: list[Any] = []
        j = 0
        for eid in self.cols.event_ids:
            while events[j].event_id != eid:
                j += 1
            out.append(events[j])
            j += 1
        return out


def _publisher_spans(extra: Sequence[StoredExtra]) -> list[tuple[int, int] | None]:
    """Per stored event of a publisher's columns (``stored_extra``: their tokens lie in order
    in ``tokens``): its tokens' byte (offset, end) when its blocks are plain, else None."""
    out: list[tuple[int, int] | None] = []
    off = 0
    for sizes, attrs in extra:
        end = off + 4 * sum(sizes)
        out.append((off, end) if attrs is None else None)
        off = end
    return out


class PrefixIndex:
    """Every worker's cached blocks; see the module docstring for the rules.

    ``default_tokens_per_block``: the block size of groups that never advertised one (e.g.
    schema-v1 data, whose ``created`` events carry none, or bridged vLLM/SGLang engines,
    which send no ``created``); None infers it as the largest block the group stored (a full
    block), and a group that stored none yet is unmatchable.
    ``hasher_params``: algorithm-level hasher parameters for matching (events do not carry
    them), e.g. ``{"vllm_sha256_cbor": {"seed": "..."}}`` (engine mode only).
    ``key_mode``: ``"engine"`` or ``"tokens"`` (see the module docstring); ConfigError for
    anything else.
    """

    def __init__(
        self,
        *,
        default_tokens_per_block: int | None = None,
        hasher_params: Mapping[str, Mapping[str, Any]] | None = None,
        key_mode: KeyMode | str = KeyMode.ENGINE,
    ) -> None:
        if default_tokens_per_block is not None and default_tokens_per_block < 1:
            raise ValueError(
                f"default_tokens_per_block must be >= 1, got {default_tokens_per_block}"
            )
        self.default_tokens_per_block = default_tokens_per_block
        self.key_mode = KeyMode.parse(key_mode)
        self._tokens = self.key_mode.token_keyed
        self._dynamo = self.key_mode is KeyMode.DYNAMO
        self.hasher = RequestHasher(hasher_params)
        self._sources: dict[tuple[str, int | None], SourceState] = {}
        self._slots: list[WorkerKey] = []
        self._domains: dict[DomainKey, HashDomain] = {}
        self._trusted = 0
        #: bumped by every change of what match() plans from (workers, groups, domains,
        #: trust); plans of an older epoch are dropped
        self._epoch = 0
        self._plans = PlanCache()
        #: hash algorithm -> why requests cannot be hashed with it ("" when they can)
        self._unhashable: dict[str, str] = {}

    # ------------------------------------------------------------------ ingest

    def apply(self, batch: EventBatch | ColumnBatch, skipped_ids: Iterable[int] = ()) -> None:
        """Apply one batch: a model batch or the columns a source decoded
        (:class:`~kvstream.events.columns.ColumnBatch`, the fast path). ``skipped_ids``: ids
        of events the decoder left out of this batch (kinds it cannot represent); they are
        accounted for, not treated as a gap."""
        cols = batch if isinstance(batch, ColumnBatch) else ColumnBatch.from_batch(batch)
        key = (cols.instance_id, cols.attention_dp_rank)
        s = self._sources.get(key)
        if s is None:
            s = self._add_source(WorkerKey(*key))
        st = s.stats
        st.batches += 1
        inc = cols.incarnation
        if inc != s.incarnation:
            if s.incarnation is not None and inc < s.incarnation:
                st.old_incarnation_batches += 1
                return
            self._new_incarnation(s, inc)
        if not skipped_ids and self._apply_plain(s, cols, st):
            return
        skipped = set(skipped_ids) if skipped_ids else None
        groups = s.groups
        tokens = _TokenFeed(cols) if self._tokens else None
        j = -1  # the stored events' count so far, less one (skipped ones included)
        for i, (eid, code, algo, gid, window, data) in enumerate(
            zip(
                cols.event_ids,
                cols.kinds,
                cols.hash_algos,
                cols.group_ids,
                cols.window_sizes,
                cols.payloads,
                strict=True,
            )
        ):
            if code == LOST:
                self._on_lost(s, eid, gid, data)
                continue
            if code == STORED:
                j += 1
            if eid != s.next_id and not self._out_of_order(s, eid, gid, skipped):
                continue
            s.next_id = eid + 1
            st.events += 1
            g = groups.get(gid)
            if g is None:
                g = self._add_group(s, gid)
            if algo != g.hash_algo:
                self._set_algo(s, g, algo)
            if code == STORED:
                hashes = data[1]
                st.stored_events += 1
                st.stored_blocks += len(hashes)
                nt = data[3]
                if nt > g.max_block_tokens:
                    g.max_block_tokens = nt
                    if g.tokens_per_block is None:
                        self._bind(s, g)  # the inferred block size grew
                    self._check_block_size(s, g)
                if tokens is not None:
                    tokens.store(g.table, i, j, data, st)
                else:
                    g.table.store_hashes(data[0], hashes, data[2], st)
                if g.table.present > g.limit:
                    self._over_capacity(s, g)
            elif code == REMOVED:
                hashes = data[0]
                st.removed_events += 1
                st.removed_blocks += len(hashes)
                g.table.remove(hashes, data[1], st)
            elif code == UPDATED:
                st.updated_events += 1
                lv = data[1]
                if lv is not None:
                    g.table.update(data[0], lv[0], lv[1], st)
                if data[2] is not None:
                    st.priority_updates += 1
            elif code == CLEARED:
                self._on_cleared(s, g)
            elif code == CREATED:
                self._on_created(s, g, data, window)
        if skipped and s.next_id is not None:
            nxt = s.next_id
            while nxt in skipped:
                nxt += 1
                st.skipped_events += 1
            s.next_id = nxt

    def _apply_plain(self, s: SourceState, cols: ColumnBatch, st: SourceStats) -> bool:
        """Apply the batch an engine sends most: stores and removals in layer groups the
        worker has, each in the algorithm it has, ids following on, nothing that can rebind a
        group's block size, and (token-keyed) each store's token ids laid out in the columns.
        One lean pass, the same state and counters as :meth:`apply`'s loop; False (nothing
        changed) for any other batch, which that loop takes."""
        ids = cols.event_ids
        n = len(ids)
        first = s.next_id
        if not n or first is None or ids[0] != first or ids[-1] != first + n - 1:
            return False
        kinds = cols.kinds
        n_stored = kinds.count(STORED)
        if n_stored + kinds.count(REMOVED) != n:
            return False
        layout = cols.token_layout
        if self._tokens and (layout is None or cols.has_blocks or len(layout) != n_stored):
            return False
        payloads = cols.payloads
        gids = cols.group_ids
        groups = s.groups
        seen: dict[int, list[Any]] = {}  # layer group -> [its GroupState, blocks stored into it]
        for code, gid, algo, data in zip(kinds, gids, cols.hash_algos, payloads, strict=True):
            entry = seen.get(gid)
            if entry is None:
                g = groups.get(gid)
                if g is None:
                    return False
                entry = seen[gid] = [g, 0]
            g = entry[0]
            if algo != g.hash_algo:
                return False
            if code == STORED:
                if data[3] > g.max_block_tokens:
                    return False
                entry[1] += len(data[1])
        if ids != list(range(first, first + n)) or (layout is not None and None in layout):
            return False
        s.next_id = first + n
        st.events += n
        st.stored_events += n_stored
        st.stored_blocks += sum(stored for _, stored in seen.values())
        st.removed_events += n - n_stored
        if _NATIVE_APPLY is not None and all(
            isinstance(e[0].table, _NATIVE_APPLY[1]) for e in seen.values()
        ):
            self._apply_plain_native(s, cols, st, seen)
            return True
        removed_blocks = 0
        if self._tokens:
            assert layout is not None
            view = memoryview(cols.tokens)
            j = 0
            for code, gid, data in zip(kinds, gids, payloads, strict=True):
                table = seen[gid][0].table
                if code == STORED:
                    at, sizes = layout[j]  # type: ignore[misc]  # no None: checked above
                    j += 1
                    span = view[4 * at : 4 * (at + sum(sizes))]
                    table.store_tokens(data[0], data[1], data[2], span, sizes, LOCAL_HASH_SEED, st)
                    if table.present > seen[gid][0].limit:
                        self._over_capacity(s, seen[gid][0])
                else:
                    removed_blocks += len(data[0])
                    table.remove(data[0], data[1], st)
        else:
            for code, gid, data in zip(kinds, gids, payloads, strict=True):
                table = seen[gid][0].table
                if code == STORED:
                    table.store_hashes(data[0], data[1], data[2], st)
                    if table.present > seen[gid][0].limit:
                        self._over_capacity(s, seen[gid][0])
                else:
                    removed_blocks += len(data[0])
                    table.remove(data[0], data[1], st)
        st.removed_blocks += removed_blocks
        return True

    def _apply_plain_native(
        self, s: SourceState, cols: ColumnBatch, st: SourceStats, seen: dict[int, list[Any]]
    ) -> None:
        """:meth:`_apply_plain`'s store and remove loop in one native call (the tables are
        the native core's), resumed after each group that goes over its capacity."""
        assert _NATIVE_APPLY is not None
        kinds = cols.kinds
        states = [seen[gid][0] for gid in cols.group_ids]
        tables = [g.table for g in states]
        limits = [g.limit for g in states]
        layout = cols.token_layout if self._tokens else None
        call, n = _NATIVE_APPLY[0], len(kinds)
        i = j = 0
        while i < n:
            i, j, removed, over = call(
                tables, limits, kinds, cols.payloads, layout, cols.tokens, LOCAL_HASH_SEED, st,
                i, j, STORED,
            )  # fmt: skip
            st.removed_blocks += removed
            if over:
                self._over_capacity(s, states[i - 1])

    def apply_many(self, batches: Iterable[EventBatch | ColumnBatch]) -> int:
        """Apply batches (models or columns) in order; returns how many."""
        n = 0
        apply = self.apply
        for b in batches:
            apply(b)
            n += 1
        return n

    def _add_source(self, key: WorkerKey) -> SourceState:
        self._epoch += 1
        s = SourceState(key, len(self._slots))
        self._slots.append(key)
        self._sources[(key.instance_id, key.dp_rank)] = s
        self._trusted |= s.bit
        return s

    def _add_group(self, s: SourceState, gid: int) -> GroupState:
        self._epoch += 1
        g = GroupState(gid, s.bit, self._tokens, self._dynamo)
        s.groups[gid] = g
        if s.stale:
            s.pending_clear.add(gid)
        return g

    def _new_incarnation(self, s: SourceState, inc: int) -> None:
        if s.incarnation is not None:
            s.stats.incarnation_changes += 1
            self._purge(s, drop_groups=True)
            if s.stale:
                s.stats.resyncs += 1
        self._set_trusted(s, True, "")
        s.incarnation = inc
        s.next_id = 0

    def _out_of_order(self, s: SourceState, eid: int, gid: int, skipped: set[int] | None) -> bool:
        """Decide on an event (id ``eid``, layer group ``gid``) whose id is not the expected
        one: True to apply it."""
        nxt = s.next_id
        st = s.stats
        if nxt is None:  # explicit resync: any id is the new baseline
            return True
        if skipped:
            while nxt < eid and nxt in skipped:
                nxt += 1
                st.skipped_events += 1
            s.next_id = nxt
            if eid == nxt:
                return True
        if eid < nxt:
            st.duplicate_events += 1
            return False
        st.gaps += 1
        st.gap_events += eid - nxt
        what = "joined mid-stream" if nxt == 0 else "event id gap"
        self._go_stale(s, f"{what}: expected event {nxt}, got {eid}", gid)
        return True

    def _on_lost(self, s: SourceState, eid: int, gid: int, lost: tuple[int, int, str]) -> None:
        """A lost marker (id ``eid``, group ``gid``) for ``(first id, count, reason)``."""
        first_id, count, reason = lost
        st = s.stats
        first = min(first_id, eid)
        last = max(first_id + count - 1, eid)
        nxt = s.next_id if s.next_id is not None else first
        if last < nxt:
            st.duplicate_events += 1
            return
        if first > nxt:
            st.gaps += 1
            st.gap_events += first - nxt
        st.lost_markers += 1
        st.lost_events += last - max(first, nxt) + 1
        s.next_id = last + 1
        self._go_stale(s, f"lost {count} events ({reason})", gid)

    def _go_stale(self, s: SourceState, reason: str, gid: int) -> None:
        if not s.stale:
            s.stats.stale_transitions += 1
            self._set_trusted(s, False, reason)
        s.pending_clear.update(s.groups)
        s.pending_clear.add(gid)

    def _set_trusted(self, s: SourceState, trusted: bool, reason: str) -> None:
        self._epoch += 1
        s.stale = not trusted
        s.stale_reason = reason
        if trusted:
            self._trusted |= s.bit
            s.pending_clear.clear()
        else:
            self._trusted &= ~s.bit

    def _on_cleared(self, s: SourceState, g: GroupState) -> None:
        s.stats.cleared_events += 1
        g.table.clear()
        self._bind(s, g)
        if s.stale:
            s.pending_clear.discard(g.gid)
            if not s.pending_clear:
                s.stats.resyncs += 1
                self._set_trusted(s, True, "")

    def _on_created(
        self, s: SourceState, g: GroupState, data: tuple[tuple[int, ...], int, str], window: int
    ) -> None:
        s.stats.created_events += 1
        self._epoch += 1
        g.window_size = window
        caps, tpb, g.attention_kind = data
        g.capacity = tuple(caps)
        g.limit = sum(g.capacity) or 1 << 62
        if g.tokens_per_block != tpb:
            if g.tokens_per_block is not None:
                s.stats.block_size_changes += 1
                if len(g.table):
                    s.stats.purges += 1
                    g.table.clear()
            g.tokens_per_block = tpb
            self._bind(s, g)

    def _check_block_size(self, s: SourceState, g: GroupState) -> None:
        """A block longer than the group's block size (advertised, or the index's default)
        means its hashes were cut differently: the worker's state cannot be trusted."""
        tpb = g.tokens_per_block or self.default_tokens_per_block
        if tpb is not None and g.max_block_tokens > tpb:
            s.stats.block_size_mismatches += 1
            self._go_stale(
                s,
                f"block size mismatch: layer group {g.gid} stored a {g.max_block_tokens}-token "
                f"block, but its block size is {tpb}",
                g.gid,
            )

    def unmatchable(
        self, worker: WorkerKey | tuple[str, int | None], layer_group_id: int = 0
    ) -> str:
        """Why ``worker``'s layer group cannot be matched ("" when it can, or is unknown):
        an algorithm requests cannot be hashed with, or no block size yet."""
        s = self._sources.get((worker[0], worker[1]))
        g = None if s is None else s.groups.get(layer_group_id)
        if g is None or g.domain is not None:
            return ""
        if g.hash_algo is None:
            return "hash algorithm unknown"
        return self._unhashable.get(g.hash_algo) or "block size not advertised"

    def _over_capacity(self, s: SourceState, g: GroupState) -> None:
        s.stats.capacity_overflows += 1
        self._go_stale(
            s,
            f"layer group {g.gid} holds {g.table.present} blocks but advertised room for "
            f"{g.limit}: removals were missed",
            g.gid,
        )

    def _set_algo(self, s: SourceState, g: GroupState, algo: str) -> None:
        self._epoch += 1
        if g.hash_algo is not None:
            s.stats.hash_algo_changes += 1
            if len(g.table):
                s.stats.purges += 1
                g.table.clear()
        g.hash_algo = algo
        self._bind(s, g)

    def _domain_key(self, g: GroupState) -> DomainKey | None:
        # Engines that never send ``created`` (vLLM, SGLang) say their block size only through
        # their blocks: the largest stored block is a full one.
        tpb = g.tokens_per_block or self.default_tokens_per_block or g.max_block_tokens or None
        if g.hash_algo is None or tpb is None:
            return None
        algo = self.key_mode.domain_algo
        if algo is None:
            if not self._can_hash(g.hash_algo):
                return None  # one worker's unknown algorithm must not fail everyone's match
            algo = g.hash_algo
        return DomainKey(algo, tpb, g.gid)

    def _can_hash(self, algo: str) -> bool:
        """Whether requests can be hashed with ``algo`` here (why not: :attr:`_unhashable`)."""
        why = self._unhashable.get(algo)
        if why is None:
            try:
                self.hasher.hasher(algo)
                why = ""
            except (HashingError, TypeError) as exc:
                why = f"hash algorithm {algo!r} cannot be used for matching: {exc}"
            self._unhashable[algo] = why
        return not why

    def _bind(self, s: SourceState, g: GroupState) -> None:
        """Attach the group's table to the domain its metadata names (or detach it)."""
        self._epoch += 1
        key = self._domain_key(g)
        old = g.domain
        if old is not None and old.key == key:
            g.table.attach(old.masks)
            return
        if old is not None:
            g.table.detach()
            old.members &= ~s.bit
            g.domain = None
        if key is None:
            return
        dom = self._domains.get(key)
        if dom is None:
            dom = self._domains[key] = HashDomain(key)
        g.domain = dom
        dom.members |= s.bit
        g.table.attach(dom.masks)

    def _purge(self, s: SourceState, *, drop_groups: bool) -> None:
        self._epoch += 1
        s.stats.purges += 1
        for g in s.groups.values():
            g.table.clear()
            if drop_groups and g.domain is not None:
                g.domain.members &= ~s.bit
                g.domain = None
        if drop_groups:
            s.groups = {}

    # ------------------------------------------------------------------ control

    def _source(self, worker: WorkerKey | tuple[str, int | None]) -> SourceState:
        s = self._sources.get((worker[0], worker[1]))
        if s is None:
            raise KeyError(f"unknown worker {worker!r}")
        return s

    def resync(self, worker: WorkerKey | tuple[str, int | None], *, purge: bool = True) -> None:
        """Trust ``worker`` again from its next event on, whatever its id (an operator's or
        a full-state dump's say-so). With ``purge`` its blocks are forgotten first."""
        s = self._source(worker)
        if purge:
            self._purge(s, drop_groups=False)
            for g in s.groups.values():
                self._bind(s, g)
        if s.stale:
            s.stats.resyncs += 1
        self._set_trusted(s, True, "")
        s.next_id = None

    def mark_stale(self, worker: WorkerKey | tuple[str, int | None], reason: str) -> None:
        """Stop trusting ``worker`` until it resyncs (e.g. its health check failed)."""
        s = self._source(worker)
        if not s.stale:
            s.stats.stale_transitions += 1
            self._set_trusted(s, False, reason)
        s.pending_clear.update(s.groups)

    def forget(self, worker: WorkerKey | tuple[str, int | None]) -> None:
        """Remove ``worker`` entirely (it left the fleet); its slot is not reused."""
        s = self._source(worker)
        self._purge(s, drop_groups=True)
        self._trusted &= ~s.bit
        del self._sources[(s.key.instance_id, s.key.dp_rank)]
        self._epoch += 1

    # ------------------------------------------------------------------ queries

    def workers(self) -> list[WorkerKey]:
        """Known workers, in the order they were first seen."""
        return [s.key for s in self._sources.values()]

    def __contains__(self, worker: object) -> bool:
        if not isinstance(worker, tuple) or len(worker) != 2:
            return False
        return (worker[0], worker[1]) in self._sources

    def is_trusted(self, worker: WorkerKey | tuple[str, int | None]) -> bool:
        """False while ``worker`` is stale (or unknown)."""
        s = self._sources.get((worker[0], worker[1]))
        return s is not None and not s.stale

    def info(self, worker: WorkerKey | tuple[str, int | None]) -> WorkerInfo:
        """A read-only view of ``worker`` (KeyError when unknown)."""
        s = self._source(worker)
        stats = SourceStats()
        stats.add(s.stats)
        return WorkerInfo(
            worker=s.key,
            incarnation=s.incarnation,
            next_event_id=s.next_id,
            stale=s.stale,
            stale_reason=s.stale_reason,
            groups=tuple(self._group_info(g) for _, g in sorted(s.groups.items())),
            stats=stats,
        )

    @staticmethod
    def _group_info(g: GroupState) -> GroupInfo:
        t = g.table
        return GroupInfo(
            layer_group_id=g.gid,
            hash_algo=g.hash_algo,
            tokens_per_block=g.tokens_per_block,
            window_size=g.window_size,
            attention_kind=g.attention_kind,
            num_blocks_per_cache_level=g.capacity,
            max_block_tokens=g.max_block_tokens,
            blocks=t.present,
            ghost_blocks=t.ghosts,
            rooted_blocks=t.rooted_count,
            domain=None if g.domain is None else g.domain.key,
        )

    def table(
        self, worker: WorkerKey | tuple[str, int | None], layer_group_id: int = 0
    ) -> GroupTable | None:
        """The block table of a worker's group (None when it has none)."""
        s = self._sources.get((worker[0], worker[1]))
        g = None if s is None else s.groups.get(layer_group_id)
        return None if g is None else g.table

    def domain_of(
        self, worker: WorkerKey | tuple[str, int | None], layer_group_id: int = 0
    ) -> DomainKey | None:
        """How requests must be hashed to match ``worker``'s group (None: unknown)."""
        s = self._sources.get((worker[0], worker[1]))
        g = None if s is None else s.groups.get(layer_group_id)
        return None if g is None or g.domain is None else g.domain.key

    def block_key(
        self,
        worker: WorkerKey | tuple[str, int | None],
        block_hash: bytes,
        layer_group_id: int = 0,
    ) -> bytes | None:
        """The key ``worker``'s block ``block_hash`` is matched under: the hash itself in
        engine mode (when known), its canonical key in token mode (None when the block, or
        its key, is not known)."""
        t = self.table(worker, layer_group_id)
        if t is None:
            return None
        if is_token_table(t):
            return t.key_of(block_hash)
        return block_hash if t.knows(block_hash) else None

    def domains(self) -> list[DomainKey]:
        """Domains with at least one member."""
        return [k for k, d in self._domains.items() if d.members]

    def stats(self) -> IndexStats:
        """Gauges and the sum of every worker's counters."""
        total = SourceStats()
        blocks = ghosts = unrooted = stale = 0
        for s in self._sources.values():
            total.add(s.stats)
            stale += s.stale
            for g in s.groups.values():
                t = g.table
                blocks += t.present
                ghosts += t.ghosts
                unrooted += t.present - t.rooted_count
        return IndexStats(
            workers=len(self._sources),
            stale_workers=stale,
            blocks=blocks,
            ghost_blocks=ghosts,
            unrooted_blocks=unrooted,
            domains=len(self.domains()),
            counters=total,
        )

    # ------------------------------------------------------------------ matching

    def match_hashes(
        self, domain: DomainKey, hashes: Sequence[bytes], *, include_stale: bool = False
    ) -> dict[WorkerKey, int]:
        """Matched blocks per worker of ``domain`` for already-hashed request blocks (only
        workers holding at least one block; stale ones only with ``include_stale``)."""
        dom = self._domains.get(domain)
        if dom is None:
            return {}
        allowed = -1 if include_stale else self._trusted
        keys = self._slots
        return {keys[slot]: d for slot, d in dom.slot_depths(hashes, allowed)}

    def match(
        self,
        tokens: Any,
        *,
        layer_group_id: int = 0,
        workers: Sequence[WorkerKey | tuple[str, int | None]] | None = None,
        request: HashRequest | None = None,
        tier_weights: Sequence[float] = DEFAULT_TIER_WEIGHTS,
        hash_algo: str | None = None,
        tokens_per_block: int | None = None,
        block_hashes: Sequence[bytes] | None = None,
    ) -> MatchResult:
        """How much of ``tokens`` each candidate worker holds in ``layer_group_id``.

        Candidates are ``workers`` (default: every known worker), reported in that order.
        The request is hashed once per domain with the algorithm and block size the workers
        advertised (token mode: once per block size with the canonical chain, and once per
        LoRA scope when ``request`` names the adapter by both name and id; a ``salt_id``
        raises ConfigError there, as events identify salts by their string).
        ``hash_algo``/``tokens_per_block``, when given, are what the caller
        expects every candidate to use: a candidate advertising something else raises
        HashConfigMismatchError rather than being matched with the wrong hashes. Stale
        workers are matched too but flagged untrusted.

        ``block_hashes``: the request's published block hashes (of the tokens ``request``
        would hash, the last one dropped unless ``drop_last_token`` is False), computed by the
        caller with ``hash_algo`` at ``tokens_per_block`` (both required then, and an engine-
        keyed index): used instead of hashing ``tokens`` again, e.g. the hashes a cache
        computed for the same prompt. ``tokens`` still gives the token count. In a
        Dynamo-keyed index (``key_mode="dynamo"``) they are Dynamo's local hashes of the
        request's blocks from the first (8 bytes big-endian each, Dynamo's
        ``/query_by_hash``), and neither ``hash_algo`` nor ``tokens_per_block`` is needed.
        """
        req = request or _DEFAULT_REQUEST
        weights = tier_weights if type(tier_weights) is tuple else tuple(tier_weights)
        plan = self._plan(layer_group_id, workers, hash_algo, tokens_per_block)
        by_domain = plan.by_domain
        if block_hashes is None:
            chains_of = self._request_chains(tokens, req, by_domain)
        elif self._dynamo:
            given = keys_from_local(block_hashes)
            chains_of = {k: [given] for k in by_domain}
        else:
            if self._tokens or hash_algo is None or tokens_per_block is None:
                raise ConfigError(
                    "block_hashes needs hash_algo and tokens_per_block, and an engine-keyed "
                    "index (a token-keyed one hashes with its own keys)"
                )
            # read only, never kept: the caller's list needs no copy
            given = block_hashes if type(block_hashes) is list else list(block_hashes)
            chains_of = {k: [given] for k in by_domain}
        dkeys = plan.dkeys
        # every chain of a domain has one key per full block: the same length
        lens = (
            tuple([len(chains_of[k][0]) for k in dkeys])
            if block_hashes is None
            else (len(given),) * len(dkeys)
        )
        out = plan.results(chains_of, lens, self._domains, weights)
        return new_match_result(tuple(out), count_tokens(tokens))

    def _plan(
        self,
        layer_group_id: int,
        workers: Sequence[WorkerKey | tuple[str, int | None]] | None,
        hash_algo: str | None,
        tokens_per_block: int | None,
    ) -> MatchPlan:
        """What :meth:`match` needs of its candidates, cached until the index's workers,
        groups, domains or trust change (an epoch bump)."""
        return self._plans.get(
            self._epoch,
            workers,
            lambda cands: self._build_plan(layer_group_id, cands, hash_algo, tokens_per_block),
            layer_group_id=layer_group_id,
            hash_algo=hash_algo,
            tokens_per_block=tokens_per_block,
        )

    def _build_plan(
        self,
        layer_group_id: int,
        cands: list[WorkerKey] | None,
        hash_algo: str | None,
        tokens_per_block: int | None,
    ) -> MatchPlan:
        if cands is None:
            cands = [s.key for s in self._sources.values()]
        plan = MatchPlan(len(cands))
        by_domain = plan.by_domain
        for pos, w in enumerate(cands):
            s = self._sources.get((w.instance_id, w.dp_rank))
            g = None if s is None else s.groups.get(layer_group_id)
            if g is None or s is None:
                note = "unknown worker" if s is None else f"no layer group {layer_group_id}"
                plan.fixed.append((pos, WorkerMatch(w, 0, 0.0, 0, None, None, False, note)))
                continue
            if hash_algo is not None and g.hash_algo is not None and g.hash_algo != hash_algo:
                raise HashConfigMismatchError(
                    f"worker {w} publishes {g.hash_algo} hashes for layer group "
                    f"{layer_group_id}, but the router is configured for {hash_algo}"
                )
            if (
                tokens_per_block is not None
                and g.tokens_per_block is not None
                and g.tokens_per_block != tokens_per_block
            ):
                raise HashConfigMismatchError(
                    f"worker {w} uses {g.tokens_per_block}-token blocks in layer group "
                    f"{layer_group_id}, but the router is configured for {tokens_per_block}"
                )
            if g.domain is None:
                if g.hash_algo is None:
                    why = "hash algorithm unknown"
                elif self._unhashable.get(g.hash_algo):
                    why = self._unhashable[g.hash_algo]
                else:
                    why = "block size not advertised"
                plan.fixed.append(
                    (pos, WorkerMatch(w, 0, 0.0, 0, g.tokens_per_block, g.hash_algo, False, why))
                )
                continue
            k = g.domain.key
            by_domain[k] = by_domain.get(k, 0) | s.bit
            row = plan.slots.get(s.slot)
            if row is None:
                note = f"stale: {s.stale_reason}" if s.stale else ""
                plan.slots[s.slot] = (w, g.table, k, not s.stale, note, pos, [])
            else:
                row[6].append(pos)  # the worker is listed again
        plan.dkeys = list(by_domain)
        return plan

    def _request_chains(
        self, tokens: Any, req: HashRequest, domains: Iterable[DomainKey]
    ) -> dict[DomainKey, list[list[bytes]]]:
        """The request's block keys per domain (one chain per LoRA scope in token mode)."""
        out: dict[DomainKey, list[list[bytes]]] = {}
        if not self._tokens:
            for k in domains:
                out[k] = [self.hasher.hashes(tokens, k.hash_algo, k.tokens_per_block, req)]
            return out
        if req.salt_id is not None:
            raise ConfigError(
                "a token-keyed index identifies a cache salt by its string (events carry "
                "cache_salt); pass cache_salt, not salt_id"
            )
        raw = b""
        scopes: list[Any] = []
        per_size: dict[int, list[list[bytes]]] = {}
        if self._dynamo:
            if req.lora_id is not None or req.cache_salt is not None or req.mm_keys:
                raise ConfigError(
                    "a Dynamo-keyed index scopes a request by its lora_name only (Dynamo's "
                    "local hashes carry no LoRA id, cache salt or multimodal keys here)"
                )
            for k in domains:
                tpb = k.tokens_per_block
                chains = per_size.get(tpb)
                if chains is None:
                    if not raw:
                        raw = request_raw(tokens, req.drop_last_token)
                    chains = per_size[tpb] = [dynamo_request_keys(raw, tpb, req.lora_name)]
                out[k] = chains
            return out
        for k in domains:
            tpb = k.tokens_per_block
            chains = per_size.get(tpb)
            if chains is None:
                if not scopes:
                    raw = request_raw(tokens, req.drop_last_token)
                    scopes = lora_scopes(req.lora_name, req.lora_id)
                mm = request_mm(req.mm_keys, len(raw) // (4 * tpb))
                chains = per_size[tpb] = [
                    request_keys(raw, tpb, scope, req.cache_salt, mm) for scope in scopes
                ]
            out[k] = chains
        return out

    # ------------------------------------------------------------------ state

    def canonical_state(self) -> dict[str, Any]:
        """Everything that defines the index's behaviour, in a comparable form (two indexes
        with equal canonical states answer every query and every future event alike)."""
        out: dict[str, Any] = {}
        for s in self._sources.values():
            groups: dict[int, dict[str, Any]] = {}
            for gid, g in sorted(s.groups.items()):
                groups[gid] = {
                    "hash_algo": g.hash_algo,
                    "tokens_per_block": g.tokens_per_block,
                    "window_size": g.window_size,
                    "attention_kind": g.attention_kind,
                    "capacity": g.capacity,
                    "max_block_tokens": g.max_block_tokens,
                    "domain": None if g.domain is None else tuple(g.domain.key),
                    "nodes": g.table.nodes(),
                }
                if is_token_table(g.table):
                    groups[gid]["keys"] = g.table.keys()
            out[str(s.key)] = {
                "incarnation": s.incarnation,
                "next_id": s.next_id,
                "stale": s.stale,
                "stale_reason": s.stale_reason,
                "pending_clear": sorted(s.pending_clear),
                "groups": groups,
                "stats": s.stats.as_dict(),
            }
        return out

    def export_state(self) -> dict[str, Any]:
        """Metadata of every worker (JSON-able) for snapshots; tables via :meth:`tables`."""
        workers = []
        for s in self._sources.values():
            workers.append(
                {
                    "instance_id": s.key.instance_id,
                    "dp_rank": s.key.dp_rank,
                    "slot": s.slot,
                    "incarnation": s.incarnation,
                    "next_id": s.next_id,
                    "stale": s.stale,
                    "stale_reason": s.stale_reason,
                    "pending_clear": sorted(s.pending_clear),
                    "stats": s.stats.as_dict(),
                    "groups": [
                        {
                            "layer_group_id": g.gid,
                            "hash_algo": g.hash_algo,
                            "tokens_per_block": g.tokens_per_block,
                            "window_size": g.window_size,
                            "attention_kind": g.attention_kind,
                            "capacity": list(g.capacity),
                            "max_block_tokens": g.max_block_tokens,
                        }
                        for g in s.groups.values()
                    ],
                }
            )
        return {
            "default_tokens_per_block": self.default_tokens_per_block,
            "key_mode": self.key_mode.value,
            "slots": [[k.instance_id, k.dp_rank] for k in self._slots],
            "workers": workers,
        }

    def tier_match(
        self, domain: DomainKey, keys: list[bytes], *, include_stale: bool = False
    ) -> list[tuple[WorkerKey, int, int, int, int]]:
        """Per worker of ``domain`` holding a prefix of the request's ``keys`` (already
        computed for that domain): ``(worker, gpu, host, disk, any)``, the blocks its prefix
        reaches counting only GPU copies, GPU or host, GPU, host or disk, and any tier.
        Stale workers only with ``include_stale``; in slot order."""
        dom = self._domains.get(domain)
        if dom is None or not keys:
            return []
        allowed = -1 if include_stale else self._trusted
        slots = self._slots
        sources = self._sources
        gid = domain.layer_group_id
        out = []
        for slot, depth in dom.slot_depths(keys, allowed):
            w = slots[slot]
            table = sources[(w.instance_id, w.dp_rank)].groups[gid].table
            gpu, host, disk = table.tier_depths(keys, depth)
            out.append((w, gpu, host, disk, depth))
        return out

    def tables(self) -> list[tuple[WorkerKey, int, GroupTable]]:
        """Every (worker, layer group id, table), in :meth:`export_state` order."""
        return [(s.key, g.gid, g.table) for s in self._sources.values() for g in s.groups.values()]

    @classmethod
    def from_state(
        cls,
        state: Mapping[str, Any],
        tables: Mapping[tuple[WorkerKey, int], Sequence[Any]],
        *,
        hasher_params: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> PrefixIndex:
        """Rebuild an index from :meth:`export_state` and per-table dumps keyed by worker
        and group id: ``GroupTable.dump_nodes`` output, followed in token mode by
        ``TokenGroupTable.dump_keys`` output (5 items). A state without ``key_mode`` is an
        engine-mode one. ValueError when a dump does not fit its table."""
        idx = cls(
            default_tokens_per_block=state.get("default_tokens_per_block"),
            hasher_params=hasher_params,
            key_mode=state.get("key_mode", KeyMode.ENGINE),
        )
        for inst, rank in state["slots"]:
            idx._slots.append(WorkerKey(inst, rank))
        for w in state["workers"]:
            key = WorkerKey(w["instance_id"], w["dp_rank"])
            s = SourceState(key, int(w["slot"]))
            if idx._slots[s.slot] != key:
                raise ValueError(f"slot {s.slot} does not belong to {key}")
            s.incarnation = w["incarnation"]
            s.next_id = w["next_id"]
            s.stale = bool(w["stale"])
            s.stale_reason = str(w["stale_reason"])
            s.pending_clear = set(w["pending_clear"])
            s.stats.load(w["stats"])
            idx._sources[(key.instance_id, key.dp_rank)] = s
            if not s.stale:
                idx._trusted |= s.bit
            for gd in w["groups"]:
                g = GroupState(int(gd["layer_group_id"]), s.bit, idx._tokens, idx._dynamo)
                g.hash_algo = gd["hash_algo"]
                g.tokens_per_block = gd["tokens_per_block"]
                g.window_size = gd["window_size"]
                g.attention_kind = gd["attention_kind"]
                g.capacity = tuple(gd["capacity"])
                g.limit = sum(g.capacity) or 1 << 62
                g.max_block_tokens = int(gd["max_block_tokens"])
                s.groups[g.gid] = g
                dump = tables.get((key, g.gid))
                if dump is not None:
                    if len(dump) != (5 if idx._tokens else 3):
                        raise ValueError(
                            f"a {idx.key_mode.value}-keyed table dump has "
                            f"{5 if idx._tokens else 3} parts, got {len(dump)}"
                        )
                    nodes = list(zip(dump[0], dump[1], dump[2], strict=True))
                    if is_token_table(g.table):
                        g.table.load_keyed(nodes, dump[3], dump[4])
                    else:
                        g.table.load_nodes(nodes)
                idx._bind(s, g)
        return idx

    def check(self) -> None:
        """Verify internal invariants (tests): every table, and the domain masks equal the
        union of the attached tables' rooted blocks."""
        expect: dict[DomainKey, dict[bytes, int]] = {k: {} for k in self._domains}
        for s in self._sources.values():
            for g in s.groups.values():
                g.table.check()
                if g.domain is not None:
                    m = expect[g.domain.key]
                    for h in g.table.mirrored():
                        m[h] = m.get(h, 0) | s.bit
        for k, d in self._domains.items():
            assert d.masks.as_dict() == expect[k], f"domain {k} masks differ from its tables"


_DEFAULT_REQUEST = HashRequest()

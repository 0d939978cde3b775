"""kvstream :class:`~kvstream.events.model.EventBatch` -> vLLM's ``KVEventBatch`` msgpack payload.

The bytes :meth:`VllmExporter.encode` returns are what vLLM >= 0.24 (0.33 checked) puts in the
third ZMQ frame: a 3-slot array ``[ts, [events], data_parallel_rank]`` whose events are maps
tagged ``{"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared", ...}``, encoded as vLLM's
msgspec structs encode them, byte for byte (``omit_defaults``: a defaulted field at its
default is left out; ``lora_id``, ``medium`` and ``lora_name`` of ``BlockStored`` and
``medium`` of ``BlockRemoved`` have no default and are always present). Dynamo's and llm-d's
decoders, and vLLM's own ``msgspec.msgpack.Decoder(KVEventBatch)``, read them. No sockets
here (:mod:`.zmq_pub`).

What each kvstream kind becomes
===============================

``stored``
    ``BlockStored`` per run of consecutive blocks that share token count, ``lora_id``,
    ``lora_name`` and ``cache_level`` (vLLM has one ``block_size``/``medium``/LoRA per
    event); each run's ``parent_block_hash`` is the previous run's last block, so the chain
    is unbroken. ``token_ids`` are the run's tokens concatenated, ``block_size`` the tokens
    per block, ``medium`` from the cache level (:data:`MEDIUM_BY_LEVEL`), ``extra_keys`` one
    entry per block, the block's own extra keys verbatim or nil (vLLM 0.33's block pool
    always sends this list, ``[None, None]`` for two blocks without keys; the golden
    captures in ``tests/data/golden/vllm-0.33.0`` show it), ``group_idx`` the
    ``layer_group_id``, and ``kv_cache_spec_kind``/``kv_cache_spec_sliding_window`` from the
    group's attention kind (below).
``removed``
    ``BlockRemoved`` (``medium`` from the event's ``cache_level``; without one, the tier this
    exporter last saw the block on, else nil), one event per run of hashes that share a
    medium.
``updated``
    A tier move ``old -> new`` becomes ``BlockStored(medium=new)`` followed by
    ``BlockRemoved(medium=old)``: what vLLM's offloading connector publishes when a block
    reaches the CPU tier and later leaves the GPU, and what Dynamo and llm-d track per
    medium. The ``BlockStored`` repeats the block's parent, tokens, LoRA and extra keys when
    this exporter saw the block stored (it remembers up to ``track_blocks`` blocks per
    source); otherwise it is vLLM's placeholder shape (``token_ids=[]``, ``block_size=0``,
    nil parent). A priority-only change has no vLLM slot: nothing is sent.
``cleared``
    ``AllBlocksCleared``. vLLM's is engine-wide, kvstream's is per layer group, so consumers
    drop every group of the rank (the safe direction); adjacent ones collapse to one.
``lost``
    ``AllBlocksCleared``: the events in the gap are unknowable, and a vLLM-format consumer
    has no other resync signal (TensorRT-LLM's own fanout does the same on a gap).
``created``
    Nothing on the wire. It sets the group's attention kind for later events.

A new ``incarnation`` of a source starts with ``AllBlocksCleared`` (the restarted engine's
blocks are gone) and :attr:`ExportedBatch.restarted` is set, so a publisher can restart its
sequence numbers as a restarted vLLM would. An *older* incarnation than one already seen
raises :class:`~kvstream.errors.InteropError` (late batches of a dead process).

Attention kind of a group: the ``attention_kind`` of the source's last ``created`` event for
it; else ``full_attention`` when ``window_size`` is
:data:`~kvstream.events.model.UNBOUNDED_WINDOW`; else unknown, and the event carries no kind
(what vLLM before 0.2x sent; Dynamo and llm-d treat a kind-less group as main attention).
A sliding-window group publishes ``kv_cache_spec_sliding_window = window_size``.

Hashes (``hash_format``): an 8-byte hash is always its unsigned 64-bit int. A wider one (a
256-bit digest) is, with ``int`` (default, what Dynamo accepts), the last 8 bytes big-endian
as an unsigned int (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` rule); with ``bytes`` the
raw digest as msgpack ``bin`` (vLLM's ``=0`` mode; llm-d reads it, Dynamo rejects it).

kvstream fields with no vLLM slot: ``event_id``, ``hash_algo``, ``window_size`` of
full-attention groups, ``priority``, ``cache_salt``, ``mm_keys``, ``token_extra_ids``, the
source's ``instance_id``/``incarnation`` and ``Lost.first_event_id/count/reason``
(``docs/engines.md`` has the table).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias

import msgspec

from kvstream._types import CacheLevel, TokenIds
from kvstream.errors import ConfigError, InteropError
from kvstream.events.model import (
    UNBOUNDED_WINDOW,
    AttentionKind,
    Cleared,
    Created,
    EventBatch,
    KVCacheEvent,
    Lost,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)

__all__ = [
    "HASH_FORMATS",
    "MEDIUM_BY_LEVEL",
    "ExportedBatch",
    "HashFormat",
    "VllmExporter",
    "medium_of",
    "wire_hash",
]

HashFormat: TypeAlias = Literal["int", "bytes"]
HASH_FORMATS: Final[tuple[HashFormat, ...]] = ("int", "bytes")

#: kvstream cache level -> vLLM ``medium``. vLLM names its tiers GPU, CPU and STORAGE; SGLang
#: and Dynamo add EXTERNAL. Levels above 3 (undefined in kvstream) are published as EXTERNAL.
MEDIUM_BY_LEVEL: Final[dict[int, str]] = {
    CacheLevel.GPU: "GPU",
    CacheLevel.HOST: "CPU",
    CacheLevel.DISK: "STORAGE",
    CacheLevel.EXTERNAL: "EXTERNAL",
}

_U64_MASK: Final = (1 << 64) - 1


# vLLM 0.33's wire structs, field for field in declaration order (it is the wire contract):
# omit_defaults drops a defaulted field at its default, tag puts {"type": NAME} first. The
# fields kvstream never sets are declared too: msgspec sizes a map's header by the declared
# field count (BlockStored's 16 keys take a map16 header), so the bytes match vLLM 0.33's.
class _WireEvent(msgspec.Struct, omit_defaults=True, gc=False):
    pass


class _BlockStored(_WireEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _BlockRemoved(_WireEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _AllBlocksCleared(_WireEvent, tag="AllBlocksCleared"):
    pass


_Event: TypeAlias = _BlockStored | _BlockRemoved | _AllBlocksCleared


class _WireBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Event]
    data_parallel_rank: int | None


def wire_hash(block_hash: bytes, hash_format: HashFormat = "int") -> int | bytes:
    """A kvstream hash as vLLM publishes it (module docstring, "Hashes")."""
    if len(block_hash) <= 8:
        return int.from_bytes(block_hash, "big")
    if hash_format == "bytes":
        return block_hash
    return int.from_bytes(block_hash[-8:], "big") & _U64_MASK


def medium_of(cache_level: int | None) -> str | None:
    """vLLM's ``medium`` for a kvstream cache level (None stays None: unknown)."""
    if cache_level is None:
        return None
    return MEDIUM_BY_LEVEL.get(cache_level, "EXTERNAL")


@dataclass(frozen=True, slots=True)
class ExportedBatch:
    """What :meth:`VllmExporter.encode` made of one kvstream batch.

    ``payload`` is the msgpack ``KVEventBatch`` (None when nothing maps to the wire: vLLM
    publishes no empty batches), ``events`` how many vLLM events it holds, ``restarted`` True
    when the batch opened a new incarnation of its source.
    """

    payload: bytes | None
    events: int
    restarted: bool = False


@dataclass(slots=True)
class _Known:
    """A block this exporter saw stored: enough to announce it again on another tier."""

    parent: bytes | None
    block: StoredBlock
    level: int


@dataclass(slots=True)
class _SourceState:
    incarnation: int
    kinds: dict[int, AttentionKind] = field(default_factory=dict)
    known: dict[tuple[int, bytes], _Known] = field(default_factory=dict)


class VllmExporter:
    """Maps kvstream batches to vLLM ``KVEventBatch`` payloads, one source at a time.

    Stateful per source (``instance_id``, rank): each group's attention kind from ``created``
    events, the source's incarnation, and up to ``track_blocks`` stored blocks per source
    (oldest forgotten first; 0 disables it) so ``updated`` tier moves can be published as
    self-describing ``BlockStored`` events. Not thread-safe; batches of one source must come
    in order. See the module docstring for the mapping.
    """

    def __init__(self, *, hash_format: HashFormat = "int", track_blocks: int = 100_000) -> None:
        if hash_format not in HASH_FORMATS:
            raise ConfigError(f"hash_format must be one of {HASH_FORMATS}, got {hash_format!r}")
        if track_blocks < 0:
            raise ConfigError(f"track_blocks must be >= 0, got {track_blocks}")
        self.hash_format: HashFormat = hash_format
        self.track_blocks = track_blocks
        self._sources: dict[tuple[str, int | None], _SourceState] = {}
        self._encoder = msgspec.msgpack.Encoder()
        #: kvstream events that had nothing to say on the wire, by reason.
        self.unmapped: dict[str, int] = {}

    def encode(self, batch: EventBatch, *, dp_rank: int | None = None) -> ExportedBatch:
        """The vLLM payload of ``batch``; ``dp_rank`` (default: the source's rank, else 0) is
        stamped as ``data_parallel_rank``. Raises :class:`InteropError` for a batch of an
        incarnation older than one this exporter already saw for the source."""
        source = batch.source
        rank = (source.attention_dp_rank or 0) if dp_rank is None else dp_rank
        state = self._sources.get(source.key)
        restarted = False
        events: list[_Event] = []
        if state is None:
            state = self._sources[source.key] = _SourceState(source.incarnation)
        elif source.incarnation != state.incarnation:
            if source.incarnation < state.incarnation:
                raise InteropError(
                    f"source {source.instance_id!r} rank {source.attention_dp_rank}: "
                    f"incarnation {source.incarnation} is older than {state.incarnation}, "
                    "already published"
                )
            state = self._sources[source.key] = _SourceState(source.incarnation)
            restarted = True
            events.append(_AllBlocksCleared())
        for ev in batch.events:
            self._map_event(ev, state, events)
        if not events:
            return ExportedBatch(None, 0, restarted)
        payload = self._encoder.encode(_WireBatch(batch.ts_ns / 1e9, events, rank))
        return ExportedBatch(payload, len(events), restarted)

    def forget(self, instance_id: str, attention_dp_rank: int | None) -> None:
        """Drop everything known about a source (its next batch starts afresh, no restart)."""
        self._sources.pop((instance_id, attention_dp_rank), None)

    # ------------------------------------------------------------------------- mapping

    def _map_event(self, ev: KVCacheEvent, state: _SourceState, out: list[_Event]) -> None:
        data = ev.data
        if isinstance(data, Stored):
            self._stored(ev, data, state, out)
        elif isinstance(data, Removed):
            self._removed(ev, data, state, out)
        elif isinstance(data, Updated):
            self._updated(ev, data, state, out)
        elif isinstance(data, Cleared):
            group = ev.layer_group_id
            state.known = {k: v for k, v in state.known.items() if k[0] != group}
            _clear(out)
        elif isinstance(data, Lost):
            state.known.clear()
            _clear(out)
        elif isinstance(data, Created):
            state.kinds[ev.layer_group_id] = data.attention_kind
            self._count("created")

    def _spec(self, ev: KVCacheEvent, state: _SourceState) -> tuple[str | None, int | None]:
        kind = state.kinds.get(ev.layer_group_id)
        if kind is None and ev.window_size == UNBOUNDED_WINDOW:
            kind = AttentionKind.FULL
        if kind is AttentionKind.SLIDING_WINDOW:
            return kind.value, ev.window_size
        return (kind.value if kind is not None else None), None

    def _stored(
        self, ev: KVCacheEvent, data: Stored, state: _SourceState, out: list[_Event]
    ) -> None:
        fmt = self.hash_format
        kind, window = self._spec(ev, state)
        group = ev.layer_group_id
        parent = data.parent_hash
        for run in _runs(data.blocks):
            first = run[0]
            out.append(
                _BlockStored(
                    block_hashes=[wire_hash(b.block_hash, fmt) for b in run],
                    parent_block_hash=None if parent is None else wire_hash(parent, fmt),
                    token_ids=_tokens(run),
                    block_size=len(first.token_ids),
                    lora_id=first.lora_id,
                    medium=medium_of(first.cache_level),
                    lora_name=first.lora_name,
                    extra_keys=[b.extra_keys for b in run],
                    group_idx=group,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                )
            )
            for b in run:
                self._remember(state, group, parent, b)
                parent = b.block_hash

    def _removed(
        self, ev: KVCacheEvent, data: Removed, state: _SourceState, out: list[_Event]
    ) -> None:
        group = ev.layer_group_id
        known = state.known
        run: list[int | bytes] = []
        run_medium: str | None = None
        for h in data.block_hashes:
            key = (group, h)
            seen = known.get(key)
            level = data.cache_level
            if level is None:
                level = None if seen is None else seen.level
                known.pop(key, None)
            elif seen is not None and seen.level == level:
                known.pop(key, None)
            medium = medium_of(level)
            if run and medium != run_medium:
                out.append(_BlockRemoved(run, run_medium, group))
                run = []
            run_medium = medium
            run.append(wire_hash(h, self.hash_format))
        out.append(_BlockRemoved(run, run_medium, group))

    def _updated(
        self, ev: KVCacheEvent, data: Updated, state: _SourceState, out: list[_Event]
    ) -> None:
        diff = data.cache_level
        if diff is None or diff.old_value == diff.new_value:
            self._count("priority_update")
            return
        fmt = self.hash_format
        group = ev.layer_group_id
        kind, window = self._spec(ev, state)
        h = wire_hash(data.block_hash, fmt)
        seen = state.known.get((group, data.block_hash))
        if seen is None:
            self._count("tier_move_without_tokens")
            stored = _BlockStored(
                [h], None, [], 0, None, medium_of(diff.new_value), None, None, group, kind, window
            )
        else:
            b = seen.block
            seen.level = diff.new_value
            stored = _BlockStored(
                block_hashes=[h],
                parent_block_hash=None if seen.parent is None else wire_hash(seen.parent, fmt),
                token_ids=b.token_ids.tolist(),
                block_size=len(b.token_ids),
                lora_id=b.lora_id,
                medium=medium_of(diff.new_value),
                lora_name=b.lora_name,
                extra_keys=[b.extra_keys],
                group_idx=group,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
            )
        out.append(stored)
        out.append(_BlockRemoved([h], medium_of(diff.old_value), group))

    def _remember(
        self, state: _SourceState, group: int, parent: bytes | None, block: StoredBlock
    ) -> None:
        if not self.track_blocks:
            return
        known = state.known
        key = (group, block.block_hash)
        known.pop(key, None)  # re-inserted at the end: the newest
        if len(known) >= self.track_blocks:
            del known[next(iter(known))]
        known[key] = _Known(parent, block, block.cache_level)

    def _count(self, reason: str) -> None:
        self.unmapped[reason] = self.unmapped.get(reason, 0) + 1


def _clear(out: list[_Event]) -> None:
    if not out or not isinstance(out[-1], _AllBlocksCleared):
        out.append(_AllBlocksCleared())


def _runs(blocks: Iterable[StoredBlock]) -> Iterator[list[StoredBlock]]:
    """Consecutive blocks that can share one ``BlockStored`` (same size, LoRA and tier)."""
    run: list[StoredBlock] = []
    key: tuple[object, ...] = ()
    for b in blocks:
        k = (len(b.token_ids), b.lora_id, b.lora_name, b.cache_level)
        if run and k != key:
            yield run
            run = []
        key = k
        run.append(b)
    if run:
        yield run


def _tokens(run: list[StoredBlock]) -> list[int]:
    if len(run) == 1:
        return run[0].token_ids.tolist()
    return TokenIds.from_bytes(b"".join(b.token_ids.raw for b in run)).tolist()

"""A batch of events as columns: what consumers and publishers need, without a model per event.

:class:`ColumnBatch` is the event model's columnar form (DESIGN §1, L1): one list per event
field, one payload tuple per event, and every stored block's token ids in one byte string.
Decoders fill it straight from bytes (Avro records in :mod:`kvstream.codec.columnar`, engine
frames in :mod:`kvstream.engines`); :meth:`ColumnBatch.from_batch` builds it from a validated
model batch. The validated :class:`~kvstream.events.model.EventBatch` stays the public API:
:meth:`ColumnBatch.to_batch` builds it on demand through the ``build`` callable its producer
gave (or returns the model it was built from).

``from_batch``'s loop runs in C (``model_columns`` of the optional codec extension) for
batches of only stored and removed events; the Python loop here is the reference, and
``KVSTREAM_NO_NATIVE=1`` or a missing extension leaves only it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any, Final, TypeAlias

from kvstream._native import load as load_native
from kvstream._types import TokenIds
from kvstream.errors import DecodeError
from kvstream.events.model import (
    AttentionKind,
    Cleared,
    Created,
    EventBatch,
    EventDiff,
    KVCacheEvent,
    Lost,
    MmKey,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
    Updated,
)

__all__ = [
    "CLEARED",
    "CREATED",
    "KIND_NAMES",
    "LOST",
    "REMOVED",
    "STORED",
    "UPDATED",
    "ColumnBatch",
    "StoredAttrs",
    "StoredExtra",
    "model_of_columns",
    "native_model_columns",
    "publish_columns",
]

#: Event kinds as small ints (:attr:`ColumnBatch.kinds`).
CREATED: Final = 0
STORED: Final = 1
REMOVED: Final = 2
UPDATED: Final = 3
CLEARED: Final = 4
LOST: Final = 5
#: The model's name (``data.type``) of each kind code.
KIND_NAMES: Final = ("created", "stored", "removed", "updated", "cleared", "lost")


_UNSET: Final[Any] = object()


def native_model_columns() -> Any:
    """The C loop of :meth:`ColumnBatch.from_batch`, or None (pure Python); loaded on first
    use: the extension lives in the codec package, which imports this module."""
    global _model_columns  # noqa: PLW0603  (set once; tests patch it to force Python)
    if _model_columns is _UNSET:
        _model_columns = None
        # an extension module without Python dependencies: it reads model attributes
        mod: Any = load_native("kvstream.codec._columns_native")
        _model_columns = getattr(mod, "model_columns", None)
    return _model_columns


#: ColumnBatch.from_batch's loop in C for batches of stored and removed events (None: Python;
#: unset until :func:`native_model_columns` first runs)
_model_columns: Any = _UNSET

#: Per-block attribute columns of a stored event, each one entry per block: cache levels,
#: priorities, LoRA ids, LoRA names, cache salts, extra token ids (TokenIds | None), multimodal
#: keys (a tuple of MmKey per block), extra keys (a tuple or None per block).
StoredAttrs: TypeAlias = tuple[
    tuple[int, ...],
    tuple[int, ...],
    tuple[int | None, ...],
    tuple[str | None, ...],
    tuple[str | None, ...],
    tuple[TokenIds | None, ...],
    tuple[tuple[MmKey, ...], ...],
    tuple[tuple[Any, ...] | None, ...],
]
#: ``(block token counts, attrs or None)`` of one stored event (:attr:`ColumnBatch.stored_extra`).
StoredExtra: TypeAlias = tuple[list[int], StoredAttrs | None]

#: Field readers of :meth:`ColumnBatch.from_batch`.
_BLOCK_HASH: Final = operator.attrgetter("block_hash")
_CACHE_LEVEL: Final = operator.attrgetter("cache_level")


class ColumnBatch:
    """One decoded batch as columns (one entry per event that was not skipped).

    ``kinds[i]`` is a kind code (:data:`STORED`, ...), ``payloads[i]`` its values:

    ======== ================================================================================
    kind      payload
    ======== ================================================================================
    created   ``(num_blocks_per_cache_level tuple, tokens_per_block, attention kind value)``
    stored    ``(parent_hash | None, block hashes list, cache level int | per-block list,
              tokens of the first block)``, plus the model's blocks when :attr:`has_blocks`
    removed   ``(block hashes list, cache_level | None)``
    updated   ``(block_hash, (old, new) cache level | None, (old, new) priority | None)``
    cleared   None
    lost      ``(first_event_id, count, reason)``
    ======== ================================================================================

    ``tokens`` holds every stored block's token ids in order (u32 little-endian), as the
    token pack had them (bit planes the C decoder validated are unpacked on first access).
    :meth:`to_batch` builds the validated :class:`EventBatch` (cached).

    Columns a publisher encodes (:func:`publish_columns`, the engine bridges) also carry
    :attr:`stored_extra`: per stored event, in order, ``(sizes, attrs)``: each block's token
    count, and None when every block's other attributes are at their defaults (its cache
    level is the payload's), else :data:`StoredAttrs`, one tuple per attribute with one entry
    per block. Without a ``build`` callable or a model, :meth:`to_batch` then builds and
    validates the model from the columns themselves.
    """

    __slots__ = (
        "_batch",
        "_build",
        "_planes",
        "_source",
        "_tokens",
        "attention_dp_rank",
        "event_ids",
        "group_ids",
        "has_blocks",
        "hash_algos",
        "incarnation",
        "instance_id",
        "kinds",
        "payloads",
        "schema_version",
        "stored_extra",
        "token_layout",
        "ts_ns",
        "window_sizes",
    )

    def __init__(
        self,
        instance_id: str,
        *,
        attention_dp_rank: int | None,
        incarnation: int,
        ts_ns: int,
        schema_version: int,
        tokens: bytes | None,
        build: Callable[[], EventBatch] | None = None,
        batch: EventBatch | None = None,
        planes: tuple[Any, ...] | None = None,
    ) -> None:
        self._fill(
            instance_id, attention_dp_rank, incarnation, ts_ns, schema_version, tokens, planes,
            build, [], [], [], [], [], [], None,
        )  # fmt: skip
        self._batch = batch

    @classmethod
    def decoded(  # noqa: PLR0917  (positional: the decoders' hot path, a call per message)
        cls,
        instance_id: str,
        attention_dp_rank: int | None,
        incarnation: int,
        ts_ns: int,
        schema_version: int,
        tokens: bytes | None,
        planes: tuple[Any, ...] | None,
        build: Callable[[], EventBatch] | None,
        event_ids: list[int],
        kinds: list[int],
        hash_algos: list[str],
        group_ids: list[int],
        window_sizes: list[int],
        payloads: list[Any],
        token_layout: list[tuple[int, list[int]] | None] | None,
    ) -> ColumnBatch:
        """Columns a decoder filled, its lists taken as they are (they become the batch's):
        the constructor's fields plus every column in one step, for the decoders' hot path
        (the constructor makes empty lists they would replace at once: about 1.3 µs a
        message). No stored extra, no model's blocks (a consumer's columns)."""
        self = cls.__new__(cls)
        self._fill(
            instance_id, attention_dp_rank, incarnation, ts_ns, schema_version, tokens, planes,
            build, event_ids, kinds, hash_algos, group_ids, window_sizes, payloads, token_layout,
        )  # fmt: skip
        self._batch = None
        return self

    def _fill(  # noqa: PLR0917  (the constructors' one body)
        self,
        instance_id: str,
        attention_dp_rank: int | None,
        incarnation: int,
        ts_ns: int,
        schema_version: int,
        tokens: bytes | None,
        planes: tuple[Any, ...] | None,
        build: Callable[[], EventBatch] | None,
        event_ids: list[int],
        kinds: list[int],
        hash_algos: list[str],
        group_ids: list[int],
        window_sizes: list[int],
        payloads: list[Any],
        token_layout: list[tuple[int, list[int]] | None] | None,
    ) -> None:
        self.instance_id = instance_id
        self.attention_dp_rank = attention_dp_rank
        self.incarnation = incarnation
        self.ts_ns = ts_ns
        self.schema_version = schema_version
        self._tokens = tokens
        #: (unpack function, buffer, count, high_bits, low16 offset, planes offset) of valid
        #: bit planes not unpacked yet (``tokens`` is None then)
        self._planes = planes
        self.event_ids = event_ids
        self.kinds = kinds
        self.hash_algos = hash_algos
        self.group_ids = group_ids
        self.window_sizes = window_sizes
        self.payloads = payloads
        #: True when stored payloads carry the model's blocks as a fifth item (from_batch)
        self.has_blocks = False
        #: per stored event, what a publisher needs beyond the payload (see the class doc);
        #: None in columns built for consumers
        self.stored_extra: list[StoredExtra] | None = None
        #: per stored event, in order: ``(index of its first token id in tokens (ids, not
        #: bytes), each block's token count)`` when its blocks carry token ids only (no LoRA, salt,
        #: multimodal, extra ids or extra keys), else None; None when the decoder did not say
        self.token_layout = token_layout
        #: builds the validated model (from the record or frame the columns came from)
        self._build = build
        self._source: SourceId | None = None

    @property
    def tokens(self) -> bytes:
        """Every stored block's token ids, in order, as little-endian uint32 bytes."""
        if self._tokens is None:
            assert self._planes is not None
            unpack, *args = self._planes
            self._tokens = unpack(*args)
            self._planes = None
        return self._tokens

    @tokens.setter
    def tokens(self, value: bytes) -> None:
        self._tokens = value
        self._planes = None

    def __len__(self) -> int:
        """Events."""
        return len(self.event_ids)

    def to_batch(self) -> EventBatch:
        """The batch as the validated event model, built once: by the producer's ``build``,
        else from the columns and :attr:`stored_extra` (EventValidationError for values the
        model refuses); DecodeError when neither is there."""
        if self._batch is None:
            if self._build is not None:
                self._batch = self._build()
            elif self.stored_extra is not None:
                self._batch = model_of_columns(self)
            else:
                raise DecodeError("a column batch without its source record or model")
        return self._batch

    # The metadata a pipeline reads without building the model (as DeferredBatch offers it).

    @property
    def source(self) -> SourceId:
        """The producer, as :attr:`EventBatch.source` (built once, one model per batch)."""
        src = self._source
        if src is None:
            src = self._source = SourceId(
                instance_id=self.instance_id,
                attention_dp_rank=self.attention_dp_rank,
                incarnation=self.incarnation,
            )
        return src

    @property
    def num_events(self) -> int:
        """How many events (lost markers included) the batch holds."""
        return len(self.event_ids)

    def spans(self) -> Iterator[tuple[int, int, str, int, int]]:
        """Per event, in order: the inclusive id range it stands for (a lost marker's whole
        range) and its hash_algo, layer group and window (``EventSpan``)."""
        for eid, kind, algo, gid, window, payload in zip(
            self.event_ids,
            self.kinds,
            self.hash_algos,
            self.group_ids,
            self.window_sizes,
            self.payloads,
            strict=True,
        ):
            lo = hi = eid
            if kind == LOST:
                lo = min(payload[0], eid)
                hi = max(payload[0] + payload[1] - 1, eid)
            yield lo, hi, algo, gid, window

    @property
    def first_event_id(self) -> int | None:
        """The lowest id the batch covers (None if it has no events)."""
        return next(self.spans())[0] if self.event_ids else None

    @property
    def last_event_id(self) -> int | None:
        """The highest id the batch covers (its events are in id order; None if none)."""
        if not self.event_ids:
            return None
        i = len(self.event_ids) - 1
        eid = self.event_ids[i]
        if self.kinds[i] == LOST:
            first: int = self.payloads[i][0]
            count: int = self.payloads[i][1]
            return max(first + count - 1, eid)
        return eid

    @property
    def materialized(self) -> bool:
        """True once the model is built (or was given)."""
        return self._batch is not None

    def materialize(self) -> EventBatch:
        """:meth:`to_batch` (the name a pipeline calls on any batch built on demand)."""
        return self.to_batch()

    @property
    def stored_blocks(self) -> int:
        """Blocks announced by the stored events."""
        return sum(len(p[1]) for k, p in zip(self.kinds, self.payloads, strict=True) if k == 1)

    @classmethod
    def from_batch(cls, batch: EventBatch) -> ColumnBatch:
        """The columns of an already validated model batch (:attr:`tokens` stays empty)."""
        src = batch.source
        # every slot set here as __init__(..., tokens=b"", batch=batch) sets it (called with
        # keywords, __init__ took a third of this method's time); tests/test_columnar_model.py
        # checks that no slot is left unset and the result equals the constructor's
        out = cls.__new__(cls)
        out.instance_id = src.instance_id
        out.attention_dp_rank = src.attention_dp_rank
        out.incarnation = src.incarnation
        out.ts_ns = batch.ts_ns
        out.schema_version = batch.schema_version
        out._tokens = b""
        out._planes = None
        out._build = None
        out._batch = batch
        out._source = None
        out.has_blocks = True
        out.stored_extra = None
        out.token_layout = None
        native = _model_columns if _model_columns is not _UNSET else native_model_columns()
        if native is not None:
            cols = native(batch.events, Stored, Removed, STORED, REMOVED)
            if cols is not None:  # only stored and removed events: the loop below, in C
                (
                    out.event_ids,
                    out.hash_algos,
                    out.group_ids,
                    out.window_sizes,
                    out.kinds,
                    out.payloads,
                ) = cols
                return out
        out.event_ids = event_ids = []
        out.hash_algos = hash_algos = []
        out.group_ids = group_ids = []
        out.window_sizes = window_sizes = []
        out.kinds = kinds = []
        out.payloads = payloads = []
        for ev in batch.events:
            d = ev.data
            event_ids.append(ev.event_id)
            hash_algos.append(ev.hash_algo)
            group_ids.append(ev.layer_group_id)
            window_sizes.append(ev.window_size)
            payload: Any = None
            code = CLEARED
            if isinstance(d, Stored):
                blocks = d.blocks
                # map(attrgetter) reads a model field per block about a quarter faster than
                # a comprehension does
                levels = list(map(_CACHE_LEVEL, blocks))
                lv: int | list[int] = (
                    levels[0] if levels.count(levels[0]) == len(levels) else levels
                )
                payload = (
                    d.parent_hash,
                    list(map(_BLOCK_HASH, blocks)),
                    lv,
                    len(blocks[0].token_ids),
                    blocks,
                )
                code = STORED
            elif isinstance(d, Removed):
                payload = (list(d.block_hashes), d.cache_level)
                code = REMOVED
            elif isinstance(d, Updated):
                lvd, prd = d.cache_level, d.priority
                payload = (
                    d.block_hash,
                    None if lvd is None else (lvd.old_value, lvd.new_value),
                    None if prd is None else (prd.old_value, prd.new_value),
                )
                code = UPDATED
            elif isinstance(d, Created):
                payload = (d.num_blocks_per_cache_level, d.tokens_per_block, d.attention_kind.value)
                code = CREATED
            elif isinstance(d, Lost):
                payload = (d.first_event_id, d.count, d.reason)
                code = LOST
            kinds.append(code)
            payloads.append(payload)
        return out

    def __repr__(self) -> str:
        return (
            f"<ColumnBatch {self.instance_id}/{self.attention_dp_rank} "
            f"inc={self.incarnation} events={len(self.event_ids)}>"
        )


_ATTRS: Final = operator.attrgetter(
    "cache_level",
    "priority",
    "lora_id",
    "lora_name",
    "cache_salt",
    "token_extra_ids",
    "mm_keys",
    "extra_keys",
)
_DEFAULT_ROW: Final = _ATTRS(StoredBlock(block_hash=b"\x00" * 8, token_ids=()))
_DEFAULT_OTHERS: Final = _DEFAULT_ROW[1:]
_BLOCK_RAW: Final = operator.attrgetter("token_ids.raw")


def publish_columns(batch: EventBatch) -> ColumnBatch:
    """The columns of a validated model batch as a publisher encodes them: the payloads of
    :meth:`ColumnBatch.from_batch` without the model's blocks, every stored block's token ids
    in :attr:`~ColumnBatch.tokens` and :attr:`~ColumnBatch.stored_extra` filled. :meth:`to_batch`
    returns ``batch`` itself."""
    out = ColumnBatch.from_batch(batch)
    raws: list[bytes] = []
    extra: list[StoredExtra] = []
    payloads = out.payloads
    for i, (kind, payload) in enumerate(zip(out.kinds, payloads, strict=True)):
        if kind != STORED:
            continue
        blocks = payload[4]
        block_raws = list(map(_BLOCK_RAW, blocks))
        raws += block_raws
        rows = list(map(_ATTRS, blocks))
        attrs: StoredAttrs | None = None
        if any(row[1:] != _DEFAULT_OTHERS for row in rows):
            attrs = tuple(zip(*rows, strict=True))  # type: ignore[assignment]
        extra.append(([len(r) >> 2 for r in block_raws], attrs))
        payloads[i] = payload[:4]
    out.tokens = b"".join(raws)
    out.has_blocks = False
    out.stored_extra = extra
    return out


def _blocks(
    payload: tuple[Any, ...], extra: StoredExtra, tokens: bytes, pos: int
) -> tuple[tuple[StoredBlock, ...], int]:
    """The validated blocks of a stored payload, and the token position after them."""
    _, hashes, level, _ = payload[:4]
    sizes, attrs = extra
    n = len(hashes)
    if len(sizes) != n:
        raise ValueError(f"{len(sizes)} block sizes for {n} blocks")
    levels = level if isinstance(level, list) else [level] * n
    out = []
    for i, h in enumerate(hashes):
        end = pos + 4 * sizes[i]
        fields: dict[str, Any] = {
            "block_hash": h,
            "token_ids": TokenIds.from_bytes(tokens[pos:end]),
            "cache_level": levels[i],
        }
        pos = end
        if attrs is not None:
            (
                fields["cache_level"],
                fields["priority"],
                fields["lora_id"],
                fields["lora_name"],
                fields["cache_salt"],
                fields["token_extra_ids"],
                fields["mm_keys"],
                fields["extra_keys"],
            ) = (col[i] for col in attrs)
        out.append(StoredBlock(**fields))
    return tuple(out), pos


def model_of_columns(cols: ColumnBatch) -> EventBatch:
    """The validated model of publisher columns (:attr:`ColumnBatch.stored_extra` set): every
    value goes through the model's validation, so a value the model refuses raises its
    EventValidationError here."""
    extra = cols.stored_extra
    if extra is None:
        raise DecodeError("columns without stored_extra cannot build their stored blocks")
    tokens = cols.tokens
    pos = 0
    j = 0
    events = []
    for eid, kind, algo, gid, window, payload in zip(
        cols.event_ids,
        cols.kinds,
        cols.hash_algos,
        cols.group_ids,
        cols.window_sizes,
        cols.payloads,
        strict=True,
    ):
        data: Any
        if kind == STORED:
            blocks, pos = _blocks(payload, extra[j], tokens, pos)
            j += 1
            data = Stored(parent_hash=payload[0], blocks=blocks)
        elif kind == REMOVED:
            data = Removed(block_hashes=tuple(payload[0]), cache_level=payload[1])
        elif kind == UPDATED:
            lv, pr = payload[1], payload[2]
            data = Updated(
                block_hash=payload[0],
                cache_level=None if lv is None else EventDiff(old_value=lv[0], new_value=lv[1]),
                priority=None if pr is None else EventDiff(old_value=pr[0], new_value=pr[1]),
            )
        elif kind == CREATED:
            data = Created(
                num_blocks_per_cache_level=payload[0],
                tokens_per_block=payload[1],
                attention_kind=AttentionKind(payload[2]),
            )
        elif kind == LOST:
            data = Lost(first_event_id=payload[0], count=payload[1], reason=payload[2])
        elif kind == CLEARED:
            data = Cleared()
        else:
            raise DecodeError(f"unknown event kind code {kind!r}")
        events.append(
            KVCacheEvent(
                event_id=eid, hash_algo=algo, layer_group_id=gid, window_size=window, data=data
            )
        )
    if pos != len(tokens) or j != len(extra):
        raise DecodeError(
            f"columns hold {len(tokens) >> 2} token ids and {len(extra)} stored extras; "
            f"the stored events use {pos >> 2} and {j}"
        )
    return EventBatch(
        source=SourceId(
            instance_id=cols.instance_id,
            attention_dp_rank=cols.attention_dp_rank,
            incarnation=cols.incarnation,
        ),
        ts_ns=cols.ts_ns,
        schema_version=cols.schema_version,
        events=tuple(events),
    )

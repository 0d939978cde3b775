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

import importlib
import operator
import os
from collections.abc import Callable
from typing import Any, Final

from kvstream.errors import DecodeError
from kvstream.events.model import Created, EventBatch, Lost, Removed, Stored, Updated

__all__ = [
    "CLEARED",
    "CREATED",
    "KIND_NAMES",
    "LOST",
    "REMOVED",
    "STORED",
    "UPDATED",
    "ColumnBatch",
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


def _load_model_columns() -> Any:
    """The C loop of :meth:`ColumnBatch.from_batch`, or None (pure Python)."""
    if os.environ.get("KVSTREAM_NO_NATIVE", "") not in ("", "0"):
        return None
    try:
        # an extension module (no Python dependencies): it reads model attributes only
        mod: Any = importlib.import_module("kvstream.codec._columns_native")
    except ImportError:
        return None
    return getattr(mod, "model_columns", None)


#: ColumnBatch.from_batch's loop in C for batches of stored and removed events (None: Python)
_model_columns: Any = _load_model_columns()

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
    """

    __slots__ = (
        "_batch",
        "_build",
        "_planes",
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
        self.instance_id = instance_id
        self.attention_dp_rank = attention_dp_rank
        self.incarnation = incarnation
        self.ts_ns = ts_ns
        self.schema_version = schema_version
        self._tokens = tokens
        #: (unpack function, buffer, count, high_bits, low16 offset, planes offset) of valid
        #: bit planes not unpacked yet (``tokens`` is None then)
        self._planes = planes
        self.event_ids: list[int] = []
        self.kinds: list[int] = []
        self.hash_algos: list[str] = []
        self.group_ids: list[int] = []
        self.window_sizes: list[int] = []
        self.payloads: list[Any] = []
        #: True when stored payloads carry the model's blocks as a fifth item (from_batch)
        self.has_blocks = False
        #: builds the validated model (from the record or frame the columns came from)
        self._build = build
        self._batch = batch

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
        """The batch as the validated event model (built once, by the producer's ``build``;
        DecodeError if the producer's input does not make a valid model)."""
        if self._batch is None:
            if self._build is None:  # pragma: no cover - every constructor sets one
                raise DecodeError("a column batch without its source record or model")
            self._batch = self._build()
        return self._batch

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
        out.has_blocks = True
        if _model_columns is not None:
            cols = _model_columns(batch.events, Stored, Removed, STORED, REMOVED)
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

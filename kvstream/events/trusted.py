"""Building model objects from values a decoder has already checked, without re-validating.

Validation is what makes a :class:`~kvstream.events.model.StoredBlock` or a
:class:`~kvstream.events.model.KVCacheEvent` cost microseconds; decoders of other formats
(the engine bridges) check every value against the same rules on their own data first, then
build the objects with :func:`trusted`. The object is indistinguishable from a validated one
(same fields, equality, hashing, repr, ``model_fields_set``); the caller's contract is that
every value would have passed validation (types, ranges, hash widths matching ``hash_algo``).

The objects are filled as pydantic's own ``BaseModel.model_construct`` fills an instance
(``__dict__`` in field order and the three ``__pydantic_*`` attributes), without its per-field
loop, in Python only: no native code writes a model's fields (issue 22). Hot paths do not
build models at all: engine frames and the cache manager's batches travel as columns
(:class:`~kvstream.events.columns.ColumnBatch`) to the sinks and indexes that take them, and
models are built here only where a caller asks for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Protocol, TypeVar

from kvstream._types import PRIORITY_DEFAULT as _PRIORITY_DEFAULT
from kvstream._types import TokenIds
from kvstream.events.model import EventBatch, KVCacheEvent, Removed, Stored, StoredBlock

__all__ = [
    "token_blocks",
    "trusted",
    "trusted_builder",
    "trusted_stored_block",
    "trusted_stored_blocks",
]

_M = TypeVar("_M", KVCacheEvent, Stored, StoredBlock, Removed, EventBatch)


def _template(cls: type[Any]) -> dict[str, Any]:
    # every field in declaration order (pydantic's __dict__ order); required ones as None
    return {
        name: None if info.is_required() else info.default
        for name, info in cls.model_fields.items()
    }


_TEMPLATES: Final[dict[type[Any], dict[str, Any]]] = {
    cls: _template(cls) for cls in (KVCacheEvent, Stored, StoredBlock, Removed, EventBatch)
}
_new = object.__new__
_set = object.__setattr__


def _py_trusted(cls: type[_M], values: dict[str, Any]) -> _M:
    obj = _new(cls)
    fields = _TEMPLATES[cls].copy()
    fields.update(values)  # keeps the template's order
    _set(obj, "__dict__", fields)
    _set(obj, "__pydantic_fields_set__", set(values))
    _set(obj, "__pydantic_extra__", None)
    _set(obj, "__pydantic_private__", None)
    return obj


def trusted(cls: type[_M], values: dict[str, Any]) -> _M:
    """An instance of ``cls`` (StoredBlock, Stored, Removed, KVCacheEvent or EventBatch)
    holding ``values`` (field name -> already valid value; omitted fields take their
    defaults; the given ones are its ``model_fields_set``)."""
    return _py_trusted(cls, values)


def trusted_builder(cls: type[_M]) -> Callable[[dict[str, Any]], _M]:
    """``trusted`` bound to ``cls``: ``trusted_builder(cls)(values) == trusted(cls, values)``,
    without the per-call dispatch (the per-event hot path of the engine bridges)."""
    if cls not in _TEMPLATES:
        raise TypeError(f"trusted() builds {', '.join(c.__name__ for c in _TEMPLATES)} only")
    return lambda values: _py_trusted(cls, values)


_BLOCK_ORDER: Final = tuple(StoredBlock.model_fields)
assert _BLOCK_ORDER == (
    "block_hash",
    "token_ids",
    "token_extra_ids",
    "lora_id",
    "lora_name",
    "cache_level",
    "priority",
    "mm_keys",
    "cache_salt",
    "extra_keys",
), "trusted_stored_block builds StoredBlock's fields in declaration order"
_BASE_SET: Final = frozenset(("block_hash", "token_ids"))


def trusted_stored_block(
    block_hash: bytes,
    token_ids: Any,
    *,
    lora_id: int | None = None,
    lora_name: str | None = None,
    cache_level: int = 0,
    cache_salt: str | None = None,
    extra_keys: tuple[Any, ...] | None = None,
    fields_set: frozenset[str] = _BASE_SET,
) -> StoredBlock:
    """The per-block hot path of :func:`trusted` for the fields engines publish (priority,
    multimodal keys and extra token ids at their defaults). ``token_ids`` is a
    :class:`~kvstream._types.TokenIds`; ``fields_set`` names the fields given explicitly."""
    obj = _new(StoredBlock)
    _set(
        obj,
        "__dict__",
        {
            "block_hash": block_hash,
            "token_ids": token_ids,
            "token_extra_ids": None,
            "lora_id": lora_id,
            "lora_name": lora_name,
            "cache_level": cache_level,
            "priority": _PRIORITY_DEFAULT,
            "mm_keys": (),
            "cache_salt": cache_salt,
            "extra_keys": extra_keys,
        },
    )
    _set(obj, "__pydantic_fields_set__", set(fields_set))
    _set(obj, "__pydantic_extra__", None)
    _set(obj, "__pydantic_private__", None)
    return obj


def _py_stored_blocks(
    block_hashes: tuple[bytes, ...],
    token_ids: tuple[TokenIds, ...],
    *,
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None,
    lora_id: int | None = None,
    lora_name: str | None = None,
    cache_level: int = 0,
    cache_salt: str | None = None,
    fields_set: frozenset[str] = _BASE_SET,
) -> tuple[StoredBlock, ...]:
    n = len(block_hashes)
    if len(token_ids) != n or (extra_keys is not None and len(extra_keys) != n):
        raise ValueError("block_hashes, token_ids and extra_keys need one entry per block")
    template: dict[str, Any] = {
        "block_hash": None,
        "token_ids": None,
        "token_extra_ids": None,
        "lora_id": lora_id,
        "lora_name": lora_name,
        "cache_level": cache_level,
        "priority": _PRIORITY_DEFAULT,
        "mm_keys": (),
        "cache_salt": cache_salt,
        "extra_keys": None,
    }
    with_extra = fields_set | {"extra_keys"}
    out = []
    for i in range(n):
        keys = None if extra_keys is None else extra_keys[i]
        fields = template.copy()
        fields["block_hash"] = block_hashes[i]
        fields["token_ids"] = token_ids[i]
        if keys is not None:
            fields["extra_keys"] = keys
        obj = _new(StoredBlock)
        _set(obj, "__dict__", fields)
        _set(obj, "__pydantic_fields_set__", set(fields_set if keys is None else with_extra))
        _set(obj, "__pydantic_extra__", None)
        _set(obj, "__pydantic_private__", None)
        out.append(obj)
    return tuple(out)


class _StoredBlocks(Protocol):
    def __call__(
        self,
        block_hashes: tuple[bytes, ...],
        token_ids: tuple[TokenIds, ...],
        *,
        extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_level: int = 0,
        cache_salt: str | None = None,
        fields_set: frozenset[str] = _BASE_SET,
    ) -> tuple[StoredBlock, ...]: ...


#: ``trusted_stored_blocks(block_hashes, token_ids, *, extra_keys=None, lora_id=None,
#: lora_name=None, cache_level=0, cache_salt=None, fields_set=frozenset({"block_hash",
#: "token_ids"}))``: the blocks of one stored event. Block i holds ``block_hashes[i]``,
#: ``token_ids[i]`` and, when ``extra_keys`` is given, ``extra_keys[i]``; the other values are
#: shared. ``fields_set`` names the fields given explicitly; a block whose extra keys are not
#: None has ``extra_keys`` in its fields set too. Equal to :func:`trusted_stored_block` per
#: block. Raises ValueError when the lengths differ.
trusted_stored_blocks: Final[_StoredBlocks] = _py_stored_blocks


def _py_token_blocks(raw: bytes, step: int) -> tuple[TokenIds, ...]:
    if step <= 0 or step % 4 or len(raw) % 4:
        raise ValueError(
            "step must be a positive multiple of 4 and raw a multiple of 4 bytes, "
            f"got {step} and {len(raw)}"
        )
    wrap = TokenIds.from_bytes
    if len(raw) <= step:
        return (wrap(raw),) if raw else ()
    return tuple(wrap(raw[i : i + step]) for i in range(0, len(raw), step))


#: ``token_blocks(raw, step)``: ``raw`` (bytes: little-endian uint32 token ids) cut into
#: consecutive ``step``-byte blocks, the last one possibly shorter, each a
#: :class:`~kvstream._types.TokenIds`; ``()`` for empty ``raw``. Raises ValueError unless
#: ``step`` is a positive multiple of 4 and ``len(raw)`` a multiple of 4.
token_blocks: Final[Callable[[bytes, int], tuple[TokenIds, ...]]] = _py_token_blocks

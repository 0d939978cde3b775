"""Building model objects from values a decoder has already checked, without re-validating.

Validation is what makes a :class:`~kvstream.events.model.StoredBlock` or a
:class:`~kvstream.events.model.KVCacheEvent` cost microseconds; decoders of other formats
(the engine bridges) check every value against the same rules on their own data first, then
build the objects with :func:`trusted`. The object is indistinguishable from a validated one
(same fields, equality, hashing, repr, ``model_fields_set``); the caller's contract is that
every value would have passed validation (types, ranges, hash widths matching ``hash_algo``).
"""

from __future__ import annotations

from typing import Any, Final, TypeVar

from kvstream._types import PRIORITY_DEFAULT as _PRIORITY_DEFAULT
from kvstream.events.model import KVCacheEvent, Removed, Stored, StoredBlock

__all__ = ["trusted", "trusted_stored_block"]

_M = TypeVar("_M", KVCacheEvent, Stored, StoredBlock, Removed)


def _template(cls: type[Any]) -> dict[str, Any]:
    # every field in declaration order (pydantic's __dict__ order); required ones as None
    return {
        name: None if info.is_required() else info.default
        for name, info in cls.model_fields.items()
    }


_TEMPLATES: Final[dict[type[Any], dict[str, Any]]] = {
    cls: _template(cls) for cls in (KVCacheEvent, Stored, StoredBlock, Removed)
}
_new = object.__new__
_set = object.__setattr__


def trusted(cls: type[_M], values: dict[str, Any]) -> _M:
    """An instance of ``cls`` (StoredBlock, Stored, Removed or KVCacheEvent) holding
    ``values`` (field name -> already valid value; omitted fields take their defaults)."""
    obj = _new(cls)
    fields = _TEMPLATES[cls].copy()
    fields.update(values)  # keeps the template's order
    _set(obj, "__dict__", fields)
    _set(obj, "__pydantic_fields_set__", set(values))
    _set(obj, "__pydantic_extra__", None)
    _set(obj, "__pydantic_private__", None)
    return obj


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

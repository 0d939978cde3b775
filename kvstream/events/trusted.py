"""Building model objects from values a decoder has already checked, without re-validating.

Validation is what makes :class:`~kvstream.events.model.StoredBlock` cost microseconds per
block; decoders of other formats (the engine bridges) check every value against the same
rules on their own columns first, then build blocks with :func:`trusted_stored_block`. The
object is indistinguishable from a validated one (same fields, equality, hashing, repr); the
caller's contract is that every value would have passed validation.
"""

from __future__ import annotations

from typing import Any, Final

from kvstream.events.model import StoredBlock

__all__ = ["trusted_stored_block"]

# Every field in declaration order (pydantic's __dict__ order), required ones as placeholders.
_BLOCK_TEMPLATE: Final = {
    name: None if info.is_required() else info.default
    for name, info in StoredBlock.model_fields.items()
}
_new = object.__new__
_set = object.__setattr__


def trusted_stored_block(values: dict[str, Any]) -> StoredBlock:
    """A :class:`StoredBlock` from ``values`` (field name -> value, already valid; at least
    ``block_hash`` and ``token_ids`` as :class:`~kvstream._types.TokenIds`)."""
    block = _new(StoredBlock)
    fields = _BLOCK_TEMPLATE.copy()
    fields.update(values)  # keeps the template's order
    _set(block, "__dict__", fields)
    _set(block, "__pydantic_fields_set__", set(values))
    _set(block, "__pydantic_extra__", None)
    _set(block, "__pydantic_private__", None)
    return block

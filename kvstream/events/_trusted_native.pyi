"""Type stub of the optional C extension ``kvstream.events._trusted_native``
(``_trusted_native.c``).

Unvalidated construction of model objects; :mod:`kvstream.events.trusted` holds the
pure-Python reference and documents the contract (every value already valid).
"""

from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

_T = TypeVar("_T")

class ModelFactory(Generic[_T]):
    """Instances of the pydantic model ``cls``; ``template`` maps every field, in declaration
    order, to its default (None for required fields)."""

    cls: type[_T]
    template: dict[str, Any]
    def __init__(self, cls: type[_T], template: dict[str, Any]) -> None: ...
    def new(self, fields: dict[str, Any], fields_set: Any) -> _T:
        """An instance whose ``__dict__`` is ``fields`` itself and whose fields set is
        ``set(fields_set)``."""
    def build(self, values: dict[str, Any]) -> _T:
        """``__dict__`` = the template updated with ``values``; fields set = ``set(values)``."""
    def blocks(
        self,
        block_hashes: tuple[bytes, ...],
        token_ids: tuple[Any, ...],
        *,
        extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_level: int = 0,
        cache_salt: str | None = None,
        fields_set: frozenset[str] = ...,
    ) -> tuple[_T, ...]:
        """StoredBlock's factory only: the blocks of one stored event (see
        ``trusted.trusted_stored_blocks``)."""

class TokenFactory(Generic[_T]):
    """Instances of a ``__slots__ = ("_raw",)`` class (TokenIds) from packed bytes."""

    cls: type[_T]
    def __init__(self, cls: type[_T]) -> None: ...
    def split(self, raw: bytes, step: int) -> tuple[_T, ...]:
        """One instance per consecutive ``step``-byte slice of ``raw`` (the last may be
        shorter)."""

class EmittedEvents:
    """The events of an EventEmitter's buffered records (``emitter.emitted_batch``'s loop)."""

    def __init__(
        self,
        event: ModelFactory[Any],
        stored: ModelFactory[Any],
        removed: ModelFactory[Any],
        block: ModelFactory[Any],
        tokens: TokenFactory[Any],
        run_type: type[Any],
        view_type: type[Any],
        fallback: Callable[[dict[str, Any]], Any],
    ) -> None: ...
    def events(self, records: Iterable[dict[str, Any]]) -> tuple[Any, ...]:
        """Stored records of attribute-free block runs (a packed chain's blocks as
        ``view_type`` views of its bytes) and non-empty removed records built with the
        factories; any other record as ``fallback(record)`` returns it."""

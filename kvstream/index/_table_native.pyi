"""Type stub of the optional C extension ``kvstream.index._table_native``
(``_table_native.c``): the tables' integer ``Column`` and the domains' ``MaskMap`` types, the
loops of :meth:`kvstream.index.table.GroupTable.store_hashes` that
links blocks a table does not hold yet and of :meth:`~kvstream.index.table.GroupTable.remove`
for leaf blocks holding one GPU reference, the depth search over a domain's mask map, and the
fast ``WorkerMatch`` constructor; ``table.py``, ``domain.py`` and the dataclass are the
pure-Python references."""

from collections.abc import Iterable, Iterator
from typing import Any

class Column:
    """A vector of 64-bit ints (``unsigned``: 0 .. 2**64-1) with the list operations a
    ``GroupTable`` uses on its integer columns; not tracked by the cyclic GC."""

    def __init__(self, values: Iterable[int] = (), *, unsigned: bool = False) -> None: ...
    def __len__(self) -> int: ...
    def __getitem__(self, i: int, /) -> int: ...
    def __setitem__(self, i: int, v: int, /) -> None: ...
    def __iter__(self) -> Iterator[int]: ...
    def append(self, v: int, /) -> None: ...
    def extend(self, vs: Iterable[int], /) -> None: ...
    def pop(self) -> int: ...
    def tolist(self) -> list[int]: ...

class MaskMap:
    """``kvstream.index.domain.MaskMap``'s contract in one open-addressing table (bytes
    keys, the worker bits inline in the key's slot); not tracked by the cyclic GC."""

    @property
    def width(self) -> int: ...
    def reserve(self, slot: int, /) -> None: ...
    def add(self, key: bytes, slot: int, /) -> None: ...
    def discard(self, key: bytes, slot: int, /) -> None: ...
    def get(self, key: bytes, default: int = 0, /) -> int: ...
    def as_dict(self) -> dict[bytes, int]: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object, /) -> bool: ...

def untrack_atoms(values: list[bytes]) -> list[bytes]:
    """``values``, untracked by the cyclic GC when it holds only bytes and ints."""

def _column_of(values: Iterable[int], kwargs: dict[str, Any]) -> Column:
    """``Column(values, **kwargs)`` (what a ``Column`` pickles to)."""

def store_run(
    table: Any, hashes: list[bytes], start: int, p: int, ok: int, inc: int
) -> tuple[int, int, int]:
    """Link ``hashes[start:]`` under node ``p`` until a block the table holds:
    ``(stop index, last node, nodes added)``."""

def store_chain(
    table: Any, parent_hash: bytes | None, hashes: list[bytes], inc: int
) -> tuple[int, int, int] | None:
    """``store_run`` from ``hashes[0]`` under the root or a held parent; None (nothing
    changed) when the parent is unknown or a ghost."""

def remove_run(table: Any, hashes: list[bytes], start: int) -> tuple[int, int]:
    """Remove ``hashes[start:]`` while each is a childless block holding one GPU reference:
    ``(stop index, blocks removed)``."""

def prefix_depths(masks: Any, hashes: list[bytes], allowed: bytes | None) -> list[tuple[int, int]]:
    """``kvstream.index.domain.prefix_depths`` over a ``MaskMap`` (``allowed``: None, or
    ``masks.width`` bytes of allowed worker bits)."""

def slot_depths(masks: Any, hashes: list[bytes], allowed: bytes | None) -> list[tuple[int, int]]:
    """The same search per worker slot: ``(slot, deepest depth)`` in slot order."""

def slots_new(cls: type, *values: Any) -> Any:
    """An instance of the slotted class ``cls`` with its ``__slots__`` set to ``values`` (a
    fast constructor for frozen slotted dataclasses; see the C source)."""

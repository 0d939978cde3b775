"""Type stub of the optional C extension ``kvstream.index._table_native``
(``_table_native.c``): the loops of :meth:`kvstream.index.table.GroupTable.store_hashes` that
links blocks a table does not hold yet and of :meth:`~kvstream.index.table.GroupTable.remove`
for leaf blocks holding one GPU reference; ``table.py`` is the pure-Python reference."""

from typing import Any

def store_run(
    table: Any, hashes: list[bytes], start: int, p: int, ok: int, inc: int
) -> tuple[int, int, int]:
    """Link ``hashes[start:]`` under node ``p`` until a block the table holds:
    ``(stop index, last node, nodes added)``."""

def remove_run(table: Any, hashes: list[bytes], start: int) -> tuple[int, int]:
    """Remove ``hashes[start:]`` while each is a childless block holding one GPU reference:
    ``(stop index, blocks removed)``."""

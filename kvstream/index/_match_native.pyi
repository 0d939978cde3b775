"""Type stub of the optional C extension ``kvstream.index._match_native``
(``_match_native.c``): the index's result records (``Record``, ``Field``; ``record.py``'s
``_PyRecord`` is the reference) and the per-worker loops of ``PrefixIndex.match`` and
``Router.route``."""

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

class Record:
    """An immutable record whose values this type owns; a subclass names its fields in
    ``__record_fields__`` and the defaults of the last ones in ``__record_defaults__``."""

    __record_fields__: ClassVar[tuple[str, ...]]
    __record_defaults__: ClassVar[tuple[Any, ...]]
    def __new__(cls, *args: Any, **kwargs: Any) -> Any: ...
    def __reduce__(self) -> tuple[Any, ...]: ...

class Field:
    """The read-only accessor of field ``index`` of a record (assigning raises
    ``dataclasses.FrozenInstanceError``)."""

    @property
    def name(self) -> str: ...
    @property
    def index(self) -> int: ...
    def __init__(self, index: int, name: str) -> None: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Any: ...
    def __set__(self, obj: Any, value: Any) -> None: ...

def fill(
    out: list[Any],
    found: list[tuple[int, int]],
    rows: dict[int, tuple[Any, ...]],
    new: Callable[..., Any],
    n: int,
    tpb: int,
    algo: str,
    w0: float,
) -> list[tuple[int, int]]: ...
def zeros(
    out: list[Any],
    rows: dict[int, tuple[Any, ...]],
    new: Callable[..., Any],
    n_of: dict[Any, int],
) -> None: ...
def score(
    matches: Sequence[Any],
    pending: Sequence[Any],
    blocks: Sequence[Any],
    requests: Sequence[Any],
    base: Sequence[Any],
    n_tokens: int,
    factor: float,
    default_tpb: int,
    new: Callable[..., Any],
) -> tuple[list[Any], list[float]]: ...

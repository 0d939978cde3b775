from collections.abc import Callable
from typing import Any

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

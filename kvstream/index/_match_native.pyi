from collections.abc import Callable, Sequence
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

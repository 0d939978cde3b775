"""Fixtures of the service tests: vLLM-format engine ranks on real ZMQ sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from serve_support import Engine


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    """``engines(bs=4, dp_rank=0, replay=True)`` starts an :class:`Engine`; all are closed
    after the test."""
    made: list[Engine] = []

    def make(bs: int = 4, **kw: Any) -> Engine:
        e = Engine(bs, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()

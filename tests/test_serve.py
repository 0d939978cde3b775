"""``kvstream serve``: Dynamo's standalone-indexer API over real ZMQ publishers.

Each test runs the service in-process on a loopback port and talks to it over HTTP with
:class:`kvstream.serve.Client` (from a thread: the service shares the test's event loop).
The engines are vLLM-format publishers on real sockets (``serve_support.Engine``); the
expected answers are computed from what each engine holds, by Dynamo's rules (the peer test
checks the same answers against Dynamo's own service).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from serve_support import Engine, eventually, expected_answer, local_path, signed

from kvstream.serve import (
    BadRequestError,
    Client,
    ConflictError,
    IndexService,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    ServeConfig,
    UnauthorizedError,
)

BS = 4
_T = TypeVar("_T")


async def run(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """A blocking client call, off the loop the service runs on."""
    return await asyncio.to_thread(fn, *args, **kwargs)


@pytest.fixture
async def service() -> AsyncIterator[IndexService]:
    async with IndexService(ServeConfig(port=0, block_size=BS)) as svc:
        yield svc


@pytest.fixture
def engines() -> Any:
    made: list[Engine] = []

    def make(**kw: Any) -> Engine:
        e = Engine(BS, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    systems = [[rng.randrange(50_000) for _ in range(BS * 5)] for _ in range(3)]
    return [
        rng.choice(systems) + [rng.randrange(50_000) for _ in range(BS * rng.randrange(1, 6))]
        for _ in range(n)
    ]


async def test_queries_answer_as_dynamo_does(service: IndexService, engines: Any) -> None:
    rng = random.Random(5)
    fleet = {(1, 0): engines(dp_rank=0), (1, 1): engines(dp_rank=1), (2, 0): engines()}
    c = Client(service.url)
    for (inst, rank), e in fleet.items():
        await run(
            c.register, inst, e.endpoint, model_name="m", block_size=BS, dp_rank=rank,
            replay_endpoint=e.replay_endpoint,
        )
    served = prompts(rng, 40)
    for p in served:
        rng.choice(list(fleet.values())).store(p, level=rng.choice([0, 0, 0, 1, 2]))
    for e in fleet.values():
        e.evict_leaves(3)
    probes = served[-15:] + [p[: BS * 3] + [7] for p in served[:5]] + [[1, 2, 3]]

    def settled() -> bool:
        return all(c.query(p, model_name="m") == expected_answer(fleet, p, BS) for p in probes)

    await eventually(settled)
    for p in probes[:10]:
        by_hash = await run(
            c.query_by_hash, [signed(h) for h in local_path(p, BS)], model_name="m"
        )
        assert by_hash == expected_answer(fleet, p, BS)
    assert (await run(c.query, [], model_name="m")) == {
        "scores": {},
        "frequencies": [],
        "instances": {},
    }
    c.close()

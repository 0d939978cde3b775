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
from serve_support import eventually, expected_answer, local_path, signed

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
            c.register,
            inst,
            e.endpoint,
            model_name="m",
            block_size=BS,
            dp_rank=rank,
            replay_endpoint=e.replay_endpoint,
        )
    served = prompts(rng, 40)
    for p in served:
        rng.choice(list(fleet.values())).store(p, level=rng.choice([0, 0, 0, 1, 2]))
    for e in fleet.values():
        e.evict_leaves(3)
    probes = [*served[-15:], *([*p[: BS * 3], 7] for p in served[:5]), [1, 2, 3]]

    def settled() -> bool:
        return all(c.query(p, model_name="m") == expected_answer(fleet, p, BS) for p in probes)

    await eventually(settled)
    for p in probes[:10]:
        by_hash = await run(c.query_by_hash, [signed(h) for h in local_path(p, BS)], model_name="m")
        assert by_hash == expected_answer(fleet, p, BS)
    assert (await run(c.query, [], model_name="m")) == {
        "scores": {},
        "frequencies": [],
        "instances": {},
    }
    c.close()


async def test_registration_workers_and_unregister(service: IndexService, engines: Any) -> None:
    a0, a1 = engines(dp_rank=0), engines(dp_rank=1)
    c = Client(service.url)
    await run(c.register, 7, a0.endpoint, model_name="m", block_size=BS)
    await run(c.register, 7, a1.endpoint, model_name="m", block_size=BS, dp_rank=1)
    with pytest.raises(ConflictError, match="already registered"):
        await run(c.register, 7, a0.endpoint, model_name="m", block_size=BS)
    with pytest.raises(ConflictError, match="block_size mismatch"):
        await run(c.register, 8, a0.endpoint, model_name="m", block_size=BS * 2)
    prompt = list(range(1, 1 + BS * 3))
    a0.store(prompt)
    a1.store(prompt[: BS * 2])
    fleet = {(7, 0): a0, (7, 1): a1}
    await eventually(lambda: c.query(prompt, model_name="m") == expected_answer(fleet, prompt, BS))
    (w,) = await run(c.workers)
    assert w["instance_id"] == 7
    assert w["source"] == "zmq"
    assert w["model_name"] == "m"
    assert w["routing_group"] == "default"
    assert w["block_size"] == BS
    assert w["endpoints"] == {"0": a0.endpoint, "1": a1.endpoint}
    assert {r["status"] for r in w["listeners"].values()} == {"active"}
    # one rank goes: its blocks with it; then the instance: the model's index with it
    await run(c.unregister, 7, model_name="m", dp_rank=1)
    assert await run(c.query, prompt, model_name="m") == expected_answer({(7, 0): a0}, prompt, BS)
    await run(c.unregister, 7, model_name="m")
    with pytest.raises(NotFoundError, match="no indexer for model=m routing_group=default"):
        await run(c.query, prompt, model_name="m")
    with pytest.raises(NotFoundError, match="instance 7 not found"):
        await run(c.unregister, 7, model_name="m")
    c.close()


async def test_dump_lists_every_cached_block_per_tier(service: IndexService, engines: Any) -> None:
    e = engines()
    c = Client(service.url)
    await run(c.register, 3, e.endpoint, block_size=BS, replay_endpoint=e.replay_endpoint)
    prompt = list(range(100, 100 + BS * 3))
    e.store(prompt[: BS * 2])
    e.store(prompt, level=1)
    await eventually(lambda: c.query(prompt)["instances"])
    dump = await run(c.dump)
    entry = dump["default:default"]
    assert entry["block_size"] == BS
    blocks = {
        (
            ev["storage_tier"],
            b["block_hash"],
            b["tokens_hash"],
            ev["event"]["data"]["stored"]["parent_hash"],
        )
        for ev in entry["events"]
        for b in ev["event"]["data"]["stored"]["blocks"]
    }
    locs = local_path(prompt, BS)
    engine_hashes = [int.from_bytes(h, "big") for h in e.blocks]
    assert {(t, h) for t, h, _, _ in blocks} == {
        ("device", engine_hashes[0]),
        ("device", engine_hashes[1]),
        ("host_pinned", engine_hashes[2]),
    }
    assert {lh for _, _, lh, _ in blocks} == set(locs)
    assert all(ev["worker_id"] == 3 and ev["event"]["dp_rank"] == 0 for ev in entry["events"])
    c.close()


async def test_dynamo_documentation_examples_work_unchanged(engines: Any) -> None:
    """The curl examples of Dynamo's standalone-indexer page: no model_name, no block_size
    (the service's --block-size), register/unregister per rank, query by tokens and hashes."""
    e0, e1 = engines(), engines(dp_rank=1)
    async with IndexService(ServeConfig(port=0, block_size=16)) as svc:
        c = Client(svc.url)
        calls = [
            ("POST", "/register", {"instance_id": 1, "endpoint": e0.endpoint}),
            ("POST", "/register", {"instance_id": 1, "endpoint": e1.endpoint, "dp_rank": 1}),
            ("GET", "/workers", None),
            ("POST", "/query", {"token_ids": list(range(1, 17))}),
            ("POST", "/query_by_hash", {"block_hashes": [123456, 789012]}),
            ("GET", "/dump", None),
            ("POST", "/unregister", {"instance_id": 1, "dp_rank": 0}),
            ("POST", "/unregister", {"instance_id": 1}),
        ]
        answers = [await run(c.call, *call) for call in calls]
        assert answers[0] == answers[1] == {"status": "ok"}
        assert answers[2][0]["endpoints"] == {"0": e0.endpoint, "1": e1.endpoint}
        assert answers[3] == answers[4] == {"scores": {}, "frequencies": [], "instances": {}}
        assert answers[6] == answers[7] == {"status": "ok"}
        assert await run(c.health)
        c.close()


async def test_bad_requests_get_clear_errors(engines: Any, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cfg = ServeConfig(
        port=0, block_size=BS, auth_token_file=token, max_body_bytes=4096, max_tokens=100
    )
    async with IndexService(cfg) as svc:
        anon = Client(svc.url)
        assert await run(anon.health)  # /health needs no token
        with pytest.raises(UnauthorizedError):
            await run(anon.workers)
        with Client(svc.url, token="wrong") as wrong, pytest.raises(UnauthorizedError):
            await run(wrong.workers)
        c = Client(svc.url, token="s3cret")
        e = engines()
        await run(c.register, 1, e.endpoint)
        status, body = await run(c.request_raw, "POST", "/query", b"{not json")
        assert status == 400
        assert json.loads(body)["type"] == "BadRequestError"
        for bad, what in [
            ({"token_ids": "x"}, "Expected `array`"),
            ({"token_ids": [-1]}, "Expected `int` >= 0"),
            ({"token_ids": [2**32]}, "<= 4294967295"),
            ({"model_name": "default"}, "missing required field `token_ids`"),
        ]:
            with pytest.raises(InvalidRequestError, match=what):
                await run(c.call, "POST", "/query", bad)
        with pytest.raises(InvalidRequestError, match="expected i64"):
            await run(c.query_by_hash, [2**63 + 1])
        with pytest.raises(PayloadTooLargeError, match="over the limit of 100"):
            await run(c.query, list(range(101)))
        with pytest.raises(PayloadTooLargeError, match="4096 bytes"):
            await run(c.query, [1] * 3000)
        with pytest.raises(NotFoundError, match="no indexer for model=nope"):
            await run(c.query, [1, 2], model_name="nope")
        with pytest.raises(NotFoundError, match="no route"):
            await run(c.call, "GET", "/nope")
        with pytest.raises(MethodNotAllowedError):
            await run(c.call, "GET", "/query")
        with pytest.raises(InvalidRequestError, match="tcp://HOST:PORT"):
            await run(c.register, 2, "http://127.0.0.1:1")
        with pytest.raises(InvalidRequestError, match=r"did you mean"):
            await run(c.query, [1, 2, 3, 4], hash_algo="vllm_sha256_cbor64")
        with pytest.raises(ConflictError, match="publishes"):
            await run(c.query, [1, 2, 3, 4], hash_algo="v2_sha256")
        with pytest.raises(BadRequestError):
            await run(c.call, "POST", "/register_peer", None)
        c.close()
        anon.close()


async def test_tls_and_a_bearer_token(engines: Any, tmp_path: Path) -> None:
    from tls_broker import make_pki

    from kvstream.serve import UnavailableError

    pki = make_pki(tmp_path / "pki")
    token = tmp_path / "token"
    token.write_text("t0k3n")
    cfg = ServeConfig(
        port=0,
        block_size=BS,
        tls_cert=pki.server_cert,
        tls_key=pki.server_key,
        auth_token_file=token,
    )
    e = engines()
    async with IndexService(cfg) as svc:
        assert svc.url.startswith("https://127.0.0.1:")
        with Client(svc.url, token="t0k3n", ca_file=str(pki.ca)) as c:
            await run(c.register, 1, e.endpoint, replay_endpoint=e.replay_endpoint)
            prompt = list(range(1, 1 + BS * 2))
            e.store(prompt)
            await eventually(lambda: c.query(prompt) == expected_answer({(1, 0): e}, prompt, BS))
        untrusted = Client(svc.url, token="t0k3n", ca_file=str(pki.other_ca))
        with untrusted, pytest.raises(UnavailableError, match="CERTIFICATE_VERIFY_FAILED"):
            await run(untrusted.workers)
        anonymous = Client(svc.url, ca_file=str(pki.ca))
        with anonymous, pytest.raises(UnauthorizedError):
            await run(anonymous.workers)


async def test_route_picks_the_worker_holding_the_prefix(
    service: IndexService, engines: Any
) -> None:
    a, b = engines(), engines()
    with Client(service.url) as c:
        await run(c.register, 1, a.endpoint, replay_endpoint=a.replay_endpoint)
        await run(c.register, 2, b.endpoint, replay_endpoint=b.replay_endpoint)
        long_prompt = list(range(1, 1 + BS * 8))
        a.store(long_prompt[: BS * 2])
        b.store(long_prompt)
        await eventually(lambda: c.query(long_prompt)["scores"].get("2"))
        decision = await run(c.route, long_prompt)
        assert (decision["instance_id"], decision["dp_rank"]) == ("2", 0)
        assert decision["policy"] == "kv"
        by_worker = {s["worker"]: s for s in decision["scores"]}
        assert by_worker["2/0"]["matched_blocks"] == 8
        assert by_worker["1/0"]["matched_blocks"] == 2
        assert by_worker["2/0"]["cost"] < by_worker["1/0"]["cost"]

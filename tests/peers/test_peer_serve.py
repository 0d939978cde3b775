"""Peer test of ``kvstream serve`` (issue 21): NVIDIA Dynamo's standalone indexer (ai-dynamo
1.6.1, ``python -m dynamo.indexer``) and kvstream's service follow the same real vLLM 0.33
publishers (``vllm_fleet.VllmRank``: vLLM's cache manager and ``ZmqEventPublisher``, two
instances x two DP ranks, LRU evictions), registered through the same ``/register`` calls.
At every checkpoint both hold the same blocks (``/dump``, flattened), and every probe gets the
same ``/query`` answer, byte for byte once parsed: scores, ranks, per-tier ``instances``;
``/query_by_hash`` with Dynamo's own local hashes (``compute_block_hash_for_seq``, as signed
i64) too. Errors get the same status codes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dynamo_indexer import Dynamo, flatten
from engine_publisher import free_ports
from vllm_fleet import VllmRank, Workload

from kvstream.serve import Client, IndexService, ServeConfig, ServiceError

pytestmark = pytest.mark.peers

BS = 16
MODEL = "m"
INSTANCES = (11, 2**40 + 3)  # an id above 2**32 too
RANKS = (0, 1)


def _ports(n: int) -> list[int]:
    import socket

    out = []
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        out.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return out


@pytest.fixture
def fleet(vllm_kv: Any) -> Iterator[dict[tuple[int, int], VllmRank]]:
    ranks: dict[tuple[int, int], VllmRank] = {}
    for inst in INSTANCES:
        pub, rep = free_ports(len(RANKS)), free_ports(len(RANKS))  # vLLM binds port + rank
        for r in RANKS:
            ranks[(inst, r)] = VllmRank(
                vllm_kv, pub[r], rep[r], dp_rank=r, block_size=BS, num_blocks=160
            )
    yield ranks
    for rank in ranks.values():
        rank.close()


async def test_kvstream_serve_answers_exactly_as_dynamos_indexer(
    fleet: dict[tuple[int, int], VllmRank], tmp_path: Path
) -> None:
    from dynamo.llm import compute_block_hash_for_seq

    (dyn_port,) = _ports(1)
    dynamo = Dynamo(dyn_port, tmp_path / "dynamo.log", BS)
    svc = IndexService(ServeConfig(port=0, block_size=BS))
    await svc.start()
    ours = Client(svc.url)
    try:
        for (inst, r), rank in fleet.items():
            body = {
                "instance_id": inst,
                "endpoint": rank.endpoint,
                "replay_endpoint": rank.replay_endpoint,
                "model_name": MODEL,
                "block_size": BS,
                "dp_rank": r,
            }
            assert dynamo.call("/register", body)[0] == 201
            await asyncio.to_thread(ours.call, "POST", "/register", body)
        await asyncio.sleep(0.5)  # SUB sockets connect before the engines publish
        work = Workload(seed=3)
        engines = list(fleet.values())
        compared = 0
        for checkpoint in range(4):
            for _ in range(120):
                prompt, output = work.next_request()
                work.rng.choice(engines).serve(prompt, output)
            # both caught up: the same blocks
            deadline = time.monotonic() + 30
            while True:
                d = flatten(dynamo.call("/dump")[1])
                k = flatten(await asyncio.to_thread(ours.dump))
                if d == k or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            assert d == k, (
                f"checkpoint {checkpoint}: dynamo-only {len(d - k)}, ours-only {len(k - d)}"
            )
            assert d, "nothing indexed"
            for probe in work.probes(80):
                body = {"token_ids": probe, "model_name": MODEL}
                status, want = dynamo.call("/query", body)
                assert status == 200, want
                got = await asyncio.to_thread(ours.query, probe, model_name=MODEL)
                assert got == want, (len(probe), want, got)
                compared += 1
                locals_ = list(compute_block_hash_for_seq(probe, BS))
                signed = [h - 2**64 if h >= 2**63 else h for h in locals_]
                hbody = {"block_hashes": signed, "model_name": MODEL}
                status, want_h = dynamo.call("/query_by_hash", hbody)
                assert status == 200, want_h
                got_h = await asyncio.to_thread(ours.query_by_hash, signed, model_name=MODEL)
                assert got_h == want_h
        assert compared == 320
        assert sum(e.events for e in engines) > 500
        # the same refusals: unknown model 404, duplicate registration 409, bad tokens 422
        for path, body in [
            ("/query", {"token_ids": [1, 2], "model_name": "nope"}),
            (
                "/register",
                {
                    "instance_id": INSTANCES[0],
                    "endpoint": engines[0].endpoint,
                    "model_name": MODEL,
                    "block_size": BS,
                },
            ),
            (
                "/register",
                {
                    "instance_id": 99,
                    "endpoint": engines[0].endpoint,
                    "model_name": MODEL,
                    "block_size": BS * 2,
                },
            ),
            ("/query", {"token_ids": [-1], "model_name": MODEL}),
            ("/query_by_hash", {"block_hashes": [2**63], "model_name": MODEL}),
        ]:
            d_status, _ = dynamo.call(path, body)
            try:
                await asyncio.to_thread(ours.call, "POST", path, body)
                k_status = 200
            except ServiceError as exc:
                k_status = exc.status
            assert k_status == d_status, (path, body)
    finally:
        ours.close()
        await svc.aclose()
        dynamo.close()

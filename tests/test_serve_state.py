"""``kvstream serve``: snapshots and restarts, peer recovery, readiness, isolation of a bad
stream, metrics, and fuzzed HTTP requests. Real ZMQ publishers on loopback throughout."""

from __future__ import annotations

import asyncio
import http.client
import os
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_support import Engine, eventually, expected_answer

from kvstream.index.errors import SnapshotError
from kvstream.serve import Client, IndexService, ServeConfig
from kvstream.serve.snapshot import decode_service_snapshot

BS = 4


def connected(worker: dict[str, Any]) -> bool:
    return all(r["status"] == "active" for r in worker["listeners"].values())


def chats(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(50_000) for _ in range(BS * 4)]
    return [
        base + [rng.randrange(50_000) for _ in range(BS * rng.randrange(1, 5))] for _ in range(n)
    ]


async def test_restart_resumes_from_the_snapshot_and_replays_what_it_missed(
    engines: Any, tmp_path: Path
) -> None:
    snap = tmp_path / "serve.snap"
    e = engines()
    fleet = {(5, 0): e}
    cfg = ServeConfig(port=0, block_size=BS, snapshot=snap, snapshot_every_s=3600)
    first = chats(1, 10)
    async with IndexService(cfg) as svc:
        with Client(svc.url) as c:
            await asyncio.to_thread(c.register, 5, e.endpoint, replay_endpoint=e.replay_endpoint)
            for p in first:
                e.store(p)
            await eventually(
                lambda: all(c.query(p) == expected_answer(fleet, p, BS) for p in first)
            )
    assert snap.exists()
    # the engine goes on while the service is down: those batches wait in its replay buffer
    later = chats(2, 6)
    for p in later:
        e.store(p)
    e.evict_leaves(4)
    async with IndexService(cfg) as svc:
        assert svc.restored_from == "snapshot"
        with Client(svc.url) as c:
            await eventually(lambda: c.ready()["ready"])
            probes = first + later
            await eventually(
                lambda: all(c.query(p) == expected_answer(fleet, p, BS) for p in probes)
            )
            (w,) = await asyncio.to_thread(c.workers)
            assert w["endpoints"] == {"0": e.endpoint}  # the registration came back with it


async def test_a_failed_snapshot_write_keeps_the_previous_one(
    engines: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snap = tmp_path / "serve.snap"
    e = engines()
    cfg = ServeConfig(port=0, block_size=BS, snapshot=snap, snapshot_every_s=3600)
    async with IndexService(cfg) as svc:
        with Client(svc.url) as c:
            await asyncio.to_thread(c.register, 5, e.endpoint, replay_endpoint=e.replay_endpoint)
            e.store(chats(3, 1)[0])
            await eventually(lambda: c.query(chats(3, 1)[0])["scores"])
        await svc.save_snapshot()
        good = snap.read_bytes()
        e.store(chats(4, 1)[0])

        def crash(*_: Any) -> None:
            raise OSError("simulated crash before the rename")

        monkeypatch.setattr(os, "replace", crash)
        with pytest.raises(OSError, match="simulated crash"):
            await svc.save_snapshot()
        monkeypatch.undo()
        assert snap.read_bytes() == good
        assert decode_service_snapshot(good)[0].model.index.stats().blocks > 0
    snap.write_bytes(good[:-5])
    with pytest.raises(SnapshotError):
        await IndexService(cfg).start()


async def test_a_replica_without_a_snapshot_recovers_from_a_peer(engines: Any) -> None:
    e = engines()
    fleet = {(9, 0): e}
    prompts = chats(5, 8)
    async with IndexService(ServeConfig(port=0, block_size=BS)) as live:
        with Client(live.url) as c:
            await asyncio.to_thread(c.register, 9, e.endpoint, replay_endpoint=e.replay_endpoint)
            for p in prompts:
                e.store(p)
            await eventually(
                lambda: all(c.query(p) == expected_answer(fleet, p, BS) for p in prompts)
            )
        cfg = ServeConfig(port=0, block_size=BS, peers=(live.url,))
        async with IndexService(cfg) as fresh:
            assert fresh.restored_from == f"peer {live.url}"
            with Client(fresh.url) as c:
                assert await asyncio.to_thread(c.call, "GET", "/peers") == [live.url]
                for p in prompts:
                    assert await asyncio.to_thread(c.query, p) == expected_answer(fleet, p, BS)
                # it follows the engine itself from there on
                more = chats(6, 3)
                for p in more:
                    e.store(p)
                await eventually(
                    lambda: all(c.query(p) == expected_answer(fleet, p, BS) for p in more)
                )


async def test_ready_waits_for_the_start_up_replay(engines: Any) -> None:
    e = engines()
    for p in chats(7, 5):
        e.store(p)  # published before anyone listened: only the replay has them
    cfg = ServeConfig(
        port=0, block_size=BS, workers=f"4=tcp://127.0.0.1:{e.port};tcp://127.0.0.1:{e.replay_port}"
    )
    async with IndexService(cfg) as svc:
        with Client(svc.url) as c:
            await eventually(lambda: c.ready()["ready"])
            for p in chats(7, 5):
                assert await asyncio.to_thread(c.query, p) == expected_answer({(4, 0): e}, p, BS)


async def test_one_bad_stream_does_not_affect_the_others(engines: Any) -> None:
    good, bad = engines(), engines()
    async with IndexService(ServeConfig(port=0, block_size=BS)) as svc:
        with Client(svc.url) as c:
            await asyncio.to_thread(
                c.register, 1, good.endpoint, replay_endpoint=good.replay_endpoint
            )
            await asyncio.to_thread(c.register, 2, bad.endpoint)
            # no replay socket: wait for the subscription before the engine publishes
            await eventually(lambda: all(connected(w) for w in c.workers()))
            prompts = chats(8, 6)
            for p in prompts:
                good.store(p)
                bad.store(p)
            # garbage frames, an undecodable payload, a restart storm, 8-token blocks
            bad.pub.send_raw([b"only one frame"])
            bad.pub.publish(b"\x93not msgpack at all")
            for _ in range(5):
                bad.pub.restart()
                bad.store(chats(9, 1)[0])
            big = Engine(BS * 2)
            try:
                bad.pub.publish(big.payload_of_store(list(range(1, 1 + BS * 4))))
            finally:
                big.close()
            await eventually(
                lambda: next(w for w in c.workers() if w["instance_id"] == 2)["status"] == "stale"
            )
            for p in prompts:
                got = await asyncio.to_thread(c.query, p)
                assert got == expected_answer({(1, 0): good}, p, BS)
            (w2,) = [w for w in await asyncio.to_thread(c.workers) if w["instance_id"] == 2]
            assert "block size mismatch" in w2["listeners"]["0"]["note"]


async def test_metrics_cover_requests_feeds_and_the_index(engines: Any) -> None:
    e = engines()
    async with IndexService(ServeConfig(port=0, block_size=BS)) as svc:
        with Client(svc.url) as c:
            await asyncio.to_thread(c.register, 1, e.endpoint, replay_endpoint=e.replay_endpoint)
            e.store(chats(10, 1)[0])
            await eventually(lambda: c.query(chats(10, 1)[0])["scores"])
            await eventually(lambda: c.ready()["ready"])
            text = await asyncio.to_thread(c.metrics)
    for needle in (
        'kvstream_serve_requests_total{endpoint="/query",method="POST",status="200"}',
        'kvstream_serve_request_duration_seconds_bucket{endpoint="/query"',
        'kvstream_serve_ingested_batches_total{feed="zmq:1:0"} 1.0',
        'kvstream_serve_blocks{model="default:default"}',
        "kvstream_serve_ready 1.0",
        "kvstream_build_info{",
        "process_resident_memory_bytes",
        "python_info{",
    ):
        assert needle in text, needle


_methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"])
_paths = st.sampled_from(
    [
        "/query",
        "/query_by_hash",
        "/register",
        "/unregister",
        "/workers",
        "/dump",
        "/route",
        "/ready",
        "/snapshot",
        "/register_peer",
        "/peers",
        "/x",
        "/query/../dump",
    ]
)
_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
_bodies = st.one_of(
    st.binary(max_size=64),
    _json_values.map(lambda v: __import__("json").dumps(v).encode()),
    st.fixed_dictionaries(
        {"token_ids": st.lists(st.integers(min_value=-5, max_value=2**33), max_size=20)},
        optional={
            "model_name": st.text(max_size=5),
            "block_hashes": st.lists(st.integers(), max_size=5),
            "instance_id": st.integers(),
            "endpoint": st.text(max_size=30),
            "lora_name": st.text(max_size=5),
            "hash_algo": st.text(max_size=12),
        },
    ).map(lambda v: __import__("json").dumps(v).encode()),
)


async def test_fuzzed_requests_never_crash_the_service(engines: Any) -> None:
    e = engines()
    async with IndexService(ServeConfig(port=0, block_size=BS)) as svc:
        with Client(svc.url) as c:
            await asyncio.to_thread(c.register, 1, e.endpoint)
        e.store(chats(11, 1)[0])
        port = svc.port
        assert port is not None

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(method=_methods, path=_paths, body=_bodies)
        def one(method: str, path: str, body: bytes) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request(method, path, body=body, headers={"content-type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                # 503 is /ready's "not yet" (a fuzzed /register added a feed to wait for)
                ok = resp.status < 500 or (resp.status == 503 and path == "/ready")
                assert ok, (method, path, body, resp.status)
            finally:
                conn.close()

        await asyncio.to_thread(one)
        with Client(svc.url) as c:
            assert await asyncio.to_thread(c.health)


async def test_a_dead_publisher_shows_as_stale_and_its_restart_as_a_new_incarnation(
    engines: Any,
) -> None:
    e = engines()
    async with IndexService(ServeConfig(port=0, block_size=BS)) as svc:
        with Client(svc.url) as c:
            await asyncio.to_thread(c.register, 3, e.endpoint, replay_endpoint=e.replay_endpoint)
            prompt = chats(12, 1)[0]
            e.store(prompt)
            await eventually(lambda: c.query(prompt)["scores"])
            port, replay = e.port, e.replay_port
            await asyncio.to_thread(e.close)  # the engine process dies

            def listener() -> dict[str, Any]:
                return c.workers()[0]["listeners"]["0"]

            await eventually(lambda: listener()["status"] == "stale")
            assert "disconnected" in (await asyncio.to_thread(listener))["note"]
            # a new engine process on the same ports: seq from 0, an empty cache
            from engine_publisher import TestEnginePublisher

            e.pub = await asyncio.to_thread(TestEnginePublisher, port, replay)
            e.blocks.clear()
            e.next_id = 0
            await eventually(lambda: listener()["status"] == "active")  # reconnected
            other = chats(13, 1)[0]
            e.store(other)
            await eventually(lambda: c.query(other) == expected_answer({(3, 0): e}, other, BS))
            assert await asyncio.to_thread(c.query, prompt) == expected_answer(
                {(3, 0): e}, prompt, BS
            )

"""EngineSource over real ZMQ sockets on 127.0.0.1: replay, gaps, restarts, bad input.

The engine side is tests/engine_publisher.py, which speaks vLLM 0.33's protocol on the wire
(the real vLLM publisher is driven in tests/peers/). In this sandbox ZMQ delivers only when
the PUB binds and the SUB connects, which is the engine-binds deployment tested here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
from engine_publisher import TestEnginePublisher, free_ports
from engine_publisher import stored_payload as payload

from kvstream.events.model import EventBatch, Lost, Stored
from kvstream.index.sources import open_source
from kvstream.index.sources.engine import EngineSource


async def collect(src: EngineSource, n: int, timeout: float = 10.0) -> list[EventBatch]:
    out: list[EventBatch] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while len(out) < n:
        item = await src.read(max(0.0, end - loop.time()))
        if item is None:
            raise AssertionError(f"only {len(out)} of {n} batches arrived: {out}")
        out.append(item.batch)
    return out


def hashes(batches: list[EventBatch]) -> list[int]:
    out = []
    for b in batches:
        for e in b.events:
            if isinstance(e.data, Stored):
                out.extend(int.from_bytes(x.block_hash, "big") for x in e.data.blocks)
    return out


def ids(batches: list[EventBatch]) -> list[int]:
    return [e.event_id for b in batches for e in b.events]


@pytest.fixture
def ports() -> Iterator[list[int]]:
    return free_ports(4)


@pytest.fixture
async def engine(ports: list[int]) -> AsyncIterator[TestEnginePublisher]:
    pub = TestEnginePublisher(ports[0], ports[2])
    yield pub
    pub.close()


async def test_from_0_replays_what_was_published_before_the_bridge_started(
    engine: TestEnginePublisher, ports: list[int]
) -> None:
    for i in range(5):
        engine.publish(payload(i))  # nobody listens yet
    src = open_source(f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}&instance=w0")
    assert isinstance(src, EngineSource)
    async with src:
        await asyncio.sleep(0.3)  # let the SUB join before the next live batch
        engine.publish(payload(5))
        got = await collect(src, 6)
    assert hashes(got) == [1, 2, 3, 4, 5, 6]
    assert ids(got) == [0, 1, 2, 3, 4, 5]
    assert all(b.source.instance_id == "w0" and b.source.attention_dp_rank == 0 for b in got)
    assert src.subscriber.stats[0].replayed == 5
    ckpt = src.checkpoint()
    assert ckpt["engine_seq"] == {"0": 5}
    assert ckpt["streams"]["0"]["next_id"] == 6
    assert ckpt["streams"]["0"]["incarnation"] == got[0].source.incarnation
    assert engine.replay_requests == [0]


async def test_a_gap_is_replayed_in_order(engine: TestEnginePublisher, ports: list[int]) -> None:
    async with open_source(f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}") as src:
        await asyncio.sleep(0.3)
        engine.publish(payload(0))
        first = await collect(src, 1)
        engine.publish(payload(1), send=False)  # dropped by the PUB for this subscriber
        engine.publish(payload(2), send=False)
        engine.publish(payload(3))
        rest = await collect(src, 3)
    assert hashes(first + rest) == [1, 2, 3, 4]
    assert ids(first + rest) == [0, 1, 2, 3]
    assert not any(isinstance(e.data, Lost) for b in rest for e in b.events)


async def test_a_gap_beyond_the_replay_buffer_becomes_a_lost_marker(ports: list[int]) -> None:
    engine = TestEnginePublisher(ports[0], ports[2], buffer_steps=2)
    try:
        async with open_source(f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}") as src:
            await asyncio.sleep(0.3)
            engine.publish(payload(0))
            await collect(src, 1)
            for i in range(1, 5):
                engine.publish(payload(i), send=False)  # the buffer keeps only 3, 4
            engine.publish(payload(5))  # buffer now: 4, 5
            got = await collect(src, 3)
    finally:
        engine.close()
    lost = got[0].events[0]
    assert isinstance(lost.data, Lost)
    assert (lost.data.first_event_id, lost.data.count) == (1, 3)  # engine seqs 1..3
    assert "seq 1..3" in lost.data.reason
    assert hashes(got[1:]) == [5, 6]
    assert ids(got) == [3, 4, 5]  # the marker carries the last id of its range


async def test_no_replay_endpoint_means_lost_not_silence(ports: list[int]) -> None:
    engine = TestEnginePublisher(ports[0])
    try:
        engine.publish(payload(0))
        engine.publish(payload(1))
        async with open_source(f"vllm://127.0.0.1:{ports[0]}") as src:
            await asyncio.sleep(0.3)
            engine.publish(payload(2))
            got = await collect(src, 2)
    finally:
        engine.close()
    assert isinstance(got[0].events[0].data, Lost)
    assert "no replay endpoint" in got[0].events[0].data.reason
    assert hashes(got) == [3]
    assert ids(got) == [1, 2]


async def test_an_absent_replay_socket_times_out_into_a_lost_marker(ports: list[int]) -> None:
    engine = TestEnginePublisher(ports[0])  # replay port given in the URL, but nobody there
    try:
        engine.publish(payload(0))
        url = f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}&replay_timeout=0.3"
        async with open_source(url) as src:
            await asyncio.sleep(0.3)
            engine.publish(payload(1))
            got = await collect(src, 2)
    finally:
        engine.close()
    assert "did not answer" in got[0].events[0].data.reason  # type: ignore[union-attr]
    assert hashes(got) == [2]


async def test_from_latest_reports_what_came_before(
    engine: TestEnginePublisher, ports: list[int]
) -> None:
    for i in range(3):
        engine.publish(payload(i))
    async with open_source(f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}&from=latest") as src:
        await asyncio.sleep(0.3)
        engine.publish(payload(3))
        got = await collect(src, 2)
    assert "from=latest" in got[0].events[0].data.reason  # type: ignore[union-attr]
    assert got[0].events[0].data.count == 3  # type: ignore[union-attr]
    assert hashes(got) == [4]
    assert engine.replay_requests == []


async def test_an_engine_restart_starts_a_new_incarnation(
    engine: TestEnginePublisher, ports: list[int]
) -> None:
    async with open_source(f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}") as src:
        await asyncio.sleep(0.3)
        engine.publish(payload(0))
        engine.publish(payload(1))
        before = await collect(src, 2)
        engine.restart()
        engine.publish(payload(10), send=False)  # the new process's seq 0, missed live
        engine.publish(payload(11))  # seq 1 < last seen 1? no: equal -> restart detected
        after = await collect(src, 2)
    assert before[0].source.incarnation == before[1].source.incarnation
    assert after[0].source.incarnation > before[0].source.incarnation
    assert hashes(after) == [11, 12]  # seq 0 came back through replay
    assert ids(after) == [0, 1]
    assert src.subscriber.stats[0].restarts == 1


async def test_garbage_frames_are_counted_and_skipped(
    engine: TestEnginePublisher, ports: list[int]
) -> None:
    async with open_source(f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}") as src:
        await asyncio.sleep(0.3)
        engine.publish(payload(0))
        await collect(src, 1)
        engine.send_raw([b"", b"short", b"x"])
        engine.send_raw([b"only-one-frame"])
        engine.publish(b"\xc1 not msgpack")
        engine.publish(msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}], 0]))
        engine.publish(payload(4))
        got = await collect(src, 3)
    assert isinstance(got[0].events[0].data, Lost)  # the undecodable batch
    assert isinstance(got[1].events[0].data, Lost)  # the malformed event
    assert "malformed engine event" in got[1].events[0].data.reason
    assert hashes(got) == [5]
    assert ids(got) == [1, 2, 3]
    assert src.stats.malformed == 3
    assert any("not msgpack" in m.error for m in src.recent_malformed)


async def test_legacy_two_frame_replay(ports: list[int]) -> None:
    engine = TestEnginePublisher(ports[0], ports[2], legacy_replay=True)
    try:
        for i in range(3):
            engine.publish(payload(i))
        async with open_source(f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}") as src:
            await asyncio.sleep(0.3)
            engine.publish(payload(3))
            got = await collect(src, 4)
    finally:
        engine.close()
    assert hashes(got) == [1, 2, 3, 4]


async def test_two_dp_ranks_are_two_sources(ports: list[int]) -> None:
    r0 = TestEnginePublisher(ports[0], ports[2])
    r1 = TestEnginePublisher(ports[1], ports[3])
    try:
        r0.publish(payload(0, 0))
        r1.publish(payload(100, 1))
        url = f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}&dp_size=2&instance=eng"
        async with open_source(url) as src:
            await asyncio.sleep(0.3)
            r0.publish(payload(1, 0))
            r1.publish(payload(101, 1))
            got = await collect(src, 4)
    finally:
        r0.close()
        r1.close()
    by_rank: dict[int | None, list[EventBatch]] = {}
    for b in got:
        by_rank.setdefault(b.source.attention_dp_rank, []).append(b)
    assert hashes(by_rank[0]) == [1, 2]
    assert hashes(by_rank[1]) == [101, 102]
    assert ids(by_rank[0]) == ids(by_rank[1]) == [0, 1]


async def test_an_engine_that_never_started(ports: list[int]) -> None:
    async with open_source(f"vllm://127.0.0.1:{ports[0]}?dp_size=2") as src:
        assert await src.read(0.3) is None
        assert src.waiting_ranks() == [0, 1]  # the bridge says what it waits for


async def test_resume_from_a_checkpoint_replays_only_what_came_after(
    engine: TestEnginePublisher, ports: list[int]
) -> None:
    for i in range(6):
        engine.publish(payload(i))
    url = f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}"
    async with open_source(url, resume_from={"engine_seq": {"0": 3}}) as src:
        await asyncio.sleep(0.3)
        engine.publish(payload(6))
        got = await collect(src, 3)
    assert hashes(got) == [5, 6, 7]
    assert engine.replay_requests == [4]


async def test_a_resumed_source_goes_on_with_the_same_incarnation_and_ids(
    engine: TestEnginePublisher, ports: list[int]
) -> None:
    """A consumer restored from a snapshot keeps the engine's state only if the resumed
    source continues the incarnation (a new one would tell the index to forget it)."""
    from kvstream.index import PrefixIndex

    for i in range(3):
        engine.publish(payload(i))
    url = f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}&instance=w0"
    index = PrefixIndex()
    async with open_source(url) as src:
        first = await collect(src, 3)
        ckpt = src.checkpoint()
    for b in first:
        index.apply(b)
    for i in range(3, 5):
        engine.publish(payload(i))  # while the consumer is down
    async with open_source(url, resume_from=ckpt) as src:
        await asyncio.sleep(0.3)
        engine.publish(payload(5))
        later = await collect(src, 3)
    assert {b.source.incarnation for b in later} == {first[0].source.incarnation}
    assert ids(later) == [3, 4, 5]
    for b in later:
        index.apply(b)
    info = index.info(("w0", 0))
    assert not info.stale
    assert info.stats.incarnation_changes == 0
    assert info.stats.stored_blocks == 6


def test_bad_urls_are_config_errors() -> None:
    from kvstream.errors import ConfigError

    for url in (
        "vllm://127.0.0.1",
        "vllm://127.0.0.1:5557?dp_size=0",
        "vllm://127.0.0.1:5557?from=yesterday",
        "vllm://127.0.0.1:5557?replay=5557",
        "vllm://127.0.0.1:5557?bogus=1",
        "vllm://127.0.0.1:65535?dp_size=2",
        "sglang://:5557",
    ):
        with pytest.raises(ConfigError):
            open_source(url)


def _router_binds_delivers(port: int) -> bool:
    """Whether this machine delivers PUB-connect -> SUB-bind messages (some sandboxes do not)."""
    import time

    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(f"tcp://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            pub.send(b"probe")
            if sub.poll(100):
                return True
        return False
    finally:
        pub.close(0)
        sub.close(0)
        ctx.term()


async def test_bind_true_the_router_binds_and_engines_connect(ports: list[int]) -> None:
    if not _router_binds_delivers(ports[3]):
        pytest.skip("this machine does not deliver PUB-connect -> SUB-bind messages")
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)  # the engine side, connecting (vLLM endpoint without '*')
    pub.setsockopt(zmq.LINGER, 0)
    try:
        async with open_source(f"vllm://127.0.0.1:{ports[0]}?bind=true&from=latest") as src:
            pub.connect(f"tcp://127.0.0.1:{ports[0]}")
            got: list[EventBatch] = []
            for i in range(50):  # until the connection is up: from=latest marks the rest lost
                pub.send_multipart([b"", i.to_bytes(8, "big"), payload(i)])
                item = await src.read(0.1)
                if item is not None:
                    got.append(item.batch)
                    break
            assert got, "nothing arrived through the bound SUB socket"
            assert hashes(got) or isinstance(got[0].events[0].data, Lost)
    finally:
        pub.close(0)
        ctx.term()


async def test_from_0_replays_at_once_even_if_the_engine_stays_idle(
    engine: TestEnginePublisher, ports: list[int]
) -> None:
    for i in range(3):
        engine.publish(payload(i))
    async with open_source(f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}") as src:
        got = await collect(src, 3)  # nothing more is published
        assert hashes(got) == [1, 2, 3]
        engine.publish(payload(3))
        assert hashes(await collect(src, 1)) == [4]
        assert await src.read(0.3) is None

"""The vllm:// export sink on real loopback sockets: PUB frames, replay ROUTER, DP ranks.

The sink binds (as a vLLM engine does) and the test's SUB/DEALER/REQ sockets connect.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from kvstream.sinks.vllm import VllmSink
from zmq_clients import END_SEQ, Client, free_ports, recv, replay, seqs, subscribe

from kvstream.engines.vllm_export import VllmExporter
from kvstream.errors import ConfigError, PermanentSinkError, RetriableSinkError
from kvstream.events.model import (
    UNBOUNDED_WINDOW,
    Cleared,
    Created,
    EventBatch,
    KVCacheEvent,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
)
from kvstream.sink import ExportStatus, _load_target, parse_sink_url

ROOT = Path(__file__).resolve().parents[1]


def sink_url(dp: int = 1, **params: object) -> str:
    port = free_ports(2 * dp)
    query = "&".join(
        [f"replay={port + dp}", f"dp_size={dp}", *(f"{k}={v}" for k, v in params.items())]
    )
    return f"vllm://127.0.0.1:{port}?{query}"


def h8(n: int) -> bytes:
    return n.to_bytes(8, "big")


def stored_batch(
    *hashes: int, rank: int | None = None, instance: str = "w0", incarnation: int = 0
) -> EventBatch:
    blocks = tuple(StoredBlock(block_hash=h8(h), token_ids=[h, h + 1]) for h in hashes)
    event = KVCacheEvent(
        event_id=0,
        hash_algo="vllm_sha256_cbor_64",
        window_size=UNBOUNDED_WINDOW,
        data=Stored(blocks=blocks),
    )
    return EventBatch(
        source=SourceId(instance_id=instance, attention_dp_rank=rank, incarnation=incarnation),
        ts_ns=2_000_000_000,
        events=(event,),
    )


def decode(payload: bytes) -> list[Any]:
    return list(msgspec.msgpack.decode(payload))


@pytest.fixture
async def ctx() -> AsyncIterator[Client]:
    client = Client()
    yield client
    client.close()


@pytest.fixture
async def sink() -> AsyncIterator[VllmSink]:
    s = VllmSink.from_url(parse_sink_url(sink_url()))
    await s.start()
    yield s
    await s.shutdown(1.0)


# ------------------------------------------------------------------------------- URLs


def test_url_defaults_and_options() -> None:
    s = VllmSink.from_url(parse_sink_url("vllm://127.0.0.1:7000"))
    assert (s.port, s.replay_port, s.fixed_dp_size, s.name) == (7000, None, None, "vllm")
    assert (s.instance, s.ranks) == (None, None)  # dp_size=auto, every instance and rank
    assert s.endpoint(0) == "tcp://127.0.0.1:7000"
    assert s.replay_endpoint(0) is None
    s = VllmSink.from_url(
        parse_sink_url(
            "vllm://*:7000?replay=7100&dp_size=4&topic=kv@p@m&buffer_steps=5&hwm=9"
            "&hash_format=bytes&track_blocks=0&linger_s=0.5&name=dyn&instance=w3&ranks=1,3"
        )
    )
    assert (s.fixed_dp_size, s.instance, s.ranks) == (4, "w3", {1, 3})
    assert (s.endpoint(3), s.replay_endpoint(3)) == ("tcp://*:7003", "tcp://*:7103")
    assert (s.exporter.hash_format, s.exporter.track_blocks, s.linger_s, s.name) == (
        "bytes",
        0,
        0.5,
        "dyn",
    )
    v6 = VllmSink.from_url(parse_sink_url("vllm://[::1]:7000?replay=7001"))
    assert v6.endpoint(0) == "tcp://[::1]:7000"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("vllm://127.0.0.1:7000?bogus=1", "unknown parameter"),
        ("vllm://127.0.0.1", "HOST:PORT"),
        ("vllm://127.0.0.1:7000/path", "HOST:PORT"),
        ("vllm://127.0.0.1:7000?hash_format=hex", "hash_format"),
        ("vllm://127.0.0.1:7000?replay=7001&dp_size=2", "overlap"),
        ("vllm://127.0.0.1:65535?dp_size=2", "65535"),
        ("vllm://127.0.0.1:7000?dp_size=0", "dp_size"),
        ("vllm://127.0.0.1:7000?dp_size=some", "dp_size"),
        ("vllm://127.0.0.1:7000?dp_size=2&ranks=2", "ranks"),
        ("vllm://127.0.0.1:7000?ranks=a,b", "ranks"),
        ("vllm://127.0.0.1:7000?ranks=", "ranks"),
        ("vllm://127.0.0.1:7000?instance=", "instance"),
        ("vllm://127.0.0.1:7000?buffer_steps=0", "buffer_steps"),
        ("vllm://127.0.0.1:7000?hwm=-1", "hwm"),
        ("vllm://127.0.0.1:7000?track_blocks=-1", "track_blocks"),
        ("vllm://127.0.0.1:7000?linger_s=-1", "linger_s"),
    ],
)
def test_bad_urls(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        VllmSink.from_url(parse_sink_url(url))


def test_entry_point_names_the_sink() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split('[project.entry-points."kvstream.sinks"]', 1)[1].split("\n[", 1)[0]
    found = re.search(r'^vllm\s*=\s*"([^"]+)"', section, re.M)
    assert found is not None
    target = found.group(1)
    assert _load_target(target) is VllmSink


# --------------------------------------------------------------------------- publishing


async def test_sub_receives_exactly_the_frames(sink: VllmSink, ctx: Client) -> None:
    sub = await subscribe(ctx, sink.endpoint(0))
    batches = [stored_batch(1, 2), stored_batch(3), stored_batch(4, 5, 6)]
    result = await sink.export(batches)
    assert result.ok
    expected = VllmExporter()
    for seq, b in enumerate(batches):
        topic, seq_bytes, payload = await recv(sub)
        assert (topic, seq_bytes) == (b"", seq.to_bytes(8, "big"))
        assert payload == expected.encode(b, dp_rank=0).payload
    ts, events, rank = decode(payload)
    assert (ts, rank) == (2.0, 0)
    assert events[0]["block_hashes"] == [4, 5, 6]
    assert events[0]["token_ids"] == [4, 5, 5, 6, 6, 7]
    assert (sink.published_batches, sink.published_events, sink.next_seq(0)) == (3, 3, 3)


async def test_batches_with_nothing_to_say_are_not_sent(sink: VllmSink) -> None:
    created = KVCacheEvent(
        event_id=0,
        window_size=UNBOUNDED_WINDOW,
        data=Created(num_blocks_per_cache_level=(8,), tokens_per_block=4),
    )
    empty = EventBatch(source=SourceId(instance_id="w0"), ts_ns=0)
    only_created = EventBatch(source=SourceId(instance_id="w0"), ts_ns=0, events=(created,))
    assert (await sink.export([empty, only_created])).ok
    assert sink.next_seq(0) == 0
    assert sink.exporter.unmapped == {"created": 1}


async def test_export_starts_the_sink_lazily(ctx: Client) -> None:
    s = VllmSink.from_url(parse_sink_url(sink_url()))
    try:
        assert (await s.export([stored_batch(1)])).ok
        assert seqs(await replay(ctx, str(s.replay_endpoint(0)), 0)) == [0]
    finally:
        await s.shutdown(1.0)


# ------------------------------------------------------------------------------- replay


async def test_replay_from_zero_returns_every_buffered_batch(sink: VllmSink, ctx: Client) -> None:
    batches = [stored_batch(i) for i in range(1, 6)]
    assert (await sink.export(batches)).ok
    replies = await replay(ctx, str(sink.replay_endpoint(0)), 0)
    assert seqs(replies) == [0, 1, 2, 3, 4]
    expected = VllmExporter()
    for reply, b in zip(replies, batches, strict=False):
        # a DEALER without a delimiter gets [topic, seq, payload] (vLLM >= 0.26 shape)
        assert len(reply) == 3
        assert reply[0] == b""
        assert reply[2] == expected.encode(b).payload
    assert replies[-1] == [b"", END_SEQ, b""]


async def test_replay_from_the_middle_and_with_a_delimiter(sink: VllmSink, ctx: Client) -> None:
    assert (await sink.export([stored_batch(i) for i in range(1, 6)])).ok
    replies = await replay(ctx, str(sink.replay_endpoint(0)), 3, delimiter=True)
    assert seqs(replies) == [3, 4]
    # a DEALER that sent ["", start] (as llm-d's and kvstream's do) gets the delimiter back
    assert all(r[0] == b"" and len(r) == 4 for r in replies)
    assert replies[-1] == [b"", b"", END_SEQ, b""]
    assert seqs(await replay(ctx, str(sink.replay_endpoint(0)), 99)) == []


async def test_req_client_gets_the_end_marker(sink: VllmSink, ctx: Client) -> None:
    req = ctx.socket(zmq.REQ)
    req.connect(str(sink.replay_endpoint(0)))
    await req.send((0).to_bytes(8, "big"))
    assert await recv(req) == [b"", END_SEQ, b""]  # REQ strips its own delimiter


async def test_buffer_keeps_only_the_last_buffer_steps(ctx: Client) -> None:
    s = VllmSink.from_url(parse_sink_url(sink_url(buffer_steps=3)))
    try:
        assert (await s.export([stored_batch(i) for i in range(1, 6)])).ok
        assert seqs(await replay(ctx, str(s.replay_endpoint(0)), 0)) == [2, 3, 4]
        assert seqs(await replay(ctx, str(s.replay_endpoint(0)), 1)) == [2, 3, 4]
    finally:
        await s.shutdown(1.0)


async def test_malformed_replay_requests_are_ignored(sink: VllmSink, ctx: Client) -> None:
    assert (await sink.export([stored_batch(1)])).ok
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(str(sink.replay_endpoint(0)))
    await dealer.send(b"\x00\x01")  # not 8 bytes
    await dealer.send_multipart([b"x", b"y", b"z"])  # not a request shape
    await dealer.send((0).to_bytes(8, "big"))
    first = await recv(dealer)
    assert int.from_bytes(first[1], "big") == 0
    assert (await recv(dealer))[-2] == END_SEQ


# ------------------------------------------------------------------ ranks, topic, hashes


async def test_two_dp_ranks_publish_on_their_own_ports(ctx: Client) -> None:
    s = VllmSink.from_url(parse_sink_url(sink_url(dp=2)))
    await s.start()
    try:
        sub0 = await subscribe(ctx, s.endpoint(0))
        sub1 = await subscribe(ctx, s.endpoint(1))
        batches = [stored_batch(1, rank=0), stored_batch(2, rank=1), stored_batch(3, rank=1)]
        assert (await s.export(batches)).ok
        r0 = await recv(sub0)
        r1 = [await recv(sub1), await recv(sub1)]
        assert int.from_bytes(r0[1], "big") == 0
        assert decode(r0[2])[2] == 0
        assert decode(r0[2])[1][0]["block_hashes"] == [1]
        assert [int.from_bytes(f[1], "big") for f in r1] == [0, 1]
        assert [decode(f[2])[2] for f in r1] == [1, 1]
        assert [decode(f[2])[1][0]["block_hashes"] for f in r1] == [[2], [3]]
        assert seqs(await replay(ctx, str(s.replay_endpoint(0)), 0)) == [0]
        assert seqs(await replay(ctx, str(s.replay_endpoint(1)), 0)) == [0, 1]
        assert s.replay_endpoint(1) == f"tcp://127.0.0.1:{s.replay_port + 1}"  # type: ignore[operator]
    finally:
        await s.shutdown(1.0)


async def test_topic_frame_and_filter(ctx: Client) -> None:
    s = VllmSink.from_url(parse_sink_url(sink_url(topic="kv@pod-1@m")))
    await s.start()
    try:
        match = await subscribe(ctx, s.endpoint(0), b"kv@")
        other = await subscribe(ctx, s.endpoint(0), b"other")
        assert (await s.export([stored_batch(1)])).ok
        frames = await recv(match)
        assert frames[0] == b"kv@pod-1@m"
        assert await other.poll(300) == 0
        replies = await replay(ctx, str(s.replay_endpoint(0)), 0)
        assert replies[0][0] == b"kv@pod-1@m"
        assert replies[-1] == [b"", END_SEQ, b""]  # the end marker has an empty topic
    finally:
        await s.shutdown(1.0)


@pytest.mark.parametrize("fmt", ["int", "bytes"])
async def test_hash_format(fmt: str, ctx: Client) -> None:
    s = VllmSink.from_url(parse_sink_url(sink_url(hash_format=fmt)))
    digest = bytes(range(32))
    event = KVCacheEvent(
        event_id=0,
        hash_algo="v2_sha256",
        window_size=UNBOUNDED_WINDOW,
        data=Stored(blocks=(StoredBlock(block_hash=digest, token_ids=[1]),)),
    )
    try:
        assert (
            await s.export([EventBatch(source=SourceId(instance_id="t"), ts_ns=0, events=(event,))])
        ).ok
        [reply, _end] = await replay(ctx, str(s.replay_endpoint(0)), 0)
        [ev] = decode(reply[2])[1]
        expected = digest if fmt == "bytes" else int.from_bytes(digest[-8:], "big")
        assert ev["block_hashes"] == [expected]
    finally:
        await s.shutdown(1.0)


# ------------------------------------------------------------------------------- errors


async def test_rank_outside_dp_size_is_rejected(sink: VllmSink) -> None:
    result = await sink.export([stored_batch(1, rank=1)])
    assert result.status is ExportStatus.PERMANENT
    assert "outside dp_size=1" in result.reason
    assert isinstance(result.error, PermanentSinkError)
    assert sink.rejected == {"rank_out_of_range": 1}
    assert sink.next_seq(0) == 0
    assert sink.abandon().delivered == ()
    # other sources in the same export are still published; the export fails, and says
    # which batches went out, so only the refused one is counted lost
    ok, refused = stored_batch(2, rank=0), stored_batch(3, rank=5)
    mixed = await sink.export([ok, refused])
    assert mixed.status is ExportStatus.PERMANENT
    assert "batches not published: rank_out_of_range: rank 5 of 'w0'" in mixed.reason
    assert sink.abandon().delivered == (ok,)
    assert sink.next_seq(0) == 1
    assert sink.rejected == {"rank_out_of_range": 2}


async def test_second_instance_is_rejected(sink: VllmSink) -> None:
    assert (await sink.export([stored_batch(1, instance="a")])).ok
    result = await sink.export([stored_batch(2, instance="b")])
    assert result.status is ExportStatus.PERMANENT
    assert "one vllm sink per engine" in result.reason
    assert "instance=ID" in result.reason
    assert sink.rejected == {"other_instance": 1}
    assert sink.next_seq(0) == 1


async def test_rank_none_and_rank_zero_are_not_mixed(sink: VllmSink) -> None:
    assert (await sink.export([stored_batch(1, rank=None)])).ok
    result = await sink.export([stored_batch(2, rank=0)])
    assert result.status is ExportStatus.PERMANENT
    assert sink.rejected == {"other_source_on_rank": 1}


async def test_new_incarnation_restarts_seq_and_clears(sink: VllmSink, ctx: Client) -> None:
    sub = await subscribe(ctx, sink.endpoint(0))
    assert (await sink.export([stored_batch(1), stored_batch(2), stored_batch(3)])).ok
    assert (await sink.export([stored_batch(4, incarnation=1)])).ok
    got = [await recv(sub) for _ in range(4)]
    assert [int.from_bytes(f[1], "big") for f in got] == [0, 1, 2, 0]
    assert [e["type"] for e in decode(got[3][2])[1]] == ["AllBlocksCleared", "BlockStored"]
    assert sink.restarts == 1
    # the replay buffer holds the new process's batches only, as a restarted vLLM's would
    replies = await replay(ctx, str(sink.replay_endpoint(0)), 0)
    assert seqs(replies) == [0]
    assert replies[0][2] == got[3][2]
    # a late batch of the old incarnation cannot be published any more
    late = await sink.export([stored_batch(5, incarnation=0)])
    assert late.status is ExportStatus.PERMANENT
    assert sink.rejected == {"stale_incarnation": 1}


async def test_lost_and_cleared_reach_subscribers_as_all_blocks_cleared(
    sink: VllmSink, ctx: Client
) -> None:
    cleared = KVCacheEvent(event_id=1, window_size=UNBOUNDED_WINDOW, data=Cleared())
    removed = KVCacheEvent(
        event_id=2,
        hash_algo="vllm_sha256_cbor_64",
        window_size=UNBOUNDED_WINDOW,
        data=Removed(block_hashes=(h8(1),), cache_level=0),
    )
    b = EventBatch(source=SourceId(instance_id="w0"), ts_ns=0, events=(cleared, removed))
    assert (await sink.export([b])).ok
    [reply, _] = await replay(ctx, str(sink.replay_endpoint(0)), 0)
    assert decode(reply[2])[1] == [
        {"type": "AllBlocksCleared"},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0},
    ]


async def test_port_in_use_is_retriable() -> None:
    url = sink_url()
    first = VllmSink.from_url(parse_sink_url(url))
    await first.start()
    second = VllmSink.from_url(parse_sink_url(url))
    try:
        with pytest.raises(RetriableSinkError, match="in use"):
            await second.start()
        result = await second.export([stored_batch(1)])
        assert result.retriable
    finally:
        await second.shutdown(1.0)
        await first.shutdown(1.0)
    # everything was released: the same ports bind again
    third = VllmSink.from_url(parse_sink_url(url))
    await third.start()
    await third.shutdown(1.0)


async def test_unbindable_host_is_permanent() -> None:
    s = VllmSink("256.1.1.1", free_ports(1))
    with pytest.raises(PermanentSinkError, match="cannot bind"):
        await s.start()
    assert (await s.export([stored_batch(1)])).status is ExportStatus.PERMANENT


async def test_shutdown_flush_and_later_exports(ctx: Client) -> None:
    s = VllmSink.from_url(parse_sink_url(sink_url()))
    assert await s.force_flush(0.1)
    assert (await s.export([stored_batch(1)])).ok
    assert await s.force_flush(0.1)
    await s.shutdown(0.5)
    await s.shutdown(0.5)  # idempotent
    assert s.is_shut_down
    result = await s.export([stored_batch(2)])
    assert result.status is ExportStatus.PERMANENT
    with pytest.raises(PermanentSinkError):
        await s.start()
    # the replay socket is gone: a request gets no answer
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(str(s.replay_endpoint(0)))
    await dealer.send((0).to_bytes(8, "big"))
    assert await dealer.poll(300) == 0


async def test_cancelled_export_resumes_without_duplicates(sink: VllmSink, ctx: Client) -> None:
    batches = [stored_batch(i) for i in range(1, 201)]
    task = asyncio.create_task(sink.export(batches))
    await asyncio.sleep(0)  # runs until the export first yields, after its first group
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 0 < sink.next_seq(0) < len(batches)
    assert (await sink.export(batches)).ok
    assert sink.next_seq(0) == len(batches)
    replies = await replay(ctx, str(sink.replay_endpoint(0)), 0)
    hashes = [decode(r[2])[1][0]["block_hashes"][0] for r in replies[:-1]]
    assert hashes == list(range(1, 201))


async def test_pipeline_publishes_every_block_in_order(ctx: Client) -> None:
    from pipeline_helpers import batches_for, source

    from kvstream.pipeline import Pipeline, PipelineConfig

    sink = VllmSink.from_url(parse_sink_url(sink_url(dp=2)))
    await sink.start()
    sub0 = await subscribe(ctx, sink.endpoint(0))
    sub1 = await subscribe(ctx, sink.endpoint(1))
    src0, src1 = source("engine-0", 0), source("engine-0", 1)
    async with Pipeline([sink], PipelineConfig.load(defaults={"linger_s": 0})) as pipe:
        for b0, b1 in zip(
            batches_for(src0, 120, 4, stored=True),
            batches_for(src1, 60, 2, stored=True),
            strict=True,
        ):
            pipe.submit(b0)
            pipe.submit(b1)
            await asyncio.sleep(0)
        assert await pipe.flush(5)
    for sub, total in ((sub0, 120), (sub1, 60)):
        hashes: list[int] = []
        seen: list[int] = []
        while len(hashes) < total:
            _topic, seq, payload = await recv(sub)
            seen.append(int.from_bytes(seq, "big"))
            hashes.extend(h for e in decode(payload)[1] for h in e["block_hashes"])
        assert hashes == list(range(total))
        assert seen == list(range(30))
    assert sink.is_shut_down


# ----------------------------------------------------------------- the publisher alone


async def test_standalone_publisher_restart_and_close(ctx: Client) -> None:
    from kvstream.engines.zmq_pub import ZmqPublisher, tcp_endpoint

    assert tcp_endpoint("::1", 5) == "tcp://[::1]:5"
    port = free_ports(2)
    pub = ZmqPublisher(
        tcp_endpoint("127.0.0.1", port), tcp_endpoint("127.0.0.1", port + 1), buffer_steps=4
    )
    with pytest.raises(ConnectionError, match="not started"):
        pub.publish(b"x")
    await pub.start()
    try:
        assert [pub.publish(bytes([i])) for i in range(6)] == [0, 1, 2, 3, 4, 5]
        assert pub.buffered == [2, 3, 4, 5]
        replies = await replay(ctx, str(pub.replay_endpoint), 0)
        assert [r[2] for r in replies[:-1]] == [b"\x02", b"\x03", b"\x04", b"\x05"]
        pub.restart()
        assert (pub.next_seq, pub.buffered) == (0, [])
        assert pub.publish(b"new") == 0
        assert seqs(await replay(ctx, str(pub.replay_endpoint), 0)) == [0]
        assert (pub.published, pub.replays, pub.bad_requests) == (7, 2, 0)
    finally:
        await pub.close(0.1)
    assert not pub.started
    with pytest.raises(ConnectionError, match="closed"):
        pub.publish(b"late")
    with pytest.raises(ConnectionError, match="closed"):
        await pub.start()

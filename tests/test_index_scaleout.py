"""Index shards (docs/scaling.md): partition by worker, shards of partitions, the fan-out.

Property tests: on random streams (gaps, lost markers, clears, restarts, duplicates, orphans)
split by the Kafka sink's partitioner, the shards together hold exactly the unsharded index's
state, and the fan-out answers every match and routing decision exactly as one unsharded
index. Against the real broker: shards reading their partitions (in-process and as
``kvstream index`` processes), and a replica restored from a snapshot plus offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest_kafka import KafkaEnv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_support import Producer, tokens
from kafka_broker import create_topic
from kvstream.sinks.kafka import KafkaSink, partition_for, source_key

from kvstream.errors import ConfigError
from kvstream.events.model import EventBatch
from kvstream.index import (
    HashConfigMismatchError,
    HashRequest,
    IndexConsumer,
    PrefixIndex,
    Router,
    RouterConfig,
    SourceError,
    WorkerKey,
    load_snapshot,
    open_source,
)
from kvstream.index.shard_rpc import RemoteShard, ShardServer, ShardUnavailableError
from kvstream.index.shards import (
    ShardedIndex,
    ShardSpec,
    open_group_shard,
    open_shard,
    sharded_router,
    worker_partition,
)
from kvstream.index.sources.kafka import KafkaSource

KVSTREAM = str(Path(sys.executable).with_name("kvstream"))
TPB = 4
BASES = [tokens(8, seed=s) for s in range(3)]
TAILS = [tokens(12, seed=10 + s) for s in range(4)]
REQUESTS = [b + t for b in BASES for t in TAILS]
WORKERS = [("w0", None), ("w1", None), ("w2", 0), ("w2", 1), ("w3", None), ("w4", 0)]


# ---------------------------------------------------------------------- the split


def test_shard_spec() -> None:
    assert ShardSpec.parse("1/4") == ShardSpec(1, 4) == ShardSpec.parse((1, 4))
    assert str(ShardSpec(3, 4)) == "3/4"
    assert ShardSpec(1, 4).partitions(10) == [1, 5, 9]
    assert [s.partitions(3) for s in ShardSpec.all(2)] == [[0, 2], [1]]
    for bad in ("4/4", "-1/4", "1", "a/b", "1/0", ""):
        with pytest.raises(ConfigError):
            ShardSpec.parse(bad)
    with pytest.raises(ConfigError, match="owns none"):
        ShardSpec(3, 4).partitions(2)


@given(st.integers(1, 16), st.data())
def test_every_partition_belongs_to_exactly_one_shard(parts: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, parts))
    owned = [p for spec in ShardSpec.all(n) for p in spec.partitions(parts)]
    assert sorted(owned) == list(range(parts))


def test_worker_partition_is_the_sinks_partition() -> None:
    for inst, rank in WORKERS:
        p = Producer(inst, rank=rank)
        for n in (1, 3, 8):
            expect = partition_for(source_key(p.source), n)
            assert worker_partition(WorkerKey(inst, rank), n) == expect
            owners = [s for s in ShardSpec.all(min(n, 2)) if s.owns_worker((inst, rank), n)]
            assert len(owners) == 1


# ---------------------------------------------------------------------- random streams

op = st.one_of(
    st.tuples(st.just("store"), st.integers(0, len(REQUESTS) - 1), st.integers(0, 4)),
    st.tuples(st.just("remove"), st.integers(0, len(REQUESTS) - 1), st.integers(0, 4)),
    st.tuples(st.just("orphan"), st.integers(0, len(REQUESTS) - 1), st.integers(1, 4)),
    st.tuples(st.just("move"), st.integers(0, len(REQUESTS) - 1), st.integers(0, 4)),
    st.tuples(st.just("gap"), st.just(0), st.integers(1, 3)),
    st.tuples(st.just("lost"), st.just(0), st.integers(1, 3)),
    st.tuples(st.just("clear"), st.just(0), st.just(0)),
    st.tuples(st.just("restart"), st.just(0), st.just(0)),
    st.tuples(st.just("dup"), st.just(0), st.just(0)),
)


def random_streams(ops: list[tuple[int, tuple[str, int, int]]]) -> list[EventBatch]:
    """Batches of every worker in emission order (each worker's in its own order)."""
    producers = [Producer(inst, rank=rank, tpb=TPB) for inst, rank in WORKERS]
    out = [p.batch(p.created()) for p in producers]
    last: dict[int, EventBatch] = {}
    for w, (kind, r, i) in ops:
        p = producers[w % len(producers)]
        hs = p.chain(REQUESTS[r])
        if kind == "store":
            b = p.batch(p.stored(hs[: i + 1], level=i % 2))
        elif kind == "remove":
            b = p.batch(p.removed([hs[i]]))
        elif kind == "orphan":
            b = p.batch(p.stored(hs[i:], parent=hs[i - 1]))
        elif kind == "move":
            b = p.batch(p.updated(hs[i], 0, 1))
        elif kind == "gap":
            p.skip(i)
            b = p.batch(p.stored(hs[:1]))
        elif kind == "lost":
            b = p.batch(p.lost(i))
        elif kind == "clear":
            b = p.batch(p.cleared())
        elif kind == "restart":
            p.restart(p.source.incarnation + 1)
            b = p.batch(p.created())
        else:
            prev = last.get(w % len(producers))
            if prev is None:
                continue
            b = prev  # at-least-once delivery: a batch again
        last[w % len(producers)] = b
        out.append(b)
    return out


def split(batches: list[EventBatch], parts: int, shards: int) -> list[list[EventBatch]]:
    """Each shard's batches: its partitions' batches, partition by partition (any
    interleaving of partitions is a valid read order; per-partition order is kept)."""
    by_part: dict[int, list[EventBatch]] = {}
    for b in batches:
        by_part.setdefault(partition_for(source_key(b.source), parts), []).append(b)
    out: list[list[EventBatch]] = []
    for spec in ShardSpec.all(shards):
        mine: list[EventBatch] = []
        for p in reversed(spec.partitions(parts)):  # another order than the unsharded read
            mine += by_part.get(p, [])
        out.append(mine)
    return out


def build(batches: list[EventBatch], mode: str) -> PrefixIndex:
    idx = PrefixIndex(key_mode=mode)
    for b in batches:
        idx.apply(b)
    return idx


def union_state(indexes: list[PrefixIndex]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for idx in indexes:
        state = idx.canonical_state()
        assert not set(state) & set(out), "a worker in two shards"
        out.update(state)
    return out


def decision(d: Any) -> tuple[Any, ...]:
    return (d.worker, d.policy, d.num_tokens, d.scores)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, len(WORKERS) - 1), op), max_size=50),
    st.integers(1, 6),
    st.integers(1, 4),
    st.sampled_from(["engine", "tokens"]),
    st.lists(st.tuples(st.integers(0, len(REQUESTS) - 1), st.integers(0, 5)), max_size=6),
)
def test_shards_hold_the_unsharded_state_and_fan_out_matches_it(
    ops: list[tuple[int, tuple[str, int, int]]],
    parts: int,
    shards: int,
    mode: str,
    busy: list[tuple[int, int]],
) -> None:
    shards = min(shards, parts)
    batches = random_streams(ops)
    whole = build(batches, mode)
    pieces = [build(bs, mode) for bs in split(batches, parts, shards)]
    assert union_state(pieces) == whole.canonical_state()
    for k, piece in enumerate(pieces):
        spec = ShardSpec(k, shards)
        assert all(spec.owns_worker(w, parts) for w in piece.workers())

    fan = ShardedIndex(pieces)
    cands = fan.workers()
    assert sorted(cands) == sorted(whole.workers())
    extra = [*cands, WorkerKey("nobody")]
    for r in [*REQUESTS, REQUESTS[0][:5], []]:
        for req in (None, HashRequest(drop_last_token=False)):
            assert fan.match(r, request=req, workers=extra) == whole.match(
                r, request=req, workers=extra
            )

    # the router's scoring over the fan-out == over one index, under load: Dynamo's fixed
    # kv cost, the default kv policy, and baselines
    configs = [RouterConfig(policy=p, overlap_weight=2.0) for p in ("kv", "least-loaded")]
    configs += [RouterConfig(), RouterConfig(policy="round-robin")]
    for cfg in configs:
        one = Router(whole, cands, cfg)
        many = sharded_router(pieces, None, cfg)
        for j, (r, w) in enumerate(busy):
            for router in (one, many):
                router.load.start(f"r{j}", cands[w % len(cands)], r + 1)
        for r in REQUESTS:
            assert decision(many.route(r)) == decision(one.route(r))


# ---------------------------------------------------------------------- fan-out edges


def _stored(name: str, rank: int | None = None, algo: str = "blake3_64") -> list[EventBatch]:
    p = Producer(name, rank=rank, algo=algo, tpb=TPB)
    return [p.batch(p.created()), p.batch(p.stored(p.chain(REQUESTS[0])))]


def test_a_worker_in_two_shards_is_not_trusted() -> None:
    a = build(_stored("a") + _stored("b"), "engine")
    b = build(_stored("b"), "engine")
    fan = ShardedIndex([a, b])
    res = fan.match(REQUESTS[0])
    assert [m.worker for m in res] == [WorkerKey("a"), WorkerKey("b")]
    assert res.matches[0].trusted
    assert res.matches[0].matched_blocks == 4
    twice = res.matches[1]
    assert not twice.trusted
    assert twice.matched_blocks == 0
    assert twice.note == "held by shards 0, 1"
    assert WorkerKey("b") in fan
    assert WorkerKey("c") not in fan
    assert sharded_router(fan).route(REQUESTS[0]).worker == WorkerKey("a")


def test_fan_out_follows_workers_appearing_and_leaving() -> None:
    a = build(_stored("a"), "engine")
    b = build(_stored("b"), "engine")
    fan = ShardedIndex([a, b])
    assert fan.workers() == [WorkerKey("a"), WorkerKey("b")]
    for batch in _stored("c"):
        b.apply(batch)
    assert fan.workers() == [WorkerKey("a"), WorkerKey("b"), WorkerKey("c")]
    assert fan.match(REQUESTS[0]).get(WorkerKey("c")).matched_blocks == 4  # type: ignore[union-attr]
    a.forget(WorkerKey("a"))
    assert fan.workers() == [WorkerKey("b"), WorkerKey("c")]
    assert fan.match(REQUESTS[0], workers=[("a", None)]).matches[0].note == "unknown worker"
    assert fan.owners() == {WorkerKey("b"): [1], WorkerKey("c"): [1]}


def test_fan_out_raises_what_a_shard_raises() -> None:
    fan = ShardedIndex(
        [build(_stored("a"), "engine"), build(_stored("b", algo="v2_sha256_64"), "engine")]
    )
    with pytest.raises(HashConfigMismatchError, match="worker b/-"):
        sharded_router(fan, config=RouterConfig(hash_algo="blake3_64")).check()
    with pytest.raises(ConfigError):
        ShardedIndex([])


# ---------------------------------------------------------------------- remote shards


@contextlib.contextmanager
def served(indexes: list[PrefixIndex]) -> Iterator[list[RemoteShard]]:
    """Each index behind a ShardServer on an event loop in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = [
        asyncio.run_coroutine_threadsafe(ShardServer(idx).start(), loop).result(10)
        for idx in indexes
    ]
    remotes = [RemoteShard("127.0.0.1", s.port, timeout_s=10) for s in servers]
    try:
        yield remotes
    finally:
        for r in remotes:
            r.close()
        for s in servers:
            asyncio.run_coroutine_threadsafe(s.aclose(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, len(WORKERS) - 1), op), max_size=40),
    st.sampled_from(["engine", "tokens"]),
)
def test_remote_shards_answer_like_local_ones(
    ops: list[tuple[int, tuple[str, int, int]]], mode: str
) -> None:
    batches = random_streams(ops)
    whole = build(batches, mode)
    pieces = [build(bs, mode) for bs in split(batches, 4, 2)]
    with served(pieces) as remotes:
        fan = ShardedIndex(remotes)
        assert fan.workers() == ShardedIndex(pieces).workers()
        cands = [*fan.workers(), WorkerKey("nobody")]
        requests = [None, HashRequest(drop_last_token=False), HashRequest(lora_id=3)]
        if mode == "tokens":
            mm = ((("img-1", 0), (b"\x01" * 32, 2)), None)
            requests.append(HashRequest(cache_salt="s", mm_keys=mm))
        for r in REQUESTS[:4]:
            for req in requests:
                assert fan.match(r, request=req, workers=cands) == whole.match(
                    r, request=req, workers=cands
                )
        cfg = RouterConfig(overlap_weight=2.0)
        one, many = Router(whole, fan.workers(), cfg), sharded_router(fan, None, cfg)
        for r in REQUESTS:
            assert decision(many.route(r)) == decision(one.route(r))


def test_remote_shard_errors() -> None:
    a = build(_stored("a"), "engine")
    b = build(_stored("b", algo="v2_sha256_64"), "engine")
    with served([a, b]) as remotes:
        fan = ShardedIndex(remotes)
        with pytest.raises(HashConfigMismatchError, match="worker b/-"):
            sharded_router(fan, config=RouterConfig(hash_algo="blake3_64")).check()
        # the server answers garbage with an error and keeps serving
        sock = socket.create_connection(("127.0.0.1", remotes[0].port), 5)
        with sock:
            sock.sendall(struct.pack(">I", 3) + b"{x}")
            n = struct.unpack(">I", sock.recv(4))[0]
            reply = json.loads(sock.recv(n))
        assert reply["ok"] is False
        assert fan.match(REQUESTS[0]).matches[0].matched_blocks == 4
        port = remotes[1].port
    with pytest.raises(ShardUnavailableError):
        RemoteShard("127.0.0.1", port, timeout_s=1).match(REQUESTS[0])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["kafka://127.0.0.1:1/t", "--shard", "4/4"], "K/N"),
        (["kafka://127.0.0.1:1/t", "--shard", "0/2", "--listen", "nowhere"], "HOST:PORT"),
        (["kafka://127.0.0.1:1/t?shard=0/2", "--shard", "0/2"], "not in the URL"),
        (["/some/dir", "--shard", "0/2"], "kafka://"),
        (["kafka://127.0.0.1:1/t"], "exactly one"),
        (["kafka://127.0.0.1:1/t", "--shard", "0/2", "--group-id", "g"], "exactly one"),
    ],
)
def test_shard_command_rejects_bad_arguments(args: list[str], says: str) -> None:
    from typer.testing import CliRunner

    from kvstream.cli.main import app

    result = CliRunner().invoke(app, ["shard", *args])
    assert result.exit_code == 2, result.output
    assert says in result.output


def test_a_shard_that_stops_answering_leaves_its_workers_untrusted() -> None:
    a = build(_stored("a"), "engine")
    b = build(_stored("b"), "engine")
    with served([a, b]) as remotes:
        fan = ShardedIndex(remotes)
        strict = ShardedIndex(remotes, tolerate_unavailable=False)
        assert [m.matched_blocks for m in fan.match(REQUESTS[0])] == [4, 4]
        dead = RemoteShard("127.0.0.1", remotes[1].port, timeout_s=1)
        dead.workers()
    # the servers are gone: `dead` knows b but cannot reach it; a local shard still answers
    fan = ShardedIndex([a, dead])
    res = fan.match(REQUESTS[0])
    assert res.matches[0].matched_blocks == 4
    gone = res.matches[1]
    assert gone.worker == WorkerKey("b")
    assert not gone.trusted
    assert gone.note.startswith("shard unavailable")
    assert sharded_router(fan).route(REQUESTS[0]).worker == WorkerKey("a")
    with pytest.raises(ShardUnavailableError):
        strict.match(REQUESTS[0])


def test_fan_out_reads_every_reply_before_raising() -> None:
    a = build(_stored("a", algo="v2_sha256_64"), "engine")
    b = build(_stored("b"), "engine")
    with served([a, b]) as remotes:
        fan = ShardedIndex(remotes)
        with pytest.raises(HashConfigMismatchError):
            fan.match(REQUESTS[0], hash_algo="blake3_64")
        # both connections are still in step: the next answers are this request's (a reply
        # left unread would answer it with the previous request's 4 blocks)
        res = fan.match(REQUESTS[1])
        assert [m.matched_blocks for m in res] == [2, 2]


@pytest.mark.parametrize(
    "reply",
    [b"[1, 2]", b'{"ok": true, "num_tokens": 3, "matches": [[1]]}', b'{"ok": true}', b"{no"],
)
def test_remote_shard_rejects_a_malformed_reply(reply: bytes) -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1 << 20)
            conn.sendall(struct.pack(">I", len(reply)) + reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        remote = RemoteShard("127.0.0.1", listener.getsockname()[1], timeout_s=5)
        with pytest.raises(ShardUnavailableError):
            remote.match(REQUESTS[0], workers=[("a", None)])
        remote.close()
    finally:
        thread.join(5)
        listener.close()


# ---------------------------------------------------------------------- the real broker

PARTS = 4
NAMES = [f"node-{i}" for i in range(8)]


def fleet() -> dict[str, Producer]:
    return {name: Producer(name, algo="v2_sha256_64") for name in NAMES}


def tail(name: str, i: int) -> list[int]:
    return tokens(12, seed=zlib.crc32(f"{name}:{i}".encode()) % 1000)


def events(ps: dict[str, Producer], rounds: range, created: bool) -> list[EventBatch]:
    out = []
    for name, p in ps.items():
        if created:
            out.append(p.batch(p.created()))
        for i in rounds:
            hs = p.chain(tokens(8, seed=1) + tail(name, i))
            out.append(p.batch(p.stored(hs)))
            if i % 3 == 2:
                out.append(p.batch(p.removed(hs[3:][::-1])))
    return out


async def publish(env: KafkaEnv, topic: str, batches: list[EventBatch]) -> None:
    sink = KafkaSink(env.bootstrap, topic, request_timeout_ms=3000)
    try:
        assert (await sink.export(batches)).ok
    finally:
        await sink.shutdown(5)


async def run_to_end(consumer: IndexConsumer, **kw: Any) -> None:
    async with consumer.source:
        report = await asyncio.wait_for(consumer.run(**kw), 60)
    assert report.ended or kw.get("max_batches")


pytest_kafka = pytest.mark.kafka


@pytest_kafka
async def test_shards_read_their_partitions_and_fan_out_like_one_index(kafka: KafkaEnv) -> None:
    topic = kafka.topic("idx-shards")
    await create_topic(kafka.broker.bootstrap, topic, PARTS)
    batches = events(fleet(), range(6), created=True)
    await publish(kafka, topic, batches)
    whole = build(batches, "engine")
    pieces = []
    sources = [
        KafkaSource(kafka.bootstrap, topic, shard=s, stop_at_end=True) for s in ShardSpec.all(2)
    ]
    consumers = [IndexConsumer(s) for s in sources]
    await asyncio.gather(*(run_to_end(c) for c in consumers))
    for spec, c in zip(ShardSpec.all(2), consumers, strict=True):
        pieces.append(c.index)
        ckpt = c.source.checkpoint()
        assert ckpt["shard"] == str(spec)
        assert ckpt["num_partitions"] == PARTS
        assert {int(p) for p in ckpt["offsets"]} <= set(spec.partitions(PARTS))
        assert all(spec.owns_worker(w, PARTS) for w in c.index.workers())
    assert union_state(pieces) == whole.canonical_state()
    fan = ShardedIndex(pieces)
    for name in NAMES:
        q = tokens(8, seed=1) + tail(name, 5)
        assert fan.match(q, workers=fan.workers()) == whole.match(q, workers=fan.workers())
    url = f"kafka://{kafka.bootstrap}/{topic}?shard=1/2"
    src = open_source(url)
    assert isinstance(src, KafkaSource)
    assert src.shard == ShardSpec(1, 2)
    with pytest.raises(ConfigError):
        KafkaSource(kafka.bootstrap, topic, shard="0/2", partitions=[0])
    bad = KafkaSource(kafka.bootstrap, topic, shard="5/8", stop_at_end=True)
    try:
        with pytest.raises(SourceError, match="owns none"):
            await bad.start()
    finally:
        await bad.aclose()


@pytest_kafka
async def test_replica_from_snapshot_and_offsets_equals_a_rebuild(
    kafka: KafkaEnv, tmp_path: Path
) -> None:
    topic = kafka.topic("idx-replica")
    await create_topic(kafka.broker.bootstrap, topic, PARTS)
    ps = fleet()
    first = events(ps, range(4), created=True)
    await publish(kafka, topic, first)
    snap = tmp_path / "shard1.snap"
    primary = open_shard(snap, kafka.bootstrap, topic, "1/2", stop_at_end=True)
    await run_to_end(primary)
    await primary.snapshot()
    await publish(kafka, topic, events(ps, range(4, 9), created=False))

    replica = open_shard(snap, kafka.bootstrap, topic, "1/2", stop_at_end=True)
    assert replica.index.canonical_state() == primary.index.canonical_state()
    await run_to_end(replica)
    rebuilt = open_shard(tmp_path / "fresh.snap", kafka.bootstrap, topic, "1/2", stop_at_end=True)
    await run_to_end(rebuilt)
    assert rebuilt.batches > replica.batches > 0
    assert replica.index.canonical_state() == rebuilt.index.canonical_state()
    assert load_snapshot(snap).meta["shard"] == "1/2"

    # a snapshot only resumes its own shard, with the partition count it was taken with
    with pytest.raises(SourceError, match="cannot resume shard 0/2"):
        open_shard(snap, kafka.bootstrap, topic, "0/2")
    ckpt = dict(load_snapshot(snap).positions or {})
    with pytest.raises(SourceError, match="unsharded"):
        KafkaSource(kafka.bootstrap, topic, shard="1/2", resume_from={**ckpt, "shard": None})
    moved = KafkaSource(
        kafka.bootstrap, topic, shard="1/2", resume_from={**ckpt, "num_partitions": 8}
    )
    try:
        with pytest.raises(SourceError, match="rebuild the shards"):
            await moved.start()
    finally:
        await moved.aclose()


@pytest_kafka
@pytest.mark.slow
async def test_shard_processes_serve_the_router_and_snapshot_on_exit(
    kafka: KafkaEnv, tmp_path: Path
) -> None:
    """Two ``kvstream shard`` processes, one per shard: a router fans matches out to them
    over TCP and gets the unsharded index's answers; on SIGTERM each snapshots its index with
    its offsets, and the snapshots together hold the unsharded index."""
    topic = kafka.topic("idx-procs")
    await create_topic(kafka.broker.bootstrap, topic, PARTS)
    batches = events(fleet(), range(5), created=True)
    await publish(kafka, topic, batches)
    whole = build(batches, "engine")
    url = f"kafka://{kafka.bootstrap}/{topic}"
    procs = []
    try:
        for spec in ShardSpec.all(2):
            snap = tmp_path / f"shard{spec.shard}.snap"
            cmd = [KVSTREAM, "shard", url, "--shard", str(spec), "--snapshot", str(snap)]
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            procs.append((snap, proc))
        remotes = []
        for _, proc in procs:
            assert proc.stdout is not None
            line = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
            host, port = line["listening"].rsplit(":", 1)
            remotes.append(RemoteShard(host, int(port), timeout_s=10))
        fan = ShardedIndex(remotes)
        cands = sorted(whole.workers())
        queries = [tokens(8, seed=1) + tail(name, i) for name in NAMES for i in (0, 4)]

        def answers(index: Any) -> list[Any]:
            return [index.match(q, workers=cands) for q in queries]

        want = answers(whole)
        for _ in range(300):  # until both processes have read their partitions to the end
            got = await asyncio.to_thread(answers, fan)
            if got == want:
                break
            await asyncio.sleep(0.1)
        assert got == want
        one = Router(whole, cands, RouterConfig(overlap_weight=2.0))
        many = sharded_router(fan, None, RouterConfig(overlap_weight=2.0))
        for q in queries:
            assert decision(await asyncio.to_thread(many.route, q)) == decision(one.route(q))
        for r in remotes:
            r.close()
    finally:
        for _, proc in procs:
            if proc.returncode is None:
                proc.terminate()
    pieces = []
    for snap, proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert json.loads(out.splitlines()[-1])["snapshots"] >= 1
        pieces.append(load_snapshot(snap).index)
    assert union_state(pieces) == whole.canonical_state()


@pytest_kafka
@pytest.mark.slow
async def test_elastic_group_shards_hand_partitions_over(kafka: KafkaEnv, tmp_path: Path) -> None:
    """Consumer-group members as index shards: a member joining takes partitions with their
    workers (rebuilt from the start), the one giving them up forgets them; together they
    always converge to the unsharded index, and the survivor of a leave holds it all."""
    topic = kafka.topic("idx-elastic")
    await create_topic(kafka.broker.bootstrap, topic, PARTS)
    ps = fleet()
    batches = events(ps, range(4), created=True)
    await publish(kafka, topic, batches)
    group = f"{topic}-shards"

    def member(name: str) -> tuple[IndexConsumer, asyncio.Event, asyncio.Task[Any]]:
        c = open_group_shard(tmp_path / f"{name}.snap", kafka.bootstrap, topic, group)
        stop = asyncio.Event()

        async def go() -> Any:
            async with c.source:
                return await c.run(stop=stop)

        return c, stop, asyncio.ensure_future(go())

    async def until(cond: Any, what: str, members: list[IndexConsumer]) -> None:
        for _ in range(600):
            if cond():
                return
            await asyncio.sleep(0.1)
        state = [
            (
                {str(w): m.index.info(w).stale_reason for w in m.index.workers()},
                m.source.checkpoint(),
                m.source.stats.as_dict(),
            )
            for m in members
        ]
        raise AssertionError(f"timed out waiting for {what}: {state}")

    def split_is_whole(members: list[IndexConsumer], want: PrefixIndex) -> bool:
        states = [m.index.canonical_state() for m in members]
        if any(not s for s in states) or sum(map(len, states)) != len(want.workers()):
            return False
        return union_state([m.index for m in members]) == want.canonical_state()

    whole = build(batches, "engine")
    a, stop_a, run_a = member("a")
    try:
        await until(lambda: split_is_whole([a], whole), "the first member to read all", [a])
        b, stop_b, run_b = member("b")
        try:
            await until(lambda: split_is_whole([a, b], whole), "the two to split", [a, b])
            for m in (a, b):
                owned = {tp.partition for tp in m.source._consumer.assignment()}  # type: ignore[attr-defined]
                assert {worker_partition(w, PARTS) for w in m.index.workers()} <= owned
                assert {int(p) for p in m.source.checkpoint()["offsets"]} <= owned
            fan = ShardedIndex([a.index, b.index])
            q = tokens(8, seed=1) + tail(NAMES[0], 3)
            assert fan.match(q, workers=fan.workers()) == whole.match(q, workers=fan.workers())
        finally:
            stop_b.set()
            await asyncio.wait_for(run_b, 30)
        assert load_snapshot(tmp_path / "b.snap").meta["group_id"] == group
        more = events(ps, range(4, 6), created=False)
        await publish(kafka, topic, more)
        whole = build(batches + more, "engine")
        await until(lambda: split_is_whole([a], whole), "the survivor to hold all", [a])
    finally:
        stop_a.set()
        await asyncio.wait_for(run_a, 30)

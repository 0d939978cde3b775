"""Index shards (docs/scaling.md): partition by worker, shards of partitions, the fan-out.

Property tests: on random streams (gaps, lost markers, clears, restarts, duplicates, orphans)
split by the Kafka sink's partitioner, the shards together hold exactly the unsharded index's
state, and the fan-out answers every match and routing decision exactly as one unsharded
index. Against the real broker: shards reading their partitions (in-process and as
``kvstream index`` processes), and a replica restored from a snapshot plus offsets.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import json
import socket
import subprocess
import sys
import tempfile
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
from serve_support import eventually

from kvstream._types import TokenIds
from kvstream.errors import ConfigError
from kvstream.events.model import EventBatch
from kvstream.index import (
    HashConfigMismatchError,
    HashRequest,
    IndexConsumer,
    KeyMode,
    PrefixIndex,
    Router,
    RouterConfig,
    SourceError,
    WorkerKey,
    load_snapshot,
    open_source,
)
from kvstream.index.shards import (
    ShardedIndex,
    ShardSpec,
    ShardUnavailableError,
    open_group_shard,
    open_shard,
    sharded_router,
    worker_partition,
)
from kvstream.index.sources.kafka import KafkaSource
from kvstream.serve import (
    Client,
    ConflictError,
    IndexService,
    InvalidRequestError,
    NotFoundError,
    ServeConfig,
)
from kvstream.serve.config import parse_source
from kvstream.serve.models import ModelIndex, ModelKey
from kvstream.serve.shards import RemoteShard
from kvstream.serve.snapshot import encode_service_snapshot, read_snapshot

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
def services(
    indexes: list[PrefixIndex], tmp: Path, **settings: Any
) -> Iterator[list[IndexService]]:
    """Each index served by an index service on a loopback port (restored from a service
    snapshot holding it as the ``default`` model; ``settings`` for its ServeConfig), on an
    event loop in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started: list[IndexService] = []
    try:
        for i, idx in enumerate(indexes):
            model = ModelIndex(ModelKey("default", "default"), TPB, idx.key_mode)
            model.index = idx
            snap = tmp / f"shard{i}.snap"
            snap.write_bytes(encode_service_snapshot([(model, {})]))
            cfg = ServeConfig(port=0, snapshot=snap, snapshot_every_s=None, **settings)
            svc = IndexService(cfg)
            asyncio.run_coroutine_threadsafe(svc.start(), loop).result(30)
            started.append(svc)
        yield started
    finally:
        for svc in started:
            asyncio.run_coroutine_threadsafe(svc.aclose(snapshot=False), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def served(indexes: list[PrefixIndex], tmp: Path) -> Iterator[list[RemoteShard]]:
    """A :class:`RemoteShard` of each index, served by an index service (:func:`services`)."""
    with services(indexes, tmp) as svcs:
        remotes = [RemoteShard(svc.url, timeout_s=10) for svc in svcs]
        try:
            yield remotes
        finally:
            for r in remotes:
                r.close()


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
    with tempfile.TemporaryDirectory() as tmp, served(pieces, Path(tmp)) as remotes:
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


def test_match_endpoint(tmp_path: Path) -> None:
    """``POST /match`` over plain HTTP: rows in candidate order, the model's workers, and
    errors as the API's JSON (409 for a hash mismatch, 422 for a bad body, 404 for an
    unknown model); Dynamo's ``/query`` refuses an engine-keyed model (409)."""
    a = build(_stored("a") + _stored("b", rank=1), "engine")
    with services([a], tmp_path) as (svc,):
        c = Client(svc.url)
        body = {"token_ids": REQUESTS[0], "workers": [["b", 1], ["a", None], ["x", None]]}
        got = c.call("POST", "/match", body)
        assert got["workers"] == [["a", None], ["b", 1]]
        assert got["num_tokens"] == len(REQUESTS[0])
        rows = got["matches"]
        assert [(r["instance_id"], r["dp_rank"], r["matched_blocks"]) for r in rows] == [
            ("b", 1, 4),
            ("a", None, 4),
            ("x", None, 0),
        ]
        assert rows[0]["trusted"]
        assert rows[0]["hash_algo"] == "blake3_64"
        assert rows[2]["note"] == "unknown worker"
        with pytest.raises(ConflictError, match="worker a/-"):
            c.call("POST", "/match", {"token_ids": REQUESTS[0], "hash_algo": "v2_sha256_64"})
        raw = base64.b64encode(TokenIds(REQUESTS[0]).raw).decode()
        assert c.call("POST", "/match", {"tokens": raw, "workers": body["workers"]}) == got
        for bad in (
            {"token_ids": [-1]},
            {"tokens": "AAA="},
            {"token_ids": [1], "tokens": ""},
            {"token_ids": [1], "tier_weights": []},
        ):
            with pytest.raises(InvalidRequestError):
                c.call("POST", "/match", bad)
        with pytest.raises(NotFoundError):
            c.call("POST", "/match", {"token_ids": [1], "model_name": "other"})
        with pytest.raises(ConflictError, match="use /match or /route"):
            c.query(REQUESTS[0])
        assert c.route(REQUESTS[0])["instance_id"] in ("a", "b")
        c.close()


def test_source_key_mode_and_elastic_options(tmp_path: Path) -> None:
    spec = parse_source("kafka://h:1/t?shard=0/2&key_mode=engine&block_size=4")
    assert (spec.key_mode, spec.block_size, spec.elastic) == (KeyMode.ENGINE, 4, False)
    assert "key_mode" not in spec.url
    assert parse_source("/some/dir").key_mode is KeyMode.DYNAMO
    assert parse_source("kafka://h:1/t?group_id=g&elastic=1").elastic
    with pytest.raises(ConfigError, match="unknown key mode"):
        parse_source("kafka://h:1/t?key_mode=nope")
    with pytest.raises(ConfigError, match="needs a Kafka group_id"):
        parse_source("kafka://h:1/t?elastic=1")

    # a snapshot's model keeps its key mode: a source of another mode does not start on it
    model = ModelIndex(ModelKey("default", "default"), TPB, "engine")
    snap = tmp_path / "svc.snap"
    snap.write_bytes(encode_service_snapshot([(model, {})]))
    (state,) = read_snapshot(snap) or []
    assert state.model.key_mode is KeyMode.ENGINE
    source = f"{tmp_path / 'events'}?key_mode=tokens&block_size={TPB}"
    svc = IndexService(ServeConfig(port=0, snapshot=snap, sources=[source]))
    with pytest.raises(ConfigError, match="key_mode mismatch"):
        asyncio.run(svc.start())


def test_remote_shard_errors(tmp_path: Path) -> None:
    a = build(_stored("a"), "engine")
    b = build(_stored("b", algo="v2_sha256_64"), "engine")
    with services([a, b], tmp_path) as svcs:
        remotes = [RemoteShard(s.url, timeout_s=10) for s in svcs]
        fan = ShardedIndex(remotes)
        with pytest.raises(HashConfigMismatchError, match="worker b/-"):
            sharded_router(fan, config=RouterConfig(hash_algo="blake3_64")).check()
        # the service answers garbage with an error and keeps serving
        with Client(svcs[0].url) as c:
            status, data = c.request_raw("POST", "/match", b"{x}")
        assert status == 400
        assert json.loads(data)["type"] == "BadRequestError"
        assert fan.match(REQUESTS[0]).matches[0].matched_blocks == 4
        for r in remotes:
            r.close()
        url = svcs[1].url
    with pytest.raises(ShardUnavailableError):
        RemoteShard(url, timeout_s=1).match(REQUESTS[0])
    with (
        services([a], tmp_path) as (svc,),
        RemoteShard(svc.url, model_name="other") as other,
        pytest.raises(ShardUnavailableError, match="HTTP 404"),
    ):
        other.workers()
    with pytest.raises(ConfigError, match="http://HOST:PORT"):
        RemoteShard("127.0.0.1:80")


def test_remote_shard_with_a_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    a = build(_stored("a"), "engine")
    with services([a], tmp_path, auth_token_file=token) as (svc,):
        with RemoteShard(svc.url, token="s3cret") as good:
            assert good.match(REQUESTS[0]).matches[0].matched_blocks == 4
        for wrong in (None, "nope"):
            with RemoteShard(svc.url, token=wrong) as bad, pytest.raises(ConfigError, match="401"):
                bad.workers()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["kafka://127.0.0.1:1/t", "--shard", "4/4"], "K/N"),
        (["kafka://127.0.0.1:1/t", "--shard", "0/2", "--listen", "nowhere"], "HOST:PORT"),
        (["kafka://127.0.0.1:1/t?shard=0/2", "--shard", "0/2"], "not in the URL"),
        (["/some/dir", "--shard", "0/2"], "kafka://"),
        (["kafka://127.0.0.1:1/t"], "exactly one"),
        (["kafka://127.0.0.1:1/t", "--shard", "0/2", "--group-id", "g"], "exactly one"),
        (["kafka://127.0.0.1:1/t", "--shard", "0/2", "--key-mode", "nope"], "key mode"),
        (["kafka://127.0.0.1:1/t", "--shard", "0/2", "--key-mode", "dynamo"], "--block-size"),
    ],
)
def test_shard_command_rejects_bad_arguments(args: list[str], says: str) -> None:
    from typer.testing import CliRunner

    from kvstream.cli.main import app

    result = CliRunner().invoke(app, ["shard", *args])
    assert result.exit_code == 2, result.output
    assert says in result.output


def test_a_shard_that_stops_answering_leaves_its_workers_untrusted(tmp_path: Path) -> None:
    a = build(_stored("a"), "engine")
    b = build(_stored("b"), "engine")
    with served([a, b], tmp_path) as remotes:
        fan = ShardedIndex(remotes)
        strict = ShardedIndex(remotes, tolerate_unavailable=False)
        assert [m.matched_blocks for m in fan.match(REQUESTS[0])] == [4, 4]
        dead = RemoteShard(remotes[1].url, timeout_s=1)
        dead.workers()
    # the services are gone: `dead` knows b but cannot reach it; a local shard still answers
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


def test_fan_out_reads_every_reply_before_raising(tmp_path: Path) -> None:
    a = build(_stored("a", algo="v2_sha256_64"), "engine")
    b = build(_stored("b"), "engine")
    with served([a, b], tmp_path) as remotes:
        fan = ShardedIndex(remotes)
        with pytest.raises(HashConfigMismatchError):
            fan.match(REQUESTS[0], hash_algo="blake3_64")
        # both connections are still in step: the next answers are this request's (an
        # answer left unread would answer it with the previous request's 4 blocks)
        res = fan.match(REQUESTS[1])
        assert [m.matched_blocks for m in res] == [2, 2]


def test_remote_shard_reopens_a_connection_the_service_closed(tmp_path: Path) -> None:
    """A keep-alive connection the service dropped while idle (a restart, an idle timeout)
    is re-opened and the request sent again, on submit and on reading the answer."""
    a = build(_stored("a"), "engine")
    with served([a], tmp_path) as (remote,):
        assert remote.match(REQUESTS[0]).matches[0].matched_blocks == 4
        conn = remote._conn
        assert conn is not None
        assert conn.sock is not None
        conn.sock.shutdown(socket.SHUT_RDWR)  # as if the peer had closed it
        assert remote.match(REQUESTS[0]).matches[0].matched_blocks == 4


def test_fan_out_sends_to_every_shard_before_reading_any() -> None:
    """Each of two shards answers only once both have received their request (a barrier
    across the two servers), so a client that waited for one answer before sending the next
    request would never get one: the fan-out costs the slowest shard, not the sum."""
    barrier = threading.Barrier(2, timeout=20)

    class Both(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers["content-length"])))
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                self.send_error(503)
                return
            (inst, rank), *_ = req["workers"]
            row = {
                "instance_id": inst,
                "dp_rank": rank,
                "matched_blocks": 1,
                "weighted_blocks": 1.0,
                "request_blocks": 1,
                "tokens_per_block": TPB,
                "hash_algo": "blake3_64",
                "trusted": True,
            }
            body = json.dumps(
                {"num_tokens": 5, "matches": [row], "workers": [[inst, rank]]}
            ).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    servers = [http.server.HTTPServer(("127.0.0.1", 0), Both) for _ in range(2)]
    threads = [threading.Thread(target=s.handle_request, daemon=True) for s in servers]
    for t in threads:
        t.start()
    remotes = [RemoteShard(f"http://127.0.0.1:{s.server_address[1]}") for s in servers]
    for r, name in zip(remotes, "ab", strict=True):  # what a worker list would have said
        r._workers, r._seen = [WorkerKey(name)], float("inf")
    try:
        res = ShardedIndex(remotes, tolerate_unavailable=False).match(REQUESTS[0][:5])
        assert [(m.worker, m.matched_blocks) for m in res] == [
            (WorkerKey("a"), 1),
            (WorkerKey("b"), 1),
        ]
    finally:
        for r in remotes:
            r.close()
        for t in threads:
            t.join(30)
        for s in servers:
            s.server_close()


@pytest.mark.parametrize(
    "reply",
    [
        b"[1, 2]",
        b'{"num_tokens": 3, "matches": [[1]], "workers": []}',
        b'{"num_tokens": 3}',
        b"{no",
    ],
)
def test_remote_shard_rejects_a_malformed_reply(reply: bytes) -> None:
    class Garbage(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Garbage)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    try:
        remote = RemoteShard(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=5)
        with pytest.raises(ShardUnavailableError, match="malformed"):
            remote.match(REQUESTS[0], workers=[("a", None)])
        remote.close()
    finally:
        thread.join(5)
        server.server_close()


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
async def test_services_on_kafka_shards_fan_out_like_one_index(kafka: KafkaEnv) -> None:
    """Two index services, each reading its shard of the topic (``?shard=K/2&key_mode=
    engine``): a router fanning out to them over HTTP decides as one unsharded index, follows
    what is published later, and carries on without a service that went down (its workers
    untrusted), or raises ShardUnavailableError when told not to tolerate it."""
    topic = kafka.topic("idx-svc")
    await create_topic(kafka.broker.bootstrap, topic, PARTS)
    ps = fleet()
    batches = events(ps, range(4), created=True)
    await publish(kafka, topic, batches)
    svcs = []
    for spec in ShardSpec.all(2):
        url = f"kafka://{kafka.bootstrap}/{topic}?shard={spec}&key_mode=engine&block_size={TPB}"
        svcs.append(await IndexService(ServeConfig(port=0, sources=[url])).__aenter__())
    remotes = [RemoteShard(svc.url, timeout_s=10, refresh_s=0) for svc in svcs]
    try:
        fan = ShardedIndex(remotes)
        queries = [tokens(8, seed=1) + tail(name, i) for name in NAMES for i in (0, 3, 5)]

        def same_as(whole: PrefixIndex) -> bool:
            cands = sorted(whole.workers())
            if fan.workers() != cands:
                return False
            for q in queries:
                if fan.match(q, workers=cands) != whole.match(q, workers=cands):
                    return False
            one = Router(whole, cands, RouterConfig(overlap_weight=2.0))
            many = sharded_router(fan, None, RouterConfig(overlap_weight=2.0))
            return all(decision(many.route(q)) == decision(one.route(q)) for q in queries)

        await eventually(lambda: same_as(build(batches, "engine")), 60)
        await eventually(lambda: all(svc.ready()[0] for svc in svcs), 30)
        for spec, svc in zip(ShardSpec.all(2), svcs, strict=True):
            (m,) = svc.models()
            assert m.index.workers()
            assert m.key_mode.value == "engine"
            assert all(spec.owns_worker(w, PARTS) for w in m.index.workers())
        more = events(ps, range(4, 6), created=False)
        await publish(kafka, topic, more)
        await eventually(lambda: same_as(build(batches + more, "engine")), 60)

        lost = set(await asyncio.to_thread(remotes[1].workers))
        down = svcs.pop()
        await down.aclose()
        res = await asyncio.to_thread(fan.match, queries[0])
        assert {m.worker for m in res if not m.trusted} == lost
        assert all(m.note.startswith("shard unavailable") for m in res if m.worker in lost)
        assert all(m.trusted for m in res if m.worker not in lost)
        routed = await asyncio.to_thread(sharded_router(fan).route, queries[0])
        assert routed.worker not in lost
        strict = ShardedIndex(remotes, tolerate_unavailable=False)
        with pytest.raises(ShardUnavailableError):
            await asyncio.to_thread(strict.match, queries[0])
    finally:
        for r in remotes:
            r.close()
        for svc in svcs:
            await svc.aclose()


@pytest_kafka
@pytest.mark.slow
async def test_shard_processes_serve_the_router_and_snapshot_on_exit(
    kafka: KafkaEnv, tmp_path: Path
) -> None:
    """Two ``kvstream shard`` processes, one per shard: a router fans matches out to them
    over HTTP and gets the unsharded index's answers; on SIGTERM each snapshots its index
    with its offsets, and the snapshots together hold the unsharded index; a snapshot of
    one shard does not start the other."""
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
                *cmd, "--block-size", str(TPB), stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            procs.append((snap, proc))
        remotes = []
        for _, proc in procs:
            assert proc.stdout is not None
            line = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
            assert line["url"] == f"http://{line['listening']}"
            remotes.append(RemoteShard(line["url"], timeout_s=10, refresh_s=0))
        fan = ShardedIndex(remotes)
        cands = sorted(whole.workers())
        queries = [tokens(8, seed=1) + tail(name, i) for name in NAMES for i in (0, 4)]

        def answers(index: Any) -> list[Any]:
            return [index.match(q, workers=cands) for q in queries]

        want = answers(whole)
        await eventually(lambda: answers(fan) == want, 60)
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
        (state,) = read_snapshot(snap) or []
        assert len(state.positions) == 1
        pieces.append(state.model.index)
    assert union_state(pieces) == whole.canonical_state()
    wrong = await asyncio.create_subprocess_exec(
        *[KVSTREAM, "shard", url, "--shard", "0/2", "--block-size", str(TPB)],
        *["--snapshot", str(procs[1][0]), "--no-follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(wrong.communicate(), 60)
    assert wrong.returncode == 2
    assert b"give this shard its own snapshot" in err


@pytest_kafka
@pytest.mark.slow
async def test_elastic_shard_services_follow_their_group(kafka: KafkaEnv) -> None:
    """Index services as members of one consumer group (``?group_id=G&elastic=1``): the
    first holds every worker; when a second joins, the first forgets the workers of the
    partitions it gave up, and the fan-out over both answers as the unsharded index."""
    topic = kafka.topic("idx-svc-elastic")
    await create_topic(kafka.broker.bootstrap, topic, PARTS)
    batches = events(fleet(), range(4), created=True)
    await publish(kafka, topic, batches)
    whole = build(batches, "engine")
    url = (
        f"kafka://{kafka.bootstrap}/{topic}?group_id={topic}-g&elastic=1"
        f"&key_mode=engine&block_size={TPB}"
    )
    svcs = [await IndexService(ServeConfig(port=0, sources=[url])).__aenter__()]
    remotes: list[RemoteShard] = []
    try:
        (first,) = svcs[0].models()
        await eventually(lambda: first.index.canonical_state() == whole.canonical_state(), 60)
        svcs.append(await IndexService(ServeConfig(port=0, sources=[url])).__aenter__())
        (second,) = svcs[1].models()

        def split() -> bool:
            states = [first.index.canonical_state(), second.index.canonical_state()]
            return all(states) and union_state([first.index, second.index]) == (
                whole.canonical_state()
            )

        await eventually(split, 90)
        remotes = [RemoteShard(svc.url, timeout_s=10, refresh_s=0) for svc in svcs]
        fan = ShardedIndex(remotes)
        cands = sorted(whole.workers())
        for name in NAMES:
            q = tokens(8, seed=1) + tail(name, 3)
            got = await asyncio.to_thread(fan.match, q, workers=cands)
            assert got == whole.match(q, workers=cands)
    finally:
        for r in remotes:
            r.close()
        for svc in svcs:
            await svc.aclose()


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

"""``kvstream serve`` fed by Kafka (the real tansu broker) and by file-sink directories.

Two full replicas read one topic. One is killed (no last snapshot: its periodic one is all
it keeps); the other goes on answering. The killed one restarts from its snapshot, resumes
from the stored offsets, and reports ready only once it has caught up: its first answers
after ``/ready`` says true already include everything published while it was down.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
from conftest_kafka import KafkaEnv
from kafka_broker import create_topic
from kvstream.sinks.file import FileSink
from kvstream.sinks.kafka import KafkaSink
from serve_support import eventually

from kvstream.events.model import EventBatch, KVCacheEvent, Removed, SourceId, Stored, StoredBlock
from kvstream.hashing import get_hasher, split_blocks
from kvstream.serve import Client, IndexService, ServeConfig

BS = 4
ALGO = "blake3_64"


class Worker:
    """A kvstream-instrumented engine: stored chains with real tokens, leaf evictions."""

    def __init__(self, name: str, rng: random.Random) -> None:
        self.source = SourceId(instance_id=name, attention_dp_rank=0, incarnation=1)
        self.rng = rng
        self.next_id = 0
        self.hasher = get_hasher(ALGO)
        self.held: dict[bytes, bytes | None] = {}
        self.paths: dict[bytes, int] = {}

    def _batch(self, data: Any) -> EventBatch:
        ev = KVCacheEvent(
            event_id=self.next_id, hash_algo=ALGO, layer_group_id=0, window_size=1 << 20, data=data
        )
        self.next_id += 1
        return EventBatch(source=self.source, ts_ns=1, events=[ev])

    def store(self, tokens: list[int]) -> EventBatch | None:
        blocks = split_blocks(tokens, BS)
        hashes = self.hasher.chain_bytes(blocks)
        start = 0
        while start < len(hashes) and hashes[start] in self.held:
            start += 1
        if start == len(hashes):
            return None
        for i in range(start, len(hashes)):
            self.held[hashes[i]] = hashes[i - 1] if i else None
        return self._batch(
            Stored(
                parent_hash=hashes[start - 1] if start else None,
                blocks=tuple(
                    StoredBlock(block_hash=h, token_ids=b)
                    for h, b in zip(hashes[start:], blocks[start:], strict=True)
                ),
            )
        )

    def evict(self, n: int) -> EventBatch | None:
        parents = {p for p in self.held.values() if p is not None}
        leaves = [h for h in self.held if h not in parents][:n]
        for h in leaves:
            del self.held[h]
        return self._batch(Removed(block_hashes=tuple(leaves))) if leaves else None

    def depth(self, tokens: list[int]) -> int:
        hashes = self.hasher.chain_bytes(split_blocks(tokens, BS)[: len(tokens) // BS])
        d = 0
        while d < len(hashes) and hashes[d] in self.held:
            d += 1
        return d


def traffic(
    workers: list[Worker], rng: random.Random, n: int
) -> tuple[list[EventBatch], list[list[int]]]:
    systems = [[rng.randrange(50_000) for _ in range(BS * 4)] for _ in range(3)]
    batches: list[EventBatch] = []
    prompts: list[list[int]] = []
    for _ in range(n):
        w = rng.choice(workers)
        p = rng.choice(systems) + [rng.randrange(50_000) for _ in range(BS * rng.randrange(1, 5))]
        prompts.append(p)
        for b in (w.store(p), w.evict(2) if rng.random() < 0.3 else None):
            if b is not None:
                batches.append(b)
    return batches, prompts


def expected(workers: list[Worker], tokens: list[int]) -> dict[str, dict[str, int]]:
    return {w.source.instance_id: {"0": w.depth(tokens) * BS} for w in workers if w.depth(tokens)}


async def publish(env: KafkaEnv, topic: str, batches: list[EventBatch]) -> None:
    sink = KafkaSink(env.bootstrap, topic, request_timeout_ms=5000)
    try:
        assert (await sink.export(batches)).ok
    finally:
        await sink.shutdown(5)


pytestmark = pytest.mark.kafka


async def test_two_kafka_fed_replicas_survive_a_kill_and_resume(
    kafka: KafkaEnv, tmp_path: Path
) -> None:
    topic = kafka.topic("serve")
    await create_topic(kafka.broker.bootstrap, topic, 2)
    rng = random.Random(4)
    workers = [Worker(f"w{i}", rng) for i in range(4)]
    first, prompts1 = traffic(workers, rng, 40)
    await publish(kafka, topic, first)
    source = f"kafka://{kafka.bootstrap}/{topic}?block_size={BS}&model_name=m"

    def cfg(name: str) -> ServeConfig:
        return ServeConfig(
            port=0, sources=(source,), snapshot=tmp_path / f"{name}.snap", snapshot_every_s=0.3
        )

    a = IndexService(cfg("a"))
    await a.start()
    try:
        async with IndexService(cfg("b")) as b:
            ca, cb = Client(a.url), Client(b.url)
            await eventually(lambda: ca.ready()["ready"] and cb.ready()["ready"], 30)
            metrics = await asyncio.to_thread(ca.metrics)
            assert "kvstream_serve_feed_records_behind{" in metrics
            assert 'kvstream_serve_feed_caught_up{feed="source:kafka://' in metrics
            for p in prompts1:
                want = expected(workers, p)
                assert (await asyncio.to_thread(ca.query, p, model_name="m"))["scores"] == want
                assert (await asyncio.to_thread(cb.query, p, model_name="m"))["scores"] == want
            await asyncio.sleep(0.8)  # a periodic snapshot with these offsets
            assert a.snapshots >= 1
            await a.aclose(snapshot=False)  # killed: only its periodic snapshot remains
            ca.close()
            second, prompts2 = traffic(workers, rng, 30)
            await publish(kafka, topic, second)
            probes = prompts1 + prompts2
            # the survivor answers alone
            await eventually(
                lambda: all(
                    cb.query(p, model_name="m")["scores"] == expected(workers, p) for p in probes
                ),
                30,
            )
            restarted = IndexService(cfg("a"))
            await restarted.start()
            try:
                assert restarted.restored_from == "snapshot"
                with Client(restarted.url) as cr:
                    await eventually(lambda: cr.ready()["ready"], 30)
                    for p in probes:  # ready means caught up: no waiting here
                        got = await asyncio.to_thread(cr.query, p, model_name="m")
                        assert got["scores"] == expected(workers, p)
            finally:
                await restarted.aclose()
            cb.close()
    finally:
        await a.aclose(snapshot=False)


async def test_a_file_sink_directory_feeds_the_service(tmp_path: Path) -> None:
    rng = random.Random(9)
    workers = [Worker(f"f{i}", rng) for i in range(2)]
    batches, prompts = traffic(workers, rng, 20)
    sink = FileSink(tmp_path / "events")
    await sink.start()
    assert (await sink.export(batches)).ok
    await sink.shutdown(5)
    cfg = ServeConfig(port=0, block_size=BS, sources=(str(tmp_path / "events"),))
    async with IndexService(cfg) as svc:
        with Client(svc.url) as c:
            await eventually(lambda: c.ready()["ready"])
            for p in prompts:
                assert (await asyncio.to_thread(c.query, p))["scores"] == expected(workers, p)
            workers_json = await asyncio.to_thread(c.workers)
            assert {w["instance_id"] for w in workers_json} == {"f0", "f1"}
            assert {w["source"] for w in workers_json} == {"stream"}

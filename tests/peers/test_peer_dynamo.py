"""Peer test: NVIDIA Dynamo's index and kvstream's ``PrefixIndex`` learn the same thing from the
same KV events (issue 11 §9). Skipped without ``ai-dynamo-runtime`` (``scripts/test-peers``).

How Python drives Dynamo 1.6.1 (``dynamo/_core.pyi``, checked by introspection):

- ``RadixTree().apply_event(worker_id, kv_cache_event_bytes)`` takes one ``KvCacheEvent`` as
  JSON bytes: ``{"event_id": u64, "data": D, "dp_rank": u32}`` with ``D`` one of
  ``{"stored": {"parent_hash": u64 | null, "blocks": [{"block_hash": u64, "tokens_hash":
  u64}]}}``, ``{"removed": {"block_hashes": [u64]}}`` or ``"cleared"``. ``block_hash`` is the
  engine's (external) hash, ``tokens_hash`` Dynamo's local hash of the block's tokens, which
  is what the tree navigates by. A store under an unknown parent or a removal of an unknown
  block raises ``RuntimeError`` (the rest of a removal is still applied).
- ``find_matches(local_hashes).scores`` maps ``(worker_id, dp_rank)`` to the number of leading
  blocks the worker holds (workers with none are absent).
- ``compute_block_hash_for_seq(tokens, block_size)`` returns one local hash per full block:
  XXH3-64 of the block's u32 LE tokens, seed 1337, not chained.
- ``python -m dynamo.indexer`` is Dynamo's standalone indexer: it SUBs to vLLM-format ZMQ
  publishers (``POST /register``), decodes them with Dynamo's ``zmq_wire`` code and answers
  ``POST /query`` (token ids, hashed by Dynamo) and ``GET /dump``.

kvstream is compared in both key modes: ``engine`` (the request is hashed with vLLM's
``sha256_cbor`` as the workers advertise) and ``tokens`` (canonical token keys, as Dynamo
navigates by token hashes). Requests are matched on all their tokens
(``drop_last_token=False``), as Dynamo's ``/query`` and ``find_matches`` do.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from dynamo_support import (
    ENGINE_ALGO,
    Fleet,
    StandaloneIndexer,
    flatten_dump,
    local_hashes,
    probes,
    router_events,
)
from zmq_clients import free_ports

from kvstream.engines.vllm_export import VllmExporter
from kvstream.engines.zmq_pub import ZmqPublisher, tcp_endpoint
from kvstream.events.model import (
    UNBOUNDED_WINDOW,
    Cleared,
    Created,
    EventBatch,
    EventData,
    KVCacheEvent,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
)
from kvstream.hashing import get_hasher, split_blocks
from kvstream.index import HashRequest, PrefixIndex

llm = pytest.importorskip("dynamo.llm")

pytestmark = pytest.mark.peers

BS = 16
MODES = ("engine", "tokens")
#: Match on every token of the request, as Dynamo does.
EXACT = HashRequest(drop_last_token=False)

Scores = dict[tuple[int, int], int]


class DynamoTree:
    """A Dynamo ``RadixTree`` fed kvstream batches through :func:`router_events`."""

    def __init__(self) -> None:
        self.tree = llm.RadixTree()
        self.next_id: dict[tuple[int, int], int] = {}
        self.errors: list[str] = []

    def apply(self, worker: int, batch: EventBatch) -> None:
        rank = batch.source.attention_dp_rank or 0
        for ev in batch.events:
            eid = self.next_id.get((worker, rank), 0)
            for rev in router_events(ev, BS, eid, rank):
                self.next_id[(worker, rank)] = eid + 1
                try:
                    self.tree.apply_event(worker, json.dumps(rev).encode())
                except RuntimeError as exc:  # ParentBlockNotFound / BlockNotFound
                    self.errors.append(str(exc))

    def scores(self, tokens: Sequence[int]) -> Scores:
        hashes = local_hashes(tokens, BS)
        if not hashes:
            return {}
        return {(w, r): n for (w, r), n in self.tree.find_matches(hashes).scores.items()}

    def dump(self) -> set[tuple[int, int, int | None, int, int]]:
        return flatten_dump(self.tree.dump_tree_as_events())


def worker_index(instance_id: str) -> int:
    return int(instance_id.removeprefix("w"))


def kv_scores(index: PrefixIndex, tokens: Sequence[int]) -> Scores:
    """Matched blocks per (worker, rank) in kvstream's index (workers with none left out)."""
    out: Scores = {}
    for m in index.match(list(tokens), request=EXACT):
        assert m.trusted, m.note
        if m.matched_blocks:
            out[(worker_index(m.worker.instance_id), m.worker.dp_rank or 0)] = m.matched_blocks
    return out


def present_blocks(index: PrefixIndex) -> dict[int, int]:
    """Blocks each worker holds with their whole chain (the matchable ones)."""
    return {
        worker_index(w.instance_id): table.rooted_count
        for w, _, table in index.tables()
        if table.rooted_count
    }


def dump_counts(dump: set[tuple[int, int, int | None, int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for w, *_ in dump:
        out[w] = out.get(w, 0) + 1
    return out


class Tally:
    """What the probes covered, so a scenario that stopped exercising anything fails."""

    def __init__(self) -> None:
        self.probes = 0
        self.matched = 0  # some worker holds a prefix
        self.shared = 0  # several workers hold a prefix
        self.uneven = 0  # several workers with different depths
        self.partial = 0  # the best worker holds part of the request only

    def add(self, tokens: Sequence[int], scores: Scores) -> None:
        self.probes += 1
        depths = [d for d in scores.values() if d]
        if not depths:
            return
        self.matched += 1
        self.shared += len(depths) > 1
        self.uneven += len(set(depths)) > 1
        self.partial += max(depths) < len(tokens) // BS

    def check(self, min_probes: int) -> None:
        assert self.probes >= min_probes
        assert self.matched >= self.probes // 4, vars(self)
        assert self.shared >= self.probes // 20, vars(self)
        assert self.uneven >= self.probes // 40, vars(self)
        assert self.partial >= self.probes // 10, vars(self)


def check_fleet(fleet: Fleet) -> None:
    """The scenario evicted (many) blocks and reset one worker's cache."""
    assert sum(w.evicted for w in fleet.sims) >= 100
    assert all(w.evicted for w in fleet.sims)
    assert fleet.sims[fleet.clear_worker].cleared == 1


# ------------------------------------------------------------------------------ the fleet


def test_radix_tree_and_prefix_index_agree_on_a_fleet() -> None:
    """4 workers, 320 multi-turn requests over shared system prompts, LRU evictions and a
    cache reset: at every checkpoint each probe's per-worker overlap is the same in Dynamo's
    RadixTree and in kvstream's index (both key modes), and both hold the same blocks."""
    fleet = Fleet()
    checkpoints = fleet.run()
    dyn = DynamoTree()
    indexes = {m: PrefixIndex(key_mode=m) for m in MODES}
    rng = random.Random(5)
    tally = Tally()
    for cp in checkpoints:
        for wi, batch in cp.batches:
            dyn.apply(wi, batch)
            for index in indexes.values():
                index.apply(batch)
        assert not dyn.errors
        held = dump_counts(dyn.dump())
        for mode, index in indexes.items():
            index.check()
            assert present_blocks(index) == held, mode
        for tokens in probes(rng, cp.served, 120):
            want = dyn.scores(tokens)
            for mode, index in indexes.items():
                assert kv_scores(index, tokens) == want, (mode, len(tokens))
            tally.add(tokens, want)
    check_fleet(fleet)
    tally.check(min_probes=600)
    # the reset worker lost everything it held before the reset and cached again since
    assert held.get(fleet.clear_worker, 0) > 0


# ------------------------------------------------------------------------------ semantics


class Both:
    """kvstream's index (both key modes) and a Dynamo RadixTree fed the same hand-made events."""

    def __init__(self) -> None:
        self.dyn = DynamoTree()
        self.indexes = {m: PrefixIndex(key_mode=m) for m in MODES}
        self.next_id: dict[tuple[int, int], int] = {}
        self.hasher = get_hasher(ENGINE_ALGO)

    def chain(self, tokens: Sequence[int]) -> tuple[list[Any], list[bytes]]:
        blocks = split_blocks(list(tokens), BS)
        return blocks, self.hasher.chain_bytes(blocks)

    def send(self, worker: int, *datas: EventData, rank: int = 0) -> list[str]:
        """Apply one batch of ``worker``; returns the errors Dynamo raised for it."""
        key = (worker, rank)
        events = []
        if key not in self.next_id:
            datas = (Created(num_blocks_per_cache_level=(10_000,), tokens_per_block=BS), *datas)
            self.next_id[key] = 0
        for d in datas:
            events.append(
                KVCacheEvent(
                    event_id=self.next_id[key],
                    hash_algo=ENGINE_ALGO,
                    window_size=UNBOUNDED_WINDOW,
                    data=d,
                )
            )
            self.next_id[key] += 1
        source = SourceId(instance_id=f"w{worker}", attention_dp_rank=rank, incarnation=1)
        batch = EventBatch(source=source, ts_ns=1, events=tuple(events))
        before = len(self.dyn.errors)
        self.dyn.apply(worker, batch)
        for index in self.indexes.values():
            index.apply(batch)
            index.check()
        return self.dyn.errors[before:]

    def kv(self, tokens: Sequence[int]) -> Scores:
        """kvstream's scores (the same in both key modes)."""
        engine, canon = (kv_scores(self.indexes[m], tokens) for m in MODES)
        assert engine == canon
        return engine

    def dynamo(self, tokens: Sequence[int]) -> Scores:
        return self.dyn.scores(tokens)


def stored(blocks: Sequence[Any], hashes: Sequence[bytes], lo: int, hi: int) -> Stored:
    """Blocks ``lo..hi-1`` of a chain, under block ``lo-1``."""
    return Stored(
        parent_hash=hashes[lo - 1] if lo else None,
        blocks=tuple(StoredBlock(block_hash=hashes[i], token_ids=blocks[i]) for i in range(lo, hi)),
    )


def removed(*hashes: bytes) -> Removed:
    return Removed(block_hashes=hashes)


def seq(rng: random.Random, n_blocks: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n_blocks * BS)]


def test_removed_middle_block() -> None:
    """A removal in the middle of a cached chain: the systems agree while the block is gone
    and differ, each as documented here, once it is stored again.

    - kvstream removes the one block. Its cached descendants stay in the worker's table,
      unrooted (unmatchable), and count again as soon as the chain is whole, which is what
      the engine does: vLLM still holds them and finds them by hash once the parent is cached
      again. A later removal of a descendant is applied to it.
    - Dynamo's RadixTree (1.6.1) takes the worker off the block's whole subtree: re-storing
      the middle block gives a depth of 2 blocks, not 4, and the engine's later removal of a
      descendant fails with ``BlockNotFound`` (ignored).

    Both leave other workers holding the same chain untouched.
    """
    both = Both()
    tokens = seq(random.Random(1), 4)  # A B C D
    blocks, h = both.chain(tokens)
    assert not both.send(0, stored(blocks, h, 0, 4))
    assert not both.send(1, stored(blocks, h, 0, 3))
    assert both.kv(tokens) == both.dynamo(tokens) == {(0, 0): 4, (1, 0): 3}

    assert not both.send(0, removed(h[1]))  # B leaves worker 0
    assert both.kv(tokens) == both.dynamo(tokens) == {(0, 0): 1, (1, 0): 3}
    assert both.kv(tokens[: 2 * BS]) == both.dynamo(tokens[: 2 * BS]) == {(0, 0): 1, (1, 0): 2}

    assert not both.send(0, stored(blocks, h, 1, 2))  # B again, under A
    assert both.kv(tokens) == {(0, 0): 4, (1, 0): 3}  # C and D count again
    assert both.dynamo(tokens) == {(0, 0): 2, (1, 0): 3}  # worker 0 lost C and D with B

    errors = both.send(0, removed(h[3]))  # the engine evicts D
    assert len(errors) == 1  # Dynamo no longer has it
    assert "find block" in errors[0]
    assert both.kv(tokens) == {(0, 0): 3, (1, 0): 3}
    assert both.dynamo(tokens) == {(0, 0): 2, (1, 0): 3}


def test_cleared_worker() -> None:
    """``cleared`` empties one worker in both systems; the others keep their blocks, and the
    cleared worker is matched again after it caches anew. With several DP ranks both clear
    only the rank that sent it (vLLM publishes ``AllBlocksCleared`` per rank)."""
    both = Both()
    rng = random.Random(2)
    shared = seq(rng, 3)
    own = shared + seq(rng, 2)
    blocks, h = both.chain(own)
    for w in range(3):
        assert not both.send(w, stored(blocks, h, 0, 3 + (w == 0) * 2))
    assert both.kv(own) == both.dynamo(own) == {(0, 0): 5, (1, 0): 3, (2, 0): 3}
    assert not both.send(0, Cleared())
    assert both.kv(own) == both.dynamo(own) == {(1, 0): 3, (2, 0): 3}
    assert not both.send(0, stored(blocks, h, 0, 2))
    assert both.kv(own) == both.dynamo(own) == {(0, 0): 2, (1, 0): 3, (2, 0): 3}

    # worker 5 with two DP ranks; rank 0 resets its cache
    other = seq(rng, 2)
    ob, oh = both.chain(other)
    assert not both.send(5, stored(ob, oh, 0, 2), rank=0)
    assert not both.send(5, stored(ob, oh, 0, 2), rank=1)
    assert both.kv(other) == both.dynamo(other) == {(5, 0): 2, (5, 1): 2}
    assert not both.send(5, Cleared(), rank=0)
    assert both.kv(other) == both.dynamo(other) == {(5, 1): 2}


def test_store_under_unknown_parent() -> None:
    """A store whose parent the index never saw (a lost event, a late join): kvstream keeps
    the blocks unmatchable and counts them once the parent chain is stored; Dynamo rejects the
    store (``ParentBlockNotFound``), so those blocks stay unknown to it until stored again."""
    both = Both()
    tokens = seq(random.Random(3), 4)
    blocks, h = both.chain(tokens)
    errors = both.send(0, stored(blocks, h, 2, 4))  # C D under B, before A B
    assert len(errors) == 1
    assert "parent" in errors[0]
    assert both.kv(tokens) == both.dynamo(tokens) == {}
    assert not both.send(0, stored(blocks, h, 0, 2))
    assert both.kv(tokens) == {(0, 0): 4}
    assert both.dynamo(tokens) == {(0, 0): 2}
    assert both.indexes["engine"].info(("w0", 0)).stats.unknown_parent_stores == 1


# ------------------------------------------------------------------------------ vLLM wire


def heartbeat() -> bytes:
    """An empty vLLM ``KVEventBatch`` (``[ts, [], rank]``): lets a subscriber that missed the
    last frame see the seq gap and replay it."""
    return msgspec.msgpack.encode([time.time(), [], 0])


async def synced(
    indexer: StandaloneIndexer,
    pubs: Sequence[ZmqPublisher],
    want: set[tuple[int, int, int | None, int, int]],
    timeout_s: float = 30.0,
) -> None:
    """Wait until the indexer's tree is ``want``: it may have joined late or missed the last
    frames, which it replays once a later frame shows the gap."""
    deadline = time.monotonic() + timeout_s
    got = await asyncio.to_thread(indexer.dump)
    while got != want and time.monotonic() < deadline:
        for p in pubs:
            p.publish(heartbeat())
        await asyncio.sleep(0.2)
        got = await asyncio.to_thread(indexer.dump)
    assert got == want, (
        f"missing {len(want - got)}, extra {len(got - want)} blocks\n{indexer.log()}"
    )


async def test_vllm_wire_bridge_into_dynamo(tmp_path: Path) -> None:
    """kvstream stream -> vLLM wire -> Dynamo: the fleet's batches go through kvstream's vLLM
    export (``VllmExporter`` + ``ZmqPublisher``, one PUB and replay ROUTER per worker) into
    Dynamo's standalone indexer, which decodes them with its own ``zmq_wire`` code (the path
    a Dynamo worker takes for a vLLM engine). At every checkpoint its tree equals the tree of
    a RadixTree fed the kvstream events directly, and its ``/query`` scores (Dynamo hashing
    the request) equal kvstream's."""
    fleet = Fleet(seed=23, requests=240, checkpoints=4)
    checkpoints = fleet.run()
    n = fleet.workers
    base = free_ports(2 * n + 1)
    pubs = [
        ZmqPublisher(
            tcp_endpoint("127.0.0.1", base + 2 * i), tcp_endpoint("127.0.0.1", base + 2 * i + 1)
        )
        for i in range(n)
    ]
    for p in pubs:
        await p.start()
    indexer = StandaloneIndexer(base + 2 * n, tmp_path / "dynamo-indexer.log", BS)
    try:
        await asyncio.to_thread(indexer.wait_healthy)
        for i, p in enumerate(pubs):
            assert p.replay_endpoint is not None
            await asyncio.to_thread(indexer.register, i, p.endpoint, p.replay_endpoint)
        exporter = VllmExporter()
        direct = DynamoTree()
        indexes = {m: PrefixIndex(key_mode=m) for m in MODES}
        rng = random.Random(7)
        tally = Tally()
        published = 0
        for cp in checkpoints:
            for wi, batch in cp.batches:
                direct.apply(wi, batch)
                for index in indexes.values():
                    index.apply(batch)
                payload = exporter.encode(batch).payload
                if payload is not None:
                    pubs[wi].publish(payload)
                    published += 1
            assert not direct.errors
            await synced(indexer, pubs, direct.dump())
            for tokens in probes(rng, cp.served, 60):
                got = await asyncio.to_thread(indexer.scores, tokens)
                want = {(w, 0): d for w, d in got.items()}
                assert direct.scores(tokens) == want, len(tokens)
                for mode, index in indexes.items():
                    assert kv_scores(index, tokens) == want, (mode, len(tokens))
                tally.add(tokens, want)
        assert published >= fleet.requests
        assert not exporter.unmapped.keys() - {"created"}
        check_fleet(fleet)
        tally.check(min_probes=240)
    finally:
        indexer.close()
        for p in pubs:
            await p.close()

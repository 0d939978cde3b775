"""``PrefixIndex(key_mode="dynamo")``: blocks keyed by Dynamo's local hashes, matched as
Dynamo's radix tree matches them; and one worker's unusable stream never fails the others.

The reference here is the definition of Dynamo's tree: a worker holds a path of local hashes
(``dynamo_xxh3_64`` of each block's tokens) from the root, and a request matches a worker to
the depth of the longest such path that is a prefix of the request's local hashes. (The peer
tests check the same against Dynamo's own ``RadixTree`` and indexer service.)
"""

from __future__ import annotations

import random

import pytest
from index_support import WINDOW, Producer

from kvstream.errors import ConfigError
from kvstream.events.model import KVCacheEvent, Removed, Stored, StoredBlock
from kvstream.hashing import get_hasher, split_blocks
from kvstream.index import HashRequest, PrefixIndex, Router, WorkerKey
from kvstream.index.keys import DYNAMO_ALGO, KeyMode, keys_from_local
from kvstream.index.snapshot import decode_snapshot, encode_snapshot

TPB = 4
#: Dynamo matches every full block of a request (no last token dropped)
ALL = HashRequest(drop_last_token=False)
_local = get_hasher("dynamo_xxh3_64")


def local_hashes(tokens: list[int], lora_name: str | None = None) -> list[bytes]:
    blocks = split_blocks(tokens, TPB)
    return _local.chain_bytes(blocks, lora_name=lora_name)


class Worker:
    """One engine: stores chains and evicts leaves, publishing real engine hashes, and keeps
    the reference state: the set of local-hash paths it holds."""

    def __init__(self, name: str, rng: random.Random) -> None:
        self.p = Producer(name, algo="blake3_64", tpb=TPB)
        self.rng = rng
        self.paths: dict[bytes, tuple[bytes, ...]] = {}  # engine hash -> local path
        self.parent: dict[bytes, bytes | None] = {}

    def store(self, tokens: list[int], lora_name: str | None = None) -> KVCacheEvent:
        blocks = split_blocks(tokens, TPB)
        hashes = self.p.hasher.chain_bytes(blocks, lora_id=1 if lora_name else None)
        locs = local_hashes(tokens, lora_name)
        # store only what is new, under the deepest cached prefix (what an engine sends)
        start = 0
        while start < len(hashes) and hashes[start] in self.paths:
            start += 1
        parent = hashes[start - 1] if start else None
        path = self.paths[parent] if parent is not None else ()
        for i in range(start, len(hashes)):
            path = (*path, locs[i])
            self.paths[hashes[i]] = path
            self.parent[hashes[i]] = hashes[i - 1] if i else None
        data = Stored(
            parent_hash=parent,
            blocks=tuple(
                StoredBlock(block_hash=h, token_ids=b, lora_name=lora_name)
                for h, b in zip(hashes[start:], blocks[start:], strict=True)
            ),
        )
        return self.p._ev(data)

    def evict(self, n: int) -> KVCacheEvent | None:
        parents = {p for p in self.parent.values() if p is not None}
        leaves = [h for h in self.paths if h not in parents]
        self.rng.shuffle(leaves)
        gone = leaves[:n]
        if not gone:
            return None
        for h in gone:
            del self.paths[h]
            del self.parent[h]
        return self.p._ev(Removed(block_hashes=tuple(gone)))

    def depth(self, locs: list[bytes]) -> int:
        held = set(self.paths.values())
        d = 0
        while d < len(locs) and tuple(locs[: d + 1]) in held:
            d += 1
        return d


def test_dynamo_keys_match_the_radix_tree_definition() -> None:
    rng = random.Random(7)
    index = PrefixIndex(key_mode="dynamo", default_tokens_per_block=TPB)
    workers = [Worker(f"w{i}", rng) for i in range(4)]
    systems = [[rng.randrange(50_000) for _ in range(TPB * 6)] for _ in range(3)]
    prompts: list[list[int]] = []
    for _step in range(300):
        w = rng.choice(workers)
        if rng.random() < 0.3 and w.paths:
            ev = w.evict(rng.randrange(1, 6))
        else:
            base = rng.choice(systems)
            prompt = base + [rng.randrange(50_000) for _ in range(TPB * rng.randrange(1, 8))]
            prompts.append(prompt)
            ev = w.store(prompt)
        if ev is not None:
            index.apply(w.p.batch(ev))
    assert index.domains()[0].hash_algo == DYNAMO_ALGO
    queries = prompts[-50:] + [[*rng.choice(systems), 1, 2, 3] for _ in range(10)]
    for q in queries:
        locs = local_hashes(q)
        want = {WorkerKey(w.p.source.instance_id): w.depth(locs) for w in workers}
        got = {m.worker: m.matched_blocks for m in index.match(q, request=ALL).matches}
        assert got == want
        by_hash = index.match(q, block_hashes=locs)
        assert {m.worker: m.matched_blocks for m in by_hash.matches} == want


def test_lora_name_separates_dynamo_keys() -> None:
    rng = random.Random(1)
    index = PrefixIndex(key_mode="dynamo", default_tokens_per_block=TPB)
    w = Worker("w0", rng)
    prompt = list(range(1, 17))
    index.apply(w.p.batch(w.store(prompt, lora_name="adapter-a")))
    plain = index.match(prompt, request=HashRequest(drop_last_token=False))
    scoped = index.match(prompt, request=HashRequest(lora_name="adapter-a", drop_last_token=False))
    assert plain.matches[0].matched_blocks == 0
    assert scoped.matches[0].matched_blocks == 4
    with pytest.raises(ConfigError):
        index.match(prompt, request=HashRequest(cache_salt="s"))


def test_dynamo_index_snapshot_round_trip() -> None:
    rng = random.Random(3)
    index = PrefixIndex(key_mode=KeyMode.DYNAMO, default_tokens_per_block=TPB)
    w = Worker("w0", rng)
    stored = [[rng.randrange(100) for _ in range(TPB * 5)] for _ in range(20)]
    for prompt in stored:
        index.apply(w.p.batch(w.store(prompt)))
    restored = decode_snapshot(encode_snapshot(index)).index
    assert restored.key_mode is KeyMode.DYNAMO
    assert restored.canonical_state() == index.canonical_state()
    probe = stored[7]
    assert index.match(probe, request=ALL).matches[0].matched_blocks == 5
    assert restored.match(probe, request=ALL).matches == index.match(probe, request=ALL).matches


# ------------------------------------------------------------------------------ isolation


def _two_workers(algo_b: str) -> tuple[PrefixIndex, list[int]]:
    index = PrefixIndex()
    a = Producer("a", algo="blake3_64", tpb=TPB)
    b = Producer("b", algo="blake3_64", tpb=TPB)
    prompt = list(range(100, 117))
    index.apply(a.batch(a.created(), a.stored(a.chain(prompt))))
    index.apply(b.batch(b.created(), b.stored(b.chain(prompt), algo=algo_b)))
    return index, prompt


def test_a_worker_with_an_unknown_algorithm_does_not_fail_the_others() -> None:
    index, prompt = _two_workers("no_such_algo_v9")
    result = index.match(prompt)
    by = {m.worker.instance_id: m for m in result.matches}
    assert by["a"].matched_blocks == 4
    assert by["b"].matched_blocks == 0
    assert "no_such_algo_v9" in by["b"].note
    assert "no_such_algo_v9" in index.unmatchable(WorkerKey("b"))
    assert index.unmatchable(WorkerKey("a")) == ""
    decision = Router(index).route(prompt)
    assert decision.worker == WorkerKey("a")
    # and a snapshot carrying such a worker restores and answers the same way
    restored = decode_snapshot(encode_snapshot(index)).index
    again = {m.worker.instance_id: m.matched_blocks for m in restored.match(prompt).matches}
    assert again == {"a": 4, "b": 0}


def test_a_block_longer_than_the_block_size_makes_the_worker_stale() -> None:
    index = PrefixIndex(default_tokens_per_block=TPB)
    p = Producer("w", algo="blake3_64", tpb=TPB)
    long_block = StoredBlock(block_hash=b"\x01" * 8, token_ids=list(range(2 * TPB)))
    ev = KVCacheEvent(
        event_id=0,
        hash_algo="blake3_64",
        layer_group_id=0,
        window_size=WINDOW,
        data=Stored(parent_hash=None, blocks=(long_block,)),
    )
    index.apply(p.batch(ev))
    info = index.info(WorkerKey("w"))
    assert info.stale
    assert "block size mismatch" in info.stale_reason
    assert info.stats.block_size_mismatches == 1


def test_tier_match_counts_each_tier_as_dynamo_does() -> None:
    """GPU blocks 0-1 and 5, host blocks 2-3, disk block 4: the prefix reaches 2 blocks on GPU
    alone, 4 with host copies, all 6 with disk copies (Dynamo's ``gpu``/``cpu``/``disk``)."""
    index = PrefixIndex(key_mode="dynamo", default_tokens_per_block=TPB)
    w = Worker("w", random.Random(0))
    prompt = list(range(1, 1 + 6 * TPB))
    ev = w.store(prompt)
    blocks = ev.data.blocks  # type: ignore[union-attr]
    levels = [0, 0, 1, 1, 2, 0]  # block 5 on GPU again: reached only through disk block 4
    leveled = tuple(
        b.model_copy(update={"cache_level": lv}) for b, lv in zip(blocks, levels, strict=True)
    )
    ev = ev.model_copy(update={"data": Stored(parent_hash=None, blocks=leveled)})
    index.apply(w.p.batch(ev))
    (domain,) = index.domains()
    keys = keys_from_local(local_hashes(prompt))
    assert index.tier_match(domain, keys) == [(WorkerKey("w"), 2, 4, 6, 6)]
    assert index.tier_match(domain, keys[:3]) == [(WorkerKey("w"), 2, 3, 3, 3)]
    assert index.tier_match(domain, []) == []

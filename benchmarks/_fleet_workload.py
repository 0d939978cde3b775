"""A fleet of engines with LRU prefix caches, and the KV events they publish (bench_peers,
bench_index_memory).

The workload an independent audit of issue 13 used (issue 22 "Why"):

- ``workers`` engines (default 64), each with a prefix cache of ``capacity`` blocks;
- ``pool`` distinct prompts of ``tokens`` tokens (default 8192) in ``block_size``-token blocks
  (default 32); prompt ``p`` starts with system prompt ``p % systems`` (a quarter of it);
- every engine serves ``requests`` prompts drawn from the pool, one chunk of at most
  ``chunk`` blocks (default 64) per engine iteration, as chunked prefill allocates them: the
  chunk's new blocks are one ``stored`` event (parent = the block before), and the blocks its
  allocation evicts, one ``removed`` event just before it;
- evictions are LRU and leaf-first, as vLLM's free queue does it: a finished request's blocks
  go back to the queue from its last block to its first, so a block is always older than its
  parent and the oldest cached block is a leaf; blocks in use are never evicted;
- engines run interleaved: each batch is one iteration of one engine, engines taken in a
  shuffled round-robin order.

Every engine's stream starts with a ``created`` event advertising its capacity and block
size. Hashes are vLLM's ``sha256_cbor`` (u64 form), the token ids random below 50,000.
Generation is deterministic in ``seed``.
"""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstream._types import TokenIds
from kvstream.events.model import (
    Created,
    EventBatch,
    KVCacheEvent,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
)
from kvstream.hashing import get_hasher

ALGO = "vllm_sha256_cbor_64"
VOCAB = 50_000
WINDOW = 1 << 17


@dataclass(frozen=True)
class FleetSpec:
    """The workload's size; see the module docstring."""

    workers: int = 64
    tokens: int = 8192
    block_size: int = 32
    systems: int = 8
    pool: int = 256
    requests: int = 62
    capacity: int = 8192
    chunk: int = 64

    @property
    def blocks_per_prompt(self) -> int:
        return self.tokens // self.block_size

    def check(self) -> None:
        """ValueError when the caches cannot hold a request being served."""
        if self.capacity < self.blocks_per_prompt + self.chunk:
            raise ValueError(
                f"capacity {self.capacity} < a prompt ({self.blocks_per_prompt} blocks) + a "
                f"chunk ({self.chunk}): requests in flight could not be served"
            )


@dataclass
class Totals:
    """Blocks announced so far: stored, removed, and still cached at the end (present
    worker x block pairs)."""

    stored: int = 0
    removed: int = 0
    present: int = 0
    events: int = 0
    batches: int = 0
    max_store: int = 0
    max_remove: int = 0

    @property
    def blocks(self) -> int:
        return self.stored + self.removed


@dataclass
class Prompts:
    """The pool: each prompt's blocks (packed u32 token ids), engine hashes (8 bytes each)."""

    blocks: list[list[TokenIds]] = field(default_factory=list)
    hashes: list[list[bytes]] = field(default_factory=list)

    def tokens(self, p: int, n_blocks: int) -> list[int]:
        """The first ``n_blocks`` blocks of prompt ``p`` as token ids."""
        raw = b"".join(b.raw for b in self.blocks[p][:n_blocks])
        return array("I", raw).tolist()


def random_tokens(rng: np.random.Generator, n: int) -> bytes:
    """``n`` token ids below VOCAB, packed u32 little-endian."""
    return rng.integers(0, VOCAB, n, dtype="<u4").tobytes()


def build_prompts(spec: FleetSpec, seed: int) -> Prompts:
    """The pool of prompts of ``seed`` (system prompts shared, the rest random)."""
    rng = np.random.default_rng(seed)
    shared = spec.tokens // 4
    systems = [random_tokens(rng, shared) for _ in range(spec.systems)]
    hasher = get_hasher(ALGO)
    out = Prompts()
    bpt = 4 * spec.block_size
    for p in range(spec.pool):
        raw = systems[p % spec.systems] + random_tokens(rng, spec.tokens - shared)
        blocks = [TokenIds.from_bytes(raw[i : i + bpt]) for i in range(0, len(raw), bpt)]
        out.blocks.append(blocks)
        out.hashes.append(list(hasher.chain_bytes(blocks)))
    return out


def _event(eid: int, data: Any) -> KVCacheEvent:
    return KVCacheEvent(event_id=eid, hash_algo=ALGO, window_size=WINDOW, data=data)


def _engine(
    w: int, spec: FleetSpec, prompts: Prompts, plan: list[int], totals: Totals
) -> Iterator[EventBatch]:
    """One engine's batches, one per iteration (a chunk of a request, with its evictions)."""
    src = SourceId(instance_id=f"worker-{w}", attention_dp_rank=0, incarnation=1)
    created = Created(num_blocks_per_cache_level=(spec.capacity,), tokens_per_block=spec.block_size)
    evs: list[KVCacheEvent] = [_event(0, created)]
    eid = 1
    lru: OrderedDict[bytes, None] = OrderedDict()  # free queue: oldest (a leaf) first
    for p in plan:
        chain = prompts.hashes[p]
        blocks = prompts.blocks[p]
        n = len(chain)
        k = 0
        while k < n and chain[k] in lru:
            del lru[chain[k]]  # in use now: not evictable
            k += 1
        in_use = k
        while k < n:
            m = min(spec.chunk, n - k)
            evict = in_use + len(lru) + m - spec.capacity
            if evict > 0:
                gone = [lru.popitem(last=False)[0] for _ in range(evict)]
                evs.append(_event(eid, Removed(block_hashes=tuple(gone))))
                eid += 1
                totals.removed += evict
                totals.max_remove = max(totals.max_remove, evict)
            stored = tuple(
                StoredBlock(block_hash=chain[i], token_ids=blocks[i]) for i in range(k, k + m)
            )
            evs.append(_event(eid, Stored(parent_hash=chain[k - 1] if k else None, blocks=stored)))
            eid += 1
            totals.stored += m
            totals.max_store = max(totals.max_store, m)
            k += m
            in_use += m
            totals.events += len(evs)
            totals.batches += 1
            yield EventBatch(source=src, ts_ns=eid, events=tuple(evs))
            evs = []
        for i in range(n - 1, -1, -1):  # freed last block first: the root is the newest
            lru[chain[i]] = None
    totals.present += len(lru)


def fleet_batches(
    spec: FleetSpec, seed: int, prompts: Prompts | None = None
) -> tuple[Iterator[EventBatch], Prompts, Totals]:
    """The fleet's batches in stream order (a generator: encode them as they come), the
    prompt pool, and the totals (complete once the generator is exhausted)."""
    spec.check()
    prompts = prompts if prompts is not None else build_prompts(spec, seed)
    rng = random.Random(seed)
    totals = Totals()
    engines = [
        _engine(w, spec, prompts, [rng.randrange(spec.pool) for _ in range(spec.requests)], totals)
        for w in range(spec.workers)
    ]

    def interleaved() -> Iterator[EventBatch]:
        live = list(engines)
        while live:
            rng.shuffle(live)
            for eng in list(live):
                batch = next(eng, None)
                if batch is None:
                    live.remove(eng)
                else:
                    yield batch

    return interleaved(), prompts, totals


def dynamo_local_hashes(llm: Any, prompts: Prompts, block_size: int) -> list[list[int]]:
    """Dynamo's ``LocalBlockHash`` of every pool prompt's blocks (its own
    ``compute_block_hash_for_seq``)."""
    n = len(prompts.blocks[0]) if prompts.blocks else 0
    return [
        list(llm.compute_block_hash_for_seq(prompts.tokens(p, n), block_size))
        for p in range(len(prompts.blocks))
    ]


def dynamo_event_json(batch: EventBatch, local_of: dict[bytes, int]) -> Iterator[tuple[int, bytes]]:
    """Dynamo ``KvCacheEvent`` JSON (``RadixTree.apply_event``'s input) for each stored or
    removed event of ``batch``, with the worker id: ``(worker, bytes)``. ``local_of`` maps an
    engine hash to Dynamo's local hash of that block's tokens (what a Dynamo publisher puts in
    ``tokens_hash``)."""
    import json

    w = int(batch.source.instance_id.removeprefix("worker-"))
    for ev in batch.events:
        d = ev.data
        if isinstance(d, Stored):
            body: Any = {
                "stored": {
                    "parent_hash": None
                    if d.parent_hash is None
                    else int.from_bytes(d.parent_hash, "big"),
                    "blocks": [
                        {
                            "block_hash": int.from_bytes(b.block_hash, "big"),
                            "tokens_hash": local_of[b.block_hash],
                        }
                        for b in d.blocks
                    ],
                }
            }
        elif isinstance(d, Removed):
            body = {"removed": {"block_hashes": [int.from_bytes(h, "big") for h in d.block_hashes]}}
        else:
            continue
        yield w, json.dumps({"event_id": ev.event_id, "data": body, "dp_rank": 0}).encode()


def local_hash_map(prompts: Prompts, local: list[list[int]]) -> dict[bytes, int]:
    """Engine hash -> Dynamo local hash, over the pool."""
    out: dict[bytes, int] = {}
    for hs, ls in zip(prompts.hashes, local, strict=True):
        out.update(zip(hs, ls, strict=True))
    return out


@dataclass
class Encoded:
    """One round's input on both sides, from the same events: kvstream's Avro single-object
    messages (as Kafka values) and Dynamo's event JSON (None without Dynamo)."""

    messages: list[bytes]
    dynamo: list[tuple[int, bytes]] | None
    prompts: Prompts
    local: list[list[int]] | None
    totals: Totals


def encode_fleet(spec: FleetSpec, seed: int, llm: Any | None, codec: Any) -> Encoded:
    """Generate the fleet's events for ``seed`` and encode them for both sides."""
    batches, prompts, totals = fleet_batches(spec, seed)
    local = dynamo_local_hashes(llm, prompts, spec.block_size) if llm is not None else None
    local_of = local_hash_map(prompts, local) if local is not None else None
    messages: list[bytes] = []
    dyn: list[tuple[int, bytes]] | None = [] if local_of is not None else None
    encode = codec.encode
    for b in batches:
        messages.append(encode(b))
        if dyn is not None and local_of is not None:
            dyn.extend(dynamo_event_json(b, local_of))
    return Encoded(messages, dyn, prompts, local, totals)

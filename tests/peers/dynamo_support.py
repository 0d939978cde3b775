"""Helpers for the Dynamo peer test: a simulated vLLM fleet, and Dynamo's index driven two ways.

- :class:`Fleet` plays a few vLLM-like workers serving multi-turn conversations that share
  system prompts. Each worker keeps an LRU prefix cache of bounded size and emits the kvstream
  batches a real engine would (``created``, ``stored`` with real token ids and vLLM's
  ``sha256_cbor`` hashes, ``removed`` on eviction, ``cleared`` on a cache reset).
- :func:`router_events` turns a kvstream event into Dynamo's ``KvCacheEvent`` JSON for
  ``RadixTree.apply_event`` (the shape ``dynamo._core``'s ``RadixTree`` deserializes).
- :class:`StandaloneIndexer` runs Dynamo's own standalone indexer (``python -m
  dynamo.indexer``), which subscribes to vLLM-format ZMQ publishers and answers HTTP queries.

Nothing here imports ``dynamo`` at module level: the test module skips without it first.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

#: The engine hash the simulated workers publish (vLLM's portable ``sha256_cbor``, u64 form).
ENGINE_ALGO = "vllm_sha256_cbor_64"
VOCAB = 50_000


def local_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Dynamo's per-block ``LocalBlockHash`` of the full blocks of ``tokens`` (the real code)."""
    from dynamo.llm import compute_block_hash_for_seq

    return list(compute_block_hash_for_seq(list(tokens), block_size))


def hash_int(h: bytes) -> int:
    """A kvstream 8-byte hash as the u64 Dynamo (and vLLM's int mode) carries."""
    return int.from_bytes(h, "big")


# ------------------------------------------------------------------------------- Dynamo JSON


def router_events(
    ev: KVCacheEvent, block_size: int, event_id: int, dp_rank: int = 0
) -> list[dict[str, Any]]:
    """Dynamo ``KvCacheEvent`` dicts (``{event_id, data, dp_rank}``) for one kvstream event.

    ``stored`` -> ``{"stored": {parent_hash, blocks: [{block_hash, tokens_hash}]}}`` with the
    engine hash as Dynamo's external ``block_hash`` and ``tokens_hash`` recomputed from the
    block's tokens, as Dynamo's worker does for vLLM events; ``removed`` -> ``{"removed":
    {block_hashes}}``; ``cleared`` -> ``"cleared"``; ``created`` has no Dynamo counterpart.
    """
    data = ev.data
    if isinstance(data, Stored):
        tokens: list[int] = []
        for b in data.blocks:
            assert len(b.token_ids) == block_size
            tokens.extend(b.token_ids.tolist())
        ths = local_hashes(tokens, block_size)
        body: Any = {
            "stored": {
                "parent_hash": None if data.parent_hash is None else hash_int(data.parent_hash),
                "blocks": [
                    {"block_hash": hash_int(b.block_hash), "tokens_hash": th}
                    for b, th in zip(data.blocks, ths, strict=True)
                ],
            }
        }
    elif isinstance(data, Removed):
        body = {"removed": {"block_hashes": [hash_int(h) for h in data.block_hashes]}}
    elif isinstance(data, Cleared):
        body = "cleared"
    elif isinstance(data, Created):
        return []
    else:  # pragma: no cover - the fleet emits nothing else
        raise AssertionError(f"no Dynamo mapping for {data!r}")
    return [{"event_id": event_id, "data": body, "dp_rank": dp_rank}]


def flatten_dump(events: Iterable[Any]) -> set[tuple[int, int, int | None, int, int]]:
    """Dynamo tree dump events (``RouterEvent`` JSON, as strings or dicts) as a set of
    ``(worker_id, dp_rank, parent_hash, block_hash, tokens_hash)`` per stored block."""
    out: set[tuple[int, int, int | None, int, int]] = set()
    for raw in events:
        rev = json.loads(raw) if isinstance(raw, str) else raw
        ev = rev["event"]
        stored = ev["data"]["stored"]
        parent = stored["parent_hash"]
        for b in stored["blocks"]:
            out.add((rev["worker_id"], ev["dp_rank"], parent, b["block_hash"], b["tokens_hash"]))
            parent = b["block_hash"]
    return out


# ------------------------------------------------------------------------------- the fleet


class SimWorker:
    """One vLLM-like engine: an LRU prefix cache of ``capacity`` blocks and its event stream.

    Eviction follows vLLM's free-queue order: a finished request's blocks are freed last block
    first, so a parent is always more recently used than its children and only leaves (blocks
    without cached children) are evicted. A removal in the middle of a cached chain therefore
    never happens here; the test covers it separately.
    """

    def __init__(self, index: int, capacity: int, block_size: int) -> None:
        self.index = index
        self.name = f"w{index}"
        self.capacity = capacity
        self.block_size = block_size
        self.source = SourceId(instance_id=self.name, attention_dp_rank=0, incarnation=1)
        self.hasher = get_hasher(ENGINE_ALGO)
        self.next_id = 0
        self.lru: OrderedDict[bytes, bytes | None] = OrderedDict()  # hash -> parent hash
        self.evicted = 0
        self.cleared = 0

    def _ev(self, data: EventData) -> KVCacheEvent:
        ev = KVCacheEvent(
            event_id=self.next_id,
            hash_algo=ENGINE_ALGO,
            window_size=UNBOUNDED_WINDOW,
            data=data,
        )
        self.next_id += 1
        return ev

    def batch(self, events: Sequence[KVCacheEvent], ts_ns: int) -> EventBatch:
        return EventBatch(source=self.source, ts_ns=ts_ns, events=tuple(events))

    def created(self) -> KVCacheEvent:
        return self._ev(
            Created(num_blocks_per_cache_level=(self.capacity,), tokens_per_block=self.block_size)
        )

    def clear(self) -> KVCacheEvent:
        """``reset_prefix_cache``: every block is gone."""
        self.lru.clear()
        self.cleared += 1
        return self._ev(Cleared())

    def serve(self, prompt: Sequence[int], output: Sequence[int]) -> list[list[KVCacheEvent]]:
        """Serve one request; returns its events per scheduler step: evictions and the
        prompt's new blocks at prefill, then the output's new blocks after decoding."""
        seq = [*prompt, *output]
        blocks = split_blocks(seq, self.block_size)
        hashes = self.hasher.chain_bytes(blocks)
        assert len(hashes) <= self.capacity
        lru = self.lru
        hit = 0
        while hit < len(hashes) and hashes[hit] in lru:
            hit += 1
        for h in reversed(hashes[:hit]):  # touched: no longer evictable first
            lru.move_to_end(h)
        prefill: list[KVCacheEvent] = []
        while len(lru) + len(hashes) - hit > self.capacity:
            h, _ = lru.popitem(last=False)
            assert h not in lru.values(), "the simulated cache evicted a block with children"
            self.evicted += 1
            prefill.append(self._ev(Removed(block_hashes=(h,), cache_level=0)))
        n_prompt = min(len(prompt) // self.block_size, len(hashes))
        steps = [prefill, []]
        for step, lo, hi in ((0, hit, max(hit, n_prompt)), (1, max(hit, n_prompt), len(hashes))):
            if lo == hi:
                continue
            parent = hashes[lo - 1] if lo else None
            stored = tuple(
                StoredBlock(block_hash=hashes[i], token_ids=blocks[i], cache_level=0)
                for i in range(lo, hi)
            )
            steps[step].append(self._ev(Stored(parent_hash=parent, blocks=stored)))
            for i in range(lo, hi):
                lru[hashes[i]] = hashes[i - 1] if i else None
        for h in reversed(hashes):  # freed last block first: the head stays most recent
            lru.move_to_end(h)
        return [s for s in steps if s]


@dataclass
class Checkpoint:
    """Where the fleet's event stream is paused for probing."""

    batches: list[tuple[int, EventBatch]]  # (worker index, batch) since the last checkpoint
    served: list[list[int]]  # every sequence served so far (prompt + output)


@dataclass
class Fleet:
    """``workers`` engines serving ``requests`` multi-turn requests (see the module docstring).

    Conversations start from one of ``n_system`` system prompts, keep their worker with
    probability ``affinity`` (else move to a random one, so prefixes spread across workers)
    and end past ``max_tokens``. Worker ``clear_worker`` resets its cache once, after
    ``clear_at`` of the requests.
    """

    seed: int = 11
    workers: int = 4
    block_size: int = 16
    capacity: int = 160
    requests: int = 320
    checkpoints: int = 5
    n_system: int = 4
    affinity: float = 0.75
    max_tokens: int = 900
    clear_worker: int = 3
    clear_at: float = 0.55
    sims: list[SimWorker] = field(default_factory=list)

    def run(self) -> list[Checkpoint]:
        """Play the whole scenario; the event stream cut at each checkpoint."""
        rng = random.Random(self.seed)
        self.sims = [SimWorker(i, self.capacity, self.block_size) for i in range(self.workers)]

        def toks(lo: int, hi: int) -> list[int]:
            return [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]

        systems = [toks(40, 200) for _ in range(self.n_system)]
        convs: list[tuple[list[int], int]] = []  # (history, worker)
        ts = 1_700_000_000_000_000_000
        pending: list[tuple[int, EventBatch]] = [
            (w.index, w.batch([w.created()], ts)) for w in self.sims
        ]
        served: list[list[int]] = []
        out: list[Checkpoint] = []
        every = self.requests // self.checkpoints
        clear_req = int(self.requests * self.clear_at)
        for r in range(self.requests):
            if r == clear_req:
                w = self.sims[self.clear_worker]
                ts += 1_000
                pending.append((w.index, w.batch([w.clear()], ts)))
            if convs and rng.random() < 0.7:
                ci = rng.randrange(len(convs))
                history, wi = convs[ci]
                if rng.random() > self.affinity:
                    wi = rng.randrange(self.workers)
            else:
                ci = -1
                history, wi = list(rng.choice(systems)), rng.randrange(self.workers)
            prompt = history + toks(8, 80)
            output = toks(4, 60)
            w = self.sims[wi]
            for step in w.serve(prompt, output):
                ts += 1_000
                pending.append((wi, w.batch(step, ts)))
            seq = prompt + output
            served.append(seq)
            if ci >= 0:
                convs[ci] = (seq, wi)
            else:
                convs.append((seq, wi))
            if len(seq) > self.max_tokens:
                convs = [c for c in convs if c[0] is not seq]
            if (r + 1) % every == 0:
                out.append(Checkpoint(pending, list(served)))
                pending = []
        if pending:
            out.append(Checkpoint(pending, list(served)))
        return out


def probes(rng: random.Random, served: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Requests to match: served sequences whole, cut (anywhere, not only at block bounds),
    extended, diverging after a shared system prompt, shifted by one token, and unrelated."""
    out: list[list[int]] = []
    for _ in range(n):
        seq = list(rng.choice(served))
        kind = rng.randrange(6)
        if kind == 0:
            out.append(seq)
        elif kind == 1:
            out.append(seq[: rng.randint(1, len(seq))])
        elif kind == 2:
            out.append(seq + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 70))])
        elif kind == 3:
            cut = rng.randint(16, 220)
            out.append(seq[:cut] + [rng.randrange(VOCAB) for _ in range(rng.randint(16, 90))])
        elif kind == 4:
            out.append(seq[1:])
        else:
            out.append([rng.randrange(VOCAB) for _ in range(rng.randint(16, 400))])
    return out


# ------------------------------------------------------------------------------- standalone


class StandaloneIndexer:
    """Dynamo's standalone KV indexer (``python -m dynamo.indexer``) in a subprocess.

    Workers are registered over HTTP (``POST /register`` with the vLLM publisher's PUB and
    replay endpoints); the indexer SUBs to them, decodes vLLM's wire format with Dynamo's
    ``zmq_wire`` code (int hashes only, ``tokens_hash`` recomputed from ``token_ids``, the
    engine hash kept as the external id) and replays gaps (from seq 0 when it joined late).
    """

    def __init__(self, port: int, log_path: Path, block_size: int, model: str = "kvstream"):
        self.port = port
        self.block_size = block_size
        self.model = model
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited: {self.log()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def call(self, path: str, body: Any = None) -> Any:
        """JSON request to the indexer; raises on an HTTP error with its body."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path}: HTTP {exc.code} {exc.read()!r}") from exc

    def register(self, worker_id: int, endpoint: str, replay_endpoint: str) -> None:
        self.call(
            "/register",
            {
                "instance_id": worker_id,
                "endpoint": endpoint,
                "replay_endpoint": replay_endpoint,
                "model_name": self.model,
                "block_size": self.block_size,
                "dp_rank": 0,
            },
        )

    def scores(self, tokens: Sequence[int]) -> dict[int, int]:
        """Matched blocks per worker id (dp rank 0) for ``tokens``, hashed by Dynamo itself."""
        resp = self.call("/query", {"token_ids": list(tokens), "model_name": self.model})
        out: dict[int, int] = {}
        for wid, ranks in resp["scores"].items():
            for rank, matched_tokens in ranks.items():
                assert rank == "0"
                assert matched_tokens % self.block_size == 0
                out[int(wid)] = matched_tokens // self.block_size
        return out

    def dump(self) -> set[tuple[int, int, int | None, int, int]]:
        resp = self.call("/dump")
        entry = resp.get(f"{self.model}:default")
        return flatten_dump(entry["events"]) if entry else set()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

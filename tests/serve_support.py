"""Helpers for the service tests: vLLM-format engines on real ZMQ sockets and a running
service on a loopback port.

:class:`Engine` plays one engine rank: it stores and evicts real blocks (vLLM's
``sha256_cbor`` hashes in int mode, real token ids), publishes them through
:class:`~kvstream.engines.vllm_export.VllmExporter` on a PUB socket with a replay ROUTER
(``engine_publisher.TestEnginePublisher``), and keeps the reference: which local-hash paths
it holds per tier, so a test can say what Dynamo's indexer would answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine_publisher import TestEnginePublisher, free_ports

from kvstream.engines.vllm_export import VllmExporter
from kvstream.events.model import (
    EventBatch,
    KVCacheEvent,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
)
from kvstream.hashing import get_hasher, split_blocks

ENGINE_ALGO = "vllm_sha256_cbor_64"
_engine_hasher = get_hasher(ENGINE_ALGO)
_local_hasher = get_hasher("dynamo_xxh3_64")


def local_path(tokens: Sequence[int], bs: int, lora_name: str | None = None) -> list[int]:
    """Dynamo's local hashes (u64) of the full blocks of ``tokens``."""
    blocks = split_blocks(list(tokens), bs)
    if blocks and len(blocks[-1]) < bs:
        blocks.pop()
    return [
        int.from_bytes(h, "big") for h in _local_hasher.chain_bytes(blocks, lora_name=lora_name)
    ]


def signed(h: int) -> int:
    """A u64 as Dynamo's ``/query_by_hash`` takes it (i64)."""
    return h - 2**64 if h >= 2**63 else h


class Engine:
    """One engine rank publishing vLLM KV events (module docstring)."""

    def __init__(self, bs: int, *, dp_rank: int = 0, replay: bool = True) -> None:
        self.bs = bs
        self.dp_rank = dp_rank
        ports = free_ports(2)
        self.port = ports[0]
        self.replay_port = ports[1] if replay else None
        self.pub = TestEnginePublisher(self.port, self.replay_port)
        self.exporter = VllmExporter()
        self.source = SourceId(instance_id="engine", attention_dp_rank=dp_rank, incarnation=1)
        self.next_id = 0
        #: engine hash -> (parent hash, local path, level)
        self.blocks: dict[bytes, tuple[bytes | None, tuple[int, ...], int]] = {}

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"

    def _publish(self, data: Any) -> None:
        ev = KVCacheEvent(
            event_id=self.next_id,
            hash_algo=ENGINE_ALGO,
            layer_group_id=0,
            window_size=1 << 30,
            data=data,
        )
        self.next_id += 1
        batch = EventBatch(source=self.source, ts_ns=time.time_ns(), events=[ev])
        self.pub.publish(self.exporter.encode(batch).payload)

    def payload_of_store(self, tokens: Sequence[int]) -> bytes:
        """The vLLM payload storing ``tokens``' full blocks from the root, not published and
        not remembered (for tests that play a misconfigured engine)."""
        blocks = split_blocks(list(tokens), self.bs)
        hashes = _engine_hasher.chain_bytes(blocks)
        ev = KVCacheEvent(
            event_id=0,
            hash_algo=ENGINE_ALGO,
            layer_group_id=0,
            window_size=1 << 30,
            data=Stored(
                parent_hash=None,
                blocks=tuple(
                    StoredBlock(block_hash=h, token_ids=b)
                    for h, b in zip(hashes, blocks, strict=True)
                ),
            ),
        )
        batch = EventBatch(source=self.source, ts_ns=time.time_ns(), events=[ev])
        payload = VllmExporter().encode(batch).payload
        assert payload is not None
        return payload

    def store(self, tokens: Sequence[int], level: int = 0) -> None:
        """Cache the full blocks of ``tokens`` not cached yet (under the cached prefix)."""
        blocks = split_blocks(list(tokens), self.bs)
        if blocks and len(blocks[-1]) < self.bs:
            blocks.pop()
        hashes = _engine_hasher.chain_bytes(blocks)
        locs = local_path(tokens, self.bs)
        start = 0
        while start < len(hashes) and hashes[start] in self.blocks:
            start += 1
        if start == len(hashes):
            return
        parent = hashes[start - 1] if start else None
        for i in range(start, len(hashes)):
            self.blocks[hashes[i]] = (hashes[i - 1] if i else None, tuple(locs[: i + 1]), level)
        self._publish(
            Stored(
                parent_hash=parent,
                blocks=tuple(
                    StoredBlock(block_hash=h, token_ids=b, cache_level=level)
                    for h, b in zip(hashes[start:], blocks[start:], strict=True)
                ),
            )
        )

    def evict_leaves(self, n: int) -> None:
        """Remove up to ``n`` cached blocks that have no cached child."""
        parents = {p for p, _, _ in self.blocks.values() if p is not None}
        leaves = [h for h in self.blocks if h not in parents][:n]
        if leaves:
            for h in leaves:
                del self.blocks[h]
            self._publish(Removed(block_hashes=tuple(leaves)))

    def depths(self, tokens: Sequence[int]) -> tuple[int, int, int, int]:
        """What Dynamo reports for this rank: blocks matched on GPU, GPU or host, GPU, host
        or disk, any tier."""
        locs = local_path(tokens, self.bs)
        by_path = {path: level for _, path, level in self.blocks.values()}
        out = []
        for max_level in (0, 1, 2, 99):
            d = 0
            while d < len(locs) and by_path.get(tuple(locs[: d + 1]), 100) <= max_level:
                d += 1
            out.append(d)
        return out[0], out[1], out[2], out[3]

    def close(self) -> None:
        self.pub.close()


def expected_answer(
    engines: dict[tuple[int, int], Engine], tokens: Sequence[int], bs: int
) -> dict[str, Any]:
    """Dynamo's ``/query`` answer for ``tokens`` over ``{(instance, rank): engine}``."""
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    for (inst, rank), eng in sorted(engines.items()):
        gpu, host, disk, depth = eng.depths(tokens)
        if not depth:
            continue
        i, r = str(inst), str(rank)
        e = instances.setdefault(i, {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0})
        if gpu:
            scores.setdefault(i, {})[r] = gpu * bs
            e["dp"][r] = gpu * bs
        e["longest_matched"] = max(e["longest_matched"], depth * bs)
        e["gpu"] = max(e["gpu"], gpu * bs)
        e["cpu"] = max(e["cpu"], host * bs)
        e["disk"] = max(e["disk"], disk * bs)
    return {"scores": scores, "frequencies": [], "instances": instances}


async def eventually(check: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """Run the blocking ``check`` in a thread (a service on this loop keeps answering) until
    it returns a truthy value without an AssertionError; returns that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = await asyncio.to_thread(check)
            if value:
                return value
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.05)

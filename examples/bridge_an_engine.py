"""Publish KV events in vLLM's wire format, follow them as a router would, route a request.

Two workers publish their KV-cache events exactly as vLLM engines do (ZMQ PUB + a replay
ROUTER each; here kvstream's own ``vllm://`` sink plays the engines, so no GPU is needed).
A consumer that starts late follows both with ``vllm://`` sources — what it missed comes back
through replay — builds one prefix index and sends a request to the worker that holds its
prefix. Point the same sources at real vLLM or SGLang engines (``--kv-events-config``, see
README "Connect your engine") and nothing else changes.

Run: python examples/bridge_an_engine.py
"""

from __future__ import annotations

import asyncio
import socket

from kvstream.events import EventEmitter, SourceId
from kvstream.hashing import get_hasher
from kvstream.index import PrefixIndex, Router, open_source
from kvstream.pipeline import Pipeline
from kvstream.sink import create_sink

ALGO = "blake3_64"  # what the "engines" hash with; the consumer is told the same
BLOCK = 4
SYSTEM_PROMPT = list(range(100, 116))  # 4 blocks every request starts with


def free_port_pair() -> int:
    """A port p with p and p + 1 free (publisher and replay socket)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return int(port)


def engine_batches(worker: str, prompts: list[list[int]]) -> list:
    """What a worker's cache announces after serving ``prompts`` (one batch per prompt)."""
    hasher = get_hasher(ALGO)
    emitter = EventEmitter(SourceId(instance_id=worker), hash_algo=ALGO)
    # vLLM has no "created" event; the export records the group's attention kind from it
    emitter.created(0, window_size=8192, num_blocks_per_cache_level=[1024], tokens_per_block=BLOCK)
    out = []
    for prompt in prompts:
        blocks = [prompt[i : i + BLOCK] for i in range(0, len(prompt) - BLOCK + 1, BLOCK)]
        parent = None
        for tokens, h in zip(blocks, hasher.chain_bytes(blocks), strict=True):
            emitter.stored(0, parent_hash=parent, block_hash=h, token_ids=tokens)
            parent = h
        batch = emitter.flush()
        if batch is not None:
            out.append(batch)
    return out


async def main() -> None:
    workers = {
        "worker-a": [[*SYSTEM_PROMPT, 1, 2, 3, 4, 5, 6, 7, 8]],
        "worker-b": [
            [*SYSTEM_PROMPT, 9, 9, 9, 9],
            [*SYSTEM_PROMPT, 42, 43, 44, 45, 46, 47, 48, 49],
        ],
    }
    ports = {w: free_port_pair() for w in workers}
    sinks = {w: create_sink(f"vllm://127.0.0.1:{p}?replay={p + 1}") for w, p in ports.items()}
    pipelines = {w: Pipeline([s]) for w, s in sinks.items()}
    for pipe in pipelines.values():
        await pipe.start()
    for w, prompts in workers.items():  # published before anyone listens
        for batch in engine_batches(w, prompts):
            await pipelines[w].put(batch)
        await pipelines[w].flush(5)

    index = PrefixIndex()
    expected = {w: len(engine_batches(w, p)) for w, p in workers.items()}
    for w, port in ports.items():
        url = f"vllm://127.0.0.1:{port}?replay={port + 1}&hash_algo={ALGO}&instance={w}"
        async with open_source(url) as source:  # from=0: replay what it missed, at once
            got = 0
            while got < expected[w]:
                item = await source.read(10)
                assert item is not None, f"{w}: only {got} batches"
                index.apply(item.batch)
                got += 1
            print(
                f"{w}: {got} batches from {url.split('?', maxsplit=1)[0]} (replayed: "
                f"{source.subscriber.stats[0].replayed})"
            )

    router = Router(index)
    request = [*SYSTEM_PROMPT, 42, 43, 44, 45, 46, 47, 48, 49, 50]
    decision = router.route(request)
    print(
        f"request of {len(request)} tokens -> {decision.worker.instance_id} "
        f"({decision.predicted_blocks} cached blocks to reuse)"
    )
    assert decision.worker.instance_id == "worker-b"
    assert decision.predicted_blocks == 6
    for pipe in pipelines.values():
        await pipe.aclose()


if __name__ == "__main__":
    asyncio.run(main())

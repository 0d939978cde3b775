"""Run the index service, register two engines, and query it as a router would over HTTP.

Two "engines" publish KV events in vLLM's wire format (kvstream's ``vllm://`` sink plays them:
ZMQ PUB + replay ROUTER each, as ``vllm serve --kv-events-config`` does). ``IndexService`` is
what ``kvstream serve`` runs: here it starts in-process on a free port, the engines are
registered with Dynamo's ``POST /register`` (what they published before comes back through
replay), and ``kvstream.serve.Client`` asks ``/query`` and ``/route`` what a Go or Rust router
would ask with curl.

Run: python examples/serve_an_index.py
"""

from __future__ import annotations

import asyncio
import socket

from kvstream.events import EventEmitter, SourceId
from kvstream.hashing import get_hasher
from kvstream.pipeline import Pipeline
from kvstream.serve import Client, IndexService, ServeConfig
from kvstream.sink import create_sink

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
    """What a worker's cache announces after serving ``prompts``."""
    hasher = get_hasher("blake3_64")
    emitter = EventEmitter(SourceId(instance_id=worker), hash_algo="blake3_64")
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
    engines = {
        1: [[*SYSTEM_PROMPT, 1, 2, 3, 4, 5, 6, 7, 8]],
        2: [[*SYSTEM_PROMPT, 9, 9, 9, 9], [*SYSTEM_PROMPT, 42, 43, 44, 45, 46, 47, 48, 49]],
    }
    ports = {e: free_port_pair() for e in engines}
    pipelines = {
        e: Pipeline([create_sink(f"vllm://127.0.0.1:{p}?replay={p + 1}")]) for e, p in ports.items()
    }
    for e, prompts in engines.items():  # published before the service exists
        await pipelines[e].start()
        for batch in engine_batches(f"engine-{e}", prompts):
            await pipelines[e].put(batch)
        await pipelines[e].flush(5)

    async with IndexService(ServeConfig(port=0, block_size=BLOCK)) as service:
        client = Client(service.url)
        for e, port in ports.items():
            await asyncio.to_thread(
                client.register,
                e,
                f"tcp://127.0.0.1:{port}",
                replay_endpoint=f"tcp://127.0.0.1:{port + 1}",
            )
        while not (await asyncio.to_thread(client.ready))["ready"]:
            await asyncio.sleep(0.05)
        request = [*SYSTEM_PROMPT, 42, 43, 44, 45, 7, 7]
        answer = {}
        for _ in range(100):  # the replays land within milliseconds of /ready
            answer = await asyncio.to_thread(client.query, request)
            if answer["scores"].get("2"):
                break
            await asyncio.sleep(0.05)
        decision = await asyncio.to_thread(client.route, request)
        client.close()
    print(f"service at {service.url}")
    print(f"POST /query  -> scores (matched tokens per instance and DP rank): {answer['scores']}")
    print(f"POST /route  -> instance {decision['instance_id']} rank {decision['dp_rank']}")
    assert answer["scores"] == {"1": {"0": 16}, "2": {"0": 20}}, answer
    assert decision["instance_id"] == "2"
    for pipe in pipelines.values():
        await pipe.aclose()


if __name__ == "__main__":
    asyncio.run(main())

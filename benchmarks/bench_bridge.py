"""Bridge benchmark: vLLM-format KV events in, kvstream batches out, against raw msgspec.

What an operator runs is ``kvstream bridge vllm://...``; what they would write instead is a
pyzmq SUB socket decoding vLLM's ``KVEventBatch`` with msgspec. Both consume the same frames:

(a) **baseline**: msgspec decoding each payload into vLLM 0.33's own structs (imported from
    vLLM when it is installed, else identical struct declarations), counting blocks;
(b) **kvstream decode**: :func:`kvstream.engines.vllm.decode_payload` + ``EngineStream`` —
    every engine event as a validated kvstream ``EventBatch`` with ids, windows, sources;
(c) **kvstream bridge**: (b) plus Avro encoding of every batch (what each sink pays).

Rows ``decode_payload only`` and ``EngineStream.convert only`` split (b) into its two halves.
(b) and (c) use kvstream's optional C extensions (``kvstream.events._trusted_native``,
``kvstream.engines._wire_native``) when they are built; run with ``KVSTREAM_NO_NATIVE=1`` to
measure the pure-Python fallback.

Workload, one payload per scheduler step as vLLM publishes it (``--steps`` steps): 8 prefill
stores of 32 blocks, 64 decode stores of 1 block (16 tokens per block, ids from a 128k
vocabulary) and 40 single-hash ``BlockRemoved`` events (vLLM does not coalesce removals).

Two measurements: **offline** (payload bytes already in memory; thread CPU time, best of
``--rounds``) and **live** (a publisher process binds a PUB socket and sends every frame —
vLLM's real ``ZmqEventPublisher`` when vLLM is importable, else a plain pyzmq PUB sending the
same frames — while this process follows it with ``EngineSource``; wall time from the first
frame to the last). Prints blocks/s and the ratio to the baseline. Goal: >= 500k blocks/s
end to end on one core.

Usage: ``python benchmarks/bench_bridge.py [--steps 400] [--rounds 5] [--no-live]``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstream.codec import AvroCodec
from kvstream.engines.stream import EngineStream
from kvstream.engines.vllm import decode_payload
from kvstream.events.trusted import NATIVE_AVAILABLE

VOCAB = 128_000
BLOCK = 16


# vLLM 0.33's declarations (peers.md §1.2), for machines without vLLM.
class _Event(msgspec.Struct, omit_defaults=True, tag=True):  # type: ignore[call-arg]
    pass


class _BlockStored(_Event, tag="BlockStored"):  # type: ignore[call-arg]
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _BlockRemoved(_Event, tag="BlockRemoved"):  # type: ignore[call-arg]
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _AllBlocksCleared(_Event, tag="AllBlocksCleared"):  # type: ignore[call-arg]
    pass


class _KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    ts: float
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]
    data_parallel_rank: int | None = None


def vllm_structs() -> tuple[Any, Any, Any, Any, str]:
    """vLLM's own KVEventBatch and event structs, or identical declarations."""
    try:
        from vllm.distributed.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )

        return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared, "vllm 0.33 structs"
    except ImportError:
        pass

    return _KVEventBatch, _BlockStored, _BlockRemoved, _AllBlocksCleared, "msgspec structs (vLLM's)"


def make_batches(steps: int, seed: int = 0) -> tuple[list[Any], int]:
    """vLLM KVEventBatch objects for ``steps`` scheduler steps, and their block count."""
    batch_cls, stored, removed, _, _ = vllm_structs()
    rng = random.Random(seed)
    next_hash = 1
    live: list[int] = []
    out = []
    blocks = 0
    for step in range(steps):
        events: list[Any] = []
        for n in [32] * 8 + [1] * 64:
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            parent = rng.choice(live) if live and rng.random() < 0.5 else None
            tokens = [rng.randrange(VOCAB) for _ in range(n * BLOCK)]
            events.append(
                stored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=BLOCK,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
            live.extend(hashes)
            blocks += n
        for _ in range(40):
            if live:
                h = live.pop(rng.randrange(len(live)))
                events.append(removed(block_hashes=[h], medium="GPU", group_idx=0))
                blocks += 1
        out.append(batch_cls(ts=float(step), events=events, data_parallel_rank=0))
    return out, blocks


def _cpu_best(fn: Callable[[], None], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        gc.disable()
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
        gc.enable()
    return best


def offline(payloads: list[bytes], blocks: int, rounds: int) -> dict[str, float]:
    batch_cls = vllm_structs()[0]
    dec = msgspec.msgpack.Decoder(batch_cls)
    codec = AvroCodec()

    def baseline() -> None:
        n = 0
        for p in payloads:
            for ev in dec.decode(p).events:
                n += len(ev.block_hashes)
        assert n == blocks

    def kv_decode() -> None:
        s = EngineStream("vllm@bench", 0, "vllm_sha256_64")
        for p in payloads:
            s.convert(decode_payload(p, width=8))

    def kv_decode_only() -> None:
        for p in payloads:
            decode_payload(p, width=8)

    wires = [decode_payload(p, width=8) for p in payloads]

    def kv_convert_only() -> None:
        s = EngineStream("vllm@bench", 0, "vllm_sha256_64")
        for w in wires:
            s.convert(w)

    def kv_bridge() -> None:
        s = EngineStream("vllm@bench", 0, "vllm_sha256_64")
        for p in payloads:
            codec.encode(s.convert(decode_payload(p, width=8)))

    return {
        "baseline": blocks / _cpu_best(baseline, rounds),
        "kvstream decode": blocks / _cpu_best(kv_decode, rounds),
        "  decode_payload only": blocks / _cpu_best(kv_decode_only, rounds),
        "  EngineStream.convert only": blocks / _cpu_best(kv_convert_only, rounds),
        "kvstream decode + Avro": blocks / _cpu_best(kv_bridge, rounds),
    }


def _publish(port: int, steps: int, ready: Any, go: Any, real: bool) -> None:
    batches, _ = make_batches(steps)
    if real:
        from vllm.config.kv_events import KVEventsConfig
        from vllm.distributed.kv_events import EventPublisherFactory

        cfg = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{port}",
            hwm=10 * steps,
            max_queue_size=10 * steps,
        )
        pub = EventPublisherFactory.create(cfg, data_parallel_rank=0)
        ready.set()
        go.wait()
        for b in batches:
            pub.publish(b)
        pub.shutdown()
        return
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 10 * steps)
    sock.bind(f"tcp://127.0.0.1:{port}")
    enc = msgspec.msgpack.Encoder()
    frames = [[b"", seq.to_bytes(8, "big"), enc.encode(b)] for seq, b in enumerate(batches)]
    ready.set()
    go.wait()
    for f in frames:
        sock.send_multipart(f)
    time.sleep(1.0)
    sock.close()
    ctx.term()


async def _follow(port: int, n_frames: int) -> tuple[float, int]:
    from kvstream.events.model import Removed, Stored
    from kvstream.index.sources.engine import EngineSource

    src = EngineSource(f"vllm://127.0.0.1:{port}?hwm=0&from=latest")
    blocks = 0
    seen = 0
    t0 = None
    async with src:
        while seen < n_frames:
            item = await src.read(30)
            if item is None:
                break
            if t0 is None:
                t0 = time.perf_counter()
            for e in item.batch.events:
                if isinstance(e.data, Stored):
                    blocks += len(e.data.blocks)
                elif isinstance(e.data, Removed):
                    blocks += len(e.data.block_hashes)
            seen += 1
    return time.perf_counter() - (t0 or time.perf_counter()), blocks


def live(steps: int) -> tuple[str, float, float, int]:
    try:
        import vllm.distributed.kv_events  # noqa: F401

        real = True
    except ImportError:
        real = False
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_publish, args=(port, steps, ready, go, real))
    proc.start()
    ready.wait(120)

    async def run() -> tuple[float, int]:
        task = asyncio.create_task(_follow(port, steps))
        await asyncio.sleep(0.5)  # subscribe before the first frame
        go.set()
        return await task

    elapsed, blocks = asyncio.run(run())
    proc.join(30)
    who = "vLLM ZmqEventPublisher" if real else "pyzmq PUB (vLLM frames)"
    return who, elapsed, blocks / elapsed if elapsed else 0.0, blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-live", action="store_true")
    args = ap.parse_args()
    batches, blocks = make_batches(args.steps)
    enc = msgspec.msgpack.Encoder()
    payloads = [enc.encode(b) for b in batches]
    structs = vllm_structs()[4]
    size = sum(map(len, payloads))
    print(
        f"{args.steps} vLLM batches, {blocks:,} blocks ({size / 1e6:.1f} MB msgpack); "
        f"baseline decodes with {structs}"
    )
    native = "loaded" if NATIVE_AVAILABLE else "not loaded (pure Python)"
    print(f"kvstream C extensions: {native}")
    rates = offline(payloads, blocks, args.rounds)
    base = rates["baseline"]
    print(f"{'offline (one core, CPU time)':40s} {'blocks/s':>12s} {'vs baseline':>12s}")
    for name, rate in rates.items():
        print(f"{name:40s} {rate:12,.0f} {rate / base:11.2f}x")
    if not args.no_live:
        who, elapsed, rate, n = live(args.steps)
        print(
            f"live from {who}: {n:,} blocks in {elapsed:.2f} s = {rate:,.0f} blocks/s, "
            f"{args.steps / elapsed:,.0f} frames/s (EngineSource: SUB + decode + convert)"
        )


if __name__ == "__main__":
    main()

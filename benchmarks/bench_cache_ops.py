"""Cost of the cache manager's operations at several pool sizes (it should not grow).

    python benchmarks/bench_cache_ops.py [--sizes 1000,10000,100000] [--ops N]
        [--blocks-per-request B] [--tokens-per-block T] [--events on|off]

For each pool size the pool is first filled with evictable cached blocks (so every new block
evicts one: the steady state of a busy server, with the hash map and LRU at full size). Then
it cycles through batches of requests, timing each operation over the whole batch:

- ``add miss``: ``add_request`` of a fresh prompt of B full blocks plus one token (hashing, B
  commits, B+1 allocations that each evict an LRU block);
- ``decode``: ``append_tokens`` of one token that stays in the partial block (fast path);
- ``commit``: ``append_tokens`` of the tokens that fill the partial block (one commit);
- ``free``: ``free_request`` (B+2 blocks back to the LRU);
- ``add hit``: ``add_request`` of a prompt whose B blocks are all cached (B touches).

Metadata-only, one full-attention group, events flushed after every batch. The last column
compares the largest pool with the smallest (1.0 = flat; the free queue and maps are O(1)).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstream._types import TokenIds
from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.events import SourceId
from kvstream.workloads import pseudo_tokens

OPS = ["add miss", "decode", "commit", "free", "add hit"]


def measure(size: int, args: argparse.Namespace) -> dict[str, float]:
    tpb, nblk = args.tokens_per_block, args.blocks_per_request
    cfg = CacheConfig(
        tokens_per_block=tpb,
        groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=size)],
        metadata_only=True,
        events=args.events == "on",
        hash_algo=args.hash_algo,
        event_capacity=1 << 20,
    )
    mgr = KVCacheManager(cfg, source=SourceId(instance_id="ops"))
    counter = 0

    def prompt() -> TokenIds:
        nonlocal counter
        counter += 1
        return pseudo_tokens(b"ops%d" % counter, nblk * tpb + 1, 32000)

    # Fill the pool with evictable cached blocks.
    while mgr.stats().groups[0].cached_blocks < size - nblk - 2:
        mgr.add_request("fill", prompt())
        mgr.free_request("fill")
    mgr.flush_events()

    batch = max(1, min(64, size // (4 * (nblk + 2))))
    totals = dict.fromkeys(OPS, 0.0)
    counts = dict.fromkeys(OPS, 0)
    fill = TokenIds(range(tpb - 2))
    one = TokenIds([7])
    done = 0
    while done < args.ops:
        prompts = [prompt() for _ in range(batch)]
        ids = [f"r{done + i}" for i in range(batch)]
        timings = []
        t0 = time.perf_counter()
        for rid, p in zip(ids, prompts, strict=True):
            mgr.add_request(rid, p)
        timings.append(("add miss", time.perf_counter() - t0))
        t0 = time.perf_counter()
        for rid in ids:
            mgr.append_tokens(rid, one)
        timings.append(("decode", time.perf_counter() - t0))
        t0 = time.perf_counter()
        for rid in ids:
            mgr.append_tokens(rid, fill)
        timings.append(("commit", time.perf_counter() - t0))
        t0 = time.perf_counter()
        for rid in ids:
            mgr.free_request(rid)
        timings.append(("free", time.perf_counter() - t0))
        t0 = time.perf_counter()
        for rid, p in zip(ids, prompts, strict=True):
            mgr.add_request(rid, p)
        timings.append(("add hit", time.perf_counter() - t0))
        for rid in ids:
            mgr.free_request(rid)
        mgr.flush_events()
        for op, dt in timings:
            totals[op] += dt
            counts[op] += batch
        done += batch
    g = mgr.stats().groups[0]
    assert g.cached_blocks <= size
    assert g.evictions > 0
    return {op: 1e6 * totals[op] / counts[op] for op in OPS}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--ops", type=int, default=3000, help="requests per pool size")
    p.add_argument("--blocks-per-request", type=int, default=8)
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--hash-algo", default="blake3")
    p.add_argument("--events", choices=["on", "off"], default="on")
    p.add_argument(
        "--gc",
        choices=["on", "off"],
        default="on",
        help="off: disable Python's cyclic GC while measuring (its full passes scale with the "
        "number of live objects, i.e. with the pool, and hide the O(1) cost of the operations)",
    )
    args = p.parse_args()
    if args.gc == "off":
        gc.disable()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {size: measure(size, args) for size in sizes}
    b = args.blocks_per_request
    print(
        f"us per operation ({b} blocks per request, {args.tokens_per_block}-token blocks, "
        f"events {args.events}, gc {args.gc})"
    )
    print(f"{'pool blocks':>12} " + " ".join(f"{op:>10}" for op in OPS))
    for size in sizes:
        print(f"{size:12d} " + " ".join(f"{results[size][op]:10.2f}" for op in OPS))
    lo, hi = results[sizes[0]], results[sizes[-1]]
    print(f"{'ops/s':>12} " + " ".join(f"{1e6 / hi[op]:10.0f}" for op in OPS) + f"  ({sizes[-1]})")
    print(
        f"{'ratio':>12} "
        + " ".join(f"{hi[op] / lo[op]:10.2f}" for op in OPS)
        + f"  ({sizes[-1]} / {sizes[0]} blocks; 1.00 = flat)"
    )


if __name__ == "__main__":
    main()

"""Metadata-only replay of a Mooncake trace on one KV-cache manager: requests/s and hit ratio.

    python benchmarks/bench_mooncake_replay.py [--trace conversation|synthetic] [--limit N]
        [--events on|off] [--hash-algo NAME] [--tokens-per-block 512]

Every row becomes its prompt tokens (each hash id -> a fixed pseudo-random 512-token list,
kvstream.workloads.mooncake); the manager (one full-attention group, an unlimited pool, real
hashing of the real tokens) adds the request, hands its events over and frees it. With
512-token blocks its prefix hit ratio must equal the trace's ceiling, computed in the same
run from the hash ids alone: a full block hits when its id was seen as a full block before
(conversation: 105,592 of 276,491 = 38.2%). For reference it also prints the published
figure that counts every hash id, partial last blocks included (36.6%), which a cache that
only shares full blocks cannot reach.

Baseline, same run: building the same tokens and hashing them (``hasher.chain_bytes``) with
no cache at all; ``x baseline`` = replay time / baseline time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.events import SourceId
from kvstream.workloads import MOONCAKE_BLOCK_TOKENS, MooncakeTokens, TraceRow, load_trace


def ceilings(rows: list[TraceRow]) -> tuple[int, int, int, int]:
    """(full-block hits, full blocks, id hits, ids) from the hash ids alone."""
    seen_full: set[int] = set()
    seen_any: set[int] = set()
    hits = full = id_hits = ids = 0
    for r in rows:
        nf = r.input_length // MOONCAKE_BLOCK_TOKENS
        cap = min(nf, (r.input_length - 1) // MOONCAKE_BLOCK_TOKENS)
        k = 0
        while k < cap and r.hash_ids[k] in seen_full:
            k += 1
        hits += k
        full += nf
        id_hits += sum(1 for h in r.hash_ids if h in seen_any)
        ids += len(r.hash_ids)
        seen_full.update(r.hash_ids[:nf])
        seen_any.update(r.hash_ids)
    return hits, full, id_hits, ids


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trace", default="conversation")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N rows")
    p.add_argument("--events", choices=["on", "off"], default="on")
    p.add_argument("--hash-algo", default="blake3")
    p.add_argument("--tokens-per-block", type=int, default=MOONCAKE_BLOCK_TOKENS)
    args = p.parse_args()

    rows = load_trace(args.trace, limit=args.limit)
    tpb = args.tokens_per_block
    total_blocks = sum(-(-r.input_length // tpb) for r in rows)
    cfg = CacheConfig(
        tokens_per_block=tpb,
        groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=total_blocks)],
        hash_algo=args.hash_algo,
        metadata_only=True,
        events=args.events == "on",
        event_capacity=1 << 20,
    )
    hasher = cfg.make_hasher()

    tokens = MooncakeTokens()
    t0 = time.perf_counter()
    for r in rows:
        prompt = tokens.prompt(r)
        step = 4 * tpb
        raw = prompt.raw
        hasher.chain_bytes(
            [
                type(prompt).from_bytes(raw[i : i + step])
                for i in range(0, len(raw) - step + 1, step)
            ]
        )
    baseline = time.perf_counter() - t0

    mgr = KVCacheManager(cfg, source=SourceId(instance_id="replay"))
    tokens = MooncakeTokens()
    events = batches = blocks_announced = 0
    t0 = time.perf_counter()
    for r in rows:
        rid = f"m{r.index}"
        mgr.add_request(rid, tokens.prompt(r))
        batch = mgr.flush_events()
        if batch is not None:
            events += len(batch.events)
            batches += 1
            blocks_announced += sum(
                len(e.data.blocks) for e in batch.events if e.data.type == "stored"
            )
        mgr.free_request(rid)
    replay = time.perf_counter() - t0

    g = mgr.stats().groups[0]
    hits, full, id_hits, ids = ceilings(rows)
    print(
        f"trace {args.trace}: {len(rows)} requests, {tpb}-token blocks, hash {hasher.name}, "
        f"events {args.events}"
    )
    print(f"{'':28} {'seconds':>8} {'req/s':>9} {'x baseline':>10}")
    base_rate = len(rows) / baseline
    print(f"{'baseline (tokens + hashing)':28} {baseline:8.2f} {base_rate:9.0f} {1.0:10.2f}")
    print(
        f"{'manager replay':28} {replay:8.2f} {len(rows) / replay:9.0f} {replay / baseline:10.2f}"
    )
    print(
        f"events: {events:,} in {batches:,} batches, {blocks_announced:,} blocks announced, "
        f"{g.cached_blocks:,} cached blocks, {g.evictions} evictions"
    )
    print(
        f"manager prefix hits: {g.hit_blocks:,} of {g.queried_blocks:,} full blocks "
        f"= {g.hit_ratio:.1%}"
    )
    if tpb == MOONCAKE_BLOCK_TOKENS:
        ok = (g.hit_blocks, g.queried_blocks) == (hits, full)
        print(
            f"trace ceiling (hash ids):  {hits:,} of {full:,} full blocks = {hits / full:.1%}"
            f"  -> {'EQUAL' if ok else 'MISMATCH'}"
        )
        print(
            f"published, every hash id incl. partial last blocks: {id_hits:,} of {ids:,} "
            f"= {id_hits / ids:.1%}"
        )
        if not ok:
            sys.exit(1)


if __name__ == "__main__":
    main()

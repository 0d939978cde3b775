"""Prefix index: ingest (stored blocks/s) and match latency (64 workers, 8k-token requests),
against the naive index TensorRT-LLM's router keeps (a flat set of hashes per worker, matched
by walking each worker's set until the first miss), measured in the same run.

    python benchmarks/bench_index.py [--workers 64] [--tokens 8192] [--block-size 32]
        [--requests 48] [--queries 2000] [--repeat 3] [--seed 0] [--key-mode engine|tokens]

Workload: ``--requests`` distinct requests per worker drawn from a pool that shares a few
system prompts (a quarter of each request); every worker caches a random-length prefix of
each of its requests, announced as an engine would (only blocks it did not hold, with their
parent). Batches are built (and validated) before timing: ingest measures the index, not
decoding (the "columns" column: the same batches encoded and decoded into the columns the file
and Kafka sources hand over, before timing). Queries are requests of the pool; each worker
holds a different prefix of them, which is the hard case for the index's search (many
distinct depths).

``--key-mode tokens`` measures the token-keyed index (``PrefixIndex(key_mode="tokens")``):
ingest then hashes every stored block's tokens (each block's tokens derive from its identity,
so shared blocks share tokens), and queries are the requests' canonical keys.

Targets (issue 6): ingest >= 1M stored blocks/s on one core, match p99 <= 50 us. Match
latency is the index lookup of already-hashed request blocks ("hash once per algorithm and
block size"); hashing the request and a full router decision are reported as extra rows.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstream._types import TokenIds
from kvstream.codec import AvroCodec, schema_registry
from kvstream.codec.columnar import decode_columns_message
from kvstream.events.columns import ColumnBatch
from kvstream.events.model import (
    Created,
    EventBatch,
    KVCacheEvent,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
)
from kvstream.hashing import get_hasher, split_blocks
from kvstream.index import (
    CANONICAL_ALGO,
    DomainKey,
    PrefixIndex,
    RequestHasher,
    Router,
    RouterConfig,
    WorkerKey,
)
from kvstream.index.keys import request_keys

ALGO = "blake3_64"


def block_hash(*key: int) -> bytes:
    return hashlib.blake2b(repr(key).encode(), digest_size=8).digest()


def block_tokens(h: bytes, tpb: int) -> TokenIds:
    """The block's token ids: derived from its hash, so equal blocks have equal tokens."""
    return TokenIds.from_bytes(hashlib.shake_128(h).digest(4 * tpb))


class Pool:
    """Requests of ``n`` blocks; request r shares its first quarter with system prompt r % 8."""

    def __init__(self, n_blocks: int, size: int) -> None:
        self.n = n_blocks
        self.shared = n_blocks // 4
        self.chains = [self._chain(r) for r in range(size)]

    def _chain(self, r: int) -> list[bytes]:
        s = r % 8
        return [block_hash(s, i) if i < self.shared else block_hash(s, r, i) for i in range(self.n)]


def build_stream(
    pool: Pool, workers: int, per_worker: int, tpb: int, rng: random.Random, *, evict: bool
) -> tuple[list[EventBatch], int, int]:
    """Batches of every worker; returns (batches, stored blocks, removed blocks)."""
    toks: dict[bytes, TokenIds] = {}
    out: list[EventBatch] = []
    stored = removed = 0
    for w in range(workers):
        src = SourceId(instance_id=f"worker-{w}", incarnation=1)
        eid = 0
        evs = [
            KVCacheEvent(
                event_id=eid,
                hash_algo=ALGO,
                window_size=131072,
                data=Created(num_blocks_per_cache_level=(1 << 20,), tokens_per_block=tpb),
            )
        ]
        eid += 1
        held: set[bytes] = set()
        for r in rng.sample(range(len(pool.chains)), per_worker):
            chain = pool.chains[r][: rng.randint(1, pool.n)]
            k = 0
            while k < len(chain) and chain[k] in held:
                k += 1
            new = chain[k:]
            if new:
                blocks = tuple(
                    StoredBlock.model_construct(
                        block_hash=h,
                        token_ids=toks.get(h) or toks.setdefault(h, block_tokens(h, tpb)),
                        cache_level=0,
                    )
                    for h in new
                )
                data = Stored.model_construct(
                    type="stored", parent_hash=chain[k - 1] if k else None, blocks=blocks
                )
                evs.append(
                    KVCacheEvent.model_construct(
                        event_id=eid,
                        hash_algo=ALGO,
                        layer_group_id=0,
                        window_size=131072,
                        data=data,
                    )
                )
                eid += 1
                held.update(new)
                stored += len(new)
            if evict and len(evs) >= 8:
                # leaf-first eviction of this request's private tail, as an LRU cache does
                tail = [h for h in new[::-1] if h not in pool.chains[r % 8][: pool.shared]]
                if tail:
                    evs.append(
                        KVCacheEvent.model_construct(
                            event_id=eid,
                            hash_algo=ALGO,
                            layer_group_id=0,
                            window_size=131072,
                            data=Removed.model_construct(
                                type="removed", block_hashes=tuple(tail), cache_level=None
                            ),
                        )
                    )
                    eid += 1
                    held.difference_update(tail)
                    removed += len(tail)
            if len(evs) >= 16:
                out.append(
                    EventBatch.model_construct(
                        source=src, ts_ns=0, schema_version=2, events=tuple(evs)
                    )
                )
                evs = []
        if evs:
            out.append(
                EventBatch.model_construct(source=src, ts_ns=0, schema_version=2, events=tuple(evs))
            )
    return out, stored, removed


def ingest_index(batches: list[EventBatch], mode: str) -> tuple[float, PrefixIndex]:
    idx = PrefixIndex(key_mode=mode)
    gc.collect()
    t0 = time.perf_counter()
    for b in batches:
        idx.apply(b)
    return time.perf_counter() - t0, idx


def ingest_columns(cols: list[ColumnBatch], mode: str) -> float:
    """Ingest of the columns the file and Kafka sources hand over (decoded before timing)."""
    idx = PrefixIndex(key_mode=mode)
    gc.collect()
    t0 = time.perf_counter()
    for c in cols:
        idx.apply(c)
    return time.perf_counter() - t0


def ingest_naive(batches: list[EventBatch]) -> tuple[float, dict[str, set[bytes]]]:
    """TensorRT-LLM's router: stored adds every hash, removed discards."""
    sets: dict[str, set[bytes]] = {}
    gc.collect()
    t0 = time.perf_counter()
    for b in batches:
        s = sets.get(b.source.instance_id)
        if s is None:
            s = sets[b.source.instance_id] = set()
        for ev in b.events:
            d = ev.data
            if d.type == "stored":
                for blk in d.blocks:  # type: ignore[union-attr]
                    s.add(blk.block_hash)
            elif d.type == "removed":
                for h in d.block_hashes:  # type: ignore[union-attr]
                    s.discard(h)
    return time.perf_counter() - t0, sets


def naive_match(sets: dict[str, set[bytes]], hashes: list[bytes]) -> dict[str, int]:
    """Walk every worker's set until the first miss (TensorRT-LLM's PrefixBlockSet)."""
    out = {}
    for w, s in sets.items():
        d = 0
        for h in hashes:
            if h not in s:
                break
            d += 1
        if d:
            out[w] = d
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def add_workload_args(ap: argparse.ArgumentParser, *, queries: int) -> None:
    """The index workload's options."""
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--requests", type=int, default=48, help="requests cached per worker")
    ap.add_argument("--pool", type=int, default=256, help="distinct requests in the pool")
    ap.add_argument("--queries", type=int, default=queries)
    ap.add_argument("--seed", type=int, default=0)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(ap, queries=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--key-mode", choices=("engine", "tokens"), default="engine")
    args = ap.parse_args()
    mode = args.key_mode
    rng = random.Random(args.seed)
    tpb = args.block_size
    n_blocks = args.tokens // tpb
    pool = Pool(n_blocks, args.pool)

    print(
        f"workers {args.workers}, {args.tokens}-token requests = {n_blocks} blocks of {tpb}, "
        f"{args.requests} cached requests per worker, key mode {mode}, "
        f"python {sys.version.split()[0]}"
    )
    print("\n== ingest (one core; batches prebuilt) ==")
    print(
        f"{'stream':36} {'blocks':>9} {'index M/s':>10} {'columns M/s':>12} {'naive M/s':>10} "
        f"{'index/naive':>12}"
    )
    codec = AvroCodec()
    registry = schema_registry()
    keep: PrefixIndex | None = None
    sets: dict[str, set[bytes]] = {}
    best_store = 0.0
    for evict in (False, True):
        batches, stored, removed = build_stream(
            pool, args.workers, args.requests, tpb, random.Random(args.seed), evict=evict
        )
        cols = [decode_columns_message(codec.encode(b), registry).columns for b in batches]
        t_idx = [ingest_index(batches, mode)[0] for _ in range(args.repeat)]
        t_col = [ingest_columns(cols, mode) for _ in range(args.repeat)]
        t_nv = [ingest_naive(batches)[0] for _ in range(args.repeat)]
        total = stored + removed
        label = "stored blocks" if not evict else "stored + removed blocks"
        for name, ti, tc, tn in (
            ("first run", t_idx[0], t_col[0], t_nv[0]),
            (f"best of {args.repeat}", min(t_idx), min(t_col), min(t_nv)),
        ):
            print(
                f"{label + ', ' + name:36} {total:9,} {total / ti / 1e6:10.2f} "
                f"{total / tc / 1e6:12.2f} {total / tn / 1e6:10.2f} {tn / ti:12.2f}"
            )
        if not evict:
            best_store = stored / min(t_idx)
            _, keep = ingest_index(batches, mode)
            _, sets = ingest_naive(batches)
    assert keep is not None

    print(f"\n== match: {args.queries} queries over {args.workers} workers (hashes precomputed) ==")
    domain = DomainKey(ALGO if mode == "engine" else CANONICAL_ALGO, tpb, 0)
    picks = [rng.randrange(len(pool.chains)) for _ in range(args.queries)]
    queries = [pool.chains[r] for r in picks]
    keyed = queries  # what the index is queried with: engine hashes, or canonical keys
    if mode == "tokens":
        keys = [
            request_keys(b"".join(block_tokens(h, tpb).raw for h in c), tpb) for c in pool.chains
        ]
        keyed = [keys[r] for r in picks]
    for q, k in zip(queries[:50], keyed[:50], strict=True):  # the two must agree
        got = {str(w): v for w, v in keep.match_hashes(domain, k).items()}
        want = {f"{w}/-": v for w, v in naive_match(sets, q).items()}
        assert got == want, "index and naive disagree"
    clock = time.perf_counter_ns

    def timed(fn: object, qs: list[list[bytes]]) -> list[float]:
        lat = []
        gc.disable()
        try:
            for q in qs:
                t0 = clock()
                fn(q)  # type: ignore[operator]
                lat.append((clock() - t0) / 1e3)
        finally:
            gc.enable()
        return lat

    # each in its own loop (interleaving them evicts each other's dicts from the CPU caches);
    # several rounds, the best round of each by median (other processes share this machine)
    rounds_i = [timed(lambda q: keep.match_hashes(domain, q), keyed) for _ in range(args.repeat)]
    rounds_n = [timed(lambda q: naive_match(sets, q), queries) for _ in range(args.repeat)]
    lat_i = min(rounds_i, key=lambda xs: pct(xs, 0.5))
    lat_n = min(rounds_n, key=lambda xs: pct(xs, 0.5))
    matched = [len(keep.match_hashes(domain, q)) for q in keyed]
    print(f"best of {args.repeat} rounds")
    print(f"{'':30} {'p50 us':>9} {'p99 us':>9} {'mean us':>9}")
    for name, lat in (("index (mask search)", lat_i), ("naive (walk each set)", lat_n)):
        print(f"{name:30} {pct(lat, 0.5):9.1f} {pct(lat, 0.99):9.1f} {statistics.fmean(lat):9.1f}")
    print(
        f"{'naive / index':30} {pct(lat_n, 0.5) / pct(lat_i, 0.5):9.1f} "
        f"{pct(lat_n, 0.99) / pct(lat_i, 0.99):9.1f} "
        f"{statistics.fmean(lat_n) / statistics.fmean(lat_i):9.1f}"
    )
    print(f"workers holding a prefix per query: mean {statistics.fmean(matched):.1f}")
    p99 = pct(lat_i, 0.99)
    print(
        f"targets: ingest >= 1.00 M stored blocks/s -> {best_store / 1e6:.2f} "
        f"{'MET' if best_store >= 1e6 else 'MISSED'}; match p99 <= 50 us -> {p99:.1f} us "
        f"{'MET' if p99 <= 50 else 'MISSED'}"
    )

    print("\n== for reference: hashing the request, and a whole router decision ==")
    hasher = get_hasher(ALGO)
    request_hasher = RequestHasher()  # what match() and the router hash a request with
    toks = list(range(args.tokens))
    t0 = time.perf_counter()
    n = 50
    for _ in range(n):
        if mode == "engine":
            request_hasher.hashes(toks, ALGO, tpb)
        else:
            request_keys(TokenIds(toks).raw, tpb)
    hash_us = (time.perf_counter() - t0) / n * 1e6
    # a real index of hashed requests for the router: 64 workers holding prefixes of 8 prompts
    idx = PrefixIndex(key_mode=mode)
    prompts = [[(p * 1000003 + i) % 32000 for i in range(args.tokens)] for p in range(8)]
    chains = [hasher.chain_bytes(split_blocks(p, tpb)) for p in prompts]
    for w in range(args.workers):
        c = chains[w % 8][: rng.randint(1, n_blocks)]
        parts = split_blocks(prompts[w % 8], tpb)
        blocks = tuple(
            StoredBlock.model_construct(block_hash=h, token_ids=b, cache_level=0)
            for h, b in zip(c, parts, strict=False)
        )
        idx.apply(
            EventBatch(
                source=SourceId(instance_id=f"worker-{w}"),
                ts_ns=0,
                events=(
                    KVCacheEvent(
                        event_id=0,
                        hash_algo=ALGO,
                        window_size=131072,
                        data=Created(num_blocks_per_cache_level=(1 << 20,), tokens_per_block=tpb),
                    ),
                    KVCacheEvent.model_construct(
                        event_id=1,
                        hash_algo=ALGO,
                        layer_group_id=0,
                        window_size=131072,
                        data=Stored.model_construct(type="stored", parent_hash=None, blocks=blocks),
                    ),
                ),
            )
        )
    router = Router(idx, [WorkerKey(f"worker-{w}") for w in range(args.workers)], RouterConfig())
    t0 = time.perf_counter()
    for i in range(n):
        router.route(prompts[i % 8])
    route_us = (time.perf_counter() - t0) / n * 1e6
    algo = ALGO if mode == "engine" else CANONICAL_ALGO
    print(f"hash an {args.tokens}-token request ({algo}, {n_blocks} blocks): {hash_us:9.1f} us")
    print(f"router.route() incl. hashing and {args.workers} worker scores: {route_us:9.1f} us")


if __name__ == "__main__":
    main()

"""Block-hash chain throughput of every registered algorithm vs. its raw hash primitive.

    python benchmarks/bench_hashing.py [--blocks N] [--tokens-per-block T] [--repeat R]
                                       [--profile ALGO]

For each algorithm it times ``h.chain_bytes(blocks)`` over one request of N blocks of T random
token ids (as ``TokenIds``, the cache manager's type), and, in the same run, the raw primitive
over the same per-block byte strings the algorithm hashes, precomputed:

- ``v2_sha256*``: ``hashlib.sha256(parent_key || tokens_le)`` per block;
- ``vllm_sha256_cbor*``: ``hashlib.sha256(canonical_cbor((parent, tokens, None)))`` per block;
- ``vllm_sha256*``: ``hashlib.sha256(pickle.dumps((parent, tokens, None), protocol=5))``;
- ``sglang_sha256_64``: ``hashlib.sha256(parent_digest || tokens_le)`` (no parent first);
- ``blake3*``: ``blake3(parent_key || tokens_le)`` per block (the ``blake3`` package, itself
  SIMD across a message's chunks); from 249 tokens per block a message spans more than one
  1 KiB chunk and the C chain hashes the chunks that do not hold the parent key eight at a
  time on AVX2 (``--tokens-per-block 512 --blocks 2000``: Mooncake's block size);
- ``v1_block_key``: no byte-string primitive exists (a 64-bit integer mix); the baseline is
  ``hashlib.sha256(parent_8_bytes || tokens_le)`` per block, for scale only. It is reported
  twice: ``[native]`` (the C extension ``kvstream.hashing._v1native``, the default when built)
  and ``[python]`` (the pure-Python reference, ``V1BlockKeyHasher(native=False)``), followed by a
  summary line with the native/pure-Python speed-up and both ratios to SHA-256.

``ratio`` = primitive time / chain time (1.0 = as fast as hashing pre-built messages; the
target is >= 0.7). ``list`` repeats the chain with blocks as lists of ints (conversion
included); ``extend`` drives ``root``/``extend`` one block at a time. Best of R runs each.
Runs alternate between the four measurements so that machine noise hits them alike.
``--profile ALGO`` prints a cProfile of that algorithm's chain instead (a row label such as
``v1_block_key[python]`` is accepted too).

``--request``: request hashing and matching against NVIDIA Dynamo (issue 13 item 3)::

    python benchmarks/bench_hashing.py --request [--tokens 8192] [--block-sizes 16,32,64]
        [--algos A,B] [--workers 64] [--queries 300] [--repeat 3]

An index of ``--workers`` workers, each holding random-length prefixes of 4 requests of a pool
(``--tokens``-token requests, 8 system prompts of ``--prompt-share`` of the request each);
queries are new requests (a system prompt plus fresh tokens), matched on all their tokens (as
Dynamo's ``find_matches``). Per query, p50 over the queries, best of ``--repeat`` rounds:

- ``hash``: ``RequestHasher.hashes`` (with a ``--cache-bytes`` prefix cache, and without: the
  default, ``prefix_cache_bytes=0``);
- ``hash+match``: that plus ``PrefixIndex.match_hashes`` (per-worker depths, what Dynamo's
  ``find_matches(...).scores`` returns);
- ``match()``: the full ``PrefixIndex.match`` (hash, then per-worker ``WorkerMatch`` results);
- Dynamo (when ``ai-dynamo-runtime`` is importable, e.g. ``.peers-venv/bin/python``):
  ``compute_block_hash_for_seq`` and ``RadixTree.find_matches`` of its result, on a tree fed
  the same stored blocks. ``ratio`` = kvstream / Dynamo hash+match p50 (target <= 0.8).

Each operation uses its own RequestHasher, so no query is ever served from a cache filled by
another measurement of the same query. The caches are first filled to their bound by
``--warm`` other requests (steady state: a full cache recycles the memory it evicts; a cache
still growing pays page faults for fresh memory). The operations take turns over chunks of
25 queries, each looping over a chunk on its own: load changes on a shared machine hit all of
them alike, and Dynamo's worker threads stay awake (calling Dynamo once between other work
lets them fall asleep, which on a loaded machine costs milliseconds per call).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import json
import pickle
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from blake3 import blake3

from kvstream._types import TokenIds
from kvstream.events.model import (
    Created,
    EventBatch,
    KVCacheEvent,
    SourceId,
    Stored,
    StoredBlock,
)
from kvstream.hashing import BlockHasher, accel, available_hashers, get_hasher, split_blocks
from kvstream.hashing.cbor import dumps as cbor_dumps
from kvstream.hashing.prefix_cache import DEFAULT_MAX_BYTES
from kvstream.hashing.trtllm import V1BlockKeyHasher
from kvstream.index import DomainKey, HashRequest, PrefixIndex, RequestHasher, WorkerKey

#: Algorithms of ``--request`` (the C chains, then the other engine hashes for scale).
REQUEST_ALGOS = (
    "vllm_sha256_cbor_64",
    "vllm_sha256_cbor",
    "vllm_sha256_64",
    "sglang_sha256_64",
    "v2_sha256",
    "v2_sha256_64",
    "blake3",
    "blake3_64",
    "v1_block_key",
)


def _best_interleaved(fns: list[Callable[[], Any]], repeat: int) -> list[float]:
    """Best wall time of each function; runs alternate so that drift hits all alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _messages(h: BlockHasher, blocks: list[TokenIds]) -> tuple[list[bytes], Callable[[bytes], Any]]:
    """The per-block byte strings the algorithm hashes, and the primitive that hashes them."""
    name = h.name
    if name.startswith("v2_sha256"):
        parent = h.root().key
        msgs = []
        for b in blocks:
            msgs.append(parent + b.raw)
            parent = hashlib.sha256(msgs[-1]).digest()
        return msgs, hashlib.sha256
    if name.startswith("blake3"):
        parent = h.root().key
        msgs = []
        for b in blocks:
            msgs.append(parent + b.raw)
            parent = blake3(msgs[-1]).digest()
        return msgs, blake3
    if name.startswith("vllm_sha256_cbor"):
        parent = h.root().key
        msgs = []
        for b in blocks:
            msgs.append(cbor_dumps((parent, tuple(b), None)))
            parent = hashlib.sha256(msgs[-1]).digest()
        return msgs, hashlib.sha256
    if name.startswith("vllm_sha256"):  # pickle
        parent = h.root().key
        msgs = []
        for b in blocks:
            msgs.append(pickle.dumps((parent, tuple(b), None), protocol=5))
            parent = hashlib.sha256(msgs[-1]).digest()
        return msgs, hashlib.sha256
    if name.startswith("sglang_sha256"):
        parent = b""  # an unsalted chain's first page has no parent
        msgs = []
        for b in blocks:
            msgs.append(parent + b.raw)
            parent = hashlib.sha256(msgs[-1]).digest()
        return msgs, hashlib.sha256
    keys = h.chain_bytes(blocks)
    parents = [bytes(8), *keys[:-1]]
    return [p + b.raw for p, b in zip(parents, blocks, strict=True)], hashlib.sha256


def _rows() -> list[tuple[str, BlockHasher]]:
    """(label, hasher) of every registered algorithm; v1_block_key native and pure Python."""
    rows: list[tuple[str, BlockHasher]] = []
    for name in available_hashers():
        h = get_hasher(name)
        if isinstance(h, V1BlockKeyHasher):
            rows.append((f"{name}[{'native' if h.native else 'python'}]", h))
            if h.native:
                rows.append((f"{name}[python]", V1BlockKeyHasher(native=False)))
        else:
            rows.append((name, h))
    return rows


def _primitive(msgs: list[bytes], prim: Callable[[bytes], Any]) -> None:
    for m in msgs:
        prim(m).digest()


def _extend_all(h: BlockHasher, blocks: list[TokenIds]) -> None:
    st = h.root()
    ext = h.extend
    for b in blocks:
        _, st = ext(st, b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", type=int, default=20_000, help="blocks per request (20000)")
    ap.add_argument("--tokens-per-block", type=int, default=32, help="tokens per block (32)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per measurement; best is kept")
    ap.add_argument("--vocab", type=int, default=128_256, help="token ids drawn below this")
    ap.add_argument(
        "--dist",
        choices=("uniform", "zipf"),
        default="uniform",
        help="token id distribution: uniform (worst case for lookup tables) or zipf(1.1)",
    )
    ap.add_argument("--profile", metavar="ALGO", help="cProfile ALGO's chain and exit")
    ap.add_argument("--request", action="store_true", help="request hashing vs Dynamo")
    ap.add_argument("--tokens", type=int, default=8192, help="--request: tokens per request")
    ap.add_argument("--block-sizes", default="16,32,64", help="--request: block sizes")
    ap.add_argument("--algos", default=",".join(REQUEST_ALGOS), help="--request: algorithms")
    ap.add_argument("--workers", type=int, default=64, help="--request: workers in the index")
    ap.add_argument("--queries", type=int, default=300, help="--request: queries per round")
    ap.add_argument("--warm", type=int, default=700, help="--request: cache warm-up requests")
    ap.add_argument(
        "--cache-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help="--request: prefix_cache_bytes of the cached RequestHashers (32 MiB)",
    )
    ap.add_argument(
        "--prompt-share",
        type=float,
        default=0.25,
        help="--request: share of each request that is a recurring system prompt (0.25)",
    )
    args = ap.parse_args(argv)
    if args.request:
        return run_request_bench(
            tokens=args.tokens,
            block_sizes=[int(x) for x in args.block_sizes.split(",")],
            algos=args.algos.split(","),
            workers=args.workers,
            queries=args.queries,
            warm=args.warm,
            prompt_share=args.prompt_share,
            cache_bytes=args.cache_bytes,
            repeat=args.repeat,
            vocab=args.vocab,
        )

    n, tpb = args.blocks, args.tokens_per_block
    if args.dist == "zipf":
        ids = np.random.default_rng(0).zipf(1.1, n * tpb) % args.vocab
        lists = ids.reshape(n, tpb).tolist()
    else:
        rng = random.Random(0)
        lists = [[rng.randrange(args.vocab) for _ in range(tpb)] for _ in range(n)]
    blocks = [TokenIds(b) for b in lists]
    mb = n * tpb * 4 / 1e6

    if args.profile:
        labels = dict(_rows())
        h = labels[args.profile] if args.profile in labels else get_hasher(args.profile)
        prof = cProfile.Profile()
        prof.enable()
        h.chain_bytes(blocks)
        _extend_all(h, blocks)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        return 0

    print(
        f"# {n} blocks x {tpb} tokens ({mb:.2f} MB of token bytes), {args.dist} ids below "
        f"{args.vocab}, best of {args.repeat}"
    )
    print(f"# python {sys.version.split()[0]}")
    header = (
        f"{'algorithm':<22} {'chain blk/s':>12} {'MB/s':>7} {'prim blk/s':>11} {'ratio':>6} "
        f"{'list':>6} {'extend':>7}  primitive"
    )
    print(header)
    print("-" * len(header))
    v1: dict[str, tuple[float, float]] = {}  # label -> (chain time, primitive time)
    for name, h in _rows():
        msgs, prim = _messages(h, blocks)
        assert h.chain_bytes(blocks) == h.chain_bytes(lists)
        t_chain, t_list, t_ext, t_prim = _best_interleaved(
            [
                partial(h.chain_bytes, blocks),
                partial(h.chain_bytes, lists),
                partial(_extend_all, h, blocks),
                partial(_primitive, msgs, prim),
            ],
            args.repeat,
        )
        prim_name = "blake3" if prim is blake3 else "sha256"
        if isinstance(h, V1BlockKeyHasher):
            v1[name] = (t_chain, t_prim)
        print(
            f"{name:<22} {n / t_chain:>12,.0f} {mb / t_chain:>7.1f} {n / t_prim:>11,.0f} "
            f"{t_prim / t_chain:>5.2f}x {t_prim / t_list:>5.2f}x {t_prim / t_ext:>6.2f}x  "
            f"{prim_name}"
        )
    nat, py = v1.get("v1_block_key[native]"), v1.get("v1_block_key[python]")
    if nat and py:
        print(
            f"# v1_block_key: native {n / nat[0]:,.0f} blk/s, pure Python {n / py[0]:,.0f} blk/s, "
            f"sha256 {n / nat[1]:,.0f} blk/s -> native/python {py[0] / nat[0]:.1f}x, "
            f"native/sha256 {nat[1] / nat[0]:.2f}x, python/sha256 {py[1] / py[0]:.2f}x "
            "(target >= 0.7x)"
        )
    elif py:
        print("# v1_block_key: C extension not loaded (not built or KVSTREAM_NO_NATIVE set)")
    return 0


# ----------------------------------------------------------------------------- --request


def _dynamo() -> Any:
    """``dynamo.llm`` when ai-dynamo-runtime is importable, else None."""
    try:
        from dynamo import llm
    except ImportError:
        return None
    return llm


def _p50(xs: list[float]) -> float:
    return statistics.median(xs)


def _index(
    algo: str, tpb: int, stored: list[tuple[int, list[int], int]], rh: RequestHasher
) -> PrefixIndex:
    """A PrefixIndex holding, per (worker, request tokens, n blocks), the request's first n
    blocks stored under ``algo`` (one Stored event per request, parent = the held prefix)."""
    idx = PrefixIndex()
    h = get_hasher(algo)
    evs: dict[int, list[KVCacheEvent]] = {}
    held: dict[int, set[bytes]] = {}
    for w, toks, n in stored:
        blocks = split_blocks(toks, tpb)[:n]
        hashes = h.chain_bytes(blocks)
        have = held.setdefault(w, set())
        k = 0
        while k < n and hashes[k] in have:
            k += 1
        lst = evs.setdefault(w, [])
        if not lst:
            lst.append(
                KVCacheEvent(
                    event_id=0,
                    hash_algo=algo,
                    window_size=131072,
                    data=Created(num_blocks_per_cache_level=(1 << 20,), tokens_per_block=tpb),
                )
            )
        if k < n:
            lst.append(
                KVCacheEvent(
                    event_id=len(lst),
                    hash_algo=algo,
                    window_size=131072,
                    data=Stored(
                        parent_hash=hashes[k - 1] if k else None,
                        blocks=tuple(
                            StoredBlock(block_hash=bh, token_ids=b, cache_level=0)
                            for bh, b in zip(hashes[k:], blocks[k:n], strict=True)
                        ),
                    ),
                )
            )
            have.update(hashes[k:])
    for w, lst in evs.items():
        idx.apply(
            EventBatch(
                source=SourceId(instance_id=f"worker-{w}", incarnation=1),
                ts_ns=0,
                events=tuple(lst),
            )
        )
    idx.hasher = rh
    return idx


def _dynamo_tree(llm: Any, tpb: int, stored: list[tuple[int, list[int], int]]) -> Any:
    """A Dynamo RadixTree holding the same blocks (external hashes: vllm_sha256_cbor_64)."""
    tree = llm.RadixTree()
    h = get_hasher("vllm_sha256_cbor_64")
    eids: dict[int, int] = {}
    held: dict[int, set[int]] = {}
    for w, toks, n in stored:
        ext = [int.from_bytes(b, "big") for b in h.chain_bytes(split_blocks(toks, tpb)[:n])]
        local = list(llm.compute_block_hash_for_seq(toks[: n * tpb], tpb))
        have = held.setdefault(w, set())
        k = 0
        while k < n and ext[k] in have:
            k += 1
        if k == n:
            continue
        ev = {
            "event_id": eids.get(w, 0),
            "data": {
                "stored": {
                    "parent_hash": ext[k - 1] if k else None,
                    "blocks": [
                        {"block_hash": e, "tokens_hash": t}
                        for e, t in zip(ext[k:], local[k:], strict=True)
                    ],
                }
            },
            "dp_rank": 0,
        }
        eids[w] = eids.get(w, 0) + 1
        tree.apply_event(w, json.dumps(ev).encode())
        have.update(ext[k:])
    return tree


def run_request_bench(
    *,
    tokens: int,
    block_sizes: list[int],
    algos: list[str],
    workers: int,
    queries: int,
    warm: int,
    prompt_share: float,
    cache_bytes: int,
    repeat: int,
    vocab: int,
) -> int:
    """The ``--request`` benchmark (see the module docstring)."""
    llm = _dynamo()
    rng = random.Random(0)
    ids = np.random.default_rng(0)
    prompt_len = int(tokens * prompt_share)
    prompts = [ids.integers(0, vocab, prompt_len).tolist() for _ in range(8)]

    def request() -> list[int]:
        tail: list[int] = ids.integers(0, vocab, tokens - prompt_len).tolist()
        return rng.choice(prompts) + tail

    pool = [request() for _ in range(64)]
    print(
        f"# request hashing: {tokens}-token requests (system prompts of {prompt_len} tokens, "
        f"8 of them), {workers} workers, {queries} queries, p50 in us, best of {repeat}; "
        f"python {sys.version.split()[0]}; C chains "
        f"{'on' if accel.NATIVE_CHAINS else 'off'}"
        + (f" (SHA-NI {'on' if _sha_ni() else 'off'})" if accel.NATIVE_CHAINS else "")
    )
    if llm is None:
        print("# Dynamo: ai-dynamo-runtime not importable (run with .peers-venv/bin/python)")
    header = (
        f"{'algorithm':22} {'block':>5} {'hash':>7} {'hash':>7} {'hash+m':>7} {'hash+m':>7} "
        f"{'match()':>8} {'dyn h':>7} {'dyn h+m':>8} {'ratio':>6} {'ratio':>6} {'ratio':>6}"
    )
    print(header)
    print(
        f"{'':22} {'':>5} {'cache':>7} {'none':>7} {'cache':>7} {'none':>7} {'cache':>8} "
        f"{'':>7} {'':>8} {'cache':>6} {'none':>6} {'rounds':>6}"
    )
    print("-" * len(header))
    req = HashRequest(drop_last_token=False)
    for tpb in block_sizes:
        n_blocks = tokens // tpb
        stored = [
            (w, rng.choice(pool), rng.randint(1, n_blocks))
            for w in range(workers)
            for _ in range(4)
        ]
        tree = _dynamo_tree(llm, tpb, stored) if llm is not None else None
        for algo in algos:
            domain = DomainKey(algo, tpb, 0)
            best: dict[str, float] = {}
            ratios: list[float] = []
            rh = {k: RequestHasher(prefix_cache_bytes=cache_bytes) for k in ("h", "hm", "m")}
            rh0 = RequestHasher(prefix_cache_bytes=0)
            for r in rh.values():
                for _ in range(warm):
                    r.hashes(request(), algo, tpb, req)
            idx = _index(algo, tpb, stored, rh["m"])
            for _ in range(repeat):
                qs = [request() for _ in range(queries)]
                check = rh0.hashes(qs[0], algo, tpb, req)
                assert rh["h"].hashes(list(qs[0]), algo, tpb, req) == check
                ops: dict[str, Callable[[list[int]], Any]] = {
                    "hash": partial(_hash, rh["h"], algo, tpb, req),
                    "hash0": partial(_hash, rh0, algo, tpb, req),
                    "hm": partial(_hash_match, rh["hm"], idx, domain, algo, tpb, req),
                    "hm0": partial(_hash_match, rh0, idx, domain, algo, tpb, req),
                    "match": partial(_full_match, idx, req),
                }
                if tree is not None:
                    ops["dh"] = partial(_dyn_hash, llm, tpb)
                    ops["dhm"] = partial(_dyn_hash_match, llm, tree, tpb)
                    _agree(llm, tree, idx, domain, qs[:5], rh0, algo, tpb, req)
                lat = _per_op(ops, qs)
                for k, xs in lat.items():
                    best[k] = min(best.get(k, float("inf")), _p50(xs))
                if "dhm" in lat:
                    ratios.append(min(_p50(lat["hm"]), _p50(lat["hm0"])) / _p50(lat["dhm"]))
            dyn = ""
            if "dhm" in best:
                dyn = (
                    f"{best['dh']:7.1f} {best['dhm']:8.1f} {best['hm'] / best['dhm']:5.2f}x "
                    f"{best['hm0'] / best['dhm']:5.2f}x {statistics.median(ratios):5.2f}x"
                )
            print(
                f"{algo:22} {tpb:5} {best['hash']:7.1f} {best['hash0']:7.1f} {best['hm']:7.1f} "
                f"{best['hm0']:7.1f} {best['match']:8.1f} {dyn}"
            )
    print(
        "# hash: RequestHasher.hashes; hash+m: + PrefixIndex.match_hashes (Dynamo: "
        "compute_block_hash_for_seq + RadixTree.find_matches); match(): PrefixIndex.match; "
        "cache/none: with the prefix cache / prefix_cache_bytes=0; ratio: kvstream hash+m / "
        "Dynamo hash+m, best p50s (target <= 0.8); rounds: median over the rounds of each "
        "round's best kvstream hash+m p50 / Dynamo's"
    )
    return 0


def _sha_ni() -> bool:
    from kvstream._native import load

    chain = load("kvstream.hashing._chainnative")
    return chain is not None and bool(chain.has_sha_ni())


def _hash(rh: RequestHasher, algo: str, tpb: int, req: HashRequest, q: list[int]) -> Any:
    return rh.hashes(q, algo, tpb, req)


def _hash_match(  # noqa: PLR0917
    rh: RequestHasher,
    idx: PrefixIndex,
    domain: DomainKey,
    algo: str,
    tpb: int,
    req: HashRequest,
    q: list[int],
) -> Any:
    return idx.match_hashes(domain, rh.hashes(q, algo, tpb, req))


def _full_match(idx: PrefixIndex, req: HashRequest, q: list[int]) -> Any:
    return idx.match(q, request=req)


def _dyn_hash(llm: Any, tpb: int, q: list[int]) -> Any:
    return llm.compute_block_hash_for_seq(q, tpb)


def _dyn_hash_match(llm: Any, tree: Any, tpb: int, q: list[int]) -> Any:
    return tree.find_matches(llm.compute_block_hash_for_seq(q, tpb)).scores


def _agree(  # noqa: PLR0917
    llm: Any,
    tree: Any,
    idx: PrefixIndex,
    domain: DomainKey,
    qs: list[list[int]],
    rh: RequestHasher,
    algo: str,
    tpb: int,
    req: HashRequest,
) -> None:
    """kvstream's and Dynamo's per-worker matched blocks agree on a few queries."""
    for q in qs:
        ours = {
            int(str(w.instance_id).split("-")[1]): d
            for w, d in _hm_items(idx, domain, rh, q, algo, tpb, req)
        }
        theirs = {w: n for (w, _r), n in _dyn_hash_match(llm, tree, tpb, q).items()}
        assert ours == theirs, (ours, theirs)


def _hm_items(  # noqa: PLR0917
    idx: PrefixIndex,
    domain: DomainKey,
    rh: RequestHasher,
    q: list[int],
    algo: str,
    tpb: int,
    req: HashRequest,
) -> list[tuple[WorkerKey, int]]:
    return list(_hash_match(rh, idx, domain, algo, tpb, req, q).items())


def _per_op(
    ops: dict[str, Callable[[list[int]], Any]], qs: list[list[int]], chunk: int = 25
) -> dict[str, list[float]]:
    """Per-query latency (us) of every op: the ops take turns over chunks of ``chunk``
    queries, each op looping over a chunk on its own (so load changes on a shared machine hit
    every op alike, and Dynamo's worker threads stay awake within a chunk)."""
    clock = time.perf_counter_ns
    lat: dict[str, list[float]] = {k: [] for k in ops}
    gc.collect()
    gc.disable()
    try:
        for start in range(0, len(qs), chunk):
            part = qs[start : start + chunk]
            for k, fn in ops.items():
                xs = lat[k]
                for q in part:
                    t0 = clock()
                    fn(q)
                    xs.append((clock() - t0) / 1e3)
    finally:
        gc.enable()
    return lat


if __name__ == "__main__":
    raise SystemExit(main())

"""Hashing several prompts at once (``BlockHasher.chain_raw_many``) against one at a time.

    python benchmarks/bench_hash_many.py [--trace conversation] [--groups 8,16,32]
        [--algo blake3_64] [--repeat 5] [--limit N]

The prompts are the replay's (``MooncakeTokens(seed=0).prompt(row)`` for the rows of
``load_rows(ReplayOptions(trace=...))``, cut into the replay's blocks: 12,031 prompts, 276,491
blocks of 512 tokens for conversation), packed once before timing. Rows, each over every prompt:

- ``chain_raw``: one request at a time, as a cache hashes a prompt (``chain_raw(root, raw,
  512, every=n)``, the C chain: each block's parent-free chunks eight at a time on AVX2, its
  first chunk and tree nodes one after the other);
- ``chain_raw_many/G``: the prompts in groups of G, one ``chain_raw_many`` call per group
  (BLAKE3: the groups' chains side by side, eight per AVX2 lane);
- ``blake3 package``: what a user would write with the ``blake3`` PyPI package (Rust, SIMD
  across a message's chunks): ``blake3(key + block).digest()`` chained block by block over the
  same bytes (BLAKE3 algorithms only; skipped when the package is missing).

Then the cache's calls, as the replay makes them (a metadata-only ``KVCacheManager`` of the
replay's block size and algorithm; prompts as ``TokenIds``): ``hash_prompt`` per prompt against
``hash_prompts`` of groups of G (its token checks, roots and ``HashedPrompt``s included). And
``resume``: the chain state after a prompt, built once per prompt as a cache does
(``BlockHasher.resume``), against ``namedtuple._replace`` (what ``resume`` did before).

Process CPU time, best of ``--repeat`` rounds, the rows alternated within each round so that
machine noise hits them alike; ratios are against ``chain_raw`` (and the package) of the same
run. Results are checked equal before timing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstream._types import TokenIds
from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.cli.replay_run import ReplayOptions, _block_size, load_rows
from kvstream.hashing import BlockHasher, ChainState, get_hasher
from kvstream.workloads import MooncakeTokens

_blake3: Any
try:
    from blake3 import blake3 as _blake3
except ImportError:  # pragma: no cover - the package is a kvstream dependency
    _blake3 = None


def one_at_a_time(hasher: BlockHasher, root: ChainState, raws: list[bytes], tpb: int) -> None:
    step = 4 * tpb
    chain_raw = hasher.chain_raw
    for raw in raws:
        if len(raw) >= step:
            chain_raw(root, raw, tpb, every=len(raw) // step)


def in_groups(hasher: BlockHasher, root: ChainState, raws: list[bytes], tpb: int, g: int) -> None:
    many = hasher.chain_raw_many
    for i in range(0, len(raws), g):
        many(root, raws[i : i + g], tpb)


def cache_groups(mgr: KVCacheManager, prompts: list[TokenIds], g: int) -> None:
    for i in range(0, len(prompts), g):
        mgr.hash_prompts(prompts[i : i + g])


def package(root: ChainState, raws: list[bytes], tpb: int) -> None:
    assert _blake3 is not None
    step = 4 * tpb
    b3 = _blake3
    for raw in raws:
        key = root.key
        for i in range(len(raw) // step):
            key = b3(key + raw[i * step : (i + 1) * step]).digest()


def resumes(hasher: BlockHasher, root: ChainState, keys: list[bytes], replace: bool) -> None:
    if replace:
        for i, key in enumerate(keys):
            hasher._check_state(root)
            root._replace(key=key, depth=i)
    else:
        resume = hasher.resume
        for i, key in enumerate(keys):
            resume(root, key, i)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", default="conversation")
    ap.add_argument("--groups", default="8,16,32")
    ap.add_argument("--algo", default="blake3_64")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()

    opts = ReplayOptions(trace=args.trace, limit=args.limit)
    rows = load_rows(opts)
    toks = MooncakeTokens(seed=opts.seed)
    prompts = [toks.prompt(r) for r in rows]
    raws = [p.raw for p in prompts]
    tpb = _block_size(opts, rows)
    hasher = get_hasher(args.algo)
    root = hasher.root()
    blocks = sum(len(r) // (4 * tpb) for r in raws)
    groups = [int(g) for g in args.groups.split(",") if g]

    want = [hasher.chain_raw(root, raw, tpb, every=len(raw) // (4 * tpb)) for raw in raws]
    for g in groups:
        got = [
            x
            for i in range(0, len(raws), g)
            for x in hasher.chain_raw_many(root, raws[i : i + g], tpb)
        ]
        if got != [w if w[0] else ([], []) for w in want]:
            raise SystemExit(f"chain_raw_many in groups of {g} differs from chain_raw")
    keys = [w[1][-1] for w in want if w[1]]

    rows_run: dict[str, Callable[[], object]] = {
        "chain_raw (one at a time)": lambda: one_at_a_time(hasher, root, raws, tpb)
    }
    for g in groups:
        rows_run[f"chain_raw_many/{g}"] = partial(in_groups, hasher, root, raws, tpb, g)
    use_pkg = _blake3 is not None and args.algo.startswith("blake3")
    if use_pkg:
        rows_run["blake3 package, block by block"] = lambda: package(root, raws, tpb)
    mgr = KVCacheManager(
        CacheConfig(
            tokens_per_block=tpb,
            groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=64)],
            hash_algo=args.algo,
            metadata_only=True,
        )
    )
    rows_run["cache: hash_prompt (one at a time)"] = lambda: [mgr.hash_prompt(p) for p in prompts]
    for g in groups:
        rows_run[f"cache: hash_prompts/{g}"] = partial(cache_groups, mgr, prompts, g)
    rows_run["resume (tuple.__new__)"] = lambda: resumes(hasher, root, keys, False)
    rows_run["resume as before (_replace)"] = lambda: resumes(hasher, root, keys, True)

    best = dict.fromkeys(rows_run, float("inf"))
    for _ in range(max(args.repeat, 1)):
        for name, fn in rows_run.items():
            t0 = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - t0)

    print(
        f"# {args.trace}: {len(raws):,} prompts, {blocks:,} blocks of {tpb} tokens, "
        f"{args.algo}; process CPU, best of {args.repeat}"
    )
    base = best["chain_raw (one at a time)"]
    pkg = best.get("blake3 package, block by block")
    print(f"{'row':34} {'CPU s':>8} {'us/block':>9} {'x chain_raw':>12} {'x package':>10}")
    for name, t in best.items():
        if name.startswith(("resume", "cache")):
            continue
        vs_pkg = f"{t / pkg:10.2f}" if pkg else f"{'-':>10}"
        print(f"{name:34} {t:8.3f} {t / blocks * 1e6:9.2f} {t / base:12.2f} {vs_pkg}")
    one = best["cache: hash_prompt (one at a time)"]
    for name, t in best.items():
        if name.startswith("cache"):
            print(f"{name:34} {t:8.3f} {t / blocks * 1e6:9.2f} {t / one:12.2f} {'':>10}")
    new, old = best["resume (tuple.__new__)"], best["resume as before (_replace)"]
    print(
        f"resume x{len(keys):,}: {new * 1e9 / len(keys):.0f} ns/call, "
        f"before (_replace) {old * 1e9 / len(keys):.0f} ns/call: x{new / old:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

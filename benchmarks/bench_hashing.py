"""Block-hash chain throughput of every registered algorithm vs. its raw hash primitive.

    python benchmarks/bench_hashing.py [--blocks N] [--tokens-per-block T] [--repeat R]
                                       [--profile ALGO]

For each algorithm it times ``h.chain_bytes(blocks)`` over one request of N blocks of T random
token ids (as ``TokenIds``, the cache manager's type), and, in the same run, the raw primitive
over the same per-block byte strings the algorithm hashes, precomputed:

- ``v2_sha256*``: ``hashlib.sha256(parent_key || tokens_le)`` per block;
- ``vllm_sha256_cbor*``: ``hashlib.sha256(canonical_cbor((parent, tokens, None)))`` per block;
- ``blake3*``: ``blake3(parent_key || tokens_le)`` per block;
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
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import random
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
from kvstream.hashing import BlockHasher, available_hashers, get_hasher
from kvstream.hashing.cbor import dumps as cbor_dumps
from kvstream.hashing.trtllm import V1BlockKeyHasher


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
    args = ap.parse_args(argv)

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


if __name__ == "__main__":
    raise SystemExit(main())

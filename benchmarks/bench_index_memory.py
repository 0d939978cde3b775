"""Index memory and ingest: kvstream's native table, its Python twin and Dynamo's RadixTree.

Each measurement runs in a fresh process (``--side``), so RSS deltas are the index's alone:
the workload (``_fleet_workload``, bench_peers' fleet with caches large enough that nothing
is evicted: 8k-token prompts in 32-token blocks sharing system prompts, 64 workers, stored
only) is built first and converted to each side's input, freed
memory is returned to the OS (``malloc_trim``), then the index is fed and RSS read again.
kvstream is fed decoded columns (decoded before the timer) and Dynamo its event JSON bytes,
so the ingest column is NOT a same-bytes comparison (bench_peers has that row); the memory
column is like for like. Rounds interleave the sides, each round with a fresh seed, and the
table reports the median and the spread of the ratios to Dynamo.

    python benchmarks/bench_index_memory.py [--rounds 3] [--requests 128 --pool 1024]

Dynamo's side runs under ``.peers-venv/bin/python`` (it has ai-dynamo-runtime); without it
the Dynamo rows are skipped.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS_PY = HERE.parent / ".peers-venv" / "bin" / "python"
SIDES = ("kv-native", "kv-python", "dynamo")


def rss() -> int:
    """This process's resident bytes, after a full collection and ``malloc_trim`` (freed
    memory returned to the OS), so deltas count only what is still referenced."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fresh_process(
    python: str, argv: list[str], env: dict[str, str] | None = None
) -> dict[str, float]:
    """Run ``python *argv`` in a fresh process; the JSON object its last output line holds."""
    out = subprocess.run(
        [python, *argv], check=True, capture_output=True, text=True, env=env
    ).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def measure(a: argparse.Namespace) -> dict[str, float]:
    """One side, in this process: ``{"pairs", "mib_per_m", "ingest_m"}``."""
    sys.path.insert(0, str(HERE))
    from _fleet_workload import FleetSpec, encode_fleet

    from kvstream.codec import AvroCodec

    n_blocks = a.tokens // a.block_size
    spec = FleetSpec(
        workers=a.workers,
        tokens=a.tokens,
        block_size=a.block_size,
        pool=a.pool,
        requests=a.requests,
        capacity=(a.requests + 1) * n_blocks,  # room for every request: nothing evicted
        chunk=n_blocks,
    )
    llm = None
    if a.side == "dynamo":
        from dynamo import llm
    enc = encode_fleet(spec, a.seed, llm, AvroCodec())
    stored = enc.totals.stored
    if a.side == "dynamo":
        evs = enc.dynamo or []
        del enc
        r0 = rss()
        t0 = time.perf_counter()
        tree = llm.RadixTree()
        for w, d in evs:
            tree.apply_event(w, d)
        t = time.perf_counter() - t0
        keep: object = tree
    else:
        import kvstream.index.domain as dm
        import kvstream.index.index as ix
        from kvstream.codec import schema_registry
        from kvstream.codec.columnar import decode_columns_message
        from kvstream.index import PrefixIndex
        from kvstream.index.table import GroupTable

        if a.side == "kv-python":
            ix._ENGINE_TABLE = GroupTable
            dm._INDEX_MASKS = None
        reg = schema_registry()
        cols = [decode_columns_message(m, reg).columns for m in enc.messages]
        del enc
        r0 = rss()
        t0 = time.perf_counter()
        idx = PrefixIndex()
        idx.apply_many(cols)
        t = time.perf_counter() - t0
        keep = idx
    r1 = rss()
    assert keep is not None
    return {
        "pairs": stored,
        "mib_per_m": (r1 - r0) / 2**20 / (stored / 1e6),
        "ingest_m": stored / t / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=SIDES, help="measure one side here (internal)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--requests", type=int, default=128, help="requests cached per worker")
    ap.add_argument("--pool", type=int, default=1024, help="distinct requests in the pool")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.side:
        print(json.dumps(measure(a)))
        return
    common = [
        f"--{k.replace('_', '-')}={getattr(a, k)}"
        for k in ("workers", "tokens", "block_size", "requests", "pool")
    ]
    rows: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    for r in range(a.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            py = str(PEERS_PY) if side == "dynamo" else sys.executable
            if side == "dynamo" and not PEERS_PY.exists():
                continue
            rows[side].append(
                fresh_process(py, [__file__, f"--side={side}", f"--seed={a.seed + r}", *common])
            )
    print(
        f"# {a.rounds} rounds, load {os.getloadavg()[0]:.2f}; pairs per round: "
        f"{[int(x['pairs']) for x in rows['kv-native']]}"
    )
    print(f"{'side':10s} {'MiB/M pairs':>12s} {'x Dynamo':>16s} {'ingest M/s':>11s}")
    dyn = rows["dynamo"]
    for side in SIDES:
        got = rows[side]
        if not got:
            continue
        mem = statistics.median(x["mib_per_m"] for x in got)
        ing = statistics.median(x["ingest_m"] for x in got)
        ratio = ""
        if dyn and len(dyn) == len(got):
            rs = [x["mib_per_m"] / d["mib_per_m"] for x, d in zip(got, dyn, strict=True)]
            ratio = f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"
        print(f"{side:10s} {mem:12.1f} {ratio:>16s} {ing:11.2f}")


if __name__ == "__main__":
    main()

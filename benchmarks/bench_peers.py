"""kvstream side by side with what users pick instead, in one run, as one table of ratios.

    python benchmarks/bench_peers.py [--workers 64] [--tokens 8192] [--block-size 32]
        [--requests 48] [--queries 300] [--rounds 5] [--json OUT.json] [--svg OUT.svg]

Run it with ``.peers-venv/bin/python`` (``scripts/test-peers`` creates it) for the NVIDIA
Dynamo rows; in an environment without ``ai-dynamo-runtime`` those rows say so and the rest
runs.

Rows (issue 13's goals in the last column):

* **codec vs msgspec** on vLLM's wire types (``KVEventBatch`` of ``BlockStored`` /
  ``BlockRemoved``, the structs and workload of ``bench_codec.py``): encode (model ->
  bytes), decode (bytes -> kvstream's columns with the token ids unpacked, what consumers
  use; msgspec -> structs), and bytes, for uniform and Zipf-distributed token ids.
* **index vs Dynamo's RadixTree** (ai-dynamo-runtime's Rust tree, driven as its Python
  binding takes events: one ``KvCacheEvent`` JSON per call, pre-serialized) on the same
  events: ``--workers`` workers each caching random-length prefixes of ``--requests``
  ``--tokens``-token requests that share 8 system prompts (a quarter of each), announced
  as an engine does (only new blocks, with their parent; with removals: leaf-first eviction
  of each request's private tail). kvstream ingests the decoded columns (what its sources
  hand over) and, for reference, model batches. Match latency: already-hashed request
  blocks (kvstream ``match_hashes``, Dynamo ``find_matches`` of its local hashes); hash +
  match: the request's tokens (kvstream ``PrefixIndex.match``: the public RequestHasher with
  the workers' ``vllm_sha256_cbor_64`` chain, then the index; Dynamo
  ``compute_block_hash_for_seq`` + ``find_matches``).
* **end to end, bytes -> index** (one core, no peer): a file sink directory read by
  ``IndexConsumer(FileSource(...))``, and Kafka message values (single-object Avro, as the
  Kafka source receives them; no broker in the loop) decoded and applied.

Timing: process CPU time (all threads, robust on a shared machine), best of ``--rounds``,
rounds interleave kvstream and the peer; the GC stays on (a consumer runs with it).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgspec
from bench_codec import KVEventBatch
from bench_codec import build as build_codec_workload
from bench_index import add_workload_args

from kvstream.codec import AvroCodec, ContainerWriter, schema_registry
from kvstream.codec.columnar import decode_columns_message
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
from kvstream.index import DomainKey, FileSource, HashRequest, IndexConsumer, PrefixIndex
from kvstream.index.sources import decode_message

ALGO = "vllm_sha256_cbor_64"
VOCAB = 50_000


def dynamo() -> Any:
    """``dynamo.llm`` when ai-dynamo-runtime is importable, else None."""
    try:
        from dynamo import llm
    except ImportError:
        return None
    return llm


def best_cpu(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Best process CPU seconds of each function; rounds interleave them."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            gc.collect()
            t0 = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - t0)
    return best


# ------------------------------------------------------------------------------ codec


def codec_rows(rounds: int) -> list[tuple[str, float, float, str, str]]:
    rows = []
    codec = AvroCodec()
    registry = schema_registry()
    for dist in ("uniform", "zipf"):
        w = build_codec_workload(dist, 64, 16, 64, 0)
        enc = msgspec.msgpack.Encoder()
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        data = codec.encode(w.batch)
        ms = enc.encode(w.vllm)
        if decode_columns_message(data, registry).batch.events != w.batch.events:
            raise SystemExit("kvstream round trip failed")
        n = 20

        def kv_enc(w: Any = w, n: int = n) -> None:
            for _ in range(n):
                codec.encode(w.batch)

        def ms_enc(w: Any = w, n: int = n, enc: Any = enc) -> None:
            for _ in range(n):
                enc.encode(w.vllm)

        def kv_dec(data: bytes = data, n: int = n) -> None:
            # .tokens: the ids unpacked (a hash-keyed index never reads them, so the decoder
            # unpacks them lazily; msgspec always builds its int lists)
            for _ in range(n):
                decode_columns_message(data, registry).columns.tokens  # noqa: B018

        def kv_model(data: bytes = data, n: int = n) -> None:
            for _ in range(n):
                codec.decode(data)

        def ms_dec(ms: bytes = ms, n: int = n, dec: Any = dec) -> None:
            for _ in range(n):
                dec.decode(ms)

        t = best_cpu(
            {
                "kv_enc": kv_enc,
                "ms_enc": ms_enc,
                "kv_dec": kv_dec,
                "kv_model": kv_model,
                "ms_dec": ms_dec,
            },
            rounds,
        )
        b = w.blocks * n / 1e6
        rows += [
            (f"encode, {dist} tokens (M blocks/s)", b / t["kv_enc"], b / t["ms_enc"], "hi", ">= 1"),
            (
                f"decode to columns, {dist} (M blocks/s)",
                b / t["kv_dec"],
                b / t["ms_dec"],
                "hi",
                ">= 1.5",
            ),
            (f"  decode to models, {dist} (ref.)", b / t["kv_model"], b / t["ms_dec"], "hi", ""),
            (
                f"bytes, {dist} tokens (KiB/batch)",
                len(data) / 1024,
                len(ms) / 1024,
                "lo",
                "<= 0.6" if dist == "uniform" else "<= 0.8",
            ),
        ]
    return rows


# ------------------------------------------------------------------------------ index


class Workload:
    """Requests of ``n_blocks`` blocks; request r shares its first quarter with system
    prompt r % 8; every worker caches random-length prefixes of ``per_worker`` of them."""

    def __init__(self, args: argparse.Namespace, rng: random.Random) -> None:
        tpb = self.tpb = args.block_size
        self.n_blocks = args.tokens // tpb
        shared = args.tokens // 4
        prompts = [[rng.randrange(VOCAB) for _ in range(shared)] for _ in range(8)]
        self.requests = [
            prompts[r % 8] + [rng.randrange(VOCAB) for _ in range(args.tokens - shared)]
            for r in range(args.pool)
        ]
        h = get_hasher(ALGO)
        self.blocks = [split_blocks(r, tpb) for r in self.requests]
        self.hashes = [h.chain_bytes(b) for b in self.blocks]
        self.shared_blocks = shared // tpb
        self.plan = [
            [
                (r, rng.randint(1, self.n_blocks))
                for r in rng.sample(range(args.pool), args.requests)
            ]
            for _ in range(args.workers)
        ]

    def batches(self, evict: bool) -> tuple[list[EventBatch], int, int]:
        """Model batches (16 events each) of every worker; (batches, stored, removed)."""
        out: list[EventBatch] = []
        stored = removed = 0
        for w, plan in enumerate(self.plan):
            src = SourceId(instance_id=f"worker-{w}", attention_dp_rank=0, incarnation=1)
            evs: list[KVCacheEvent] = [
                KVCacheEvent(
                    event_id=0,
                    hash_algo=ALGO,
                    window_size=1 << 17,
                    data=Created(num_blocks_per_cache_level=(1 << 20,), tokens_per_block=self.tpb),
                )
            ]
            held: set[bytes] = set()
            for r, n in plan:
                chain = self.hashes[r][:n]
                k = 0
                while k < n and chain[k] in held:
                    k += 1
                if k < n:
                    blocks = tuple(
                        StoredBlock(block_hash=chain[i], token_ids=self.blocks[r][i])
                        for i in range(k, n)
                    )
                    data = Stored(parent_hash=chain[k - 1] if k else None, blocks=blocks)
                    evs.append(self._ev(0, data))
                    held.update(chain[k:])
                    stored += n - k
                if evict:
                    tail = [x for x in chain[max(k, self.shared_blocks) :][::-1] if x in held]
                    if tail:
                        evs.append(self._ev(0, Removed(block_hashes=tuple(tail))))
                        held.difference_update(tail)
                        removed += len(tail)
            for i, ev in enumerate(evs):
                evs[i] = ev.model_copy(update={"event_id": i})
            for i in range(0, len(evs), 16):
                out.append(EventBatch(source=src, ts_ns=1, events=tuple(evs[i : i + 16])))
        return out, stored, removed

    @staticmethod
    def _ev(eid: int, data: Any) -> KVCacheEvent:
        return KVCacheEvent(event_id=eid, hash_algo=ALGO, window_size=1 << 17, data=data)


def dynamo_events(llm: Any, batches: list[EventBatch], tpb: int) -> list[tuple[int, bytes]]:
    """Dynamo ``KvCacheEvent`` JSON per kvstream event (worker id, bytes), pre-serialized."""
    out = []
    for b in batches:
        w = int(b.source.instance_id.removeprefix("worker-"))
        for ev in b.events:
            d = ev.data
            if isinstance(d, Stored):
                tokens = [t for blk in d.blocks for t in blk.token_ids.tolist()]
                local = llm.compute_block_hash_for_seq(tokens, tpb)
                body: Any = {
                    "stored": {
                        "parent_hash": None
                        if d.parent_hash is None
                        else int.from_bytes(d.parent_hash, "big"),
                        "blocks": [
                            {"block_hash": int.from_bytes(blk.block_hash, "big"), "tokens_hash": th}
                            for blk, th in zip(d.blocks, local, strict=True)
                        ],
                    }
                }
            elif isinstance(d, Removed):
                body = {
                    "removed": {"block_hashes": [int.from_bytes(h, "big") for h in d.block_hashes]}
                }
            else:
                continue
            out.append(
                (w, json.dumps({"event_id": ev.event_id, "data": body, "dp_rank": 0}).encode())
            )
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def index_rows(
    args: argparse.Namespace, llm: Any
) -> tuple[list[tuple[str, float, float, str, str]], dict[str, Any]]:
    rng = random.Random(args.seed)
    wl = Workload(args, rng)
    codec = AvroCodec()
    registry = schema_registry()
    rows: list[tuple[str, float, float, str, str]] = []
    extra: dict[str, Any] = {}
    nan = float("nan")
    for evict in (False, True):
        batches, stored, removed = wl.batches(evict)
        blocks = (stored + removed) / 1e6
        cols = [decode_columns_message(codec.encode(b), registry).columns for b in batches]
        fns: dict[str, Callable[[], Any]] = {
            "columns": lambda cols=cols: PrefixIndex().apply_many(cols),
            "models": lambda batches=batches: PrefixIndex().apply_many(batches),
        }
        if llm is not None:
            dyn = dynamo_events(llm, batches, wl.tpb)

            def feed(dyn: list[tuple[int, bytes]] = dyn) -> None:
                tree = llm.RadixTree()
                apply = tree.apply_event
                for w, data in dyn:
                    apply(w, data)

            fns["dynamo"] = feed
        t = best_cpu(fns, args.rounds)
        what = "stored + removed" if evict else "stored"
        dyn_rate = blocks / t["dynamo"] if "dynamo" in t else nan
        rows.append(
            (f"ingest {what} (M blocks/s)", blocks / t["columns"], dyn_rate, "hi", ">= 1.2")
        )
        rows.append(("  from model batches (ref.)", blocks / t["models"], dyn_rate, "hi", ""))
        extra[f"blocks_{what}"] = {"stored": stored, "removed": removed}
    # matching, on the stored-only index
    batches, _, _ = wl.batches(False)
    idx = PrefixIndex()
    idx.apply_many(batches)
    tree = None
    if llm is not None:
        tree = llm.RadixTree()
        for w, data in dynamo_events(llm, batches, wl.tpb):
            tree.apply_event(w, data)
    dom = DomainKey(ALGO, wl.tpb, 0)
    queries = [rng.randrange(args.pool) for _ in range(args.queries)]
    local = [llm.compute_block_hash_for_seq(wl.requests[q], wl.tpb) for q in queries] if llm else []
    req = HashRequest(drop_last_token=False)
    # agreement: same matched blocks per worker
    if tree is not None:
        for q, lh in list(zip(queries, local, strict=True))[:20]:
            kv = {
                int(k.instance_id.removeprefix("worker-")): d
                for k, d in idx.match_hashes(dom, wl.hashes[q]).items()
            }
            dy = {w: d for (w, _), d in tree.find_matches(lh).scores.items()}
            if kv != dy:
                raise SystemExit(f"kvstream and Dynamo disagree on query {q}: {kv} vs {dy}")
    lat: dict[str, list[float]] = {"kv_m": [], "dy_m": [], "kv_hm": [], "dy_hm": []}
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):
        for k in lat:
            lat[k] = []
        for i, q in enumerate(queries):
            toks = wl.requests[q]
            t0 = time.perf_counter_ns()
            idx.match_hashes(dom, wl.hashes[q])
            t1 = time.perf_counter_ns()
            lat["kv_m"].append((t1 - t0) / 1e3)
            t0 = time.perf_counter_ns()
            idx.match(toks, request=req)
            t1 = time.perf_counter_ns()
            lat["kv_hm"].append((t1 - t0) / 1e3)
            if tree is not None:
                t0 = time.perf_counter_ns()
                tree.find_matches(local[i])
                t1 = time.perf_counter_ns()
                lat["dy_m"].append((t1 - t0) / 1e3)
                t0 = time.perf_counter_ns()
                tree.find_matches(llm.compute_block_hash_for_seq(toks, wl.tpb))
                t1 = time.perf_counter_ns()
                lat["dy_hm"].append((t1 - t0) / 1e3)
        for k, xs in lat.items():
            if xs:
                p = (pct(xs, 0.5), pct(xs, 0.99))
                old = best.get(k)
                best[k] = p if old is None else (min(old[0], p[0]), min(old[1], p[1]))
    dm = best.get("dy_m", (nan, nan))
    dhm = best.get("dy_hm", (nan, nan))
    rows += [
        ("match p50 (us)", best["kv_m"][0], dm[0], "lo", ""),
        ("match p99 (us)", best["kv_m"][1], dm[1], "lo", "<= 1"),
        ("hash + match p50 (us)", best["kv_hm"][0], dhm[0], "lo", "<= 0.8"),
    ]
    return rows, extra


# ------------------------------------------------------------------------------ end to end


def file_to_index(directory: str) -> PrefixIndex:
    """A file sink's directory read to its end by ``IndexConsumer(FileSource(directory))``."""
    consumer = IndexConsumer(FileSource(directory))

    async def go() -> None:
        async with consumer.source:
            await consumer.run()

    asyncio.run(go())
    return consumer.index


def kafka_to_index(messages: list[bytes], decode: Callable[[bytes], Any]) -> PrefixIndex:
    """Kafka message values decoded by ``decode`` (-> a ColumnarResult) and applied, in order,
    as the Kafka source hands them over (no broker in the loop)."""
    idx = PrefixIndex()
    apply = idx.apply
    for m in messages:
        r = decode(m)
        apply(r.columns, tuple(s.event_id for s in r.skipped))
    return idx


def e2e_rows(args: argparse.Namespace) -> list[tuple[str, float, float, str, str]]:
    rng = random.Random(args.seed + 1)
    wl = Workload(args, rng)
    batches, stored, removed = wl.batches(True)
    blocks = (stored + removed) / 1e6
    codec = AvroCodec()
    messages = [codec.encode(b) for b in batches]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kvstream-00000001.avro"
        try:  # the file sink's default container codec; uncompressed when it is not installed
            with ContainerWriter(path) as w:
                w.write_many(batches)
        except ImportError:
            path.unlink()
            with ContainerWriter(path, codec="null") as w:
                w.write_many(batches)
        with open(path, "rb") as f:
            head = f.read(4096)
        file_codec = "snappy" if b"snappy" in head else "deflate" if b"deflate" in head else "null"

        t = best_cpu(
            {
                "file": lambda: file_to_index(tmp),
                "kafka": lambda: kafka_to_index(messages, lambda m: decode_message(codec, m)),
            },
            args.rounds,
        )
    target = 2.0
    return [
        (
            f"file ({file_codec}) -> index (M blocks/s)",
            blocks / t["file"],
            target,
            "hi",
            ">= 1 (2M/s)",
        ),
        ("Kafka bytes -> index (M blocks/s)", blocks / t["kafka"], target, "hi", ">= 1 (2M/s)"),
    ]


# ------------------------------------------------------------------------------ output


def ratio(row: tuple[str, float, float, str, str]) -> float:
    kv, peer = row[1], row[2]
    if math.isnan(peer) or not peer:
        return float("nan")
    return kv / peer


def met(row: tuple[str, float, float, str, str]) -> str:
    goal = row[4].split(" ")
    if len(goal) < 2 or math.isnan(row[2]):
        return ""
    r = ratio(row)
    bound = float(goal[1])
    return "yes" if (r >= bound if goal[0] == ">=" else r <= bound) else "NO"


def svg(rows: list[tuple[str, float, float, str, str]], path: Path) -> None:
    """A horizontal bar chart of the ratios (log scale around 1), hand-written SVG."""
    data = [(r[0].strip(), ratio(r), r[3]) for r in rows if not math.isnan(ratio(r))]
    width, left, bar, gap = 760, 300, 18, 8
    height = 40 + len(data) * (bar + gap)
    x1 = left + (width - left - 20) / 2

    def x(v: float) -> float:
        return x1 + math.log10(max(min(v, 10.0), 0.1)) * (width - left - 20) / 2

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="{left}" y="16">kvstream / peer (log scale; for "lo" rows smaller is '
        "better)</text>",
        f'<line x1="{x1}" y1="24" x2="{x1}" y2="{height - 4}" stroke="#333"/>',
    ]
    for i, (name, r, sense) in enumerate(data):
        y = 30 + i * (bar + gap)
        good = r >= 1 if sense == "hi" else r <= 1
        color = "#2b8a3e" if good else "#c92a2a"
        xa, xb = sorted((x1, x(r)))
        out.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{name}</text>')
        out.append(
            f'<rect x="{xa:.1f}" y="{y}" width="{max(xb - xa, 1):.1f}" height="{bar}" '
            f'fill="{color}"/>'
        )
        out.append(f'<text x="{max(xb, x1) + 4:.1f}" y="{y + 13}">{r:.2f}x</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(ap, queries=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: codec,index,e2e")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--svg", type=Path, help="write a bar chart of the ratios here")
    args = ap.parse_args()
    llm = dynamo()
    skip = set(filter(None, args.skip.split(",")))
    print(
        f"# kvstream vs peers: python {sys.version.split()[0]}, {args.workers} workers, "
        f"{args.tokens}-token requests, {args.block_size}-token blocks, best of {args.rounds} "
        "(process CPU time)"
    )
    if llm is None:
        print(
            "# Dynamo rows: ai-dynamo-runtime is not importable here (use .peers-venv/bin/python)"
        )
    rows: list[tuple[str, float, float, str, str]] = []
    extra: dict[str, Any] = {}
    if "codec" not in skip:
        rows += codec_rows(args.rounds)
    if "index" not in skip:
        r, extra = index_rows(args, llm)
        rows += r
    if "e2e" not in skip:
        rows += e2e_rows(args)
    header = f"{'metric':44} {'kvstream':>10} {'peer':>10} {'ratio':>7} {'goal':>12} {'met':>4}"
    print(header)
    print("-" * len(header))
    for row in rows:
        name, kv, peer, _, goal = row
        r = ratio(row)
        peer_s = "n/a" if math.isnan(peer) else f"{peer:10.2f}"
        r_s = "" if math.isnan(r) else f"{r:6.2f}x"
        print(f"{name:44} {kv:10.2f} {peer_s:>10} {r_s:>7} {goal:>12} {met(row):>4}")
    print(
        "# peer: msgspec (codec rows), Dynamo RadixTree 1.6.1 (index rows), the 2M blocks/s "
        "goal (end-to-end rows); ratio = kvstream / peer (rates: higher is better; bytes "
        "and latencies: lower is better)"
    )
    if extra:
        print(f"# index workload: {extra}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": [
                        {"metric": r[0].strip(), "kvstream": r[1], "peer": r[2], "goal": r[4]}
                        for r in rows
                    ],
                    "dynamo": llm is not None,
                    "workload": vars(args) | {"json": None, "svg": None},
                },
                indent=1,
                default=str,
            )
        )
    if args.svg:
        svg(rows, args.svg)


if __name__ == "__main__":
    main()

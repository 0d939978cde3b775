"""kvstream against what users pick instead, like with like, in one run: one table of ratios.

    .peers-venv/bin/python benchmarks/bench_peers.py [--rounds 3] [--json OUT] [--svg OUT]
        [--skip codec,ingest,match,memory,file,replay] [--pure] [--tiny]
        [--workers 64 --tokens 8192 --block-size 32 --pool 256 --requests 62
         --capacity 8192 --chunk 64 --queries 1200]

``.peers-venv`` (``scripts/test-peers``) has ai-dynamo-runtime 1.6.1 (NVIDIA Dynamo's Rust
``RadixTree`` and ``compute_block_hash_for_seq``) and msgspec; without Dynamo its rows say
n/a and the rest runs.

Every round builds fresh data (a new seed, outside the timer); within a round the sides run
interleaved (the order reverses every other round). Rows report the median of each side over
the rounds, and the median ratio with its spread (min-max over the rounds); "met" compares
the median ratio with the goal (issue 22's goals table). Times are process CPU time (all
threads), the garbage collector on (a consumer runs with it).

The fleet (``_fleet_workload.py``, the audit's workload): ``--workers`` engines with LRU
prefix caches of ``--capacity`` blocks serve ``--requests`` prompts each, drawn from a pool
of ``--pool`` ``--tokens``-token prompts in ``--block-size``-token blocks that share 8 system
prompts (a quarter of each); chunked stores of at most ``--chunk`` blocks, each allocation's
LRU leaf-first evictions as one removal event before its store, engines interleaved batch by
batch (one batch = one engine iteration). Defaults: about 950k blocks stored + removed.
Both sides get the same events, each encoded before the timer in its own wire form:

* kvstream: Avro single-object messages (``AvroCodec.encode``, one per batch, as Kafka values
  arrive), decoded inside the timer by the Kafka source's reader
  (``kvstream.index.sources.decode_message`` -> columns) and applied
  (``PrefixIndex.apply``);
* Dynamo: one ``KvCacheEvent`` JSON per event, what ``RadixTree.apply_event`` takes, with the
  ``tokens_hash`` of each block computed before the timer by its own
  ``compute_block_hash_for_seq`` (a Dynamo publisher computes it on the worker).

Rows:

* **codec vs msgspec** (bench_codec.py's structs and workload, a fresh seed each round): a
  batch of 64 stored events x 16 blocks x 64 tokens, uniform and Zipf token ids; encode
  (kvstream model -> Avro bytes; msgspec vLLM ``KVEventBatch`` -> msgpack), decode (bytes ->
  kvstream's columns with the token ids unpacked; msgspec -> structs), and bytes per batch.
* **ingest, engine-keyed / token-keyed / Dynamo-keyed** (M blocks/s, stored + removed): the
  fleet's bytes into ``PrefixIndex()`` / ``PrefixIndex(key_mode="tokens")`` /
  ``PrefixIndex(key_mode="dynamo")`` against ``RadixTree`` (which keys by token hashes
  itself), each from an empty index. The goal rows count CPU time; the wall-clock reference
  row shows both sides' wall time, which on a loaded machine exceeds CPU time (preemption;
  Dynamo's binding also hands every call to the tree's own thread and waits for it).
* **match p50 / p99** (us) over ``--queries`` distinct queries per round: prefixes of pool
  prompts at random depths (one to all blocks), a tenth misses (random tokens), against the
  engine-keyed index and the tree after that round's ingest. kvstream ``match_hashes`` of
  the engine hashes; Dynamo ``find_matches`` of its local hashes. Both sides must report the
  same matched blocks per worker for every query, else the run stops. Latency is wall time
  per call, the sides taking turns query by query, with the long-lived heap frozen
  (``gc.freeze``) so a collection of the round's data does not land on one side's call;
  the "CPU time (ref.)" rows give the process CPU time of the same calls, which leaves out
  time spent off the CPU (``find_matches`` too waits for the tree's thread: on a loaded
  machine some calls wait milliseconds off-CPU while using ~70 us of CPU).
* **hash + match p50 / p99** (us), the same queries from token ids: kvstream
  ``PrefixIndex.match`` (it hashes with the workers' ``vllm_sha256_cbor_64``), and the same on
  the Dynamo-keyed index (XXH3 local hashes, like Dynamo); Dynamo
  ``compute_block_hash_for_seq`` + ``find_matches``.
* **memory** (MiB per million present worker x block pairs): each side in a fresh process
  (bench_index_memory's harness): the round's input bytes loaded, then RSS read (after
  ``gc.collect`` and ``malloc_trim``), the bytes ingested, RSS read again; the difference over
  the pairs still cached at the end.
* **file -> index** (M blocks/s): ``kvstream demo --trace mooncake-synthetic --ranks 8`` writes
  its Avro container files (a new ``--seed`` each round, outside the timer);
  ``IndexConsumer(FileSource(dir))`` reads them to an index, against fastavro's bare record
  iteration of the same files (``for _ in fastavro.reader(f)``: no index, no model). The
  demo's files use the file sink's default codec (snappy), whose decompression both sides
  pay; the "uncompressed" row reads the same batches rewritten with the ``null`` codec.
* **replay** (s CPU): ``kvstream replay`` of the Mooncake conversation trace (12,031 requests,
  8 workers, the defaults of bench_replay.py), a new seed each round; goal: under 5 s.

``--pure`` runs the same rows again in a subprocess with ``KVSTREAM_NO_NATIVE=1`` and prints,
per row, how many times slower (or larger) the pure-Python fallback is than native (goal: at
most 5x; reported, not asserted). ``--tiny`` shrinks everything for a smoke test.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fleet_workload import ALGO, Encoded, FleetSpec, encode_fleet, random_tokens
from bench_index_memory import fresh_process, rss

from kvstream.codec import AvroCodec
from kvstream.hashing import get_hasher, split_blocks
from kvstream.index import DomainKey, FileSource, HashRequest, IndexConsumer, PrefixIndex
from kvstream.index.sources import decode_message
from kvstream.index.sources.base import skipped_ids

SECTIONS = ("codec", "ingest", "match", "memory", "file", "replay")
KEY_MODES = ("engine", "tokens", "dynamo")
#: how the rows name each key mode
MODE_LABEL = {"engine": "engine-keyed", "tokens": "token-keyed", "dynamo": "Dynamo-keyed"}


def dynamo() -> Any:
    """``dynamo.llm`` when ai-dynamo-runtime is importable, else None."""
    try:
        from dynamo import llm
    except ImportError:
        return None
    return llm


@dataclass
class Row:
    """One metric: kvstream's and the peer's value per round (``peer`` empty: an absolute
    goal, or no peer here). ``sense``: "hi" (rates: higher is better) or "lo". ``goal``:
    "OP BOUND" on the ratio (OP ">=" or "<="), "OP BOUND abs" on kvstream's own value, or ""."""

    name: str
    sense: str
    goal: str
    kv: list[float] = field(default_factory=list)
    peer: list[float] = field(default_factory=list)

    def ratios(self) -> list[float]:
        return [k / p for k, p in zip(self.kv, self.peer, strict=False) if p]

    def ratio(self) -> float:
        rs = self.ratios()
        return statistics.median(rs) if rs else float("nan")

    def met(self) -> str:
        parts = self.goal.split()
        if len(parts) < 2 or not self.kv:
            return ""
        value = statistics.median(self.kv) if parts[2:] == ["abs"] else self.ratio()
        if math.isnan(value):
            return ""
        ok = value >= float(parts[1]) if parts[0] == ">=" else value <= float(parts[1])
        return "yes" if ok else "NO"


class Rows:
    """Rows by name, in order of first use."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def add(self, name: str, sense: str, goal: str, kv: float, peer: float | None) -> None:
        row = self.rows.setdefault(name, Row(name, sense, goal))
        row.kv.append(kv)
        if peer is not None:
            row.peer.append(peer)


def cpu(fn: Callable[[], Any]) -> tuple[float, Any, float]:
    """(process CPU seconds, result, wall seconds) of ``fn()``, after a full collection."""
    gc.collect()
    w0 = time.perf_counter()
    t0 = time.process_time()
    out = fn()
    t1 = time.process_time()
    return t1 - t0, out, time.perf_counter() - w0


def in_turn(
    r: int, fns: list[tuple[str, Callable[[], Any]]]
) -> dict[str, tuple[float, Any, float]]:
    """Run ``fns`` in order (reversed on odd rounds); name -> (CPU s, result, wall s)."""
    order = fns if r % 2 == 0 else fns[::-1]
    return {name: cpu(fn) for name, fn in order}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def round_seed(args: argparse.Namespace, r: int) -> int:
    """Round ``r``'s seed: a new one every round."""
    return int(args.seed) + 1_000_003 * (r + 1)


# ------------------------------------------------------------------------------ codec


def codec_rows(args: argparse.Namespace, rows: Rows) -> None:
    import msgspec
    from bench_codec import KVEventBatch
    from bench_codec import build as build_codec_workload

    from kvstream.codec import schema_registry
    from kvstream.codec.columnar import decode_columns_message

    codec, registry = AvroCodec(), schema_registry()
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVEventBatch)
    n = 2 if args.tiny else 20
    for r in range(args.rounds):
        for dist in ("uniform", "zipf"):
            w = build_codec_workload(dist, 64, 16, 64, round_seed(args, r))
            data, ms = codec.encode(w.batch), enc.encode(w.vllm)
            if decode_columns_message(data, registry).batch.events != w.batch.events:
                raise SystemExit("kvstream round trip failed")

            def kv_dec(data: bytes = data) -> None:
                for _ in range(n):
                    # .tokens: the ids unpacked (msgspec always builds its int lists)
                    decode_columns_message(data, registry).columns.tokens  # noqa: B018

            t = in_turn(
                r,
                [
                    ("kv_enc", lambda w=w: [codec.encode(w.batch) for _ in range(n)]),
                    ("ms_enc", lambda w=w: [enc.encode(w.vllm) for _ in range(n)]),
                    ("kv_dec", kv_dec),
                    ("ms_dec", lambda ms=ms: [dec.decode(ms) for _ in range(n)]),
                ],
            )
            b = w.blocks * n / 1e6
            rows.add(
                f"encode, {dist} tokens (M blocks/s)",
                "hi",
                ">= 1",
                b / t["kv_enc"][0],
                b / t["ms_enc"][0],
            )
            rows.add(
                f"decode to columns, {dist} (M blocks/s)",
                "hi",
                ">= 1.5",
                b / t["kv_dec"][0],
                b / t["ms_dec"][0],
            )
            goal = "<= 0.6" if dist == "uniform" else "<= 0.8"
            rows.add(
                f"bytes, {dist} tokens (KiB/batch)", "lo", goal, len(data) / 1024, len(ms) / 1024.0
            )


# ------------------------------------------------------------------------------ ingest, match


def kafka_to_index(
    messages: Iterable[bytes],
    decode: Callable[[bytes], Any] | None = None,
    key_mode: str = "engine",
) -> PrefixIndex:
    """Kafka message values decoded (``decode``: bytes -> ColumnarResult; default the Kafka
    source's ``decode_message``) and applied in order, as the Kafka source hands them over
    (no broker in the loop)."""
    idx = PrefixIndex(key_mode=key_mode)
    apply = idx.apply
    if decode is None:
        codec = AvroCodec()

        def decode(m: bytes) -> Any:
            return decode_message(codec, m)

    for m in messages:
        res = decode(m)
        apply(res.columns, skipped_ids(res.skipped) if res.skipped else ())
    return idx


def feed_dynamo(llm: Any, events: list[tuple[int, bytes]]) -> Any:
    """A new ``RadixTree`` fed every ``(worker, KvCacheEvent JSON)`` in order."""
    tree = llm.RadixTree()
    apply = tree.apply_event
    for w, data in events:
        apply(w, data)
    return tree


def fleet_spec(args: argparse.Namespace) -> FleetSpec:
    return FleetSpec(
        workers=args.workers,
        tokens=args.tokens,
        block_size=args.block_size,
        pool=args.pool,
        requests=args.requests,
        capacity=args.capacity,
        chunk=args.chunk,
    )


def check_index(idx: PrefixIndex, enc: Encoded, mode: str) -> None:
    st = idx.stats()
    if st.blocks != enc.totals.present or st.stale_workers or st.unrooted_blocks:
        raise SystemExit(
            f"{mode}-keyed index disagrees with the fleet: {st.blocks} blocks cached "
            f"(expected {enc.totals.present}), {st.stale_workers} stale workers, "
            f"{st.unrooted_blocks} unrooted blocks"
        )


@dataclass
class Query:
    tokens: list[int]
    hashes: list[bytes]
    local: list[int]


def queries(args: argparse.Namespace, enc: Encoded, llm: Any, seed: int) -> list[Query]:
    """Distinct prefixes of pool prompts at random depths, and a tenth misses."""
    import numpy as np

    rng = random.Random(seed)
    n_blocks = args.tokens // args.block_size
    pairs = {(rng.randrange(args.pool), rng.randint(1, n_blocks)) for _ in range(args.queries * 2)}
    hits = sorted(pairs)
    rng.shuffle(hits)
    hits = hits[: args.queries - args.queries // 10]
    out = []
    for p, d in hits:
        local = enc.local[p][:d] if enc.local is not None else []
        out.append(Query(enc.prompts.tokens(p, d), enc.prompts.hashes[p][:d], local))
    nrng = np.random.default_rng(seed)
    hasher = get_hasher(ALGO)
    for _ in range(args.queries // 10):
        toks = array("I", random_tokens(nrng, rng.randint(1, n_blocks) * args.block_size))
        tl = toks.tolist()
        local = list(llm.compute_block_hash_for_seq(tl, args.block_size)) if llm else []
        out.append(Query(tl, list(hasher.chain_bytes(split_blocks(tl, args.block_size))), local))
    rng.shuffle(out)
    return out


def index_rows(args: argparse.Namespace, llm: Any, rows: Rows, memory: bool) -> None:
    codec = AvroCodec()
    spec = fleet_spec(args)
    for r in range(args.rounds):
        seed = round_seed(args, r)
        enc = encode_fleet(spec, seed, llm, codec)
        blocks = enc.totals.blocks / 1e6
        print(
            f"# round {r + 1}: {enc.totals.stored:,} stored + {enc.totals.removed:,} removed "
            f"blocks in {enc.totals.batches:,} batches, {enc.totals.present:,} present pairs",
            file=sys.stderr,
        )
        idx: dict[str, PrefixIndex] = {}
        tree = None
        if "ingest" not in args.skip or "match" not in args.skip:
            msgs, dyn = enc.messages, enc.dynamo
            fns: list[tuple[str, Callable[[], Any]]] = [
                (m, lambda m=m, msgs=msgs: kafka_to_index(msgs, key_mode=m)) for m in KEY_MODES
            ]
            if llm is not None and dyn is not None:
                fns.insert(1, ("peer", lambda dyn=dyn: feed_dynamo(llm, dyn)))
            t = in_turn(r, fns)
            for m in KEY_MODES:
                idx[m] = t[m][1]
                check_index(idx[m], enc, m)
            tree = t["peer"][1] if "peer" in t else None
        if "ingest" not in args.skip:
            peer = blocks / t["peer"][0] if "peer" in t else None
            for m, goal in zip(KEY_MODES, (">= 1.2", ">= 1", ">= 1"), strict=True):
                rows.add(
                    f"ingest, {MODE_LABEL[m]} (M blocks/s)", "hi", goal, blocks / t[m][0], peer
                )
            rows.add(
                "ingest, engine-keyed, wall (M/s, ref.)",
                "hi",
                "",
                blocks / t["engine"][2],
                blocks / t["peer"][2] if "peer" in t else None,
            )
        if "match" not in args.skip:
            qs = queries(args, enc, llm, seed + 1)
            match_rows(args, llm, rows, qs, (idx["engine"], idx["dynamo"], tree))
        del idx, tree
        if memory:
            memory_rows(args, llm, rows, enc, r)
        del enc


def match_rows(
    args: argparse.Namespace, llm: Any, rows: Rows, qs: list[Query], sides: tuple[Any, Any, Any]
) -> None:
    """Latencies of ``qs`` on the engine-keyed and Dynamo-keyed indexes and on Dynamo's tree
    (``sides``; the tree None without Dynamo), one query at a time on each side in turn."""
    eng, dyk, tree = sides
    req = HashRequest(drop_last_token=False)
    dom = DomainKey(ALGO, args.block_size, 0)
    if tree is not None:  # both sides must give the same answer
        for q in qs:
            kv = {
                int(k.instance_id.removeprefix("worker-")): d
                for k, d in eng.match_hashes(dom, q.hashes).items()
            }
            dy = {w: d for (w, _), d in tree.find_matches(q.local).scores.items()}
            if kv != dy:
                raise SystemExit(f"kvstream and Dynamo disagree on a query: {kv} vs {dy}")
    bs = args.block_size
    calls: list[tuple[str, Callable[[Query], Any]]] = [
        ("kv_m", lambda q: eng.match_hashes(dom, q.hashes)),
        ("kv_hm", lambda q: eng.match(q.tokens, request=req)),
        ("kd_hm", lambda q: dyk.match(q.tokens, request=req)),
    ]
    if tree is not None:
        calls += [
            ("dy_m", lambda q: tree.find_matches(q.local)),
            ("dy_hm", lambda q: tree.find_matches(llm.compute_block_hash_for_seq(q.tokens, bs))),
        ]
    wall: dict[str, list[float]] = {k: [] for k, _ in calls}
    cpu_: dict[str, list[float]] = {k: [] for k, _ in calls}
    clock, cpu_clock = time.perf_counter_ns, time.process_time_ns
    # the indexes, the tree and the round's data are long-lived: a server would freeze them
    # too; else a full collection walking them lands on whichever side's call is running
    gc.collect()
    gc.freeze()
    for q in qs:
        for key, call in calls:
            c0 = cpu_clock()
            t0 = clock()
            call(q)
            t1 = clock()
            c1 = cpu_clock()
            wall[key].append((t1 - t0) / 1e3)
            cpu_[key].append((c1 - c0) / 1e3)
    gc.unfreeze()

    def add(name: str, goal: str, q: float, pair: tuple[str, str], lat: dict[str, Any]) -> None:
        kv, dy = pair
        rows.add(name, "lo", goal, pct(lat[kv], q), pct(lat[dy], q) if dy in lat else None)

    m, hm, kd = ("kv_m", "dy_m"), ("kv_hm", "dy_hm"), ("kd_hm", "dy_hm")
    add("match p50 (us)", "", 0.5, m, wall)
    add("match p99 (us)", "<= 1", 0.99, m, wall)
    add("match p99, CPU time (us, ref.)", "", 0.99, m, cpu_)
    add("hash + match p50 (us)", "<= 0.8", 0.5, hm, wall)
    add("hash + match p99 (us)", "", 0.99, hm, wall)
    add("hash + match p99, CPU time (us, ref.)", "", 0.99, hm, cpu_)
    add("hash + match p50, Dynamo-keyed (us)", "<= 0.8", 0.5, kd, wall)
    add("hash + match p99, Dynamo-keyed (us)", "", 0.99, kd, wall)


# ------------------------------------------------------------------------------ memory


def memory_side(args: argparse.Namespace) -> None:
    """(In a fresh process) load ``--input``, read RSS, ingest it on ``--side``, read RSS:
    print ``{"mib": delta}``."""
    with open(args.input, "rb") as f:
        data = pickle.load(f)
    r0 = rss()
    if args.side == "peer":
        keep: Any = feed_dynamo(dynamo(), data)
    else:
        keep = kafka_to_index(data, key_mode=args.side)
    r1 = rss()
    assert keep is not None
    print(json.dumps({"mib": (r1 - r0) / 2**20}))


def memory_rows(args: argparse.Namespace, llm: Any, rows: Rows, enc: Encoded, r: int) -> None:
    pairs_m = enc.totals.present / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        kv_in, dy_in = Path(tmp) / "avro.pickle", Path(tmp) / "dynamo.pickle"
        kv_in.write_bytes(pickle.dumps(enc.messages))
        sides = list(KEY_MODES)
        if llm is not None and enc.dynamo is not None:
            dy_in.write_bytes(pickle.dumps(enc.dynamo))
            sides.insert(1, "peer")
        got = {}
        for side in sides if r % 2 == 0 else sides[::-1]:
            src = dy_in if side == "peer" else kv_in
            got[side] = fresh_process(
                sys.executable, [__file__, f"--side={side}", f"--input={src}"]
            )["mib"]
    peer = got["peer"] / pairs_m if "peer" in got else None
    for m, goal in zip(KEY_MODES, ("<= 1", "<= 1.5", "<= 1.5"), strict=True):
        rows.add(f"memory, {MODE_LABEL[m]} (MiB/M pairs)", "lo", goal, got[m] / pairs_m, peer)


# ------------------------------------------------------------------------------ file, replay


def file_to_index(directory: str) -> PrefixIndex:
    """A file sink's directory read to its end by ``IndexConsumer(FileSource(directory))``."""
    consumer = IndexConsumer(FileSource(directory))

    async def go() -> None:
        async with consumer.source:
            await consumer.run()

    asyncio.run(go())
    return consumer.index


def fastavro_iterate(directory: str) -> int:
    """fastavro's bare record iteration of every container file in ``directory``."""
    import fastavro

    n = 0
    for path in sorted(Path(directory).glob("*.avro")):
        with open(path, "rb") as f:
            for _ in fastavro.reader(f):
                n += 1
    return n


def uncompressed_copy(src: str, dst: str) -> None:
    """Every container file of ``src`` rewritten into ``dst`` with the ``null`` codec."""
    from kvstream.codec import ContainerWriter, read_container

    for path in sorted(Path(src).glob("*.avro")):
        with ContainerWriter(Path(dst) / path.name, codec="null") as w:
            w.write_many(read_container(path))


def file_rows(args: argparse.Namespace, rows: Rows) -> None:
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as raw:
            cmd = [sys.executable, "-m", "kvstream", "demo", "--trace", "mooncake-synthetic"]
            cmd += ["--ranks", "8", "--out", tmp, "--seed", str(round_seed(args, r)), "--json"]
            if args.demo_requests:
                cmd += ["--requests", str(args.demo_requests)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            demo = json.loads(out)
            uncompressed_copy(tmp, raw)
            blocks = (demo["blocks_stored"] + demo["blocks_removed"]) / 1e6
            t = in_turn(
                r,
                [
                    ("kv", lambda tmp=tmp: file_to_index(tmp)),
                    ("fa", lambda tmp=tmp: fastavro_iterate(tmp)),
                    ("kv_raw", lambda raw=raw: file_to_index(raw)),
                    ("fa_raw", lambda raw=raw: fastavro_iterate(raw)),
                ],
            )
            for k in ("kv", "kv_raw"):
                if t[k][1].stats().counters.stored_blocks != demo["blocks_stored"]:
                    raise SystemExit("file -> index: the index missed stored blocks of the demo")
            for name, kv, fa in (
                ("file -> index, demo stream (M blocks/s)", "kv", "fa"),
                ("file -> index, demo uncompressed (M blocks/s)", "kv_raw", "fa_raw"),
            ):
                rows.add(name, "hi", ">= 0.5", blocks / t[kv][0], blocks / t[fa][0])


def replay_rows(args: argparse.Namespace, rows: Rows) -> None:
    from kvstream.cli.replay_run import ReplayOptions, load_rows, run_replay

    base = ReplayOptions(trace="conversation", limit=args.replay_limit)
    trace = load_rows(base)
    for r in range(args.rounds):
        opts = replace(base, seed=round_seed(args, r))
        t = cpu(lambda opts=opts: asyncio.run(run_replay(opts, rows=trace)))[0]
        rows.add("replay, conversation trace (s CPU)", "lo", "<= 5 abs", t, None)


# ------------------------------------------------------------------------------ output


def fmt(x: float) -> str:
    return f"{x:10.2f}" if x < 1e4 else f"{x:10.3g}"


def print_table(rows: list[Row], llm: Any) -> None:
    head = f"{'metric':46} {'kvstream':>10} {'peer':>10} {'ratio':>7} {'spread':>13} "
    head += f"{'goal':>11} {'met':>4}"
    print(head)
    print("-" * len(head))
    for row in rows:
        kv = statistics.median(row.kv)
        peer = fmt(statistics.median(row.peer)) if row.peer else "n/a"
        rs = row.ratios()
        r = f"{row.ratio():6.2f}x" if rs else ""
        spread = f"{min(rs):.2f}-{max(rs):.2f}" if rs else f"{min(row.kv):.2f}-{max(row.kv):.2f}"
        goal = row.goal.replace(" abs", " s") if row.goal.endswith("abs") else row.goal
        print(f"{row.name:46} {fmt(kv)} {peer:>10} {r:>7} {spread:>13} {goal:>11} {row.met():>4}")
    print(
        "# peers: msgspec (codec rows), Dynamo RadixTree / compute_block_hash_for_seq "
        f"({'ai-dynamo-runtime' if llm else 'not importable here: n/a'}; ingest, match, "
        "memory rows), fastavro's bare iteration (file row); ratio = kvstream / peer, median of "
        "the rounds (spread: min-max; rows without a peer: kvstream's own min-max)"
    )


def svg(rows: list[Row], path: Path) -> None:
    """A horizontal bar chart of the median ratios (log scale around 1), hand-written SVG."""
    data = [(r.name, r.ratio(), r.sense) for r in rows if not math.isnan(r.ratio())]
    width, left, bar, gap = 800, 340, 18, 8
    height = 40 + len(data) * (bar + gap)
    x1 = left + (width - left - 20) / 2

    def x(v: float) -> float:
        return x1 + math.log10(max(min(v, 10.0), 0.1)) * (width - left - 20) / 2

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="{left}" y="16">kvstream / peer, median of rounds (log scale; for time, '
        "bytes and memory smaller is better)</text>",
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


def pure_table(native: list[Row], argv: list[str]) -> list[dict[str, Any]]:
    """Run the same rows with KVSTREAM_NO_NATIVE=1 in a subprocess; per row, how many times
    slower (or larger) the pure-Python fallback's median is than native's."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pure.json"
        env = dict(os.environ, KVSTREAM_NO_NATIVE="1")
        cmd = [sys.executable, __file__, *argv, "--no-peer", f"--json={out}"]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        pure = {r["metric"]: r for r in json.loads(out.read_text())["rows"]}
    print("\n# pure-Python fallback (KVSTREAM_NO_NATIVE=1) against native, same rows")
    head = f"{'metric':46} {'native':>10} {'pure':>10} {'x slower':>9} {'goal':>6} {'met':>4}"
    print(head)
    print("-" * len(head))
    table = []
    for row in native:
        p = pure.get(row.name)
        if p is None:
            continue
        nat, pur = statistics.median(row.kv), statistics.median(p["kvstream_rounds"])
        slower = nat / pur if row.sense == "hi" else pur / nat
        met = "yes" if slower <= 5 else "NO"
        print(f"{row.name:46} {fmt(nat)} {fmt(pur)} {slower:8.2f}x {'<= 5':>6} {met:>4}")
        table.append({"metric": row.name, "native": nat, "pure": pur, "slower": slower})
    return table


def same_run(args: argparse.Namespace) -> list[str]:
    """Options that repeat this run's rows and sizes (for the pure-Python subprocess)."""
    keys = ["rounds", "seed", "workers", "tokens", "block_size", "pool", "requests", "capacity"]
    keys += ["chunk", "queries", "demo_requests", "replay_limit"]
    out = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys if getattr(args, k)]
    out += ["--tiny"] if args.tiny else []
    return out + ([f"--skip={','.join(sorted(args.skip))}"] if args.skip else [])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--pool", type=int, default=256, help="distinct prompts")
    ap.add_argument("--requests", type=int, default=62, help="requests served per worker")
    ap.add_argument("--capacity", type=int, default=8192, help="cache blocks per worker")
    ap.add_argument("--chunk", type=int, default=64, help="most blocks per stored event")
    ap.add_argument("--queries", type=int, default=1200, help="distinct queries per round")
    ap.add_argument("--demo-requests", type=int, default=None, help="file row: demo requests")
    ap.add_argument("--replay-limit", type=int, default=None, help="replay row: first N rows")
    ap.add_argument("--skip", default="", help=f"comma list of sections: {','.join(SECTIONS)}")
    ap.add_argument("--tiny", action="store_true", help="a small run (smoke test)")
    ap.add_argument("--pure", action="store_true", help="also run the pure-Python fallback")
    ap.add_argument("--no-peer", action="store_true", help="kvstream's side only")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--svg", type=Path, help="write a bar chart of the ratios here")
    ap.add_argument("--side", choices=[*KEY_MODES, "peer"], help=argparse.SUPPRESS)
    ap.add_argument("--input", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        memory_side(args)
        return
    if args.tiny:
        args.workers, args.tokens, args.pool, args.requests = 4, 1024, 12, 8
        args.capacity, args.chunk, args.queries = 96, 16, 60
        args.demo_requests, args.replay_limit = args.demo_requests or 12, args.replay_limit or 150
    args.skip = set(filter(None, args.skip.split(",")))
    if args.skip - set(SECTIONS):
        ap.error(f"--skip: unknown sections {sorted(args.skip - set(SECTIONS))}")
    llm = None if args.no_peer else dynamo()
    print(
        f"# kvstream vs peers: python {sys.version.split()[0]}, {args.rounds} rounds, fleet of "
        f"{args.workers} workers x {args.requests} requests of {args.tokens} tokens "
        f"({args.block_size}-token blocks, {args.chunk}-block chunks, {args.capacity}-block "
        f"caches), load {os.getloadavg()[0]:.2f}"
    )
    if llm is None and not args.no_peer:
        print(
            "# Dynamo rows: ai-dynamo-runtime is not importable here (use .peers-venv/bin/python)"
        )
    rows = Rows()
    if "codec" not in args.skip:
        codec_rows(args, rows)
    if not {"ingest", "match", "memory"} <= args.skip:
        index_rows(args, llm, rows, memory="memory" not in args.skip)
    if "file" not in args.skip:
        file_rows(args, rows)
    if "replay" not in args.skip:
        replay_rows(args, rows)
    table = list(rows.rows.values())
    print_table(table, llm)
    pure = pure_table(table, same_run(args)) if args.pure else None
    if args.json:
        doc = {
            "rows": [
                {
                    "metric": r.name,
                    "kvstream": statistics.median(r.kv),
                    "peer": statistics.median(r.peer) if r.peer else None,
                    "ratio": None if math.isnan(r.ratio()) else r.ratio(),
                    "ratio_spread": [min(r.ratios()), max(r.ratios())] if r.ratios() else None,
                    "goal": r.goal,
                    "met": r.met(),
                    "kvstream_rounds": r.kv,
                    "peer_rounds": r.peer,
                }
                for r in table
            ],
            "pure": pure,
            "dynamo": llm is not None,
            "load": os.getloadavg()[0],
            "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
        }
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    if args.svg:
        svg(table, args.svg)


if __name__ == "__main__":
    main()

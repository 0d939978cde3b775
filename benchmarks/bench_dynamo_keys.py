"""The Dynamo-keyed index's hot paths in ``kvstream serve``: C against the pure-Python twins.

1. ``/query``: a request body of N token ids (1k, 3k, 8k) to its Dynamo keys (16-byte keys of
   the full 16-token blocks), the way ``IndexService.query_body`` does it (msgspec decodes the
   body with ``token_ids`` as raw JSON, ``accel.json_ids`` reads the ids to u32 bytes in C,
   ``keys.dynamo_request_keys`` hashes and chains them in one C call) against the decoded
   path it replaced (msgspec decodes a Python int per id, then the Python twin packs them and
   hashes each block with two ``xxhash`` calls); and the key step alone, from msgspec's list.
2. ``/query_by_hash``: N/16 signed-i64 local hashes to keys (``keys_from_i64``, C vs twin).
3. ingest: 400 stored events of 48 blocks of 16 tokens (vLLM msgpack, ``vllm_sha256_64``),
   each followed by the removal of its last 24 blocks, through ``decode_payload`` +
   ``EngineStream.convert`` + ``PrefixIndex(key_mode="dynamo").apply``: CPU per block in all,
   and in ``apply`` alone. Run it twice, once with ``KVSTREAM_NO_NATIVE=1`` (every C path
   off, this one included), to see the pure-Python figure.

Run::

    python benchmarks/bench_dynamo_keys.py [--reps 300]
    KVSTREAM_NO_NATIVE=1 python benchmarks/bench_dynamo_keys.py --only ingest

Figures are medians of ``--reps`` calls (wall time of one thread, which is its CPU time on an
idle core); ingest is the best of ``--rounds`` runs in process CPU time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvstream.engines.stream import EngineStream
from kvstream.engines.vllm import VLLM, decode_payload
from kvstream.engines.vllm_export import VllmExporter
from kvstream.events.model import EventBatch, KVCacheEvent, Removed, SourceId, Stored, StoredBlock
from kvstream.hashing import accel, get_hasher, split_blocks
from kvstream.index import PrefixIndex
from kvstream.index import keys as K
from kvstream.index.keys import KeyMode
from kvstream.serve.requests import QueryRequest, QueryTokensRequest

BS = 16


def median_us(f: Callable[[], Any], reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def bench_query(reps: int) -> None:
    rng = random.Random(1)
    listed = msgspec.json.Decoder(QueryRequest)
    raw_tokens = msgspec.json.Decoder(QueryTokensRequest)
    print(f"C extension: {K.NATIVE_DYNAMO_KEYS}; block size {BS}; median of {reps} calls, us")
    print(
        f"{'tokens':>7} {'decoded path':>13} {'fast path':>10} {'keys: twin':>11} "
        f"{'keys: C':>8} {'by_hash twin':>13} {'by_hash C':>10}"
    )
    for n in (1000, 3000, 8000):
        query_row(n, [rng.randrange(150_000) for _ in range(n)], listed, raw_tokens, reps)


def query_row(n: int, ids: list[int], listed: Any, raw_tokens: Any, reps: int) -> None:
    body = json.dumps({"token_ids": ids, "model_name": "default"}).encode()

    def decoded() -> list[bytes]:
        req = listed.decode(body)
        return K.py_dynamo_request_keys(req.token_ids, BS, req.lora_name)

    def fast() -> list[bytes]:
        req = raw_tokens.decode(body)
        raw = accel.json_ids(req.token_ids)
        assert raw is not None
        return K.dynamo_request_keys(raw, BS, req.lora_name)

    assert decoded() == fast()
    hashes = [int.from_bytes(k[8:], "big", signed=True) for k in fast()]
    print(
        f"{n:>7} {median_us(decoded, reps):>13.1f} {median_us(fast, reps):>10.1f} "
        f"{median_us(lambda: K.py_dynamo_request_keys(ids, BS), reps):>11.1f} "
        f"{median_us(lambda: K.dynamo_request_keys(ids, BS), reps):>8.1f} "
        f"{median_us(lambda: K.py_keys_from_i64(hashes), reps):>13.1f} "
        f"{median_us(lambda: K.keys_from_i64(hashes), reps):>10.1f}"
    )


def ingest_payloads() -> list[bytes]:
    h = get_hasher("vllm_sha256_cbor_64")
    rng = random.Random(1)
    ex = VllmExporter()
    src = SourceId(instance_id="e", attention_dp_rank=0, incarnation=1)
    out: list[bytes] = []
    eid = 0
    for _ in range(400):
        blocks = split_blocks([rng.randrange(30000) for _ in range(BS * 48)], BS)
        hs = h.chain_bytes(blocks)
        stored = Stored(
            parent_hash=None,
            blocks=tuple(
                StoredBlock(block_hash=x, token_ids=b) for x, b in zip(hs, blocks, strict=True)
            ),
        )
        for data in (stored, Removed(block_hashes=tuple(hs[24:]))):
            ev = KVCacheEvent(
                event_id=eid,
                hash_algo="vllm_sha256_cbor_64",
                layer_group_id=0,
                window_size=1 << 30,
                data=data,
            )
            eid += 1
            out.append(ex.encode(EventBatch(source=src, ts_ns=1, events=[ev])).payload)
    return out


def bench_ingest(rounds: int) -> None:
    payloads = ingest_payloads()
    n_blocks = 400 * 48
    clock = time.process_time
    runs = []
    for _ in range(rounds):
        st = EngineStream("1", 0, "vllm_sha256_64")
        index = PrefixIndex(key_mode=KeyMode.DYNAMO, default_tokens_per_block=BS)
        in_apply = 0.0
        t0 = clock()
        for p in payloads:
            batch = st.convert(decode_payload(p, width=st.width, dialect=VLLM))
            t1 = clock()
            index.apply(batch)
            in_apply += clock() - t1
        runs.append(((clock() - t0) / n_blocks * 1e6, in_apply / n_blocks * 1e6))
    total, apply = min(r[0] for r in runs), min(r[1] for r in runs)
    print(
        f"ingest (C extension: {K.NATIVE_DYNAMO_KEYS}): {total:.2f} us CPU per stored block, "
        f"{apply:.2f} of it in PrefixIndex.apply (best of {rounds})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--only", choices=("query", "ingest"))
    args = ap.parse_args()
    if args.only != "ingest":
        bench_query(args.reps)
    if args.only != "query":
        bench_ingest(args.rounds)


if __name__ == "__main__":
    main()

"""Codec benchmark: kvstream's Avro codec against naive fastavro and vLLM's msgspec wire format.

A realistic batch: ``--events`` stored events x ``--blocks`` blocks x ``--tokens`` tokens
(8-byte hashes, token ids from a 128k vocabulary: uniform, or Zipf-like with frequent ids
small as in BPE vocabularies) plus one removed event (4 hashes) per 8 stored events.

Formats, each encoding the same information:

(a) kvstream ``AvroCodec`` (single-object encoding, schema v4, token ids packed per batch:
    ``token_encoding="auto"``) from ``EventBatch`` models; decode back to validated models
    (and, for reference, the fastavro stage alone). Schema v3 (bit-plane tokens) for reference.
    Decode to columns (``decode_columns_message``, what consumers use, token ids unpacked to
    bytes) by the C decoder (``kvstream.codec._columns_native``) and by the pure-Python
    reference it falls back to (fastavro + ``record_columns``), in the same rounds.
(b) fastavro ``schemaless_writer`` of pre-built plain dicts in a naive row-wise layout (one
    record per block, ``array<long>`` of token ids), decode to dicts.
(c) msgspec msgpack of vLLM >= 0.24 events (``KVEventBatch`` array-like ``[ts, events, rank]``,
    ``BlockStored``/``BlockRemoved`` tagged maps; see reference/peers.md section 1.2) from
    pre-built structs, decode to structs.

Timing: rounds interleave the formats; each figure is the best round, measured as thread CPU
time (robust on a shared machine) with the GC paused like ``timeit`` (``--gc`` leaves it
on). Targets: kvstream encode blocks/s >= msgspec's; kvstream bytes <= 0.6x msgspec's on
uniform ids and <= 0.8x on Zipf ids.

Two more tables:

* token encodings: bytes per id and the cost of each v4 token encoding alone (encode_tokens /
  tokens_from_record on the batch's ids) and of the whole codec with it;
* Kafka producer compression: the same events as Kafka record batches built by aiokafka's own
  ``DefaultRecordBatchBuilder`` (what ``AIOKafkaProducer(compression_type=...)`` sends:
  ``max_batch_size`` 16 KiB, one record per engine batch of ``--kafka-events`` events), for
  kvstream v4 (packed tokens), kvstream v3 (bit planes) and msgspec, uncompressed and with
  gzip/snappy/lz4/zstd: bytes on the wire, producer CPU to build the batches, consumer CPU to
  read them back (skipped without aiokafka).

And, with ``--e2e``, bench_peers' fleet (``_fleet_workload.py``: stores and LRU evictions
of 64 engines, seed 1) read from a container file by ``IndexConsumer(FileSource(...))`` and
from Kafka message values decoded and applied, with the C column decoder and with the
reference, in the same rounds (process CPU time).

Usage: ``python benchmarks/bench_codec.py [--rounds 15] [--profile] [--kafka-events 4] [--e2e]``
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstream._types import TokenIds
from kvstream.codec import AvroCodec, columnar, schema_registry
from kvstream.codec.columnar import decode_columns_message
from kvstream.codec.decoder import read_record
from kvstream.codec.framing import split_single_object
from kvstream.codec.schemas import SchemaRegistry
from kvstream.codec.tokens import TOKEN_ENCODINGS, encode_tokens, tokens_from_record
from kvstream.events.model import (
    EventBatch,
    KVCacheEvent,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
)

VOCAB = 128_000


# ------------------------------------------------------------------------ vLLM (msgspec)


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM >= 0.24 ``BlockStored`` (field order of peers.md 1.2, up to the fields vLLM
    0.33 sets for a plain full-attention request)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None = None


# The map-era test vector of peers.md 1.2, to check the struct definitions above.
_VLLM_VECTOR = (
    "93cb0000000000000000918aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf"
    "84b146b151d55111b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa62"
    "6c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a96772"
    "6f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00"
)


def check_vllm_vector() -> None:
    batch = KVEventBatch(
        ts=0.0,
        events=[
            BlockStored(
                block_hashes=[9561501211280363793],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        ],
        data_parallel_rank=0,
    )
    got = msgspec.msgpack.encode(batch).hex()
    if got != _VLLM_VECTOR:
        raise SystemExit(f"vLLM struct definitions do not reproduce peers.md 1.2:\n{got}")


# ------------------------------------------------------------------------ naive fastavro

NAIVE_SCHEMA = fastavro.parse_schema(
    {
        "type": "record",
        "name": "NaiveBatch",
        "fields": [
            {"name": "instance_id", "type": "string"},
            {"name": "ts_ns", "type": "long"},
            {
                "name": "events",
                "type": {
                    "type": "array",
                    "items": {
                        "type": "record",
                        "name": "NaiveEvent",
                        "fields": [
                            {"name": "event_id", "type": "long"},
                            {"name": "kind", "type": "string"},
                            {"name": "window_size", "type": "long"},
                            {"name": "hash_algo", "type": "string"},
                            {"name": "layer_group_id", "type": "int"},
                            {"name": "parent_hash", "type": ["null", "bytes"]},
                            {
                                "name": "blocks",
                                "type": {
                                    "type": "array",
                                    "items": {
                                        "type": "record",
                                        "name": "NaiveBlock",
                                        "fields": [
                                            {"name": "block_hash", "type": "bytes"},
                                            {
                                                "name": "token_ids",
                                                "type": {"type": "array", "items": "long"},
                                            },
                                            {"name": "cache_level", "type": "int"},
                                            {"name": "priority", "type": "int"},
                                            {"name": "lora_id", "type": ["null", "long"]},
                                        ],
                                    },
                                },
                            },
                            {"name": "removed_hashes", "type": {"type": "array", "items": "bytes"}},
                        ],
                    },
                },
            },
        ],
    }
)


# ------------------------------------------------------------------------ the workload


@dataclass
class Workload:
    name: str
    blocks: int
    batch: EventBatch
    naive: dict[str, Any]
    vllm: KVEventBatch


def token_ids(rng: np.random.Generator, n: int, dist: str) -> np.ndarray:
    if dist == "uniform":
        return rng.integers(0, VOCAB, n, dtype=np.uint32)
    out = np.empty(0, dtype=np.uint32)
    while len(out) < n:  # Zipf ranks (a=1.2) truncated to the vocabulary, rank 1 = id 0
        ranks = rng.zipf(1.2, 2 * n)
        out = np.concatenate([out, (ranks[ranks <= VOCAB] - 1).astype(np.uint32)])
    return out[:n]


def build(dist: str, n_events: int, n_blocks: int, n_tokens: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    events: list[KVCacheEvent] = []
    naive_events: list[dict[str, Any]] = []
    vllm_events: list[BlockStored | BlockRemoved] = []
    event_id = 0
    for e in range(n_events):
        ids = token_ids(rng, n_blocks * n_tokens, dist)
        hashes = [rng.bytes(8) for _ in range(n_blocks)]
        parent = rng.bytes(8)
        chunks = [ids[i * n_tokens : (i + 1) * n_tokens] for i in range(n_blocks)]
        events.append(
            KVCacheEvent(
                event_id=event_id,
                window_size=4096,
                data=Stored(
                    parent_hash=parent,
                    blocks=tuple(
                        StoredBlock(block_hash=h, token_ids=TokenIds.from_bytes(c.tobytes()))
                        for h, c in zip(hashes, chunks, strict=True)
                    ),
                ),
            )
        )
        naive_events.append(
            {
                "event_id": event_id,
                "kind": "stored",
                "window_size": 4096,
                "hash_algo": "v1_block_key",
                "layer_group_id": 0,
                "parent_hash": parent,
                "blocks": [
                    {
                        "block_hash": h,
                        "token_ids": c.tolist(),
                        "cache_level": 0,
                        "priority": 35,
                        "lora_id": None,
                    }
                    for h, c in zip(hashes, chunks, strict=True)
                ],
                "removed_hashes": [],
            }
        )
        vllm_events.append(
            BlockStored(
                block_hashes=[int.from_bytes(h, "big") for h in hashes],
                parent_block_hash=int.from_bytes(parent, "big"),
                token_ids=ids.tolist(),
                block_size=n_tokens,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )
        event_id += 1
        if e % 8 == 7:
            gone = [rng.bytes(8) for _ in range(4)]
            events.append(
                KVCacheEvent(
                    event_id=event_id, window_size=4096, data=Removed(block_hashes=tuple(gone))
                )
            )
            naive_events.append(
                {
                    "event_id": event_id,
                    "kind": "removed",
                    "window_size": 4096,
                    "hash_algo": "v1_block_key",
                    "layer_group_id": 0,
                    "parent_hash": None,
                    "blocks": [],
                    "removed_hashes": gone,
                }
            )
            vllm_events.append(
                BlockRemoved(
                    block_hashes=[int.from_bytes(h, "big") for h in gone],
                    medium="GPU",
                    group_idx=0,
                )
            )
            event_id += 1
    ts = 1_700_000_000_000_000_000
    return Workload(
        name=dist,
        blocks=n_events * n_blocks,
        batch=EventBatch(
            source=SourceId(instance_id="worker-0", attention_dp_rank=0),
            ts_ns=ts,
            events=tuple(events),
        ),
        naive={"instance_id": "worker-0", "ts_ns": ts, "events": naive_events},
        vllm=KVEventBatch(ts=ts / 1e9, events=vllm_events, data_parallel_rank=0),
    )


# ------------------------------------------------------------------------ measuring


KEEP_GC = False


def best_time(fns: dict[str, Callable[[], object]], rounds: int, number: int) -> dict[str, float]:
    """Best per-call thread CPU time (seconds) of each function; rounds interleave them."""
    best = dict.fromkeys(fns, float("inf"))
    gc_was_enabled = gc.isenabled()
    if not KEEP_GC:
        gc.disable()
    try:
        for fn in fns.values():
            fn()  # warm caches
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.thread_time_ns()
                for _ in range(number):
                    fn()
                best[name] = min(best[name], (time.thread_time_ns() - t0) / number / 1e9)
    finally:
        if gc_was_enabled:
            gc.enable()
    return best


def naive_encode(record: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, NAIVE_SCHEMA, record)
    return buf.getvalue()


def naive_decode(data: bytes) -> object:
    return fastavro.schemaless_reader(io.BytesIO(data), NAIVE_SCHEMA, None)


def _same(a: EventBatch, b: EventBatch) -> bool:
    return a.model_copy(update={"schema_version": b.schema_version}) == b


def decode_columns(data: bytes, registry: SchemaRegistry, native: bool) -> bytes:
    """Columns of one message (C decoder or the reference), token ids unpacked."""
    saved = columnar._native
    if not native:
        columnar._native = None
    try:
        return decode_columns_message(data, registry).columns.tokens
    finally:
        columnar._native = saved


def run(w: Workload, rounds: int, number: int) -> dict[str, dict[str, float]]:
    codec = AvroCodec(4)
    codec_v3 = AvroCodec(3)
    enc_msgspec = msgspec.msgpack.Encoder()
    dec_msgspec = msgspec.msgpack.Decoder(KVEventBatch)
    data_kv = codec.encode(w.batch)
    data_v3 = codec_v3.encode(w.batch)
    if not (_same(codec.decode(data_kv), w.batch) and _same(codec.decode(data_v3), w.batch)):
        raise SystemExit("kvstream round trip failed")
    data_naive = naive_encode(w.naive)
    data_ms = enc_msgspec.encode(w.vllm)
    if dec_msgspec.decode(data_ms) != w.vllm:
        raise SystemExit("msgspec round trip failed")
    writer = codec.schema
    body = split_single_object(data_kv)[1]
    registry = schema_registry()
    if decode_columns(data_kv, registry, True) != decode_columns(data_kv, registry, False):
        raise SystemExit("the C column decoder and the reference disagree")
    enc = best_time(
        {
            "kvstream": lambda: codec.encode(w.batch),
            "kvstream_v3": lambda: codec_v3.encode(w.batch),
            "fastavro": lambda: naive_encode(w.naive),
            "msgspec": lambda: enc_msgspec.encode(w.vllm),
        },
        rounds,
        number,
    )
    dec = best_time(
        {
            "kvstream": lambda: codec.decode(data_kv),
            "kvstream_v3": lambda: codec.decode(data_v3),
            "kvstream_records": lambda: read_record(body, writer, writer),
            "columns_c": lambda: decode_columns(data_kv, registry, True),
            "columns_ref": lambda: decode_columns(data_kv, registry, False),
            "fastavro": lambda: naive_decode(data_naive),
            "msgspec": lambda: dec_msgspec.decode(data_ms),
        },
        max(3, rounds // 3),
        max(1, number // 2),
    )
    sizes = {
        "kvstream": len(data_kv),
        "kvstream_v3": len(data_v3),
        "fastavro": len(data_naive),
        "msgspec": len(data_ms),
    }
    return {"encode": enc, "decode": dec, "size": {k: float(v) for k, v in sizes.items()}}


def report(w: Workload, r: dict[str, dict[str, float]]) -> tuple[float, float, float]:
    b = w.blocks
    print(f"\n== {w.name} token ids: {b} blocks/batch, {len(w.batch.events)} events ==")
    print(f"{'format':34s} {'encode blocks/s':>16s} {'decode blocks/s':>16s} {'bytes/block':>12s}")
    rows = [
        ("kvstream AvroCodec v4 (models)", "kvstream"),
        ("kvstream AvroCodec v3 (bit planes)", "kvstream_v3"),
        ("fastavro naive row-wise (dicts)", "fastavro"),
        ("msgspec vLLM>=0.24 (structs)", "msgspec"),
    ]
    for label, key in rows:
        print(
            f"{label:34s} {b / r['encode'][key]:16,.0f} {b / r['decode'][key]:16,.0f} "
            f"{r['size'][key] / b:12.1f}"
        )
    print(
        f"{'  kvstream decode, fastavro stage':34s} {'':16s} "
        f"{b / r['decode']['kvstream_records']:16,.0f}"
    )
    for label, key in (
        ("  columns, C decoder", "columns_c"),
        ("  columns, reference", "columns_ref"),
    ):
        print(f"{label:34s} {'':16s} {b / r['decode'][key]:16,.0f}")
    enc_ratio = r["encode"]["msgspec"] / r["encode"]["kvstream"]
    size_ratio = r["size"]["kvstream"] / r["size"]["msgspec"]
    target = SIZE_TARGET[w.name]
    print(
        f"kvstream v4/msgspec: encode speed {enc_ratio:.2f}x (target >= 1.00), "
        f"bytes {size_ratio:.2f}x (target <= {target:.2f}), "
        f"decode speed {r['decode']['msgspec'] / r['decode']['kvstream']:.2f}x"
    )
    print(
        f"kvstream v4 columns/msgspec: decode speed, C decoder "
        f"{r['decode']['msgspec'] / r['decode']['columns_c']:.2f}x, reference "
        f"{r['decode']['msgspec'] / r['decode']['columns_ref']:.2f}x"
    )
    print(
        f"kvstream v3/msgspec: encode speed "
        f"{r['encode']['msgspec'] / r['encode']['kvstream_v3']:.2f}x, "
        f"bytes {r['size']['kvstream_v3'] / r['size']['msgspec']:.2f}x, "
        f"decode speed {r['decode']['msgspec'] / r['decode']['kvstream_v3']:.2f}x"
    )
    print(
        f"kvstream/naive fastavro: encode speed "
        f"{r['encode']['fastavro'] / r['encode']['kvstream']:.2f}x, "
        f"bytes {r['size']['kvstream'] / r['size']['fastavro']:.2f}x"
    )
    return enc_ratio, size_ratio, target


SIZE_TARGET = {"uniform": 0.6, "zipf": 0.8}


def batch_tokens(batch: EventBatch) -> bytes:
    return b"".join(
        b.token_ids.raw
        for ev in batch.events
        if isinstance(ev.data, Stored)
        for b in ev.data.blocks
    )


def token_table(w: Workload, rounds: int, number: int) -> None:
    """Bytes and CPU of every v4 token encoding, alone and inside the whole codec."""
    raw = batch_tokens(w.batch)
    n = len(raw) // 4
    print(f"\n-- token encodings ({w.name}, {n} ids of {w.blocks} blocks) --")
    print(
        f"{'encoding':20s} {'bytes/id':>9s} {'tokens enc ns/id':>17s} {'tokens dec ns/id':>17s} "
        f"{'codec bytes/block':>18s} {'codec enc blocks/s':>19s} {'codec dec blocks/s':>19s}"
    )
    for name in TOKEN_ENCODINGS:
        enc = encode_tokens(raw, name)
        record = {
            "count": enc.planes.count,
            "high_bits": enc.planes.high_bits,
            "low16": enc.planes.low16,
            "high_planes": enc.planes.high_planes,
            "packed_encoding": enc.encoding,
            "packed_compression": enc.compression,
            "packed_count": enc.count if enc.is_packed else 0,
            "packed": enc.packed,
        }
        if tokens_from_record(record) != raw:
            raise SystemExit(f"token encoding {name} does not round-trip")
        codec = AvroCodec(4, token_encoding=name)
        data = codec.encode(w.batch)
        t_tok = best_time(
            {
                "enc": lambda name=name: encode_tokens(raw, name),
                "dec": lambda record=record: tokens_from_record(record),
            },
            rounds,
            number,
        )
        t_codec = best_time(
            {
                "enc": lambda codec=codec: codec.encode(w.batch),
                "dec": lambda codec=codec, data=data: codec.decode(data),
            },
            max(3, rounds // 3),
            max(1, number // 2),
        )
        label = (
            name if name != "auto" else f"auto ({enc.encoding.lower()}/{enc.compression.lower()})"
        )
        print(
            f"{label:20s} {enc.wire_bytes / n:9.3f} {t_tok['enc'] / n * 1e9:17.2f} "
            f"{t_tok['dec'] / n * 1e9:17.2f} {len(data) / w.blocks:18.1f} "
            f"{w.blocks / t_codec['enc']:19,.0f} {w.blocks / t_codec['dec']:19,.0f}"
        )


def _chunks(w: Workload, events_per_message: int) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """The workload as engine-sized messages: kvstream v4, kvstream v3, msgspec values."""
    v4, v3 = AvroCodec(4), AvroCodec(3)
    enc = msgspec.msgpack.Encoder()
    evs, vevs = w.batch.events, w.vllm.events
    out: tuple[list[bytes], list[bytes], list[bytes]] = ([], [], [])
    for i in range(0, len(evs), events_per_message):
        part = w.batch.model_copy(update={"events": evs[i : i + events_per_message]})
        out[0].append(v4.encode(part))
        out[1].append(v3.encode(part))
        vpart = KVEventBatch(w.vllm.ts, vevs[i : i + events_per_message], 0)
        out[2].append(enc.encode(vpart))
    return out


def kafka_table(w: Workload, events_per_message: int, rounds: int) -> None:
    """Kafka record batches as aiokafka's producer builds them, per format and compression."""
    try:
        from aiokafka.record.default_records import (
            DefaultRecordBatch,
            DefaultRecordBatchBuilder,
        )
    except ImportError:
        print("\n(aiokafka not installed: Kafka compression table skipped)")
        return
    codecs = {
        "none": 0,
        "gzip": DefaultRecordBatch.CODEC_GZIP,
        "snappy": DefaultRecordBatch.CODEC_SNAPPY,
        "lz4": DefaultRecordBatch.CODEC_LZ4,
        "zstd": DefaultRecordBatch.CODEC_ZSTD,
    }
    v4, v3, ms = _chunks(w, events_per_message)

    def produce(values: list[bytes], attrs: int) -> list[bytes]:
        """Record batches as aiokafka's accumulator fills them (offsets relative per batch)."""
        batches: list[bytes] = []
        builder = DefaultRecordBatchBuilder(2, attrs, False, -1, -1, 0, 16384)
        offset = 0
        for value in values:
            if builder.append(offset, None, b"worker-0/0", value, []) is None:
                batches.append(bytes(builder.build()))
                builder = DefaultRecordBatchBuilder(2, attrs, False, -1, -1, 0, 16384)
                offset = 0
                builder.append(offset, None, b"worker-0/0", value, [])
            offset += 1
        batches.append(bytes(builder.build()))
        return batches

    def consume(batches: list[bytes]) -> int:
        return sum(len(r.value) for b in batches for r in DefaultRecordBatch(b))

    base = sum(map(len, produce(ms, 0)))
    print(
        f"\n-- Kafka record batches ({w.name}; {len(v4)} messages of {events_per_message} "
        f"events; aiokafka max_batch_size 16 KiB) --"
    )
    print(
        f"{'format':22s} {'compression':>11s} {'bytes':>10s} {'vs msgspec raw':>15s} "
        f"{'produce us/block':>17s} {'consume us/block':>17s}"
    )
    for label, values in (
        ("kvstream v4 (packed)", v4),
        ("kvstream v3 (planes)", v3),
        ("msgspec", ms),
    ):
        for cname, attrs in codecs.items():
            batches = produce(values, attrs)
            if consume(batches) != sum(map(len, values)):
                raise SystemExit("Kafka record batch round trip failed")
            t = best_time(
                {"p": lambda v=values, a=attrs: produce(v, a), "c": lambda b=batches: consume(b)},
                max(3, rounds // 3),
                1,
            )
            size = sum(map(len, batches))
            print(
                f"{label:22s} {cname:>11s} {size:10,d} {size / base:14.2f}x "
                f"{t['p'] / w.blocks * 1e6:17.3f} {t['c'] / w.blocks * 1e6:17.3f}"
            )


def e2e_table(rounds: int) -> None:
    """bench_peers' end-to-end rows with the C column decoder and with the reference."""
    import tempfile

    import bench_peers
    from _fleet_workload import FleetSpec, fleet_batches

    from kvstream.codec import ContainerWriter

    gen, _, totals = fleet_batches(FleetSpec(), seed=1)  # bench_peers' fleet
    batches = list(gen)
    stored, removed = totals.stored, totals.removed
    codec = AvroCodec()
    messages = [codec.encode(b) for b in batches]
    native = columnar._native
    with tempfile.TemporaryDirectory() as tmp:
        with ContainerWriter(Path(tmp) / "kvstream-00000001.avro", codec="null") as w:
            w.write_many(batches)

        def file_run() -> None:
            bench_peers.file_to_index(tmp)

        def kafka_run() -> None:
            bench_peers.kafka_to_index(messages, lambda m: decode_columns_message(m, REGISTRY))

        best: dict[tuple[str, str], float] = {}
        for _ in range(rounds):
            for mode in ("C decoder", "reference"):
                columnar._native = native if mode == "C decoder" else None
                try:
                    for name, fn in (
                        ("file (null) -> index", file_run),
                        ("Kafka bytes -> index", kafka_run),
                    ):
                        gc.collect()
                        t0 = time.process_time()
                        fn()
                        t = time.process_time() - t0
                        best[name, mode] = min(best.get((name, mode), t), t)
                finally:
                    columnar._native = native
    blocks = (stored + removed) / 1e6
    print(f"\n== end to end ({stored} stored + {removed} removed blocks), M blocks/s ==")
    print(f"{'path':24s} {'C decoder':>10s} {'reference':>10s} {'ratio':>7s}")
    for name in ("file (null) -> index", "Kafka bytes -> index"):
        c, ref = blocks / best[name, "C decoder"], blocks / best[name, "reference"]
        print(f"{name:24s} {c:10.2f} {ref:10.2f} {c / ref:6.2f}x")


REGISTRY = schema_registry()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--events", type=int, default=64, help="stored events per batch")
    p.add_argument("--blocks", type=int, default=16, help="blocks per stored event")
    p.add_argument("--tokens", type=int, default=64, help="tokens per block")
    p.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    p.add_argument("--number", type=int, default=10, help="calls per round")
    p.add_argument("--dist", choices=["uniform", "zipf", "both"], default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="cProfile kvstream encode and decode")
    p.add_argument("--gc", action="store_true", help="leave the garbage collector on while timing")
    p.add_argument(
        "--kafka-events", type=int, default=4, help="events per Kafka message (0: no Kafka table)"
    )
    p.add_argument("--no-tokens", action="store_true", help="skip the token encodings table")
    p.add_argument(
        "--e2e", action="store_true", help="bench_peers' end-to-end rows, C decoder vs reference"
    )
    args = p.parse_args()
    global KEEP_GC  # noqa: PLW0603 - a script-level switch
    KEEP_GC = args.gc
    check_vllm_vector()
    dists = ["uniform", "zipf"] if args.dist == "both" else [args.dist]
    verdicts = []
    for dist in dists:
        w = build(dist, args.events, args.blocks, args.tokens, args.seed)
        enc_ratio, size_ratio, target = report(w, run(w, args.rounds, args.number))
        verdicts.append((dist, enc_ratio >= 1.0, size_ratio <= target))
        if not args.no_tokens:
            token_table(w, args.rounds, args.number)
        if args.kafka_events:
            kafka_table(w, args.kafka_events, args.rounds)
        if args.profile:
            codec = AvroCodec(4)
            data = codec.encode(w.batch)
            for label, stmt in (
                ("encode", "codec.encode(batch)"),
                ("decode", "codec.decode(data)"),
            ):
                prof = cProfile.Profile()
                prof.runctx(
                    f"for _ in range(20): {stmt}",
                    {},
                    {"codec": codec, "batch": w.batch, "data": data},
                )
                print(f"\n-- cProfile kvstream {label} ({dist}) --")
                pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    print()
    for dist, speed_ok, size_ok in verdicts:
        print(
            f"{dist}: encode target {'met' if speed_ok else 'MISSED'}, "
            f"size target {'met' if size_ok else 'MISSED'}"
        )
    if args.e2e:
        e2e_table(max(3, args.rounds // 5))


if __name__ == "__main__":
    main()

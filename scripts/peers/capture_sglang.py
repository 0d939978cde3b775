#!/usr/bin/env python3
"""Golden KV-event frames from SGLang's real radix cache and publisher, for kvstream's decoders.

Run it with the peer venv (``scripts/test-peers`` builds it)::

    .peers-venv/bin/python scripts/peers/capture_sglang.py [--out tests/data/golden]

SGLang 0.5.23 does the work: a ``RadixCache`` (``sglang.srt.mem_cache.radix_cache``, made as
``RadixCache.create_simulated`` makes one: no memory pools, a stand-in allocator that only
records the KV slots eviction frees) with ``enable_kv_cache_events=True`` inserts, splits and
evicts as the scheduler drives it; its ``KVCacheEventRecorder`` emits the events, hashing pages
with SGLang's C++ page hash (``hash_binding.cpp``, built by SGLang's ``native_hash.py``). After
each step ``take_events()`` becomes one ``KVEventBatch`` published through SGLang's
``ZmqEventPublisher`` (made by ``EventPublisherFactory.create`` from a ``--kv-events-config``
JSON), exactly as ``SchedulerKvEventsPublisher.publish_kv_events`` does. ``golden.Capture``
records the raw frames (SUB) and the replay ROUTER's raw replies to a DEALER asking for seq 0.
``peer_imports.load_sglang`` says what of SGLang's import chain is skipped on a CPU machine.

Captures (``tests/data/golden/sglang-0.5.23/``): ``page4-default-dp0``, ``page1-default-dp1``
(attention-DP rank 1 on PORT+1, an llm-d style topic), ``page4-dynamo-dp0`` (``"format":
"dynamo"``: LoRA and salted hashes namespaced), ``page4-eagle-dp0`` (EAGLE bigram keys: token ids
published as pairs).

SGLang <= 0.5.19 encoded events as positional arrays (``BlockStored`` 7 slots, 8 with a salt's
metadata map; ``BlockRemoved`` 3; replay replies of two frames). ``sglang-0.5.19/page4-array-dp0``
publishes the page-4 default scenario's events through SGLang 0.5.19's own ``kv_events.py``
(structs and publisher), each event copied field by field into the 0.5.19 struct of the same
name (a salted store becomes 0.5.19's ``BlockStoredWithMetadata``); fields 0.5.19 lacks
(``lora_name``, ``session_id``) are dropped.

Batch timestamps are fixed (SGLang uses ``time.time()``) so that a rerun writes identical files.
"""

from __future__ import annotations

import argparse
import atexit
import json
import sys
import time
from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import golden
from peer_imports import SGLANG_0519_KV_EVENTS, load_module_file, load_sglang

SHARED = [101, 102, 103, 104, 105, 106, 107, 108]
LORA_ID = "0f3c6a1e9b8d4c2aa7e5f10b3d9c8e71"  # SGLang's LoRARef.lora_id: a uuid hex string
LLMD_TOPIC = "kv@10.0.0.9:30000@Qwen/Qwen3-8B"


def _sglang_version() -> str:
    from sglang.version import __version__

    return str(__version__)


class Allocator:
    """Stands in for the KV pool allocator: hands out slot indices, records what is freed."""

    device = "cpu"

    def __init__(self) -> None:
        self.next = 0
        self.freed = 0

    def alloc(self, n: int) -> Any:
        import torch

        value = torch.arange(self.next, self.next + n, dtype=torch.int64)
        self.next += n
        return value

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        self.freed += len(indices)


def run_scenario(sg: dict[str, Any], *, page_size: int, dynamo: bool, eagle: bool) -> list[Any]:
    """(what, events) per step; the events of one step are one published batch."""
    rc, bpc, ev = sg["radix_cache"], sg["base_prefix_cache"], sg["events"]
    allocator = Allocator()
    lora_names = ev.KvEventLoraNames()
    params = sg["cache_init_params"].CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        is_eagle=eagle,
        enable_kv_cache_events=True,
        dynamo_kv_event_format=dynamo,
        kv_event_lora_names=lora_names,
    )
    cache = rc.RadixCache(params)
    steps: list[tuple[str, list[Any]]] = []

    def insert(tokens: list[int], extra_key: str | None = None, salt: str | None = None) -> None:
        key = rc.RadixKey(array("q", tokens), extra_key, is_bigram=False, cache_salt=salt)
        # As RadixCache._insert_cache does: the bigram view for EAGLE, then page-aligned.
        key, _ = key.maybe_to_bigram_view(eagle)
        key = key.page_aligned(page_size)
        cache.insert(bpc.InsertParams(key=key, value=allocator.alloc(len(key))))
        time.sleep(0.002)  # distinct LRU access times keep eviction order deterministic

    def step(what: str) -> None:
        events = cache.take_events()
        if not events:
            raise RuntimeError(f"step {what!r} produced no events")
        steps.append((what, events))

    insert([*SHARED, 109, 110, 111, 112, 113, 114])
    step("startup (the reset's AllBlocksCleared) and insert a: 14 tokens, page-aligned")

    insert([*SHARED, 201, 202, 203, 204, 205, 206, 207, 208])
    step("insert b: splits a's node after the shared prefix, stores b's own pages")

    insert([*SHARED, 301, 302, 303, 304], salt="tenant-a")
    step("insert c with cache_salt tenant-a: its own chain, seeded by the salt")

    # The scheduler registers each LoRA request's namespace with the recorder's name table.
    lora_names.register(SimpleNamespace(extra_key=LORA_ID, lora_id=LORA_ID), "sql-adapter")
    insert([*SHARED, 401, 402, 403, 404], extra_key=LORA_ID)
    step("insert d for LoRA sql-adapter (extra_key = its lora_id): lora_name, namespaced hashes")

    insert([*SHARED, 501, 502, 503, 504, 505, 506, 507, 508, 509, 510, 511, 512])
    step("insert e: 20 tokens sharing the prefix")

    evicted = cache.evict(bpc.EvictParams(num_tokens=12)).num_tokens_evicted
    step(f"evict 12 tokens ({evicted} evicted): least recent leaves; removes merged in one event")

    cache.reset()
    step("reset (flush_cache): AllBlocksCleared")

    insert([*SHARED, 109, 110, 111, 112])
    step("insert a's prompt again after the reset")
    return steps


def _publisher(sg_kv_events: Any, *, rank: int, topic: str) -> tuple[Any, int, int]:
    base, rbase = golden.free_port() - rank, golden.free_port() - rank
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{base}",
        "replay_endpoint": f"tcp://*:{rbase}",
        "topic": topic,
    }
    publisher = sg_kv_events.EventPublisherFactory.create(json.dumps(config), attn_dp_rank=rank)
    return publisher, base + rank, rbase + rank


def capture_0523(
    sg: dict[str, Any], *, page_size: int, dynamo: bool, eagle: bool, rank: int, topic: str
) -> dict[str, Any]:
    kv = sg["kv_events"]
    scenario = run_scenario(sg, page_size=page_size, dynamo=dynamo, eagle=eagle)
    steps = [
        golden.Step(what, kv.KVEventBatch(ts=golden.TS0 + i, events=events))
        for i, (what, events) in enumerate(scenario)
    ]
    publisher, port, rport = _publisher(kv, rank=rank, topic=topic)
    fmt = "dynamo" if dynamo else "default"
    variant = "eagle" if eagle else fmt
    capture = golden.Capture(port, rport, topic)
    try:
        return golden.record(
            name=f"sglang-0.5.23/page{page_size}-{variant}-dp{rank}",
            producer={
                "package": "sglang",
                "version": _sglang_version(),
                "publisher": "sglang.srt.disaggregation.kv_events.ZmqEventPublisher",
                "events": "sglang.srt.mem_cache.radix_cache.RadixCache.take_events "
                "(KVCacheEventRecorder)",
            },
            provenance={
                "frames": "captured",
                "real": [
                    "RadixCache insert/split/evict/reset and its KVCacheEventRecorder "
                    "(sglang.srt.mem_cache.radix_cache, .events)",
                    "page hashes: hash_binding.cpp through sglang's native_hash.py; "
                    "hash_str_to_int64, namespace seeds (sglang.srt.mem_cache.utils, .events)",
                    "KVEventBatch/BlockStored/BlockRemoved/AllBlocksCleared structs",
                    "ZmqEventPublisher from EventPublisherFactory: encoding, frames, replay",
                ],
                "stand_ins": [
                    "the KV pool allocator (slot numbers; RadixCache.create_simulated's "
                    "mock_allocator role)",
                    "the scheduler's calls (insert of page-aligned keys, LoRA name "
                    "registration, evict, reset) in scripts/peers/capture_sglang.py",
                    "batch ts (fixed, SGLang uses time.time())",
                ],
                "import_notes": [
                    "sglang/__init__.py (frontend API) not executed",
                    "base_prefix_cache.py executed without its memory_pool and "
                    "metrics_collector imports (they need torchvision's CUDA ops)",
                ],
            },
            config={
                "kv_events_config": {
                    "publisher": "zmq",
                    "endpoint": "tcp://*:PORT",
                    "replay_endpoint": "tcp://*:RPORT",
                    "topic": topic,
                    "format": fmt,
                },
                "attn_dp_rank": rank,
                "bound_ports": "PORT+rank, RPORT+rank",
                "page_size": page_size,
                "is_eagle": eagle,
                "lora": {"extra_key": LORA_ID, "lora_name": "sql-adapter"},
            },
            steps=steps,
            publish=publisher.publish,
            capture=capture,
            topic=topic,
            batch_fields=("ts", "events", "attn_dp_rank"),
        )
    finally:
        capture.close()
        _shutdown(publisher)


def capture_0519(sg: dict[str, Any]) -> dict[str, Any]:
    """The page-4 default scenario through SGLang 0.5.19's array-era structs and publisher."""
    import msgspec

    old = load_module_file("sglang_0_5_19_kv_events", SGLANG_0519_KV_EVENTS)
    scenario = run_scenario(sg, page_size=4, dynamo=False, eagle=False)
    dropped: set[str] = set()

    def convert(event: Any) -> Any:
        values = msgspec.structs.asdict(event)
        name = type(event).__name__
        salt = values.pop("cache_salt", None)
        cls = getattr(old, name)
        for field, value in values.items():
            if field not in cls.__struct_fields__ and value is not None:
                dropped.add(field)
        kwargs = {f: values[f] for f in cls.__struct_fields__ if f in values}
        if salt is not None:
            meta = old.BlockStoredMetadata(cache_salt=salt)
            return old.BlockStoredWithMetadata(**kwargs, metadata=meta)
        return cls(**kwargs)

    steps = [
        golden.Step(what, old.KVEventBatch(ts=golden.TS0 + i, events=[convert(e) for e in evs]))
        for i, (what, evs) in enumerate(scenario)
    ]
    publisher, port, rport = _publisher(old, rank=0, topic="")
    capture = golden.Capture(port, rport, "")
    try:
        return golden.record(
            name="sglang-0.5.19/page4-array-dp0",
            producer={
                "package": "sglang",
                "version": "0.5.19",
                "module": "sglang/srt/disaggregation/kv_events.py from the sglang 0.5.19 wheel",
                "publisher": "ZmqEventPublisher (SGLang 0.5.19)",
            },
            provenance={
                "frames": "captured",
                "real": [
                    "SGLang 0.5.19's KVEventBatch/BlockStored/BlockStoredWithMetadata/"
                    "BlockRemoved/AllBlocksCleared (array_like) and its ZmqEventPublisher: "
                    "encoding, frames, 2-frame replay",
                ],
                "mapped": [
                    "event content: the sglang-0.5.23/page4-default-dp0 scenario's events "
                    "(SGLang 0.5.23 RadixCache), copied field by field into 0.5.19 structs; "
                    "a cache_salt becomes BlockStoredWithMetadata.metadata",
                    f"0.5.23 fields with values 0.5.19 has no slot for, dropped: {sorted(dropped)}",
                ],
            },
            config={
                "kv_events_config": {
                    "publisher": "zmq",
                    "endpoint": "tcp://*:PORT",
                    "replay_endpoint": "tcp://*:RPORT",
                    "topic": "",
                },
                "attn_dp_rank": 0,
                "page_size": 4,
            },
            steps=steps,
            publish=publisher.publish,
            capture=capture,
            topic="",
            batch_fields=("ts", "events", "attn_dp_rank"),
        )
    finally:
        capture.close()
        _shutdown(publisher)


def _shutdown(publisher: Any) -> None:
    publisher.shutdown()
    atexit.unregister(publisher.shutdown)  # SGLang's publisher also registers it at exit


CAPTURES_0523 = [
    {"page_size": 4, "dynamo": False, "eagle": False, "rank": 0, "topic": ""},
    {"page_size": 1, "dynamo": False, "eagle": False, "rank": 1, "topic": LLMD_TOPIC},
    {"page_size": 4, "dynamo": True, "eagle": False, "rank": 0, "topic": ""},
    {"page_size": 4, "dynamo": False, "eagle": True, "rank": 0, "topic": ""},
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=golden.ROOT / "tests" / "data" / "golden")
    args = parser.parse_args(argv)
    sg = load_sglang()
    if _sglang_version() != "0.5.23":
        print(f"SGLang 0.5.23 expected, found {_sglang_version()}", file=sys.stderr)
        return 1
    for options in CAPTURES_0523:
        path = golden.write(capture_0523(sg, **options), args.out)
        print(f"wrote {path}")
    path = golden.write(capture_0519(sg), args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

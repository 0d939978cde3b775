#!/usr/bin/env python3
"""Golden KV-event frames from vLLM's real cache manager and publisher, for kvstream's decoders.

Run it with the peer venv (``scripts/test-peers`` builds it)::

    .peers-venv/bin/python scripts/peers/capture_vllm.py [--out tests/data/golden]

vLLM 0.33.0 does all the work: a ``KVCacheManager`` (its ``BlockPool`` with
``enable_kv_cache_events=True``, real ``KVCacheBlock``s, requests hashed by
``get_request_block_hasher`` with ``hash_block_tokens`` over ``sha256`` (pickle) or
``sha256_cbor`` after ``init_none_hash``) runs a scheduler-like scenario (below) over two
KV-cache groups (0: full attention, 1: sliding window of 8 tokens), block size 4. After each
step the manager's ``take_events()`` become one ``KVEventBatch`` published through vLLM's
``ZmqEventPublisher`` (made by ``EventPublisherFactory`` from a ``KVEventsConfig`` with
``endpoint=tcp://*:PORT``, ``replay_endpoint=tcp://*:RPORT``); ``golden.Capture`` records the raw
frames with a SUB socket and the replay ROUTER's raw replies to a DEALER asking for seq 0.

Captures (``tests/data/golden/vllm-0.33.0/``): ``sha256-int-dp0`` (vLLM's defaults),
``sha256-bytes-dp0`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), ``sha256_cbor-int-dp1`` and
``sha256_cbor-bytes-dp1`` (``PYTHONHASHSEED=0``, data-parallel rank 1 on PORT+1, an llm-d style
topic).

vLLM <= 0.23 encoded events as positional arrays. ``vllm-0.23.0/sha256-int-dp0`` publishes the
same scenario's events through vLLM 0.23.0's own ``kv_events.py`` (its array-like structs and
its ``ZmqEventPublisher``, whose replay replies have two frames): each 0.33 event is copied
field by field into the 0.23 struct of the same name; 0.23 has no ``locality``, ``ownership``,
``session_id`` or ``lookahead_token_ids``, and those are dropped.

The batch timestamps are fixed (vLLM's scheduler uses ``time.time()``) so that a rerun writes
identical files; ``tests/peers/test_peer_publishers.py`` checks that.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import golden
from peer_imports import VLLM_023_KV_EVENTS, load_module_file

BLOCK_SIZE = 4
SLIDING_WINDOW = 8
NUM_BLOCKS = 48
LLMD_TOPIC = "kv@10.0.0.7:8000@Qwen/Qwen3-8B"
#: The prompt prefix most requests share: 2 full blocks.
SHARED = [101, 102, 103, 104, 105, 106, 107, 108]


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


class Scheduler:
    """The calls vLLM's scheduler makes on the KV cache manager, one request at a time: a whole
    prefill in one step, a decode step per output token, ``free`` when a request finishes."""

    def __init__(self, hash_fn: Callable[[Any], bytes]) -> None:
        import torch
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )

        spec = {"block_size": BLOCK_SIZE, "num_kv_heads": 1, "head_size": 1}
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["model.layers.0.attn"], FullAttentionSpec(**spec, dtype=torch.float32)
                ),
                KVCacheGroupSpec(
                    ["model.layers.1.attn"],
                    SlidingWindowSpec(**spec, dtype=torch.float32, sliding_window=SLIDING_WINDOW),
                ),
            ],
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=1024,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.hash_fn = hash_fn

    def request(self, request_id: str, prompt: list[int] | None, **kwargs: Any) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        extra_args = kwargs.pop("extra_args", None)
        params = SamplingParams(max_tokens=64, extra_args=extra_args)
        params.update_from_generation_config({}, eos_token_id=2)
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, self.hash_fn),
            **kwargs,
        )

    def prefill(self, req: Any) -> None:
        computed, num_computed, _ = self.manager.get_computed_blocks(req)
        blocks = self.manager.allocate_slots(
            req, req.num_tokens - num_computed, num_computed, computed
        )
        if blocks is None:
            raise RuntimeError(f"no KV blocks for {req.request_id}")
        req.num_computed_tokens = req.num_tokens

    def decode(self, req: Any, tokens: list[int]) -> None:
        for token in tokens:
            req.append_output_token_ids(token)
            if self.manager.allocate_slots(req, 1) is None:
                raise RuntimeError(f"no KV blocks for {req.request_id}")
            req.num_computed_tokens += 1

    def free(self, *reqs: Any) -> None:
        for req in reqs:
            self.manager.free(req)


def run_scenario(hash_name: str) -> list[tuple[str, list[Any]]]:
    """The scenario's steps and each step's events (``KVCacheManager.take_events()``)."""
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    hash_fn = get_hash_fn_by_name(hash_name)
    init_none_hash(hash_fn)
    s = Scheduler(hash_fn)
    steps: list[tuple[str, list[Any]]] = []

    def step(what: str) -> None:
        events = s.manager.take_events()
        if not events:  # vLLM publishes a batch only for a step that produced events
            raise RuntimeError(f"step {what!r} produced no events")
        steps.append((what, events))

    a = s.request("a", [*SHARED, 109, 110])
    s.prefill(a)
    step("prefill a: 10 tokens, blocks 0-1 stored in both groups")

    b = s.request("b", [*SHARED, 201, 202, 203, 204, 205, 206, 207, 208], session_id="sess-42")
    s.prefill(b)
    step("prefill b (session sess-42): hits a's 2 blocks, stores blocks 2-3 parented on block 1")

    s.decode(a, [111, 112, 113])
    step("decode a: 3 tokens complete block 2 (single-block store with a parent)")

    lora = LoRARequest("sql-adapter", 7, "/adapters/sql-adapter")
    c = s.request("c", [*SHARED, 301], lora_request=lora)
    s.prefill(c)
    step("prefill c with LoRA sql-adapter (id 7): lora_id, lora_name and per-block extra keys")

    d = s.request("d", [*SHARED, 401], cache_salt="tenant-a")
    s.prefill(d)
    step("prefill d with cache_salt tenant-a: salt in block 0's extra keys only")

    image = MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier="img-3f9a2c",
        mm_position=PlaceholderRange(offset=2, length=9),
    )
    audio = MultiModalFeatureSpec(
        data=None,
        modality="audio",
        identifier="aud-77e1",
        mm_position=PlaceholderRange(offset=12, length=2),
    )
    mm_prompt = [501, 502, *([9] * 9), 503, *([8] * 2), 504, 505, 506]
    e = s.request("e", mm_prompt, mm_features=[image, audio])
    s.prefill(e)
    step("prefill e: an image over blocks 0-2 (in-block offsets 2, -2, -6) and an audio item")

    embeds = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) / 16
    f = s.request("f", None, prompt_embeds=embeds)
    s.prefill(f)
    step("prefill f from prompt embeddings: per-block embedding digests as extra keys (bytes)")

    g = s.request("g", [*SHARED, 601], extra_args={"kv_cache_report_mode": "full"})
    s.prefill(g)
    step("prefill g, kv_cache_report_mode=full: cache hits re-reported (duplicate stores)")

    s.free(a, b, c, d, e, f, g)
    big = s.request("h", list(range(1000, 1000 + 4 * 18)))
    s.prefill(big)
    step("all freed; prefill h (72 tokens) evicts cached blocks: one BlockRemoved per hash")

    s.free(big)
    if not s.manager.reset_prefix_cache():
        raise RuntimeError("reset_prefix_cache refused")
    step("h freed; reset_prefix_cache: AllBlocksCleared")

    again = s.request("i", [*SHARED, 109, 110])
    s.prefill(again)
    step("prefill i (a's prompt again) after the reset: the same hashes stored again")
    return steps


def _set_env(int_hashes: bool, python_hash_seed: str | None) -> None:
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if int_hashes else "0"
    if python_hash_seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = python_hash_seed


def capture_033(
    *, hash_name: str, int_hashes: bool, dp_rank: int, topic: str, seed: str | None
) -> dict[str, Any]:
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch
    from vllm.v1.core import kv_cache_utils

    _set_env(int_hashes, seed)
    scenario = run_scenario(hash_name)
    base, rbase = golden.free_port() - dp_rank, golden.free_port() - dp_rank
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{base}",
        replay_endpoint=f"tcp://*:{rbase}",
        topic=topic,
    )
    publisher = EventPublisherFactory.create(config, data_parallel_rank=dp_rank)
    steps = [
        golden.Step(what, KVEventBatch(ts=golden.TS0 + i, events=events))
        for i, (what, events) in enumerate(scenario)
    ]
    capture = golden.Capture(base + dp_rank, rbase + dp_rank, topic)
    try:
        doc = golden.record(
            name=f"vllm-0.33.0/{hash_name}-{'int' if int_hashes else 'bytes'}-dp{dp_rank}",
            producer={
                "package": "vllm",
                "version": _vllm_version(),
                "publisher": "vllm.distributed.kv_events.ZmqEventPublisher",
                "events": "vllm.v1.core.kv_cache_manager.KVCacheManager.take_events",
            },
            provenance={
                "frames": "captured",
                "real": [
                    "KVCacheManager/BlockPool event emission (vllm.v1.core)",
                    "block hashes: get_request_block_hasher + hash_block_tokens + "
                    f"{hash_name}, NONE_HASH from init_none_hash",
                    "KVEventBatch/BlockStored/BlockRemoved/AllBlocksCleared structs",
                    "ZmqEventPublisher: encoding, PUB frames, seq, replay ROUTER",
                ],
                "scripted": [
                    "the scheduler's calls (get_computed_blocks, allocate_slots, free, "
                    "reset_prefix_cache) in scripts/peers/capture_vllm.py",
                    "batch ts (fixed, vLLM uses time.time())",
                ],
            },
            config={
                "endpoint": "tcp://*:PORT",
                "replay_endpoint": "tcp://*:RPORT",
                "topic": topic,
                "data_parallel_rank": dp_rank,
                "bound_ports": "PORT+rank, RPORT+rank",
                "prefix_caching_hash_algo": hash_name,
                "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": int(int_hashes),
                "PYTHONHASHSEED": seed,
                "none_hash_seed": kv_cache_utils.get_none_hash_seed(),
                "none_hash": kv_cache_utils.NONE_HASH.hex(),
                "block_size": BLOCK_SIZE,
                "kv_cache_groups": [
                    {"group_idx": 0, "kind": "full_attention"},
                    {"group_idx": 1, "kind": "sliding_window", "sliding_window": SLIDING_WINDOW},
                ],
                "num_gpu_blocks": NUM_BLOCKS,
            },
            steps=steps,
            publish=publisher.publish,
            capture=capture,
            topic=topic,
            batch_fields=("ts", "events", "data_parallel_rank"),
        )
    finally:
        capture.close()
        publisher.shutdown()
    return doc


def capture_023() -> dict[str, Any]:
    """The sha256/int/dp0 scenario through vLLM 0.23.0's array-era structs and publisher."""
    import msgspec

    old = load_module_file("vllm_0_23_0_kv_events", VLLM_023_KV_EVENTS)
    _set_env(True, None)
    scenario = run_scenario("sha256")
    classes = {c.__name__: c for c in (old.BlockStored, old.BlockRemoved, old.AllBlocksCleared)}
    dropped: set[str] = set()

    def convert(event: Any) -> Any:
        cls = classes[type(event).__name__]
        values = msgspec.structs.asdict(event)
        for field, value in values.items():
            if field not in cls.__struct_fields__ and value is not None:
                dropped.add(field)
        return cls(**{f: values[f] for f in cls.__struct_fields__})

    steps = [
        golden.Step(what, old.KVEventBatch(ts=golden.TS0 + i, events=[convert(e) for e in evs]))
        for i, (what, evs) in enumerate(scenario)
    ]
    port, rport = golden.free_port(), golden.free_port()
    publisher = old.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}"
    )
    capture = golden.Capture(port, rport, "")
    try:
        doc = golden.record(
            name="vllm-0.23.0/sha256-int-dp0",
            producer={
                "package": "vllm",
                "version": "0.23.0",
                "module": "vllm/distributed/kv_events.py from the vllm 0.23.0 wheel",
                "publisher": "ZmqEventPublisher (vLLM 0.23.0)",
            },
            provenance={
                "frames": "captured",
                "real": [
                    "vLLM 0.23.0's KVEventBatch/BlockStored/BlockRemoved/AllBlocksCleared "
                    "(array_like) and its ZmqEventPublisher: encoding, frames, 2-frame replay",
                ],
                "mapped": [
                    "event content: the vllm-0.33.0/sha256-int-dp0 scenario's events "
                    "(vLLM 0.33.0 KVCacheManager), copied field by field into 0.23.0 structs",
                    f"0.33 fields with values 0.23 has no slot for, dropped: {sorted(dropped)}",
                ],
            },
            config={
                "endpoint": "tcp://*:PORT",
                "replay_endpoint": "tcp://*:RPORT",
                "topic": "",
                "data_parallel_rank": 0,
                "prefix_caching_hash_algo": "sha256",
                "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": 1,
                "block_size": BLOCK_SIZE,
            },
            steps=steps,
            publish=publisher.publish,
            capture=capture,
            topic="",
            batch_fields=("ts", "events", "data_parallel_rank"),
        )
    finally:
        capture.close()
        publisher.shutdown()
    return doc


CAPTURES_033 = [
    {"hash_name": "sha256", "int_hashes": True, "dp_rank": 0, "topic": "", "seed": None},
    {"hash_name": "sha256", "int_hashes": False, "dp_rank": 0, "topic": "", "seed": None},
    {
        "hash_name": "sha256_cbor",
        "int_hashes": True,
        "dp_rank": 1,
        "topic": LLMD_TOPIC,
        "seed": "0",
    },
    {
        "hash_name": "sha256_cbor",
        "int_hashes": False,
        "dp_rank": 1,
        "topic": LLMD_TOPIC,
        "seed": "0",
    },
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=golden.ROOT / "tests" / "data" / "golden")
    args = parser.parse_args(argv)
    if _vllm_version() != "0.33.0":
        print(f"vLLM 0.33.0 expected, found {_vllm_version()}", file=sys.stderr)
        return 1
    for options in CAPTURES_033:
        path = golden.write(capture_033(**options), args.out)
        print(f"wrote {path}")
    path = golden.write(capture_023(), args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared by the pipeline benchmarks: realistic event batches and small timing helpers.

Batches come from metadata-only KV-cache managers (a full-attention and a sliding-window
group) serving a multi-turn chat workload, one manager per source, as ``kvstream demo``
runs them: stored/removed/created events with real block hashes and token ids.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstream.cache import (  # noqa: E402 - after the sys.path line
    CacheConfig,
    CacheFullError,
    KVCacheManager,
    LayerGroupSpec,
)
from kvstream.events.deferred import DeferredBatch  # noqa: E402
from kvstream.events.model import EventBatch, SourceId  # noqa: E402
from kvstream.workloads import ChatWorkload, multi_turn_chats  # noqa: E402


def cache_batches(
    min_events: int, *, sources: int = 4, tokens_per_block: int = 16, seed: int = 0
) -> list[EventBatch]:
    """At least ``min_events`` events in per-iteration batches from ``sources`` caches,
    interleaved as an engine with attention-DP ranks hands them over."""
    cfg = CacheConfig(
        tokens_per_block=tokens_per_block,
        groups=[
            LayerGroupSpec(num_layers=8, num_kv_heads=8, head_dim=128, num_blocks=1024),
            LayerGroupSpec(
                num_layers=8, num_kv_heads=8, head_dim=128, num_blocks=512, window_size=512
            ),
        ],
        hash_algo="v2_sha256_64",
        metadata_only=True,
    )
    streams: list[list[EventBatch]] = []
    per_source = min_events // sources + 1
    for s in range(sources):
        src = SourceId(instance_id="bench-engine", attention_dp_rank=s, incarnation=1)
        mgr = KVCacheManager(cfg, source=src)
        out: list[EventBatch] = []
        events = 0
        conv = 0
        while events < per_source:
            work = ChatWorkload(num_conversations=16, seed=seed * 1000 + s * 100 + conv)
            conv += 1
            for req in multi_turn_chats(work):
                try:
                    mgr.add_request(req.request_id, req.prompt)
                except CacheFullError:
                    continue
                for i in range(0, len(req.output), tokens_per_block):
                    mgr.append_tokens(req.request_id, req.output[i : i + tokens_per_block])
                    b = mgr.flush_events()
                    if b is not None:
                        out.append(b)
                        events += len(b.events)
                mgr.free_request(req.request_id)
                if events >= per_source:
                    break
        streams.append(out)
    merged: list[EventBatch] = []
    for i in range(max(len(s) for s in streams)):
        merged.extend(s[i] for s in streams if i < len(s))
    return merged


def fleet_batches(
    *,
    workers: int = 64,
    batches_per_worker: int = 40,
    seed: int = 0,
    tokens_per_block: int = 16,
    prompt_tokens: int = 8192,
    system_tokens: int = 2048,
    prefill_chunk: int = 768,
    running: int = 8,
    output_tokens: int = 64,
    num_blocks: int = 4096,
    deferred: bool = True,
) -> list[Any]:
    """A fleet's event stream, as its engines hand it over: ``workers`` metadata-only cache
    managers (one full-attention group, ``v2_sha256_64``), each serving ``running`` requests
    at a time, 8k-token prompts (one of 8 shared system prompts + a unique rest, token ids
    uniform below 128k) prefilled in chunks of ``prefill_chunk`` tokens, then
    ``output_tokens`` decoded 16 at a time, under memory pressure (LRU evictions). One
    ``flush_events_deferred()`` per engine iteration (``flush_events()``, model batches, with
    ``deferred=False``: the same stream, deterministic but for the timestamps); the workers'
    batches interleaved. With
    the defaults (seed 0): 2,560 batches, ~31.6k events (stored and batched removals),
    ~1.1M blocks, ~32 MiB of Avro. Materialise each batch for models with :func:`fresh_models`
    (every call builds new ones)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 128_000, system_tokens).tolist() for _ in range(8)]
    cfg = CacheConfig(
        tokens_per_block=tokens_per_block,
        groups=[LayerGroupSpec(num_layers=32, num_kv_heads=8, head_dim=128, num_blocks=num_blocks)],
        hash_algo="v2_sha256_64",
        metadata_only=True,
    )
    streams: list[list[Any]] = []
    for w in range(workers):
        src = SourceId(instance_id=f"worker-{w:03d}", attention_dp_rank=None, incarnation=seed + 1)
        mgr = KVCacheManager(cfg, source=src)
        out: list[Any] = []
        flush = mgr.flush_events_deferred if deferred else mgr.flush_events
        live: dict[str, list[Any]] = {}  # request -> [prompt, prefilled, decoded]
        n = 0
        while len(out) < batches_per_worker:
            while len(live) < running:
                rid, n = f"r{n}", n + 1
                rest = rng.integers(0, 128_000, prompt_tokens - system_tokens).tolist()
                prompt = systems[int(rng.integers(8))] + rest
                try:
                    mgr.add_request(rid, prompt[:prefill_chunk])
                except CacheFullError:
                    break
                live[rid] = [prompt, prefill_chunk, 0]
            for rid, state in list(live.items()):
                prompt, pos, decoded = state
                try:
                    if pos < len(prompt):
                        mgr.append_tokens(rid, prompt[pos : pos + prefill_chunk])
                        state[1] = pos + prefill_chunk
                    else:
                        mgr.append_tokens(rid, rng.integers(0, 128_000, 16).tolist())
                        state[2] = decoded + 16
                except CacheFullError:
                    state[2] = output_tokens
                if state[2] >= output_tokens:
                    mgr.free_request(rid)
                    del live[rid]
            b = flush()
            if b is not None:
                out.append(b)
        streams.append(out)
    merged: list[Any] = []
    for i in range(max(len(s) for s in streams)):
        merged.extend(s[i] for s in streams if i < len(s))
    return merged


def fresh_models(batches: list[DeferredBatch]) -> list[EventBatch]:
    """New model batches of ``batches`` (nothing shared with earlier calls but the records)."""
    # the records are immutable once handed over, so a second wrapper builds a second model
    return [DeferredBatch(b.source, b.ts_ns, b._records).materialize() for b in batches]


def count_events(batches: list[EventBatch]) -> int:
    return sum(len(b.events) for b in batches)


@contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic GC while timing (as timeit does)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def best_of(rounds: int, fn: Callable[[], float]) -> tuple[float, float]:
    """(best, median) of ``rounds`` calls of ``fn`` (each returns seconds)."""
    times = [fn() for _ in range(rounds)]
    return min(times), statistics.median(times)


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append(
            "  ".join(
                str(c).rjust(w) if i else str(c).ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(out)


def now() -> float:
    return time.perf_counter()

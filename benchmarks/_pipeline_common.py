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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstream.cache import (  # noqa: E402 - after the sys.path line
    CacheConfig,
    CacheFullError,
    KVCacheManager,
    LayerGroupSpec,
)
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

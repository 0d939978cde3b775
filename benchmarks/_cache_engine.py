"""A tiny continuous-batching engine loop over a KVCacheManager, shared by the cache benchmarks.

Each iteration admits waiting requests (``add_request``) up to ``max_batch`` running ones,
decodes ``decode_chunk`` output tokens for every running request (``append_tokens``), frees
the finished ones and hands the iteration's events over (``flush_events``, or with
``deferred=True`` ``flush_events_deferred``, whose batches go to a ``consume`` callback that
stands for the pipeline's sink task: it is timed apart, so the engine thread's own cost is the
total minus ``consume_s``). A request that
does not fit waits; a running request whose append does not fit is preempted (freed and
queued again at the front, as vLLM recomputes). Arrival times are ignored: the loop runs as
fast as it can, which is what a cost benchmark wants.

With ``kv`` (a manager with tensors) the loop also writes the K/V of every token it
"computes" into the first layer of every group: the prompt from each group's reuse boundary
at admission, then each decoded token.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstream.cache import CacheFullError, KVCacheManager
from kvstream.events import DeferredBatch
from kvstream.workloads import WorkloadRequest


@dataclass
class EngineResult:
    iterations: int = 0
    adds: int = 0
    appends: int = 0
    frees: int = 0
    preemptions: int = 0
    dropped: int = 0
    events: int = 0
    batches: int = 0
    flush_s: float = 0.0  # time inside flush_events (materialising the EventBatch)
    consume_s: float = 0.0  # time inside the consume callback (deferred=True)


def run_engine(
    mgr: KVCacheManager,
    requests: Sequence[WorkloadRequest],
    *,
    max_batch: int = 64,
    decode_chunk: int = 1,
    kv: Any = None,
    deferred: bool = False,
    consume: Callable[[DeferredBatch], object] | None = None,
) -> EngineResult:
    """Serve every request to completion; returns counts of what happened.

    ``kv``: None, or a tensor ``[max_tokens, heads, head_dim]`` to slice K/V from.
    ``deferred``: hand events over with ``flush_events_deferred``, each batch to ``consume``
    (default: drop it unmaterialised), timed apart in ``EngineResult.consume_s``.
    """
    res = EngineResult()
    waiting: deque[WorkloadRequest] = deque(requests)
    running: dict[str, list[Any]] = {}  # id -> [request, tokens produced]
    add, append, free, flush = (
        mgr.add_request,
        mgr.append_tokens,
        mgr.free_request,
        mgr.flush_events_deferred if deferred else mgr.flush_events,
    )
    write = mgr.write_kv
    first_layers = []
    layer = 0
    for spec in mgr.config.groups:
        first_layers.append(layer)
        layer += spec.num_layers
    clock = time.perf_counter
    while waiting or running:
        res.iterations += 1
        while waiting and len(running) < max_batch:
            req = waiting[0]
            try:
                match = add(req.request_id, req.prompt)
            except CacheFullError:
                if not running:  # cannot fit even alone: give up on it
                    waiting.popleft()
                    res.dropped += 1
                    continue
                break
            waiting.popleft()
            running[req.request_id] = [req, 0]
            res.adds += 1
            if kv is not None:
                n = len(req.prompt)
                for g, lay in zip(match.groups, first_layers, strict=True):
                    b = g.matched_tokens
                    write(req.request_id, lay, kv[: n - b], kv[: n - b], start=b)
        for rid, state in list(running.items()):
            req, done = state
            if done >= len(req.output):
                free(rid)
                del running[rid]
                res.frees += 1
                continue
            try:
                append(rid, req.output[done : done + decode_chunk])
            except CacheFullError:
                free(rid)
                del running[rid]
                waiting.appendleft(req)
                res.preemptions += 1
                continue
            if kv is not None:
                pos = len(req.prompt) + done
                m = min(decode_chunk, len(req.output) - done)
                for lay in first_layers:
                    write(rid, lay, kv[:m], kv[:m], start=pos)
            state[1] = done + decode_chunk
            res.appends += 1
        t0 = clock()
        batch = flush()
        res.flush_s += clock() - t0
        if batch is not None:
            res.batches += 1
            if deferred:
                assert isinstance(batch, DeferredBatch)
                res.events += batch.num_events
                if consume is not None:
                    t0 = clock()
                    consume(batch)
                    res.consume_s += clock() - t0
            else:
                assert not isinstance(batch, DeferredBatch)
                res.events += len(batch.events)
    return res

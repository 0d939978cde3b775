"""The replay behind ``kvstream replay``: a Mooncake trace over N simulated workers, routed by
a prefix index built from the workers' own KV-cache events.

Each worker is a :class:`~kvstream.cache.KVCacheManager` in metadata-only mode with a
capacity in blocks (LRU eviction). Requests are processed in arrival order in simulated time:

1. requests whose simulated completion time has passed finish first: their output tokens are
   appended (committing full output blocks), they are freed, and the worker's events go out;
2. the router picks a worker for the request from the index (and the active load it tracks);
3. the chosen worker adds the request (reusing its cached prefix); its events go through the
   pipeline (memory sink by default, or Kafka) into the consumer that updates the index;
4. the request is scheduled: prefill of its uncached tokens after the worker's earlier
   prefills (``prefill_tokens_per_s``), then one output token per ``decode_ms_per_token``.

By default the index catches up with every batch before the next routing decision
(``max_lag_batches=0``); a positive lag lets routing run ahead of the stream, as a router
behind Kafka would. Reported: hit ratios, how often the index's predicted reuse equalled the
worker's actual reuse, per-worker balance, simulated time to first token, and throughput.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from kvstream.cache import CacheConfig, CacheFullError, KVCacheManager, LayerGroupSpec
from kvstream.errors import ConfigError
from kvstream.events.model import EventBatch, SourceId
from kvstream.index import (
    IndexConsumer,
    MemorySource,
    PrefixIndex,
    Router,
    RouterConfig,
    RoutingPolicy,
    WorkerKey,
)
from kvstream.pipeline import Pipeline, PipelineConfig
from kvstream.sink import Sink, create_sink
from kvstream.workloads import MOONCAKE_BLOCK_TOKENS, MooncakeTokens, TraceRow, load_trace

__all__ = ["ReplayOptions", "ReplayResult", "WorkerSummary", "run_replay", "trace_ceiling"]

ROUTERS = tuple(p.value for p in RoutingPolicy)


@dataclass(frozen=True)
class ReplayOptions:
    """What to replay and how (see the module docstring)."""

    trace: str = "conversation"
    limit: int | None = None
    workers: int = 8
    capacity_blocks: int = 5859
    block_size: int = MOONCAKE_BLOCK_TOKENS
    router: str = "kv"
    overlap_weight: float = 1.0
    hash_algo: str = "blake3_64"
    key_mode: str = "engine"
    sink: str = "memory"
    prefill_tokens_per_s: float = 10_000.0
    decode_ms_per_token: float = 20.0
    output_to_cache: bool = True
    max_lag_batches: int = 0
    seed: int = 0

    def check(self) -> None:
        """ConfigError for values out of range."""
        if self.workers < 1 or self.capacity_blocks < 1 or self.block_size < 1:
            raise ConfigError("--workers, --capacity-blocks and --block-size must be >= 1")
        if self.router not in ROUTERS:
            raise ConfigError(f"unknown router {self.router!r}; use one of {', '.join(ROUTERS)}")
        if self.prefill_tokens_per_s <= 0 or self.decode_ms_per_token < 0:
            raise ConfigError("--prefill-tps must be > 0 and --decode-ms >= 0")
        if self.max_lag_batches < 0:
            raise ConfigError("--max-lag must be >= 0")
        if self.sink != "memory" and not self.sink.startswith("kafka://"):
            raise ConfigError(
                f"--sink must be memory or kafka://HOST:PORT/TOPIC, got {self.sink!r}"
            )


@dataclass
class WorkerSummary:
    """One worker's share: requests, prompt blocks, blocks reused, evictions."""

    worker: str
    requests: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    prefill_tokens: int = 0
    evictions: int = 0

    @property
    def hit_ratio(self) -> float:
        """Reused over prompt blocks."""
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


@dataclass
class ReplayResult:
    """Everything a replay measured."""

    options: ReplayOptions
    trace_file: str = ""
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    ceiling_blocks: int = 0
    predicted_equal: int = 0
    predicted_more: int = 0
    predicted_less: int = 0
    batches: int = 0
    events: int = 0
    wall_s: float = 0.0
    simulated_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list, repr=False)
    workers: list[WorkerSummary] = field(default_factory=list)
    index: dict[str, Any] = field(default_factory=dict)
    malformed: int = 0

    @property
    def hit_ratio(self) -> float:
        """Reused prompt blocks over all prompt blocks (partial last blocks included; with
        512-token blocks: over the trace's hash ids, the measure the published 36.6% uses)."""
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        """Reused prompt tokens over all prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ceiling_ratio(self) -> float:
        """The hit ratio of an unlimited cache shared by everyone (same counting)."""
        return self.ceiling_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def prediction_accuracy(self) -> float:
        """How often the index's predicted reuse equalled the worker's actual reuse."""
        n = self.predicted_equal + self.predicted_more + self.predicted_less
        return self.predicted_equal / n if n else 0.0

    @property
    def imbalance(self) -> float:
        """Most requests on one worker over the mean (1.0: perfectly even)."""
        counts = [w.requests for w in self.workers]
        mean = sum(counts) / len(counts) if counts else 0
        return max(counts) / mean if mean else 0.0

    @property
    def prefill_imbalance(self) -> float:
        """Most prefill tokens on one worker over the mean."""
        work = [w.prefill_tokens for w in self.workers]
        mean = sum(work) / len(work) if work else 0
        return max(work) / mean if mean else 0.0

    @property
    def requests_per_s(self) -> float:
        """Replayed requests per wall-clock second."""
        return self.requests / self.wall_s if self.wall_s else 0.0

    def ttft(self, q: float) -> float:
        """Quantile ``q`` of the simulated time to first token, seconds."""
        if not self.ttft_s:
            return 0.0
        xs = sorted(self.ttft_s)
        return xs[min(int(q * len(xs)), len(xs) - 1)]

    def as_dict(self) -> dict[str, Any]:
        """JSON-able summary."""
        return {
            "options": asdict(self.options),
            "trace_file": self.trace_file,
            "requests": self.requests,
            "rejected": self.rejected,
            "prompt_tokens": self.prompt_tokens,
            "prompt_blocks": self.prompt_blocks,
            "hit_blocks": self.hit_blocks,
            "hit_ratio": round(self.hit_ratio, 6),
            "token_hit_ratio": round(self.token_hit_ratio, 6),
            "ceiling_ratio": round(self.ceiling_ratio, 6),
            "prediction_accuracy": round(self.prediction_accuracy, 6),
            "predicted": {
                "equal": self.predicted_equal,
                "more_than_actual": self.predicted_more,
                "less_than_actual": self.predicted_less,
            },
            "imbalance": round(self.imbalance, 4),
            "prefill_imbalance": round(self.prefill_imbalance, 4),
            "ttft_s": {
                "mean": round(statistics.fmean(self.ttft_s), 4) if self.ttft_s else 0.0,
                "p50": round(self.ttft(0.5), 4),
                "p90": round(self.ttft(0.9), 4),
                "p99": round(self.ttft(0.99), 4),
            },
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(self.requests_per_s, 1),
            "simulated_s": round(self.simulated_s, 1),
            "batches": self.batches,
            "events": self.events,
            "malformed": self.malformed,
            "workers": [{**asdict(w), "hit_ratio": round(w.hit_ratio, 6)} for w in self.workers],
            "index": self.index,
        }


def trace_ceiling(rows: list[TraceRow], block_size: int) -> int:
    """Blocks an unlimited shared cache would reuse: per row, the leading full blocks (the
    last prompt token excluded) seen as full blocks of earlier rows. Exact for 512-token
    blocks (the trace's hash ids); for other sizes it is left at 0."""
    if block_size != MOONCAKE_BLOCK_TOKENS:
        return 0
    seen: set[int] = set()
    hits = 0
    for r in rows:
        nf = r.input_length // block_size
        cap = min(nf, (r.input_length - 1) // block_size)
        k = 0
        while k < cap and r.hash_ids[k] in seen:
            k += 1
        hits += k
        seen.update(r.hash_ids[:nf])
    return hits


# ----------------------------------------------------------------------------- transport


class _Transport:
    """Batches from the workers -> pipeline -> sink -> source -> index consumer."""

    def __init__(self, opts: ReplayOptions, index: PrefixIndex) -> None:
        self.opts = opts
        self.index = index
        self.published = 0
        self.sink: Sink
        self.consumer: IndexConsumer
        if opts.sink == "memory":
            self.sink = create_sink(f"memory?max_batches={1 << 16}")
            source = MemorySource(cast(Any, self.sink), from_start=False)
            self.consumer = IndexConsumer(source, index)
        else:
            self.sink = create_sink(_kafka_sink_url(opts.sink))
            self.consumer = IndexConsumer(_kafka_source(opts.sink), index)
        cfg = PipelineConfig.load(
            defaults={"linger_s": 0.0, "overflow": "block", "block_timeout_s": 30.0},
            handoff_timeout_s=60.0,
            close_timeout_s=60.0,
        )
        self.pipe = Pipeline([self.sink], cfg)
        self.memory = opts.sink == "memory"

    async def start(self) -> None:
        await asyncio.wait_for(self.sink.start(), 30)
        await self.pipe.start()
        await self.consumer.source.start()

    async def publish(self, batch: EventBatch | None) -> None:
        if batch is None:
            return
        if not await self.pipe.put(batch):
            raise RuntimeError("the pipeline refused a batch (sink down?)")
        self.published += 1

    async def sync(self, lag: int) -> None:
        """Apply delivered batches until the index is at most ``lag`` batches behind."""
        consumer = self.consumer
        if self.memory:
            spins = 0
            while True:
                consumer.drain()
                if self.published - consumer.batches <= lag:
                    return
                spins += 1
                await asyncio.sleep(0 if spins < 100 else 0.001)
        while self.published - consumer.batches > lag:
            await consumer.catch_up(0.01)
        if lag:
            await consumer.catch_up(0.0)

    async def aclose(self) -> None:
        await self.pipe.aclose()
        await self.consumer.source.aclose()


def _kafka_sink_url(url: str) -> str:
    return url if "create_topic" in url or "partitions" in url else f"{url}?partitions=1"


def _kafka_source(url: str) -> Any:
    from kvstream.index.sources.kafka import KafkaSource

    base = url.split("?", 1)[0]
    return KafkaSource.from_url(base)


# ------------------------------------------------------------------------------- replay


@dataclass(order=True)
class _Running:
    finish: float
    seq: int
    request_id: str = field(compare=False)
    worker: int = field(compare=False)
    output: Any = field(compare=False)


async def run_replay(
    opts: ReplayOptions,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Replay ``opts.trace`` (a name under shared/data/mooncake or a JSONL path).

    ``progress(done, total)`` is called as requests are routed. Raises ConfigError for bad
    options, DataNotFoundError/TraceFormatError for trace problems.
    """
    opts.check()
    rows = load_trace(opts.trace, limit=opts.limit)
    result = ReplayResult(options=opts, trace_file=_trace_file(opts.trace))
    bs = opts.block_size
    toks = MooncakeTokens(seed=opts.seed)
    cfg = CacheConfig(
        tokens_per_block=bs,
        groups=[
            LayerGroupSpec(
                num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=opts.capacity_blocks
            )
        ],
        hash_algo=opts.hash_algo,
        metadata_only=True,
        event_capacity=1 << 20,
    )
    keys = [WorkerKey(f"worker-{i}") for i in range(opts.workers)]
    managers = [
        KVCacheManager(cfg, source=SourceId(instance_id=k.instance_id, incarnation=time.time_ns()))
        for k in keys
    ]
    result.workers = [WorkerSummary(str(k)) for k in keys]
    index = PrefixIndex(key_mode=opts.key_mode)
    router = Router(
        index,
        keys,
        RouterConfig(
            policy=opts.router,
            overlap_weight=opts.overlap_weight,
            hash_algo=opts.hash_algo,
            tokens_per_block=bs,
            seed=opts.seed,
        ),
    )
    transport = _Transport(opts, index)
    prefill_rate = opts.prefill_tokens_per_s
    decode_s = opts.decode_ms_per_token / 1000.0
    busy = [0.0] * opts.workers
    heap: list[_Running] = []
    seq = 0
    lag = opts.max_lag_batches
    t0 = time.perf_counter()
    await transport.start()
    try:
        for m in managers:
            await transport.publish(m.flush_events())
        await transport.sync(0)
        router.check()

        async def complete(r: _Running) -> None:
            mgr = managers[r.worker]
            if opts.output_to_cache and len(r.output):
                with contextlib.suppress(CacheFullError):  # no room: the output is not cached
                    mgr.append_tokens(r.request_id, r.output)
            mgr.free_request(r.request_id)
            router.load.finish(r.request_id)
            await transport.publish(mgr.flush_events())

        total = len(rows)
        now = 0.0
        for i, row in enumerate(rows):
            now = row.timestamp_ms / 1000.0
            while heap and heap[0].finish <= now:
                await complete(heapq.heappop(heap))
            await transport.sync(lag)
            prompt = toks.prompt(row)
            decision = router.route(prompt)
            w = keys.index(decision.worker)
            rid = f"m{row.index}"
            try:
                match = managers[w].add_request(rid, prompt)
            except CacheFullError:
                result.rejected += 1
                continue
            n = len(prompt)
            nblocks = -(-n // bs)
            hit = match.groups[0].matched_tokens // bs
            predicted = decision.predicted_blocks
            if predicted == hit:
                result.predicted_equal += 1
            elif predicted > hit:
                result.predicted_more += 1
            else:
                result.predicted_less += 1
            ws = result.workers[w]
            ws.requests += 1
            ws.prompt_blocks += nblocks
            ws.hit_blocks += hit
            ws.prefill_tokens += n - hit * bs
            result.requests += 1
            result.prompt_tokens += n
            result.prompt_blocks += nblocks
            result.hit_blocks += hit
            result.hit_tokens += hit * bs
            start = max(now, busy[w])
            first_token = start + (n - hit * bs) / prefill_rate
            busy[w] = first_token
            result.ttft_s.append(first_token - now)
            output = toks.output(row)
            router.load.start(rid, decision.worker, nblocks)
            seq += 1
            heapq.heappush(
                heap, _Running(first_token + len(output) * decode_s, seq, rid, w, output)
            )
            await transport.publish(managers[w].flush_events())
            if progress is not None and (i % 64 == 0 or i == total - 1):
                progress(i + 1, total)
        while heap:
            r = heapq.heappop(heap)
            now = max(now, r.finish)
            await complete(r)
        await transport.sync(0)
        result.simulated_s = now
    finally:
        await transport.aclose()
    result.wall_s = time.perf_counter() - t0
    result.ceiling_blocks = trace_ceiling(rows, bs)
    result.batches = transport.consumer.batches
    st = index.stats()
    result.events = st.counters.events + st.counters.lost_markers
    result.index = st.as_dict()
    result.malformed = transport.consumer.source.stats.malformed
    for ws, m in zip(result.workers, managers, strict=True):
        ws.evictions = m.stats().groups[0].evictions
    return result


def _trace_file(trace: str) -> str:
    try:
        from kvstream.workloads import trace_path

        if trace.endswith(".jsonl") or "/" in trace:
            return str(Path(trace))
        return str(trace_path(trace))
    except Exception:
        return trace

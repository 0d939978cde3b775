"""The replay behind ``kvstream replay``: a request trace over N simulated workers, routed by
a prefix index built from the workers' own KV-cache events.

Each worker is a :class:`~kvstream.cache.KVCacheManager` in metadata-only mode with a
capacity in blocks (LRU eviction), scheduled as vLLM's and SGLang's schedulers do: a request
routed to a worker waits in that worker's queue (first come, first served) until its cache
can hold the prompt, then holds its blocks until it finishes. In simulated time, per arrival:

1. requests whose first token is out stop counting as pending prefill for the router; those
   whose decode is over finish: their output tokens are appended (committing full output
   blocks), they are freed, the worker's events go out, and its queue is admitted again;
2. a request needing more blocks than a worker's whole cache can never be served: it is
   counted as *unservable* (and left out of every ratio, ceiling included);
3. the router picks a worker from the index (and the load it tracks); the request joins that
   worker's queue and is admitted when the cache has room (immediately, usually);
4. on admission the worker reuses its cached prefix and commits the prompt; its events go
   through the pipeline (memory sink by default, or Kafka) into the consumer that updates the
   index; prefill of the uncached tokens starts after the worker's earlier prefills
   (``prefill_tokens_per_s``), then one output token per ``decode_ms_per_token``.

Whether a request is served depends only on its size and the capacity, never on the timing
options: those move *when* it is served (queueing delay, time to first token).
``prediction_accuracy`` compares the blocks the index said the worker held with the blocks
it reused, at the moment of admission (a request that had to wait is matched again then).

By default the index catches up with every batch before a routing decision
(``max_lag_batches=0``); a positive lag lets routing run ahead of the stream, as a router
behind Kafka would. ``router="global-lru"`` replays one worker with every worker's capacity
and prefill speed together: the hit ratio partitioned caches approach when routing is
perfect.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from kvstream.cache import (
    CacheConfig,
    CacheFullError,
    HashedPrompt,
    KVCacheManager,
    LayerGroupSpec,
)
from kvstream.cli.replay_result import LoadSample, ReplayResult, RequestRecord, WorkerSummary
from kvstream.cli.replay_transport import Transport
from kvstream.errors import ConfigError
from kvstream.events.model import SourceId
from kvstream.index import KeyMode, PrefixIndex, Router, RouterConfig, RoutingPolicy, WorkerKey
from kvstream.workloads import MooncakeTokens, TraceRow, load_trace, resolve_trace

__all__ = [
    "GLOBAL_LRU",
    "POLICIES",
    "ROUTERS",
    "ReplayOptions",
    "ReplayResult",
    "WorkerSummary",
    "load_rows",
    "normalize_policy",
    "run_replay",
]

#: The reference "policy": one cache of every worker's capacity together.
GLOBAL_LRU = "global-lru"
#: ``--router`` choices (routing policies; ``global-lru`` is the shared-cache reference).
ROUTERS = (*(p.value for p in RoutingPolicy), GLOBAL_LRU)
POLICIES = ROUTERS
#: Tokens per block for token-id traces when ``block_size`` is not given (vLLM's default).
TOKEN_TRACE_BLOCK_SIZE = 16


def normalize_policy(name: str) -> str:
    """A policy name as :data:`ROUTERS` spells it (``least_loaded`` -> ``least-loaded``);
    ConfigError for an unknown one."""
    p = name.strip().lower().replace("_", "-")
    if p not in ROUTERS:
        raise ConfigError(f"unknown router {name!r}; use one of {', '.join(ROUTERS)}")
    return p


@dataclass(frozen=True)
class ReplayOptions:
    """What to replay and how (see the module docstring).

    ``block_size``: tokens per KV block (None: the trace's tokens per hash id, 512 for
    Mooncake; 16 for token-id traces). ``overlap_weight``: None for the adaptive ``kv``
    router, a number for Dynamo's fixed cost. ``trace_block_tokens``/``time_unit``: how to
    read the trace (see :func:`kvstream.workloads.load_trace`). ``timeline_points``: load
    samples over the trace's duration (for the report).
    """

    trace: str = "conversation"
    limit: int | None = None
    workers: int = 8
    capacity_blocks: int = 5859
    block_size: int | None = None
    router: str = "kv"
    overlap_weight: float | None = None
    hash_algo: str = "blake3_64"
    key_mode: str = "engine"
    sink: str = "memory"
    prefill_tokens_per_s: float = 10_000.0
    decode_ms_per_token: float = 20.0
    output_to_cache: bool = True
    max_lag_batches: int = 0
    seed: int = 0
    trace_block_tokens: int | None = None
    time_unit: str = "ms"
    timeline_points: int = 200

    def check(self) -> None:
        """ConfigError for values out of range."""
        if self.workers < 1 or self.capacity_blocks < 1:
            raise ConfigError("--workers and --capacity-blocks must be >= 1")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError("--block-size must be >= 1")
        normalize_policy(self.router)
        if self.overlap_weight is not None and self.overlap_weight < 0:
            raise ConfigError("--overlap-weight must be >= 0")
        if self.prefill_tokens_per_s <= 0 or self.decode_ms_per_token < 0:
            raise ConfigError("--prefill-tps must be > 0 and --decode-ms >= 0")
        if self.max_lag_batches < 0:
            raise ConfigError("--max-lag must be >= 0")
        if self.limit is not None and self.limit < 1:
            raise ConfigError("--limit must be >= 1")
        if self.sink != "memory" and not self.sink.startswith("kafka://"):
            raise ConfigError(
                f"--sink must be memory or kafka://HOST:PORT/TOPIC, got {self.sink!r}"
            )


def load_rows(opts: ReplayOptions) -> list[TraceRow]:
    """The trace rows ``opts`` names (DataNotFoundError/TraceFormatError on problems)."""
    return load_trace(
        opts.trace,
        limit=opts.limit,
        block_tokens=opts.trace_block_tokens,
        time_unit=opts.time_unit,
    )


def _block_size(opts: ReplayOptions, rows: list[TraceRow]) -> int:
    if opts.block_size is not None:
        return opts.block_size
    for r in rows:
        if r.tokens is None:
            return r.block_tokens
    return TOKEN_TRACE_BLOCK_SIZE


async def run_replay(
    opts: ReplayOptions,
    *,
    progress: Callable[[int, int], None] | None = None,
    rows: list[TraceRow] | None = None,
) -> ReplayResult:
    """Replay ``opts.trace`` (a shipped trace's name or a JSONL path; ``rows`` when already
    loaded). ``progress(done, total)`` is called as requests arrive. Raises ConfigError for
    bad options, DataNotFoundError/TraceFormatError for trace problems."""
    opts.check()
    policy = normalize_policy(opts.router)
    if rows is None:
        rows = load_rows(opts)
    if policy == GLOBAL_LRU:
        shared = replace(
            opts,
            workers=1,
            capacity_blocks=opts.capacity_blocks * opts.workers,
            # as fast as all workers together, or its queue (and held blocks) explode
            prefill_tokens_per_s=opts.prefill_tokens_per_s * opts.workers,
            router=RoutingPolicy.ROUND_ROBIN.value,
        )
        with _fewer_collections():
            result = await _Replay(shared, rows, progress).run()
        result.options = opts
        result.policy = GLOBAL_LRU
        return result
    with _fewer_collections():
        return await _Replay(replace(opts, router=policy), rows, progress).run()


#: The garbage collector's thresholds while a replay runs (see _fewer_collections).
_REPLAY_GC_THRESHOLDS = (100_000, 50, 100)


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    # A replay allocates millions of short-lived containers (events, blocks, token lists)
    # next to a large live set (caches, index, per-request records); with the default
    # thresholds the cyclic collector runs every 700 allocations and traverses the young
    # part of that live set each time: about a quarter of the replay's CPU time, measured.
    # Nothing it allocates depends on cycles being collected promptly, so collect rarely
    # while it runs (process-wide: the thresholds are global), and restore them after.
    old = gc.get_threshold()
    gc.set_threshold(*(max(a, b) for a, b in zip(old, _REPLAY_GC_THRESHOLDS, strict=True)))
    try:
        yield
    finally:
        gc.set_threshold(*old)


# ------------------------------------------------------------------------------- replay

#: Servable rows whose prompts are built and hashed in one call, ahead of their turn.
PROMPTS_AHEAD = 32
_FIRST_TOKEN = 0  # heap event kinds; the first token of a request sorts before its finish
_FINISH = 1


class _Request:
    """A routed request from routing until it finishes (a plain slotted class: one is built
    per request)."""

    __slots__ = (
        "arrival",
        "blocks",
        "fresh",
        "hashed",
        "predicted",
        "prompt",
        "rid",
        "row",
        "worker",
    )

    def __init__(
        self,
        row: TraceRow,
        rid: str,
        prompt: Any,
        worker: int,
        arrival: float,
        blocks: int,
        predicted: int,
        hashed: HashedPrompt | None,
    ) -> None:
        self.row = row
        self.rid = rid
        self.prompt = prompt
        self.worker = worker
        self.arrival = arrival
        self.blocks = blocks
        self.predicted = predicted  # the index's prediction at routing time
        self.fresh = False  # admitted right at routing, nothing changed in between
        self.hashed = hashed  # the prompt's hashed blocks, until admission


class _Replay:
    """One replay run: the workers, their queues and the simulated clock."""

    def __init__(
        self,
        opts: ReplayOptions,
        rows: list[TraceRow],
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.opts = opts
        self.rows = rows
        self.progress = progress
        self.bs = bs = _block_size(opts, rows)
        self.tokens = MooncakeTokens(seed=opts.seed)
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
        self.keys = [WorkerKey(f"worker-{i}") for i in range(opts.workers)]
        self.slot = {k: i for i, k in enumerate(self.keys)}
        incarnation = time.time_ns()
        self.managers = [
            KVCacheManager(cfg, source=SourceId(instance_id=k.instance_id, incarnation=incarnation))
            for k in self.keys
        ]
        self.index = PrefixIndex(key_mode=opts.key_mode)
        # the workers' own hashes spare hashing a prompt twice, but only an engine-keyed
        # index looks blocks up by them (a token-keyed one hashes with its own keys)
        self.reuse_hashes = self.index.key_mode is KeyMode.ENGINE
        self.router = Router(
            self.index,
            self.keys,
            RouterConfig(
                policy=opts.router,
                overlap_weight=opts.overlap_weight,
                hash_algo=opts.hash_algo,
                tokens_per_block=bs,
                seed=opts.seed,
            ),
        )
        self.transport = Transport(opts.sink, self.index, max_lag=opts.max_lag_batches)
        self.result = ReplayResult(
            options=opts, trace_file=_trace_file(opts.trace), policy=opts.router
        )
        self.result.workers = [WorkerSummary(str(k)) for k in self.keys]
        self.result.block_size = bs
        self.queues: list[deque[_Request]] = [deque() for _ in self.keys]
        self.running = [0] * opts.workers
        self.busy = [0.0] * opts.workers  # when each worker's prefill queue drains
        self.heap: list[tuple[float, int, int, _Request]] = []
        self.seq = 0
        self.served = 0  # requests admitted
        # the ceiling (see ReplayResult.ceiling_blocks): blocks an unlimited cache shared by
        # everyone would reuse, and the full blocks it has seen, counted by _prepare
        self.ceiling_hits = 0
        self.seen: set[bytes] = set()
        self.dirty: set[int] = set()  # workers with events not yet handed to the pipeline
        self.now = 0.0
        self.rate = opts.prefill_tokens_per_s
        self.decode_s = opts.decode_ms_per_token / 1000.0

    async def run(self) -> ReplayResult:
        rows, result = self.rows, self.result
        transport = self.transport
        result.trace_requests = len(rows)
        t0 = time.perf_counter()
        await transport.start()
        try:
            for m in self.managers:
                await transport.publish(m.flush_events_deferred())
            await transport.sync(0)
            self.router.check()
            await self._replay_rows()
            await transport.sync(0)
        finally:
            await transport.aclose()
        result.wall_s = time.perf_counter() - t0
        result.simulated_s = self.now
        result.ceiling_blocks = self.ceiling_hits
        result.batches = transport.consumer.batches
        st = self.index.stats()
        result.events = st.counters.events + st.counters.lost_markers
        result.index = st.as_dict()
        result.malformed = transport.consumer.source.stats.malformed
        for ws, m in zip(result.workers, self.managers, strict=True):
            ws.evictions = m.stats().groups[0].evictions
            m.close()  # frees its blocks without a cyclic collection
        if self.router.config.policy is RoutingPolicy.KV:
            result.router_signals = self.router.signals
        if self.served + result.unservable != len(rows):
            raise RuntimeError("replay lost track of a request")  # never expected
        return result

    async def _replay_rows(self) -> None:
        opts, rows, result = self.opts, self.rows, self.result
        bs, cap = self.bs, opts.capacity_blocks
        total = len(rows)
        start = rows[0].timestamp_ms / 1000.0 if rows else 0.0
        span = (rows[-1].timestamp_ms / 1000.0 - start) if rows else 0.0
        every = span / opts.timeline_points if opts.timeline_points > 0 and span > 0 else 0.0
        next_sample = start
        lag = opts.max_lag_batches
        router, transport = self.router, self.transport
        consumer = transport.consumer
        heap = self.heap
        ahead: deque[tuple[Any, HashedPrompt]] = deque()  # the next servable rows' prompts
        for i, row in enumerate(rows):
            now = row.timestamp_ms / 1000.0
            if heap and heap[0][0] <= now:  # (the checks spare a coroutine per call)
                await self._advance(now)
            self.now = max(self.now, now)
            if every and now >= next_sample:
                self._sample(now)
                next_sample = now + every
            nblocks = -(-row.input_length // bs)
            if nblocks > cap:
                result.unservable += 1
            else:
                if self.dirty:
                    await self._publish_dirty()
                if not transport.memory or transport.published != consumer.batches:
                    await transport.sync(lag)  # (a memory sink has nothing else to apply)
                if not ahead:
                    self._prepare(i, ahead)
                # hashed once: the router matches the cache's own hashes (tokens[:-1])
                prompt, hashed = ahead.popleft()
                decision = router.route(
                    prompt,
                    block_hashes=hashed.hashes[: (hashed.num_tokens - 1) // bs]
                    if self.reuse_hashes
                    else None,
                )
                w = self.slot[decision.worker]
                chosen = decision.chosen
                req = _Request(
                    row,
                    f"m{row.index}",
                    prompt,
                    w,
                    now,
                    nblocks,
                    0 if chosen is None else chosen.match.usable_blocks,  # predicted_blocks
                    hashed,
                )
                router.load.start(
                    req.rid,
                    decision.worker,
                    nblocks,
                    prefill_blocks=nblocks if chosen is None else chosen.prefill_blocks,
                )
                queue = self.queues[w]
                req.fresh = not queue
                queue.append(req)
                await self._admit(w, now)
            if self.progress is not None and (i % 64 == 0 or i == total - 1):
                self.progress(i + 1, total)
        await self._advance(float("inf"))
        await self._publish_dirty()
        if any(self.queues):  # never expected: every queued request fits an idle worker
            raise RuntimeError("replay stalled with requests still queued")

    async def _advance(self, until: float) -> None:
        """Process first tokens and completions up to ``until`` (simulated seconds)."""
        heap = self.heap
        load = self.router.load
        managers, queues, running, dirty = self.managers, self.queues, self.running, self.dirty
        output = self.opts.output_to_cache
        tokens = self.tokens
        pop = heapq.heappop
        while heap and heap[0][0] <= until:
            t, _, kind, req = pop(heap)
            self.now = max(self.now, t)
            if kind == _FIRST_TOKEN:
                load.prefilled(req.rid)
                continue
            w = req.worker
            mgr = managers[w]
            row = req.row
            if output and row.output_length:
                try:  # noqa: SIM105 - cheaper than contextlib.suppress on the hot path
                    mgr.append_tokens(req.rid, tokens.output(row))
                except CacheFullError:
                    pass  # no room: the output is not cached
            mgr.free_request(req.rid)
            load.finish(req.rid)
            running[w] -= 1
            dirty.add(w)
            if queues[w]:
                await self._admit(w, t)

    async def _admit(self, w: int, now: float) -> None:
        """Admit worker ``w``'s queue, first come first served, while its cache has room."""
        queue = self.queues[w]
        mgr = self.managers[w]
        bs = self.bs
        result = self.result
        while queue:
            req = queue[0]
            if not req.fresh and w in self.dirty:
                await self._publish(w)  # the index must see the cache as admission finds it
            try:
                match = mgr.add_request(req.rid, req.prompt, hashed=req.hashed)
            except CacheFullError:
                if not self.running[w]:  # cannot happen: it fits an idle cache
                    raise RuntimeError(f"request {req.rid} does not fit an idle worker") from None
                req.fresh = False
                return
            queue.popleft()
            hit = match.groups[0].matched_tokens // bs
            predicted = req.predicted
            if not req.fresh:
                # the cache changed while it waited: ask the index again, as of now (its own
                # events are not published yet)
                await self.transport.sync(self.opts.max_lag_batches)
                hashed = req.hashed
                assert hashed is not None
                m = self.index.match(
                    req.prompt,
                    workers=[self.keys[w]],
                    tier_weights=self.router.config.tier_weights,
                    hash_algo=self.opts.hash_algo,
                    tokens_per_block=bs,
                    block_hashes=hashed.hashes[: (hashed.num_tokens - 1) // bs]
                    if self.reuse_hashes
                    else None,
                )
                predicted = m.matches[0].usable_blocks
                result.requeried += 1
            if predicted == hit:
                result.predicted_equal += 1
            elif predicted > hit:
                result.predicted_more += 1
            else:
                result.predicted_less += 1
            row = req.row
            n = row.input_length
            blocks = req.blocks
            hit_tokens = hit * bs
            ws = result.workers[w]
            ws.requests += 1
            ws.prompt_blocks += blocks
            ws.hit_blocks += hit
            ws.prefill_tokens += n - hit_tokens
            result.requests += 1
            result.prompt_tokens += n
            result.prompt_blocks += blocks
            result.hit_blocks += hit
            result.hit_tokens += hit_tokens
            self.served += 1
            busy = self.busy[w]
            start = now if now >= busy else busy  # max(now, busy), as floats compare
            first = start + (n - hit_tokens) / self.rate
            self.busy[w] = first
            arrival = req.arrival
            queued = start - arrival
            ttft = first - arrival
            result.queue_s.append(queued)
            result.ttft_s.append(ttft)
            result.per_request.append(
                RequestRecord(row.index, w, arrival, queued, ttft, blocks, hit)
            )
            self.running[w] += 1
            self.seq = seq = self.seq + 1
            heap = self.heap
            heapq.heappush(heap, (first, seq, _FIRST_TOKEN, req))
            heapq.heappush(heap, (first + row.output_length * self.decode_s, seq, _FINISH, req))
            req.prompt = req.hashed = None  # the tokens are no longer needed
            self.dirty.add(w)

    async def _publish(self, w: int) -> None:
        """Hand worker ``w``'s events to the pipeline (one batch: its engine iteration)."""
        self.dirty.discard(w)
        await self.transport.publish(self.managers[w].flush_events_deferred())

    async def _publish_dirty(self) -> None:
        """:meth:`_publish` every worker with events, in worker order."""
        dirty = self.dirty
        ws = sorted(dirty) if len(dirty) > 1 else list(dirty)
        dirty.clear()  # (publishing applies batches to the index; it admits nothing)
        publish, managers = self.transport.publish, self.managers
        for w in ws:
            await publish(managers[w].flush_events_deferred())

    def _prepare(self, i: int, ahead: deque[tuple[Any, HashedPrompt]]) -> None:
        """Build and hash the prompts of the next :data:`PROMPTS_AHEAD` servable rows from
        row ``i`` (servable itself) in one :meth:`~kvstream.cache.KVCacheManager.hash_prompts`
        call, so the hasher may hash their chains side by side; they wait in ``ahead`` until
        their turn (a prompt is a function of its row alone). Every servable row is served,
        so the ceiling counts them here, in arrival order, while their hashes are fresh."""
        rows, bs, cap = self.rows, self.bs, self.opts.capacity_blocks
        prompt = self.tokens.prompt
        prompts = []
        lengths = []
        for j in range(i, len(rows)):
            row = rows[j]
            if -(-row.input_length // bs) <= cap:
                prompts.append(prompt(row))
                lengths.append(row.input_length)
                if len(prompts) == PROMPTS_AHEAD:
                    break
        hashed = self.managers[0].hash_prompts(prompts)
        seen = self.seen
        hits = 0
        for n, h in zip(lengths, hashed, strict=True):
            hs = h.hashes
            # its leading full blocks (the last prompt token excluded) already seen: seen
            # holds every earlier request's full blocks, and a block's hash is chained to all
            # of its prefix, so a seen block's prefix was seen too; bisect for the first
            # block not seen
            lo, hi = 0, (n - 1) // bs
            while lo < hi:
                mid = (lo + hi) >> 1
                if hs[mid] in seen:
                    lo = mid + 1
                else:
                    hi = mid
            hits += lo
            seen.update(hs[lo:])  # (the first lo are in already)
        self.ceiling_hits += hits
        ahead.extend(zip(prompts, hashed, strict=True))

    def _sample(self, t: float) -> None:
        self.result.timeline.append(
            LoadSample(t, tuple(self.running), tuple(len(q) for q in self.queues))
        )


def _trace_file(trace: str) -> str:
    try:
        return str(resolve_trace(trace))
    except Exception:
        return trace

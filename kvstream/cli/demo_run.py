"""What ``kvstream demo`` does, without the command line: run, stream, read back, summarise.

1. One metadata-only KV-cache manager per attention-DP rank (a full-attention group and a
   sliding-window group) serves a workload with continuous batching: each engine iteration
   admits requests, appends one block of generated tokens to every running request, frees
   the finished ones, and hands the iteration's event batch to the pipeline.
2. The pipeline fans the batches out to every sink (``block`` policy: the demo loses nothing).
3. Every sink is read back and compared with what the cache emitted, per source.

:func:`run_demo` returns a :class:`DemoResult`; ``demo_cmd`` renders it.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvstream.cache import (
    CacheConfig,
    CacheFullError,
    HostTierConfig,
    KVCacheManager,
    LayerGroupSpec,
)
from kvstream.codec import AvroCodec
from kvstream.errors import ConfigError
from kvstream.events.model import EventBatch, KVCacheEvent, Lost, Removed, SourceId, Stored
from kvstream.kafka_security import redact_url
from kvstream.pipeline import CloseReport, Pipeline, PipelineConfig
from kvstream.sink import ReadableSink, Sink, create_sink
from kvstream.workloads import ChatWorkload, WorkloadRequest, multi_turn_chats

__all__ = ["DemoOptions", "DemoResult", "SinkCheck", "TRACES", "run_demo"]

#: ``--trace`` choices: the synthetic chat generator or a Mooncake trace from shared/data.
TRACES = ("chat", "mooncake-conversation", "mooncake-synthetic")
#: Rows of a Mooncake trace the demo replays unless told otherwise (each is ~14k tokens).
MOONCAKE_DEFAULT_REQUESTS = 500


@dataclass(frozen=True)
class DemoOptions:
    """Everything the demo can be told."""

    sinks: Sequence[str] = ()  # sink URLs; empty: a file sink in ``out_dir`` or a temp dir
    out_dir: Path | None = None
    trace: str = "chat"
    #: At most this many requests (None: the whole chat workload, or the first
    #: MOONCAKE_DEFAULT_REQUESTS rows of a Mooncake trace).
    requests: int | None = None
    conversations: int = 48
    ranks: int = 2
    tokens_per_block: int | None = None  # None: 16 for chat, 64 for Mooncake traces
    #: None: 2048 for chat; for a Mooncake trace, room for every distinct block of the rows
    #: replayed, so what the trace can reuse is not evicted first
    gpu_blocks: int | None = None
    window: int = 512
    #: Host-tier blocks per GPU block (0: no host tier; evicted blocks are dropped).
    host_ratio: float = 0.0
    concurrency: int = 8
    hash_algo: str = "v2_sha256_64"
    seed: int = 0
    instance_id: str = "demo-engine"


@dataclass
class SinkCheck:
    """What was read back from one sink and whether it matches what the cache emitted."""

    url: str
    name: str
    batches: int = 0
    events: int = 0
    lost_ids: int = 0
    bytes: int | None = None
    files: int | None = None
    location: str = ""
    ok: bool = False
    problem: str | None = None
    avro_files: bool = False


@dataclass
class DemoResult:
    """The numbers the summary shows (all JSON-ready through :meth:`as_dict`)."""

    options: DemoOptions
    workload: str
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    iterations: int = 0
    batches: int = 0
    #: An unlimited cache's token hit rate on the same requests (Mooncake traces only): what
    #: the workload itself offers (the start of a trace is cold: most reuse comes later).
    ceiling_rate: float | None = None
    events_by_kind: Counter[str] = field(default_factory=Counter)
    blocks_stored: int = 0
    blocks_removed: int = 0
    evictions: int = 0
    encoded_bytes: int = 0
    engine_s: float = 0.0
    total_s: float = 0.0
    groups: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    close: CloseReport | None = None
    sinks: list[SinkCheck] = field(default_factory=list)
    #: The temporary directory of the default file sink, removed once read back.
    removed_dir: str | None = None

    @property
    def events(self) -> int:
        """Events the cache emitted."""
        return sum(self.events_by_kind.values())

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ok(self) -> bool:
        """Every sink got every event back, identical."""
        return bool(self.sinks) and all(s.ok for s in self.sinks)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "ok": self.ok,
            "workload": self.workload,
            "requests": self.requests,
            "rejected_requests": self.rejected,
            "prompt_tokens": self.prompt_tokens,
            "reused_prompt_tokens": self.reused_tokens,
            "prefix_hit_rate": round(self.hit_rate, 4),
            "ceiling_hit_rate": None if self.ceiling_rate is None else round(self.ceiling_rate, 4),
            "generated_tokens": self.generated_tokens,
            "engine_iterations": self.iterations,
            "layer_groups": self.groups,
            "sources": self.sources,
            "batches": self.batches,
            "events": self.events,
            "events_by_kind": dict(sorted(self.events_by_kind.items())),
            "blocks_stored": self.blocks_stored,
            "blocks_removed": self.blocks_removed,
            "evictions": self.evictions,
            "encoded_bytes": self.encoded_bytes,
            "engine_seconds": round(self.engine_s, 4),
            "total_seconds": round(self.total_s, 4),
            "events_per_second": round(self.events / self.engine_s, 1) if self.engine_s else None,
            "pipeline": self.close.as_dict() if self.close else None,
            "sinks": [vars(s) for s in self.sinks],
            "removed_dir": self.removed_dir,
        }


# ---------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class _Workload:
    label: str
    requests: Iterator[WorkloadRequest]
    total: int
    blocks_needed: int | None = None  # Mooncake: distinct blocks of the rows (demo block size)
    ceiling_rate: float | None = None


def _requests(opts: DemoOptions) -> _Workload:
    """The chosen workload (``opts`` resolved except Mooncake's ``gpu_blocks``)."""
    if opts.trace == "chat":
        work = ChatWorkload(num_conversations=opts.conversations, seed=opts.seed)
        label = (
            f"synthetic multi-turn chats ({opts.conversations} conversations, "
            f"{work.num_system_prompts} shared system prompts)"
        )
        total = sum(1 for _ in multi_turn_chats(work))  # cheap: prompts are small
        if opts.requests is not None:
            total = min(total, opts.requests)
        return _Workload(label, multi_turn_chats(work), total)
    if opts.trace.startswith("mooncake-"):
        from kvstream.workloads import load_trace, mooncake_requests

        name = opts.trace.removeprefix("mooncake-")
        rows = load_trace(name, limit=opts.requests)
        label = f"Mooncake {name} trace ({len(rows)} requests)"
        tpb = opts.tokens_per_block or 64
        distinct: set[int] = set()
        covered: dict[int, int] = {}  # hash id -> most of its tokens an earlier row held
        reused = prompt = 0
        for r in rows:  # what an unlimited cache of tpb-token blocks would reuse
            bt = r.block_tokens
            budget = (r.input_length - 1) // tpb * tpb  # the last token is never reused
            for i, h in enumerate(r.hash_ids):
                have = min(covered.get(h, 0), budget - i * bt)
                if have <= 0:
                    break
                reused += have
                if have < bt:
                    break
            prompt += r.input_length
            for i, h in enumerate(r.hash_ids):
                held = min(bt, r.input_length - i * bt) // tpb * tpb
                covered[h] = max(covered.get(h, 0), held)
            distinct.update(r.hash_ids)
        bt = rows[0].block_tokens if rows else tpb
        needed = len(distinct) * -(-bt // tpb) + 64  # + room for the running outputs
        return _Workload(
            label,
            mooncake_requests(rows, seed=opts.seed),
            len(rows),
            blocks_needed=needed,
            ceiling_rate=reused / prompt if prompt else 0.0,
        )
    raise ConfigError(f"unknown trace {opts.trace!r}; choose one of {', '.join(TRACES)}")


def _resolved(opts: DemoOptions) -> DemoOptions:
    chat = opts.trace == "chat"
    return replace(
        opts,
        tokens_per_block=opts.tokens_per_block or (16 if chat else 64),
        gpu_blocks=opts.gpu_blocks or (2048 if chat else None),
        requests=opts.requests if opts.requests is not None or chat else MOONCAKE_DEFAULT_REQUESTS,
    )


def _cache_config(opts: DemoOptions) -> CacheConfig:
    assert opts.tokens_per_block is not None
    assert opts.gpu_blocks is not None
    return CacheConfig(
        tokens_per_block=opts.tokens_per_block,
        groups=[
            LayerGroupSpec(num_layers=24, num_kv_heads=8, head_dim=128, num_blocks=opts.gpu_blocks),
            LayerGroupSpec(
                num_layers=8,
                num_kv_heads=8,
                head_dim=128,
                num_blocks=max(opts.gpu_blocks // 2, 64),
                window_size=opts.window,
            ),
        ],
        hash_algo=opts.hash_algo,
        metadata_only=True,
        host_tier=HostTierConfig(ratio=opts.host_ratio) if opts.host_ratio > 0 else None,
    )


@dataclass
class _Running:
    req: WorkloadRequest
    rank: int
    sent: int = 0  # output tokens appended so far


def _drive(
    opts: DemoOptions,
    *,
    requests: Iterator[WorkloadRequest],
    managers: list[KVCacheManager],
    submit: Callable[[EventBatch], object],
    result: DemoResult,
    advance: Callable[[], None],
    stop: threading.Event | None = None,
) -> list[EventBatch]:
    """The engine thread: continuous batching over every rank; returns the emitted batches
    (those of the iterations run so far once ``stop`` is set).

    Requests are routed to a rank (a conversation sticks to one rank, where its history is
    cached) and wait there until the rank has a free slot and enough free blocks; a request
    that does not fit into an idle rank is rejected.
    """
    emitted: list[EventBatch] = []
    tpb = opts.tokens_per_block or 16
    n = len(managers)
    running: list[list[_Running]] = [[] for _ in managers]
    waiting: list[deque[WorkloadRequest]] = [deque() for _ in managers]
    source = iter(requests)
    read = 0
    exhausted = False

    def refill() -> None:  # read ahead until every rank has work (bounded)
        nonlocal read, exhausted
        limit = 2 * opts.concurrency * n
        while (
            not exhausted
            and any(len(w) == 0 for w in waiting)
            and sum(len(w) for w in waiting) < limit
        ):
            if opts.requests is not None and read >= opts.requests:
                exhausted = True
                return
            req = next(source, None)
            if req is None:
                exhausted = True
                return
            read += 1
            # prefix affinity, as a KV-aware router: a conversation (or else a prompt's first
            # 1024 tokens: past a system prompt that everyone shares) sticks to one rank,
            # where its prefix is cached, unless that rank is overloaded compared with the
            # least loaded one
            key = req.conversation
            if key is None:
                key = zlib.crc32(req.prompt.raw[: 4 * max(tpb, 1024)])
            rank = key % n
            least = min(range(n), key=lambda i: len(waiting[i]) + len(running[i]))
            if len(waiting[rank]) + len(running[rank]) > 2 * opts.concurrency + len(
                waiting[least]
            ) + len(running[least]):
                rank = least
            waiting[rank].append(req)

    def admit(rank: int) -> None:
        mgr, queue = managers[rank], waiting[rank]
        while queue and len(running[rank]) < opts.concurrency:
            req = queue[0]
            try:
                match = mgr.add_request(req.request_id, req.prompt)
            except CacheFullError:
                if running[rank]:
                    return  # wait for running requests to free blocks
                queue.popleft()
                result.rejected += 1  # does not fit even into an idle cache
                advance()
                continue
            queue.popleft()
            result.requests += 1
            result.prompt_tokens += len(req.prompt)
            result.reused_tokens += match.reusable_tokens
            running[rank].append(_Running(req, rank))
            refill()

    while stop is None or not stop.is_set():
        refill()
        for rank in range(n):
            admit(rank)
        if exhausted and not any(running) and not any(waiting):
            break
        result.iterations += 1
        for rank, mgr in enumerate(managers):
            still = []
            for r in running[rank]:
                chunk = r.req.output[r.sent : r.sent + tpb]
                if len(chunk):
                    try:
                        mgr.append_tokens(r.req.request_id, chunk)
                    except CacheFullError:
                        chunk = chunk[:0]  # out of blocks: finish the request early
                    r.sent += len(chunk)
                    result.generated_tokens += len(chunk)
                if len(chunk) and r.sent < len(r.req.output):
                    still.append(r)
                else:
                    mgr.free_request(r.req.request_id)
                    advance()
            running[rank] = still
            batch = mgr.flush_events()  # the iteration's events, one batch per rank
            if batch is not None:
                emitted.append(batch)
                submit(batch)
    return emitted


# ------------------------------------------------------------------------------- sinks


def _sinks(opts: DemoOptions) -> tuple[list[tuple[str, Sink]], Path | None]:
    """The sinks, and the temporary directory made for the file sink (None: ``out_dir`` or
    none). The bare word ``file`` (and no sink at all) is a file sink in ``out_dir``, or in a
    new temporary directory, as in ``kvstream bridge``."""
    urls = list(opts.sinks) or ["file"]
    temp = None
    if "file" in urls:
        if opts.out_dir is not None:
            where = opts.out_dir
        else:
            where = temp = Path(tempfile.mkdtemp(prefix="kvstream-demo-"))
        urls = [f"file://{where.resolve()}" if u == "file" else u for u in urls]
    elif opts.out_dir is not None:
        raise ConfigError("--out is the directory of the file sink: add --sink file")
    try:
        return [(url, create_sink(url)) for url in urls], temp
    except BaseException:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
        raise


async def _read_back(
    url: str, name: str, sink: Sink, since: object
) -> tuple[list[EventBatch], SinkCheck]:
    check = SinkCheck(url=redact_url(url), name=name, location=_location(sink))
    check.avro_files = getattr(sink, "format", None) == "avro"
    if not isinstance(sink, ReadableSink):
        check.problem = f"a {type(sink).__name__} cannot be read back"
        return [], check
    paths = getattr(sink, "paths", None)  # a file sink: the files this run wrote
    if isinstance(paths, list) and isinstance(since, int):
        files = [Path(p) for p in paths[since:]]
        check.files = len(files)
        check.bytes = sum(p.stat().st_size for p in files)
    return await sink.read_back(since), check


def _location(sink: Sink) -> str:
    for attr in ("directory", "topic"):
        value = getattr(sink, attr, None)
        if value is not None:
            servers = getattr(sink, "bootstrap_servers", None)
            return f"{servers}/{value}" if servers else str(value)
    return "in memory" if sink.scheme == "memory" else ""


def _compare(emitted: list[EventBatch], got: list[EventBatch], check: SinkCheck) -> None:
    want: dict[SourceId, list[KVCacheEvent]] = {}
    for b in emitted:
        want.setdefault(b.source, []).extend(b.events)
    have: dict[SourceId, list[KVCacheEvent]] = {}
    for b in got:
        if b.source in want:  # a reused topic or directory may hold other runs' sources
            have.setdefault(b.source, []).extend(b.events)
            check.batches += 1
    for src, events in want.items():
        mine = have.get(src, [])
        check.events += sum(1 for ev in mine if not isinstance(ev.data, Lost))
        check.lost_ids += sum(ev.data.count for ev in mine if isinstance(ev.data, Lost))
        if mine != events and check.problem is None:
            ids = [ev.event_id for ev in mine]
            check.problem = (
                f"source {src.instance_id}/rank {src.attention_dp_rank}: read back "
                f"{len(mine)} events (ids {ids[:3]}..), emitted {len(events)}"
            )
    check.ok = check.problem is None


# --------------------------------------------------------------------------------- run


async def run_demo(
    opts: DemoOptions,
    *,
    on_start: Callable[[str, int | None], None] | None = None,
    advance: Callable[[], None] | None = None,
) -> DemoResult:
    """Run the whole demo; ``on_start(label, total)``/``advance()`` drive a progress bar.

    Raises :class:`ConfigError` for bad options or sink URLs and
    :class:`~kvstream.errors.SinkError` when a sink cannot be reached at all. The default
    file sink's temporary directory is removed once read back, or when the run fails or is
    cancelled (``result.removed_dir``); ``out_dir`` keeps the files.
    """
    if opts.ranks < 1 or opts.concurrency < 1:
        raise ConfigError("--ranks and --concurrency must be >= 1")
    opts = _resolved(opts)
    work = _requests(opts)
    label = work.label
    if opts.gpu_blocks is None:
        opts = replace(opts, gpu_blocks=max(work.blocks_needed or 0, 64))
    cfg = _cache_config(opts)
    incarnation = time.time_ns()
    managers = [
        KVCacheManager(
            cfg,
            source=SourceId(
                instance_id=opts.instance_id, attention_dp_rank=rank, incarnation=incarnation
            ),
        )
        for rank in range(opts.ranks)
    ]
    result = DemoResult(options=opts, workload=label, ceiling_rate=work.ceiling_rate)
    result.groups = [
        "full attention" if g.window_size is None else f"sliding window {g.window_size}"
        for g in cfg.groups
    ]
    result.sources = [f"{opts.instance_id}/rank {r}" for r in range(opts.ranks)]
    named, temp = _sinks(opts)
    try:
        return await _stream(opts, result, named, work, managers, on_start, advance)
    finally:
        if temp is not None:  # the files were read back: nothing left to look at
            shutil.rmtree(temp, ignore_errors=True)
            result.removed_dir = str(temp)


async def _stream(
    opts: DemoOptions,
    result: DemoResult,
    named: list[tuple[str, Sink]],
    work: Any,
    managers: list[KVCacheManager],
    on_start: Callable[[str, int | None], None] | None,
    advance: Callable[[], None] | None,
) -> DemoResult:
    """Serve the workload into the sinks, read them back, compare."""
    label, requests, total = work.label, work.requests, work.total
    starts: dict[str, object] = {}
    try:
        for url, sink in named:
            await asyncio.wait_for(sink.start(), 30)  # fail fast on an unreachable sink
            # remember where this run starts (a reused topic or directory holds older runs)
            starts[url] = await sink.position() if isinstance(sink, ReadableSink) else None
    except BaseException:
        await asyncio.gather(*(s.shutdown(5) for _, s in named), return_exceptions=True)
        raise
    if on_start is not None:
        on_start(label, total)
    config = PipelineConfig.load(
        defaults={
            "overflow": "block",
            "block_timeout_s": 10.0,
            "linger_s": 0.005,
            "retry": {"deadline_s": 30.0},
        },
        handoff_timeout_s=30.0,
        close_timeout_s=60.0,
    )
    t0 = time.perf_counter()
    pipe = Pipeline([s for _, s in named], config)
    stop = threading.Event()
    async with pipe:
        try:
            emitted = await asyncio.to_thread(
                lambda: _drive(
                    opts,
                    requests=requests,
                    managers=managers,
                    submit=pipe.submit,
                    result=result,
                    advance=advance or (lambda: None),
                    stop=stop,
                )
            )
        except BaseException:  # cancelled (Ctrl-C): the engine thread stops too
            stop.set()
            raise
        await pipe.flush(60)
    result.engine_s = time.perf_counter() - t0
    result.close = await pipe.aclose()
    result.batches = len(emitted)
    codec = AvroCodec()
    for b in emitted:
        result.encoded_bytes += len(codec.encode(b))
        for ev in b.events:
            result.events_by_kind[ev.kind.value] += 1
            if isinstance(ev.data, Stored):
                result.blocks_stored += len(ev.data.blocks)
            elif isinstance(ev.data, Removed):
                result.blocks_removed += len(ev.data.block_hashes)
    result.evictions = sum(g.evictions for m in managers for g in m.stats().groups)
    for (url, sink), name in zip(named, pipe.sinks, strict=True):
        try:
            got, check = await _read_back(url, name, sink, starts[url])
        except Exception as exc:
            check = SinkCheck(url=url, name=name, problem=f"read back failed: {exc}")
            got = []
        if check.problem is None:
            _compare(emitted, got, check)
        if check.bytes is None:
            check.bytes = result.encoded_bytes
        result.sinks.append(check)
    result.total_s = time.perf_counter() - t0
    return result

"""Cost of recording KV-cache events, against baselines measured in the same run.

Workload: each iteration stores ``--requests`` chains of ``--chain`` blocks (each chain
coalesces into one ``stored`` event) per layer group, evicts as many older blocks
(``removed``, batched per group), then calls ``flush()`` (which builds and validates the
EventBatch). The cost per recorded block is the whole loop's time (recording + take) divided
by the number of stored + removed calls (blocks, for the batched calls).

Variants: one ``stored``/``removed`` call per block, or one ``stored_chain`` per chain and one
``removed_many`` per group and iteration (what the cache manager does); ``take`` (models built
in the loop), ``flush_deferred`` (the engine thread's cost: the records are handed over as a
DeferredBatch) and the ``materialize()`` of those batches measured apart (the pipeline's cost).

The cache manager's step (issue 23 §4, ``--step``, the default section first): one
metadata-only :class:`KVCacheManager` step with the real recorder (an ``EventEmitter``) whose
iteration's events are handed over with ``flush_events_deferred()`` and ``submit()``-ted to
a running asyncio :class:`Pipeline` (its own loop thread and memory sink), against the same
step on a manager with the null recorder (events off, nothing handed over). Two sinks, in the
same rounds: the memory sink as it is (it takes columns: the pipeline turns each deferred
batch into columns, no model built, as for Kafka), and one that needs models (``on,
models``: the pipeline materialises every batch there, what every sink got before columns).
``on, checked``: the columns sink with an ``EventEmitter`` subclass as the recorder, which
the manager records into through the public, checked calls and which keeps its own set of
announced blocks (what the manager's own emitter did before its trusted paths and
``dedup=False``).
Two steps: *prefill* (admit one 8k-token prompt: hash, match, allocate, commit its blocks;
then free it, so later prompts evict) and *decode* (append one token to each of 64 running
requests; a block fills every 16 steps). Fresh prompts every round, the six runs interleaved
in a rotated order, wall time per step on the
engine thread (the pipeline thread's GIL use included); median ratio and spread over the
rounds. Metadata-only is the worst case for the ratio (no tensor work). Goal: <= 1.05x.

Also measured: a NullRecorder call (events off) against an empty method call with the same
signature and a bare empty method call, and the per-block cost against appending a tuple to a
list (the cheapest conceivable "recording").

Then the same steps' engine-thread CPU alone (``--paired-rounds``, no pipeline), step by
step, the three managers rotated within each round: quantiles over the steps, which load on
a shared machine disturbs less than whole-run means.

    python benchmarks/bench_emitter.py [--iterations N] [--chain 16] [--profile]
        [--step-rounds 7] [--paired-rounds 9] [--step-only]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from kvstream.sinks.memory import MemorySink

from kvstream._types import TokenIds
from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.events.deferred import DeferredBatch
from kvstream.events.emitter import EventEmitter, NullRecorder
from kvstream.events.model import AttentionKind, SourceId
from kvstream.events.recorder import NULL_RECORDER
from kvstream.pipeline import Pipeline, PipelineConfig


def best_ns(fn: Callable[[], int], repeats: int) -> tuple[float, float]:
    """(best, median) ns per operation over ``repeats`` runs; ``fn`` returns its op count."""
    per_op: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        n = fn()
        per_op.append((time.perf_counter_ns() - t0) / n)
    return min(per_op), statistics.median(per_op)


class Workload:
    """Pre-built arguments, so that only recording is timed."""

    def __init__(self, iterations: int, requests: int, chain: int, groups: int, tpb: int) -> None:
        self.groups = groups
        self.tpb = tpb
        n_blocks = iterations * requests * chain
        self.hashes = [(i + 1).to_bytes(8, "big") for i in range(n_blocks)]
        self.tokens = [TokenIds(range(i * tpb, (i + 1) * tpb)) for i in range(n_blocks)]
        self.token_lists = [list(t) for t in self.tokens]
        self.iterations, self.requests, self.chain = iterations, requests, chain
        # Per chain: its hashes and its tokens packed (as the cache manager passes them).
        self.chains = [
            (
                self.hashes[i : i + chain],
                TokenIds.from_bytes(b"".join(t.raw for t in self.tokens[i : i + chain])),
            )
            for i in range(0, n_blocks, chain)
        ]
        self.deferred: list[DeferredBatch] = []

    def emitter(self, capacity: int) -> EventEmitter:
        em = EventEmitter(SourceId(instance_id="bench"), capacity=capacity)
        for g in range(self.groups):
            em.created(
                g,
                window_size=4096 if g == 0 else 128,
                num_blocks_per_cache_level=[1 << 20],
                tokens_per_block=self.tpb,
                attention_kind=AttentionKind.FULL if g == 0 else AttentionKind.SLIDING_WINDOW,
            )
        em.take()
        return em

    def run(self, em: EventEmitter, *, lists: bool = False, do_take: bool = True) -> int:
        """Record the workload; returns the number of recording calls."""
        hashes = self.hashes
        tokens = self.token_lists if lists else self.tokens
        chain, per_iter = self.chain, self.requests * self.chain
        groups = range(self.groups)
        stored = em.stored
        removed = em.removed
        calls = 0
        for it in range(self.iterations):
            base = it * per_iter
            for r in range(self.requests):
                start = base + r * chain
                for g in groups:
                    parent = None
                    for i in range(start, start + chain):
                        h = hashes[i]
                        stored(g, parent_hash=parent, block_hash=h, token_ids=tokens[i])
                        parent = h
            calls += per_iter * self.groups
            if it:  # evict the previous iteration's blocks
                prev = base - per_iter
                for g in groups:
                    for i in range(prev, base):
                        removed(g, hashes[i])
                calls += per_iter * self.groups
            if do_take:
                em.flush()
            else:
                em.flush_iteration()
        return calls

    def run_batched(self, em: EventEmitter, *, deferred: bool = False) -> int:
        """The same workload through stored_chain/removed_many; returns the number of blocks
        recorded (stored + removed). With ``deferred`` the iteration's events are handed over
        with flush_deferred and kept in ``self.deferred`` (not materialised)."""
        hashes = self.hashes
        per_iter = self.requests * self.chain
        groups = range(self.groups)
        stored_chain = em.stored_chain
        removed_many = em.removed_many
        keep = self.deferred.append
        calls = 0
        for it in range(self.iterations):
            for r in range(self.requests):
                block_hashes, packed = self.chains[it * self.requests + r]
                for g in groups:
                    stored_chain(g, parent_hash=None, block_hashes=block_hashes, token_ids=packed)
            calls += per_iter * self.groups
            if it:
                base = it * per_iter
                evicted = hashes[base - per_iter : base]
                for g in groups:
                    removed_many(g, evicted)
                calls += per_iter * self.groups
            if deferred:
                d = em.flush_deferred()
                if d is not None:
                    keep(d)
            else:
                em.flush()
        return calls

    def materialize_deferred(self) -> int:
        """Materialise (and drop) the kept deferred batches; returns their block count."""
        n = sum(
            len(ev.data.blocks) if ev.data.type == "stored" else len(ev.data.block_hashes)  # type: ignore[union-attr]
            for d in self.deferred
            for ev in d.materialize().events
            if ev.data.type in ("stored", "removed")
        )
        self.deferred.clear()
        return n

    def baseline_append(self) -> int:
        """The same loop shape, appending a tuple per call instead of recording."""
        hashes, tokens = self.hashes, self.tokens
        chain, per_iter = self.chain, self.requests * self.chain
        groups = range(self.groups)
        out: list[tuple[Any, ...]] = []
        append = out.append
        calls = 0
        for it in range(self.iterations):
            base = it * per_iter
            for r in range(self.requests):
                start = base + r * chain
                for g in groups:
                    parent = None
                    for i in range(start, start + chain):
                        h = hashes[i]
                        append((g, parent, h, tokens[i]))
                        parent = h
            calls += per_iter * self.groups
            if it:
                prev = base - per_iter
                for g in groups:
                    for i in range(prev, base):
                        append((g, hashes[i]))
                calls += per_iter * self.groups
            out.clear()
        return calls


class _Empty:
    def noop(self) -> None:
        pass

    def stored(
        self,
        layer_group_id: int,
        *,
        parent_hash: bytes | None,
        block_hash: bytes,
        token_ids: Any,
        cache_level: int = 0,
        priority: int = 35,
        lora_id: int | None = None,
        lora_name: str | None = None,
        mm_keys: Any = (),
        cache_salt: str | None = None,
        token_extra_ids: Any = None,
    ) -> None:
        pass


def null_costs(n: int, repeats: int) -> dict[str, tuple[float, float]]:
    h = b"\x00" * 8
    t = TokenIds(range(16))
    rec = NullRecorder()
    empty = _Empty()

    def null_call() -> int:
        stored = rec.stored
        for _ in range(n):
            stored(0, parent_hash=h, block_hash=h, token_ids=t)
        return n

    def null_guarded() -> int:
        for _ in range(n):
            if rec.enabled:
                rec.stored(0, parent_hash=h, block_hash=h, token_ids=t)
        return n

    def empty_same_signature() -> int:
        stored = empty.stored
        for _ in range(n):
            stored(0, parent_hash=h, block_hash=h, token_ids=t)
        return n

    def empty_method() -> int:
        noop = empty.noop
        for _ in range(n):
            noop()
        return n

    def empty_loop() -> int:
        for _ in range(n):
            pass
        return n

    return {
        "empty loop iteration": best_ns(empty_loop, repeats),
        "empty method call": best_ns(empty_method, repeats),
        "empty method, stored() signature": best_ns(empty_same_signature, repeats),
        "NullRecorder.stored()": best_ns(null_call, repeats),
        "if rec.enabled: (NullRecorder)": best_ns(null_guarded, repeats),
    }


class ModelsMemorySink(MemorySink):
    """A memory sink that takes models only (the pipeline materialises batches for it)."""

    accepts_columns = False


class PipelineThread:
    """A Pipeline with a memory sink running on its own event-loop thread (the engine's
    pipeline); ``submit`` from the engine thread. ``models``: a sink that needs the models."""

    def __init__(self, models: bool = False) -> None:
        self.loop = asyncio.new_event_loop()
        self.sink = (ModelsMemorySink if models else MemorySink)(max_batches=256)
        self.pipe = Pipeline([self.sink], PipelineConfig.load(defaults={"linger_s": 0.0}))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.pipe.start(), self.loop).result()

    def drain(self) -> None:
        asyncio.run_coroutine_threadsafe(self.pipe.flush(60), self.loop).result()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.pipe.aclose(30), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


STEP_TPB = 16
STEP_PROMPT = 8192


class PublicPathEmitter(EventEmitter):
    """An EventEmitter the manager does not trust (a subclass): it records through the
    public, checked calls and keeps its own set of announced blocks (dedup), as the manager's
    emitter did before its trusted paths (``on, checked``)."""


def _step_manager(events: bool, checked: bool = False) -> KVCacheManager:
    cfg = CacheConfig(
        tokens_per_block=STEP_TPB,
        groups=[LayerGroupSpec(num_layers=32, num_kv_heads=8, head_dim=128, num_blocks=8192)],
        hash_algo="vllm_sha256_cbor_64",
        metadata_only=True,
    )
    if checked:
        source = SourceId(instance_id="bench-step")
        rec = PublicPathEmitter(source, hash_algo=cfg.hash_algo, capacity=cfg.event_capacity)
        return KVCacheManager(cfg, recorder=rec)
    if events:
        return KVCacheManager(cfg, source=SourceId(instance_id="bench-step"))
    return KVCacheManager(cfg, recorder=NULL_RECORDER)


def prefill_steps(
    events: bool, prompts: list[list[int]], pipe: PipelineThread, checked: bool = False
) -> tuple[float, float]:
    """(wall, engine-thread CPU) seconds per prefill step (admit one prompt, hand the
    events over, free it)."""
    mgr = _step_manager(events, checked)
    submit = pipe.pipe.submit
    c0, t0 = time.thread_time(), time.perf_counter()
    for i, prompt in enumerate(prompts):
        rid = f"p{i}"
        mgr.add_request(rid, prompt)
        if events:
            batch = mgr.flush_events_deferred()
            if batch is not None:
                submit(batch)
        mgr.free_request(rid)
    dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
    pipe.drain()
    return dt / len(prompts), cpu / len(prompts)


def decode_steps(
    events: bool,
    prompts: list[list[int]],
    steps: int,
    pipe: PipelineThread,
    checked: bool = False,
) -> tuple[float, float]:
    """(wall, engine-thread CPU) seconds per decode step (one token appended to each
    running request)."""
    mgr = _step_manager(events, checked)
    for i, prompt in enumerate(prompts):
        mgr.add_request(f"d{i}", prompt)
    if events:
        mgr.flush_events_deferred()
    rids = [f"d{i}" for i in range(len(prompts))]
    rng = np.random.default_rng(len(prompts))
    tokens = rng.integers(0, 128_000, (steps, len(rids))).tolist()
    submit = pipe.pipe.submit
    append = mgr.append_tokens
    c0, t0 = time.thread_time(), time.perf_counter()
    for row in tokens:
        for rid, tok in zip(rids, row, strict=True):
            append(rid, (tok,))
        if events:
            batch = mgr.flush_events_deferred()
            if batch is not None:
                submit(batch)
    dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
    pipe.drain()
    return dt / steps, cpu / steps


def step_costs(rounds: int, prefills: int, running: int, decodes: int) -> None:
    pipes = {"columns": PipelineThread(), "models": PipelineThread(models=True)}
    results: dict[str, list[tuple[float, float]]] = {}
    try:
        variants = ("off", "on", "on, models", "on, checked")
        runs = [f"{k} {v}" for k in ("prefill", "decode") for v in variants]
        for r in range(rounds):
            rng = np.random.default_rng(1000 + r)
            system = rng.integers(0, 128_000, 2048).tolist()
            prompts = [
                system + rng.integers(0, 128_000, STEP_PROMPT - 2048).tolist()
                for _ in range(prefills)
            ]
            dprompts = [system + rng.integers(0, 128_000, 1000).tolist() for _ in range(running)]
            k = r % len(runs)
            for name in runs[k:] + runs[:k]:
                on = "on" in name
                checked = name.endswith("checked")
                p = pipes["models" if name.endswith("models") else "columns"]
                if name.startswith("prefill"):
                    got = prefill_steps(on, prompts, p, checked)
                else:
                    got = decode_steps(on, dprompts, decodes, p, checked)
                results.setdefault(name, []).append(got)
        delivered = {k: p.sink.batches_in for k, p in pipes.items()}
    finally:
        for p in pipes.values():
            p.close()
    print(
        f"\ncache-manager step, events on (EventEmitter + flush_events_deferred + submit to a "
        f"running pipeline) / off (null recorder); {rounds} rounds, median (spread)"
    )
    for kind in ("prefill", "decode"):
        what = (
            f"{STEP_PROMPT}-token prompt, {STEP_PROMPT // STEP_TPB} blocks"
            if kind == "prefill"
            else f"{running} requests, 1 token each"
        )
        print(f"  {kind} ({what})")
        for col, label in ((0, "wall, engine thread"), (1, "CPU of the engine thread")):
            off = [x[col] for x in results[f"{kind} off"]]
            for variant in ("on", "on, models", "on, checked"):
                on = [x[col] for x in results[f"{kind} {variant}"]]
                ratios = [a / b for a, b in zip(on, off, strict=True)]
                print(
                    f"    {label:<26} off {statistics.median(off) * 1e6:8.1f} us, "
                    f"{variant:<11} {statistics.median(on) * 1e6:8.1f} us, on/off "
                    f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}; "
                    f"goal <= 1.05x)"
                )
    print(f"  (batches the memory sinks received: {delivered})")


def paired_step_cpu(rounds: int, prefills: int, running: int, decodes: int) -> None:
    """The engine thread's CPU per step alone (no pipeline: the deferred batch is dropped),
    measured step by step: ``off``, ``on`` and ``on, checked`` managers rotated within each
    round on the same fresh prompts; p10 / p25 / median over the steps of all rounds (robust to
    what other load adds to some steps). Prefill: the steps that evict (the second half);
    decode: groups of 16 steps, so that each holds one block-filling step."""
    tpb = STEP_TPB
    per: dict[str, list[float]] = {}
    variants = ("off", "on", "on, checked")
    for r in range(rounds):
        rng = np.random.default_rng(2000 + r)
        system = rng.integers(0, 128_000, 2048).tolist()
        prompts = [
            system + rng.integers(0, 128_000, STEP_PROMPT - 2048).tolist() for _ in range(prefills)
        ]
        dprompts = [system + rng.integers(0, 128_000, 1000).tolist() for _ in range(running)]
        tokens = rng.integers(0, 128_000, (decodes, running)).tolist()
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            on, checked = v != "off", v.endswith("checked")
            mgr = _step_manager(on, checked)
            out = per.setdefault(f"prefill {v}", [])
            for i, prompt in enumerate(prompts):
                c0 = time.thread_time_ns()
                mgr.add_request(f"p{i}", prompt)
                if on:
                    mgr.flush_events_deferred()
                mgr.free_request(f"p{i}")
                if 2 * i >= len(prompts):
                    out.append(time.thread_time_ns() - c0)
            mgr = _step_manager(on, checked)
            for i, prompt in enumerate(dprompts):
                mgr.add_request(f"d{i}", prompt)
            if on:
                mgr.flush_events_deferred()
            rids = [f"d{i}" for i in range(running)]
            out = per.setdefault(f"decode {v}", [])
            c0 = time.thread_time_ns()
            for j, row in enumerate(tokens):
                for rid, tok in zip(rids, row, strict=True):
                    mgr.append_tokens(rid, (tok,))
                if on:
                    mgr.flush_events_deferred()
                if j % tpb == tpb - 1:
                    out.append((time.thread_time_ns() - c0) / tpb)
                    c0 = time.thread_time_ns()
    print(
        f"\nengine-thread CPU per step alone (no pipeline), paired per step; {rounds} rounds; "
        "on/off at p10 / p25 / median of the steps"
    )
    for kind in ("prefill", "decode"):
        qs = {}
        for v in variants:
            x = sorted(per[f"{kind} {v}"])
            qs[v] = (x[len(x) // 10], x[len(x) // 4], x[len(x) // 2])
        off = qs["off"]
        print(f"  {kind:<8} off {off[0] / 1e3:7.1f} / {off[1] / 1e3:7.1f} / {off[2] / 1e3:7.1f} us")
        for v in variants[1:]:
            q = qs[v]
            ratios = " / ".join(f"{a / b:.3f}x" for a, b in zip(q, off, strict=True))
            print(f"    {v:<12} {ratios}  (goal <= 1.05x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--requests", type=int, default=8, help="chains stored per iteration")
    ap.add_argument("--chain", type=int, default=16, help="blocks per chain")
    ap.add_argument("--groups", type=int, default=1, help="layer groups (1 = full attention)")
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile one run and print the top")
    ap.add_argument("--step-rounds", type=int, default=7, help="rounds of the step section")
    ap.add_argument("--step-prefills", type=int, default=40, help="8k prompts per round")
    ap.add_argument("--step-decodes", type=int, default=160, help="decode steps per round")
    ap.add_argument("--step-only", action="store_true", help="only the cache-manager step")
    ap.add_argument(
        "--paired-rounds",
        type=int,
        default=9,
        help="rounds of the step's engine-thread CPU alone, paired per step (0: skip)",
    )
    args = ap.parse_args()
    if args.step_rounds:
        step_costs(args.step_rounds, args.step_prefills, 64, args.step_decodes)
    if args.paired_rounds:
        paired_step_cpu(args.paired_rounds, args.step_prefills, 64, args.step_decodes)
    if args.step_only:
        return

    wl = Workload(args.iterations, args.requests, args.chain, args.groups, args.tokens_per_block)
    capacity = 1 << 20

    if args.profile:
        em = wl.emitter(capacity)
        prof = cProfile.Profile()
        prof.runcall(wl.run, em)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)

    rows: dict[str, tuple[float, float]] = {}
    rows["baseline: append a tuple"] = best_ns(wl.baseline_append, args.repeats)
    rows["emitter, recording only (flush_iteration)"] = best_ns(
        lambda: wl.run(wl.emitter(capacity), do_take=False), args.repeats
    )
    rows["emitter, recording + take (flush)"] = best_ns(
        lambda: wl.run(wl.emitter(capacity)), args.repeats
    )
    rows["emitter, list[int] tokens, + take"] = best_ns(
        lambda: wl.run(wl.emitter(capacity), lists=True), args.repeats
    )
    rows["batched calls, recording + take (flush)"] = best_ns(
        lambda: wl.run_batched(wl.emitter(capacity)), args.repeats
    )
    engine: list[float] = []
    mat: list[float] = []
    for _ in range(args.repeats):
        em = wl.emitter(capacity)
        t0 = time.perf_counter_ns()
        n = wl.run_batched(em, deferred=True)
        t1 = time.perf_counter_ns()
        m = wl.materialize_deferred()
        engine.append((t1 - t0) / n)
        mat.append((time.perf_counter_ns() - t1) / m)
    rows["batched calls + flush_deferred (engine thread)"] = (
        min(engine),
        statistics.median(engine),
    )
    rows["  materialize() of those batches (pipeline)"] = (min(mat), statistics.median(mat))
    small = max(2, args.requests * args.chain // 4)
    rows[f"emitter, capacity {small} (overflowing), + take"] = best_ns(
        lambda: wl.run(wl.emitter(small)), args.repeats
    )

    calls = wl.iterations * wl.requests * wl.chain * wl.groups * 2 - (
        wl.requests * wl.chain * wl.groups
    )
    print(
        f"\nper recorded block ({calls} stored+removed calls, chains of {wl.chain}, "
        f"{wl.requests} chains/iteration, {wl.groups} group(s), best/median of {args.repeats})"
    )
    base = rows["baseline: append a tuple"][0]
    for name, (best, med) in rows.items():
        print(f"  {name:<48} {best:8.0f} ns  (median {med:6.0f})  x{best / base:6.1f}")

    nulls = null_costs(1_000_000, args.repeats)
    print("\nevents off, per call (best/median)")
    ref = nulls["empty method, stored() signature"][0]
    for name, (best, med) in nulls.items():
        print(f"  {name:<48} {best:8.1f} ns  (median {med:6.1f})  x{best / ref:6.2f}")


if __name__ == "__main__":
    main()

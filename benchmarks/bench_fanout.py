"""Fan-out overhead: what the pipeline costs per event per sink, against a bare queue.

An engine thread hands the same batches over (a) to a bare ``queue.SimpleQueue`` drained by
a consumer thread (the least any hand-off costs), and (b) to the pipeline with 1 and 3
memory sinks (each with its own queue and task), timed from the first hand-off until every
sink holds every batch (``flush``). Overhead per event per sink = (T_pipeline - T_bare) /
(events x sinks); target <= 2 us. The engine-side cost (time inside ``submit`` in the
engine thread) is shown separately.

Batches are real cache-manager iterations (a few events each) and, as a worst case, the
same events one per batch.

Usage: python benchmarks/bench_fanout.py [--events 100000] [--rounds 5] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import queue
import threading

from _pipeline_common import cache_batches, count_events, no_gc, now, table
from kvstream.sinks.memory import MemorySink

from kvstream.events.model import EventBatch
from kvstream.pipeline import Pipeline, PipelineConfig


def run_bare(batches: list[EventBatch]) -> tuple[float, float]:
    """(total seconds, engine-side seconds) for a SimpleQueue hand-off to a consumer thread."""
    q: queue.SimpleQueue[EventBatch | None] = queue.SimpleQueue()
    got: list[EventBatch] = []

    def consume() -> None:
        while (b := q.get()) is not None:
            got.append(b)

    t = threading.Thread(target=consume)
    t.start()
    t0 = now()
    put = q.put
    for b in batches:
        put(b)
    engine = now() - t0
    q.put(None)
    t.join()
    total = now() - t0
    assert len(got) == len(batches)
    return total, engine


async def _run_pipeline(batches: list[EventBatch], sinks: int) -> tuple[float, float]:
    mem = [MemorySink(max_batches=None, name=f"m{i}") for i in range(sinks)]
    cfg = PipelineConfig.load(
        defaults={
            "max_queue_batches": len(batches) + 1,
            "max_queue_events": count_events(batches) + 1,
            "linger_s": 0.001,
            "max_export_batches": 1024,
        }
    )
    pipe = await Pipeline(mem, cfg).start()
    engine = 0.0

    def feed() -> None:
        nonlocal engine
        submit = pipe.submit
        t = now()
        for b in batches:
            submit(b)
        engine = now() - t

    t0 = now()
    await asyncio.to_thread(feed)
    assert await pipe.flush(60)
    total = now() - t0
    await pipe.aclose()
    assert all(m.batches_in == len(batches) for m in mem)
    return total, engine


def run_pipeline(batches: list[EventBatch], sinks: int) -> tuple[float, float]:
    return asyncio.run(_run_pipeline(batches, sinks))


def measure(batches: list[EventBatch], rounds: int) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    with no_gc():
        for name, fn in (
            ("bare SimpleQueue", lambda: run_bare(batches)),
            ("pipeline, 1 sink", lambda: run_pipeline(batches, 1)),
            ("pipeline, 3 sinks", lambda: run_pipeline(batches, 3)),
        ):
            results = [fn() for _ in range(rounds)]
            best = min(results, key=lambda r: r[0])
            out[name] = best
    return out


def report(title: str, batches: list[EventBatch], rounds: int) -> float:
    n_ev = count_events(batches)
    res = measure(batches, rounds)
    bare = res["bare SimpleQueue"][0]
    rows = []
    worst = 0.0
    for name, (total, engine) in res.items():
        k = 3 if "3" in name else 1 if "1 sink" in name else 0
        over = (total - bare) / (n_ev * k) * 1e6 if k else 0.0
        worst = max(worst, over)
        rows.append(
            [
                name,
                f"{total * 1e3:.1f}",
                f"{n_ev / total / 1e3:.0f}k",
                f"{engine / len(batches) * 1e6:.2f}",
                f"{over:.2f}" if k else "-",
                f"{total / bare:.2f}x",
            ]
        )
    print(f"\n{title}: {len(batches)} batches, {n_ev} events ({n_ev / len(batches):.1f}/batch)")
    print(
        table(
            rows,
            ["hand-off", "ms", "events/s", "engine us/batch", "us/event/sink", "vs bare"],
        )
    )
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile the 3-sink pipeline")
    args = ap.parse_args()
    batches = cache_batches(args.events)
    singles = [b.model_copy(update={"events": (ev,)}) for b in batches for ev in b.events][
        : args.events
    ]
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run_pipeline(batches, 3)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        return
    w1 = report("cache iterations", batches, args.rounds)
    w2 = report("one event per batch (worst case)", singles, args.rounds)
    print(
        f"\nfan-out overhead per event per sink: {w1:.2f} us (real batches), "
        f"{w2:.2f} us (1-event batches); target <= 2 us"
    )


if __name__ == "__main__":
    main()

"""File sink throughput, and what handing a batch over costs the engine thread.

1. Throughput: the pipeline writing real cache-manager batches into the file sink (Avro
   container files; JSON Lines too), from the first hand-off until ``flush`` has fsynced,
   against a bare ``ContainerWriter`` writing the same batches in one thread (the codec and
   the disk, nothing else). Ratio = pipeline / bare.
2. Engine-side cost: each ``submit()`` call from the engine thread timed while the file sink
   drains concurrently (p50/p99/mean, microseconds), against ``queue.Queue.put`` and
   ``queue.SimpleQueue.put`` of the same batches.

Usage: python benchmarks/bench_file_sink.py [--events 100000] [--rounds 3] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import shutil
import statistics
import tempfile
import threading
from pathlib import Path

from _pipeline_common import cache_batches, count_events, no_gc, now, table
from kvstream.sinks.file import FileSink

from kvstream.codec import ContainerWriter
from kvstream.events.model import EventBatch
from kvstream.pipeline import Pipeline, PipelineConfig


def bare_writer(batches: list[EventBatch], directory: Path) -> tuple[float, int]:
    path = directory / "bare.avro"
    t0 = now()
    with open(path, "wb") as fo:
        w = ContainerWriter(fo, append=False)
        for b in batches:
            w.write(b)
        w.flush(fsync=True)
    dt = now() - t0
    size = path.stat().st_size
    path.unlink()
    return dt, size


def _config(batches: list[EventBatch]) -> PipelineConfig:
    return PipelineConfig.load(
        defaults={
            "max_queue_batches": len(batches) + 1,
            "max_queue_events": count_events(batches) + 1,
            "max_export_batches": 2048,
            "max_export_events": 1 << 20,
        }
    )


async def _pipeline(
    batches: list[EventBatch], directory: Path, fmt: str
) -> tuple[float, int, list[float]]:
    sink = FileSink(directory, format=fmt)  # type: ignore[arg-type]
    pipe = await Pipeline([sink], _config(batches)).start()
    calls: list[float] = []

    def engine() -> None:
        submit, clock, record = pipe.submit, now, calls.append
        for b in batches:
            t = clock()
            submit(b)
            record(clock() - t)

    t0 = now()
    await asyncio.to_thread(engine)
    assert await pipe.flush(120)  # delivered and fsynced
    dt = now() - t0
    await pipe.aclose()
    assert sink.stats.batches == len(batches)
    size = sum(p.stat().st_size for p in sink.paths)
    return dt, size, calls


def pipeline(
    batches: list[EventBatch], directory: Path, fmt: str
) -> tuple[float, int, list[float]]:
    d = directory / f"run-{fmt}"
    try:
        return asyncio.run(_pipeline(batches, d, fmt))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def bare_puts(
    batches: list[EventBatch], q: queue.Queue[EventBatch] | queue.SimpleQueue[EventBatch]
) -> list[float]:
    calls: list[float] = []

    def drain() -> None:
        for _ in batches:
            q.get()

    consumer = threading.Thread(target=drain)
    consumer.start()
    put, clock, record = q.put, now, calls.append
    for b in batches:
        t = clock()
        put(b)
        record(clock() - t)
    consumer.join()
    return calls


def stats_us(calls: list[float]) -> list[str]:
    s = sorted(calls)
    p = lambda q: s[min(len(s) - 1, int(q * len(s)))] * 1e6  # noqa: E731
    return [
        f"{p(0.5):.2f}",
        f"{p(0.99):.2f}",
        f"{statistics.fmean(s) * 1e6:.2f}",
        f"{s[-1] * 1e6:.0f}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    batches = cache_batches(args.events)
    n_ev = count_events(batches)
    base = Path(tempfile.mkdtemp(prefix="kvstream-bench-", dir=args.dir))
    try:
        with no_gc():
            bare = min((bare_writer(batches, base) for _ in range(args.rounds)), key=lambda r: r[0])
            avro = min(
                (pipeline(batches, base, "avro") for _ in range(args.rounds)), key=lambda r: r[0]
            )
            jsonl = min(
                (pipeline(batches, base, "jsonl") for _ in range(args.rounds)), key=lambda r: r[0]
            )
            q_calls = bare_puts(batches, queue.Queue())
            sq_calls = bare_puts(batches, queue.SimpleQueue())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"{len(batches)} batches, {n_ev} events ({n_ev / len(batches):.1f}/batch), "
        f"written under {base.parent}"
    )
    rows = []
    for name, (dt, size) in (
        ("bare ContainerWriter (1 thread)", bare),
        ("pipeline -> file sink (avro)", avro[:2]),
        ("pipeline -> file sink (jsonl)", jsonl[:2]),
    ):
        rows.append(
            [
                name,
                f"{dt * 1e3:.0f}",
                f"{n_ev / dt / 1e3:.0f}k",
                f"{size / dt / 1e6:.1f}",
                f"{size / n_ev:.0f}",
                f"{bare[0] / dt:.2f}x",
            ]
        )
    print("\nThroughput (until flush() returned: written and fsynced)")
    print(table(rows, ["writer", "ms", "events/s", "MB/s", "B/event", "vs bare"]))
    rows = [
        ["Pipeline.submit (file sink draining)", *stats_us(avro[2])],
        ["queue.Queue.put", *stats_us(q_calls)],
        ["queue.SimpleQueue.put", *stats_us(sq_calls)],
    ]
    print("\nEngine-side cost of handing one batch over (microseconds per call)")
    print(table(rows, ["hand-off", "p50", "p99", "mean", "max"]))
    mean_submit = statistics.fmean(avro[2])
    print(
        f"\nsubmit vs Queue.put: {mean_submit / statistics.fmean(q_calls):.2f}x mean; "
        f"file sink at {bare[0] / avro[0]:.2f}x the bare writer's throughput "
        f"(cpus: {os.cpu_count()})"
    )


if __name__ == "__main__":
    main()

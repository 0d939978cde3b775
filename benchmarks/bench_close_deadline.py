"""Close deadline benchmark: ``Pipeline.aclose(2.0)`` with a stuck sink and a full queue, while an
engine thread keeps calling ``submit()`` (bound 50 ms) every millisecond.

The queue is filled to the default bound (8192 batches) with ``--events`` events per batch
(120: about 1M events, the default ``max_queue_events``), the sink is paused, and close has to
drop and account for all of it. Prints, per round, the time ``aclose(2.0)`` took (the promise:
<= 2.5 s) and the worst ``submit()`` hand-off seen meanwhile (the promise: <= 50 ms).

    python benchmarks/bench_close_deadline.py --events 120 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

from kvstream.sinks.memory import MemorySink

from kvstream.events.model import EventBatch, KVCacheEvent, Removed, SourceId
from kvstream.pipeline import Pipeline, PipelineConfig


def _batch(src: SourceId, first: int, n: int) -> EventBatch:
    events = tuple(
        KVCacheEvent(
            event_id=i, window_size=128, data=Removed(block_hashes=(i.to_bytes(8, "big"),))
        )
        for i in range(first, first + n)
    )
    return EventBatch(source=src, ts_ns=first, events=events)


async def one_round(per_batch: int, batches: int) -> tuple[float, float]:
    sink = MemorySink()
    pipe = await Pipeline([sink], PipelineConfig.load(defaults={"linger_s": 0.0})).start()
    sink.pause()
    src = SourceId(instance_id="bench", attention_dp_rank=0)
    for i in range(batches):
        pipe.submit_nowait(_batch(src, i * per_batch, per_batch))
    worst = 0.0
    stop = threading.Event()

    def engine() -> None:
        nonlocal worst
        other = SourceId(instance_id="engine", attention_dp_rank=0)
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            pipe.submit(_batch(other, i, 1))
            worst = max(worst, time.perf_counter() - t0)
            i += 1
            time.sleep(0.001)

    thread = threading.Thread(target=engine)
    thread.start()
    t0 = time.monotonic()
    await pipe.aclose(timeout_s=2.0)
    took = time.monotonic() - t0
    stop.set()
    thread.join()
    return took, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=120, help="events per queued batch")
    ap.add_argument("--batches", type=int, default=8192, help="queued batches")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for r in range(args.rounds):
        took, worst = asyncio.run(one_round(args.events, args.batches))
        print(
            f"round {r}: {args.batches} x {args.events} events queued: aclose(2.0) took "
            f"{took:.2f}s (bound 2.5s), worst submit() {worst * 1000:.1f} ms (bound 50 ms)"
        )


if __name__ == "__main__":
    main()

"""The subscriber's item queue between its rank followers and its one reader: order, the
bound (a full queue makes the follower wait, nothing is dropped), timeouts, and a follower's
failure reaching a reader that waits."""

from __future__ import annotations

import asyncio

import pytest

from kvstream.engines.endpoint import parse_engine_url
from kvstream.engines.zmq_sub import EngineSubscriber, Frame, Gap, _ItemQueue


async def test_items_come_out_in_order_and_a_full_queue_makes_the_writer_wait() -> None:
    q = _ItemQueue(3)
    got: list[object] = []

    async def writer() -> None:
        for i in range(10):
            if q.full():
                await q.put(Frame(0, i, b""))
            else:
                q.put_nowait(Frame(0, i, b""))

    task = asyncio.create_task(writer())
    await asyncio.sleep(0)
    assert len(q) == 3
    assert not task.done()  # waits for room
    while len(got) < 10:
        item = await asyncio.wait_for(q.get(), 1)
        got.append(item)
    await task
    assert [f.seq for f in got] == list(range(10))  # type: ignore[attr-defined]
    assert q.get_nowait() is None


async def test_a_waiting_reader_is_woken_by_an_item_and_by_wake() -> None:
    q = _ItemQueue(8)
    reader = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    q.put_nowait(Gap(0, 1, 2, "x"))
    assert await reader == Gap(0, 1, 2, "x")
    reader = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    q.wake()
    assert await reader is None
    with pytest.raises(asyncio.TimeoutError):  # a cancelled wait leaves nothing behind
        await asyncio.wait_for(q.get(), 0.01)
    q.put_nowait(Gap(0, 3, 1, "y"))
    assert q.get_nowait() == Gap(0, 3, 1, "y")


async def test_a_failed_follower_reaches_the_reader_after_what_it_queued() -> None:
    sub = EngineSubscriber(parse_engine_url("vllm://127.0.0.1:1?instance=w"))
    sub._queue.put_nowait(Frame(0, 0, b"p"))

    async def follower() -> None:
        raise RuntimeError("socket gone")

    waiting = asyncio.create_task(sub.next(5))
    await asyncio.sleep(0)
    assert (await waiting) == Frame(0, 0, b"p")  # queued before the failure: delivered
    sub._watch_task(asyncio.create_task(follower()))
    with pytest.raises(RuntimeError, match="socket gone"):
        await sub.next(5)  # woken, not timed out
    with pytest.raises(RuntimeError, match="socket gone"):
        sub.next_ready()

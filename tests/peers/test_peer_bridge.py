"""``kvstream bridge`` between the real engines and the real consumers (issue 11, "Done when").

- vLLM 0.33's cache manager (its ``KVCacheManager``/``BlockPool`` and hasher, driven by
  ``scripts/peers/capture_vllm.py``'s scenario) publishes through vLLM's own
  ``ZmqEventPublisher`` on two DP ranks; ``kvstream bridge "vllm://...?dp_size=2" --sink file``,
  started after half the batches went out, must recover every batch (the rest through replay)
  with bit-exact hashes and tokens and no ``lost`` event.
- ``kvstream bridge DIR --sink "vllm://..."`` republishes those files; vLLM's own msgspec
  decoder reads every batch, carrying the same blocks.
- The same for SGLang 0.5.23 (its ``RadixCache``, C++ page hash and publisher) with
  ``sglang_sha256_64``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from kvstream.sinks.file import FileSink, read_dir

from kvstream.events.model import Cleared, EventBatch, Lost, Removed, Stored

pytestmark = pytest.mark.peers

KVSTREAM = [sys.executable, "-m", "kvstream.cli.main"]


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free ports")


def _u64(v: int | None) -> int | None:
    return None if v is None else v % 2**64


def _tokens(token_ids: list[Any]) -> list[int]:
    return [t[0] if isinstance(t, (list, tuple)) else t for t in token_ids]  # SGLang bigrams


def _engine_view(events: Iterable[Any]) -> list[tuple[Any, ...]]:
    """What a consumer must learn from engine events: stores (group, parent, hashes, tokens),
    removals per hash, clears — as unsigned ints, in order."""
    out: list[tuple[Any, ...]] = []
    for ev in events:
        name = type(ev).__name__
        group = getattr(ev, "group_idx", None) or 0
        if name == "BlockStored":
            hashes = [_u64(h) for h in ev.block_hashes]
            out.append(("stored", group, _u64(ev.parent_block_hash), hashes, _tokens(ev.token_ids)))
        elif name == "BlockRemoved":
            out.extend(("removed", group, _u64(h)) for h in ev.block_hashes)
        else:
            out.append(("cleared",))
    return out


def _kvstream_view(batches: Iterable[EventBatch]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    last_clear = None
    for b in batches:
        for e in b.events:
            d = e.data
            if isinstance(d, Stored):
                parent = None if d.parent_hash is None else int.from_bytes(d.parent_hash, "big")
                hashes = [int.from_bytes(x.block_hash, "big") for x in d.blocks]
                toks = [t for x in d.blocks for t in x.token_ids]
                out.append(("stored", e.layer_group_id, parent, hashes, toks))
            elif isinstance(d, Removed):
                out.extend(
                    ("removed", e.layer_group_id, int.from_bytes(h, "big")) for h in d.block_hashes
                )
            elif isinstance(d, Cleared):
                if last_clear != e.event_id - 1:  # one AllBlocksCleared = a cleared per group
                    out.append(("cleared",))
                last_clear = e.event_id
            assert not isinstance(d, Lost), d
    return out


def _bridge(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*KVSTREAM, "bridge", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_bridge_against(
    publish: Callable[[int, list[Any]], None],
    steps: list[list[Any]],
    url: str,
    out: Path,
    ranks: int,
) -> dict[str, Any]:
    half = len(steps) // 2
    for events in steps[:half]:
        for r in range(ranks):
            publish(r, events)
    time.sleep(0.5)  # the publisher threads send and buffer them
    proc = _bridge(url, "--sink", "file", "--out", str(out), "--idle-exit", "4", "--json")
    time.sleep(4.0)  # interpreter start, subscribe
    for events in steps[half:]:
        for r in range(ranks):
            publish(r, events)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    summary: dict[str, Any] = json.loads(stdout)
    return summary


def test_vllm_engine_to_files_and_back_to_vllms_decoder(
    vllm_kv: Any, vllm_publisher: Callable[..., Any], tmp_path: Path
) -> None:
    import capture_vllm
    import msgspec

    steps = [events for _, events in capture_vllm.run_scenario("sha256")]
    port, replay = _free_ports(2), _free_ports(2)
    pubs = [vllm_publisher(port, replay, dp_rank=r) for r in range(2)]

    def publish(rank: int, events: list[Any]) -> None:
        pubs[rank].publish(vllm_kv.KVEventBatch(ts=time.time(), events=events))

    out = tmp_path / "files"
    url = f"vllm://127.0.0.1:{port}?replay={replay}&dp_size=2&instance=vllm-0"
    summary = _run_bridge_against(publish, steps, url, out, ranks=2)
    assert summary["ok"]
    assert summary["lost_ids"] == 0
    batches = list(read_dir(out))
    want = _engine_view(ev for events in steps for ev in events)
    for rank in (0, 1):
        mine = [b for b in batches if b.source.attention_dp_rank == rank]
        assert {b.source.instance_id for b in mine} == {"vllm-0"}
        assert all(e.hash_algo == "vllm_sha256_64" for b in mine for e in b.events)
        ids = [e.event_id for b in mine for e in b.events]
        assert ids == list(range(len(ids)))
        assert _kvstream_view(mine) == want, f"rank {rank}"

    # kvstream files -> vLLM wire format -> vLLM's own decoder, batch by batch
    sub_port, sub_replay = _free_ports(1), _free_ports(1)
    sink = f"vllm://127.0.0.1:{sub_port}?replay={sub_replay}"
    rank0 = tmp_path / "rank0"
    rank0.mkdir()

    async def write_rank0() -> None:  # one vllm:// endpoint is one engine rank
        fs = FileSink(rank0)
        await fs.start()
        await fs.export([b for b in batches if b.source.attention_dp_rank == 0])
        await fs.shutdown(5)

    asyncio.run(write_rank0())
    # --follow keeps the bridge (and so the sink's replay buffer) up until it has been idle
    proc = _bridge(str(rank0), "--follow", "--sink", sink, "--idle-exit", "6", "--json")
    import zmq

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{sub_replay}")
    decoder = msgspec.msgpack.Decoder(vllm_kv.KVEventBatch)
    decoded: list[Any] = []
    time.sleep(4.0)  # the bridge has published everything by now and keeps its replay buffer
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    while True:
        assert dealer.poll(10_000), "no replay reply"
        reply = dealer.recv_multipart()
        _, _topic, seq, payload = reply
        if seq == b"\xff" * 8:
            break
        decoded.append(decoder.decode(payload))
    dealer.close(0)
    ctx.term()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert decoded, "nothing republished"
    assert _engine_view(ev for b in decoded for ev in b.events) == want


def test_sglang_engine_to_files(
    sglang_kv: Any, sglang_publisher: Callable[..., Any], tmp_path: Path
) -> None:
    import capture_sglang
    import peer_imports

    sg = peer_imports.load_sglang()
    steps = [
        events
        for _, events in capture_sglang.run_scenario(sg, page_size=4, dynamo=False, eagle=False)
    ]
    port, replay = _free_ports(1), _free_ports(1)
    pub = sglang_publisher(port, replay)

    def publish(rank: int, events: list[Any]) -> None:
        pub.publish(sglang_kv.KVEventBatch(ts=time.time(), events=events))

    out = tmp_path / "files"
    url = f"sglang://127.0.0.1:{port}?replay={replay}"
    summary = _run_bridge_against(publish, steps, url, out, ranks=1)
    assert summary["ok"]
    assert summary["lost_ids"] == 0
    batches = list(read_dir(out))
    assert all(e.hash_algo == "sglang_sha256_64" for b in batches for e in b.events)
    assert _kvstream_view(batches) == _engine_view(ev for events in steps for ev in events)

"""Peer test: what the vllm:// export sink publishes, read by vLLM 0.33's own decoder.

Each frame's payload must decode with ``msgspec.msgpack.Decoder(KVEventBatch)`` from
``vllm.distributed.kv_events`` into exactly the events a vLLM engine would have published for
the same cache activity, and be byte-identical to vLLM's own encoding of those events.
Skipped without vLLM (``scripts/test-peers`` runs it in a venv that has it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from kvstream.sinks.vllm import VllmSink
from zmq_clients import END_SEQ, Client, free_ports, recv, replay, subscribe

from kvstream.events.model import (
    UNBOUNDED_WINDOW,
    AttentionKind,
    Cleared,
    Created,
    EventBatch,
    EventData,
    EventDiff,
    KVCacheEvent,
    Lost,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
    Updated,
)

kv = pytest.importorskip("vllm.distributed.kv_events")

pytestmark = pytest.mark.peers

TS_NS = 1_700_000_000_123_456_789
TS = TS_NS / 1e9


def h8(n: int) -> bytes:
    return n.to_bytes(8, "big")


def ev(data: EventData, group: int = 0, window: int = 8192, algo: str = "v2_sha256_64") -> Any:
    return KVCacheEvent(
        event_id=0, hash_algo=algo, layer_group_id=group, window_size=window, data=data
    )


def batch(*events: KVCacheEvent, rank: int = 0, incarnation: int = 0) -> EventBatch:
    return EventBatch(
        source=SourceId(instance_id="trt-0", attention_dp_rank=rank, incarnation=incarnation),
        ts_ns=TS_NS,
        events=events,
    )


def vllm_batch(events: list[Any], rank: int) -> Any:
    return kv.KVEventBatch(ts=TS, events=events, data_parallel_rank=rank)


def stored(
    hashes: list[int | bytes],
    parent: int | bytes | None,
    tokens: list[int],
    *,
    block_size: int = 4,
    medium: str | None = "GPU",
    group_idx: int = 0,
    **kw: Any,
) -> Any:
    """vLLM's own ``BlockStored`` (LoRA fields default to nil, as the engine leaves them;
    ``extra_keys`` one None per block, as vLLM 0.33's cache manager sends it: the golden
    captures in ``tests/data/golden`` have it so, and kvstream's export writes it so)."""
    kw.setdefault("extra_keys", [None] * len(hashes))
    return kv.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=kw.pop("lora_id", None),
        medium=medium,
        lora_name=kw.pop("lora_name", None),
        group_idx=group_idx,
        **kw,
    )


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    c = Client()
    yield c
    c.close()


async def started(url: str) -> VllmSink:
    from kvstream.sink import parse_sink_url

    sink = VllmSink.from_url(parse_sink_url(url))
    await sink.start()
    return sink


async def test_vllm_decodes_every_kind_as_its_own_engine_would_publish_it(client: Client) -> None:
    port = free_ports(4)
    sink = await started(f"vllm://127.0.0.1:{port}?replay={port + 2}&dp_size=2")
    try:
        sub0 = await subscribe(client, sink.endpoint(0))
        sub1 = await subscribe(client, sink.endpoint(1))
        sliding = Created(
            num_blocks_per_cache_level=(64, 128),
            tokens_per_block=4,
            attention_kind=AttentionKind.SLIDING_WINDOW,
        )
        full = Created(num_blocks_per_cache_level=(64, 128), tokens_per_block=4)
        to_host = EventDiff(old_value=0, new_value=1)
        kvstream_batches = [
            batch(ev(full), ev(sliding, group=1, window=128)),
            batch(
                ev(
                    Stored(
                        blocks=(
                            StoredBlock(block_hash=h8(1), token_ids=[1, 2, 3, 4]),
                            StoredBlock(
                                block_hash=h8(2**64 - 2),
                                token_ids=[5, 6, 7, 8],
                                lora_id=7,
                                lora_name="ad",
                                extra_keys=("ad", ("img", 2)),
                            ),
                        )
                    )
                ),
                ev(
                    Stored(blocks=(StoredBlock(block_hash=h8(3), token_ids=[1, 2, 3, 4]),)),
                    group=1,
                    window=128,
                ),
            ),
            batch(
                ev(Updated(block_hash=h8(1), cache_level=to_host)),
                ev(Removed(block_hashes=(h8(2**64 - 2),), cache_level=0)),
                ev(Updated(block_hash=h8(1), priority=EventDiff(old_value=35, new_value=90))),
            ),
            batch(
                ev(Stored(blocks=(StoredBlock(block_hash=h8(10), token_ids=[9, 9]),))),
                rank=1,
            ),
            batch(ev(Cleared(), group=1, window=128), ev(Lost(first_event_id=9, count=3))),
            batch(
                ev(Stored(blocks=(StoredBlock(block_hash=h8(20), token_ids=[4, 3, 2, 1]),))),
                incarnation=1,
            ),
        ]
        expected_rank0 = [
            (
                0,
                [
                    stored([1], None, [1, 2, 3, 4], kv_cache_spec_kind="full_attention"),
                    stored(
                        [2**64 - 2],
                        1,
                        [5, 6, 7, 8],
                        lora_id=7,
                        lora_name="ad",
                        extra_keys=[("ad", ("img", 2))],
                        kv_cache_spec_kind="full_attention",
                    ),
                    stored(
                        [3],
                        None,
                        [1, 2, 3, 4],
                        group_idx=1,
                        kv_cache_spec_kind="sliding_window",
                        kv_cache_spec_sliding_window=128,
                    ),
                ],
            ),
            (
                1,
                [
                    stored(
                        [1], None, [1, 2, 3, 4], medium="CPU", kv_cache_spec_kind="full_attention"
                    ),
                    kv.BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0),
                    kv.BlockRemoved(block_hashes=[2**64 - 2], medium="GPU", group_idx=0),
                ],
            ),
            (2, [kv.AllBlocksCleared()]),
            # a new incarnation: seq starts again at 0, the old process's blocks are cleared
            (
                0,
                [
                    kv.AllBlocksCleared(),
                    # the new process has not announced its groups (no created): no kind
                    stored([20], None, [4, 3, 2, 1]),
                ],
            ),
        ]
        expected_rank1 = [(0, [stored([10], None, [9, 9], block_size=2)])]

        assert (await sink.export(kvstream_batches)).ok

        decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
        encoder = msgspec.msgpack.Encoder()
        for sub, rank, expected in ((sub0, 0, expected_rank0), (sub1, 1, expected_rank1)):
            for seq, events in expected:
                topic, seq_bytes, payload = await recv(sub)
                assert (topic, int.from_bytes(seq_bytes, "big")) == (b"", seq)
                want = encoder.encode(vllm_batch(events, rank))
                assert payload == want  # byte-identical to vLLM's own encoding
                got = decoder.decode(payload)
                # vLLM's decoder reads nested extra-key tuples back as lists: compare decoded
                assert got == decoder.decode(want)
                assert (got.ts, got.data_parallel_rank) == (TS, rank)
                assert [type(e).__name__ for e in got.events] == [type(e).__name__ for e in events]
            assert await sub.poll(200) == 0

        # replay after the restart holds the new incarnation only, decoded by vLLM too
        replies = await replay(client, str(sink.replay_endpoint(0)), 0, delimiter=True)
        assert [r[3] for r in replies[:-1]] == [
            encoder.encode(vllm_batch(expected_rank0[-1][1], 0))
        ]
        assert decoder.decode(replies[0][3]) == vllm_batch(expected_rank0[-1][1], 0)
        assert replies[-1] == [b"", b"", END_SEQ, b""]
    finally:
        await sink.shutdown(1.0)


@pytest.mark.parametrize("fmt", ["int", "bytes"])
async def test_vllm_decodes_256_bit_hashes(fmt: str, client: Client) -> None:
    port = free_ports(2)
    sink = await started(f"vllm://127.0.0.1:{port}?replay={port + 1}&hash_format={fmt}")
    d1, d2, parent = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    try:
        assert (
            await sink.export(
                [
                    batch(
                        ev(
                            Stored(
                                parent_hash=parent,
                                blocks=(
                                    StoredBlock(block_hash=d1, token_ids=[1, 2]),
                                    StoredBlock(block_hash=d2, token_ids=[3, 4]),
                                ),
                            ),
                            algo="v2_sha256",
                            window=UNBOUNDED_WINDOW,
                        ),
                        ev(Removed(block_hashes=(d1,)), algo="v2_sha256", window=UNBOUNDED_WINDOW),
                    )
                ]
            )
        ).ok
        [reply, _end] = await replay(client, str(sink.replay_endpoint(0)), 0)
        got = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(reply[2])

        def wire(h: bytes) -> int | bytes:
            return h if fmt == "bytes" else int.from_bytes(h[-8:], "big")

        assert got == vllm_batch(
            [
                stored(
                    [wire(d1), wire(d2)],
                    wire(parent),
                    [1, 2, 3, 4],
                    block_size=2,
                    kv_cache_spec_kind="full_attention",
                ),
                kv.BlockRemoved(block_hashes=[wire(d1)], medium="GPU", group_idx=0),
            ],
            0,
        )
    finally:
        await sink.shutdown(1.0)

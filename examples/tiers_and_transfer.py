"""Cache tiers and disaggregated KV transfer, end to end.

1. A "prefill" manager with a small GPU pool, a host tier and a disk store: blocks evicted
   from the GPU move to the host, then to disk, and come back on a prefix hit; every move
   is an ``updated`` event.
2. A second manager opening the same disk directory (as another process would) reuses the
   first one's blocks, bit-identical.
3. The prefill manager hands a request's K/V to a "decode" manager, which receives only the
   blocks it does not already hold.

Run: ``python examples/tiers_and_transfer.py``
"""

from __future__ import annotations

import tempfile
from collections import Counter

import torch

from kvstream.cache import (
    CacheConfig,
    DiskTierConfig,
    HostTierConfig,
    KVCacheManager,
    LayerGroupSpec,
    transfer_request,
)

TPB = 16
LAYERS, HEADS, HEAD_DIM = 4, 4, 64


def config(store: str, gpu_blocks: int, *, write_through: bool = False) -> CacheConfig:
    return CacheConfig(
        tokens_per_block=TPB,
        groups=[LayerGroupSpec(LAYERS, HEADS, HEAD_DIM, num_blocks=gpu_blocks)],
        hash_algo="v2_sha256_64",
        host_tier=HostTierConfig(blocks=[4]),
        disk_tier=DiskTierConfig(
            store, capacity_bytes=64 << 20, model_id="example-model", write_through=write_through
        ),
    )


def fake_forward(mgr: KVCacheManager, rid: str, tokens: list[int], start: int) -> None:
    """Write K/V for positions [start, len(tokens)): deterministic per position and layer,
    so managers computing the same tokens hold the same K/V (as with a real model)."""
    pos = torch.arange(start, len(tokens), dtype=torch.float32)
    tok = torch.tensor(tokens[start:], dtype=torch.float32)
    for layer in range(LAYERS):
        k = (tok * 1e-3 + pos * 1e-2 + layer)[:, None, None].expand(-1, HEADS, HEAD_DIM)
        mgr.write_kv(rid, layer, k.contiguous(), -k.contiguous(), start=start)


def summarize(mgr: KVCacheManager) -> str:
    batch = mgr.flush_events()
    kinds: Counter[str] = Counter()
    for e in [] if batch is None else batch.events:
        d = e.data
        if d.type == "updated" and d.cache_level is not None:
            kinds[f"updated {d.cache_level.old_value}->{d.cache_level.new_value}"] += 1
        else:
            kinds[d.type] += 1
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))


def main() -> None:
    store = tempfile.mkdtemp(prefix="kvstream-store-")
    prompt = list(range(1, 6 * TPB + 2))  # 6 full blocks + 1 token
    with KVCacheManager(config(store, gpu_blocks=8, write_through=True)) as prefill:
        m = prefill.add_request("chat-1", prompt)
        fake_forward(prefill, "chat-1", prompt, m.reusable_tokens)
        written = prefill.persist()  # write-through: share the new blocks on disk now
        print(f"prefill chat-1: {summarize(prefill)}; {written} blocks written to the store")
        prefill.free_request("chat-1")
        other = list(range(1000, 1000 + 7 * TPB + 1))  # pushes chat-1's blocks down
        prefill.add_request("other", other)
        prefill.free_request("other")
        print("evictions:    ", summarize(prefill))
        m = prefill.add_request("chat-1b", prompt)
        print(
            f"prefix hit:    {m.reusable_tokens} tokens reused, "
            f"{m.groups[0].onboarded_blocks} blocks onboarded: {summarize(prefill)}"
        )
        k1, _ = prefill.read_kv("chat-1b", 0, end=m.reusable_tokens)
        fake_forward(prefill, "chat-1b", prompt, m.reusable_tokens)

        with KVCacheManager(config(store, gpu_blocks=16)) as second:
            m2 = second.match_prefix(prompt)
            print(f"second manager, same directory: {m2.reusable_tokens} tokens reusable")

        decode = KVCacheManager(config(tempfile.mkdtemp(), gpu_blocks=16))
        warm = prompt[: 3 * TPB + 1]
        decode.add_request("warm", warm)
        fake_forward(decode, "warm", warm, 0)
        decode.free_request("warm")
        decode.flush_events()
        result = transfer_request(prefill, decode, "chat-1b")
        print(
            f"transfer: decode received {result.received_blocks[0]} of 7 blocks "
            f"({result.received_bytes / 1024:.0f} KiB); events: {summarize(decode)}"
        )
        k2, _ = decode.read_kv("chat-1b", 0, end=m.reusable_tokens)
        same = torch.equal(k1, k2)
        print("decode K/V equals prefill's:", same)
        assert same
        decode.close()


if __name__ == "__main__":
    main()

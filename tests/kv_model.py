"""A deterministic stand-in for a model's forward pass, for tier and transfer tests.

The K/V of position ``p`` of layer ``L`` depends only on the tokens ``[0, p]`` and ``L`` (as a
real model's would), through a rolling hash reduced to small integers that float16 holds
exactly, so two managers that compute the same prefix hold bit-identical K/V.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstream.cache import KVCacheManager


def expected_kv(  # noqa: PLR0917
    tokens: Sequence[int],
    layer: int,
    heads: int,
    head_dim: int,
    start: int = 0,
    end: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (``[end - start, heads, head_dim]``, float32) of positions ``[start, end)``."""
    stop = len(tokens) if end is None else end
    h = 0
    vals: list[int] = []
    for t in tokens[:stop]:
        h = (h * 1_000_003 + int(t) + 1) % 2_147_483_647
        vals.append(h % 509)
    base = torch.tensor(vals[start:stop], dtype=torch.float32).reshape(-1, 1, 1)
    grid = torch.arange(heads * head_dim, dtype=torch.float32).reshape(1, heads, head_dim)
    k = base + grid + layer
    return k, -(k + 1)


def prefill(mgr: KVCacheManager, request_id: str, tokens: Sequence[int], **kw: object) -> int:
    """Add a request and compute what each group does not reuse; returns the minimum
    reuse boundary."""
    match = mgr.add_request(request_id, tokens, **kw)  # type: ignore[arg-type]
    for layer in range(mgr.config.num_layers):
        gid, _ = mgr.layer_location(layer)
        spec = mgr.config.groups[gid]
        lo = match.groups[gid].matched_tokens
        k, v = expected_kv(tokens, layer, spec.num_kv_heads, spec.head_dim, lo)
        mgr.write_kv(request_id, layer, k, v, start=lo)
    return match.reusable_tokens


def assert_kv(mgr: KVCacheManager, request_id: str, tokens: Sequence[int]) -> None:
    """Every layer's K/V of the request (what each group still holds) equals the model's."""
    tpb = mgr.config.tokens_per_block
    for layer in range(mgr.config.num_layers):
        gid, _ = mgr.layer_location(layer)
        spec = mgr.config.groups[gid]
        lo = mgr.block_ids(request_id, gid).count(None) * tpb
        k, v = mgr.read_kv(request_id, layer, start=lo, end=len(tokens))
        ek, ev = expected_kv(tokens, layer, spec.num_kv_heads, spec.head_dim, lo)
        dtype = k.dtype
        assert torch.equal(k.cpu(), ek.to(dtype)), f"layer {layer}: K differs"
        assert torch.equal(v.cpu(), ev.to(dtype)), f"layer {layer}: V differs"

"""K/V storage: one torch tensor per layer group, on the configured device.

Layout of group ``g``'s tensor: ``[num_blocks, num_layers, 2 (K, V), tokens_per_block,
num_kv_heads, head_dim]``, so one block of one layer is contiguous and a block's whole K/V
(every layer) is one contiguous slice (what tier moves and transfers copy).

torch is imported here, lazily, and only by the cache package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstream.cache.block_file import byte_view
from kvstream.cache.config import CacheConfig
from kvstream.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["KVStorage", "copy_blocks", "resolve_device", "tensor_bytes"]


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> ``cuda`` when available else ``cpu``; otherwise ``torch.device(name)``.

    ConfigError for an unparsable name or a CUDA device that is not available.
    """
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"device: {name!r} is not a torch device ({exc})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {name!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device: {name!r} requested but only {torch.cuda.device_count()} CUDA "
                "device(s) exist"
            )
    return dev


class KVStorage:
    """The K/V tensors of every layer group of ``config``, allocated zeroed on ``device``.

    ``num_blocks`` overrides the block count of each group (the host tier uses this class
    too); ``pin_memory`` allocates page-locked CPU memory (needs CUDA).
    """

    def __init__(
        self,
        config: CacheConfig,
        device: torch.device,
        *,
        num_blocks: Sequence[int] | None = None,
        pin_memory: bool = False,
    ) -> None:
        import torch

        self.device = device
        self.tokens_per_block = config.tokens_per_block
        self.tensors: list[torch.Tensor] = []
        counts = [g.num_blocks for g in config.groups] if num_blocks is None else num_blocks
        for i, (spec, count) in enumerate(zip(config.groups, counts, strict=True)):
            shape = (
                count,
                spec.num_layers,
                2,
                config.tokens_per_block,
                spec.num_kv_heads,
                spec.head_dim,
            )
            try:
                t = torch.zeros(
                    shape, dtype=getattr(torch, spec.dtype), device=device, pin_memory=pin_memory
                )
            except (RuntimeError, MemoryError) as exc:
                need = spec.block_bytes(config.tokens_per_block) * count
                pinned = " pinned" if pin_memory else ""
                raise ConfigError(
                    f"groups[{i}]: cannot allocate {need} bytes of{pinned} K/V on {device}: {exc}"
                ) from None
            self.tensors.append(t)

    def block_buffer(self, group: int, block_id: int) -> memoryview:
        """The bytes of one block of a CPU tensor, writable and without a copy (what the disk
        store reads and writes)."""
        return tensor_bytes(self.tensors[group][block_id])

    def _index(
        self, block_ids: Sequence[int], offset: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # (physical block, slot) of each of n positions starting at slot `offset` of
        # block_ids[0].
        import torch

        tpb = self.tokens_per_block
        pos = torch.arange(offset, offset + n, device=self.device)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return ids[pos // tpb], pos % tpb

    def write(
        self,
        group: int,
        block_ids: Sequence[int],
        *,
        layer: int,
        offset: int,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store ``k``/``v`` (``[n, heads, head_dim]``) for ``n`` consecutive positions that
        start at slot ``offset`` of ``block_ids[0]`` and run through ``block_ids``."""
        t = self.tensors[group]
        k = k.to(device=self.device, dtype=t.dtype)
        v = v.to(device=self.device, dtype=t.dtype)
        if len(block_ids) == 1:  # one block (every decode step): plain slices, no index tensors
            end = offset + k.shape[0]
            t[block_ids[0], layer, 0, offset:end] = k
            t[block_ids[0], layer, 1, offset:end] = v
            return
        blk, slot = self._index(block_ids, offset, k.shape[0])
        t[blk, layer, 0, slot] = k
        t[blk, layer, 1, slot] = v

    def read(
        self, group: int, block_ids: Sequence[int], *, layer: int, offset: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V (``[n, heads, head_dim]``) of ``n`` positions laid out as for
        :meth:`write`."""
        t = self.tensors[group]
        if len(block_ids) == 1:
            kv = t[block_ids[0], layer, :, offset : offset + n]
            return kv[0].clone(), kv[1].clone()
        blk, slot = self._index(block_ids, offset, n)
        return t[blk, layer, 0, slot], t[blk, layer, 1, slot]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview, without a copy."""
    import torch

    return byte_view(t.reshape(-1).view(torch.uint8).numpy())


def copy_blocks(
    dst: torch.Tensor,
    dst_ids: Sequence[int],
    src: torch.Tensor,
    src_ids: Sequence[int],
    *,
    non_blocking: bool = False,
) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every ``i``, across devices.

    Every run of ids consecutive on both sides (both ascending or both descending) is one
    slice copy, so contiguous blocks move at the bandwidth of one large copy and nothing is
    staged. ``non_blocking`` makes
    copies between pinned CPU memory and CUDA asynchronous (callers synchronise the stream
    before the CPU reads what was copied to it).
    """
    n = len(dst_ids)
    if n != len(src_ids):
        raise ValueError(f"copy_blocks: {n} destination ids for {len(src_ids)} sources")
    i = 0
    while i < n:
        j = i + 1
        step = 0
        if j < n and dst_ids[j] - dst_ids[i] in (1, -1):
            step = dst_ids[j] - dst_ids[i]
        while j < n and step and dst_ids[j] == dst_ids[j - 1] + step:
            if src_ids[j] != src_ids[j - 1] + step:
                break
            j += 1
        d, s = (dst_ids[i], src_ids[i]) if step >= 0 else (dst_ids[j - 1], src_ids[j - 1])
        dst[d : d + j - i].copy_(src[s : s + j - i], non_blocking=non_blocking)
        i = j

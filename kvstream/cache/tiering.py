"""Moves between a manager's tiers: GPU pool -> host tier -> disk store, and back on a hit.

:class:`Tiers` is what a :class:`~kvstream.cache.manager.KVCacheManager` with a host and/or
disk tier delegates to. Each layer group has its own host tier and its own namespace in the
(shared) disk store. A block lives, as far as this manager's events say, at exactly one
level: the fastest one holding it (``cache_level`` 0 GPU, 1 host, 2 disk).

- **Offload** (:meth:`Tiers.evict`, called by a pool instead of dropping a block): GPU -> host
  (``updated`` 0->1); a full host tier first demotes its least recently offloaded block to
  disk (``updated`` 1->2) or drops it (``removed`` at level 1); without host room the GPU
  block goes straight to disk (0->2) or is dropped (``removed`` at level 0). A block the disk
  store evicts to make room is ``removed`` at level 2.
- **Onboard** (:meth:`Tiers.stage` then :meth:`Tiers.onboard`): a prefix hit on host or disk
  copies the block into a fresh GPU block (``updated`` level->0). A block found on disk that
  this manager never announced (another process wrote it) is announced by the manager with a
  ``stored`` event instead.
- **Write-through** (:meth:`Tiers.persist`): blocks committed on the GPU are also written to
  disk, so other processes can reuse them while this one still holds them; their level stays 0.

Disk files are checked on every load (checksum, size, the block and namespace named in the
header); a bad file is a miss: removed, counted, never loaded. Write failures (a full disk)
are logged and counted, and the block is dropped as if there were no disk tier.

Copies between CUDA and pinned host memory are asynchronous; the CPU touches host memory
only after synchronising the stream (:meth:`Tiers._sync`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from kvstream.cache.block import Block
from kvstream.cache.block_file import HEADER_SIZE
from kvstream.cache.config import CacheConfig
from kvstream.cache.disk_store import DiskStore
from kvstream.cache.errors import CacheInvariantError, StoreError
from kvstream.cache.host_tier import HostTier
from kvstream.cache.storage import KVStorage, copy_blocks, tensor_bytes
from kvstream.cache.tier_config import available_host_memory, size_host_tier
from kvstream.events.emitter import EventRecorder

if TYPE_CHECKING:
    import torch

__all__ = ["GPU", "HOST", "DISK", "TierStats", "Tiers", "group_namespace"]

GPU, HOST, DISK = 0, 1, 2
_log = logging.getLogger("kvstream.cache.tiering")
NAMESPACE_FORMAT = 1


def group_namespace(config: CacheConfig, layer_group_id: int, model_id: str) -> bytes:
    """The 16-byte disk namespace of a layer group: a digest of the model, the layout
    fingerprint (block size, hash configuration, every group's shape) and the group."""
    text = f"{NAMESPACE_FORMAT}\0{model_id}\0{config.layout_fingerprint()}\0{layer_group_id}"
    return hashlib.sha256(text.encode()).digest()[:16]


@dataclass(frozen=True, slots=True)
class TierStats:
    """One layer group's tier counters (monotonic) and gauges.

    Gauges: ``host_blocks`` (capacity), ``host_cached_blocks`` (resident),
    ``disk_cached_blocks`` (blocks this manager announced at level 2). Counters:
    ``offloaded_to_host``, ``offloaded_to_disk`` (from GPU or host), ``onboarded_from_host``,
    ``onboarded_from_disk``, ``dropped`` (fell off the last tier), ``disk_misses`` (a block
    expected on disk was gone or corrupt), ``disk_write_errors``, ``persisted`` (write-through).
    """

    layer_group_id: int
    host_blocks: int
    host_cached_blocks: int
    disk_cached_blocks: int
    offloaded_to_host: int
    offloaded_to_disk: int
    onboarded_from_host: int
    onboarded_from_disk: int
    dropped: int
    disk_misses: int
    disk_write_errors: int
    persisted: int


class _Group:
    __slots__ = (
        "disk_known",
        "disk_misses",
        "disk_write_errors",
        "dropped",
        "gid",
        "host",
        "namespace",
        "onboarded_disk",
        "onboarded_host",
        "persisted",
        "to_disk",
        "to_host",
    )

    def __init__(self, gid: int, host: HostTier | None, namespace: bytes) -> None:
        self.gid = gid
        self.host = host
        self.namespace = namespace
        #: Blocks this manager announced at level 2 (the store may have lost them since).
        self.disk_known: set[bytes] = set()
        self.to_host = self.to_disk = self.onboarded_host = self.onboarded_disk = 0
        self.dropped = self.disk_misses = self.disk_write_errors = self.persisted = 0


class Tiers:
    """The host tiers and disk store of one manager (see the module docstring).

    ``gpu`` is the manager's GPU storage (None when metadata-only: moves are bookkeeping).
    ``host_blocks`` gives each group's host capacity; ``disk`` the store (owned: closed by
    :meth:`close`); ``namespaces`` each group's disk namespace.
    """

    def __init__(
        self,
        config: CacheConfig,
        recorder: EventRecorder,
        *,
        gpu: KVStorage | None,
        host_blocks: Sequence[int],
        disk: DiskStore | None,
        namespaces: Sequence[bytes],
        pinned: bool,
    ) -> None:
        self._recorder = recorder
        self._gpu = gpu
        self._disk = disk
        self._cuda = gpu is not None and gpu.device.type == "cuda"
        self._groups = [
            _Group(gid, HostTier(n) if n else None, ns)
            for gid, (n, ns) in enumerate(zip(host_blocks, namespaces, strict=True))
        ]
        self._host: KVStorage | None = None
        if gpu is not None and any(host_blocks):
            import torch

            self._host = KVStorage(
                config, torch.device("cpu"), num_blocks=host_blocks, pin_memory=pinned
            )
        self._pinned = pinned
        self._file_bytes = [
            HEADER_SIZE + g.block_bytes(config.tokens_per_block) for g in config.groups
        ]
        self._staging: list[list[torch.Tensor]] = [[] for _ in config.groups]
        self._async_pending = False
        self._persist_queue: list[tuple[int, Block, bytes]] = []
        self.write_through = False

    # ------------------------------------------------------------------ queries

    @property
    def disk(self) -> DiskStore | None:
        """The disk store, or None."""
        return self._disk

    def levels(self, layer_group_id: int, gpu_blocks: int) -> list[int]:
        """``num_blocks_per_cache_level`` of a group for its ``created`` event: GPU, host and
        (with a disk tier) how many of the group's blocks the store's capacity holds."""
        g = self._groups[layer_group_id]
        out = [gpu_blocks, 0 if g.host is None else g.host.capacity]
        if self._disk is not None:
            out.append(self._disk.capacity_bytes // self._file_bytes[layer_group_id])
        return out

    def level_of(self, layer_group_id: int, block_hash: bytes) -> int:
        """Where below the GPU a block is: HOST, DISK, or 0 when no lower tier holds it.

        A disk block counts when this manager put it there or the store has its file (another
        process may have written it); the file is only read by :meth:`stage`."""
        g = self._groups[layer_group_id]
        if g.host is not None and block_hash in g.host:
            return HOST
        disk = self._disk
        if disk is not None and (
            block_hash in g.disk_known or disk.contains(g.namespace, block_hash)
        ):
            return DISK
        return 0

    def stats(self, layer_group_id: int) -> TierStats:
        """A snapshot of one group's tier counters."""
        g = self._groups[layer_group_id]
        return TierStats(
            layer_group_id=g.gid,
            host_blocks=0 if g.host is None else g.host.capacity,
            host_cached_blocks=0 if g.host is None else len(g.host),
            disk_cached_blocks=len(g.disk_known),
            offloaded_to_host=g.to_host,
            offloaded_to_disk=g.to_disk,
            onboarded_from_host=g.onboarded_host,
            onboarded_from_disk=g.onboarded_disk,
            dropped=g.dropped,
            disk_misses=g.disk_misses,
            disk_write_errors=g.disk_write_errors,
            persisted=g.persisted,
        )

    def host_hashes(self, layer_group_id: int) -> list[bytes]:
        """Hashes resident in a group's host tier, least recently offloaded first."""
        host = self._groups[layer_group_id].host
        return [] if host is None else host.hashes()

    def disk_hashes(self, layer_group_id: int) -> set[bytes]:
        """Hashes this manager announced at the disk level."""
        return set(self._groups[layer_group_id].disk_known)

    # ------------------------------------------------------------------ offload

    def evict(self, layer_group_id: int, blocks: list[Block], hashes: list[bytes]) -> None:
        """GPU blocks leave the pool (their ids are about to be reused): move each down a
        tier, in order, recording the moves."""
        g = self._groups[layer_group_id]
        host = g.host
        rec = self._recorder
        pairs_dst: list[int] = []
        pairs_src: list[int] = []
        for b, h in zip(blocks, hashes, strict=True):
            if host is not None:
                if not host.num_free and len(host):
                    if pairs_dst:  # the slot demoted next may be one of these: copy first
                        self._copy_to_host(g.gid, pairs_dst, pairs_src)
                        pairs_dst, pairs_src = [], []
                    self._demote_lru(g)
                if host.num_free:
                    pairs_dst.append(host.add(h))
                    pairs_src.append(b.block_id)
                    g.to_host += 1
                    rec.updated(g.gid, h, cache_level=(GPU, HOST))
                    continue
            # No host room (no tier, or every slot is being onboarded): straight to disk.
            if self._disk is not None and self._write(g, h, partial(self._gpu_buffer, g, b)):
                rec.updated(g.gid, h, cache_level=(GPU, DISK))
            else:
                g.dropped += 1
                rec.removed(g.gid, h, cache_level=GPU)
        if pairs_dst:
            self._copy_to_host(g.gid, pairs_dst, pairs_src)

    def _demote_lru(self, g: _Group) -> None:
        assert g.host is not None
        popped = g.host.pop_lru()
        if popped is None:
            return
        h, slot = popped
        host = self._host
        if (
            self._disk is not None
            and host is not None
            and self._write(g, h, partial(self._host_buffer, host, g.gid, slot))
        ):
            self._recorder.updated(g.gid, h, cache_level=(HOST, DISK))
        else:
            g.dropped += 1
            self._recorder.removed(g.gid, h, cache_level=HOST)
        g.host.release(slot)

    def _write(self, g: _Group, h: bytes, buffer: Callable[[], memoryview]) -> bool:
        # Put one block on disk (unless its file exists); True when the disk now holds it.
        disk = self._disk
        assert disk is not None
        try:
            if not disk.contains(g.namespace, h):
                disk.put(g.namespace, h, buffer())
        except StoreError as exc:
            g.disk_write_errors += 1
            _log.warning("disk tier: block %s of group %d not written: %s", h.hex(), g.gid, exc)
            self._note_disk_evictions()
            return False
        self._note_disk_evictions()
        g.disk_known.add(h)
        g.to_disk += 1
        return True

    def _note_disk_evictions(self) -> None:
        # Files the store deleted to make room: blocks announced at level 2 leave the cache.
        disk = self._disk
        assert disk is not None
        evicted = disk.take_evicted()
        if not evicted:
            return
        by_ns = {g.namespace: g for g in self._groups}
        for ns, h in evicted:
            g = by_ns.get(ns)
            if g is not None and h in g.disk_known:
                g.disk_known.discard(h)
                g.dropped += 1
                self._recorder.removed(g.gid, h, cache_level=DISK)

    # ------------------------------------------------------------------ onboard

    def stage(self, layer_group_id: int, block_hash: bytes) -> torch.Tensor | bool | None:
        """Read a disk block ahead of onboarding it.

        Returns the block's K/V in a staging tensor (True when metadata-only and the file
        exists), or None when the file is missing or bad; then the block is forgotten at the
        disk level (``removed`` if this manager had announced it there) and counted.
        """
        g = self._groups[layer_group_id]
        disk = self._disk
        assert disk is not None
        if self._host is None and self._gpu is None:
            return True
        gpu = self._gpu
        assert gpu is not None
        pool = self._staging[g.gid]
        if pool:
            t = pool.pop()
        else:
            import torch

            shape = tuple(gpu.tensors[g.gid].shape[1:])
            dtype = gpu.tensors[g.gid].dtype
            t = torch.empty(shape, dtype=dtype, pin_memory=self._pinned)
        self._sync()  # a recycled staging tensor may still be the source of a copy
        if disk.get_into(g.namespace, block_hash, tensor_bytes(t)):
            return t
        pool.append(t)
        self.forget_disk(g.gid, block_hash)
        return None

    def unstage(self, layer_group_id: int, staged: torch.Tensor | bool) -> None:
        """Give back a staging tensor from :meth:`stage` that will not be onboarded."""
        if not isinstance(staged, bool):
            self._staging[layer_group_id].append(staged)

    def forget_disk(self, layer_group_id: int, block_hash: bytes) -> None:
        """The disk no longer holds a block: count it and, if it was announced at level 2,
        record its removal."""
        g = self._groups[layer_group_id]
        g.disk_misses += 1
        if block_hash in g.disk_known:
            g.disk_known.discard(block_hash)
            g.dropped += 1
            self._recorder.removed(g.gid, block_hash, cache_level=DISK)

    def take_host(self, layer_group_id: int, block_hash: bytes) -> int:
        """Take a host-resident block out of the tier (so no eviction can reuse its slot
        before :meth:`onboard` copies it); returns the slot."""
        host = self._groups[layer_group_id].host
        assert host is not None
        return host.take(block_hash)

    def onboard(
        self,
        layer_group_id: int,
        moves: Sequence[tuple[Block, bytes, int, int | torch.Tensor | bool]],
    ) -> list[bool]:
        """Copy blocks into fresh GPU blocks: each move is ``(gpu block, hash, level, source)``
        with source a host slot (level HOST) or a staged tensor (level DISK). Records
        ``updated`` (level -> 0) for blocks this manager had announced below the GPU and
        returns, per move, whether it was announced (False: the caller announces it)."""
        g = self._groups[layer_group_id]
        rec = self._recorder
        gpu, host = self._gpu, self._host
        dst: list[int] = []
        slots: list[int] = []
        known: list[bool] = []
        for block, h, level, source in moves:
            if level == HOST:
                assert isinstance(source, int)
                assert g.host is not None
                dst.append(block.block_id)
                slots.append(source)
                g.onboarded_host += 1
                known.append(True)
                rec.updated(g.gid, h, cache_level=(HOST, GPU))
            else:
                if gpu is not None and not isinstance(source, bool):
                    assert not isinstance(source, int)
                    gpu.tensors[g.gid][block.block_id].copy_(source, non_blocking=self._cuda)
                    self._async_pending |= self._cuda
                    self._staging[g.gid].append(source)
                g.onboarded_disk += 1
                was_known = h in g.disk_known
                g.disk_known.discard(h)
                known.append(was_known)
                if was_known:
                    rec.updated(g.gid, h, cache_level=(DISK, GPU))
        if slots:
            if gpu is not None and host is not None:
                copy_blocks(
                    gpu.tensors[g.gid], dst, host.tensors[g.gid], slots, non_blocking=self._cuda
                )
                self._async_pending |= self._cuda
            assert g.host is not None
            for s in slots:
                g.host.release(s)
        return known

    def claim(self, layer_group_id: int, block_hash: bytes) -> int:
        """A request committed a block on the GPU that this manager holds on a lower tier:
        drop the lower copy from the books and return its level (0 if none) so the caller
        records ``updated`` (level -> 0) instead of ``stored``. The disk file stays."""
        g = self._groups[layer_group_id]
        if g.host is not None and block_hash in g.host:
            g.host.release(g.host.take(block_hash))
            return HOST
        if block_hash in g.disk_known:
            g.disk_known.discard(block_hash)
            return DISK
        return 0

    # ------------------------------------------------------------------ write-through

    def queue_persist(self, layer_group_id: int, block: Block, block_hash: bytes) -> None:
        """Remember a block just committed on the GPU, to write at the next :meth:`persist`."""
        self._persist_queue.append((layer_group_id, block, block_hash))

    def persist(self) -> int:
        """Write every queued block that is still committed and not on disk yet; returns how
        many files were written. Blocks evicted or recommitted since are skipped."""
        queue, self._persist_queue = self._persist_queue, []
        disk = self._disk
        if disk is None or self._gpu is None:
            return 0
        written = 0
        for gid, block, h in queue:
            g = self._groups[gid]
            if block.block_hash != h or disk.contains(g.namespace, h):
                continue
            try:
                if disk.put(g.namespace, h, self._gpu_buffer(g, block)):
                    written += 1
                    g.persisted += 1
            except StoreError as exc:
                g.disk_write_errors += 1
                _log.warning("write-through of block %s failed: %s", h.hex(), exc)
            self._note_disk_evictions()
        return written

    # ------------------------------------------------------------------ lifecycle

    def clear(self) -> None:
        """Forget every block on every tier (the disk files stay for other processes)."""
        for g in self._groups:
            if g.host is not None:
                g.host.clear()
            g.disk_known.clear()
        self._persist_queue.clear()

    def close(self) -> None:
        """Wait for pending copies and close the disk store."""
        self._sync()
        if self._disk is not None:
            self._disk.close()

    def check(self) -> None:
        """CacheInvariantError unless every host tier's slots are consistent and no block is
        both host-resident and announced on disk."""
        for g in self._groups:
            if g.host is not None:
                g.host.check()
                both = g.disk_known.intersection(g.host.hashes())
                if both:
                    raise CacheInvariantError(
                        f"group {g.gid}: {len(both)} blocks are both on host and on disk"
                    )

    # ------------------------------------------------------------------ copies

    def _copy_to_host(self, gid: int, slots: list[int], block_ids: list[int]) -> None:
        gpu, host = self._gpu, self._host
        if gpu is None or host is None:
            return
        copy_blocks(host.tensors[gid], slots, gpu.tensors[gid], block_ids, non_blocking=self._cuda)
        self._async_pending |= self._cuda

    def _gpu_buffer(self, g: _Group, block: Block) -> memoryview:
        # The bytes of a GPU block on the CPU (through a staging tensor when on CUDA).
        gpu = self._gpu
        assert gpu is not None
        if not self._cuda:
            return gpu.block_buffer(g.gid, block.block_id)
        return tensor_bytes(gpu.tensors[g.gid][block.block_id].to("cpu"))

    def _host_buffer(self, host: KVStorage, gid: int, slot: int) -> memoryview:
        self._sync()
        return host.block_buffer(gid, slot)

    def _sync(self) -> None:
        if self._async_pending:
            import torch

            torch.cuda.current_stream().synchronize()
            self._async_pending = False


def build_tiers(
    config: CacheConfig, recorder: EventRecorder, gpu: KVStorage | None
) -> Tiers | None:
    """The :class:`Tiers` that ``config`` asks for (None without host and disk tiers)."""
    if config.host_tier is None and config.disk_tier is None:
        return None
    tpb = config.tokens_per_block
    host_blocks = [0] * len(config.groups)
    pinned = False
    if config.host_tier is not None:
        host_blocks = size_host_tier(
            config.host_tier,
            [g.num_blocks for g in config.groups],
            [g.block_bytes(tpb) for g in config.groups],
            # Metadata-only tiers allocate nothing: host memory does not bound them.
            available_host_memory() if gpu is not None else 2**62,
        )
        want_pin = config.host_tier.pinned
        on_cuda = gpu is not None and gpu.device.type == "cuda"
        pinned = on_cuda if want_pin is None else want_pin
    disk: DiskStore | None = None
    model_id = ""
    if config.disk_tier is not None:
        dt = config.disk_tier
        model_id = dt.model_id
        disk = DiskStore(dt.path, capacity_bytes=dt.capacity_bytes, fsync=dt.fsync)
    namespaces = [group_namespace(config, gid, model_id) for gid in range(len(config.groups))]
    tiers = Tiers(
        config,
        recorder,
        gpu=gpu,
        host_blocks=host_blocks,
        disk=disk,
        namespaces=namespaces,
        pinned=pinned,
    )
    tiers.write_through = config.disk_tier is not None and config.disk_tier.write_through
    return tiers

"""Tier move bandwidth through KVCacheManager (GPU pool <-> host tier <-> disk store) against
raw copies of the same bytes.

    python benchmarks/bench_tiers.py [--block-kib 2048,256] [--blocks 64] [--rounds 5]
                                     [--device auto|cpu|cuda] [--dir /tmp/x]
                                     [--disk-host-blocks 1] [--flush-mib 256] [--profile]

Blocks have one layer group of L layers x 2 (K, V) x 16 tokens x 8 kv heads x 128 head_dim,
fp16: L = 32 gives 2 MiB per block, L = 4 256 KiB (``--block-kib`` picks L = KiB / 64). The
GPU pool lives on ``--device`` (``auto``: cuda when available); with CUDA the host tier (and
the raw host buffers) are pinned and copies asynchronous, every timed run synchronises.

Every manager has a GPU pool of 2N blocks. Each round starts with ``reset()``, then N one-token
requests hold N uncommitted blocks ("F"), then request A (N full blocks) is added and freed, so
its N blocks are the only evictable ones. Then, timed (the real code paths):

- ``offload GPU->host`` (host tier of N blocks): ``add_request`` of B, another N-block prompt:
  its allocation evicts A's N blocks, ``Tiers.evict`` copies them to the host
  (``offloaded_to_host`` must grow by exactly N). Bytes: N blocks.
- ``onboard host->GPU``: B and the F requests are freed (F's blocks are uncached, so nothing
  is evicted next), then ``add_request`` of A again: its N-1 reusable blocks (the last prompt
  token is never reused) come back from the host (``onboarded_blocks`` = N-1). Bytes: N-1.
- ``offload host->disk`` (host tier of ``--disk-host-blocks`` H, a DiskStore in a temp dir
  under ``--dir``): ``add_request`` of B evicts A's N blocks; each goes GPU -> host, and a full
  host tier first writes its oldest block to disk, so N-H files are written
  (``offloaded_to_disk`` = N-H). Bytes: N-H blocks (the GPU->host copies are included in the
  time). Block files are deleted after each round (untimed).
- ``onboard disk->GPU``: B and F are freed, H more one-token requests push the blocks still
  on the host to disk (untimed), then ``add_request`` of A: its N-1 reusable blocks are read
  from disk (``stage``: header, checksum, into a staging tensor) and copied into the GPU pool
  (``onboarded_from_disk`` = N-1; page cache hot). Bytes: N-1 blocks.

``no-tier ms`` is the same ``add_request`` on a manager without tiers (evicted blocks dropped;
on the onboard rows A is missed and allocated fresh): hashing, planning, allocation, commit and
events. ``net`` = ours - no-tier, the cost of the move itself. Raw baselines, same bytes:

- host rows: ``raw`` one ``copy_`` of N (or N-1) contiguous blocks, ``loop`` one ``copy_``
  per block (pinned + non_blocking + synchronize on CUDA);
- disk rows: ``raw`` copies the N-H blocks from the pool-like tensor to a host buffer (one
  copy; pinned + non_blocking on CUDA) and writes them to N-H new files with
  ``open(path, "wb").write``; it reads N-1 such files back with ``readinto`` into the host
  buffer and copies them into the pool-like tensor, page cache hot. That is the data path
  any disk tier under a GPU pool takes (on a CPU device the copies are memcpys);
  ``bench_disk_store.py`` compares the store alone with bare file I/O.

All runs are interleaved per round (ours, no-tier, raw, loop) and the best of R is kept for
each, after one warm-up round (staging tensors, allocator, page cache). Before every timed
operation ``--flush-mib`` of writes push the CPU caches out, so ours and the baselines start
equally cold (otherwise a baseline that copies the same buffers twice in a row runs from L3).
The store's 256 hash-prefix directories are created up front, as in a store that has run a
while. GB/s = bytes / time; ``ours/raw`` and ``net/raw`` are throughput ratios (target >=
0.8). K/V contents are written once, before timing. ``--profile`` then runs one more round of
each tiered manager with only its two timed ``add_request`` calls under cProfile and prints
where their time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _pipeline_common import no_gc, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.cache.block_file import byte_view
from kvstream.cache.storage import resolve_device
from kvstream.cache.tier_config import DiskTierConfig, HostTierConfig
from kvstream.cache.tiering import group_namespace
from kvstream.errors import ConfigError
from kvstream.events import SourceId

TPB, HEADS, HEAD_DIM = 16, 8, 128
KIB_PER_LAYER = 2 * TPB * HEADS * HEAD_DIM * 2 // 1024  # K and V, fp16: 64 KiB


def fill(t: torch.Tensor) -> None:
    """Random-looking K/V in every block (one random block repeated: normal_ over the whole
    pool is slow on a CPU and the contents do not matter to the copies)."""
    flat = t.view(t.shape[0], -1)
    flat[0].normal_()
    flat[1:].copy_(flat[0].expand_as(flat[1:]))


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"unexpected tier counters: {what}")


def counters(mgr: KVCacheManager) -> dict[str, int]:
    """The tier counters of the manager's group (empty without tiers)."""
    tier = mgr.stats().groups[0].tier
    return {} if tier is None else dataclasses.asdict(tier)


def delta(before: dict[str, int], after: dict[str, int], name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


class Case:
    """One block size: the three managers, the raw buffers, and their timed operations."""

    def __init__(self, args: argparse.Namespace, kib: int, base: Path) -> None:
        if kib % KIB_PER_LAYER:
            raise SystemExit(f"--block-kib must be a multiple of {KIB_PER_LAYER}, got {kib}")
        self.n = n = args.blocks
        self.h = args.disk_host_blocks
        if n < 2 or not 1 <= self.h < n:
            raise SystemExit("need --blocks >= 2 and 1 <= --disk-host-blocks < --blocks")
        self.device = args.device
        self.cuda = torch.device(args.device).type == "cuda"
        self.spec = LayerGroupSpec(kib // KIB_PER_LAYER, HEADS, HEAD_DIM, 2 * n)
        self.block_bytes = self.spec.block_bytes(TPB)
        self.disk_dir = base / f"store-{kib}"
        self.raw_dir = base / f"raw-{kib}"
        self.raw_dir.mkdir()
        self.host = self._manager(host=n)
        self.plain = self._manager()
        self.disk = self._manager(host=self.h, disk=True)
        # The store's hash-prefix directories exist, as in a store that has run a while (their
        # first-use mkdir is not a tier move).
        ns_dir = self.disk_dir / group_namespace(self.disk.config, 0, "").hex()
        for i in range(256):
            (ns_dir / f"{i:02x}").mkdir(parents=True, exist_ok=True)
        for m in (self.host, self.plain, self.disk):
            kv = m.kv_tensor(0)
            assert kv is not None
            fill(kv)
        shape = (n, self.block_bytes // 2)
        self.gpu_raw = torch.empty(shape, dtype=torch.float16, device=args.device)
        fill(self.gpu_raw)
        self.host_raw = torch.zeros(shape, dtype=torch.float16, pin_memory=self.cuda)
        # The raw disk baseline goes through a host buffer on every device, as the tiers do
        # (the pool's memory is the GPU's; on a CPU device this copy is a memcpy).
        self.file_bufs = [byte_view(self.host_raw[i].view(torch.uint8).numpy()) for i in range(n)]
        self.scratch = torch.empty(args.flush_mib << 20, dtype=torch.uint8)
        self.next_token = 1
        self.requests = 0
        #: Profiles of the timed offload / onboard adds (``--profile``), else None.
        self.profiles: tuple[cProfile.Profile, cProfile.Profile] | None = None

    def _manager(self, *, host: int = 0, disk: bool = False) -> KVCacheManager:
        cfg = CacheConfig(
            tokens_per_block=TPB,
            groups=[self.spec],
            device=self.device,
            hash_algo="blake3_64",
            event_capacity=1 << 20,
            host_tier=HostTierConfig(blocks=[host]) if host else None,
            disk_tier=DiskTierConfig(self.disk_dir, capacity_bytes=1 << 50) if disk else None,
        )
        return KVCacheManager(cfg, source=SourceId(instance_id="bench-tiers"))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def cold(self) -> None:
        """Push the CPU caches out (``--flush-mib`` of writes) before a timed operation, so
        ours and the baselines start alike whatever ran before them."""
        if self.scratch.numel():
            self.scratch.add_(1)
        self.sync()

    def tokens(self, count: int) -> list[int]:
        """A prompt no earlier request shares a block with."""
        start = self.next_token
        self.next_token += count
        return list(range(start, start + count))

    def rid(self) -> str:
        self.requests += 1
        return f"r{self.requests}"

    # -- through the manager -----------------------------------------------------------------

    def _timed_add(
        self, mgr: KVCacheManager, rid: str, tokens: list[int], which: int
    ) -> tuple[float, int]:
        prof = None if self.profiles is None else self.profiles[which]
        self.cold()
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        match = mgr.add_request(rid, tokens)
        self.sync()
        dt = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        return dt, match.groups[0].onboarded_blocks

    def round(self, mgr: KVCacheManager) -> tuple[float, float]:
        """(offload seconds, onboard seconds) of one round on ``mgr`` (see the docstring)."""
        n = self.n
        mgr.reset()
        mgr.flush_events()
        fillers = [self.rid() for _ in range(n)]
        for f in fillers:
            mgr.add_request(f, self.tokens(1))
        a_tokens, a, b = self.tokens(n * TPB), self.rid(), self.rid()
        mgr.add_request(a, a_tokens)
        mgr.free_request(a)
        before = counters(mgr)
        offload, _ = self._timed_add(mgr, b, self.tokens(n * TPB), 0)
        mid = counters(mgr)
        mgr.free_request(b)
        if mgr is self.disk:  # H evictions of B's blocks push A's last H blocks to disk
            pushers = [self.rid() for _ in range(self.h)]
            for g in pushers:
                mgr.add_request(g, self.tokens(1))
            for g in pushers:
                mgr.free_request(g)
        for f in fillers:
            mgr.free_request(f)
        pushed = counters(mgr)
        a2 = self.rid()
        onboard, onboarded = self._timed_add(mgr, a2, a_tokens, 1)
        after = counters(mgr)
        mgr.free_request(a2)
        mgr.flush_events()
        # Exactly the moves the rows count.
        if mgr is self.plain:
            expect(onboarded == 0, "the no-tier manager onboarded blocks")
            return offload, onboard
        expect(onboarded == n - 1, f"{onboarded} blocks onboarded, not {n - 1}")
        # Every evicted block passes through the host tier (the disk runs' too).
        expect(delta(before, mid, "offloaded_to_host") == n, "offloaded_to_host")
        expect(delta(before, after, "disk_misses") == 0, "disk misses")
        expect(delta(before, after, "disk_write_errors") == 0, "disk write errors")
        if mgr is self.host:
            expect(delta(before, mid, "dropped") == 0, "blocks dropped")
            expect(delta(pushed, after, "onboarded_from_host") == n - 1, "onboarded_from_host")
        else:
            expect(delta(before, mid, "offloaded_to_disk") == n - self.h, "offloaded_to_disk")
            expect(delta(pushed, after, "onboarded_from_disk") == n - 1, "onboarded_from_disk")
            for p in self.disk_dir.rglob("*.kvb"):
                p.unlink()
        return offload, onboard

    # -- raw baselines -----------------------------------------------------------------------

    def raw_copy(self, to_host: bool, per_block: bool) -> float:
        n = self.n if to_host else self.n - 1
        dst, src = (self.host_raw, self.gpu_raw) if to_host else (self.gpu_raw, self.host_raw)
        nb = self.cuda
        self.cold()
        t0 = time.perf_counter()
        if per_block:
            for i in range(n):
                dst[i].copy_(src[i], non_blocking=nb)
        else:
            dst[:n].copy_(src[:n], non_blocking=nb)
        self.sync()
        return time.perf_counter() - t0

    def raw_disk(self) -> tuple[float, float]:
        """(write seconds of N-H blocks, read seconds of N-1 blocks) as plain files."""
        n_write, n_read = self.n - self.h, self.n - 1
        paths = [str(self.raw_dir / f"{i:08x}.bin") for i in range(n_read)]
        bufs = self.file_bufs

        def write(lo: int, hi: int) -> None:
            self.host_raw[lo:hi].copy_(self.gpu_raw[lo:hi], non_blocking=self.cuda)
            self.sync()
            for i in range(lo, hi):
                with open(paths[i], "wb") as f:
                    f.write(bufs[i])

        self.cold()
        t0 = time.perf_counter()
        write(0, n_write)
        written = time.perf_counter() - t0
        write(n_write, n_read)  # the files onboarding reads beyond those (untimed; H > 1)
        self.cold()
        t0 = time.perf_counter()
        for i in range(n_read):
            with open(paths[i], "rb", buffering=0) as f:
                view, done = bufs[i], 0
                while done < len(view):
                    got = f.readinto(view[done:])
                    if not got:
                        raise RuntimeError(f"{paths[i]} is short")
                    done += got
        self.gpu_raw[:n_read].copy_(self.host_raw[:n_read], non_blocking=self.cuda)
        self.sync()
        read = time.perf_counter() - t0
        for p in paths:
            os.unlink(p)
        return written, read

    def close(self) -> None:
        for m in (self.host, self.plain, self.disk):
            m.close()


def measure(case: Case, rounds: int) -> dict[str, float]:
    """Best seconds of every timed operation, all interleaved round by round."""
    runs: dict[str, Callable[[], tuple[float, ...]]] = {
        "host": lambda: case.round(case.host),
        "plain": lambda: case.round(case.plain),
        "disk": lambda: case.round(case.disk),
        "raw": lambda: (case.raw_copy(True, False), case.raw_copy(False, False)),
        "loop": lambda: (case.raw_copy(True, True), case.raw_copy(False, True)),
        "rawdisk": case.raw_disk,
    }
    best: dict[str, float] = {}
    for _ in range(rounds + 1):  # round 0 warms up (staging tensors, page cache, allocator)
        warm = not best
        for name, fn in runs.items():
            for op, t in zip(("off", "on"), fn(), strict=True):
                key = f"{name}.{op}"
                best[key] = float("inf") if warm else min(best.get(key, t), t)
    return best


def rows_of(case: Case, kib: int, best: dict[str, float]) -> list[list[str]]:
    n, h = case.n, case.h
    rows = []
    for label, blocks, ours_key, op, raw_key, loop_key in (
        ("offload GPU->host", n, "host", "off", "raw", "loop"),
        ("onboard host->GPU", n - 1, "host", "on", "raw", "loop"),
        ("offload host->disk", n - h, "disk", "off", "rawdisk", None),
        ("onboard disk->GPU", n - 1, "disk", "on", "rawdisk", None),
    ):
        nbytes = blocks * case.block_bytes
        ours, plain = best[f"{ours_key}.{op}"], best[f"plain.{op}"]
        raw = best[f"{raw_key}.{op}"]
        net = ours - plain

        def gbs(t: float, nbytes: int = nbytes) -> str:
            return f"{nbytes / t / 1e9:.2f}" if t > 0 else "n/a"

        rows.append(
            [
                label,
                f"{kib} KiB",
                f"{nbytes / (1 << 20):g}",
                f"{ours * 1e3:.2f}",
                f"{plain * 1e3:.2f}",
                gbs(ours),
                gbs(net),
                gbs(raw),
                "-" if loop_key is None else gbs(best[f"{loop_key}.{op}"]),
                f"{raw / ours:.2f}x",
                f"{raw / net:.2f}x" if net > 0 else "n/a",
            ]
        )
    return rows


def profile(case: Case, kib: int, top: int) -> None:
    """One more round of each tiered manager with its two timed ``add_request`` calls under
    cProfile (nothing else): the top functions by own time."""
    for name, mgr in (("host", case.host), ("disk", case.disk)):
        case.profiles = (cProfile.Profile(), cProfile.Profile())
        case.round(mgr)
        for op, prof in zip(("offload", "onboard"), case.profiles, strict=True):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
            lines = out.getvalue().splitlines()
            start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
            total = next(ln for ln in lines if "function calls" in ln).strip()
            print(f"\n-- profile: {op} via the {name} tier, {kib} KiB blocks: {total}")
            print("\n".join(ln for ln in lines[start : start + top + 1] if ln.strip()))
        case.profiles = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-kib", default="2048,256", help="block sizes in KiB (multiples of 64)")
    ap.add_argument("--blocks", type=int, default=64, help="N: blocks moved per operation")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda")
    ap.add_argument("--disk-host-blocks", type=int, default=1, help="H: host tier of the disk runs")
    ap.add_argument(
        "--flush-mib",
        type=int,
        default=256,
        help="MiB written before each timed op to push the CPU caches out (0: off)",
    )
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--profile", action="store_true", help="cProfile one round of each manager")
    args = ap.parse_args()
    try:
        dev = resolve_device(args.device)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    args.device = str(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    sizes = [int(s) for s in args.block_kib.split(",")]
    base = Path(tempfile.mkdtemp(prefix="kvstream-bench-tiers-", dir=args.dir))
    rows: list[list[str]] = []
    try:
        for kib in sizes:
            case = Case(args, kib, base)
            try:
                with no_gc():
                    best = measure(case, args.rounds)
                rows += rows_of(case, kib, best)
                if args.profile:
                    profile(case, kib, 14)
            finally:
                case.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"\ndevice: {name}  cpus: {os.cpu_count()}  torch threads: {torch.get_num_threads()}  "
        f"N = {args.blocks} blocks per offload (N-1 onboarded, N-{args.disk_host_blocks} to "
        f"disk)  best of {args.rounds}  files under {base.parent}"
    )
    print(
        table(
            rows,
            [
                "operation",
                "block",
                "MiB",
                "ours ms",
                "no-tier ms",
                "ours GB/s",
                "net GB/s",
                "raw GB/s",
                "loop GB/s",
                "ours/raw",
                "net/raw",
            ],
        )
    )


if __name__ == "__main__":
    main()

"""Disk tier throughput: DiskStore.put / get_into against plain file writes and reads.

    python benchmarks/bench_disk_store.py [--sizes 2M,256K] [--blocks 64] [--rounds 5]
                                          [--fsync] [--dir /tmp/x]

For each block payload size, N blocks come from one torch CPU tensor (as the host tier holds
them) and are timed, best of R runs, the runs of ours and of the baseline interleaved:

- ``offload``: ``DiskStore.put`` of the N blocks into a fresh store directory (header,
  checksum, temp file + link, LRU bookkeeping) vs. the baseline writing the same bytes to N
  new files with ``open(path, "wb").write(buf)``. ``--fsync`` makes both fsync every file
  (the store also fsyncs the directory).
- ``onboard hot``: ``DiskStore.get_into`` every block into a preallocated tensor (header
  parse, payload checksum, mtime refresh) vs. ``open(path, "rb", buffering=0).readinto`` of
  the baseline's files into the same tensor; page cache hot.
- ``onboard cold``: the same after ``posix_fadvise(POSIX_FADV_DONTNEED)`` of every file (ours
  and the baseline's) before each timed run, so the reads go to the disk.

GB/s counts payload bytes. ``ratio`` = ours / raw throughput (the target is >= 0.8).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from _pipeline_common import no_gc, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstream.cache.block_file import HEADER_SIZE, byte_view
from kvstream.cache.disk_store import DiskStore

NS = bytes(range(16))


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def best_interleaved(fns: list[Callable[[], float]], rounds: int) -> list[float]:
    """Best time of each function (each returns the seconds it timed); runs alternate."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], fn())
    return best


def drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED only drops clean pages
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Case:
    """One payload size: the source blocks, the destination tensor and the directories."""

    def __init__(self, base: Path, size: int, blocks: int, fsync: bool) -> None:
        self.base, self.size, self.n, self.fsync = base, size, blocks, fsync
        gen = torch.Generator().manual_seed(size)
        src = torch.randint(0, 256, (blocks, size), dtype=torch.uint8, generator=gen)
        self.src = src
        self.dst = torch.empty_like(src)
        self.src_bufs = [byte_view(src[i].numpy()) for i in range(blocks)]
        self.dst_bufs = [byte_view(self.dst[i].numpy()) for i in range(blocks)]
        self.runs = 0

    def _fresh(self, name: str) -> Path:
        self.runs += 1
        return self.base / f"{name}-{self.size}-{self.runs}"

    # -- offload -----------------------------------------------------------------------------

    def put_ours(self) -> float:
        root = self._fresh("ours")
        store = DiskStore(root, capacity_bytes=1 << 62, fsync=self.fsync)
        put, bufs = store.put, self.src_bufs
        t0 = time.perf_counter()
        for i in range(self.n):
            put(NS, key(i), bufs[i])
        dt = time.perf_counter() - t0
        assert store.stats().writes == self.n
        store.close()
        shutil.rmtree(root)
        return dt

    def put_raw(self) -> float:
        root = self._fresh("raw")
        root.mkdir()
        paths = [str(root / f"{i:08x}.bin") for i in range(self.n)]
        bufs, fsync = self.src_bufs, self.fsync
        t0 = time.perf_counter()
        for i in range(self.n):
            with open(paths[i], "wb") as f:
                f.write(bufs[i])
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        shutil.rmtree(root)
        return dt

    # -- onboard -----------------------------------------------------------------------------

    def prepare_reads(self) -> None:
        self.store_root = self.base / f"read-ours-{self.size}"
        self.store = DiskStore(self.store_root, capacity_bytes=1 << 62)
        for i in range(self.n):
            self.store.put(NS, key(i), self.src_bufs[i])
        self.ours_paths = [self.store.path(NS, key(i)) for i in range(self.n)]
        raw_root = self.base / f"read-raw-{self.size}"
        raw_root.mkdir()
        self.raw_paths = [str(raw_root / f"{i:08x}.bin") for i in range(self.n)]
        for p, buf in zip(self.raw_paths, self.src_bufs, strict=True):
            with open(p, "wb") as f:
                f.write(buf)
        assert all(os.path.getsize(p) == HEADER_SIZE + self.size for p in self.ours_paths)

    def get_ours(self, cold: bool) -> float:
        if cold:
            drop_cache(self.ours_paths)
        self.dst.zero_()
        get, bufs = self.store.get_into, self.dst_bufs
        t0 = time.perf_counter()
        for i in range(self.n):
            if not get(NS, key(i), bufs[i]):
                raise RuntimeError(f"block {i} missing")
        dt = time.perf_counter() - t0
        assert torch.equal(self.dst, self.src)
        return dt

    def get_raw(self, cold: bool) -> float:
        if cold:
            drop_cache(self.raw_paths)
        self.dst.zero_()
        paths, bufs = self.raw_paths, self.dst_bufs
        t0 = time.perf_counter()
        for i in range(self.n):
            with open(paths[i], "rb", buffering=0) as f:
                view, done = bufs[i], 0
                while done < len(view):
                    got = f.readinto(view[done:])
                    if not got:
                        raise RuntimeError(f"{paths[i]} is short")
                    done += got
        dt = time.perf_counter() - t0
        assert torch.equal(self.dst, self.src)
        return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2M,256K", help="block payload sizes (K/M suffixes)")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fsync", action="store_true", help="fsync every file (both sides)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    base = Path(tempfile.mkdtemp(prefix="kvstream-bench-disk-", dir=args.dir))
    rows: list[list[str]] = []
    try:
        for size in sizes:
            case = Case(base, size, args.blocks, args.fsync)
            total = size * args.blocks
            with no_gc():
                put = best_interleaved([case.put_ours, case.put_raw], args.rounds)
                case.prepare_reads()
                case.get_ours(False)  # warm the page cache
                case.get_raw(False)
                hot = best_interleaved(
                    [partial(case.get_ours, False), partial(case.get_raw, False)], args.rounds
                )
                cold = best_interleaved(
                    [partial(case.get_ours, True), partial(case.get_raw, True)], args.rounds
                )
            case.store.close()
            for op, (ours, raw) in (
                ("offload" + (" (fsync)" if args.fsync else ""), put),
                ("onboard hot", hot),
                ("onboard cold", cold),
            ):
                rows.append(
                    [
                        op,
                        fmt_size(size),
                        f"{total / ours / 1e9:.2f}",
                        f"{total / raw / 1e9:.2f}",
                        f"{ours / args.blocks * 1e6:.0f}",
                        f"{raw / args.blocks * 1e6:.0f}",
                        f"{raw / ours:.2f}x",
                    ]
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"{args.blocks} blocks per run, best of {args.rounds}, under {base.parent} "
        f"(cpus: {os.cpu_count()})"
    )
    print(
        table(
            rows,
            ["operation", "block", "ours GB/s", "raw GB/s", "ours us/blk", "raw us/blk", "ratio"],
        )
    )


if __name__ == "__main__":
    main()

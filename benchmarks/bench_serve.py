"""``kvstream serve`` against NVIDIA Dynamo's standalone indexer (issue 21), side by side.

Both services run as processes pinned to the same core(s) (``--server-cores``, default one
core), the load client to the others, and follow the same real vLLM 0.33 publishers
(``tests/peers/vllm_fleet.py``: vLLM's ``KVCacheManager`` and ``ZmqEventPublisher``,
``--instances`` x ``--ranks``, a pool small enough for LRU evictions), registered with the
same ``/register`` calls. Each round, with a fresh workload:

1. **ingest**, ``--bursts`` times (fresh requests each): the engines serve ``--requests``
   requests; their event batches are held, then published as fast as vLLM's publishers send
   them (the same bytes reach both services); then one sentinel request per rank. Reported
   per burst: each server's CPU per 1,000 blocks ingested (the scheduler's per-thread CPU
   time, to the nanosecond, the clock-tick count beside it) and how long after the last
   publish each answered the sentinels (caught up); and over all bursts together, the
   sustainable rate on its core (blocks per CPU-second), with the per-burst ratios' range;
2. **state**: both ``/dump``s, flattened, must hold the same blocks; RSS of each process;
3. **answers**: ``--probes`` distinct requests (served prompts, their prefixes with new tails,
   new ones) to both: identical answers are counted;
4. **latency**: the probes sequentially over one keep-alive connection per service, the
   services alternating request by request: p50 and p99;
5. **throughput**: the probes from 16 concurrent connections, one service at a time, the
   order alternating by round: queries/s and the server's CPU per query (the scheduler's
   nanosecond counters, as for ingest). The client is ``wrk`` (C, epoll; the Debian
   package) when it is installed: it cycles through the probes for ``--wrk-seconds`` per
   service and round on the client's cores, so the server's core, not the client, is the
   bound (any non-2xx answer fails the run). Without it, an aiohttp client sends the probes
   once; a Python client saturates first (about 4k queries/s here, below either service), so
   queries/s then measures the client and the CPU per query is the figure.

Run with the peer venv (``scripts/test-peers`` builds it)::

    .peers-venv/bin/python benchmarks/bench_serve.py [--rounds 3] [--requests 600]

Spread is reported as median (min-max) over rounds (over bursts for the ingest rows); ratios
are kvstream / Dynamo (for ingest capacity and throughput, higher is better; for latency, CPU
and RSS, lower).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "peers"))
sys.path.insert(0, str(ROOT / "tests"))

from dynamo_indexer import Dynamo, flatten  # noqa: E402
from engine_publisher import free_ports  # noqa: E402
from vllm_fleet import VllmRank, Workload  # noqa: E402

BS = 16
MODEL = "bench"


def cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads, exited ones included), seconds, in
    clock ticks (10 ms here)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ns_s(pid: int) -> float:
    """CPU time of process ``pid``'s live threads, seconds, to the nanosecond (the scheduler's
    ``/proc/PID/task/*/schedstat``): an ingest burst is a few ticks of :func:`cpu_s`. A thread
    that exits in between takes its time with it; the tick count is reported beside it."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread exited meanwhile
            continue
    return total / 1e9


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Kvstream:
    """``kvstream serve`` in a subprocess."""

    def __init__(self, port: int, log: Path, cmd_prefix: tuple[str, ...]) -> None:
        self.port = port
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [
                *cmd_prefix,
                sys.executable,
                "-m",
                "kvstream.cli.main",
                "serve",
                "--port",
                str(port),
                "--block-size",
                str(BS),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    c.close()
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(log.read_text(errors="replace")[-2000:])
            time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self._log.close()


class Conn:
    """One keep-alive JSON connection."""

    def __init__(self, port: int) -> None:
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.c.request("POST", path, body=body, headers={"content-type": "application/json"})
        r = self.c.getresponse()
        return r.status, r.read()

    def get(self, path: str) -> Any:
        self.c.request("GET", path)
        return json.loads(self.c.getresponse().read())


def query_body(tokens: list[int]) -> bytes:
    return json.dumps({"token_ids": tokens, "model_name": MODEL}).encode()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def hammer(port: int, bodies: list[bytes], concurrency: int) -> float:
    import aiohttp

    it = iter(bodies)
    conn = aiohttp.TCPConnector(limit=concurrency)
    url = f"http://127.0.0.1:{port}/query"
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one() -> None:
            for body in it:
                async with session.post(
                    url, data=body, headers={"content-type": "application/json"}
                ) as r:
                    await r.read()
                    assert r.status == 200

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return time.perf_counter() - t0


_WRK_SCRIPT = """
local bodies = {}
local i = 0
init = function(args)
  for line in io.lines(args[1]) do bodies[#bodies + 1] = line end
end
request = function()
  i = i % #bodies + 1
  return wrk.format("POST", "/query", {["Content-Type"] = "application/json"}, bodies[i])
end
"""


def wrk_hammer(
    port: int, bodies: list[bytes], *, concurrency: int, seconds: int, cores: str, tmp: Path
) -> tuple[int, float]:
    """(requests answered, wall seconds) of ``wrk`` cycling through ``bodies`` (one JSON body
    per line) with ``concurrency`` connections for ``seconds`` on ``cores``; raises on any
    error or non-2xx answer."""
    script, lines = tmp / "probes.lua", tmp / "probes.jsonl"
    script.write_text(_WRK_SCRIPT)
    lines.write_bytes(b"\n".join(bodies) + b"\n")
    threads = max(1, len(cores.split(",")))
    out = subprocess.run(
        [
            "taskset",
            "-c",
            cores,
            "wrk",
            f"-t{threads}",
            f"-c{concurrency}",
            f"-d{seconds}s",
            "-s",
            str(script),
            f"http://127.0.0.1:{port}/query",
            "--",
            str(lines),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        raise SystemExit(f"wrk saw failed requests:\n{out}")
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[1:3] == ["requests", "in"]:
            return int(parts[0]), float(parts[3].rstrip("s,"))
    raise SystemExit(f"cannot read wrk's output:\n{out}")


def ingest_burst(
    work: Workload,
    ranks: list[tuple[int, int, VllmRank]],
    services: dict[str, tuple[int, int]],
    conns: dict[str, Conn],
    requests: int,
    *,
    seed: str,
) -> tuple[int, dict[str, tuple[float, float, float]]]:
    """One ingest burst: the engines serve ``requests`` requests of ``work`` whose event
    batches are held, then published as fast as vLLM's publishers send them, then one
    sentinel request per rank. Returns the blocks the batches carry and, per service, its
    CPU seconds (nanosecond counters, then clock ticks) from the first publish until it
    answered the sentinels, and how long after the last publish that was (NaN: never)."""
    held: list[tuple[VllmRank, Any]] = []
    blocks = 0
    pick = random.Random(f"ranks/{seed}")
    for _ in range(requests):
        prompt, output = work.next_request()
        eng = pick.choice(ranks)[2]
        for batch in eng.run(prompt, output):
            held.append((eng, batch))
            blocks += sum(len(getattr(e, "block_hashes", ()) or ()) for e in batch.events)
    # one sentinel prompt served last by every rank: one /query sees them all
    sentinel = [random.Random(f"sentinel/{seed}").randrange(3, 30000) for _ in range(BS * 4)]
    for _, _, eng in ranks:
        for batch in eng.run(sentinel, []):
            held.append((eng, batch))
    want_ranks = {(str(inst), str(r)) for inst, r, _ in ranks}
    sentinel_body = query_body(sentinel)
    cpu0 = {n: cpu_s(pid) for n, (pid, _) in services.items()}
    ns0 = {n: cpu_ns_s(pid) for n, (pid, _) in services.items()}
    for eng, batch in held:
        eng.publisher.publish(batch)
    t_pub = time.perf_counter()
    pending = dict.fromkeys(services)
    seen: dict[str, float] = {}
    while pending and time.perf_counter() - t_pub < 120:
        for name in list(pending):
            _, raw = conns[name].post("/query", sentinel_body)
            scores = json.loads(raw)["scores"]
            held_by = {
                (i, r) for i, ranks_ in scores.items() for r, n in ranks_.items() if n == BS * 4
            }
            if want_ranks <= held_by:
                seen[name] = time.perf_counter() - t_pub
                del pending[name]
        time.sleep(0.01)  # ~10 polls per 100 ms: under 5% of either's ingest CPU
    return blocks, {
        name: (
            cpu_ns_s(pid) - ns0[name],
            cpu_s(pid) - cpu0[name],
            seen.get(name, float("nan")),
        )
        for name, (pid, _) in services.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--requests", type=int, default=600, help="requests per ingest burst")
    ap.add_argument("--bursts", type=int, default=3, help="ingest bursts per round")
    ap.add_argument("--probes", type=int, default=3000, help="queries per round")
    ap.add_argument("--num-blocks", type=int, default=1500, help="KV blocks per engine rank")
    ap.add_argument("--server-cores", default="1", help="taskset -c list for both services")
    ap.add_argument("--client-cores", default="0", help="CPU list for this process")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--client",
        choices=("auto", "wrk", "aiohttp"),
        default="auto",
        help="throughput client (auto: wrk when installed)",
    )
    ap.add_argument("--wrk-seconds", type=int, default=4, help="wrk run per service/round")
    ap.add_argument("--json", action="store_true", help="also print the raw rows as JSON")
    args = ap.parse_args()
    import vllm.distributed.kv_events as kv

    os.sched_setaffinity(0, {int(c) for c in args.client_cores.split(",")})
    use_wrk = args.client == "wrk" or (args.client == "auto" and shutil.which("wrk") is not None)
    if args.client == "wrk" and shutil.which("wrk") is None:
        raise SystemExit("--client wrk: wrk is not installed (Debian: apt-get install wrk)")
    pin = ("taskset", "-c", args.server_cores)
    tmp = Path(tempfile.mkdtemp(prefix="kvs-bench-serve-"))
    ports = free_ports(2)
    dyn = Dynamo(ports[0], tmp / "dynamo.log", BS, cmd_prefix=pin)
    ours = Kvstream(ports[1], tmp / "kvstream.log", pin)
    services = {"kvstream": (ours.proc.pid, ours.port), "dynamo": (dyn.proc.pid, dyn.port)}
    ranks: list[tuple[int, int, VllmRank]] = []
    for i in range(args.instances):
        pub, rep = free_ports(args.ranks), free_ports(args.ranks)
        for r in range(args.ranks):
            ranks.append(
                (
                    1000 + i,
                    r,
                    VllmRank(
                        kv, pub[r], rep[r], dp_rank=r, block_size=BS, num_blocks=args.num_blocks
                    ),
                )
            )
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in services}
    answers_same = answers_total = 0
    total_blocks = 0
    ingest_ns = dict.fromkeys(services, 0.0)

    def add(name: str, key: str, value: float) -> None:
        rows[name].setdefault(key, []).append(value)

    try:
        for inst, r, eng in ranks:
            body = json.dumps(
                {
                    "instance_id": inst,
                    "endpoint": eng.endpoint,
                    "replay_endpoint": eng.replay_endpoint,
                    "model_name": MODEL,
                    "block_size": BS,
                    "dp_rank": r,
                }
            ).encode()
            for _, port in services.values():
                status, text = Conn(port).post("/register", body)
                assert status == 201, text
        time.sleep(1.0)
        conns = {name: Conn(port) for name, (_, port) in services.items()}
        for rnd in range(args.rounds):
            work = Workload(seed=1000 + rnd, system_tokens=1024)
            # 1. ingest: --bursts bursts, each of fresh requests
            for burst in range(args.bursts):
                blocks, cpu = ingest_burst(
                    work, ranks, services, conns, args.requests, seed=f"{rnd}/{burst}"
                )
                total_blocks += blocks
                for name, (ns, ticks, caught_up) in cpu.items():
                    ingest_ns[name] += ns
                    add(name, "ingest CPU ms / 1k blocks", ns / blocks * 1e6)
                    add(name, "  (in clock ticks)", ticks / blocks * 1e6)
                    add(name, "caught up after publish, ms", caught_up * 1e3)
            # 2. state
            deadline = time.monotonic() + 30
            while True:
                dumps = {n: flatten(conns[n].get("/dump")) for n in services}
                if dumps["kvstream"] == dumps["dynamo"] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            same_state = dumps["kvstream"] == dumps["dynamo"]
            n_blocks = len(dumps["dynamo"])
            for name, (pid, _) in services.items():
                add(name, "RSS MiB", rss_mib(pid))
            # 3. answers and 4. sequential latency, alternating request by request
            probes = work.probes(args.probes)
            bodies = [query_body(p) for p in probes]
            lat: dict[str, list[float]] = {n: [] for n in services}
            order = list(services) if rnd % 2 == 0 else list(services)[::-1]
            for body in bodies:
                got = {}
                for name in order:
                    t0 = time.perf_counter()
                    status, raw = conns[name].post("/query", body)
                    lat[name].append(time.perf_counter() - t0)
                    got[name] = json.loads(raw)
                answers_total += 1
                answers_same += got["kvstream"] == got["dynamo"]
            for name in services:
                add(name, "query p50 us", pct(lat[name], 0.5) * 1e6)
                add(name, "query p99 us", pct(lat[name], 0.99) * 1e6)
            # 5. throughput with concurrent clients
            for name in order:
                pid, port = services[name]
                c0 = cpu_ns_s(pid)
                if use_wrk:
                    done, wall = wrk_hammer(
                        port,
                        bodies,
                        concurrency=args.concurrency,
                        seconds=args.wrk_seconds,
                        cores=args.client_cores,
                        tmp=tmp,
                    )
                else:
                    done = len(bodies)
                    wall = asyncio.run(hammer(port, bodies, args.concurrency))
                add(name, f"queries/s ({args.concurrency} conns)", done / wall)
                add(name, "server CPU us / query", (cpu_ns_s(pid) - c0) / done * 1e6)
            print(
                f"round {rnd + 1}/{args.rounds}: {args.bursts} ingest bursts, "
                f"{total_blocks:,} blocks so far, {n_blocks} cached, "
                f"state {'identical' if same_state else 'DIFFERENT'}, "
                f"answers identical {answers_same}/{answers_total}",
                flush=True,
            )
    finally:
        for _, _, eng in ranks:
            eng.close()
        ours.close()
        dyn.close()

    def fmt(v: list[float]) -> str:
        return f"{statistics.median(v):,.1f} ({min(v):,.1f}-{max(v):,.1f})"

    print(
        f"\nkvstream serve vs Dynamo {args.instances}x{args.ranks} vLLM ranks, block size {BS},"
        f" {args.rounds} rounds; services on cores {args.server_cores}, client on "
        f"{args.client_cores} (throughput: "
        f"{f'wrk, {args.wrk_seconds} s per run' if use_wrk else 'aiohttp'}); median (min-max)"
    )
    print(f"{'metric':34} {'kvstream':>24} {'dynamo':>24} {'ratio':>7}")
    for key in rows["kvstream"]:
        k, d = rows["kvstream"][key], rows["dynamo"][key]
        ratio = statistics.median(k) / statistics.median(d)
        print(f"{key:34} {fmt(k):>24} {fmt(d):>24} {ratio:>6.2f}x")
    print(f"answers identical: {answers_same}/{answers_total}")
    # over every burst's blocks and CPU together (the per-burst rows above give the spread)
    cap = {name: total_blocks / ns for name, ns in ingest_ns.items()}
    per_burst = [
        d / k
        for k, d in zip(
            rows["kvstream"]["ingest CPU ms / 1k blocks"],
            rows["dynamo"]["ingest CPU ms / 1k blocks"],
            strict=True,
        )
    ]
    print(
        f"ingest capacity (blocks per CPU-second, {total_blocks:,} blocks in "
        f"{len(per_burst)} bursts): kvstream {cap['kvstream']:,.0f}, dynamo "
        f"{cap['dynamo']:,.0f}, ratio {cap['kvstream'] / cap['dynamo']:.2f}x "
        f"(bursts {min(per_burst):.2f}-{max(per_burst):.2f}x, "
        f"{sum(r >= 1.2 for r in per_burst)} of {len(per_burst)} at >= 1.2x)"
    )
    if args.json:
        print(json.dumps({"rows": rows, "answers": [answers_same, answers_total]}))


if __name__ == "__main__":
    main()

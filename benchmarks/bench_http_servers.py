"""Which asyncio HTTP server should ``kvstream serve`` run on? (issue 21: measure two or three)

Each candidate serves the same handler, shaped like ``POST /query``: decode a JSON body of
``token_ids`` (a 2k-token prompt) with msgspec, as the service does, answer a small JSON object.
One load-client process drives every server with the same requests over keep-alive
connections, sequentially (latency) and with 16 concurrent connections (throughput), rounds
interleaved; the figure that matters is the server process's CPU per request (utime + stime
from /proc), since a Python client saturates before a fast server does.

Candidates: aiohttp's ``web`` server; uvicorn with httptools and uvloop running a bare ASGI
app (no framework); granian (Rust HTTP, RSGI interface), one worker; ``kvstream``: the
service's own HTTP/1.1 protocol (kvstream.serve.server: httptools' parser on
``loop.create_server``, uvloop) with a one-route table. aiohttp, uvicorn and granian are
not kvstream dependencies: install them to run their rows (``--servers`` picks rows).

    python benchmarks/bench_http_servers.py [--rounds 3] [--requests 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SERVERS = ("aiohttp", "uvicorn", "granian", "kvstream")

_APP = r"""
import json, sys

import msgspec
_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()

def work(body):
    req = _dec.decode(body)
    toks = req["token_ids"]
    n = len(toks) // 16
    return _enc.encode({"scores": {"1": {"0": n * 16}}, "frequencies": [], "instances": {}})

kind, port = sys.argv[1], int(sys.argv[2])
if kind == "aiohttp":
    from aiohttp import web
    async def query(request):
        return web.Response(body=work(await request.read()), content_type="application/json")
    app = web.Application()
    app.router.add_post("/query", query)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
elif kind == "uvicorn":
    import uvicorn
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        out = work(body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})
    uvicorn.run(app, host="127.0.0.1", port=port, http="httptools", loop="uvloop",
                log_level="warning", access_log=False, lifespan="off")
elif kind == "kvstream":
    import asyncio
    import uvloop
    from kvstream.serve.server import HttpServer

    class Metrics:
        def observe(self, endpoint, method, status, seconds):
            pass

    class Routes:
        routes = {"/query": ("POST", None, None)}
        metrics = Metrics()

        def respond(self, method, path, authorization, body):
            return 200, work(body), b"content-type: application/json\r\n"

    async def main():
        server = HttpServer(Routes(), max_body_bytes=1 << 24)
        await server.start("127.0.0.1", port)
        await asyncio.Event().wait()

    uvloop.run(main())
else:
    from granian import Granian
    from granian.constants import Interfaces
    Granian("rsgi_app:app", address="127.0.0.1", port=port, interface=Interfaces.RSGI,
            workers=1, log_enabled=False).serve()
"""

_RSGI = r"""
import json
import msgspec
_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()

def work(body):
    req = _dec.decode(body)
    toks = req["token_ids"]
    n = len(toks) // 16
    return _enc.encode({"scores": {"1": {"0": n * 16}}, "frequencies": [], "instances": {}})

async def app(scope, proto):
    body = await proto()
    proto.response_bytes(200, [("content-type", "application/json")], work(body))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` and its children threads (whole process), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    total = cpu_s(pid)
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    return total + sum(tree_cpu_s(int(k)) for k in kids)


class Server:
    def __init__(self, kind: str, workdir: Path) -> None:
        self.kind = kind
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=str(workdir))
        self.proc = subprocess.Popen(
            [sys.executable, str(workdir / "app.py"), kind, str(self.port)],
            cwd=workdir,
            env=env,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(
                    urllib.request.Request(
                        f"http://127.0.0.1:{self.port}/query",
                        data=b'{"token_ids": []}',
                        headers={"content-type": "application/json"},
                    ),
                    timeout=1,
                ).read()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{kind} did not start")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


async def drive(port: int, bodies: list[bytes], concurrency: int) -> list[float]:
    import aiohttp

    lat: list[float] = []
    it = iter(bodies)
    url = f"http://127.0.0.1:{port}/query"
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one() -> None:
            for body in it:
                t0 = time.perf_counter()
                async with session.post(
                    url, data=body, headers={"content-type": "application/json"}
                ) as r:
                    await r.read()
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--servers", default=",".join(SERVERS))
    args = ap.parse_args()
    import random
    import tempfile

    kinds = args.servers.split(",")
    work = Path(tempfile.mkdtemp(prefix="kvs-http-"))
    (work / "app.py").write_text(_APP)
    (work / "rsgi_app.py").write_text(_RSGI)
    rows: dict[str, dict[str, list[float]]] = {
        k: {"p50": [], "p99": [], "cpu": [], "qps": []} for k in kinds
    }
    servers = {k: Server(k, work) for k in kinds}
    try:
        for rnd in range(args.rounds):
            rng = random.Random(rnd)
            bodies = [
                json.dumps({"token_ids": [rng.randrange(50000) for _ in range(2048)]}).encode()
                for _ in range(args.requests)
            ]
            order = kinds if rnd % 2 == 0 else kinds[::-1]
            for k in order:
                s = servers[k]
                lat = asyncio.run(drive(s.port, bodies[: args.requests // 4], 1))
                lat.sort()
                rows[k]["p50"].append(lat[len(lat) // 2] * 1e6)
                rows[k]["p99"].append(lat[int(len(lat) * 0.99)] * 1e6)
                c0 = tree_cpu_s(s.proc.pid)
                t0 = time.perf_counter()
                asyncio.run(drive(s.port, bodies, 16))
                wall = time.perf_counter() - t0
                rows[k]["cpu"].append((tree_cpu_s(s.proc.pid) - c0) / len(bodies) * 1e6)
                rows[k]["qps"].append(len(bodies) / wall)
    finally:
        for s in servers.values():
            s.close()

    def fmt(v: list[float]) -> str:
        return f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})"

    head = ("server", "p50 us", "p99 us", "server CPU us/req", "req/s (16 conn)")
    print(f"{head[0]:10} {head[1]:>16} {head[2]:>16} {head[3]:>20} {head[4]:>18}")
    for k in kinds:
        r = rows[k]
        cells = (fmt(r["p50"]), fmt(r["p99"]), fmt(r["cpu"]), fmt(r["qps"]))
        print(f"{k:10} {cells[0]:>16} {cells[1]:>16} {cells[2]:>20} {cells[3]:>18}")


if __name__ == "__main__":
    main()

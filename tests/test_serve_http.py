"""The service's HTTP/1.1 layer (kvstream.serve.server) on a real socket, in raw bytes.

Pipelining, chunked bodies, the body limit (413, with and without ``Expect: 100-continue``),
malformed requests, HTTP/1.0, oversized heads, graceful shutdown, and raw bytes fuzzed
onto the socket: the service answers every complete request in order, never with a 5xx, and
keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_support import eventually

from kvstream.serve import Client, IndexService, ServeConfig

BS = 4
LIMIT = 4096


@pytest.fixture
async def service() -> AsyncIterator[IndexService]:
    async with IndexService(ServeConfig(port=0, block_size=BS, max_body_bytes=LIMIT)) as svc:
        yield svc


def exchange(port: int, *parts: bytes, shut: bool = True, reset_ok: bool = False) -> bytes:
    """Send ``parts`` on one connection (then half-close when ``shut``) and read until the
    service closes it. ``reset_ok``: the service may close while bytes are still coming (it
    does after a malformed request), so a reset ends the exchange."""
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            for p in parts:
                s.sendall(p)
            if shut:
                s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                out += chunk
        except OSError as exc:  # a reset shows as EPIPE, ECONNRESET or ENOTCONN
            if not reset_ok or isinstance(exc, TimeoutError):
                raise
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(65536):
                    out += chunk
    return out


def responses(data: bytes, partial_ok: bool = False) -> list[tuple[int, dict[str, str], bytes]]:
    """The responses in ``data`` (status, lower-cased headers, body), interim ones too;
    ``partial_ok``: a cut last response is left out."""
    out = []
    while data:
        head, sep, data = data.partition(b"\r\n\r\n")
        if not sep and partial_ok:
            break
        assert sep, head
        lines = head.decode("latin-1").split("\r\n")
        version, status, *_ = lines[0].split(" ", 2)
        assert version == "HTTP/1.1", lines[0]
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        n = int(headers.get("content-length", "0"))
        body, data = data[:n], data[n:]
        if len(body) < n and partial_ok:
            break
        assert len(body) == n
        out.append((int(status), headers, body))
    return out


def post(path: str, body: bytes, *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: x", f"content-length: {len(body)}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


GET_HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
GET_PEERS = b"GET /peers HTTP/1.1\r\nhost: x\r\n\r\n"


async def registered(svc: IndexService, engines: Any) -> list[int]:
    """One engine registered with one stored prompt; the prompt."""
    e = engines(BS)
    prompt = list(range(1, 1 + BS * 3))
    with Client(svc.url) as c:
        await asyncio.to_thread(c.register, 1, e.endpoint, replay_endpoint=e.replay_endpoint)
        e.store(prompt)
        await eventually(lambda: c.query(prompt)["scores"])
    return prompt


async def test_pipelined_requests_are_answered_in_order(
    service: IndexService, engines: Any
) -> None:
    prompt = await registered(service, engines)
    query = json.dumps({"token_ids": prompt}).encode()
    data = await asyncio.to_thread(
        exchange,
        service.port,
        GET_HEALTH + post("/query", query) + GET_PEERS + post("/query", b"{bad") + GET_HEALTH,
    )
    got = responses(data)
    assert [r[0] for r in got] == [200, 200, 200, 400, 200]
    with Client(service.url) as c:
        assert json.loads(got[1][2]) == await asyncio.to_thread(c.query, prompt)
    assert json.loads(got[3][2])["type"] == "BadRequestError"
    assert got[1][1]["content-type"] == "application/json"
    assert "connection" not in got[0][1]
    assert "date" in got[0][1]


async def test_a_chunked_body_is_read_like_a_sized_one(service: IndexService, engines: Any) -> None:
    prompt = await registered(service, engines)
    query = json.dumps({"token_ids": prompt}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (query[:5], query[5:])) + b"0\r\n\r\n"
    head = b"POST /query HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    # sent in pieces: the parser must carry its state across reads
    data = await asyncio.to_thread(exchange, service.port, head, chunks[:7], chunks[7:])
    sized = await asyncio.to_thread(exchange, service.port, post("/query", query))
    assert responses(data) == responses(sized)
    assert responses(data)[0][0] == 200


async def test_a_body_over_the_limit_gets_413_and_is_not_kept(service: IndexService) -> None:
    big = b"[" + b"1," * LIMIT + b"1]"
    data = await asyncio.to_thread(exchange, service.port, post("/query", big) + GET_HEALTH)
    (status, _, body), (after, _, _) = responses(data)
    assert status == 413
    assert after == 200
    assert json.loads(body)["type"] == "PayloadTooLargeError"
    assert f"over the limit of {LIMIT} bytes" in json.loads(body)["error"]
    # chunked: no length to refuse up front, refused when the limit is passed
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big)
    head = b"POST /query HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    data = await asyncio.to_thread(exchange, service.port, head + chunked)
    assert [r[0] for r in responses(data)] == [413]


async def test_a_client_that_waits_to_send_gets_413_at_once(service: IndexService) -> None:
    head = (
        f"POST /query HTTP/1.1\r\nhost: x\r\ncontent-length: {LIMIT + 1}\r\n"
        "expect: 100-continue\r\n\r\n"
    ).encode()
    # no body sent and no half-close: the answer and the close come from the service alone
    data = await asyncio.to_thread(exchange, service.port, head, shut=False)
    ((status, headers, _),) = responses(data)
    assert status == 413
    assert headers["connection"] == "close"
    small = post("/query", b'{"token_ids": [1]}', "expect: 100-continue")
    got = responses(await asyncio.to_thread(exchange, service.port, small))
    assert [r[0] for r in got] == [100, 404]  # 100 Continue, then no model yet


async def test_malformed_requests_get_400_and_the_connection_closes(
    service: IndexService,
) -> None:
    for bad in (
        b"NOT A REQUEST\r\n\r\n",
        b"GET /health HTTP/9.9\r\n\r\n",
        b"POST /query HTTP/1.1\r\ncontent-length: x\r\n\r\n",
        b"POST /query HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"GET /health HTTP/1.1\r\nbad header\r\n\r\n",
    ):
        got = responses(await asyncio.to_thread(exchange, service.port, bad, GET_HEALTH))
        assert len(got) == 1, bad
        status, headers, body = got[0]
        assert status == 400, bad
        assert headers["connection"] == "close", bad
        assert json.loads(body)["type"] == "BadRequestError"
    head = b"GET /health HTTP/1.1\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n"
    got = responses(await asyncio.to_thread(exchange, service.port, head))
    assert got[0][0] == 431


async def test_bodies_that_are_not_utf8_get_400(service: IndexService) -> None:
    """A JSON string that is not UTF-8 is bad input, on every route that reads a body (the
    fuzzer found /register answering 500: msgspec raises UnicodeDecodeError for it)."""
    for path, body in (
        (b"/register", b'{"instance_id": 1, "endpoint": "\x80tcp://127.0.0.1:1"}'),
        (b"/query", b'{"token_ids": [1, 2, 3], "model_name": "\xff"}'),
        (b"/route", b'{"token_ids": [1, 2, 3], "model_name": "\xff"}'),
    ):
        req = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (
            path,
            len(body),
            body,
        )
        got = responses(await asyncio.to_thread(exchange, service.port, req))
        assert got[0][0] == 400, (path, got[0])
        assert json.loads(got[0][2])["type"] == "BadRequestError"


async def test_http_1_0_head_and_unknown_methods(service: IndexService) -> None:
    got = responses(
        await asyncio.to_thread(
            exchange, service.port, b"GET /peers HTTP/1.0\r\n\r\n" + GET_HEALTH, shut=False
        )
    )
    assert [r[0] for r in got] == [200]  # closed after the HTTP/1.0 answer
    assert got[0][1]["connection"] == "close"
    head = b"HEAD /peers HTTP/1.1\r\nhost: x\r\n\r\n"
    data = await asyncio.to_thread(exchange, service.port, head)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n")
    assert data.endswith(b"\r\n\r\n")
    got = responses(await asyncio.to_thread(exchange, service.port, b"PUT /peers HTTP/1.1\r\n\r\n"))
    assert got[0][0] == 405
    assert got[0][1]["allow"] == "GET"


async def test_shutdown_closes_idle_connections_and_stops_accepting() -> None:
    svc = IndexService(ServeConfig(port=0, block_size=BS))
    await svc.start()
    port = svc.port
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(GET_HEALTH)
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    await svc.aclose()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the service
    writer.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


_valid = st.sampled_from(
    [
        GET_HEALTH,
        GET_PEERS,
        post("/query", b'{"token_ids": [1, 2, 3, 4, 5]}'),
        post("/query_by_hash", b'{"block_hashes": [1, -2]}'),
        post("/register", b'{"instance_id": 1, "endpoint": "tcp://127.0.0.1:1"}'),
        b"POST /query HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n3\r\n[1]\r\n0\r\n\r\n",
        b"GET /workers HTTP/1.0\r\nconnection: keep-alive\r\n\r\n",
    ]
)


@st.composite
def _raw_streams(draw: st.DrawFn) -> list[bytes]:
    """Valid requests, spliced with random bytes, truncated, and cut into random reads."""
    data = b"".join(draw(st.lists(_valid, min_size=1, max_size=4)))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(data)))
        how = draw(st.sampled_from(["insert", "replace", "delete", "cut"]))
        junk = draw(st.binary(min_size=1, max_size=12))
        if how == "insert":
            data = data[:at] + junk + data[at:]
        elif how == "replace":
            data = data[:at] + junk + data[at + len(junk) :]
        elif how == "delete":
            data = data[:at] + data[at + len(junk) :]
        else:
            data = data[:at]
    if draw(st.booleans()):
        data = draw(st.binary(max_size=200))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=4)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


async def test_fuzzed_bytes_on_the_socket_never_crash_the_service(
    service: IndexService,
) -> None:
    port = service.port
    assert port is not None

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(parts=_raw_streams())
    def one(parts: list[bytes]) -> None:
        data = exchange(port, *parts, reset_ok=True)
        for status, _, body in responses(data, partial_ok=True):
            assert status < 500, (parts, status, body)
            if status >= 400:
                assert "type" in json.loads(body)

    await asyncio.to_thread(one)
    with Client(service.url) as c:
        assert await asyncio.to_thread(c.health)
    assert service._server is not None
    assert not service._server.tasks

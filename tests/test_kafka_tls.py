"""Every Kafka reader and writer over real TLS: tansu behind stunnel (tests/tls_broker.py).

One topic is written through TLS by ``kvstream demo`` (pipeline -> Kafka sink, then read back
by the sink, over TLS) and read again over TLS by ``kvstream index``, by ``kvstream bridge``
(its Kafka source) and by ``kvstream shard``: before the shared security options, the three
readers refused ``security_protocol`` as an unknown option. Mutual TLS (a client certificate
whose key is encrypted) and the failures a user meets (an untrusted broker, no client
certificate) are checked too, and no secret reaches any output.

SASL: the only installable broker, tansu 0.6, speaks SCRAM when started with
``--authentication`` but cannot hold a user (``tansu user create`` answers success and stores
nothing, memory or S3 storage alike: every login gets ``e=unknown-user``) and does not offer
PLAIN. So the SCRAM test below shows the settings reach a real broker that negotiates SCRAM
with us, and that a refused login is a clean error; successful SASL logins are not tested
against a broker (test_kafka_security.py checks the exact aiokafka arguments).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka_broker import BrokerUnavailable, _answers, free_port, tansu_binary
from tls_broker import KEY_PASSWORD, Pki, TlsBroker, make_pki, stunnel_binary

from kvstream.errors import PermanentSinkError
from kvstream.events.model import EventBatch, SourceId
from kvstream.index.errors import SourceError
from kvstream.index.sources.kafka import KafkaSource
from kvstream.sink import create_sink

pytestmark = pytest.mark.kafka

KVSTREAM = [sys.executable, "-m", "kvstream.cli.main"]
SECRET = "tls-test-secret-never-printed"


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTREAM_KAFKA_")}
    return subprocess.run(
        [*KVSTREAM, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "COLUMNS": "200"},
        check=False,
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _start(pki: Pki, directory: Path, *, client_auth: bool) -> TlsBroker:
    try:
        tansu_binary()
        stunnel_binary()
        return TlsBroker(pki, directory, client_auth=client_auth).start()
    except BrokerUnavailable as exc:
        pytest.skip(f"no TLS Kafka endpoint for tests: {exc}")


@pytest.fixture(scope="module")
def tls(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsBroker]:
    broker = _start(pki, tmp_path_factory.mktemp("tls"), client_auth=False)
    yield broker
    broker.close()


@pytest.fixture(scope="module")
def mtls(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsBroker]:
    broker = _start(pki, tmp_path_factory.mktemp("mtls"), client_auth=True)
    yield broker
    broker.close()


def tls_url(broker: TlsBroker, topic: str, **extra: str) -> str:
    query = {"security_protocol": "SSL", "ssl_cafile": str(broker.pki.ca), **extra}
    return f"kafka://{broker.bootstrap}/{topic}?" + "&".join(f"{k}={v}" for k, v in query.items())


@pytest.fixture(scope="module")
def written(tls: TlsBroker) -> dict[str, Any]:
    """``kvstream demo`` through the Kafka sink over TLS: everything read back identical."""
    url = tls_url(tls, "kv-tls", partitions="2")
    done = run_cli("demo", "--sink", url, "--requests", "40", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["ok"], result
    return result


def test_sink_round_trip_over_tls(written: dict[str, Any]) -> None:
    (sink,) = written["sinks"]
    assert sink["ok"], sink
    assert written["events"] > 0


def test_index_reads_over_tls(tls: TlsBroker, written: dict[str, Any]) -> None:
    done = run_cli("index", tls_url(tls, "kv-tls"), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["batches"] == written["batches"]
    assert len(result["workers"]) == 2  # both ranks


def test_bridge_reads_kafka_over_tls(
    tls: TlsBroker, written: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "files"
    done = run_cli(
        "bridge", tls_url(tls, "kv-tls"), "--no-follow", "--sink", "file", "--out", str(out),
        "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"]
    assert (result["batches"], result["events"]) == (written["batches"], written["events"])


def test_shard_reads_over_tls(tls: TlsBroker, written: dict[str, Any]) -> None:
    done = run_cli(
        "shard", tls_url(tls, "kv-tls"), "--shard", "0/1", "--no-follow", "--block-size", "16"
    )  # the demo's chat workload: 16 tokens per block
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines[0]["shard"] == "0/1"
    assert lines[-1]["batches"] == written["batches"]
    assert lines[-1]["workers"] == 2


def test_an_untrusted_broker_is_a_clean_error(tls: TlsBroker) -> None:
    url = tls_url(tls, "kv-tls").replace(str(tls.pki.ca), str(tls.pki.other_ca))
    done = run_cli("index", url, "--json")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "CERTIFICATE_VERIFY_FAILED" in done.stderr or "certificate verify" in done.stderr


def _batch(i: int) -> EventBatch:
    from kvstream.events.model import KVCacheEvent, Removed

    ev = KVCacheEvent(
        event_id=i,
        hash_algo="v2_sha256_64",
        layer_group_id=0,
        window_size=64,
        data=Removed(block_hashes=[(1000 + i).to_bytes(8, "big")]),
    )
    return EventBatch(
        source=SourceId(instance_id="mtls", attention_dp_rank=0, incarnation=1),
        ts_ns=1 + i,
        events=[ev],
    )


async def _drain(source: KafkaSource) -> list[EventBatch]:
    out: list[EventBatch] = []
    async with source:
        async for item in source:
            out.append(item.batch)
    return out


async def test_mutual_tls_with_an_encrypted_client_key(mtls: TlsBroker, tmp_path: Path) -> None:
    pki = mtls.pki
    password = tmp_path / "key-password"
    password.write_text(KEY_PASSWORD + "\n")
    url = tls_url(
        mtls,
        "kv-mtls",
        ssl_certfile=str(pki.client_cert),
        ssl_keyfile=str(pki.client_key),
        ssl_password_file=str(password),
    )
    sink = create_sink(url + "&partitions=1&request_timeout_ms=10000")
    try:
        await sink.start()
        result = await sink.export([_batch(i) for i in range(5)])
        assert result.ok, result.reason
    finally:
        await sink.shutdown(10)
    got = await _drain(KafkaSource.from_url(url + "&stop_at_end=1"))
    assert [b.events[0].event_id for b in got] == list(range(5))

    # no client certificate: the broker hangs up during the handshake; a clean SourceError
    bare = KafkaSource.from_url(tls_url(mtls, "kv-mtls") + "&stop_at_end=1&request_timeout_ms=5000")
    with pytest.raises(SourceError, match="cannot read kv-mtls"):
        await _drain(bare)


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """tansu requiring SASL authentication (``--authentication``); yields host:port."""
    try:
        binary = tansu_binary()
    except BrokerUnavailable as exc:
        pytest.skip(f"no Kafka broker for tests: {exc}")
    port = free_port()
    log = tmp_path_factory.mktemp("sasl") / "tansu.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                binary, "broker", "--authentication",
                "--listener-url", f"tcp://127.0.0.1:{port}",
                "--advertised-listener-url", f"tcp://127.0.0.1:{port}",
                "--storage-engine", "memory://tansu/",
            ],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 15
        while not _answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"tansu --authentication did not start: {log.read_text()[-500:]}")
            time.sleep(0.02)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def sasl_url(bootstrap: str, mechanism: str) -> str:
    return (
        f"kafka://{bootstrap}/kv?security_protocol=SASL_PLAINTEXT&sasl_mechanism={mechanism}"
        f"&sasl_username=alice&sasl_password={SECRET}"
    )


async def test_scram_reaches_a_broker_that_speaks_it(sasl_broker: str) -> None:
    source = KafkaSource.from_url(sasl_url(sasl_broker, "SCRAM-SHA-512") + "&stop_at_end=1")
    with pytest.raises(SourceError, match="SASL SCRAM-SHA-512 login as 'alice' refused") as info:
        await _drain(source)
    assert SECRET not in str(info.value)
    sink = create_sink(sasl_url(sasl_broker, "SCRAM-SHA-256"))
    with pytest.raises(PermanentSinkError, match="SASL SCRAM-SHA-256 login as 'alice' refused"):
        await sink.start()
    await sink.shutdown(1)


def test_a_refused_scram_login_on_the_command_line(sasl_broker: str) -> None:
    done = run_cli("index", sasl_url(sasl_broker, "SCRAM-SHA-256"), "--json")
    assert done.returncode == 1
    err = " ".join(done.stderr.split())
    assert "SASL SCRAM-SHA-256 login as 'alice' refused by the broker" in err
    assert "Traceback" not in err
    assert SECRET not in done.stdout + done.stderr


def test_replay_over_mutual_tls(mtls: TlsBroker) -> None:
    """The replay's workers publish through the Kafka sink and its index reads the topic back,
    both over mutual TLS (before: the sink's URL got a second '?' and the reader dropped the
    query); the key password given in the URL shows nowhere, human or JSON output."""
    pki = mtls.pki
    url = tls_url(
        mtls,
        "kv-replay",
        ssl_certfile=str(pki.client_cert),
        ssl_keyfile=str(pki.client_key),
        ssl_password=KEY_PASSWORD,
    )
    args = ["replay", "conversation", "-n", "30", "-w", "2", "--no-progress", "--sink", url]
    done = run_cli(*args, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert KEY_PASSWORD not in done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["requests"] == 30
    assert result["events"] > 0
    assert result["index"]["events"] == result["events"]  # every event came back from Kafka
    assert "ssl_password=***" in result["options"]["sink"]
    human = run_cli(*args)
    assert human.returncode == 0, human.stderr[-3000:]
    assert KEY_PASSWORD not in human.stdout + human.stderr
    assert "ssl_password=***" in " ".join(human.stdout.split()).replace(" ", "")

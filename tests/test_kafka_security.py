"""Kafka TLS/SASL settings (kvstream.kafka_security): one parser for every Kafka client.

What is checked here needs no broker: which settings are accepted and refused, where they
come from (URL, environment, config file, password files), the exact aiokafka keyword
arguments they turn into (SASL PLAIN and SCRAM: no installable broker authenticates SASL,
see docs/kafka-security.md), and that no secret is ever shown. The round trips over real TLS
are in test_kafka_tls.py.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from kvstream.errors import ConfigError
from kvstream.index.sources.kafka import KafkaSource
from kvstream.kafka_security import KafkaSecurity, Secret, redact_url
from kvstream.sink import create_sink, parse_sink_url

SECRET = "hunter2-not-for-logs"


def parse(options: dict[str, str], env: dict[str, str] | None = None) -> KafkaSecurity:
    return KafkaSecurity.from_options(options, environ=env or {})


def test_default_is_plaintext() -> None:
    sec = parse({})
    assert sec.client_kwargs() == {"security_protocol": "PLAINTEXT"}


@pytest.mark.parametrize(
    ("mechanism", "expected"),
    [
        ("plain", "PLAIN"),
        ("SCRAM-SHA-256", "SCRAM-SHA-256"),
        ("scram-sha-512", "SCRAM-SHA-512"),
    ],
)
def test_sasl_becomes_aiokafka_kwargs(mechanism: str, expected: str) -> None:
    sec = parse(
        {
            "security_protocol": "sasl_plaintext",
            "sasl_mechanism": mechanism,
            "sasl_username": "alice",
            "sasl_password": SECRET,
        }
    )
    assert sec.client_kwargs() == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": expected,
        "sasl_plain_username": "alice",
        "sasl_plain_password": SECRET,
    }


async def test_aiokafka_takes_the_kwargs(tmp_path: Path) -> None:
    """aiokafka's own constructors accept every combination (they validate mechanism and
    protocol names and want an SSLContext for SSL)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    password = tmp_path / "pw"
    password.write_text(SECRET + "\n")
    for options in (
        {"security_protocol": "SSL"},
        {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "alice",
            "sasl_password_file": str(password),
        },
        {
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "SCRAM-SHA-256",
            "sasl_username": "alice",
            "sasl_password_file": str(password),
        },
    ):
        kwargs = parse(options).client_kwargs()
        if "ssl_context" in kwargs:
            assert isinstance(kwargs["ssl_context"], ssl.SSLContext)
        if "sasl_plain_password" in kwargs:
            assert kwargs["sasl_plain_password"] == SECRET  # the file's trailing newline dropped
        for cls in (AIOKafkaProducer, AIOKafkaConsumer):
            client = cls(bootstrap_servers="127.0.0.1:1", **kwargs)
            await client.stop()  # never started


def test_ssl_context_verifies_the_broker(tmp_path: Path) -> None:
    sec = parse({"security_protocol": "SSL"})
    ctx = sec.client_kwargs()["ssl_context"]
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.check_hostname
    relaxed = parse({"security_protocol": "SSL", "ssl_check_hostname": "false"})
    assert not relaxed.ssl_context.check_hostname  # type: ignore[union-attr]
    assert relaxed.ssl_context.verify_mode == ssl.CERT_REQUIRED  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"security_protocol": "TLS"}, "security_protocol must be one of"),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI"},
            "sasl_mechanism must be one of",
        ),
        ({"security_protocol": "SASL_SSL", "sasl_username": "a"}, "needs sasl_username and"),
        ({"sasl_username": "a"}, "need security_protocol SASL_PLAINTEXT or SASL_SSL"),
        ({"ssl_cafile": "/etc/hostname"}, "need security_protocol SSL or SASL_SSL"),
        ({"security_protocol": "SSL", "ssl_cafile": "/nonexistent/ca.pem"}, "not a readable"),
        ({"security_protocol": "SSL", "ssl_cafile": "/etc/hostname"}, "does not load"),
        ({"security_protocol": "SSL", "ssl_keyfile": "/etc/hostname"}, "needs ssl_certfile"),
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_username": "a",
                "sasl_password": "x",
                "sasl_password_env": "X",
            },
            "one way",
        ),
        (
            {"security_protocol": "SASL_SSL", "sasl_username": "a", "sasl_password_env": "NOPE"},
            "environment variable NOPE",
        ),
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_username": "a",
                "sasl_password_file": "/nonexistent",
            },
            "cannot read sasl_password_file /nonexistent",
        ),
    ],
)
def test_bad_settings_are_refused_up_front(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(options)


def test_environment_and_config_file(tmp_path: Path) -> None:
    conf = tmp_path / "client.properties"
    conf.write_text(
        "# librdkafka's names work as they are\n"
        "security.protocol=SASL_SSL\n"
        "sasl.mechanism=SCRAM-SHA-256\n"
        "sasl.username=from-file\n"
        "sasl.password=file-secret\n"
    )
    env = {"KVSTREAM_KAFKA_CONFIG": str(conf)}
    sec = parse({}, env)
    assert (sec.security_protocol, sec.sasl_mechanism, sec.sasl_username) == (
        "SASL_SSL",
        "SCRAM-SHA-256",
        "from-file",
    )
    assert sec.client_kwargs()["sasl_plain_password"] == "file-secret"
    # the environment beats the file, the URL beats both
    env["KVSTREAM_KAFKA_SASL_PASSWORD"] = "env-secret"
    env["KVSTREAM_KAFKA_SASL_USERNAME"] = "from-env"
    sec = parse({"sasl_username": "from-url"}, env)
    assert sec.sasl_username == "from-url"
    assert sec.client_kwargs()["sasl_plain_password"] == "env-secret"
    # a URL asking for PLAINTEXT is not refused for the environment's SASL settings
    assert parse({"security_protocol": "PLAINTEXT"}, env).client_kwargs() == {
        "security_protocol": "PLAINTEXT"
    }
    # kafka_config in a URL
    sec = parse({"kafka_config": str(conf)})
    assert sec.sasl_username == "from-file"
    conf.write_text("security.protocol=SSL\nbogus=1\n")
    with pytest.raises(ConfigError, match="line 2: unknown option 'bogus'"):
        parse({"kafka_config": str(conf)})


def test_secrets_never_show(tmp_path: Path) -> None:
    sec = parse(
        {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "PLAIN",
            "sasl_username": "alice",
            "sasl_password": SECRET,
        }
    )
    shown = [repr(sec), str(sec), str(sec.describe()), repr(sec.sasl_password)]
    shown.append(f"{sec.sasl_password}")
    assert all(SECRET not in text for text in shown), shown
    assert sec.describe()["sasl_password"] == "***"
    assert Secret(SECRET) == Secret(SECRET)

    url = f"kafka://h:9093/t?security_protocol=SASL_SSL&sasl_password={SECRET}&x=1"
    assert redact_url(url) == "kafka://h:9093/t?security_protocol=SASL_SSL&sasl_password=***&x=1"
    assert SECRET not in redact_url(f"kafka://u:{SECRET}@h:1/t?ssl_password={SECRET}")
    # error messages quote URLs masked: an unknown option next to a password
    for build in (
        create_sink,
        KafkaSource.from_url,
        lambda u: parse_sink_url(u).check_keys(()),
    ):
        with pytest.raises(ConfigError) as info:
            build(url)
        assert SECRET not in str(info.value)
        assert "sasl_password=***" in str(info.value)


def test_every_kafka_client_takes_the_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: only the sink knew them; the index source (kvstream index, bridge, shard)
    refused them as unknown options."""
    pw = tmp_path / "pw"
    pw.write_text(SECRET)
    query = (
        "security_protocol=SASL_SSL&sasl_mechanism=SCRAM-SHA-512&sasl_username=alice"
        f"&sasl_password_file={pw}"
    )
    source = KafkaSource.from_url(f"kafka://127.0.0.1:9093/kv?{query}&stop_at_end=1")
    sink = create_sink(f"kafka://127.0.0.1:9093/kv?{query}")
    for sec in (source.security, sink.security):  # type: ignore[attr-defined]
        assert sec.client_kwargs()["sasl_mechanism"] == "SCRAM-SHA-512"
        assert sec.client_kwargs()["sasl_plain_password"] == SECRET
        assert sec.uses_ssl
    # the sink's historical spellings still work
    monkeypatch.setenv("KV_TEST_PW", SECRET)
    old = create_sink(
        "kafka://127.0.0.1:9093/kv?security_protocol=SASL_PLAINTEXT&sasl_plain_username=a"
        "&sasl_plain_password_env=KV_TEST_PW"
    )
    kwargs = old.security.client_kwargs()  # type: ignore[attr-defined]
    assert (kwargs["sasl_plain_username"], kwargs["sasl_plain_password"]) == ("a", SECRET)

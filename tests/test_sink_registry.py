"""The Sink interface helpers: export results, sink URLs, the registry and entry points."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import pytest

from kvstream import sink as sink_mod
from kvstream.errors import ConfigError, PermanentSinkError, RetriableSinkError, SinkError
from kvstream.events.model import EventBatch
from kvstream.pipeline import PipelineConfig
from kvstream.sink import (
    ExportResult,
    ExportStatus,
    Sink,
    SinkURL,
    available_sinks,
    create_sink,
    get_sink_factory,
    parse_sink_url,
    parse_size,
    register_sink,
)

ROOT = Path(__file__).resolve().parents[1]


def test_export_result_classification() -> None:
    assert ExportResult.success().ok
    assert ExportResult.from_exception(RetriableSinkError("x")).retriable
    assert ExportResult.from_exception(TimeoutError()).retriable
    assert ExportResult.from_exception(ConnectionResetError()).retriable
    assert ExportResult.from_exception(PermanentSinkError("x")).status is ExportStatus.PERMANENT
    assert ExportResult.from_exception(KeyError("bug")).status is ExportStatus.PERMANENT
    with pytest.raises(RetriableSinkError, match="later"):
        ExportResult.retry("later").raise_for_status()
    with pytest.raises(PermanentSinkError):
        ExportResult.permanent("never").raise_for_status()
    ExportResult.success().raise_for_status()


@pytest.mark.parametrize(
    ("url", "scheme", "netloc", "path", "params"),
    [
        ("memory", "memory", "", "", {}),
        ("memory?max_batches=5", "memory", "", "", {"max_batches": "5"}),
        ("file:///var/kv?format=jsonl", "file", "", "/var/kv", {"format": "jsonl"}),
        (
            "kafka://a:9092,b:9093/kv-events?partitions=8",
            "kafka",
            "a:9092,b:9093",
            "/kv-events",
            {"partitions": "8"},
        ),
    ],
)
def test_parse_sink_url(
    url: str, scheme: str, netloc: str, path: str, params: dict[str, str]
) -> None:
    u = parse_sink_url(url)
    assert (u.scheme, u.netloc, u.path, dict(u.params)) == (scheme, netloc, path, params)


def test_url_typed_getters_and_errors() -> None:
    u = parse_sink_url("file:///d?a=64MiB&b=1e3&c=0.5&d=yes&e=off&f=zz")
    assert u.get_int("a") == 64 * 1024 * 1024
    assert u.get_int("b") == 1000
    assert u.get_float("c") == 0.5
    assert u.get_bool("d")
    assert not u.get_bool("e")
    assert u.get_int("missing", 7) == 7
    with pytest.raises(ConfigError):
        u.get_int("f")
    with pytest.raises(ConfigError):
        u.get_bool("f")
    with pytest.raises(ConfigError, match="unknown parameter"):
        u.check_keys(["a"])
    assert parse_sink_url("kafka://h1:1,h2:2/t").hosts == ["h1:1", "h2:2"]
    for bad in ("", "not a url", "://x"):
        with pytest.raises(ConfigError):
            parse_sink_url(bad)
    assert parse_size("10kb") == 10_000
    assert parse_size("2KiB") == 2048
    with pytest.raises(ConfigError):
        parse_size("1.5")


def test_builtin_sinks_by_url(tmp_path: Path) -> None:
    from kvstream.sinks.file import FileSink
    from kvstream.sinks.memory import MemorySink

    assert {"memory", "file", "kafka"} <= set(available_sinks())
    mem = create_sink("memory?max_batches=3&name=m")
    assert isinstance(mem, MemorySink)
    assert mem.max_batches == 3
    assert mem.name == "m"
    f = create_sink(f"file://{tmp_path}?format=jsonl&rotate_bytes=1MiB&rotate_s=0")
    assert isinstance(f, FileSink)
    assert (f.format, f.rotate_bytes, f.rotate_s) == ("jsonl", 1024 * 1024, None)
    with pytest.raises(ConfigError, match="unknown sink"):
        create_sink("nosuch://x")
    with pytest.raises(ConfigError, match="unknown parameter"):
        create_sink("memory?bogus=1")
    with pytest.raises(ConfigError):
        create_sink("file://remotehost/dir")


def test_kafka_sink_url(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstream.sinks.kafka import KafkaSink

    monkeypatch.setenv("KV_PW", "s3cret")
    k = create_sink(
        "kafka://h1:9092,h2:9092/events?partitions=4&security_protocol=SASL_PLAINTEXT"
        "&sasl_mechanism=SCRAM-SHA-256&sasl_plain_username=u&sasl_plain_password_env=KV_PW"
        "&schema_registry_id=12&compression=gzip"
    )
    assert isinstance(k, KafkaSink)
    assert (k.bootstrap_servers, k.topic, k.partitions, k.create_topic) == (
        "h1:9092,h2:9092",
        "events",
        4,
        True,
    )
    opts = k._producer_options
    assert opts["sasl_plain_password"] == "s3cret"
    assert opts["sasl_mechanism"] == "SCRAM-SHA-256"
    assert opts["compression_type"] == "gzip"
    assert k.schema_registry_id == 12
    for bad in ("kafka://h:1", "kafka:///t", "kafka://h:1/t?sasl_plain_password_env=NOPE_X"):
        with pytest.raises(ConfigError):
            create_sink(bad)
    with pytest.raises(ConfigError, match="sets acks"):
        KafkaSink("h:1", "t", producer_options={"acks": 1})


class _Custom(Sink):
    scheme = "custom"

    async def export(self, batches: Sequence[EventBatch]) -> ExportResult:
        return ExportResult.success()

    @classmethod
    def from_url(cls, url: SinkURL) -> _Custom:
        return cls(name=url.get("name"))


def test_register_a_sink_in_process() -> None:
    register_sink("custom", _Custom)
    try:
        s = create_sink("custom://?name=c1")
        assert isinstance(s, _Custom)
        assert s.name == "c1"
        assert "custom" in available_sinks()
    finally:
        sink_mod._registered.pop("custom", None)


def test_third_party_entry_point_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = metadata.EntryPoint(
        name="thirdparty", value="test_sink_registry:_Custom", group=sink_mod.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(sink_mod, "_entry_points", {"thirdparty": ep})
    monkeypatch.setattr(sink_mod, "_registered", {})
    monkeypatch.setattr(sink_mod._entry_points_loaded, "is_set", lambda: True)
    assert isinstance(get_sink_factory("thirdparty")(parse_sink_url("thirdparty")), _Custom)


def test_package_declares_the_entry_points() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points."kvstream.sinks"]' in text
    for name in ("memory", "file", "kafka"):
        assert f'{name} = "kvstream.sinks.{name}:' in text


def test_a_missing_dependency_is_a_clear_sink_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sink_mod, "_registered", {})
    monkeypatch.setitem(sink_mod._BUILTINS, "ghost", "kvstream.sinks.no_such_module:Ghost")
    with pytest.raises(SinkError, match="could not be loaded"):
        get_sink_factory("ghost")


def test_memory_and_file_sinks_do_not_import_aiokafka() -> None:
    code = (
        "import sys\n"
        "from kvstream.sink import create_sink\n"
        "from kvstream.pipeline import Pipeline\n"
        "create_sink('memory'); create_sink('file:///tmp/kvstream-x')\n"
        "assert 'aiokafka' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---------------------------------------------------------------------------- config


def test_pipeline_config_overrides_and_sources(tmp_path: Path) -> None:
    cfg = PipelineConfig.load(
        defaults={"linger_s": 0.01, "retry": {"deadline_s": 5}},
        sinks={"kafka": {"overflow": "block", "retry": {"max_backoff_s": 1}}},
    )
    k = cfg.policy_for("kafka")
    assert k.overflow.value == "block"
    assert k.linger_s == 0.01
    assert k.retry.deadline_s == 5
    assert k.retry.max_backoff_s == 1
    assert cfg.policy_for("other") is cfg.defaults
    env = {
        "KVSTREAM_PIPELINE_HANDOFF_TIMEOUT_S": "0.002",
        "KVSTREAM_PIPELINE_DEFAULTS__OVERFLOW": "drop_newest",
        "KVSTREAM_PIPELINE_DEFAULTS__RETRY__DEADLINE_S": "null",
        "OTHER": "x",
    }
    e = PipelineConfig.from_env(env)
    assert e.handoff_timeout_s == 0.002
    assert e.defaults.overflow.value == "drop_newest"
    assert e.defaults.retry.deadline_s is None
    path = tmp_path / "p.json"
    path.write_text('{"name": "n", "defaults": {"max_queue_batches": 3}}')
    f = PipelineConfig.from_file(path)
    assert f.name == "n"
    assert f.defaults.max_queue_batches == 3
    for bad in (
        {"defaults": {"overflow": "sometimes"}},
        {"defaults": {"retry": {"initial_backoff_s": 2, "max_backoff_s": 1}}},
        {"sinks": {"x": {"linger_s": -1}}},
        {"bogus": 1},
    ):
        with pytest.raises(ConfigError):
            PipelineConfig.load(bad)
    path.write_text("[1]")
    with pytest.raises(ConfigError):
        PipelineConfig.from_file(path)

"""The service's settings: worker specs, source options, precedence of flags, environment and
file, and what a feed name shows (no secrets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstream.errors import ConfigError
from kvstream.serve import ServeConfig, SourceSpec, WorkerSpec, parse_workers
from kvstream.serve.config import parse_source
from kvstream.serve.feeds import StreamFeed
from kvstream.serve.models import ModelIndex, ModelKey


def test_worker_specs_take_dynamos_syntax_and_a_replay_endpoint() -> None:
    assert parse_workers("1=tcp://h:5557, 1:1=tcp://h:5558;tcp://h:6558") == [
        WorkerSpec(1, 0, "tcp://h:5557"),
        WorkerSpec(1, 1, "tcp://h:5558", "tcp://h:6558"),
    ]
    for bad, why in [
        ("1", "expected ID"),
        ("x=tcp://h:1", "must be integers"),
        ("1=http://h:1", "tcp://HOST:PORT"),
        ("1=tcp://h:99999", "tcp://HOST:PORT"),
        ("1=tcp://h:1,1=tcp://h:2", "listed twice"),
        (f"{2**64}=tcp://h:1", "out of range"),
    ]:
        with pytest.raises(ConfigError, match=why):
            parse_workers(bad)


def test_source_options_pick_the_model_and_leave_the_rest_to_the_source() -> None:
    spec = parse_source("kafka://b:9092/t?block_size=16&model_name=m&group_id=g")
    assert spec == SourceSpec("kafka://b:9092/t?group_id=g", "m", "default", 16)
    assert parse_source("/var/lib/kv") == SourceSpec("/var/lib/kv")
    with pytest.raises(ConfigError, match="block_size"):
        parse_source("kafka://b:9092/t?block_size=x")


def test_flags_override_the_environment_which_overrides_the_file(tmp_path: Path) -> None:
    f = tmp_path / "serve.json"
    f.write_text(json.dumps({"port": 1, "block_size": 8, "model_name": "from-file"}))
    env = {"KVSTREAM_SERVE_PORT": "2", "KVSTREAM_SERVE_WORKERS": "3=tcp://h:9"}
    cfg = ServeConfig.load(f, env, port=3, host=None)
    assert (cfg.port, cfg.block_size, cfg.model_name) == (3, 8, "from-file")
    assert cfg.workers == (WorkerSpec(3, 0, "tcp://h:9"),)
    with pytest.raises(ConfigError, match="--workers needs --block-size"):
        ServeConfig.load(None, {}, workers="1=tcp://h:1")
    with pytest.raises(ConfigError, match="both --tls-cert and --tls-key"):
        ServeConfig.load(None, {}, tls_cert=tmp_path / "c.pem")
    with pytest.raises(ConfigError, match="port"):
        ServeConfig.load(None, {}, port=70000)
    with pytest.raises(ConfigError, match="cannot read serve config"):
        ServeConfig.load(tmp_path / "missing.json", {})


def test_a_feed_name_never_shows_a_password() -> None:
    url = "kafka://b:9093/t?security_protocol=SASL_SSL&sasl_username=u&sasl_password=hunter2"
    feed = StreamFeed(parse_source(url), ModelIndex(ModelKey("m", "g"), 16))
    assert "hunter2" not in feed.name
    assert "***" in feed.name

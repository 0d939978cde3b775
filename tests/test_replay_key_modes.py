"""``kvstream replay --key-mode tokens`` (documented in docs/index.md) under every router
policy: a token-keyed index finds exactly the blocks an engine-keyed one finds, so the two
replays route and reuse alike."""

from __future__ import annotations

import json
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvstream.cli import replay_cmd

app = typer.Typer()
app.callback()(lambda: None)  # a command group, as in kvstream's own app
app.command("replay")(replay_cmd.replay)
runner = CliRunner()
# the synthetic trace reuses prefixes from its first rows on
SMALL = ["synthetic", "-n", "200", "-w", "3", "-c", "600", "--no-progress", "--json"]
POLICIES = ["kv", "least_loaded", "round_robin", "random", "global_lru"]


def replay(*args: str) -> dict[str, Any]:
    res = runner.invoke(app, ["replay", *SMALL, *args])
    assert res.exit_code == 0, res.output
    out: dict[str, Any] = json.loads(res.stdout)
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_token_keyed_replay_matches_engine_keyed(policy: str) -> None:
    tokens = replay("--router", policy, "--key-mode", "tokens")
    engine = replay("--router", policy, "--key-mode", "engine")
    assert tokens["requests"] + tokens["unservable"] == 200
    assert tokens["prediction_accuracy"] == 1.0  # the index saw what the workers then reused
    for key in ("requests", "hit_blocks", "prompt_blocks", "unservable"):
        assert tokens[key] == engine[key], key
    assert [w["requests"] for w in tokens["workers"]] == [w["requests"] for w in engine["workers"]]
    assert tokens["hit_blocks"] > 0


def test_compare_in_token_mode_runs_every_policy() -> None:
    out = replay("--key-mode", "tokens", "--compare", ",".join(POLICIES))
    assert out["policies"] == ["kv", "least-loaded", "round-robin", "random", "global-lru"]
    assert all(r["prediction_accuracy"] == 1.0 for r in out["runs"])

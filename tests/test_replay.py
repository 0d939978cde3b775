"""``kvstream replay``'s scheduler: every request served or unservable, per-worker queues,
the modelled time to first token, and the counting the ratios share."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvstream.cli.replay_run import ReplayOptions, ReplayResult, run_replay
from kvstream.errors import ConfigError

BS = 512


def write(path: Path, rows: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def replay(**kw: object) -> ReplayResult:
    return asyncio.run(run_replay(ReplayOptions(**kw)))  # type: ignore[arg-type]


def chain(conv: int, n: int) -> list[int]:
    """Hash ids of conversation ``conv``'s first ``n`` blocks (block 0 shared by all)."""
    return [0] + [1000 * conv + i for i in range(1, n)]


def busy_trace(tmp_path: Path) -> str:
    rows = []
    for i in range(40):  # 4 conversations, turns growing; everything arrives within 4 s
        conv, turn = i % 4, i // 4
        n = 3 + turn % 4
        rows.append(
            {"timestamp": 100 * i, "input_length": n * BS - 7, "output_length": 30,
             "hash_ids": chain(conv, n)}
        )  # fmt: skip
    rows.append(  # needs 9 blocks: more than a worker's whole cache
        {"timestamp": 50, "input_length": 9 * BS, "output_length": 1, "hash_ids": chain(9, 9)}
    )
    return write(tmp_path / "busy.jsonl", rows)


def test_every_request_is_served_or_reported_unservable(tmp_path: Path) -> None:
    trace = busy_trace(tmp_path)
    r = replay(trace=trace, workers=2, capacity_blocks=8, decode_ms_per_token=200.0)
    assert r.trace_requests == 41
    assert r.unservable == 1
    assert r.requests == 40 == sum(w.requests for w in r.workers)
    assert max(r.queue_s) > 0  # cache full: requests waited in their worker's queue
    assert r.requeried > 0  # ... and were matched again when admitted
    assert r.prediction_accuracy == 1.0
    assert 0 < r.hit_ratio <= r.ceiling_ratio <= 1.0
    # the ceiling counts the same 40 requests' blocks as the ratio
    assert r.prompt_blocks == sum(
        -(-(n * BS - 7) // BS) for n in [3 + (i // 4) % 4 for i in range(40)]
    )
    assert len(r.ttft_s) == len(r.queue_s) == 40
    d = r.as_dict()
    assert d["unservable"] == 1
    assert d["ttft_s"]["p99"] >= d["ttft_s"]["p50"] > 0
    assert d["queue_s"]["p99"] > 0


@pytest.mark.parametrize(("tps", "decode_ms"), [(500.0, 500.0), (1e6, 0.0), (2000.0, 5.0)])
def test_timing_moves_when_requests_are_served_never_whether(
    tmp_path: Path, tps: float, decode_ms: float
) -> None:
    trace = busy_trace(tmp_path)
    r = replay(
        trace=trace,
        workers=2,
        capacity_blocks=8,
        prefill_tokens_per_s=tps,
        decode_ms_per_token=decode_ms,
    )
    assert (r.requests, r.unservable) == (40, 1)
    assert r.prediction_accuracy == 1.0
    assert r.ceiling_ratio <= 1.0


def test_modelled_ttft_is_queue_wait_plus_uncached_prefill(tmp_path: Path) -> None:
    trace = write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1100, "output_length": 0, "hash_ids": [0, 1, 2]},
            {"timestamp": 0, "input_length": 600, "output_length": 0, "hash_ids": [5, 6]},
            {"timestamp": 60_000, "input_length": 1100, "output_length": 0,
             "hash_ids": [0, 1, 2]},
        ],
    )  # fmt: skip
    r = replay(trace=trace, workers=1, capacity_blocks=64, prefill_tokens_per_s=100.0)
    # 1: nothing cached; 2: waits for 1's prefill (11 s); 3: reuses 2 full blocks
    assert r.queue_s == pytest.approx([0.0, 11.0, 0.0])
    assert [(x.index, x.queue_s, x.hit_blocks) for x in r.per_request] == [
        (0, 0.0, 0),
        (1, pytest.approx(11.0), 0),
        (2, 0.0, 2),
    ]
    assert r.ttft_s == pytest.approx([11.0, 17.0, (1100 - 1024) / 100.0])
    assert r.hit_blocks == 2
    assert r.ceiling_blocks == 2


def test_global_lru_is_one_cache_of_every_worker_together(tmp_path: Path) -> None:
    trace = busy_trace(tmp_path)
    r = replay(trace=trace, workers=2, capacity_blocks=8, router="global_lru")
    assert r.policy == "global-lru"
    assert r.options.workers == 2  # reported with the configuration it stands for
    assert len(r.workers) == 1
    assert r.imbalance == 1.0
    assert r.unservable == 0  # 9 blocks fit one cache of 16
    assert r.requests == 41


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown router"):
        replay(router="fastest", limit=3)
    with pytest.raises(ConfigError, match="overlap-weight"):
        replay(overlap_weight=-1.0, limit=3)
    with pytest.raises(ConfigError, match="prefill"):
        replay(prefill_tokens_per_s=0.0, limit=3)


def test_token_id_trace_replays_with_its_own_tokens(tmp_path: Path) -> None:
    system = list(range(100, 164))
    rows = [
        {"timestamp": 10 * i, "tokens": [*system, *range(i * 7, i * 7 + 20)],
         "output_length": 5}
        for i in range(12)
    ]  # fmt: skip
    trace = write(tmp_path / "tok.jsonl", rows)
    r = replay(trace=trace, workers=2, capacity_blocks=64)
    assert r.block_size == 16  # vLLM's default for token traces
    assert r.requests == 12
    assert r.prediction_accuracy == 1.0
    # the 4 system-prompt blocks are reused by every request after the first on each worker
    assert r.hit_blocks >= 4 * (12 - 2)
    assert r.hit_ratio <= r.ceiling_ratio <= 1.0


def test_adaptive_router_beats_fixed_weights_on_a_trace_it_was_not_tuned_on(
    tmp_path: Path,
) -> None:
    """Agent-like chats (kvstream's own generator, as token ids): long shared system prompts,
    growing histories, a cache that must queue. No flag changes between the runs."""
    from kvstream.workloads import ChatWorkload, multi_turn_chats

    work = ChatWorkload(
        num_conversations=80,
        turns=(2, 8),
        num_system_prompts=6,
        system_prompt_tokens=(512, 2048),
        user_tokens=(32, 512),
        output_tokens=(32, 256),
        duration_ms=80 * 150.0,
        think_time_ms=(1000.0, 15000.0),
        seed=7,
    )
    rows = [
        {"timestamp": round(r.arrival_ms), "tokens": r.prompt.tolist(),
         "output_length": len(r.output)}
        for r in multi_turn_chats(work)
    ]  # fmt: skip
    trace = write(tmp_path / "chats.jsonl", rows)
    adaptive = replay(trace=trace, workers=4, capacity_blocks=600)
    assert adaptive.prediction_accuracy == 1.0
    assert adaptive.requests == len(rows)
    for weight in (1.0, 4.0):  # Dynamo's default, and the weight that suits conversation
        fixed = replay(trace=trace, workers=4, capacity_blocks=600, overlap_weight=weight)
        assert adaptive.hit_ratio > fixed.hit_ratio, weight
        assert adaptive.ttft(0.5) < fixed.ttft(0.5), weight
    assert adaptive.imbalance < 1.5  # 375 requests in sticky conversations: a noisy count

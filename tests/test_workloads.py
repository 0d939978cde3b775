"""Workloads: the Mooncake trace loader and the synthetic multi-turn chat generator."""

from __future__ import annotations

import json
from itertools import islice, pairwise
from pathlib import Path

import pytest

from kvstream._types import TokenIds
from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.errors import KVStreamError
from kvstream.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    ChatWorkload,
    DataNotFoundError,
    MooncakeTokens,
    TraceFormatError,
    TraceRow,
    WorkloadRequest,
    data_dir,
    load_trace,
    mooncake_requests,
    multi_turn_chats,
    pseudo_tokens,
)


def _real_trace_available() -> bool:
    try:
        data_dir()
    except DataNotFoundError:
        return False
    return (data_dir() / "mooncake" / "conversation_trace.jsonl").is_file()


needs_trace = pytest.mark.skipif(
    not _real_trace_available(), reason="shared/data/mooncake is not present"
)


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 7, "input_length": 1024, "output_length": 0, "hash_ids": [0, 1]},
    {"timestamp": 9, "input_length": 600, "output_length": 3, "hash_ids": [0, 3]},
]


def test_pseudo_tokens_are_deterministic_and_in_range() -> None:
    a = pseudo_tokens(b"k", 1000, 50)
    assert a == pseudo_tokens(b"k", 1000, 50)
    assert a != pseudo_tokens(b"j", 1000, 50)
    assert len(a) == 1000
    assert max(a) < 50
    assert isinstance(a, TokenIds)
    assert pseudo_tokens(b"k", 10, 50) == a[:10]  # a prefix of the same stream
    assert len(pseudo_tokens(b"k", 0, 50)) == 0


def test_mooncake_rows_become_exact_length_prompts_with_shared_prefixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_trace(tmp_path / "mooncake" / "conversation_trace.jsonl", ROWS)
    monkeypatch.setenv("KVSTREAM_DATA_DIR", str(tmp_path))
    rows = load_trace("conversation")
    assert rows[0] == TraceRow(0, 0, 1100, 5, (0, 1, 2))
    assert [r.index for r in rows] == [0, 1, 2]
    toks = MooncakeTokens(seed=3)
    prompts = [toks.prompt(r) for r in rows]
    assert [len(p) for p in prompts] == [1100, 1024, 600]
    assert prompts[0][:1024] == prompts[1]  # ids 0, 1 shared
    assert prompts[2][:512] == prompts[0][:512]
    assert prompts[2][512:] != prompts[0][512:600]
    assert toks.block(2)[: 1100 - 1024] == prompts[0][1024:]  # the last block is cut short
    assert len(toks.output(rows[0])) == 5
    assert MooncakeTokens(seed=4).prompt(rows[0]) != prompts[0]
    reqs = list(mooncake_requests(rows, seed=3))
    assert [r.request_id for r in reqs] == ["m0", "m1", "m2"]
    assert reqs[1].prompt == prompts[1]
    assert reqs[2].arrival_ms == 9.0
    assert load_trace(tmp_path / "mooncake" / "conversation_trace.jsonl", limit=2) == rows[:2]


def test_mooncake_tokens_reproduce_the_trace_prefix_structure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_trace(tmp_path / "mooncake" / "conversation_trace.jsonl", ROWS)
    monkeypatch.setenv("KVSTREAM_DATA_DIR", str(tmp_path))
    cfg = CacheConfig(
        tokens_per_block=MOONCAKE_BLOCK_TOKENS,
        groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=64)],
        metadata_only=True,
        events=False,
    )
    mgr = KVCacheManager(cfg)
    matched = []
    for req in mooncake_requests(load_trace("conversation")):
        matched.append(mgr.add_request(req.request_id, req.prompt).reusable_tokens)
        mgr.free_request(req.request_id)
    assert matched == [0, 512, 512]  # row 1's last block holds its last token: recomputed


def test_missing_data_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTREAM_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(DataNotFoundError, match="KVSTREAM_DATA_DIR") as exc:
        load_trace("conversation")
    assert isinstance(exc.value, FileNotFoundError)
    assert isinstance(exc.value, KVStreamError)
    monkeypatch.setenv("KVSTREAM_DATA_DIR", str(tmp_path))
    with pytest.raises(DataNotFoundError, match="synthetic"):
        load_trace("synthetic")
    with pytest.raises(DataNotFoundError, match="not found"):
        load_trace(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0, 1]}',
            "2 hash_ids",
        ),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [0]}', "output_length"),
    ],
)
def test_malformed_rows_name_line_and_field(tmp_path: Path, row: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + row + "\n")
    with pytest.raises(TraceFormatError, match=message) as exc:
        load_trace(path)
    assert "t.jsonl:2" in str(exc.value)


@needs_trace
def test_real_conversation_trace_loads() -> None:
    rows = load_trace("conversation")
    assert len(rows) == 12031
    assert sum(r.input_length for r in rows) / len(rows) == pytest.approx(12035, abs=1)
    assert all(r.hash_ids[0] == 0 for r in rows[:100])


@needs_trace
def test_real_trace_prefix_hits_match_the_trace_ceiling() -> None:
    rows = load_trace("conversation", limit=400)
    seen: set[int] = set()
    ceiling = 0
    for r in rows:  # a full block hits when its id (and so its whole prefix) was seen before
        full = r.input_length // MOONCAKE_BLOCK_TOKENS
        k = 0
        while (
            k < min(full, (r.input_length - 1) // MOONCAKE_BLOCK_TOKENS) and r.hash_ids[k] in seen
        ):
            k += 1
        ceiling += k
        seen.update(r.hash_ids[:full])
    cfg = CacheConfig(
        tokens_per_block=MOONCAKE_BLOCK_TOKENS,
        groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=20_000)],
        metadata_only=True,
        events=False,
    )
    mgr = KVCacheManager(cfg)
    for req in mooncake_requests(rows):
        mgr.add_request(req.request_id, req.prompt)
        mgr.free_request(req.request_id)
    assert mgr.stats().groups[0].hit_blocks == ceiling > 0


def test_chat_workload_shares_system_prompts_and_grows_histories() -> None:
    w = ChatWorkload(num_conversations=12, turns=(2, 4), num_system_prompts=2, seed=5)
    reqs = list(multi_turn_chats(w))
    assert reqs == list(multi_turn_chats(w))  # deterministic
    assert reqs != list(multi_turn_chats(ChatWorkload(num_conversations=12, seed=6)))
    assert [r.arrival_ms for r in reqs] == sorted(r.arrival_ms for r in reqs)
    assert len({r.request_id for r in reqs}) == len(reqs)
    by_conv: dict[int, list[WorkloadRequest]] = {}
    for r in reqs:
        assert r.conversation is not None
        by_conv.setdefault(r.conversation, []).append(r)
    assert len(by_conv) == 12
    for turns in by_conv.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert 2 <= len(turns) <= 4
        for prev, nxt in pairwise(turns):
            history = prev.prompt + prev.output
            assert nxt.prompt[: len(history)] == history
            assert len(nxt.prompt) > len(history)
    firsts = [t[0].prompt for t in by_conv.values()]
    lo = w.system_prompt_tokens[0]
    assert len({p[:lo] for p in firsts}) <= 2  # only two system prompts


def test_chat_workload_validates_parameters() -> None:
    with pytest.raises(ValueError, match="turns"):
        ChatWorkload(turns=(3, 2))
    with pytest.raises(ValueError, match="num_system_prompts"):
        ChatWorkload(num_system_prompts=0)
    assert list(islice(multi_turn_chats(ChatWorkload(num_conversations=0)), 3)) == []

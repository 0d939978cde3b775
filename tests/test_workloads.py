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
    infer_block_tokens,
    load_trace,
    mooncake_requests,
    multi_turn_chats,
    packaged_data_dir,
    pseudo_tokens,
    trace_path,
)

SHIPPED_SHA256 = {  # of the uncompressed files, as shared/data/README.md lists them
    "conversation": "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
    "synthetic": "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
}


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
        (
            '{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [0]}',
            "output_length",
        ),
        ('{"input_length": 10, "output_length": 1, "hash_ids": [0]}', "no timestamp"),
        ('{"timestamp": 1, "output_length": 1}', "needs hash_ids"),
        ('{"timestamp": 1, "tokens": [1, -2]}', "tokens must hold ints"),
        ('{"timestamp": 1, "input_ids": []}', "non-empty"),
        ('{"timestamp": 1, "tokens": [1, 2], "input_length": 3}', "input_length 3"),
        ('{"timestamp": 1, "tokens": [1, 2], "output_ids": "x"}', "output_ids"),
    ],
)
def test_malformed_rows_name_line_and_field(tmp_path: Path, row: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + row + "\n")
    with pytest.raises(TraceFormatError, match=message) as exc:
        load_trace(path)
    assert "t.jsonl:2" in str(exc.value)


def test_real_conversation_trace_loads() -> None:
    rows = load_trace("conversation")
    assert len(rows) == 12031
    assert sum(r.input_length for r in rows) / len(rows) == pytest.approx(12035, abs=1)
    assert all(r.hash_ids[0] == 0 for r in rows[:100])


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


# ------------------------------------------------------------------ shipped traces, formats


@pytest.mark.parametrize("name", ["conversation", "synthetic"])
def test_shipped_traces_are_the_published_files(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import gzip
    import hashlib

    monkeypatch.delenv("KVSTREAM_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # found from any directory: they live in the package
    path = trace_path(name)
    assert path.parent == packaged_data_dir()
    assert hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest() == SHIPPED_SHA256[name]
    assert trace_path(f"mooncake-{name}") == path
    notice = (packaged_data_dir() / "NOTICE").read_text()
    assert "Apache License" in notice
    assert "kvcache-ai/Mooncake" in notice
    assert SHIPPED_SHA256[name] in notice
    assert data_dir() == packaged_data_dir()


def test_unknown_trace_name_lists_the_shipped_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTREAM_DATA_DIR", raising=False)
    with pytest.raises(DataNotFoundError, match="conversation, synthetic"):
        load_trace("toolagent")


def test_token_id_rows_are_their_own_prompts(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "tok.jsonl",
        [
            {"timestamp_s": 2.5, "tokens": [5, 6, 7], "output_length": 4},
            {"timestamp": 1000, "input_ids": [5, 6, 8, 9]},
            {"timestamp_ms": 1500, "prompt_token_ids": [1], "output_ids": [3, 3]},
        ],
    )
    rows = load_trace(path)
    assert [r.line for r in rows] == [2, 3, 1]  # arrival order, stable
    assert [r.timestamp_ms for r in rows] == [1000.0, 1500.0, 2500.0]
    assert [r.output_length for r in rows] == [0, 2, 4]
    assert [r.input_length for r in rows] == [4, 1, 3]
    toks = MooncakeTokens()
    assert toks.prompt(rows[0]) == [5, 6, 8, 9]
    assert rows[0].hash_ids == ()
    assert len(toks.output(rows[2])) == 4
    s_rows = load_trace(path, time_unit="s")
    # a plain "timestamp" now counts seconds; the named units stay as they are
    assert [(r.line, r.timestamp_ms) for r in s_rows] == [(3, 1500), (1, 2500), (2, 1e6)]
    with pytest.raises(TraceFormatError, match="time unit"):
        load_trace(path, time_unit="h")


def test_hash_id_traces_of_other_block_sizes(tmp_path: Path) -> None:
    rows = [  # a Qwen-style trace: 16-token blocks, timestamps in seconds
        {"chat_id": 1, "timestamp": 0.5, "input_length": 40, "output_length": 3,
         "hash_ids": [1, 2, 3]},
        {"chat_id": 2, "timestamp": 1.25, "input_length": 33, "output_length": 3,
         "hash_ids": [1, 2, 4]},
    ]  # fmt: skip
    path = tmp_path / "qwen.jsonl.gz"
    import gzip

    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    got = load_trace(path, time_unit="s")
    assert [r.block_tokens for r in got] == [16, 16]
    assert [r.timestamp_ms for r in got] == [500.0, 1250.0]
    toks = MooncakeTokens()
    a, b = (toks.prompt(r) for r in got)
    assert len(a) == 40
    assert len(b) == 33
    assert a[:32] == b[:32]
    assert a[32:33] != b[32:33]
    assert load_trace(path, block_tokens=14)[0].block_tokens == 14  # also consistent
    with pytest.raises(TraceFormatError, match=r"qwen.jsonl.gz:1: 3 hash_ids .* 64-token"):
        load_trace(path, block_tokens=64)


def test_block_size_inference() -> None:
    assert infer_block_tokens([(1, 1100, 3), (2, 600, 2)]) == 512
    assert infer_block_tokens([(1, 40, 3), (2, 33, 3)]) == 16
    assert infer_block_tokens([(1, 10, 1)]) == 512
    assert infer_block_tokens([]) is None
    assert infer_block_tokens([(1, 7, 2), (2, 5, 2)]) == 4
    with pytest.raises(TraceFormatError, match="line 2"):
        infer_block_tokens([(1, 1100, 3), (2, 10, 2)])


def test_blocks_are_distinct_per_id_deterministic_and_in_vocabulary() -> None:
    toks = MooncakeTokens(seed=1, vocab_size=1000)
    blocks = [toks.block(h) for h in range(2000)]
    assert len({b.raw for b in blocks}) == 2000
    assert all(len(b) == MOONCAKE_BLOCK_TOKENS for b in blocks[:50])
    assert max(max(b) for b in blocks[:200]) < 1000
    assert MooncakeTokens(seed=1, vocab_size=1000).block(7) == blocks[7]
    assert MooncakeTokens(seed=2, vocab_size=1000).block(7) != blocks[7]
    assert len(toks.block(9, 2)) == 2  # shorter than the id stamp: straight from the XOF
    assert toks.block(9, 16)[:3] == toks.block(9)[:3]
    with pytest.raises(ValueError, match="too large"):
        toks.block(1000**3)

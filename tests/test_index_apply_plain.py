"""PrefixIndex.apply's lean pass for the batch engines send most (``_apply_plain``) against
its general loop: fed the same batches, two indexes end in the same state with the same
counters, whichever path each batch took, in every key mode. The batches: every frame captured
from vLLM and SGLang as the bridge's columns (the one-call C reader's, with token layouts), a
fleet's stream of stores and LRU removals through Avro, and generated batches of every kind
(gaps, lost markers, other groups and algorithms: the lean pass must decline those)."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec_strategies import batches

from kvstream.codec import AvroCodec, schema_registry
from kvstream.codec.columnar import decode_columns_message
from kvstream.engines.endpoint import DIALECTS
from kvstream.engines.stream import EngineStream
from kvstream.errors import KVStreamError
from kvstream.index import PrefixIndex
from kvstream.index.stats import SourceStats

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "data" / "golden"
MODES = ["engine", "tokens", "dynamo"]


class Pair:
    """Two indexes of one key mode: ``lean`` as shipped, ``general`` with the lean pass off."""

    def __init__(self, mode: str) -> None:
        self.lean = PrefixIndex(key_mode=mode)
        self.general = PrefixIndex(key_mode=mode)
        self.general._apply_plain = lambda *_: False  # type: ignore[method-assign]
        self.taken = 0

    def apply(self, batch: Any) -> None:
        real = self.lean._apply_plain
        took: list[bool] = []

        def spy(*args: Any) -> bool:
            took.append(real(*args))
            return took[-1]

        self.lean._apply_plain = spy  # type: ignore[method-assign]
        outcome = []
        for index in (self.lean, self.general):
            try:
                index.apply(batch)
                outcome.append(None)
            except KVStreamError as exc:
                outcome.append(type(exc))
        self.lean._apply_plain = real  # type: ignore[method-assign]
        self.taken += any(took)
        assert outcome[0] == outcome[1]

    def check(self) -> None:
        self.lean.check()
        assert self.lean.canonical_state() == self.general.canonical_state()
        lean = {k: dataclasses.asdict(s.stats) for k, s in self.lean._sources.items()}
        general = {k: dataclasses.asdict(s.stats) for k, s in self.general._sources.items()}
        assert lean == general


@pytest.mark.parametrize("mode", MODES)
def test_captured_engine_frames(mode: str) -> None:
    pair = Pair(mode)
    for capture in sorted(GOLDEN.glob("*/*.json")):
        doc = json.loads(capture.read_text())
        package = doc["producer"]["package"]
        algo = "sglang_sha256_64" if package == "sglang" else "vllm_sha256_cbor_64"
        if "-bytes-" in capture.name:
            algo = "vllm_sha256_cbor"
        stream = EngineStream(f"{package}@{capture.stem}", 0, algo, clock_ns=lambda: 1)
        for step in doc["live"]:
            pair.apply(stream.payload_columns(bytes.fromhex(step["frames"][2]), DIALECTS[package]))
            pair.check()
    # token-keyed, only the one-call reader's columns carry token layouts, and the captures
    # are mostly the shapes it leaves to Python (LoRA, extra keys, clears, placeholders)
    assert pair.taken >= 5


@pytest.mark.parametrize("mode", MODES)
def test_a_fleet_stream_through_avro(mode: str) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _fleet_workload import FleetSpec, fleet_batches

    spec = FleetSpec(
        workers=4,
        tokens=1024,
        block_size=16,
        systems=2,
        pool=8,
        requests=12,
        capacity=160,
        chunk=16,
    )
    stream, _, _ = fleet_batches(spec, seed=3)
    codec, reg = AvroCodec(), schema_registry()
    pair = Pair(mode)
    for batch in stream:
        pair.apply(decode_columns_message(codec.encode(batch), reg).columns)
    pair.check()
    assert pair.taken >= 100


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=st.lists(batches(), min_size=1, max_size=6),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**16),
)
def test_generated_batches(items: list[Any], mode: str, seed: int) -> None:
    # columns as a consumer decodes them (token layouts) and as models, in one stream
    codec, reg = AvroCodec(), schema_registry()
    rng = random.Random(seed)
    pair = Pair(mode)
    for batch in items:
        data = codec.encode(batch)
        pair.apply(decode_columns_message(data, reg).columns if rng.random() < 0.7 else batch)
        pair.check()


@pytest.mark.parametrize("mode", MODES)
def test_over_capacity_mid_batch(mode: str) -> None:
    # groups that advertise little room: stores go over it in the middle of lean batches,
    # which stop there (the worker goes stale) and go on from the next event, as the loop does
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _fleet_workload import FleetSpec, fleet_batches

    spec = FleetSpec(
        workers=3, tokens=512, block_size=16, systems=2, pool=6, requests=10, capacity=200,
        chunk=8,
    )  # fmt: skip
    stream, _, _ = fleet_batches(spec, seed=5)
    codec, reg = AvroCodec(), schema_registry()
    pair = Pair(mode)
    for batch in stream:
        for index in (pair.lean, pair.general):
            for s in index._sources.values():
                for g in s.groups.values():
                    g.limit = min(g.limit, 24)
        pair.apply(decode_columns_message(codec.encode(batch), reg).columns)
    pair.check()
    overflows = [s.stats.capacity_overflows for s in pair.lean._sources.values()]
    assert sum(overflows) >= 3
    assert pair.taken >= 20


def test_native_apply_refuses_bad_arguments() -> None:
    from kvstream.index.table import native_apply_plain

    native = native_apply_plain()
    if native is None:
        pytest.skip("no native core")
    call, (engine_table, token_table) = native
    t, tt = engine_table(1), token_table(1, True)
    st = PrefixIndex()._sources  # any object: nothing is flushed before the error
    h = b"\x01" * 8
    bad: list[tuple[Any, ...]] = [
        ([t], [9], [1], [(None, [h])], None, None, 0, st, 0, 0, 1),  # short store payload
        ([t], [9], [2], [7], None, None, 0, st, 0, 0, 1),  # removal not a tuple
        (["t"], [9], [2], [([h], None)], None, None, 0, st, 0, 0, 1),  # not a table
        ([t], [9], [1, 2], [(None, [h], 0, 1)], None, None, 0, st, 0, 0, 1),  # lengths
        ([t], [9], [1], [(None, [h], 0, 1)], [], b"", 0, st, 0, 0, 1),  # engine table, layout
        ([t], [9], [1], [(None, [h], 0, 1)], None, None, 0, st, -1, 0, 1),  # start < 0
        ((t,), [9], [1], [(None, [h], 0, 1)], None, None, 0, st, 0, 0, 1),  # not lists
        ([tt], [9], [1], [(None, [h], 0, 4)], [(0, [4])], b"\0" * 8, 0, st, 0, 0, 1),  # short
        ([tt], [9], [1], [(None, [h], 0, 4)], [(0, [-1])], b"", 0, st, 0, 0, 1),  # size < 0
        ([tt], [9], [1], [(None, [h], 0, 4)], [], b"", 0, st, 0, 0, 1),  # no layout entry
    ]
    for args in bad:
        with pytest.raises((TypeError, ValueError)):
            call(*args)
    assert len(t) == len(tt) == 0


def test_native_apply_takes_list_payloads_as_tuples() -> None:
    # payloads and layout entries as lists (what a caller may build) apply as tuples do
    from kvstream.index.table import native_apply_plain

    native = native_apply_plain()
    if native is None:
        pytest.skip("no native core")
    call, (_, token_table) = native
    tokens = bytes(range(64))  # 16 u32 token ids: two blocks of 8
    hashes = [b"\x01" * 8, b"\x02" * 8]
    got = []
    for as_list in (False, True):
        t = token_table(1, True)
        st = SourceStats()
        payload: Any = (None, hashes, 0, 8)
        entry: Any = (0, [8, 8])
        if as_list:
            payload, entry = list(payload), list(entry)
        out = call([t], [100], [1], [payload], [entry], tokens, 0, st, 0, 0, 1)
        assert out == (1, 1, 0, False)
        got.append((len(t), t.present, dataclasses.asdict(st)))
        removal: Any = [hashes[1:], None] if as_list else (hashes[1:], None)
        assert call([t], [100], [2], [removal], [], tokens, 0, st, 0, 1, 1) == (1, 1, 1, False)
        got.append((len(t), t.present))
    assert got[0] == got[2]
    assert got[1] == got[3]
    assert got[0][1] == 2
    assert got[1][1] == 1

"""Parity of the native token-keyed table (``kvstream._native._index.TokenTable``) with its
pure-Python twin (:class:`kvstream.index.token_table.TokenGroupTable`), in both key modes:
random operation sequences on both, everything observable compared after each step; and the
native keys against the reference BLAKE3 and XXH3 implementations."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import xxhash
from blake3 import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_codec_strategies import batches

from kvstream.codec import AvroCodec, schema_registry
from kvstream.codec.columnar import decode_columns_message, record_columns
from kvstream.codec.decoder import read_record
from kvstream.codec.framing import split_single_object
from kvstream.engines.endpoint import DIALECTS
from kvstream.engines.stream import EngineStream
from kvstream.errors import KVStreamError
from kvstream.events.model import MmKey, StoredBlock
from kvstream.hashing.dynamo import LOCAL_HASH_SEED, link_hash, local_hash
from kvstream.index import PrefixIndex
from kvstream.index.domain import MaskMap
from kvstream.index.keys import KEY_CONTEXT, ROOT_KEY
from kvstream.index.stats import SourceStats
from kvstream.index.token_table import TokenGroupTable, token_table_type

GOLDEN = Path(__file__).parent / "data" / "golden"

Native: Any = token_table_type()
pytestmark = pytest.mark.skipif(Native is TokenGroupTable, reason="native index not built")

# small spaces, so that stores, removes, parents and keys collide often: two engine hashes
# with the same tokens under the same parent share a key
HASHES = [bytes([i]) * 8 for i in range(10)] + [bytes([i]) * 32 for i in range(40, 43)]
TOKENS = [[7] * 4, [8] * 4, [7, 8, 9, 10], [1, 2, 3]]
hashes_st = st.sampled_from(HASHES)
level_st = st.integers(0, 5)
block_st = st.tuples(
    hashes_st,
    st.sampled_from([*TOKENS, []]),  # [] is a placeholder without tokens
    level_st,
    st.sampled_from([None, None, None, "lora-a"]),
    st.sampled_from([None, None, "salt"]),
    st.booleans(),  # a multimodal key
)


def _block(fields: tuple[Any, ...]) -> Any:
    h, toks, level, lora, salt, mm = fields
    return StoredBlock(
        block_hash=h,
        token_ids=toks,
        cache_level=level,
        lora_name=lora,
        cache_salt=salt,
        mm_keys=(MmKey(hash=bytes(32), start_offset=0),) if mm and toks else (),
    )


def _raw(toks: list[int]) -> bytes:
    return struct.pack(f"<{len(toks)}I", *toks)


class TokenParity(RuleBasedStateMachine):
    dynamo = False

    def __init__(self) -> None:
        super().__init__()
        bit = 1 << 2
        self.py = TokenGroupTable(bit, self.dynamo)
        self.nat = Native(bit, self.dynamo)
        self.py_masks: MaskMap | None = MaskMap()
        self.nat_masks: MaskMap | None = MaskMap()
        self.py.attach(self.py_masks)
        self.nat.attach(self.nat_masks)
        self.py_st = SourceStats()
        self.nat_st = SourceStats()

    def both(self, name: str, *args: Any) -> None:
        """Call ``name`` on both tables: the same result or the same exception type."""
        outcomes = []
        for table, stats in ((self.py, self.py_st), (self.nat, self.nat_st)):
            try:
                outcomes.append(("ok", getattr(table, name)(*args, stats)))
            except (TypeError, ValueError) as exc:
                outcomes.append(("err", type(exc)))
        assert outcomes[0] == outcomes[1]

    @rule(parent=st.one_of(st.none(), hashes_st), blocks=st.lists(block_st, max_size=5))
    def store(self, parent: bytes | None, blocks: list[Any]) -> None:
        self.both("store", parent, [_block(b) for b in blocks])

    @rule(
        parent=st.one_of(st.none(), hashes_st),
        blocks=st.lists(st.tuples(hashes_st, st.sampled_from([*TOKENS, []])), max_size=5),
        level=st.one_of(level_st, st.lists(level_st, min_size=5, max_size=5)),
    )
    def store_tokens(self, parent: bytes | None, blocks: list[Any], level: Any) -> None:
        hs = [h for h, _ in blocks]
        lv = level if isinstance(level, int) else level[: len(hs)]
        tokens = b"".join(_raw(t) for _, t in blocks)
        sizes = [len(t) for _, t in blocks]
        self.both("store_tokens", parent, hs, lv, tokens, sizes, LOCAL_HASH_SEED)

    @rule(hs=st.lists(hashes_st, min_size=1, max_size=5), level=st.one_of(st.none(), level_st))
    def remove(self, hs: list[bytes], level: int | None) -> None:
        self.both("remove", list(hs), level)

    @rule(h=hashes_st, old=level_st, new=level_st)
    def update(self, h: bytes, old: int, new: int) -> None:
        self.both("update", h, old, new)

    @rule()
    def clear(self) -> None:
        self.py.clear()
        self.nat.clear()
        self.py_masks = self.nat_masks = None

    @rule()
    def detach(self) -> None:
        self.py.detach()
        self.nat.detach()
        self.py_masks = self.nat_masks = None

    @precondition(lambda self: self.py_masks is None)
    @rule()
    def attach(self) -> None:
        self.py_masks = MaskMap()
        self.nat_masks = MaskMap()
        self.py.attach(self.py_masks)
        self.nat.attach(self.nat_masks)

    @rule(native_first=st.booleans())
    def round_trip(self, native_first: bool) -> None:
        """Each table reloads a dump, its own or (cross) the other's."""
        src = self.nat if native_first else self.py
        nodes = list(zip(*src.dump_nodes(), strict=True))
        keys, pending = src.dump_keys()
        self.nat.load_keyed(nodes, keys, pending)
        self.py.load_keyed(nodes, keys, pending)

    @rule(
        picks=st.lists(st.integers(0, 20), max_size=6),
        weights=st.sampled_from([(1.0,), (1.0, 0.5, 0.25, 0.1)]),
    )
    def queries(self, picks: list[int], weights: tuple[float, ...]) -> None:
        entries = self.py.keys()  # the table's (hash, key, pending) list
        known = sorted({k for _, k, _ in entries if k})
        ks = [known[i] if i < len(known) else bytes([i]) * 16 for i in picks]
        d = self.py.walk(ks)
        assert self.nat.walk(ks) == d
        for depth in (d, len(ks)):
            assert self.nat.weighted(ks, depth, weights) == pytest.approx(
                self.py.weighted(ks, depth, weights)
            )
            assert self.nat.tier_depths(ks, depth) == self.py.tier_depths(ks, depth)

    @invariant()
    def same(self) -> None:
        py, nat = self.py, self.nat
        assert nat.nodes() == py.nodes()
        assert nat.keys() == py.keys()
        assert len(nat) == len(py)
        assert (nat.present, nat.lower, nat.ghosts, nat.rooted_count) == (
            py.present,
            py.lower,
            py.ghosts,
            py.rooted_count,
        )
        assert sorted(nat.mirrored()) == sorted(py.mirrored())
        assert sorted(nat.cached_blocks()) == sorted(py.cached_blocks())
        for h in HASHES:
            assert nat.tiers_of(h) == py.tiers_of(h)
            assert nat.is_rooted(h) == py.is_rooted(h)
            assert nat.key_of(h) == py.key_of(h)
            assert (h in nat) == (h in py)
        assert self.nat_st == self.py_st
        if self.py_masks is not None:
            assert self.nat_masks is not None
            assert self.nat_masks.as_dict() == self.py_masks.as_dict()
        nat.check()
        py.check()


class DynamoParity(TokenParity):
    dynamo = True


_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TokenParity.TestCase.settings = _SETTINGS
DynamoParity.TestCase.settings = _SETTINGS
TestTokenParity = TokenParity.TestCase
TestDynamoParity = DynamoParity.TestCase


def reference_key(parent: bytes, payload: bytes, scoped: bool) -> bytes:
    """``kvstream_tokens_v2`` from the reference libraries: XXH3-128 (canonical bytes) of a
    plain payload, BLAKE3 derive-key of a scoped one."""
    if scoped:
        return blake3(parent + payload, derive_key_context=KEY_CONTEXT).digest(16)
    return xxhash.xxh3_128(parent + payload).digest()


@settings(max_examples=150, deadline=None)
@given(
    payload=st.one_of(
        st.binary(min_size=1, max_size=300),
        st.integers(1, 5000).map(lambda n: bytes(i * 7 % 251 for i in range(n))),
    ),
    scoped=st.booleans(),
)
def test_keys_follow_the_v2_definition(payload: bytes, scoped: bool) -> None:
    """XXH3-128 of plain payloads, BLAKE3 derive-key of scoped ones, of any length (on the
    stack or not, one BLAKE3 chunk or many)."""
    t = Native(1)
    t.store_payloads(None, [b"h" * 8], 0, [payload], [scoped], SourceStats())
    assert t.key_of(b"h" * 8) == reference_key(ROOT_KEY, payload, scoped)


@pytest.mark.parametrize(
    "n",
    # BLAKE3's block and chunk ends for scoped payloads (48 bytes after the key, then every
    # 64; the chunk's at 1008 = 1024 - 16), the stack buffer's end for plain ones (1024)
    [
        1,
        47,
        48,
        49,
        111,
        112,
        113,
        128,
        175,
        176,
        177,
        1007,
        1008,
        1009,
        1023,
        1024,
        1025,
        2032,
        3057,
        8192,
    ],
)
@pytest.mark.parametrize("scoped", [False, True])
def test_keys_at_buffer_and_chunk_boundaries(n: int, scoped: bool) -> None:
    payload = bytes(range(256)) * (n // 256) + bytes(n % 256)
    t = Native(1)
    t.store_payloads(None, [b"h" * 8], 0, [payload], [scoped], SourceStats())
    assert t.key_of(b"h" * 8) == reference_key(ROOT_KEY, payload, scoped)


def test_dynamo_keys_chain_local_hashes() -> None:
    t = Native(1, True)
    toks = [_raw([i] * 16) for i in range(3)]
    t.store_tokens(None, [b"a" * 8, b"b" * 8, b"c" * 8], 0, b"".join(toks), [16] * 3, 1337,
                   SourceStats())  # fmt: skip
    key = ROOT_KEY
    for h, raw in zip((b"a" * 8, b"b" * 8, b"c" * 8), toks, strict=True):
        loc = local_hash(raw, LOCAL_HASH_SEED)
        key = link_hash(key, loc) + loc
        assert t.key_of(h) == key


def test_native_token_table_errors() -> None:
    s = SourceStats()
    t = Native(1)
    with pytest.raises(TypeError, match="tokens"):
        t.store_hashes(None, [b"a" * 8], 0, s)
    with pytest.raises(ValueError, match="load_keyed"):
        t.load_nodes([])
    with pytest.raises(ValueError, match="sizes need"):
        t.store_tokens(None, [b"a" * 8], 0, b"\0" * 8, [1], 1337, s)
    with pytest.raises(ValueError, match="one size per block"):
        t.store_tokens(None, [b"a" * 8], 0, b"", [], 1337, s)
    with pytest.raises(ValueError, match="one payload"):
        t.store_payloads(None, [b"a" * 8], 0, [], None, s)
    with pytest.raises(ValueError, match="3 keys for 1 nodes"):
        t.load_keyed([(b"a" * 8, -1, 1)], [b"", b"", b""], [])
    with pytest.raises(ValueError, match="neither a key nor a payload"):
        t.load_keyed([(b"a" * 8, -1, 1)], [b""], [])
    with pytest.raises(ValueError, match="5-byte key"):
        t.load_keyed([(b"a" * 8, -1, 1)], [b"12345"], [])
    d = Native(1, True)
    with pytest.raises(ValueError, match="8-byte local hash"):
        d.store_payloads(None, [b"a" * 8], 0, [b"123"], None, s)
    assert repr(d).startswith("<TokenTable")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), mode=st.sampled_from(["tokens", "dynamo"]))
def test_an_index_fed_avro_columns_equals_one_fed_the_model(batch: Any, mode: str) -> None:
    """A token-keyed index fed the columns of an Avro message (plain stored events straight
    from the token ids, by both decoders) ends where one fed the decoded model ends."""
    codec = AvroCodec()
    data = codec.encode(batch)
    model = codec.decode(data)
    reg = schema_registry()
    fingerprint, body = split_single_object(data)
    writer = reg.by_fingerprint(fingerprint)
    native_cols = decode_columns_message(data, reg).columns
    python_cols, _ = record_columns(read_record(body, writer, writer), writer.version)
    assert native_cols.token_layout == python_cols.token_layout
    want = _state_after(mode, model)
    assert _state_after(mode, native_cols) == want
    assert _state_after(mode, python_cols) == want


def _state_after(mode: str, batch: Any) -> Any:
    index = PrefixIndex(key_mode=mode)
    try:
        index.apply(batch)
    except KVStreamError as exc:
        return ("error", type(exc))
    index.check()
    return index.canonical_state()


@pytest.mark.parametrize("mode", ["tokens", "dynamo"])
def test_an_index_fed_engine_columns_equals_one_fed_the_model(mode: str) -> None:
    """Every frame captured from vLLM and SGLang, as the bridge's columns (plain stored events'
    tokens located through stored_extra), builds the index their models build."""
    plain = 0
    for capture in sorted(GOLDEN.glob("*/*.json")):
        doc = json.loads(capture.read_text())
        package = doc["producer"]["package"]
        algo = "sglang_sha256_64" if package == "sglang" else "vllm_sha256_cbor_64"
        if "-bytes-" in capture.name:
            algo = "vllm_sha256_cbor"
        stream = EngineStream("vllm@h:1", 0, algo, clock_ns=lambda: 1)
        by_cols, by_model = PrefixIndex(key_mode=mode), PrefixIndex(key_mode=mode)
        for step in doc["live"]:
            cols = stream.payload_columns(bytes.fromhex(step["frames"][2]), DIALECTS[package])
            assert cols.stored_extra is not None
            plain += sum(attrs is None for _, attrs in cols.stored_extra)
            model = cols.to_batch()
            by_cols.apply(cols)
            by_model.apply(model)
        by_cols.check()
        assert by_cols.canonical_state() == by_model.canonical_state(), capture.name
    assert plain >= 10


@pytest.mark.parametrize("machine", [TokenParity, DynamoParity])
def test_long_stores_and_removals_equal_the_twin(machine: type[TokenParity]) -> None:
    """Events longer than remove()'s and store_tokens' prefetch distances: three 40-block
    chains (two share tokens, so their keys coincide; one hangs off an unknown parent), then
    one removal of 100 hashes, shuffled, with unknown and repeated ones."""
    rng = random.Random(7)
    m = machine()
    chains = []
    for c, parent in enumerate((None, None, b"u" * 8)):
        hs = [bytes([c, i]) * 4 for i in range(40)]
        toks = [[i % 3 + 1] * 4 for i in range(40)] if c < 2 else [[c, i] * 2 for i in range(40)]
        m.both("store_tokens", parent, hs, 0, b"".join(map(_raw, toks)), [4] * 40, 1337)
        m.same()
        chains.append(hs)
    gone = [h for hs in chains for h in hs[10:]] + [b"x" * 8] * 3 + chains[0][20:27]
    rng.shuffle(gone)
    m.both("remove", gone[:100], None)
    m.same()
    m.both("remove", [h for hs in chains for h in hs[:10]], 0)
    m.same()
    assert not m.nat.present

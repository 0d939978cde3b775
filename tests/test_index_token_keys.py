"""Token-derived keys (``PrefixIndex(key_mode="tokens")``): one index and one router across
workers whose events carry hashes of four different registry algorithms and block sizes.

Every worker below publishes real hashes of its algorithm (``get_hasher``) with the scope
conventions of its engine: vLLM names LoRA adapters and puts the cache salt and multimodal
keys in ``extra_keys``; TensorRT-LLM and kvstream carry ``lora_id`` and ``cache_salt``. The
expected matches come from a brute-force model over token prefixes that never hashes.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from blake3 import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvstream._types import TokenIds
from kvstream.codec import write_container
from kvstream.errors import ConfigError, HashingError
from kvstream.events.model import (
    Cleared,
    Created,
    EventBatch,
    EventDiff,
    KVCacheEvent,
    MmKey,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
    Updated,
)
from kvstream.hashing import get_hasher, split_blocks
from kvstream.index import (
    CANONICAL_ALGO,
    HashConfigMismatchError,
    HashRequest,
    KeyMode,
    PrefixIndex,
    Router,
    RouterConfig,
    SnapshotError,
    WorkerKey,
)
from kvstream.index.keys import KEY_CONTEXT, ROOT_KEY, request_keys
from kvstream.index.snapshot import MAGIC, decode_snapshot, encode_snapshot

LORA_NAME, LORA_ID, LORA_PATH = "adapter-L", 7, "/adapters/L"


@dataclass(frozen=True)
class Scope:
    """What separates a request's blocks besides its tokens."""

    lora: bool = False
    salt: str | None = None

    def request(self, **kw: Any) -> HashRequest:
        """The request a router sees: the adapter by name and id, the salt string."""
        return HashRequest(
            lora_name=LORA_NAME if self.lora else None,
            lora_id=LORA_ID if self.lora else None,
            cache_salt=self.salt,
            **kw,
        )


PLAIN = Scope()


class Engine:
    """One worker's event stream, with its engine's hashes and scope conventions."""

    def __init__(self, name: str, algo: str, tpb: int, style: str, incarnation: int = 1) -> None:
        self.name = name
        self.algo = algo
        self.tpb = tpb
        self.style = style  # "vllm", "trtllm" or "kvstream"
        params = {"lora_paths": {LORA_NAME: LORA_PATH}} if style == "vllm" else {}
        self.hasher = get_hasher(algo, **params)
        self.incarnation = incarnation
        self.next_id = 0

    @property
    def key(self) -> WorkerKey:
        return WorkerKey(self.name)

    def restart(self) -> None:
        self.incarnation += 1
        self.next_id = 0

    def ev(self, data: Any, group: int = 0) -> KVCacheEvent:
        ev = KVCacheEvent(
            event_id=self.next_id,
            hash_algo=self.algo,
            layer_group_id=group,
            window_size=4096,
            data=data,
        )
        self.next_id += 1
        return ev

    def batch(self, *events: KVCacheEvent) -> EventBatch:
        src = SourceId(instance_id=self.name, incarnation=self.incarnation)
        return EventBatch(source=src, ts_ns=1, events=events)

    def created(self, group: int = 0) -> KVCacheEvent:
        return self.ev(
            Created(num_blocks_per_cache_level=(1 << 20,), tokens_per_block=self.tpb), group
        )

    def blocks(self, toks: list[int]) -> list[list[int]]:
        return [b.tolist() for b in split_blocks(toks, self.tpb)]

    def hashes(self, toks: list[int], scope: Scope = PLAIN) -> list[bytes]:
        blocks = self.blocks(toks)
        if self.style == "vllm":
            return self.hasher.chain_bytes(
                blocks, cache_salt=scope.salt, lora_name=LORA_NAME if scope.lora else None
            )
        return self.hasher.chain_bytes(
            blocks, lora_id=LORA_ID if scope.lora else None, cache_salt=scope.salt
        )

    def block(
        self, h: bytes, tokens: list[int], scope: Scope, first: bool, level: int
    ) -> StoredBlock:
        if self.style == "vllm":
            extra: list[Any] = [LORA_NAME] if scope.lora else []
            if first and scope.salt is not None:
                extra.append(scope.salt)
            return StoredBlock(
                block_hash=h,
                token_ids=tokens,
                lora_id=1 if scope.lora else None,  # vLLM's own int id: never the identity
                lora_name=LORA_NAME if scope.lora else None,
                extra_keys=tuple(extra) or None,
                cache_level=level,
            )
        return StoredBlock(
            block_hash=h,
            token_ids=tokens,
            lora_id=LORA_ID if scope.lora else None,
            lora_name=LORA_NAME if scope.lora and self.style == "kvstream" else None,
            cache_salt=scope.salt,
            cache_level=level,
        )

    def stored(
        self,
        toks: list[int],
        scope: Scope = PLAIN,
        *,
        start: int = 0,
        end: int | None = None,
        level: int = 0,
        group: int = 0,
    ) -> KVCacheEvent:
        """Blocks ``start..end`` of ``toks``, parented on block ``start - 1``."""
        hs = self.hashes(toks, scope)
        blocks = self.blocks(toks)
        end = len(hs) if end is None else end
        out = tuple(self.block(hs[i], blocks[i], scope, i == 0, level) for i in range(start, end))
        return self.ev(Stored(parent_hash=hs[start - 1] if start else None, blocks=out), group)

    def placeholder(
        self, toks: list[int], scope: Scope, indices: list[int], level: int = 1
    ) -> KVCacheEvent:
        """An offload placeholder (vLLM non-self-describing): hashes only, no tokens."""
        hs = self.hashes(toks, scope)
        out = tuple(StoredBlock(block_hash=hs[i], token_ids=[], cache_level=level) for i in indices)
        return self.ev(Stored(parent_hash=None, blocks=out))

    def removed(
        self, toks: list[int], indices: list[int], scope: Scope = PLAIN, level: int | None = None
    ) -> KVCacheEvent:
        hs = self.hashes(toks, scope)
        return self.ev(Removed(block_hashes=tuple(hs[i] for i in indices), cache_level=level))

    def updated(self, toks: list[int], i: int, old: int, new: int, scope: Scope = PLAIN) -> Any:
        h = self.hashes(toks, scope)[i]
        return self.ev(Updated(block_hash=h, cache_level=EventDiff(old_value=old, new_value=new)))


def fleet() -> list[Engine]:
    """Four workers, four algorithms, two block sizes."""
    return [
        Engine("vllm", "vllm_sha256_cbor_64", 4, "vllm"),
        Engine("trt-v1", "v1_block_key", 4, "trtllm"),
        Engine("trt-v2", "v2_sha256", 8, "trtllm"),
        Engine("kvs", "blake3_64", 4, "kvstream"),
    ]


def toks(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31 + 1) % 50000 for i in range(n)]


class Model:
    """Brute force: per worker, a count of cached blocks identified by (scope, tokens of the
    whole prefix up to the block's end). A request's match is the number of consecutive
    leading prefixes (at the worker's block size, of ``tokens[:-1]``) with a count."""

    def __init__(self, engines: list[Engine]) -> None:
        self.tpb = {e.name: e.tpb for e in engines}
        self.cached: dict[str, Counter[tuple[Scope, tuple[int, ...]]]] = {
            e.name: Counter() for e in engines
        }

    def ident(self, e: Engine, t: list[int], scope: Scope, i: int) -> tuple[Scope, tuple[int, ...]]:
        return scope, tuple(t[: e.tpb * (i + 1)])

    def store(self, e: Engine, t: list[int], scope: Scope, start: int, end: int) -> None:
        for i in range(start, end):
            self.cached[e.name][self.ident(e, t, scope, i)] += 1

    def remove(self, e: Engine, t: list[int], scope: Scope, i: int) -> None:
        c = self.cached[e.name]
        k = self.ident(e, t, scope, i)
        if c[k] > 0:
            c[k] -= 1

    def count(self, e: Engine, t: list[int], scope: Scope, i: int) -> int:
        return self.cached[e.name][self.ident(e, t, scope, i)]

    def clear(self, e: Engine) -> None:
        self.cached[e.name].clear()

    def match(self, name: str, query: list[int], scope: Scope) -> int:
        tpb = self.tpb[name]
        q = query[:-1]
        d = 0
        while (d + 1) * tpb <= len(q) and self.cached[name][(scope, tuple(q[: (d + 1) * tpb]))]:
            d += 1
        return d


def depths(idx: PrefixIndex, query: list[int], scope: Scope = PLAIN) -> dict[str, int]:
    return {
        m.worker.instance_id: m.matched_blocks for m in idx.match(query, request=scope.request())
    }


def start(engines: list[Engine], mode: str = "tokens") -> PrefixIndex:
    idx = PrefixIndex(key_mode=mode)
    for e in engines:
        idx.apply(e.batch(e.created()))
    return idx


SYSTEM = toks(16, seed=1)
PROMPT = SYSTEM + toks(25, seed=2)  # 41 tokens: 10 blocks of 4 / 5 of 8 in tokens[:-1]


# ---------------------------------------------------------------------------------- routing


def test_one_router_routes_across_four_algorithms() -> None:
    engines = fleet()
    idx = start(engines)
    model = Model(engines)
    cached_blocks = {"vllm": 3, "trt-v1": 7, "trt-v2": 2, "kvs": 10}
    for e in engines:
        n = cached_blocks[e.name]
        idx.apply(e.batch(e.stored(PROMPT, end=n)))
        model.store(e, PROMPT, PLAIN, 0, n)
    other = SYSTEM + toks(30, seed=3)  # shares the system prompt only
    for q in (PROMPT, other, PROMPT[:20], toks(40, seed=9)):
        assert depths(idx, q) == {e.name: model.match(e.name, q, PLAIN) for e in engines}
    assert depths(idx, PROMPT) == {"vllm": 3, "trt-v1": 7, "trt-v2": 2, "kvs": 10}
    assert depths(idx, other)["trt-v2"] == 2
    assert depths(idx, other)["vllm"] == 3
    # two domains (block sizes 4 and 8), none per algorithm
    assert sorted(idx.domains()) == [(CANONICAL_ALGO, 4, 0), (CANONICAL_ALGO, 8, 0)]
    res = idx.match(PROMPT)
    assert {m.hash_algo for m in res} == {CANONICAL_ALGO}
    by = {m.worker.instance_id: m for m in res}
    assert (by["trt-v2"].request_blocks, by["trt-v2"].matched_tokens) == (5, 16)
    router = Router(idx)
    decision = router.route(PROMPT)
    assert decision.worker == WorkerKey("kvs")
    assert decision.predicted_blocks == 10
    # the same events in engine mode (every one of these algorithms is reproducible) agree
    engine_idx = PrefixIndex()
    for e in fleet():
        engine_idx.apply(e.batch(e.created(), e.stored(PROMPT, end=cached_blocks[e.name])))
    for q in (PROMPT, other):
        assert depths(engine_idx, q) == depths(idx, q)
    idx.check()


def test_removals_resolve_through_the_engine_hash() -> None:
    engines = fleet()
    idx = start(engines)
    for e in engines:
        idx.apply(e.batch(e.stored(PROMPT)))
    vllm, trt = engines[0], engines[1]
    hs = vllm.hashes(PROMPT)
    key = idx.block_key(vllm.key, hs[2])
    assert key is not None
    assert len(key) == 16
    # the same block (same tokens, same parent chain) has one key whatever the engine's hash
    assert idx.block_key(trt.key, trt.hashes(PROMPT)[2]) == key
    assert idx.block_key(vllm.key, b"\x00" * 8) is None
    idx.apply(vllm.batch(vllm.removed(PROMPT, [2])))  # a middle block, by vLLM's hash
    assert depths(idx, PROMPT)["vllm"] == 2
    assert depths(idx, PROMPT)["trt-v1"] == 10
    idx.apply(trt.batch(trt.removed(PROMPT, [9, 8])))
    assert depths(idx, PROMPT)["trt-v1"] == 8
    idx.apply(vllm.batch(vllm.stored(PROMPT, start=2, end=3)))  # the link is back
    assert depths(idx, PROMPT)["vllm"] == 10
    st = idx.info(vllm.key).stats
    assert st.removed_blocks == 1
    assert st.unknown_removes == 0
    idx.apply(vllm.batch(vllm.removed(PROMPT, [2]), vllm.removed(PROMPT, [2])))
    assert idx.info(vllm.key).stats.unknown_removes == 1  # the second one: already gone
    idx.check()


def test_duplicate_stores_and_removes_are_reference_counted() -> None:
    engines = fleet()
    idx = start(engines)
    e = engines[2]  # 32-byte hashes, 8-token blocks
    idx.apply(e.batch(e.stored(PROMPT), e.stored(PROMPT, end=2)))
    assert idx.info(e.key).stats.duplicate_stores == 2
    idx.apply(e.batch(e.removed(PROMPT, [1])))
    assert depths(idx, PROMPT)["trt-v2"] == 5  # one reference left
    assert idx.info(e.key).stats.refcounted_removes == 1
    idx.apply(e.batch(e.removed(PROMPT, [1])))
    assert depths(idx, PROMPT)["trt-v2"] == 1
    idx.check()


def test_cleared_and_a_new_incarnation_purge() -> None:
    engines = fleet()
    idx = start(engines)
    for e in engines:
        idx.apply(e.batch(e.stored(PROMPT)))
    vllm, kvs = engines[0], engines[3]
    idx.apply(vllm.batch(vllm.ev(Cleared())))
    assert depths(idx, PROMPT)["vllm"] == 0
    assert depths(idx, PROMPT)["kvs"] == 10  # the shared keys stay for the others
    kvs.restart()
    idx.apply(kvs.batch(kvs.created(), kvs.stored(PROMPT, end=1)))
    assert depths(idx, PROMPT)["kvs"] == 1
    assert idx.info(kvs.key).stats.incarnation_changes == 1
    assert idx.block_key(kvs.key, kvs.hashes(PROMPT)[5]) is None
    idx.check()


def test_engine_mode_still_rejects_a_mismatched_algorithm() -> None:
    engines = fleet()
    idx = start(engines, mode="engine")
    for e in engines:
        idx.apply(e.batch(e.stored(PROMPT)))
    with pytest.raises(HashConfigMismatchError, match="vllm_sha256_cbor_64"):
        idx.match(PROMPT, hash_algo="blake3_64")
    with pytest.raises(HashConfigMismatchError):
        Router(idx, config=RouterConfig(hash_algo="v2_sha256")).route(PROMPT)
    assert len(idx.domains()) == 4  # one per algorithm and block size
    # token mode keeps the expectation too (it describes what the engines publish)
    tok = start(fleet())
    with pytest.raises(HashConfigMismatchError, match="publishes"):
        tok.match(PROMPT, hash_algo="blake3_64")
    tok.match(PROMPT, hash_algo=None)


def test_key_mode_and_request_errors() -> None:
    with pytest.raises(ConfigError, match="unknown key mode"):
        PrefixIndex(key_mode="hashes")
    assert PrefixIndex().key_mode is KeyMode.ENGINE
    idx = start(fleet())
    with pytest.raises(ConfigError, match="salt_id"):
        idx.match(PROMPT, request=HashRequest(salt_id=5))


@pytest.mark.parametrize("mode", ["tokens", "dynamo"])
def test_a_request_matches_alike_in_every_token_container(mode: str) -> None:
    # lists and tuples are packed in C (request_raw), the rest by coerce_tokens: one answer
    engines = fleet()
    idx = start(engines, mode)
    for e in engines:
        idx.apply(e.batch(e.stored(PROMPT)))
    want = depths(idx, PROMPT)
    assert want
    assert all(want.values())
    for form in (tuple(PROMPT), TokenIds(PROMPT), array("I", PROMPT), np.array(PROMPT)):
        got = {m.worker.instance_id: m.matched_blocks for m in idx.match(form)}
        assert got == want
    short = {m.worker.instance_id: m.matched_blocks for m in idx.match(PROMPT[:9])}
    assert short == {m.worker.instance_id: m.matched_blocks for m in idx.match(tuple(PROMPT[:9]))}
    for bad in ([*PROMPT[:5], -1], [*PROMPT[:5], 2**32], [*PROMPT[:5], "x"]):
        with pytest.raises(HashingError, match=r"tokens\[5\]"):
            idx.match(bad)


# ---------------------------------------------------------------------------------- scope


def test_salt_and_lora_separate_blocks_across_conventions() -> None:
    engines = fleet()
    idx = start(engines)
    model = Model(engines)
    salted = Scope(salt="tenant-a")
    lora = Scope(lora=True)
    both = Scope(lora=True, salt="tenant-b")
    for e in engines:
        for scope in (salted, lora, both):
            idx.apply(e.batch(e.stored(PROMPT, scope)))
            model.store(e, PROMPT, scope, 0, len(e.hashes(PROMPT)))
    for scope in (PLAIN, salted, lora, both, Scope(salt="tenant-x")):
        assert depths(idx, PROMPT, scope) == {
            e.name: model.match(e.name, PROMPT, scope) for e in engines
        }, scope
    assert depths(idx, PROMPT, salted) == {"vllm": 10, "trt-v1": 10, "trt-v2": 5, "kvs": 10}
    assert set(depths(idx, PROMPT).values()) == {0}
    # the adapter by name only: vLLM and kvstream publish names, TensorRT-LLM ids
    by_name = idx.match(PROMPT, request=HashRequest(lora_name=LORA_NAME))
    assert [m.matched_blocks for m in by_name] == [10, 0, 0, 10]
    by_id = idx.match(PROMPT, request=HashRequest(lora_id=LORA_ID))
    assert [m.matched_blocks for m in by_id] == [0, 10, 5, 0]
    # vLLM's salt lives in block 0's extra keys only; a continuation store inherits it
    vllm = engines[0]
    table = idx.table(vllm.key)
    assert table is not None
    cont = vllm.stored(PROMPT + toks(8, seed=4), salted, start=10)
    idx.apply(vllm.batch(cont))
    assert depths(idx, PROMPT + toks(8, seed=4) + [0], salted)["vllm"] == 12
    idx.check()


def test_multimodal_keys_from_fields_and_extra_keys_agree() -> None:
    digest = blake3(b"image bytes").digest()
    t = toks(12, seed=6)
    trt = Engine("trt", "v2_sha256", 4, "trtllm")
    vllm = Engine("vllm", "vllm_sha256_cbor_64", 4, "vllm")
    embeds = Engine("emb", "vllm_sha256_cbor_64", 4, "vllm")
    idx = start([trt, vllm, embeds])
    blocks = trt.blocks(t)
    th = trt.hasher.chain_bytes(blocks, mm_keys=[[(digest, 0)], None, None])
    idx.apply(
        trt.batch(
            trt.ev(
                Stored(
                    blocks=tuple(
                        StoredBlock(
                            block_hash=h,
                            token_ids=b,
                            mm_keys=(MmKey(hash=digest, start_offset=0),) if i == 0 else (),
                        )
                        for i, (h, b) in enumerate(zip(th, blocks, strict=True))
                    )
                )
            )
        )
    )
    ident = digest.hex()
    vh = vllm.hasher.chain_bytes(blocks, mm_keys=[[(ident, 0)], None, None])
    idx.apply(
        vllm.batch(
            vllm.ev(
                Stored(
                    blocks=tuple(
                        StoredBlock(
                            block_hash=h,
                            token_ids=b,
                            extra_keys=((ident, 0),) if i == 0 else None,
                        )
                        for i, (h, b) in enumerate(zip(vh, blocks, strict=True))
                    )
                )
            )
        )
    )
    # a prompt-embeds digest (an extra key no request can present): never matched
    eh = embeds.hasher.chain_bytes(blocks[:1])
    idx.apply(
        embeds.batch(
            embeds.ev(
                Stored(
                    blocks=(
                        StoredBlock(
                            block_hash=eh[0], token_ids=blocks[0], extra_keys=(b"\x01" * 32,)
                        ),
                    )
                )
            )
        )
    )
    q = [*t, 0]
    with_image = HashRequest(mm_keys=(((digest, 0),),))
    assert [m.matched_blocks for m in idx.match(q, request=with_image)] == [3, 3, 0]
    as_text = [m.matched_blocks for m in idx.match(q)]
    assert as_text == [0, 0, 0]  # the same tokens without the image are other blocks
    other_image = HashRequest(mm_keys=(((blake3(b"other").digest(), 0),),))
    assert [m.matched_blocks for m in idx.match(q, request=other_image)] == [0, 0, 0]
    idx.check()


# ---------------------------------------------------------------------------------- blocks


def test_placeholders_resolve_known_blocks_and_skip_unknown_ones() -> None:
    vllm = Engine("vllm", "vllm_sha256_cbor_64", 4, "vllm")
    idx = start([vllm])
    idx.apply(vllm.batch(vllm.stored(PROMPT, end=4)))
    # offloaded to the CPU: the known blocks get a host copy, unknown ones are skipped
    idx.apply(vllm.batch(vllm.placeholder(PROMPT, PLAIN, [0, 1, 2, 3, 4, 5])))
    st = idx.info(vllm.key).stats
    assert (st.tokenless_resolved, st.tokenless_skipped) == (4, 2)
    table = idx.table(vllm.key)
    assert table is not None
    assert table.tiers_of(vllm.hashes(PROMPT)[1]) == (1, 1, 0, 0)
    assert vllm.hashes(PROMPT)[4] not in table  # never guessed
    # the GPU copies go: the host copies keep the prefix, at the host's weight
    idx.apply(vllm.batch(vllm.removed(PROMPT, [3, 2, 1, 0], level=0)))
    m = idx.match(PROMPT).get(vllm.key)
    assert m is not None
    assert (m.matched_blocks, m.weighted_blocks) == (4, pytest.approx(4 * 0.8))
    # a removed block whose key is still known (a ghost under a cached child) comes back
    idx.apply(vllm.batch(vllm.removed(PROMPT, [1], level=1)))
    assert depths(idx, PROMPT)["vllm"] == 1
    idx.apply(vllm.batch(vllm.placeholder(PROMPT, PLAIN, [1], level=2)))
    assert depths(idx, PROMPT)["vllm"] == 4
    assert idx.info(vllm.key).stats.tokenless_resolved == 5
    # tokens after a skipped placeholder hang off an unknown parent: kept, not matchable
    hs = vllm.hashes(PROMPT)
    blocks = vllm.blocks(PROMPT)
    mixed = Stored(
        parent_hash=hs[3],
        blocks=(
            StoredBlock(block_hash=hs[4], token_ids=[]),
            StoredBlock(block_hash=hs[5], token_ids=blocks[5]),
        ),
    )
    idx.apply(vllm.batch(vllm.ev(mixed)))
    assert depths(idx, PROMPT)["vllm"] == 4
    assert idx.info(vllm.key).stats.tokenless_skipped == 3
    assert table.knows(hs[4])  # now a ghost (the parent of block 5), without tokens
    idx.apply(vllm.batch(vllm.placeholder(PROMPT, PLAIN, [4])))
    assert idx.info(vllm.key).stats.tokenless_skipped == 4  # still unknown content: skipped
    idx.apply(vllm.batch(vllm.stored(PROMPT, start=4, end=5)))  # the missing block, with tokens
    assert depths(idx, PROMPT)["vllm"] == 6
    idx.check()


def test_orphan_keys_wait_for_their_parent() -> None:
    kvs = Engine("kvs", "blake3_64", 4, "kvstream")
    idx = start([kvs])
    idx.apply(kvs.batch(kvs.stored(PROMPT, start=3, end=6)))  # parent block 2 unknown
    table = idx.table(kvs.key)
    assert table is not None
    assert idx.block_key(kvs.key, kvs.hashes(PROMPT)[4]) is None  # pending
    assert depths(idx, PROMPT)["kvs"] == 0
    idx.apply(kvs.batch(kvs.stored(PROMPT, end=2)))
    assert depths(idx, PROMPT)["kvs"] == 2
    idx.apply(kvs.batch(kvs.stored(PROMPT, start=2, end=3)))  # the ghost gets its tokens
    assert depths(idx, PROMPT)["kvs"] == 6
    assert idx.block_key(kvs.key, kvs.hashes(PROMPT)[4]) is not None
    idx.check()


def test_two_engine_hashes_with_one_key_share_the_workers_bit() -> None:
    """vLLM hashes the LoRA path, which its events do not carry: the same adapter name at two
    paths gives two engine hashes for one token-derived key."""
    a = Engine("vllm", "vllm_sha256_cbor_64", 4, "vllm")
    idx = start([a])
    lora = Scope(lora=True)
    first = a.stored(PROMPT, lora)
    a.hasher = get_hasher("vllm_sha256_cbor_64", lora_paths={LORA_NAME: "/elsewhere"})
    second = a.stored(PROMPT, lora)
    assert first.data.blocks[0].block_hash != second.data.blocks[0].block_hash  # type: ignore[union-attr]
    idx.apply(a.batch(first, second))
    q = lora.request()

    def depth() -> int:
        return idx.match(PROMPT, request=q).matches[0].matched_blocks

    assert depth() == 10
    idx.apply(a.batch(a.removed(PROMPT, [9], lora)))  # a leaf of the second chain
    idx.apply(a.batch(a.removed(PROMPT, [0], lora)))  # its root: the whole chain unroots
    assert depth() == 10  # the first chain holds every key
    idx.check()
    idx.apply(a.batch(a.stored(PROMPT, lora, end=1), a.stored(PROMPT, lora, start=9)))
    a.hasher = get_hasher("vllm_sha256_cbor_64", lora_paths={LORA_NAME: LORA_PATH})
    idx.apply(a.batch(a.removed(PROMPT, [5], lora)))  # a middle block of the first chain
    assert depth() == 10  # the second chain is whole again
    idx.check()
    a.hasher = get_hasher("vllm_sha256_cbor_64", lora_paths={LORA_NAME: "/elsewhere"})
    idx.apply(a.batch(a.removed(PROMPT, [7], lora)))
    assert depth() == 7  # keys 0..6 rooted in the second chain, 0..4 in the first
    idx.apply(a.batch(a.removed(PROMPT, [3], lora)))
    assert depth() == 5
    idx.check()


def test_partial_blocks_are_kept_but_never_matched() -> None:
    sg = Engine("sglang-like", "blake3_64", 4, "kvstream")
    idx = start([sg])
    t = toks(10, seed=8)  # two full blocks and a trailing partial one of 2 tokens
    hs = sg.hasher.chain_bytes(split_blocks(t, 4, include_partial=True))
    parts = [b.tolist() for b in split_blocks(t, 4, include_partial=True)]
    blocks = tuple(StoredBlock(block_hash=h, token_ids=p) for h, p in zip(hs, parts, strict=True))
    idx.apply(sg.batch(sg.ev(Stored(blocks=blocks))))
    assert idx.info(sg.key).groups[0].blocks == 3
    assert depths(idx, [*t, 0, 0, 0])["sglang-like"] == 2  # the 2-token block is no 4-token one
    idx.apply(sg.batch(sg.removed(t[:8], [1])))
    assert depths(idx, t)["sglang-like"] == 1
    idx.check()


def test_canonical_keys_follow_their_definition() -> None:
    t = toks(9, seed=5)
    raw = b"".join(x.to_bytes(4, "little") for x in t[:8])
    k0 = xxhash.xxh3_128(ROOT_KEY + raw[:16]).digest()
    k1 = xxhash.xxh3_128(k0 + raw[16:32]).digest()
    assert request_keys(raw, 4) == [k0, k1]
    assert request_keys(raw, 8) == [xxhash.xxh3_128(ROOT_KEY + raw).digest()]
    # a salted first block is a scoped one: CBOR [tokens, lora, salt, mm, extra ids, other]
    scoped = b"\x86\x50" + raw[:16] + b"\xf6\x61s\x80\xf6\x80"
    s0 = blake3(ROOT_KEY + scoped, derive_key_context=KEY_CONTEXT).digest()[:16]
    salted = request_keys(raw, 4, cache_salt="s")
    assert salted == [s0, xxhash.xxh3_128(s0 + raw[16:32]).digest()]
    kvs = Engine("kvs", "blake3_64", 4, "kvstream")
    idx = start([kvs])
    idx.apply(kvs.batch(kvs.stored(t, Scope(salt="s"))))
    assert idx.block_key(kvs.key, kvs.hashes(t, Scope(salt="s"))[1]) == salted[1]


def test_v2_keys_are_pinned() -> None:
    """``kvstream_tokens_v2`` computed once and written down: a change to the definition
    must come with a new name (keys.py), not pass unnoticed."""
    raw = b"".join(i.to_bytes(4, "little") for i in range(32))
    assert CANONICAL_ALGO == "kvstream_tokens_v2"
    assert [k.hex() for k in request_keys(raw, 16)] == [
        "16d310809c3605d60b49a1755bdbc8b2",
        "f5d6d115dc50f02d9a2cecb9b5456d8b",
    ]
    kvs = Engine("kvs", "blake3_64", 16, "kvstream")
    idx = start([kvs])
    idx.apply(kvs.batch(kvs.stored(list(range(32)))))
    assert idx.block_key(kvs.key, kvs.hashes(list(range(32)))[1]) == request_keys(raw, 16)[1]


# ---------------------------------------------------------------------------------- snapshots


def test_snapshots_restore_equal_to_a_rebuilt_index(tmp_path: Path) -> None:
    engines = fleet()
    stream = [e.batch(e.created()) for e in engines]
    for e in engines:
        stream.append(e.batch(e.stored(PROMPT, end=3)))
        stream.append(e.batch(e.stored(PROMPT, Scope(salt="t"), start=2, end=4)))  # orphans
        stream.append(e.batch(e.placeholder(PROMPT, PLAIN, [1, 4])))  # one known, one not
        stream.append(e.batch(e.removed(PROMPT, [1], level=0)))
    rest = [e.batch(e.stored(PROMPT, start=3)) for e in engines]
    rest += [e.batch(e.stored(PROMPT, Scope(salt="t"), end=2)) for e in engines]
    first = PrefixIndex(key_mode="tokens")
    for b in stream:
        first.apply(b)
    data = encode_snapshot(first, {"offset": len(stream)})
    assert data[len(MAGIC) : len(MAGIC) + 2] == b"\x03\x00"  # version 3: v2 keys
    snap = decode_snapshot(data)
    assert snap.version == 3
    assert snap.index.key_mode is KeyMode.TOKENS
    assert snap.index.canonical_state() == first.canonical_state()
    full = PrefixIndex(key_mode="tokens")
    for b in stream + rest:
        full.apply(b)
    for b in rest:
        snap.index.apply(b)
    snap.index.check()
    assert snap.index.canonical_state() == full.canonical_state()
    for scope in (PLAIN, Scope(salt="t")):
        r = snap.index.match(PROMPT, request=scope.request()).as_list()
        assert r == full.match(PROMPT, request=scope.request()).as_list()
    assert depths(full, PROMPT, Scope(salt="t")) == {"vllm": 4, "trt-v1": 4, "trt-v2": 4, "kvs": 4}
    assert depths(full, PROMPT) == {"vllm": 10, "trt-v1": 10, "trt-v2": 5, "kvs": 10}


def test_snapshot_versions() -> None:
    engines = fleet()
    eng = start(engines, mode="engine")
    data = encode_snapshot(eng)
    assert data[len(MAGIC) : len(MAGIC) + 2] == b"\x01\x00"  # unchanged format: still v1
    assert decode_snapshot(data).index.key_mode is KeyMode.ENGINE
    # a v1 header that claims a token-keyed index is refused
    tok = start(fleet())
    raw = encode_snapshot(tok)
    forged = bytearray(raw[:-32])
    forged[len(MAGIC) : len(MAGIC) + 2] = b"\x01\x00"
    import hashlib

    forged += hashlib.sha256(bytes(forged)).digest()
    with pytest.raises(SnapshotError, match="version-1 snapshot cannot hold a tokens-keyed"):
        decode_snapshot(bytes(forged))
    # a key that contradicts its table is refused, not loaded
    kvs = engines[3]
    tok.apply(kvs.batch(kvs.stored(PROMPT, end=2)))
    good = encode_snapshot(tok)
    body = bytearray(good[:-32])
    at = bytes(body).rfind(b"\x10\x10")  # the two key lengths
    assert at > 0
    body[at] = 0  # the root block loses its key, its child keeps one
    body += hashlib.sha256(bytes(body)).digest()
    with pytest.raises(SnapshotError):
        decode_snapshot(bytes(body))


def _reversion(data: bytes, version: int, **header: Any) -> bytes:
    """``data`` (a snapshot) as format ``version``, header fields set (None: removed), with a
    valid digest: what an earlier release wrote, or a forged file."""
    import hashlib
    import json
    import struct

    hs = struct.Struct("<8sHI")
    magic, _, hlen = hs.unpack_from(data)
    head = json.loads(data[hs.size : hs.size + hlen])
    for k, v in header.items():
        if v is None:
            head.pop(k, None)
        else:
            head[k] = v
    raw = json.dumps(head, separators=(",", ":"), sort_keys=True).encode()
    body = hs.pack(magic, version, len(raw)) + raw + data[hs.size + hlen : -32]
    return body + hashlib.sha256(body).digest()


def test_a_v1_keyed_snapshot_is_refused_with_a_clear_error() -> None:
    """A token-keyed snapshot written before kvstream_tokens_v2 (version 2, no ``keys``)
    holds keys this release never computes: it is refused, never loaded to match nothing."""
    tok = start(fleet())
    data = encode_snapshot(tok)
    assert decode_snapshot(data).index.canonical_state() == tok.canonical_state()
    old = _reversion(data, 2, keys=None)
    with pytest.raises(
        SnapshotError, match=r"kvstream_tokens_v1 keys.*kvstream_tokens_v2.*rebuild"
    ):
        decode_snapshot(old)
    with pytest.raises(SnapshotError, match="snapshot keys are 'kvstream_tokens_v1'"):
        decode_snapshot(_reversion(data, 3, keys="kvstream_tokens_v1"))
    with pytest.raises(SnapshotError, match="snapshot keys are None"):
        decode_snapshot(_reversion(data, 3, keys=None))
    # a Dynamo-keyed index is version 2, as before, and an earlier one (no ``keys``) loads
    dyn = start(fleet(), mode="dynamo")
    data = encode_snapshot(dyn)
    assert data[len(MAGIC) : len(MAGIC) + 2] == b"\x02\x00"
    for d in (data, _reversion(data, 2, keys=None)):
        assert decode_snapshot(d).index.canonical_state() == dyn.canonical_state()
    with pytest.raises(SnapshotError, match="version-3 snapshot cannot hold a dynamo-keyed"):
        decode_snapshot(_reversion(data, 3))


# ---------------------------------------------------------------------------------- property

REQS = [
    (SYSTEM[:8] + toks(17, seed=10 + r), scope)
    for r, scope in enumerate([PLAIN, PLAIN, Scope(salt="t"), Scope(lora=True), PLAIN])
] + [(SYSTEM[:8] + toks(17, seed=10), Scope(salt="t"))]  # the same tokens as REQS[0], salted

REQ = st.integers(0, len(REQS) - 1)
BLOCK = st.integers(0, 5)
op = st.one_of(
    st.tuples(st.just("store"), REQ, BLOCK, st.integers(1, 6)),
    st.tuples(st.just("remove"), REQ, BLOCK, st.integers(0, 2)),
    st.tuples(st.just("move"), REQ, BLOCK, st.integers(0, 2)),
    st.tuples(st.just("offload"), REQ, BLOCK, st.just(1)),
    st.tuples(st.just("clear"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("restart"), st.just(0), st.just(0), st.just(0)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), op), max_size=50), st.integers(0, 1))
def test_token_mode_matches_the_brute_force_model(
    ops: list[tuple[int, tuple[str, int, int, int]]], dup: int
) -> None:
    engines = fleet()
    idx = start(engines)
    model = Model(engines)
    seen: dict[str, set[tuple[int, int]]] = {e.name: set() for e in engines}
    for w, (kind, r, block, x) in ops:
        e = engines[w]
        t, scope = REQS[r]
        n = len(e.hashes(t, scope))
        i = min(block, n - 1)
        if kind == "store":
            end = min(i + x, n)
            ev = e.stored(t, scope, start=i, end=end, level=x % 3)
            model.store(e, t, scope, i, end)
            seen[e.name].update((r, j) for j in range(i, end))
        elif kind == "remove":
            ev = e.removed(t, [i], scope, level=x or None)
            model.remove(e, t, scope, i)
        elif kind == "move":
            ev = e.updated(t, i, x, (x + 1) % 3, scope)
        elif kind == "offload":
            # a placeholder of a cached block adds a copy; of a never-seen one, nothing
            if model.count(e, t, scope, i):
                model.store(e, t, scope, i, i + 1)
            elif (r, i) in seen[e.name]:
                continue  # a removed block may survive as a ghost: covered elsewhere
            ev = e.placeholder(t, scope, [i])
        elif kind == "clear":
            ev = e.ev(Cleared())
            model.clear(e)
            seen[e.name].clear()
        else:
            e.restart()
            ev = e.created()
            model.clear(e)
            seen[e.name].clear()
        batch = e.batch(ev)
        idx.apply(batch)
        if dup:
            idx.apply(batch)  # at-least-once redelivery changes nothing
    idx.check()
    queries = [*REQS, ([*SYSTEM[:8], 0], PLAIN), (REQS[2][0], PLAIN)]
    for t, scope in queries:
        q = [*t, 0]
        assert depths(idx, q, scope) == {e.name: model.match(e.name, q, scope) for e in engines}
    assert idx.stats().stale_workers == 0


# ---------------------------------------------------------------------------------- CLI


def test_index_command_key_mode(tmp_path: Path) -> None:
    import json

    import typer

    from kvstream.cli import index_cmd, replay_cmd

    app = typer.Typer()
    app.command("index")(index_cmd.index)
    app.command("replay")(replay_cmd.replay)
    runner = CliRunner()
    stream = tmp_path / "d"
    stream.mkdir()
    engines = fleet()
    batches = [e.batch(e.created(), e.stored(PROMPT, end=3 + k)) for k, e in enumerate(engines)]
    write_container(stream / "kvstream-1.avro", batches)
    query = " ".join(map(str, PROMPT))
    snap = tmp_path / "idx.snap"
    res = runner.invoke(
        app,
        [
            "index",
            str(stream),
            "--key-mode",
            "tokens",
            "-q",
            query,
            "--snapshot",
            str(snap),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [m["matched_blocks"] for m in out["queries"][0]["matches"]] == [3, 4, 5, 6]
    resume = ["index", str(stream), "--key-mode", "tokens", "--snapshot", str(snap), "-q", query]
    res = runner.invoke(app, [*resume, "--json"])
    assert res.exit_code == 0, res.output
    resumed = json.loads(res.stdout)
    assert resumed["batches"] == 0  # everything came from the snapshot
    assert resumed["queries"] == out["queries"]
    res = runner.invoke(app, ["index", str(stream), "--snapshot", str(snap), "-q", query])
    assert res.exit_code == 2
    assert "--key-mode tokens" in res.output
    res = runner.invoke(app, ["index", str(stream), "--key-mode", "neither"])
    assert res.exit_code == 2
    assert "unknown key mode" in res.output

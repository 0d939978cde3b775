"""``token_encoding="auto"``: what it picks depends on the ids alone, never on what is installed.

An environment without cramjam (a kvstream dependency) once wrote Zipf batches as plain
varints, 25% larger than the zstd'd varints written elsewhere: the same events, different
bytes. Now such a batch is refused with EncodeError; batches ``auto`` would not compress are
written as everywhere else.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstream._types import TokenIds
from kvstream.codec import AvroCodec, tokens
from kvstream.codec.tokens import encode_tokens
from kvstream.errors import EncodeError
from kvstream.events.model import EventBatch, KVCacheEvent, SourceId, Stored, StoredBlock


def _zipf(n: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.zipf(1.2, n) - 1, 127_999).astype("<u4").tobytes()


def _uniform(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 128_000, n, dtype=np.uint32).tobytes()


def _batch(raw: bytes) -> EventBatch:
    blocks = tuple(
        StoredBlock(block_hash=i.to_bytes(8, "big"), token_ids=TokenIds.from_bytes(raw[j : j + 64]))
        for i, j in enumerate(range(0, len(raw), 64))
    )
    ev = KVCacheEvent(event_id=0, window_size=4096, data=Stored(blocks=blocks))
    return EventBatch(source=SourceId(instance_id="w"), ts_ns=1, events=(ev,))


@pytest.fixture
def no_cramjam(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens, "_cramjam", lambda: None)


def test_auto_compresses_zipf_ids_with_zstd() -> None:
    enc = encode_tokens(_zipf(4096))
    assert (enc.encoding, enc.compression) == ("VARINT", "ZSTD")


@pytest.mark.usefixtures("no_cramjam")
def test_without_cramjam_auto_refuses_what_it_would_compress() -> None:
    with pytest.raises(EncodeError, match="cramjam"):
        encode_tokens(_zipf(4096))
    with pytest.raises(EncodeError, match="cramjam"):
        AvroCodec().encode(_batch(_zipf(4096)))
    # the explicit uncompressed forms still work
    assert encode_tokens(_zipf(4096), "varint").compression == "NONE"
    assert AvroCodec(token_encoding="varint").encode(_batch(_zipf(4096)))


def test_batches_auto_leaves_uncompressed_do_not_need_cramjam(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Uniform ids stay bit planes and short varint batches are not compressed: the same bytes
    with or without cramjam."""
    with_cramjam = [encode_tokens(_uniform(4096)), encode_tokens(_zipf(100))]
    assert not with_cramjam[0].is_packed
    assert with_cramjam[1].compression == "NONE"
    monkeypatch.setattr(tokens, "_cramjam", lambda: None)
    assert [encode_tokens(_uniform(4096)), encode_tokens(_zipf(100))] == with_cramjam

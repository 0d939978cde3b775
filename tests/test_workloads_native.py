"""The C prompt builder of Mooncake hash-id rows against the Python reference.

``MooncakeTokens.prompt`` builds a hash-id row's prompt in one C call
(``kvstream.workloads._mooncake_native``); ``native=False`` runs the Python loop, the
definition. They give the same bytes for every seed (negative and beyond 64 bits included),
vocabulary, block size and cut (``input_length`` below, at, above the ids' total, zero),
and the C path hands whatever it does not handle (ids too large for the stamp, negative ids,
ids that are not exact ints) to the Python path, which raises as before.

Skipped when the extension is not built (no C compiler) or KVSTREAM_NO_NATIVE is set.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_parts import native_part

from kvstream.errors import ConfigError
from kvstream.workloads import MooncakeTokens, TraceRow
from kvstream.workloads import mooncake as mooncake_mod

native = native_part("kvstream.workloads._mooncake_native")
if not mooncake_mod.NATIVE_PROMPTS:  # pragma: no cover - only under KVSTREAM_NO_NATIVE
    pytest.skip("KVSTREAM_NO_NATIVE forces the pure-Python path", allow_module_level=True)

_PAIRS: dict[tuple[int, int], tuple[MooncakeTokens, MooncakeTokens]] = {}


def _pair(seed: int, vocab: int) -> tuple[MooncakeTokens, MooncakeTokens]:
    """(C, Python) builders; cached (each builds a 4 MiB pool)."""
    if (seed, vocab) not in _PAIRS:
        _PAIRS[seed, vocab] = (
            MooncakeTokens(seed=seed, vocab_size=vocab, native=True),
            MooncakeTokens(seed=seed, vocab_size=vocab, native=False),
        )
    return _PAIRS[seed, vocab]


def _row(ids: list[int] | tuple[int, ...], input_length: int, block_tokens: int) -> TraceRow:
    return TraceRow(
        index=0,
        timestamp_ms=0.0,
        input_length=input_length,
        output_length=1,
        hash_ids=ids,  # type: ignore[arg-type]  # a list too: the C path takes both
        block_tokens=block_tokens,
    )


@settings(max_examples=200, deadline=None)
@given(
    seed=st.sampled_from([0, 1, -1, 12345, 2**64 + 3, -(2**70)]),
    vocab=st.sampled_from([2, 3, 1000, 32000, 2**32 - 1]),
    block_tokens=st.sampled_from([4, 5, 16, 64, 512, 1000]),
    data=st.data(),
)
def test_prompt_equals_python(
    seed: int, vocab: int, block_tokens: int, data: st.DataObject
) -> None:
    c, py = _pair(seed, vocab)
    assert c.native
    assert not py.native
    top = vocab**3 - 1
    ids = data.draw(
        st.lists(
            st.one_of(st.integers(0, min(1000, top)), st.integers(0, top), st.just(top)),
            min_size=0,
            max_size=12,
        )
    )
    total = len(ids) * block_tokens
    n = data.draw(
        st.one_of(st.integers(0, total), st.just(total), st.integers(total, total + 50), st.just(0))
    )
    for seq in (tuple(ids), list(ids)):
        row = _row(seq, n, block_tokens)
        assert c.prompt(row).raw == py.prompt(row).raw


def test_prompt_is_cut_to_input_length() -> None:
    c, py = _pair(0, 32000)
    for n in (0, 1, 2, 3, 4, 511, 512, 513, 1023, 1024):
        row = _row((5, 6), n, 512)
        raw = c.prompt(row).raw
        assert len(raw) == 4 * n
        assert raw == py.prompt(row).raw
    assert c.prompt(_row((5, 6), -3, 512)).raw == py.prompt(_row((5, 6), -3, 512)).raw == b""
    # more tokens asked than the ids hold: all of them (the reference's behaviour)
    assert len(c.prompt(_row((5, 6), 2000, 512)).raw) == 4 * 1024


def test_stamp_spells_the_id() -> None:
    c, _ = _pair(0, 1000)
    raw = c.prompt(_row((123_456_789,), 512, 512)).raw
    assert struct.unpack_from("<3I", raw) == (789, 456, 123)


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        ((0, 32000**3), ValueError),  # too large for the stamp
        ((0, 2**64 + 1), ValueError),
        ((-1,), struct.error),  # negative: as the reference reports it
    ],
)
def test_bad_ids_raise_as_the_reference(ids: tuple[int, ...], error: type[Exception]) -> None:
    c, py = _pair(0, 32000)
    row = _row(ids, 512, 512)
    with pytest.raises(error):
        py.prompt(row)
    with pytest.raises(error):
        c.prompt(row)


def test_bad_id_past_the_cut_still_raises() -> None:
    """Every id is checked, even one whose tokens the cut leaves out."""
    c, _ = _pair(0, 32000)
    with pytest.raises(ValueError, match="too large"):
        c.prompt(_row((1, 32000**3), 10, 512))


def test_non_int_ids_take_the_python_path() -> None:
    """Ids that are not exact ints (bool) fall back to the reference."""
    c, py = _pair(0, 32000)
    row = _row((True, 2), 600, 512)
    assert c.prompt(row).raw == py.prompt(row).raw == py.prompt(_row((1, 2), 600, 512)).raw


def test_native_required_but_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mooncake_mod, "_mooncake_native", None)
    with pytest.raises(ConfigError, match="not available"):
        MooncakeTokens(native=True)
    assert not MooncakeTokens().native

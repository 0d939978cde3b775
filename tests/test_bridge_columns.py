"""The bridge's columnar path against its model path, from the same engine frames.

``EngineStream.convert_columns(decode_payload(p, split_tokens=False))`` must give the events
``EngineStream.convert(decode_payload(p))`` gives (ids, windows, removal runs, lost markers for
malformed events), build the same validated model, and encode to the same Avro bytes for every
schema version (EncodeErrors included): on generated payloads (valid, malformed and fuzzed,
every shape the decoders take) and on every frame captured from the real publishers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engines_vllm import MAP_ERA
from test_engines_wire_paths import payloads

from kvstream.codec import AvroCodec
from kvstream.codec.column_encoder import encode_columns_body
from kvstream.codec.encoder import ENCODED_VERSIONS, encode_batch_body
from kvstream.engines import vllm as wire
from kvstream.engines.endpoint import DIALECTS
from kvstream.engines.sglang import SGLANG
from kvstream.engines.stream import EngineStream, batch_rank, decode_typed
from kvstream.engines.vllm import VLLM, Dialect, decode_payload
from kvstream.errors import EncodeError, InteropError
from kvstream.events.model import EventBatch

GOLDEN = Path(__file__).parent / "data" / "golden"
PROPS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


class Streams:
    """Three streams fed the same frames: the model path, the columnar one from a decoded
    batch, and the columnar one from the payload (one pass)."""

    def __init__(self, algo: str) -> None:
        def stream() -> EngineStream:
            ticks = iter(range(1000, 10**6))
            return EngineStream("vllm@h:1", 0, algo, clock_ns=lambda: next(ticks))

        self.model, self.cols, self.fused = stream(), stream(), stream()

    def state(self, s: EngineStream) -> tuple[Any, ...]:
        return (s.next_event_id, s.events, s.malformed_events, s.state())


def _streams(algo: str) -> Streams:
    return Streams(algo)


def _encoded(fn: Any, batch: Any, version: int, lossy: bool) -> Any:
    try:
        return fn(batch, version, lossy=lossy, prefix=b"\xc3\x01")
    except EncodeError as exc:
        return ("EncodeError", str(exc))


def _same(
    streams: Streams, payload: bytes, width: int | None, dialect: Dialect
) -> EventBatch | None:
    """Feed ``payload`` to the streams; check they agree; the model batch (None: refused)."""
    model, cols = streams.model, streams.cols
    assert width == model.width
    try:
        wire_model = decode_payload(payload, width=width, dialect=dialect)
    except InteropError as exc:
        want = str(exc)
        with pytest.raises(InteropError) as got:
            decode_payload(payload, width=width, dialect=dialect, split_tokens=False)
        assert str(got.value) == want
        with pytest.raises(InteropError) as got:
            streams.fused.payload_columns(payload, dialect)
        assert str(got.value) == want
        assert streams.state(streams.fused) == streams.state(model)
        return None
    wire_cols = decode_payload(payload, width=width, dialect=dialect, split_tokens=False)
    for a, b in zip(wire_model.events, wire_cols.events, strict=True):
        assert (a.kind, a.error, a.block_hashes) == (b.kind, b.error, b.block_hashes)
        assert b"".join(t.raw for t in a.block_tokens) == b.token_bytes
    want = model.convert(wire_model)
    got = cols.convert_columns(wire_cols)
    fused = streams.fused.payload_columns(payload, dialect)
    clock_ts = not (math.isfinite(wire_model.ts) and 0 <= wire_model.ts < 2**62 / 1e9)
    if clock_ts:
        # no usable engine timestamp: each took the clock's time, a moment apart
        assert abs(got.ts_ns - want.ts_ns) < 60 * 10**9
        got.ts_ns = fused.ts_ns = want.ts_ns
    assert streams.state(model) == streams.state(cols) == streams.state(streams.fused)
    for version in ENCODED_VERSIONS:
        for lossy in (False, True):
            want_bytes = _encoded(encode_batch_body, want, version, lossy)
            assert _encoded(encode_columns_body, got, version, lossy) == want_bytes
            assert _encoded(encode_columns_body, fused, version, lossy) == want_bytes
    model_batch = got.to_batch()
    assert (model_batch.source, model_batch.events) == (want.source, want.events)
    assert model_batch == want or clock_ts
    return want


algos = st.sampled_from(["vllm_sha256_cbor_64", "vllm_sha256_cbor", "future_algo_x"])


@PROPS
@given(
    frames=st.lists(payloads, min_size=1, max_size=4),
    dialect=st.sampled_from([VLLM, SGLANG]),
    algo=algos,
)
def test_columns_equal_the_model_path_on_generated_frames(
    frames: list[bytes], dialect: Dialect, algo: str
) -> None:
    streams = _streams(algo)
    for payload in frames:  # decoded for the stream's hash width, as the sources do
        _same(streams, payload, streams.model.width, dialect)


@PROPS
@given(data=st.data(), algo=algos)
def test_columns_equal_the_model_path_on_mutated_frames(data: st.DataObject, algo: str) -> None:
    base = bytearray(MAP_ERA)
    for _ in range(data.draw(st.integers(1, 4))):
        base[data.draw(st.integers(0, len(base) - 1))] = data.draw(st.integers(0, 255))
    streams = _streams(algo)
    _same(streams, bytes(base), streams.model.width, VLLM)
    _same(streams, MAP_ERA, streams.model.width, VLLM)


def test_pure_python_array_readers_give_the_same_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "_wire_native", None)
    for capture in _captures():
        _check_capture(capture)


def _captures() -> list[Path]:
    found = sorted(GOLDEN.glob("*/*.json"))
    assert found
    return found


def _check_capture(capture: Path) -> int:
    doc = json.loads(capture.read_text())
    package = doc["producer"]["package"]
    width = 32 if "-bytes-" in capture.name else 8
    algo = "sglang_sha256_64" if package == "sglang" else "vllm_sha256_cbor_64"
    if width == 32:
        algo = "vllm_sha256_cbor"
    streams = _streams(algo)
    blocks = 0
    for step in doc["live"]:
        payload = bytes.fromhex(step["frames"][2])
        batch = _same(streams, payload, width, DIALECTS[package])
        assert batch is not None
        blocks += sum(len(getattr(ev.data, "blocks", ())) for ev in batch.events)
    return blocks


@pytest.mark.parametrize("capture", _captures(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_columns_equal_the_model_path_on_captured_frames(capture: Path) -> None:
    assert _check_capture(capture) > 0


def test_a_malformed_event_is_the_same_lost_marker_on_both_paths() -> None:
    import msgspec

    good = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    bad = good | {"block_size": 3}  # 8 ids do not split into 2 blocks of 3
    payload = msgspec.msgpack.encode([1.0, [good, bad, {"type": "Nope"}], 0])
    streams = _streams("vllm_sha256_cbor_64")
    batch = _same(streams, payload, 8, VLLM)
    assert batch is not None
    assert [ev.data.type for ev in batch.events] == ["stored", "lost", "lost"]
    codec = AvroCodec()
    got = streams.cols.convert_columns(decode_payload(payload, width=8, split_tokens=False))
    assert codec.decode(codec.encode(got)) == got.to_batch()


@pytest.mark.parametrize("given", [{"lora_id": 0}, {"lora_name": ""}, {"cache_salt": ""}])
def test_falsy_block_values_survive_the_model_path(given: dict[str, Any]) -> None:
    # the model path once marked such blocks as default-only, and the encoder wrote nulls
    import msgspec

    ev = {
        "type": "BlockStored",
        "block_hashes": [7],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    } | given
    payload = msgspec.msgpack.encode([1.0, [ev], 0])
    streams = _streams("vllm_sha256_cbor_64")
    batch = _same(streams, payload, 8, VLLM)
    assert batch is not None
    codec = AvroCodec()
    assert codec.decode(codec.encode(batch)) == batch


def _typed(payload: bytes) -> Any:
    typed = decode_typed(payload)
    if typed is None:
        raise wire._NotFast
    return typed


def test_captured_vllm_033_frames_take_the_one_pass_paths() -> None:
    if wire._wire_native is None:
        pytest.skip("kvstream.engines._wire_native is not built (or KVSTREAM_NO_NATIVE)")
    checked = in_c = 0
    for capture in sorted(GOLDEN.glob("vllm-0.33.0/*-int-*.json")):
        stream = EngineStream("vllm@h:1", 0, "vllm_sha256_cbor_64")
        for step in json.loads(capture.read_text())["live"]:
            payload = bytes.fromhex(step["frames"][2])
            plain = all(  # what the one C call is for: no LoRA, salt or extra keys
                ev.lora_id is None
                and ev.lora_name is None
                and ev.cache_salt is None
                and not any(ev.extra_keys or ())
                for ev in decode_payload(payload, width=8).events
            )
            # the one C call takes every plain frame vLLM 0.33 sends (None: not its case) ...
            c_stream = EngineStream("vllm@h:1", 0, "vllm_sha256_cbor_64")
            c_stream.resume(stream.state())
            took = c_stream._native_columns(payload, wire._wire_native) is not None
            assert took or not plain
            in_c += took
            # ... and the pass over msgspec's structs takes them all (_NotFast otherwise)
            stream._fast_columns(_typed(payload), wire._wire_native)
            checked += 1
    assert checked >= 10
    assert in_c >= 10


def _columns_of(stream: EngineStream, cols: Any) -> Any:
    return (
        (cols.event_ids, cols.kinds, cols.group_ids, cols.window_sizes, cols.payloads),
        (cols.stored_extra, cols.tokens, cols.ts_ns, cols.hash_algos, cols.token_layout),
        (stream.state(), stream.events),
    )


def _one_pass(payload: bytes, native: Any) -> Any:
    stream = EngineStream("vllm@h:1", 0, "vllm_sha256_cbor_64", clock_ns=lambda: 7)
    try:
        cols = stream._fast_columns(_typed(payload), native)
    except wire._NotFast:
        return "not fast", stream.state()
    return _columns_of(stream, cols)


needs_c = pytest.mark.skipif(
    wire._wire_native is None, reason="kvstream.engines._wire_native is not built"
)


@needs_c
@PROPS
@given(frames=st.lists(payloads, min_size=1, max_size=3))
def test_c_removal_runs_equal_the_python_loop(frames: list[bytes]) -> None:
    # the C loop over removal events (removed_run) against the per-event Python loop
    import types

    native = wire._wire_native
    python_only = types.SimpleNamespace(be64_array=native.be64_array, u32_array=native.u32_array)
    for payload in frames:
        assert _one_pass(payload, native) == _one_pass(payload, python_only)


@needs_c
def test_removed_run_stops_where_the_run_ends() -> None:
    import msgspec

    from kvstream.engines import _wire_structs as structs
    from kvstream.engines.vllm import MEDIUM_LEVELS

    def removed(h: Any, **kw: Any) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": h, "medium": "GPU"} | kw

    events = [
        removed([1, 2]),
        removed([2**64 - 1]),
        removed([3], group_idx=1),  # another group: a new run
        removed([4], group_idx=1),
        removed([5], group_idx=1, medium="CPU"),  # another tier
        removed([6], group_idx=1, medium="CPU", locality="LOCAL"),  # Python's to read
        removed([7], medium="cpu"),  # not a key as it is: Python's to read
        removed([]),  # no hashes
        removed([-1]),  # not a uint64
        {"type": "AllBlocksCleared"},
    ]
    got = structs.decode(msgspec.msgpack.encode([0.0, events, 0])).events
    run = wire._wire_native.removed_run
    b = [h.to_bytes(8, "big") for h in (1, 2, 2**64 - 1, 3, 4, 5)]
    assert run(got, 0, structs.Removed, MEDIUM_LEVELS) == (2, b[:3], 0, MEDIUM_LEVELS["GPU"])
    assert run(got, 2, structs.Removed, MEDIUM_LEVELS) == (4, b[3:5], 1, MEDIUM_LEVELS["GPU"])
    assert run(got, 4, structs.Removed, MEDIUM_LEVELS) == (5, b[5:], 1, MEDIUM_LEVELS["CPU"])
    for start in range(5, len(events) + 1):
        assert run(got, start, structs.Removed, MEDIUM_LEVELS) is None
    with pytest.raises(TypeError):
        run(tuple(got), 0, structs.Removed, MEDIUM_LEVELS)


@needs_c
@PROPS
@given(frames=st.lists(payloads, min_size=1, max_size=3), windows=st.booleans())
def test_the_one_c_call_equals_the_pass_over_structs(frames: list[bytes], windows: bool) -> None:
    # batch_columns reads the bytes itself: where it answers, it answers what _fast_columns
    # gives from msgspec's structs (and the stream moves on the same); None changes nothing
    native = wire._wire_native
    c_stream = EngineStream("vllm@h:1", 0, "vllm_sha256_cbor_64", clock_ns=lambda: 7)
    py_stream = EngineStream("vllm@h:1", 0, "vllm_sha256_cbor_64", clock_ns=lambda: 7)
    if windows:  # groups already known, as after earlier batches
        for s in (c_stream, py_stream):
            s.resume({"incarnation": 7, "next_id": 5, "windows": {"0": 64, "3": 9}})
    for payload in frames:
        before = c_stream.state()
        got = c_stream._native_columns(payload, native)
        if got is None:
            assert c_stream.state() == before
        try:
            want = py_stream._fast_columns(_typed(payload), native)
        except wire._NotFast:
            assert got is None
            return
        if got is None:  # outside the C subset: the struct pass takes it for both
            got = c_stream._fast_columns(_typed(payload), native)
        else:  # each stored event's tokens, where the publisher's spans put them
            off, layout = 0, []
            for sizes, attrs in got.stored_extra:
                assert attrs is None
                layout.append((off, sizes))
                off += sum(sizes)
            assert got.token_layout == layout
            assert 4 * off == len(got.tokens)
        assert _columns_of(c_stream, got) == _columns_of(py_stream, want)


@PROPS
@given(payload=payloads | st.binary(max_size=64))
def test_batch_rank_is_the_rank_the_decoders_read(payload: bytes) -> None:
    try:
        rank, _typed_batch = batch_rank(payload)
    except ValueError:
        rank = "refused"
    typed = decode_typed(payload)
    if typed is not None:
        assert rank == typed.data_parallel_rank
    try:
        decoded = decode_payload(payload, width=8, split_tokens=False)
    except InteropError:
        return
    if rank != "refused":
        assert rank == decoded.dp_rank


@needs_c
def test_the_one_c_call_leaves_what_needs_python_to_python() -> None:
    import msgspec

    base = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": 5,
        "token_ids": [1, 2, 3],
        "block_size": 2,
        "medium": "gpu",
        "extra_keys": [None, None],
    }
    native = wire._wire_native

    def c_takes(ev: dict[str, Any], *, rank: Any = 0, ts: Any = 1.5) -> bool:
        stream = EngineStream("vllm@h:1", 0, "vllm_sha256_cbor_64")
        payload = msgspec.msgpack.encode([ts, [ev], rank])
        return stream._native_columns(payload, native) is not None

    assert c_takes(base)
    assert c_takes(base, rank=None)
    assert c_takes(base | {"locality": "remote", "kv_cache_spec_sliding_window": 4})
    assert c_takes(base | {"ownership": "x", "session_id": "s", "lookahead_token_ids": [1, 2]})
    for leaves in (
        {"lora_id": 1},
        {"lora_name": "a"},
        {"cache_salt": "s"},
        {"extra_keys": [None, ["mm", 1]]},
        {"extra_keys": [None]},
        {"parent_block_hash": b"\x00" * 8},
        {"parent_block_hash": -1},
        {"medium": "GPU\u00e9"},
        {"medium": "VRAM"},
        {"block_size": None},
        {"token_ids": [[1, 2]]},
        {"ownership": {"a": 1}},  # an Any field's map: msgspec's to check
        {"unknown_field": 1},
        {"kv_cache_spec_sliding_window": 0},
        {"group_idx": 2**31},
        {"type": "BlockRemoved"},  # a removal has no token ids
    ):
        assert not c_takes(base | leaves), leaves
    assert not c_takes(base, rank=-1)
    assert not c_takes(base, ts=1)

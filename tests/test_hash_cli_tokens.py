"""``kvstream hash`` takes the token ids ``get_hasher(algo).chain`` takes, and no others.

SGLang's page hash takes ids up to 2**63-1 (its C++ hash widens pages holding an id >= 2**32);
the algorithms that pack ids as uint32 refuse larger ones with a HashingError. The command
must give the library's answer in both cases: the same hashes, or the same refusal (exit 2).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvstream.errors import HashingError
from kvstream.hashing import available_hashers, get_hasher, split_blocks

runner = CliRunner()
# vllm_* need no parameter beyond their default seed; every registered name is covered
ALGOS = sorted(available_hashers())


def _cli(algo: str, tokens: list[int], *extra: str) -> tuple[int, str]:
    from kvstream.cli.main import app

    result = runner.invoke(
        app, ["hash", "--algo", algo, "-b", "2", "--json", *extra, *map(str, tokens)]
    )
    return result.exit_code, result.output


def _library(algo: str, blocks: list[list[int]]) -> list[bytes] | HashingError:
    try:
        return get_hasher(algo).chain_bytes(blocks)
    except HashingError as exc:
        return exc


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("big", [2**32, 2**32 + 5, 2**63 - 1, 2**63, 2**64])
def test_ids_beyond_u32_get_the_library_answer(algo: str, big: int) -> None:
    tokens = [1, big, 3, 4]
    expected = _library(algo, [tokens[:2], tokens[2:]])
    code, out = _cli(algo, tokens)
    if isinstance(expected, HashingError):
        assert code == 2, out
        assert str(expected) in out
        assert "Traceback" not in out
    else:
        assert code == 0, out
        assert [bytes.fromhex(b["hex"]) for b in json.loads(out)["blocks"]] == expected


def test_sglang_takes_wide_ids_and_u32_algorithms_refuse_them() -> None:
    assert _cli("sglang_sha256_64", [1, 2**32 + 5])[0] == 0
    code, out = _cli("v2_sha256", [1, 2**32 + 5])
    assert code == 2
    assert "v2_sha256" in out
    assert "0..4294967295" in out


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=9),
    partial=st.booleans(),
    drop_last=st.booleans(),
)
def test_blocks_cut_as_split_blocks_cuts_them(
    tokens: list[int], partial: bool, drop_last: bool
) -> None:
    flags = [*(["--partial"] if partial else []), *(["--drop-last"] if drop_last else [])]
    blocks = split_blocks(tokens, 2, include_partial=partial, drop_last_token=drop_last)
    code, out = _cli("v2_sha256_64", tokens, *flags)
    assert code == 0, out
    got = [(b["tokens"], bytes.fromhex(b["hex"])) for b in json.loads(out)["blocks"]]
    want = get_hasher("v2_sha256_64").chain_bytes(blocks) if blocks else []
    assert got == [(len(b), h) for b, h in zip(blocks, want, strict=True)]

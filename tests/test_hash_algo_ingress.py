"""A ``hash_algo`` name a user types is checked where it is typed (issue 24, item 3).

Every ingress — engine URLs (``bridge``, ``index``), CLI flags (``index``, ``demo``,
``replay``, ``hash``), the cache configuration, ``get_hasher`` — refuses a name kvstream does
not know with the closest known one, instead of writing it into every event for a consumer
to trip over. Engine URLs let a foreign name through when asked (``allow_unknown_algo=true``):
a newer engine's algorithm is published as given.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from engine_publisher import TestEnginePublisher, free_ports
from test_engine_source import collect, payload

from kvstream.cache.config import CacheConfig, LayerGroupSpec
from kvstream.engines.endpoint import parse_engine_url
from kvstream.errors import ConfigError, UnknownHashAlgorithmError
from kvstream.hashing import check_hash_algo, get_hasher
from kvstream.index.sources import open_source

KVSTREAM = [sys.executable, "-m", "kvstream.cli.main"]
TYPO = "vllm_sha256_cbor64"
MEANT = "'vllm_sha256_cbor_64'"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVSTREAM, *args], capture_output=True, text=True, timeout=120, check=False
    )


def _one_line(text: str) -> str:
    return " ".join(text.split())  # rich wraps long errors


@pytest.mark.parametrize("scheme", ["vllm", "sglang"])
def test_engine_url_refuses_a_typo_with_the_closest_name(scheme: str) -> None:
    with pytest.raises(ConfigError, match="did you mean") as info:
        parse_engine_url(f"{scheme}://127.0.0.1:5557?hash_algo={TYPO}")
    assert MEANT in str(info.value)
    assert "allow_unknown_algo=true" in str(info.value)


def test_engine_url_passes_a_foreign_name_only_when_allowed() -> None:
    url = "vllm://127.0.0.1:5557?hash_algo=future_hash_128&allow_unknown_algo=true"
    assert parse_engine_url(url).hash_algo == "future_hash_128"
    assert parse_engine_url(f"vllm://127.0.0.1:5557?hash_algo={TYPO}&allow_unknown_algo=1")
    with pytest.raises(ConfigError, match="allow_unknown_algo"):
        parse_engine_url("vllm://127.0.0.1:5557?hash_algo=x&allow_unknown_algo=maybe")
    with pytest.raises(ConfigError, match=r"1\.\.64"):
        parse_engine_url(f"vllm://127.0.0.1:5557?hash_algo={'x' * 65}&allow_unknown_algo=true")


def test_known_names_pass_unchanged() -> None:
    assert parse_engine_url("vllm://127.0.0.1:5557").hash_algo == "vllm_sha256_64"
    assert parse_engine_url("sglang://127.0.0.1:5557").hash_algo == "sglang_sha256_64"
    url = "vllm://127.0.0.1:5557?hash_algo=vllm_sha256_cbor_64"
    assert parse_engine_url(url).hash_algo == "vllm_sha256_cbor_64"
    assert check_hash_algo("blake3") == "blake3"


async def test_an_allowed_foreign_name_is_published_in_every_event() -> None:
    ports = free_ports(2)
    engine = TestEnginePublisher(ports[0], ports[1])
    try:
        engine.publish(payload(0))
        url = (
            f"vllm://127.0.0.1:{ports[0]}?replay={ports[1]}&hash_algo=future_hash_64"
            "&allow_unknown_algo=true"
        )
        async with open_source(url) as src:
            await asyncio.sleep(0.3)
            engine.publish(payload(1))
            got = await collect(src, 2)
    finally:
        engine.close()
    assert {e.hash_algo for b in got for e in b.events} == {"future_hash_64"}


def test_get_hasher_and_the_cache_config_name_the_closest_algorithm() -> None:
    with pytest.raises(UnknownHashAlgorithmError, match="did you mean 'v2_sha256_64'"):
        get_hasher("v2_sha256_6")
    with pytest.raises(ConfigError, match="did you mean 'blake3_64'"):
        CacheConfig(
            tokens_per_block=4,
            groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=4)],
            hash_algo="blake3_46",
        )
    # nothing close: no suggestion, still every known name
    with pytest.raises(UnknownHashAlgorithmError) as info:
        get_hasher("md5")
    assert "did you mean" not in str(info.value)
    assert "v2_sha256" in str(info.value)


@pytest.mark.parametrize(
    ("args", "meant"),
    [
        (["bridge", f"vllm://127.0.0.1:1?hash_algo={TYPO}", "--idle-exit", "1"], MEANT),
        (["index", f"vllm://127.0.0.1:1?hash_algo={TYPO}"], MEANT),
        (["index", "memory", "--hash-algo", "blake3_6"], "'blake3_64'"),
        (["demo", "--hash-algo", "v2_sha256_6"], "'v2_sha256_64'"),
        (["replay", "conversation", "--hash-algo", "blake3_6"], "'blake3_64'"),
        (["hash", "--algo", "v2_sha25", "1", "2"], "'v2_sha256'"),
    ],
    ids=["bridge-url", "index-url", "index-flag", "demo-flag", "replay-flag", "hash-flag"],
)
def test_every_cli_ingress_refuses_a_typo_before_doing_anything(
    args: list[str], meant: str
) -> None:
    proc = _run(*args)
    assert proc.returncode == 2, proc.stderr
    err = _one_line(proc.stderr)
    assert f"did you mean {meant}" in err
    assert "Traceback" not in proc.stderr

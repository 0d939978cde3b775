"""Cache configuration: validation names the field; device and dtype resolution."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.errors import ConfigError


def group(**kw: Any) -> LayerGroupSpec:
    args: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "num_blocks": 4}
    args.update(kw)
    return LayerGroupSpec(**args)


def test_valid_config_and_derived_values() -> None:
    cfg = CacheConfig(
        tokens_per_block=16,
        groups=[group(), group(window_size=128, num_layers=3, dtype=torch.bfloat16)],
        max_seq_len=8192,
    )
    assert isinstance(cfg.groups, tuple)
    assert cfg.groups[1].dtype == "bfloat16"  # a torch.dtype is normalised to its name
    assert cfg.num_layers == 5
    assert cfg.window_of(0) == 8192
    assert cfg.window_of(1) == 128
    assert cfg.groups[0].attention_kind.value == "full_attention"
    assert cfg.groups[1].attention_kind.value == "sliding_window"
    assert cfg.groups[0].block_bytes(16) == 2 * 2 * 16 * 2 * 8 * 2
    assert cfg.make_hasher().name == "blake3"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_dim": 2.5}, "head_dim"),
        ({"num_blocks": True}, "num_blocks"),
        ({"window_size": 0}, "window_size"),
        ({"dtype": "float13"}, "dtype"),
    ],
)
def test_group_validation_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"LayerGroupSpec.{field}"):
        group(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"groups": []}, "at least one"),
        ({"groups": "abc"}, "groups must be a sequence"),
        ({"groups": [object()]}, r"groups\[0\]"),
        ({"device": ""}, "device"),
        ({"hash_algo": "md5"}, "hash_algo: unknown hash algorithm 'md5'; known algorithms:"),
        ({"hash_params": {"nope": 1}}, "hash_params for 'blake3'"),
        ({"hash_params": [1]}, "hash_params must be a mapping"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"event_capacity": 1}, "event_capacity"),
        ({"events": "yes"}, "events must be a bool"),
        ({"metadata_only": 1}, "metadata_only must be a bool"),
    ],
)
def test_cache_validation_names_the_field(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"tokens_per_block": 4, "groups": [group()]}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=message):
        CacheConfig(**args)


def test_hash_params_reach_the_hasher() -> None:
    cfg = CacheConfig(
        tokens_per_block=4,
        groups=[group()],
        hash_algo="vllm_sha256_cbor_64",
        hash_params={"seed": "42"},
    )
    a = KVCacheManager(cfg)
    b = KVCacheManager(
        CacheConfig(tokens_per_block=4, groups=[group()], hash_algo="vllm_sha256_cbor_64")
    )
    a.add_request("r", [1, 2, 3, 4, 5])
    b.add_request("r", [1, 2, 3, 4, 5])
    assert a.block_hashes("r") != b.block_hashes("r")


def test_device_resolution() -> None:
    cfg = CacheConfig(tokens_per_block=4, groups=[group()], device="auto")
    mgr = KVCacheManager(cfg)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert mgr.device is not None
    assert mgr.device.type == expected
    with pytest.raises(ConfigError, match="device"):
        KVCacheManager(CacheConfig(tokens_per_block=4, groups=[group()], device="potato"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            KVCacheManager(CacheConfig(tokens_per_block=4, groups=[group()], device="cuda"))


def test_manager_rejects_a_non_config() -> None:
    with pytest.raises(TypeError, match="CacheConfig"):
        KVCacheManager({"tokens_per_block": 4})  # type: ignore[arg-type]


def test_metadata_only_manager_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec\n"
        "g = LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=8)\n"
        "m = KVCacheManager(CacheConfig(tokens_per_block=4, groups=[g], metadata_only=True))\n"
        "m.add_request('a', [1, 2, 3, 4, 5])\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])

"""Peer test: fresh random block-hash vectors from the real engines, reproduced by kvstream.

Runs ``scripts/peers/gen_hash_vectors.py`` (vLLM 0.33's block hasher, SGLang 0.5.23's compiled
page hash and recorder, ai-dynamo-runtime's ``compute_block_hash_for_seq``) with a new seed
each run (``KVSTREAM_PEER_SEED`` pins one) and checks every case, as CI does with the committed
vectors. Skipped unless vLLM and Dynamo import and SGLang and a C++ compiler are found
(``scripts/test-peers`` provides them; ``KVSTREAM_SGLANG_DIR`` names an unzipped SGLang wheel).
``KVSTREAM_PEER_PYTHON`` runs the generator with another interpreter (a peer venv), so the test
also runs from kvstream's own venv.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from engine_hash_cases import reproduce

#: The interpreter that runs the generator: this one, or a peer venv's (KVSTREAM_PEER_PYTHON).
PEER_PYTHON = os.environ.get("KVSTREAM_PEER_PYTHON") or sys.executable
if sys.executable == PEER_PYTHON:
    pytest.importorskip("vllm.v1.core.kv_cache_utils")
    pytest.importorskip("dynamo.llm")

pytestmark = pytest.mark.peers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "peers" / "gen_hash_vectors.py"
SGLANG_DIRS = [os.environ.get("KVSTREAM_SGLANG_DIR", ""), str(ROOT / ".peers-venv" / "sglang-src")]
FAMILIES = {
    "vllm_sha256": {"vllm_sha256"},
    "vllm_sha256_cbor": {"vllm_sha256_cbor"},
    "sglang": {"sglang_sha256_64"},
    "dynamo": {"dynamo_xxh3_64"},
}


def _sglang_available() -> bool:
    if "sglang" in sys.modules:  # another peer test loaded it (scripts/peers/peer_imports.py)
        return True
    if sys.executable == PEER_PYTHON and importlib.util.find_spec("sglang") is not None:
        return True
    return any(d and (Path(d) / "sglang").is_dir() for d in SGLANG_DIRS)


@pytest.fixture(scope="module")
def fresh_vectors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not _sglang_available():
        pytest.skip("SGLang not found (install it or set KVSTREAM_SGLANG_DIR)")
    if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler for SGLang's hash_binding.cpp")
    seed = int(os.environ.get("KVSTREAM_PEER_SEED") or random.SystemRandom().randrange(2**31))
    out = tmp_path_factory.mktemp("peer-hashes") / "vectors.json"
    proc = subprocess.run(
        [PEER_PYTHON, str(SCRIPT), "--seed", str(seed), "--count", "25", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, f"seed {seed}: generator failed\n{proc.stderr[-4000:]}"
    doc: dict[str, Any] = json.loads(out.read_text("utf-8"))
    assert doc["provenance"]["seed"] == seed
    return doc


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fresh_engine_vectors_reproduced(fresh_vectors: dict[str, Any], family: str) -> None:
    seed = fresh_vectors["provenance"]["seed"]
    cases = [c for c in fresh_vectors["cases"] if c["algo"] in FAMILIES[family]]
    assert cases, f"no {family} cases"
    checked: Counter[str] = Counter()
    for case in cases:
        for name, want, got in reproduce(case, fresh_vectors["token_sets"]):
            assert got == want, f"seed {seed}, case {case['id']}: {name} differs from the engine"
            checked[name] += len(want)
    assert sum(checked.values()) > 0

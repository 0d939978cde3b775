#!/usr/bin/env python3
"""Block-hash test vectors computed by the engines' own code, for kvstream's CI.

Run it with the peer venv (vllm 0.33.0, ai-dynamo-runtime 1.6.1, torch; SGLang 0.5.23's wheel
unzipped)::

    /tmp/peers/venv/bin/python scripts/peers/gen_hash_vectors.py [--seed N] [--out PATH]

It never imports kvstream. For randomized inputs (seeded) it drives:

- **vLLM**: a real ``vllm.v1.request.Request`` (multimodal features, LoRA request, cache salt,
  prompt embeddings) hashed by ``get_request_block_hasher(block_size, get_hash_fn_by_name(algo))``
  after ``init_none_hash`` (with ``PYTHONHASHSEED`` set for the seeded cases), for ``sha256``
  (pickle) and ``sha256_cbor``. The multimodal keys written for kvstream are derived from the item
  layout and checked here against ``generate_block_hash_extra_keys``.
- **SGLang**: its KV-event recorder (``srt/mem_cache/events.py`` ``KVCacheEventRecorder``) over
  real ``RadixKey``/``TreeNode`` paths, with the page hash from ``hash_binding.cpp`` compiled
  here with g++ against pybind11 and OpenSSL (SGLang 0.5.23 has no Python page hash to fall back
  on). ``orjson`` and ``IPython`` are stubbed: SGLang's utils import them, the hash path does not
  use them.
- **Dynamo**: ``dynamo.llm.compute_block_hash_for_seq`` (LoRA name, cache namespace, multimodal
  hashes, EAGLE windows).

``tests/peers/test_peer_hashes.py`` runs this script with a fresh ``--seed`` (and ``--out`` in
a temporary directory) and checks every case against kvstream, as CI does with the committed
``tests/data/peers/hash_vectors.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import types
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "data" / "peers" / "hash_vectors.json"
SGLANG_DIRS = [
    os.environ.get("KVSTREAM_SGLANG_DIR", ""),
    str(Path(__file__).resolve().parents[2] / ".peers-venv" / "sglang-src"),
]
U32 = 2**32

# ----------------------------------------------------------------------------------- helpers


def _fresh(text: str) -> str:
    """A new str object equal to ``text`` (vLLM's engine core decodes requests from msgpack)."""
    return text.encode("utf-8").decode("utf-8")


def _token(rng: random.Random, wide: bool = False) -> int:
    """A token id: mostly vocabulary-sized, sometimes any u32 (or beyond, when ``wide``)."""
    r = rng.random()
    if wide and r < 0.3:
        return rng.randrange(U32, 2**63)
    if r < 0.7:
        return rng.randrange(0, 152_064)
    return rng.randrange(0, U32)


def _name(rng: random.Random, prefix: str) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789-_/.é中"
    return prefix + "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))


def _maybe_salt(rng: random.Random) -> str | None:
    r = rng.random()
    if r < 0.5:
        return None
    if r < 0.6:
        return ""  # an empty salt: vLLM and SGLang treat it as none
    return _name(rng, "tenant-")


def _mm_identifier(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.5:
        return f"{rng.getrandbits(256):064x}"  # a content-hash identifier
    if r < 0.75:
        return f"{_name(rng, 'lora')}:{rng.getrandbits(128):032x}"  # LoRA-prefixed identifier
    return _name(rng, "uuid-")  # a caller-chosen uuid


# --------------------------------------------------------------------------------------- vLLM


def vllm_cases(
    rng: random.Random, count: int, *, long_tokens: list[int] | None = None
) -> list[dict[str, Any]]:
    """``count`` random requests per vLLM algorithm (plus one long one), hashed by vLLM."""
    saved_seed = os.environ.get("PYTHONHASHSEED")
    try:
        return _vllm_cases(rng, count, long_tokens)
    finally:
        if saved_seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved_seed


def _vllm_cases(
    rng: random.Random, count: int, long_tokens: list[int] | None
) -> list[dict[str, Any]]:
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request
    from vllm.v1.utils import tensor_data

    cases: list[dict[str, Any]] = []
    for algo, name in (("sha256", "vllm_sha256"), ("sha256_cbor", "vllm_sha256_cbor")):
        hash_fn = get_hash_fn_by_name(algo)
        for i in range(count + (1 if long_tokens else 0)):
            long = long_tokens is not None and i == count
            seed = rng.choice([None, None, "0", str(rng.randrange(10**6))])
            if seed is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = seed
            kcu.init_none_hash(hash_fn)
            bs = 16 if long else rng.choice([1, 2, 4, 8, 16, 32])
            if long:
                tokens = list(long_tokens or [])
            else:
                n_blocks = rng.randrange(1, 9 if bs >= 8 else 17)
                tokens = [_token(rng) for _ in range(n_blocks * bs + rng.randrange(0, bs))]
            n_full = len(tokens) // bs
            lora = None
            if rng.random() < 0.35:
                lora = (_fresh(_name(rng, "adapter-")), _fresh("/adapters/" + _name(rng, "p")))
            salt = _maybe_salt(rng)
            embeds = None
            features: list[Any] = []
            layout: list[tuple[str, int, int]] = []
            kind = "plain" if long else rng.choice(["plain", "mm", "mm", "embeds"])
            if kind == "mm":
                pos = rng.randrange(0, max(1, bs))
                ident_pool: list[str] = []
                while pos < len(tokens) and len(layout) < 4:
                    length = rng.randrange(1, 3 * bs + 2)
                    if pos + length > len(tokens):
                        break
                    if ident_pool and rng.random() < 0.25:
                        ident = rng.choice(ident_pool)  # the same item again
                    else:
                        ident = _mm_identifier(rng)
                        ident_pool.append(ident)
                    layout.append((ident, pos, length))
                    features.append(
                        MultiModalFeatureSpec(
                            data=None,
                            modality="image",
                            identifier=_fresh(ident),
                            mm_position=PlaceholderRange(offset=pos, length=length),
                        )
                    )
                    pos += length + rng.randrange(0, 2 * bs)
            elif kind == "embeds":
                dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
                gen = torch.Generator().manual_seed(rng.randrange(2**31))
                embeds = torch.randn(len(tokens), rng.choice([4, 8]), generator=gen).to(dtype)
            request = Request(
                f"req-{i}",
                None if embeds is not None else tokens,
                SamplingParams(max_tokens=1),
                None,
                prompt_embeds=embeds,
                mm_features=features or None,
                lora_request=None if lora is None else LoRARequest(lora[0], 1, lora[1]),
                cache_salt=salt,
                block_hasher=kcu.get_request_block_hasher(bs, hash_fn),
            )
            digests = [bytes(h) for h in request.block_hashes]
            assert len(digests) == n_full, (len(digests), n_full)
            blocks = [list(request.all_token_ids[b * bs : (b + 1) * bs]) for b in range(n_full)]
            # kvstream's inputs, derived from the layout, checked against vLLM's own keys.
            mm_keys = []
            for b in range(n_full):
                start, end = b * bs, (b + 1) * bs
                keys = [
                    [ident, pos - start]
                    for ident, pos, length in layout
                    if pos < end and pos + length > start
                ]
                extra, _ = kcu.generate_block_hash_extra_keys(request, start, end, 0)
                vllm_mm = [[k[1], k[2]] for k in (extra or ()) if k[0] == "mm"]
                assert vllm_mm == keys, (vllm_mm, keys)
                mm_keys.append(keys)
            embed_digests = None
            if embeds is not None:
                embed_digests = [
                    hashlib.sha256(tensor_data(embeds[b * bs : (b + 1) * bs])).hexdigest()
                    for b in range(n_full)
                ]
            case: dict[str, Any] = {
                "id": f"{name}-{i:03d}" + ("-long" if long else ""),
                "algo": name,
                "params": {} if seed is None else {"seed": seed},
                "blocks": "long" if long else blocks,
                "block_size": bs,
                "scope": {
                    **({} if lora is None else {"lora_name": lora[0], "lora_path": lora[1]}),
                    **({} if salt is None else {"cache_salt": salt}),
                },
                "expect": [d.hex() for d in digests],
            }
            if any(mm_keys):
                case["mm_keys"] = mm_keys
            if embed_digests is not None:
                case["prompt_embeds"] = embed_digests
                case["embeds_dtype"] = str(embeds.dtype).removeprefix("torch.")
                if len(tokens) <= 16 and embeds.dtype == torch.float32:
                    case["embeds_f32"] = embeds.tolist()  # for prompt_embeds_digest
            cases.append(case)
    return cases


# ------------------------------------------------------------------------------------- SGLang


class _Stub(types.ModuleType):
    """Stands in for a module SGLang imports but its hash path never uses."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self.__name__}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Stub(f"{self.__name__}()")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


def _stub_module(name: str) -> None:
    if name == "dill":  # used at import time to serialize a class: pickle does that too
        import pickle

        sys.modules.setdefault("dill", pickle)
        return
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), _Stub(".".join(parts[:i])))


def _compile_hash_binding(sglang_dir: Path, build_dir: Path) -> Any:
    """SGLang's hash_binding.cpp built as an extension module (g++, pybind11, OpenSSL)."""
    source = sglang_dir / "sglang" / "srt" / "mem_cache" / "cpp_utils" / "hash_binding.cpp"
    try:
        import pybind11

        pybind_include = pybind11.get_include()
    except ImportError:
        import torch

        pybind_include = str(Path(torch.__file__).parent / "include")
    name = "hicache_hash_cpp"
    target = build_dir / (name + sysconfig.get_config_var("EXT_SUFFIX"))
    cxx = os.environ.get("CXX") or shutil.which("g++") or "c++"
    cmd = [
        cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-DNDEBUG", "-Wno-deprecated-declarations",
        f"-DTORCH_EXTENSION_NAME={name}", f"-I{pybind_include}",
        f"-I{sysconfig.get_paths()['include']}", str(source), "-lcrypto", "-o", str(target),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    sys.path.insert(0, str(build_dir))
    import importlib

    return importlib.import_module(name)


def _import_sglang_stubbing_missing() -> tuple[Any, Any, list[str]]:
    """Import SGLang's recorder and radix types, stubbing third-party modules it lacks here.

    SGLang's package imports much that its hash path never runs (``orjson``, ``IPython``,
    ``torchvision``...); a missing one becomes an empty stub module and the import is retried.
    Returns (events module, radix_cache module, the stubbed module names).
    """
    stubbed: list[str] = []
    for _ in range(100):
        try:
            from sglang.srt.mem_cache import events, radix_cache

            return events, radix_cache, stubbed
        except ModuleNotFoundError as exc:
            name = exc.name or ""
            if not name or name.split(".")[0] == "sglang" or name in stubbed:
                raise
            _stub_module(name)
            stubbed.append(name)
            for mod in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
                del sys.modules[mod]
    raise RuntimeError(f"SGLang still does not import after stubbing {stubbed}")


def load_sglang() -> tuple[Any, Any, Any, str]:
    """(events module, RadixKey, TreeNode, description of the page-hash backend)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        for d in SGLANG_DIRS:
            if d and (Path(d) / "sglang").is_dir():
                sys.path.insert(0, d)
                break
    events, radix_cache, stubbed = _import_sglang_stubbing_missing()
    import sglang
    from sglang.srt.mem_cache.cpp_utils import native_hash

    sglang_dir = Path(sglang.__file__).resolve().parents[1]
    build = Path(tempfile.mkdtemp(prefix="kvstream-sglang-hash-"))
    module = _compile_hash_binding(sglang_dir, build)
    native_hash._load_native_hash_module = lambda: module
    backend = "hash_binding.cpp compiled with g++/pybind11/OpenSSL"
    if stubbed:
        backend += f" (unused imports stubbed: {', '.join(sorted(stubbed))})"
    return events, radix_cache.RadixKey, radix_cache.TreeNode, backend


def sglang_cases(
    rng: random.Random,
    count: int,
    sglang: tuple[Any, Any, Any, str],
    *,
    long_tokens: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Random radix paths published by SGLang's own KV-event recorder."""
    events, radix_key, tree_node, _ = sglang
    cases: list[dict[str, Any]] = []
    for i in range(count + (1 if long_tokens else 0)):
        long = long_tokens is not None and i == count
        page = 16 if long else rng.choice([1, 2, 4, 16, 64])
        fmt = rng.choice(["default", "dynamo"])
        wide = not long and rng.random() < 0.2
        if long:
            tokens = list(long_tokens or [])
        else:
            n_pages = rng.randrange(1, 9 if page >= 16 else 17)
            tokens = [_token(rng, wide) for _ in range(n_pages * page - rng.randrange(0, page))]
        user_key = rng.choice([None, None, "", _name(rng, "key-")])
        lora_id = lora_name = None
        if rng.random() < 0.35:
            lora_id = f"{rng.getrandbits(128):032x}"
            lora_name = _name(rng, "adapter-")
        extra_key = (user_key or "") + lora_id if lora_id is not None else user_key
        salt = _maybe_salt(rng)
        recorder = events.KVCacheEventRecorder(
            enabled=True, page_size=page, dynamo_format=fmt == "dynamo"
        )
        if lora_id is not None:
            req = types.SimpleNamespace(extra_key=extra_key, lora_id=lora_id)
            recorder.lora_names.register(req, lora_name)
        # A radix path of 1-3 nodes split at page boundaries (the last may end mid-page).
        n_pages = -(-len(tokens) // page)
        cuts = sorted(rng.sample(range(1, n_pages), min(n_pages - 1, rng.randrange(0, 3))))
        bounds = [0, *(c * page for c in cuts), len(tokens)]
        parent = tree_node()
        parent.key = radix_key(array("q"), None)
        published: list[int] = []
        for a, b in itertools.pairwise(bounds):
            node = tree_node()
            node.parent = parent
            node.key = radix_key(array("q", tokens[a:b]), extra_key, cache_salt=salt)
            parent.children[a] = node
            recorder.record_store(node)
            parent = node
        for ev in recorder.take():
            published.extend(ev.block_hashes)
        blocks = [tokens[p : p + page] for p in range(0, len(tokens), page)]
        assert len(published) == len(blocks)
        scope: dict[str, Any] = {}
        if salt is not None:
            scope["cache_salt"] = salt
        if user_key is not None:
            scope["extra_key"] = user_key
        if lora_id is not None:
            scope["lora_id"] = lora_id
            scope["lora_name"] = lora_name
        cases.append(
            {
                "id": f"sglang-{i:03d}" + ("-long" if long else ""),
                "algo": "sglang_sha256_64",
                "params": {"event_format": fmt},
                "blocks": "long" if long else blocks,
                "block_size": page,
                "scope": scope,
                "expect_signed": published,
            }
        )
    return cases


# ------------------------------------------------------------------------------------- Dynamo


def dynamo_cases(
    rng: random.Random, count: int, *, long_tokens: list[int] | None = None
) -> list[dict[str, Any]]:
    """Random sequences hashed by ai-dynamo-runtime's ``compute_block_hash_for_seq``."""
    from dynamo.llm import compute_block_hash_for_seq

    cases: list[dict[str, Any]] = []
    for i in range(count + (1 if long_tokens else 0)):
        long = long_tokens is not None and i == count
        bs = 16 if long else rng.choice([1, 4, 16, 32, 64])
        eagle = not long and rng.random() < 0.2
        if long:
            tokens = list(long_tokens or [])
        else:
            tokens = [
                _token(rng) for _ in range(rng.randrange(1, 12) * bs + rng.randrange(0, bs + 1))
            ]
        lora = rng.choice([None, None, "", _name(rng, "adapter-")])
        namespace = _maybe_salt(rng)
        window = bs + 1 if eagle else bs
        n_blocks = (len(tokens) - window) // bs + 1 if len(tokens) >= window else 0
        mm_infos = None
        if not long and rng.random() < 0.4:
            mm_infos = [
                None
                if rng.random() < 0.5
                else {
                    "mm_objects": [
                        {
                            "mm_hash": rng.choice([rng.getrandbits(64), rng.getrandbits(20)]),
                            "offsets": [],
                        }
                        for _ in range(rng.randrange(1, 4))
                    ]
                }
                for _ in range(n_blocks)
            ]
        hashes = compute_block_hash_for_seq(
            tokens, bs, mm_infos, lora_name=lora, is_eagle=eagle or None, cache_namespace=namespace
        )
        blocks = [tokens[b * bs : b * bs + window] for b in range(n_blocks)]
        assert len(hashes) == len(blocks)
        scope: dict[str, Any] = {}
        if lora is not None:
            scope["lora_name"] = lora
        if namespace is not None:
            scope["cache_salt"] = namespace
        case: dict[str, Any] = {
            "id": f"dynamo-{i:03d}" + ("-long" if long else "") + ("-eagle" if eagle else ""),
            "algo": "dynamo_xxh3_64",
            "params": {},
            "blocks": "long" if long else blocks,
            "block_size": bs,
            "scope": scope,
            "expect": list(hashes),
        }
        if mm_infos is not None:
            case["mm_keys"] = [
                [] if info is None else [[o["mm_hash"], 0] for o in info["mm_objects"]]
                for info in mm_infos
            ]
        cases.append(case)
    return cases


# --------------------------------------------------------------------------------------- main


def provenance(seed: int, sglang_backend: str) -> dict[str, Any]:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    import sglang

    return {
        "generated_by": "scripts/peers/gen_hash_vectors.py",
        "seed": seed,
        "python": sys.version.split()[0],
        "vllm": version("vllm"),
        "sglang": getattr(sglang, "__version__", version("sglang")),
        "ai-dynamo-runtime": version("ai-dynamo-runtime"),
        "torch": version("torch"),
        "functions": {
            "vllm_sha256": "vllm.v1.core.kv_cache_utils.get_request_block_hasher with "
            "vllm.utils.hashing.get_hash_fn_by_name('sha256') after init_none_hash",
            "vllm_sha256_cbor": "the same with get_hash_fn_by_name('sha256_cbor')",
            "sglang_sha256_64": "sglang.srt.mem_cache.events.KVCacheEventRecorder.record_store "
            "over RadixKey/TreeNode paths; page hash: " + sglang_backend,
            "dynamo_xxh3_64": "dynamo.llm.compute_block_hash_for_seq",
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seed", type=int, default=20261125)
    ap.add_argument("--count", type=int, default=40, help="random cases per algorithm (40)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    long_tokens = [rng.randrange(0, 152_064) for _ in range(8192)]
    sglang = load_sglang()
    cases = vllm_cases(rng, args.count, long_tokens=long_tokens)
    cases += sglang_cases(rng, args.count, sglang, long_tokens=long_tokens)
    cases += dynamo_cases(rng, args.count, long_tokens=long_tokens)
    doc = {
        "about": "Block hashes computed by the engines' own code on seeded random inputs; "
        "kvstream must reproduce every one (tests/test_hashing_engines.py). 'blocks': 'long' "
        "means token_sets.long cut into blocks of block_size. vLLM 'expect' holds 32-byte "
        "digests (the _64 names publish their last 8 bytes); SGLang 'expect_signed' the signed "
        "int64 its events carry.",
        "provenance": provenance(args.seed, sglang[3]),
        "token_sets": {"long": long_tokens},
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, separators=(",", ":"), ensure_ascii=False) + "\n", "utf-8")
    size = args.out.stat().st_size
    print(f"wrote {len(cases)} cases ({size / 1024:.0f} KiB) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

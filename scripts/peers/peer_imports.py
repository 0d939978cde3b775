"""Import the peers' own code in the peer venv: SGLang 0.5.23 from its unzipped wheel, and the
older publishers (vLLM 0.23.0, SGLang 0.5.19) from their ``kv_events.py`` module files.

``scripts/test-peers`` lays these out under ``.peers-venv`` (``KVSTREAM_PEERS_VENV`` names
another place): ``sglang-src/`` (SGLang 0.5.23's wheel, unzipped) and
``legacy/<package>-<version>/<path inside the wheel>``.

SGLang is imported without running two things, and only those, because their imports need GPU
packages that do not install on a CPU-only machine from PyPI:

- ``sglang/__init__.py``, the frontend language API (it imports IPython, anthropic...): the
  ``sglang`` package is registered bare, so ``sglang.srt.*`` submodules import as usual;
- two import statements of ``sglang/srt/mem_cache/base_prefix_cache.py``: ``memory_pool``
  (used there only in a type annotation) and ``observability.metrics_collector`` (used only when
  a cache enables metrics). Their import chains reach torchvision's CUDA operators. The module
  is otherwise SGLang's own source, executed as ``sglang.srt.mem_cache.base_prefix_cache``.

SGLang's page hash is its C++ ``hash_binding.cpp``, built and loaded by SGLang's own
``native_hash.py`` (``torch.utils.cpp_extension.load``: g++, ninja, pybind11 from torch, OpenSSL).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PEERS_VENV = Path(os.environ.get("KVSTREAM_PEERS_VENV") or ROOT / ".peers-venv")
LEGACY = PEERS_VENV / "legacy"
VLLM_023_KV_EVENTS = LEGACY / "vllm-0.23.0" / "vllm" / "distributed" / "kv_events.py"
SGLANG_0519_KV_EVENTS = (
    LEGACY / "sglang-0.5.19" / "sglang" / "srt" / "disaggregation" / "kv_events.py"
)
_BASE_PREFIX_CACHE_SKIPPED = (
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.observability.metrics_collector",
)


def sglang_root() -> Path:
    """The directory holding SGLang 0.5.23's ``sglang`` package."""
    loaded = sys.modules.get("sglang")
    if loaded is not None and getattr(loaded, "__path__", None):
        return Path(next(iter(loaded.__path__)))
    spec = importlib.util.find_spec("sglang")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    for base in (os.environ.get("KVSTREAM_SGLANG_DIR"), PEERS_VENV / "sglang-src"):
        if base and (Path(base) / "sglang" / "srt").is_dir():
            return Path(base) / "sglang"
    raise ModuleNotFoundError("SGLang 0.5.23 not found (run scripts/test-peers)")


def _prepare_native_hash_build() -> None:
    # torch's JIT build needs the ``ninja`` the venv installed, and keeps its output in the
    # peer venv instead of ~/.cache.
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(PEERS_VENV / "torch-extensions"))


def _register_bare_sglang() -> Path:
    root = sglang_root()
    if "sglang" not in sys.modules:
        pkg = types.ModuleType("sglang")
        pkg.__path__ = [str(root)]
        pkg.__file__ = str(root / "__init__.py")
        sys.modules["sglang"] = pkg
    return root


def load_sglang_kv_events() -> types.ModuleType:
    """SGLang 0.5.23's ``sglang.srt.disaggregation.kv_events`` (event structs, publisher)."""
    _register_bare_sglang()
    from sglang.srt.disaggregation import kv_events

    return kv_events


def load_sglang() -> dict[str, Any]:
    """SGLang 0.5.23's modules: ``kv_events`` (structs, publisher), ``events`` (recorder),
    ``radix_cache``, ``base_prefix_cache``, ``cache_init_params``, ``native_hash``; the C++ hash
    is built and loaded."""
    root = _register_bare_sglang()
    name = "sglang.srt.mem_cache.base_prefix_cache"
    if name not in sys.modules:
        path = root / "srt" / "mem_cache" / "base_prefix_cache.py"
        tree = ast.parse(path.read_text())
        kept = [
            node
            for node in tree.body
            if not (isinstance(node, ast.ImportFrom) and node.module in _BASE_PREFIX_CACHE_SKIPPED)
        ]
        if len(tree.body) - len(kept) != len(_BASE_PREFIX_CACHE_SKIPPED):
            raise RuntimeError(f"{path}: the imports to skip are not where expected")
        tree.body = kept
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        exec(compile(tree, str(path), "exec"), module.__dict__)
    _prepare_native_hash_build()
    from sglang.srt.disaggregation import kv_events
    from sglang.srt.mem_cache import base_prefix_cache, cache_init_params, events, radix_cache
    from sglang.srt.mem_cache.cpp_utils import native_hash

    native_hash._load_native_hash_module()
    return {
        "kv_events": kv_events,
        "events": events,
        "radix_cache": radix_cache,
        "base_prefix_cache": base_prefix_cache,
        "cache_init_params": cache_init_params,
        "native_hash": native_hash,
        "root": root,
    }


def load_module_file(name: str, path: Path) -> types.ModuleType:
    """Execute one module file of an older release under ``name`` (its imports resolve against
    the installed packages)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing (run scripts/test-peers)")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

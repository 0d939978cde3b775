"""Which optional C extension modules this installation can use (``kvstream --version``,
the ``native`` label of ``kvstream_build_info``).

Each extension (``kvstream/*/_*native*.c``, built by ``pip install`` when a C compiler is
present) is imported by the module that uses it, unless ``KVSTREAM_NO_NATIVE`` is set (any
value but empty or ``0``); without it that module runs its pure-Python twin. This imports
each one the same way and says which succeeded.
"""

from __future__ import annotations

import os
from importlib import import_module
from typing import Final

__all__ = ["NATIVE_MODULES", "active_native", "native_status"]

#: Every optional extension, as pyproject.toml's ``ext-modules`` lists them (a test checks).
NATIVE_MODULES: Final = (
    "kvstream.hashing._v1native",
    "kvstream.hashing._chainnative",
    "kvstream.events._trusted_native",
    "kvstream.engines._wire_native",
    "kvstream.index._table_native",
    "kvstream.index._match_native",
    "kvstream.codec._tokens_native",
    "kvstream.codec._columns_native",
    "kvstream.workloads._mooncake_native",
)


def native_status() -> dict[str, str]:
    """Module name -> ``"active"``, ``"off (KVSTREAM_NO_NATIVE)"`` or ``"not built"``
    (``"failed: <error>"`` for one that exists but does not load)."""
    if os.environ.get("KVSTREAM_NO_NATIVE", "") not in ("", "0"):
        return dict.fromkeys(NATIVE_MODULES, "off (KVSTREAM_NO_NATIVE)")
    out: dict[str, str] = {}
    for name in NATIVE_MODULES:
        try:
            import_module(name)
        except ModuleNotFoundError as exc:
            out[name] = "not built" if exc.name == name else f"failed: {exc}"
        except Exception as exc:  # a broken build: say so rather than crash --version
            out[name] = f"failed: {type(exc).__name__}: {exc}"
        else:
            out[name] = "active"
    return out


def active_native() -> list[str]:
    """The short names (``hashing._v1native``) of the extensions in use."""
    return [name.removeprefix("kvstream.") for name, s in native_status().items() if s == "active"]

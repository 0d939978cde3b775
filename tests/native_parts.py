"""The native parts tests hold against their twins, imported whatever KVSTREAM_NO_NATIVE says."""

from __future__ import annotations

from types import ModuleType

import pytest

from kvstream._native import import_part


def native_part(name: str) -> ModuleType:
    """The native part ``name`` (see :func:`kvstream._native.import_part`); skips the calling
    test module when its extension did not build."""
    try:
        return import_part(name)
    except ImportError as exc:
        pytest.skip(f"{name} is not built: {exc}", allow_module_level=True)

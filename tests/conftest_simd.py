"""The ``simd`` fixture: a test run with the C hash chains' SIMD code and with their portable C."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from native_parts import native_part


@pytest.fixture(params=["simd", "portable"])
def simd(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Run a test with the SIMD code (when the CPU has it) and with the portable C; yields
    whether SIMD was asked for. Skips where the C extension is not built."""
    native = native_part("kvstream.hashing._chainnative")
    before = native.has_sha_ni()
    native.set_simd(request.param == "simd")
    try:
        yield request.param == "simd"
    finally:
        native.set_simd(before)

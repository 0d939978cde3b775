"""Test lanes (scripts/test --lane ...): which tests are slow, and which assume native code.

- ``slow``: fuzzing, schema-compatibility sweeps, wheel builds, Kafka fault schedules and
  anything marked ``@pytest.mark.slow``; ``scripts/test --lane default`` leaves them out,
  ``--lane slow`` runs only them, and CI runs both.
- ``native``: tests about the native modules themselves (that they are the ones loaded); the
  pure-Python lane (``KVSTREAM_NO_NATIVE=1``) skips them.
- ``KVSTREAM_HYPOTHESIS_PROFILE=sanitize`` (scripts/test-sanitize): property tests without
  their own example count draw 30 examples instead of 100 (an ASan build runs ~5x slower;
  the full counts run in the default lane).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from kvstream._native import disabled

settings.register_profile("sanitize", max_examples=30, deadline=None)
if os.environ.get("KVSTREAM_HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["KVSTREAM_HYPOTHESIS_PROFILE"])

#: test modules that belong to the slow lane as a whole
SLOW_MODULES = frozenset(
    {
        "test_codec_fuzz",
        "test_codec_compat",
        "test_kafka_faults",
        "test_file_faults",
        "test_replay_wheel",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_native = pytest.mark.skip(reason="asserts native code; KVSTREAM_NO_NATIVE is set")
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if disabled() and item.get_closest_marker("native") is not None:
            item.add_marker(skip_native)

"""Shared test configuration. Fixtures live in their own modules, registered here."""

pytest_plugins = ["conftest_kafka", "conftest_lanes", "conftest_serve", "conftest_simd"]

"""Test settings: type-check every rewritten program, and keep hypothesis bounded for CI."""

import os

os.environ.setdefault("AUTOOPT_CHECK", "1")
# Multi-device tests spawn their own subprocess with the flag; the main process keeps 1 device
# unless the caller set it (tests/test_multidevice.py runs either way).

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("AUTOOPT_HYPOTHESIS_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.load_profile("ci")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_wrappers():
    """Each test's ``optimize(f)`` builds its own wrapper: module-level functions are shared by
    many tests, and ``optimize`` otherwise returns the one a previous test made (and warmed)."""
    from autoopt.testing import forget_wrappers

    forget_wrappers()
    yield

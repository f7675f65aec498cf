"""The one wait of the tests: poll a condition until it holds, never sleep a fixed time.

A test waits on the event it checks: ``wait_until(lambda: agent.persisted() >= 5, "step 5
persisted")``. The timeout is only a bound against a hang (generous, so a loaded machine does
not fail a correct run), never a timed assertion.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["wait_until"]


def wait_until(
    cond: Callable[[], T], what: str, timeout: float = 60.0, interval: float = 0.02
) -> T:
    """Calls ``cond`` until it returns a truthy value, and returns that value.

    Raises:
        AssertionError: naming ``what`` when ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)

"""The one wait of the tests: poll a condition until it holds, never sleep a fixed time.

A test waits on the event it checks: ``wait_until(lambda: agent.persisted() >= 5, "step 5
persisted")``. The timeout is only a bound against a hang (generous, so a loaded machine does
not fail a correct run), never a timed assertion. On a timeout the message names what was
waited for and the last state seen (the condition's last value, its last error, ``state()``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["wait_until"]


def wait_until(
    cond: Callable[[], T],
    what: str,
    timeout: float = 60.0,
    interval: float = 0.02,
    *,
    ignore: tuple[type[BaseException], ...] = (),
    state: Callable[[], object] | None = None,
) -> T:
    """Calls ``cond`` until it returns a truthy value, and returns that value.

    Args:
        cond: the check; a falsy value means "not yet".
        what: what is waited for, as the failure names it.
        timeout: seconds before the wait fails (a bound against a hang, not a measurement).
        interval: seconds between two checks.
        ignore: errors of ``cond`` that mean "not yet" (a server not listening yet); the last
            one is named on a timeout.
        state: called once on a timeout; its value is named as the last state seen.

    Raises:
        AssertionError: naming ``what`` and the last state seen when ``timeout`` seconds pass
            first.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = cond()
        except ignore as e:
            last = e
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            seen = f"{last!r}" if state is None else f"{last!r}; {state()}"
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what} (last seen: {seen})"
            )
        time.sleep(interval)

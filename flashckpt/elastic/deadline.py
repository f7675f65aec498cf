"""One shared helper for deadlines: every blocking call in ``elastic`` takes a ``timedelta``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

__all__ = ["Deadline"]


@dataclass(frozen=True, slots=True)
class Deadline:
    """A point in ``time.monotonic()`` time after which an operation gives up."""

    expires_at: float
    """Monotonic clock reading (seconds) at which the deadline passes."""

    @classmethod
    def after(cls, timeout: timedelta) -> Deadline:
        """Returns the deadline that passes ``timeout`` from now.

        Args:
            timeout: How long from now; must not be negative.

        Raises:
            ValueError: If ``timeout`` is negative.
        """
        seconds = timeout.total_seconds()
        if seconds < 0:
            raise ValueError(f"timeout must not be negative, got {timeout!r}")
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left until the deadline, never negative."""
        return max(0.0, self.expires_at - time.monotonic())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self.expires_at

    def sleep(self, seconds: float) -> None:
        """Sleeps ``seconds``, or only until the deadline if that comes first."""
        time.sleep(max(0.0, min(seconds, self.remaining())))

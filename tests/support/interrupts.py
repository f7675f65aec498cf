"""The interruption a test raises itself to stop a training loop midway, as a Ctrl-C would.

``SimulatedInterrupt`` is a ``KeyboardInterrupt`` (so the code under test sees what a real
Ctrl-C gives it), and tests catch it alone: ``except KeyboardInterrupt`` or
``pytest.raises(KeyboardInterrupt)`` in a test would also swallow a real Ctrl-C (SIGINT) sent
to pytest, and the run would go on instead of stopping (seen: a SIGINT to a run of
``tests/trainer`` was taken for a test's own interruption, failed that test, and the run went
on to its end). ``tests/architecture/test_interrupts.py`` keeps it so.
"""

from __future__ import annotations

__all__ = ["SimulatedInterrupt"]


class SimulatedInterrupt(KeyboardInterrupt):
    """A Ctrl-C raised by the test itself; a real one is a plain ``KeyboardInterrupt``."""

"""Process lifetime helpers: children that die with the process that started them.

Linux's ``prctl(PR_SET_PDEATHSIG, sig)`` makes the kernel send ``sig`` to a process when its
parent *thread* exits, whatever the way the parent died (SIGKILL included). So:

- set it in the child (between fork and exec with :func:`die_with_parent`, or first thing in the
  child's ``main`` with :func:`set_parent_death_signal`);
- spawn such children from a thread that lives as long as the parent process (the main thread,
  or a dedicated long-lived thread), never from a short-lived helper thread;
- after setting it, check that the parent is still the expected one: if the parent died before
  the ``prctl`` call, no signal will ever come.

On other systems these helpers do nothing; the launcher's own shutdown still stops its children.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["die_with_parent", "set_parent_death_signal"]

_PR_SET_PDEATHSIG = 1


def _resolve_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved once in the parent, so a child only makes one plain call between fork and exec.
_prctl = _resolve_prctl()


def set_parent_death_signal(sig: signal.Signals, *, expected_parent: int | None = None) -> bool:
    """Asks the kernel to send ``sig`` to this process when its parent dies.

    Args:
        sig: The signal (SIGKILL for workers, SIGTERM for daemons that must clean up).
        expected_parent: The parent's pid. If the parent is already gone (this process was
            re-parented before the call), ``sig`` is raised at once, as the kernel would have.

    Returns:
        Whether the platform supports it (Linux).
    """
    if _prctl is None:
        return False
    _prctl(_PR_SET_PDEATHSIG, int(sig))
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def die_with_parent(sig: signal.Signals) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen`` that sets the parent-death signal ``sig``.

    Args:
        sig: The signal the child receives when the spawning thread's process dies.
    """
    parent = os.getpid()

    def preexec() -> None:  # pragma: no cover - runs in the child between fork and exec
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, int(sig))
            if os.getppid() != parent:
                os._exit(1)

    return preexec

"""Entry point of every worker started by ``flashckpt run``: die with the launcher, then run.

torch's elastic agent starts each worker in a new session (``start_new_session=True``), so a
launcher killed with SIGKILL would leave its workers running, still holding ports, GPUs and
shared memory, and still talking to a job that has moved on. Workers are therefore started as::

    python -u -m flashckpt.elastic.launch.worker_entry <script.py> [args...]
    python -u -m flashckpt.elastic.launch.worker_entry -m <module> [args...]
    python -u -m flashckpt.elastic.launch.worker_entry --exec <program> [args...]   (flashckpt run
    --no-python)

which sets ``PR_SET_PDEATHSIG=SIGKILL`` (the kernel kills the worker when its launcher dies,
however it dies), then runs the script or module as ``__main__`` exactly like ``python`` would:
same ``sys.argv``, script directory first on ``sys.path``. With ``--exec`` the process becomes
the program (``execvp``; the parent-death signal survives it). With ``FLASHCKPT_PREWARM_SOCKET``
set, the script runs in a fork of the launcher's pre-warmed process instead, and this process
relays signals and the exit status (see :mod:`flashckpt.elastic.launch.prewarm`).

A worker that fails with an exception prints its traceback, flushes its output and logging, and
exits at once with code 1, without the interpreter's teardown: tearing down torch (process
groups, the DDP reducer, gloo's threads) takes about a second, which the launcher would spend
waiting before it can start the recovery. Set ``FLASHCKPT_WORKER_FAST_EXIT=0`` to keep the
normal teardown (``atexit`` handlers run then). A normal exit or ``sys.exit()`` is unchanged.
"""

from __future__ import annotations

import os
import signal
import sys

from flashckpt import envnames
from flashckpt.elastic.launch.prewarm import PREWARM_SOCKET_ENV, exit_with_status, run_prewarmed
from flashckpt.elastic.launch.usercode import FAST_EXIT_ENV, run_user_code
from flashckpt.elastic.procutil import set_parent_death_signal

__all__ = ["EXEC_FLAG", "FAST_EXIT_ENV", "LAUNCHER_PID_ENV", "main", "run_user_code"]

EXEC_FLAG = "--exec"
"""``--exec <program> [args]``: replace this process by the program (``--no-python``)."""

LAUNCHER_PID_ENV = envnames.LAUNCHER_PID
"""Set by the launcher to its pid; a worker whose parent is not this pid exits at once."""


def main(argv: list[str] | None = None) -> None:
    """Sets the parent-death signal and runs the user's script or module.

    Args:
        argv: ``[script, *args]`` or ``["-m", module, *args]``; defaults to ``sys.argv[1:]``.

    Raises:
        SystemExit: With a usage message if no script is given.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    set_parent_death_signal(
        signal.SIGKILL, expected_parent=int(launcher) if launcher and launcher.isdigit() else None
    )
    if not args or (args[0] in ("-m", EXEC_FLAG) and len(args) < 2):
        raise SystemExit(
            "usage: python -m flashckpt.elastic.launch.worker_entry <script.py> [args] | "
            "-m <module> [args] | "
            f"{EXEC_FLAG} <program> [args]"
        )
    if args[0] == EXEC_FLAG:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execvp(args[1], args[1:])
        except OSError as exc:
            raise SystemExit(f"flashckpt run --no-python: cannot run {args[1]!r}: {exc}") from exc
    socket_path = os.environ.get(PREWARM_SOCKET_ENV)
    if socket_path:
        status = run_prewarmed(socket_path, args)
        if status is not None:
            exit_with_status(status)
    run_user_code(args)


if __name__ == "__main__":
    main()

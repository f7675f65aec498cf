"""Thread names for the loop benchmark's per-thread CPU accounting (``benchmarks/stall.py``).

On Python < 3.14 a ``threading.Thread``'s name stays in Python: ``/proc/<pid>/task/<tid>/comm``
shows the process name ("python") for every thread, so the copy thread, the pre-fault thread and
the node agent's persist/hash threads cannot be told apart from outside. The loop benchmark puts
this directory first on ``PYTHONPATH`` of the process it measures; the node agent that process
starts inherits the environment, so both load this module at start-up. It does nothing unless
``$FCBENCH_THREAD_LOG`` names a directory. Then every Python thread, when it starts, appends
``start <pid> <tid> - <name>`` to ``<dir>/<pid>.threads`` and sets its kernel name (``comm``,
15 bytes) to its Python name, and when it ends appends ``exit <pid> <tid> <cpu seconds> <name>``
(``time.thread_time()``: the CPU time of a thread that ended is in no ``/proc`` file any more).
Two small appends per thread: the measured code is not otherwise touched.
"""

from __future__ import annotations

import os

_DIR = os.environ.get("FCBENCH_THREAD_LOG")

if _DIR:
    import ctypes
    import threading
    import time

    try:
        _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
    except OSError:
        _libc = None
    _PR_SET_NAME = 15

    _LOG_DIR: str = _DIR

    def _record(kind: str, name: str, cpu: float | None = None) -> None:
        line = f"{kind} {os.getpid()} {threading.get_native_id()} "
        line += ("-" if cpu is None else f"{cpu:.6f}") + f" {name}\n"
        try:
            fd = os.open(
                os.path.join(_LOG_DIR, f"{os.getpid()}.threads"),
                os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                0o600,
            )
        except OSError:
            return
        try:
            os.write(fd, line.encode("utf-8", "replace"))
        finally:
            os.close(fd)

    _orig = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def _bootstrap_inner(self: threading.Thread) -> None:
        name = self.name.replace("\n", " ")
        if _libc is not None:
            _libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        _record("start", name)
        try:
            _orig(self)
        finally:
            _record("exit", name, time.thread_time())

    threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]

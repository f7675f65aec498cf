"""Pre-warmed workers: fork each worker from a process that has already imported torch.

A fresh worker spends seconds importing before it trains: ``import torch`` (about 2.5 s on a
small machine) and, at the first ``DistributedDataParallel``, ``torch._dynamo`` (another 2.4 s).
After a failure every worker of the job is fresh, so that is paid on the recovery path, on
every machine at once. This module removes it:

- the launcher starts a *zygote* (``python -m flashckpt.elastic.launch.prewarm``) that imports the
  heavy modules once (``torch``, ``torch.distributed``, ``torch.nn.parallel``, ``torch._dynamo``,
  ``flashckpt``; no CUDA initialisation, no threads of its own) and waits on a Unix socket;
- torch's elastic agent still starts each worker as a process of its own
  (``python -m flashckpt.elastic.launch.worker_entry script ...``, see
  :mod:`flashckpt.elastic.launch.worker_entry`), but that process is now a small *stub*: it sends
  its command line, environment, working directory, CPU affinity and standard streams (file
  descriptors) to the zygote, which forks a child that becomes the worker: it takes the stub's
  environment and streams and runs the script as ``__main__``;
- the stub stands in for the worker towards torch: it forwards the signals it receives
  (SIGTERM, SIGINT, ...) to the worker's process group and exits with the worker's status;
- lifetimes are tied: if the stub dies (even by SIGKILL) the zygote kills its worker; if the
  zygote dies its workers get SIGKILL (parent-death signal); the zygote dies with the
  launcher.

If the zygote is not running, not ready, or refuses, the stub runs the script itself (a cold
start); nothing else changes. ``flashckpt run --no-prewarm`` turns the zygote off. Limits: the
worker inherits the zygote's memory policy (CPU affinity is copied from the stub), and modules
imported by the zygote see the launcher's environment at import time, not the worker's; use
``--no-prewarm`` where either matters (e.g. NUMA memory binding).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from flashckpt import envnames
from flashckpt.elastic.launch.usercode import run_user_code
from flashckpt.elastic.procutil import die_with_parent, set_parent_death_signal

__all__ = [
    "DEFAULT_MODULES",
    "PREWARM_SOCKET_ENV",
    "Prewarmer",
    "exit_with_status",
    "run_prewarmed",
    "serve",
]

PREWARM_SOCKET_ENV = envnames.PREWARM_SOCKET
"""Set by the launcher in the workers' environment: the zygote's socket."""

DEFAULT_MODULES = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "flashckpt",
    # What the first checkpointing() call imports (the restore, storage, fsspec, xxhash):
    # 0.2-0.3 s a fresh worker would pay between building its model and its restore.
    "flashckpt.trainer.checkpointer",
)
"""What the zygote imports: what a DDP training script with flashckpt imports anyway."""

_MAX_MESSAGE = 1 << 22
_FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


# ---------------------------------------------------------------------------------- stub side


def run_prewarmed(socket_path: str, args: Sequence[str]) -> int | None:
    """Runs the worker as a fork of the zygote; returns its exit status, or ``None``.

    Args:
        socket_path: The zygote's socket.
        args: ``[script, *args]`` or ``["-m", module, *args]``.

    Returns:
        ``None`` if the zygote could not take the worker (run it here instead); otherwise the
        worker's status: its exit code, or ``-N`` if signal N killed it.
    """
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(2.0)
        sock.connect(socket_path)
    except OSError:
        return None
    with sock:
        request = {
            "args": list(args),
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "affinity": sorted(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else None,
        }
        try:
            payload = json.dumps(request).encode() + b"\n"
            socket.send_fds(sock, [payload], [0, 1, 2])
            reader = sock.makefile("rb")
            first = reader.readline()
        except OSError:
            return None
        if not first:
            return None
        pid = int(json.loads(first)["pid"])
        # From here on the worker runs: this process only relays signals and the exit status.
        for sig in _FORWARDED_SIGNALS:
            signal.signal(sig, lambda signum, frame: _forward(pid, signum))
        sock.settimeout(None)
        while True:
            try:
                line = reader.readline()
                break
            except InterruptedError:
                continue
        if not line:
            print(
                f"flashckpt worker stub: the pre-warm process went away; worker pid {pid} was "
                "killed with it",
                file=sys.stderr,
            )
            return 1
        return int(json.loads(line)["status"])


def _forward(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def exit_with_status(status: int) -> None:
    """Ends this process with a worker's status (an exit code, or ``-N`` for signal N)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if status < 0:
        _die_by_signal(-status)
        os._exit(128 - status)  # a signal whose default action does not end a process
    os._exit(status)


# Signals whose default action stops rather than ends a process: a worker is never reported
# killed by one, and sending it to the stub would freeze it instead of ending it.
_STOP_SIGNALS = frozenset({signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})


def _die_by_signal(signum: int) -> None:
    """Ends this process by ``signum``, so its parent (torch) sees the worker's ``-N``; returns
    only where that signal cannot end it (its default action stops or ignores)."""
    if signum in _STOP_SIGNALS:
        return
    if signum != signal.SIGKILL:
        # SIGKILL's action cannot be changed (EINVAL) and needs no reset; any other signal
        # must hit its default action, not the relay handler installed above, nor a mask.
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    with contextlib.suppress(OSError):
        os.kill(os.getpid(), signum)
    # Delivery to this process is synchronous for an unblocked signal; the sleep only covers
    # a signal whose default action is to be ignored (SIGCHLD, SIGWINCH...).
    time.sleep(0.1)


# ---------------------------------------------------------------------------------- zygote


class _Child:
    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self.conn = conn


def serve(socket_path: str, modules: Sequence[str]) -> int:
    """Imports ``modules``, then forks a worker for every stub that connects, until killed.

    Args:
        socket_path: Where to listen (created; an old socket file is replaced).
        modules: Modules to import before serving.

    Returns:
        The exit code.
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            print(f"flashckpt prewarm: cannot import {name}: {exc}", file=sys.stderr)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(socket_path + ".tmp")
    finally:
        os.umask(old_umask)
    listener.listen(64)
    # Clients may connect only once everything is imported.
    os.replace(socket_path + ".tmp", socket_path)
    stop = False
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        if signum != signal.SIGCHLD:
            stop = True
        with contextlib.suppress(OSError):
            os.write(wake_w, b"x")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, on_signal)
    children: dict[int, _Child] = {}
    by_conn: dict[int, _Child] = {}
    try:
        while not stop:
            watched: list[Any] = [listener, wake_r, *(c.conn for c in children.values())]
            readable, _, _ = select.select(watched, [], [], 1.0)
            if wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            _reap(children, by_conn)
            for ready in readable:
                if ready is listener:
                    child = _accept(listener, wake_r, wake_w)
                    if child is not None:
                        children[child.pid] = child
                        by_conn[child.conn.fileno()] = child
                elif ready is not wake_r and isinstance(ready, socket.socket):
                    holder = by_conn.get(ready.fileno())
                    if holder is not None and _stub_gone(ready):
                        # The stub died (torch gave up on it, or it was killed): so does its
                        # worker.
                        _forward(holder.pid, signal.SIGKILL)
    finally:
        for child in children.values():
            _forward(child.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.unlink(socket_path)
    return 0


def _stub_gone(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _reap(children: dict[int, _Child], by_conn: dict[int, _Child]) -> None:
    while children:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        child = children.pop(pid, None)
        if child is None:
            continue
        by_conn.pop(child.conn.fileno(), None)
        status = -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
        with contextlib.suppress(OSError):
            child.conn.sendall(json.dumps({"status": status}).encode() + b"\n")
        child.conn.close()


def _accept(listener: socket.socket, wake_r: int, wake_w: int) -> _Child | None:
    conn, _ = listener.accept()
    conn.settimeout(5.0)
    try:
        data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 3)
        while not data.endswith(b"\n"):
            more = conn.recv(_MAX_MESSAGE)
            if not more:
                raise OSError("the stub closed the connection")
            data += more
        request = json.loads(data)
        if len(fds) != 3:
            raise OSError(f"expected 3 file descriptors, got {len(fds)}")
    except (OSError, ValueError) as exc:
        print(f"flashckpt prewarm: bad request from a stub: {exc}", file=sys.stderr)
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the worker; it never returns into this loop
        _become_worker(request, fds, listener, conn, (wake_r, wake_w))
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except OSError:
        _forward(pid, signal.SIGKILL)
    conn.setblocking(False)
    return _Child(pid, conn)


def _become_worker(
    request: dict[str, Any],
    fds: list[int],
    listener: socket.socket,
    conn: socket.socket,
    pipe: tuple[int, int],
) -> None:  # pragma: no cover - runs in the forked worker
    status = 1
    try:
        listener.close()
        conn.close()
        for fd in pipe:
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()  # its own process group: the stub forwards signals to it as a group
        set_parent_death_signal(signal.SIGKILL)  # the zygote's death kills its workers
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        # Python's own stream objects still wrap fds 0-2, now pointing at the stub's streams.
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if request.get("affinity") and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, request["affinity"])
        status = 0
        try:
            run_user_code(list(request["args"]))
        except SystemExit as exc:
            status = _exit_code(exc)
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# ---------------------------------------------------------------------------------- launcher side


class Prewarmer:
    """The launcher's handle on its zygote: starts it, restarts it, says when it is ready.

    Start it from a thread that lives as long as the launcher (the zygote gets SIGTERM through
    the parent-death signal when that thread's process dies).

    Args:
        socket_path: Where the zygote listens.
        log_path: Its output.
        modules: What it imports.
    """

    def __init__(
        self, socket_path: str, log_path: str, modules: Sequence[str] = DEFAULT_MODULES
    ) -> None:
        self.socket_path = socket_path
        self.log_path = log_path
        self.modules = list(modules)
        self._proc: Any = None
        self._starts = 0

    def start(self) -> None:
        """Starts the zygote (again, if it died); returns at once."""
        import subprocess

        if self._proc is not None and self._proc.poll() is None:
            return
        if self._starts >= 5:
            return  # it keeps dying: workers start cold, see the log
        self._starts += 1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        cmd = [sys.executable, "-u", "-m", "flashckpt.elastic.launch.prewarm", "--socket",
        self.socket_path,
               "--modules", ",".join(self.modules)]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                # Its own session: a terminal's Ctrl-C stops the launcher, which stops it.
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGTERM),
            )

    def wait_ready(self, timeout: float) -> bool:
        """Waits until the zygote accepts connections; ``False`` if it did not in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            if os.path.exists(self.socket_path):
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        """Stops the zygote and every worker it forked. Never raises."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except Exception:
                proc.kill()
                proc.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)


def main(argv: list[str] | None = None) -> int:
    """``python -m flashckpt.elastic.launch.prewarm --socket PATH [--modules a,b]``: run a
    zygote."""
    parser = argparse.ArgumentParser(prog="python -m flashckpt.elastic.launch.prewarm")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--modules", default=",".join(DEFAULT_MODULES))
    args = parser.parse_args(argv)
    return serve(args.socket, [m for m in args.modules.split(",") if m])


if __name__ == "__main__":
    sys.exit(main())

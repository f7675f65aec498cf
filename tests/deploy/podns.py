"""Pods on one machine, simulated with Linux namespaces: the layout of deploy/kubernetes's node
agent DaemonSet and its trainer pods, for real processes.

A :class:`PodSim` has a "host" directory on a tmpfs of its own (as the node's ``/dev/shm`` is)
holding ``shm/`` (the snapshot slots) and ``run/`` (the agent's socket, lock and log). Each
:class:`Pod` is a process tree in its own PID namespace (its command is pid 1, with its own
``/proc``) and its own mount namespace, where

- ``/dev/shm`` is a tmpfs of the pod's own, 64 MiB, as a container gets by default;
- ``CONTAINER/shm`` and ``CONTAINER/run`` are bind mounts of the host directories (a hostPath
  volume), under a directory of the pod's own (``/mnt`` overmounted);
- the host directory itself is hidden (overmounted): the pod reaches it only through its mounts;
- its command runs as an unprivileged user (:data:`UID`, no name, as ``runAsUser`` gives), who
  owns the host directories (as the DaemonSet's init container makes them).

Everything else (the file system, the network) is shared, as with a pod's other volumes; files
the pods share besides (logs, storage) go in :attr:`PodSim.vol`, a directory of that user.
Killing a pod SIGKILLs its pid 1, and with it, as the kernel does for a PID namespace, every
process of the pod; its mounts go with its mount namespace. :meth:`PodSim.close` kills every pod
it started and unmounts the host tmpfs, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import psutil

CONTAINER = "/mnt/flashckpt"
"""Where the pods mount the host directories (the manifests' /flashckpt; /mnt exists on every
Debian root file system, and a pod's tmpfs over it leaves the host's untouched)."""


def _pod_uid(uid: int = 4242) -> int:
    """``uid``, or 0 where that user cannot import the package with this interpreter (a CI
    clone in a temp directory only root may enter: seen, 'No module named flashckpt')."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return uid
    ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    argv = ["setpriv", *ids, "--", sys.executable, "-c", "import flashckpt"]
    done = subprocess.run(argv, capture_output=True, cwd="/", timeout=120)
    return uid if done.returncode == 0 else 0


UID = _pod_uid()
"""The pods' user and group id (``runAsUser``/``runAsGroup``): 4242, not root, no passwd entry;
root only where that user cannot read this tree (see :func:`_pod_uid`)."""

# $1: host dir; $2: container dir; the rest: the pod's command (exec'ed as UID: it is pid 1).
_POD_INIT = r"""
set -eu
host=$1 ctr=$2 uid=$3
shift 3
mount -t tmpfs -o size=64m,mode=1777 pod-dev-shm /dev/shm
mount -t tmpfs -o size=1m,mode=0755 pod-root "${ctr%/*}"
mkdir -p "$ctr/shm" "$ctr/run"
mount --bind "$host/shm" "$ctr/shm"
mount --bind "$host/run" "$ctr/run"
mount -t tmpfs -o size=1m,mode=0700 hide-host "$host"
exec setpriv --reuid="$uid" --regid="$uid" --clear-groups -- "$@"
"""


def unavailable() -> str | None:
    """Why pods cannot be simulated here, or None."""
    if os.geteuid() != 0:
        return "simulated pods need root (PID and mount namespaces, tmpfs mounts)"
    for tool in ("unshare", "mount", "umount", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (apt-get install util-linux mount)"
    if not os.path.isdir(os.path.dirname(CONTAINER)):
        return f"{os.path.dirname(CONTAINER)} does not exist"
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "true"], capture_output=True
    )
    if done.returncode != 0:
        return f"cannot create PID and mount namespaces: {done.stderr.decode().strip()}"
    return None


class Pod:
    """A process tree in PID and mount namespaces of its own (see the module docstring)."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.proc = proc
        """``unshare``: it waits for the pod's pid 1."""
        self.log = log

    def init_pid(self) -> int | None:
        """The host pid of the pod's pid 1 (None before it exists or once it is gone)."""
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return None
        return children[0].pid if children else None

    def pids(self) -> list[int]:
        """Every process of the pod, as host pids."""
        pid = self.init_pid()
        if pid is None:
            return []
        try:
            init = psutil.Process(pid)
            return [pid, *(c.pid for c in init.children(recursive=True))]
        except psutil.Error:
            return []

    def kill(self) -> None:
        """SIGKILLs the pod's pid 1: the kernel kills every other process of the pod."""
        pid = self.init_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def wait(self, timeout: float) -> int:
        """The pod's exit status (its pid 1's); kills it if it runs longer than ``timeout``."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"pod {self.name} ran over {timeout} s:\n{self.output()}"
            ) from None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log.exists() else ""


class PodSim:
    """A machine's host directories and the pods using them (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.host = root / "host"
        self.host.mkdir(mode=0o700)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512m,mode=0700", "node-shm", str(self.host)],
            check=True,
        )
        # What the DaemonSet's init container does: the agent's own, private directories.
        for d in ("shm", "run"):
            (self.host / d).mkdir(mode=0o700)
            os.chown(self.host / d, UID, UID)
        self.vol = Path(tempfile.mkdtemp(prefix="fcpods-"))
        """Files the pods share besides the host directories (a volume of the pods' user)."""
        os.chown(self.vol, UID, UID)
        self.pods: list[Pod] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str]) -> Pod:
        log = self.root / f"pod-{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [
                    "unshare",
                    "--pid",
                    "--fork",
                    "--mount",
                    "--mount-proc",
                    "--propagation",
                    "private",
                    "/bin/sh",
                    "-c",
                    _POD_INIT,
                    "pod",
                    str(self.host),
                    CONTAINER,
                    str(UID),
                    *argv,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**env, "HOME": str(self.vol), "USER": "pod"},
                cwd=str(self.vol),
            )
        pod = Pod(name, proc, log)
        self.pods.append(pod)
        return pod

    def close(self) -> None:
        for pod in self.pods:
            pod.kill()
        subprocess.run(["umount", "-l", str(self.host)], capture_output=True)
        shutil.rmtree(self.vol, ignore_errors=True)

"""Simulated machines that really are separate: Linux namespaces, a private bridge, private memory.

Each :class:`Machine` of a :class:`Cluster` has

- its own network namespace, with one interface (``eth0``) on a bridge the cluster creates in a
  hub namespace of its own, and an address on that private network (``10.77.0.0/24``: it exists
  only inside these namespaces, so nothing leaves them, and two clusters never collide);
- its own hostname (a UTS namespace) and its own ``/dev/shm`` (a tmpfs in a mount namespace of
  its own), so a killed machine's shared memory is really gone: the tmpfs disappears with the
  last process of the machine;
- optionally further private directories (a tmpfs over each), e.g. the agents' default run dir.

A machine is a *holder* process that owns the namespaces; every command of the machine enters
them with ``nsenter``. :meth:`Machine.kill` SIGKILLs every process in the machine's network
namespace (the holder with them), as a power loss would; :meth:`Machine.boot` brings up a fresh
holder (empty memory, same address). :meth:`Machine.partition` takes the link down while the
machine keeps running; :meth:`Machine.heal` brings it back.

Services every machine reaches (etcd) run in the hub, on the bridge address
:attr:`Cluster.hub_addr`; the test process itself reaches a hub port through
:meth:`Cluster.forward` (a loopback relay whose far end is a socket opened inside the hub
namespace).

Needs root, ``ip`` (iproute2), ``nsenter`` and ``unshare`` (util-linux). :func:`unavailable`
tells why a machine cannot run these (tests skip with that reason).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd.server import (
    EtcdV3ServerError,
    etcd_command,
    find_etcd_binary,
    log_tail,
    wait_serving,
)

__all__ = ["Cluster", "Machine", "connect_in", "unavailable"]

_CLONE_NEWNET = 0x40000000
_SUBNET = "10.77.0"
_HOLDER_READY = b"ready\n"


def unavailable() -> str | None:
    """Why simulated machines cannot run here, or None when they can."""
    if not os.path.isdir("/proc/self/ns") or not hasattr(os, "getuid"):
        return "no Linux namespaces on this system"
    if os.getuid() != 0:
        return "simulated machines need root (network namespaces, mounts)"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (apt-get install iproute2 util-linux)"
    name = f"fcprobe-{secrets.token_hex(4)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


def _netns_pids(netns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def connect_in(netns: str, addr: str, port: int, timeout: float = 5.0) -> socket.socket:
    """A TCP connection opened inside network namespace ``netns`` (usable from this process).

    A socket belongs to the namespace it was created in, whichever thread uses it later; a
    short-lived thread enters the namespace (``setns`` changes only the calling thread's), creates
    and connects the socket, and exits.
    """
    result: list[Any] = []

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            sock = socket.create_connection((addr, port), timeout=timeout)
            result.append(sock)
        except BaseException as e:  # handed to the caller's thread
            result.append(e)

    t = threading.Thread(target=run, name=f"netns-connect-{netns}", daemon=True)
    t.start()
    t.join()
    out = result[0]
    if isinstance(out, BaseException):
        raise out
    return out


class Machine:
    """One simulated machine of a :class:`Cluster` (see the module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        name: str,
        *,
        netns: str,
        addr: str,
        shm_size: str,
        private_dirs: Sequence[str],
    ) -> None:
        self.cluster = cluster
        self.name = name
        """The machine's hostname."""
        self.netns = netns
        """Its network namespace (``ip netns exec NETNS ...`` enters it by hand)."""
        self.addr = addr
        """Its address on the cluster's private network."""
        self._shm_size = shm_size
        self._private_dirs = list(private_dirs)
        self._holder: subprocess.Popen[bytes] | None = None
        self._started: list[subprocess.Popen[bytes]] = []

    @property
    def holder_pid(self) -> int:
        if self._holder is None or self._holder.poll() is not None:
            raise RuntimeError(f"machine {self.name} is down; boot() it first")
        return self._holder.pid

    @property
    def up(self) -> bool:
        return self._holder is not None and self._holder.poll() is None

    def boot(self) -> Machine:
        """Starts the machine: a fresh hostname, /dev/shm and private dirs (empty memory)."""
        if self.up:
            return self
        for d in self._private_dirs:
            os.makedirs(d, mode=0o700, exist_ok=True)
        mounts = "".join(
            f" && mount -t tmpfs -o size={self._shm_size},mode=1777 tmpfs {d}" for d in ["/dev/shm"]
        ) + "".join(f" && mount -t tmpfs -o mode=0700 tmpfs {d}" for d in self._private_dirs)
        # The holder owns the UTS and mount namespaces; it prints "ready" once they are set up
        # and then waits for its stdin to close (or for SIGKILL).
        script = f"hostname {self.name}{mounts} && echo ready && exec cat >/dev/null"
        self._holder = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.netns,
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert self._holder.stdout is not None
        ready, _, _ = select.select([self._holder.stdout], [], [], 30)
        line = self._holder.stdout.readline() if ready else b""
        if line != _HOLDER_READY:
            err = b""
            if self._holder.poll() is not None and self._holder.stderr is not None:
                err = self._holder.stderr.read()
            self._reap_holder()
            raise OSError(f"machine {self.name} did not boot: {err.decode(errors='replace')}")
        return self

    def command(self, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """``argv`` prefixed so that it runs inside this machine, in ``cwd`` (default: ours).

        The holder is the process inside the namespaces: ``ip netns exec`` and ``unshare``
        (without ``--fork``) exec, they do not fork. Entering a mount namespace resets the
        working directory, hence ``--wd``.
        """
        wd = os.path.abspath(cwd or os.getcwd())
        return [
            "nsenter",
            "-t",
            str(self.holder_pid),
            "--net",
            "--uts",
            "--mount",
            f"--wd={wd}",
            "--",
            *argv,
        ]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Starts ``argv`` on this machine (keyword arguments go to :class:`subprocess.Popen`)."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(argv, kwargs.pop("cwd", None)), **kwargs)
        # nsenter joins the namespaces a moment after it starts (then execs, keeping its pid):
        # until then `ip netns pids` does not list it, so kill() also kills what was started here.
        self._started = [p for p in self._started if p.poll() is None] + [proc]
        return proc

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Runs ``argv`` on this machine to completion (see :func:`subprocess.run`)."""
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(argv, kwargs.pop("cwd", None)), **kwargs)

    def pids(self) -> list[int]:
        """Every process running on this machine."""
        return _netns_pids(self.netns)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILLs every process of the machine at once; its memory goes with them."""
        # Processes may still be forking while we kill: repeat until none is left.
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids() + [p.pid for p in self._started if p.poll() is None]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise OSError(f"machine {self.name}: processes {pids} survive SIGKILL")
            time.sleep(0.02)
        self._started = []
        self._reap_holder()

    def _reap_holder(self) -> None:
        holder, self._holder = self._holder, None
        if holder is None:
            return
        if holder.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                holder.kill()
        holder.wait()
        for stream in (holder.stdin, holder.stdout, holder.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def partition(self) -> None:
        """Cuts the machine off the network (its link goes down); it keeps running."""
        _ip("link", "set", "eth0", "down", netns=self.netns)

    def heal(self) -> None:
        """Brings the machine's link back after :meth:`partition`."""
        _ip("link", "set", "eth0", "up", netns=self.netns)

    def cut_from(self, addr: str) -> None:
        """Cuts the machine off one address only (an ``unreachable`` route in its namespace:
        connections fail, packets already on their way are dropped), e.g. the hub's, where the
        cluster's etcd runs: a machine that reaches its peers but not etcd."""
        _ip("route", "add", "unreachable", f"{addr}/32", netns=self.netns)

    def reconnect_to(self, addr: str) -> None:
        """Undoes :meth:`cut_from`."""
        _ip("route", "del", "unreachable", f"{addr}/32", netns=self.netns)

    def destroy(self) -> None:
        """Kills the machine and deletes its namespace (its veth goes with it)."""
        with contextlib.suppress(OSError):
            self.kill()
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)


class Cluster:
    """A private network of simulated machines, torn down on :meth:`close` whatever happened.

    Args:
        tag: Prefix of every namespace name (default: random, so parallel runs never collide).
        shm_size: Size of each machine's ``/dev/shm``.
        private_dirs: Directories each machine sees as an empty tmpfs of its own (created here
            when missing), e.g. ``["/tmp/flashckpt-0"]``.
    """

    def __init__(
        self,
        tag: str | None = None,
        *,
        shm_size: str = "2g",
        private_dirs: Sequence[str] = (),
    ) -> None:
        reason = unavailable()
        if reason is not None:
            raise OSError(reason)
        self.tag = tag or f"fc{secrets.token_hex(3)}"
        self.hub_netns = f"{self.tag}-hub"
        self.hub_addr = f"{_SUBNET}.1"
        """The hub's address on the bridge: where cluster-wide services (etcd) listen."""
        self._shm_size = shm_size
        self._private_dirs = list(private_dirs)
        self.machines: dict[str, Machine] = {}
        self._hub: Machine | None = None
        self._relays: list[_Relay] = []
        try:
            _ip("netns", "add", self.hub_netns)
            _ip("link", "set", "lo", "up", netns=self.hub_netns)
            _ip("link", "add", "br0", "type", "bridge", netns=self.hub_netns)
            _ip("addr", "add", f"{self.hub_addr}/24", "dev", "br0", netns=self.hub_netns)
            _ip("link", "set", "br0", "up", netns=self.hub_netns)
        except BaseException:
            self.close()
            raise

    @property
    def hub(self) -> Machine:
        """The hub as a machine (for running services such as etcd); booted on first use."""
        if self._hub is None:
            self._hub = Machine(
                self,
                "hub",
                netns=self.hub_netns,
                addr=self.hub_addr,
                shm_size="64m",
                private_dirs=(),
            )
        return self._hub.boot()

    def add(self, name: str, *, boot: bool = True) -> Machine:
        """Adds a machine named ``name`` (its hostname), booted unless ``boot`` is False."""
        if name in self.machines:
            raise ValueError(f"machine {name!r} exists already")
        index = len(self.machines) + 10
        if index > 250:
            raise ValueError("at most 240 machines per cluster")
        netns, addr, veth = f"{self.tag}-{name}", f"{_SUBNET}.{index}", f"v{self.tag}{index}"
        _ip("netns", "add", netns)
        m = Machine(
            self,
            name,
            netns=netns,
            addr=addr,
            shm_size=self._shm_size,
            private_dirs=self._private_dirs,
        )
        self.machines[name] = m  # from here on close() deletes it
        _ip("link", "set", "lo", "up", netns=netns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("link", "set", veth, "netns", self.hub_netns)
        _ip("link", "set", veth, "master", "br0", netns=self.hub_netns)
        _ip("link", "set", veth, "up", netns=self.hub_netns)
        _ip("addr", "add", f"{addr}/24", "dev", "eth0", netns=netns)
        _ip("link", "set", "eth0", "up", netns=netns)
        return m.boot() if boot else m

    def forward(self, port: int, addr: str | None = None) -> int:
        """A loopback port of this process's namespace relayed to ``addr:port`` in the hub.

        Returns:
            The local port (on 127.0.0.1).
        """
        relay = _Relay(self.hub_netns, addr or self.hub_addr, port)
        self._relays.append(relay)
        return relay.port

    def start_etcd(self, data_dir: str, *, binary: str | None = None, timeout: float = 30) -> str:
        """Starts an etcd server in the hub (killed by :meth:`close`); returns its client URL.

        Every machine reaches it at ``http://<hub_addr>:2379``; this process reaches it through
        :meth:`forward` (``http://127.0.0.1:<cluster.forward(2379)>``). The command line and the
        readiness probe are :mod:`flashckpt.elastic.etcd.server`'s, so it starts like every other
        etcd of the project; its log is ``<data_dir>/etcd.log``.

        Raises:
            EtcdV3ServerError: etcd exited, or does not serve within ``timeout`` seconds (the error
                carries the end of its log).
        """
        url = f"http://{self.hub_addr}:2379"
        os.makedirs(data_dir, exist_ok=True)
        log_path = os.path.join(data_dir, "etcd.log")
        argv = etcd_command(
            binary or find_etcd_binary(),
            name="hub",
            data_dir=os.path.join(data_dir, "data"),
            client_url=url,
            peer_url=f"http://{self.hub_addr}:2380",
        )
        with open(log_path, "ab") as log:
            process = self.hub.popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

        def check_alive() -> None:
            code = process.poll()
            if code is not None:
                raise EtcdV3ServerError(
                    f"etcd in the hub of {self.tag} exited with code {code} while starting; its "
                    f"log ends with:\n{log_tail(log_path)}"
                )

        wait_serving(
            f"http://127.0.0.1:{self.forward(2379)}",
            Deadline.after(timedelta(seconds=timeout)),
            check_alive=check_alive,
            log_tail=lambda: log_tail(log_path),
        )
        return url

    def close(self) -> None:
        """Kills every machine and the hub, and deletes every namespace; never raises."""
        for relay in self._relays:
            relay.close()
        self._relays.clear()
        for m in list(self.machines.values()):
            m.destroy()
        self.machines.clear()
        if self._hub is not None:
            with contextlib.suppress(OSError):
                self._hub.kill()
        for pid in _netns_pids(self.hub_netns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", self.hub_netns], capture_output=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Relay:
    """Accepts on 127.0.0.1 here and pipes each connection to ``addr:port`` inside ``netns``."""

    def __init__(self, netns: str, addr: str, port: int) -> None:
        self._target = (netns, addr, port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="netns-relay", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                far = connect_in(*self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, far]
            for a, b in ((client, far), (far, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._server.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.close()

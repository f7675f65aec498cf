"""Test helpers: throw-away TLS certificates, an in-memory rendezvous backend, and the process
helpers of simulated machines (process trees killed at once, their JSON-line logs).

The etcd server itself (:class:`flashckpt.elastic.etcd.server.EtcdV3Server`) is a product module:
``flashckpt run --standalone`` starts one. Used by the test suite and the benchmarks; no pytest
import here: the fixtures live in the test suite's ``conftest.py`` and use these.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from flashckpt.elastic.etcd.server import EtcdV3ServerError, TlsFiles

__all__ = [
    "job_processes",
    "kill_job",
    "kill_processes",
    "loopback_env",
    "make_client_certificate",
    "make_test_certificates",
    "process_tree",
    "read_jsonl",
]


def make_test_certificates(directory: str | os.PathLike[str]) -> TlsFiles:
    """Creates a throw-away CA and a server certificate for 127.0.0.1 with the openssl CLI.

    Raises:
        EtcdV3ServerError: If ``openssl`` is not installed or fails.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise EtcdV3ServerError("openssl is not installed: apt-get install openssl")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert, ext = (
        out / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem", "ext.cnf")
    )
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    commands = [
        [openssl, "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj",
         "/CN=flashckpt-test-ca"],
        [openssl, "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        [openssl, "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "2", "-extfile", ext],
    ]  # fmt: skip
    for command in commands:
        done = subprocess.run([str(c) for c in command], capture_output=True, text=True)
        if done.returncode != 0:
            raise EtcdV3ServerError(f"{' '.join(map(str, command))} failed: {done.stderr}")
    return TlsFiles(ca_file=str(ca), cert_file=str(cert), key_file=str(key))


def make_client_certificate(
    directory: str | os.PathLike[str], tls: TlsFiles, name: str = "client", *, cn: bool = False
) -> tuple[str, str]:
    """Creates a client certificate (organisation ``name``) signed by the CA of ``tls``
    (:func:`make_test_certificates` made it in the same ``directory``).

    Without a common name unless ``cn``: etcd (>= 3.4.10) refuses JSON-gateway requests made with
    a client certificate that has one (it would be ignored as a user name there).

    Returns:
        The certificate's and its key's paths.

    Raises:
        EtcdV3ServerError: If ``openssl`` is not installed or fails.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise EtcdV3ServerError("openssl is not installed: apt-get install openssl")
    out = Path(directory)
    key, csr, cert, ext = (out / f"{name}{s}" for s in (".key", ".csr", ".pem", ".cnf"))
    ca_key = Path(tls.ca_file).with_name("ca.key")
    ext.write_text("extendedKeyUsage=clientAuth\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    commands = [
        [openssl, "req", *ec, "-keyout", key, "-out", csr, "-subj",
         f"/CN={name}" if cn else f"/O={name}"],
        [openssl, "x509", "-req", "-in", csr, "-CA", tls.ca_file, "-CAkey", ca_key,
         "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", ext],
    ]  # fmt: skip
    for command in commands:
        done = subprocess.run([str(c) for c in command], capture_output=True, text=True)
        if done.returncode != 0:
            raise EtcdV3ServerError(f"{' '.join(map(str, command))} failed: {done.stderr}")
    return str(cert), str(key)


# -- simulated machines: one process tree each, on this host ------------------------------------


def loopback_env() -> dict[str, str]:
    """This process's environment for a simulated machine's launcher.

    The source tree holding this package first on ``PYTHONPATH``, gloo on loopback, one OpenMP
    thread per process.
    """
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["OMP_NUM_THREADS"] = "1"
    return env


def process_tree(pid: int) -> list[psutil.Process]:
    """A process and all its descendants (empty if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def job_processes(roots: Iterable[int], tag: str) -> list[psutil.Process]:
    """The process trees of ``roots``, plus every other process whose command line has ``tag``.

    The tag (a job's unique id) also finds processes that left their tree: daemons, orphans
    whose parent was killed first.
    """
    found = [p for pid in roots for p in process_tree(pid)]
    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if p.info["pid"] != me and tag in " ".join(p.info["cmdline"] or []):
                found.append(p)
    return found


def kill_processes(processes: Iterable[psutil.Process]) -> None:
    """SIGKILLs every process at once (like a machine losing power); does not wait."""
    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)


def kill_job(launched: Iterable[subprocess.Popen[bytes]], tag: str) -> None:
    """SIGKILLs every process of a job and reaps them; never raises.

    Args:
        launched: The processes the caller started (each with its own tree below it).
        tag: The job's unique id, in the command line of every other process of the job.
    """
    procs = list(launched)
    victims = job_processes((proc.pid for proc in procs), tag)
    kill_processes(victims)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    psutil.wait_procs(victims, timeout=10)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete JSON line of a file (a line still being written is skipped)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out

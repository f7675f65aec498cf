"""How a client proves itself to a secured etcd: TLS (the CA that signed etcd's certificate,
this client's certificate and key) and etcd's user/password authentication.

One :class:`EtcdSecurity` is built from the command line (``flashckpt run --etcd-ca ...``,
``flashckpt status --etcd-ca ...``), from torchrun's rendezvous options (``--rdzv-conf
ca_cert=...,ssl_cert=...,ssl_cert_key=...,user=...``) or from the environment
(``FLASHCKPT_ETCD_CA``, ``FLASHCKPT_ETCD_CERT``, ``FLASHCKPT_ETCD_KEY``, ``FLASHCKPT_ETCD_USER``,
``FLASHCKPT_ETCD_PASSWORD``); an explicit option wins over the environment. The password is never
a command-line flag (``ps`` shows every process's arguments): the environment or a file.

etcd's two ways of admitting a client are independent, and the kit uses both:

- ``--client-cert-auth`` with ``--trusted-ca-file``: etcd completes a TLS handshake only with a
  client that presents a certificate its CA signed (transport admission).
- ``etcdctl auth enable``: every request carries a token from ``/v3/auth/authenticate`` (user and
  password), checked against the user's roles (key-range permissions). etcd ignores a client
  certificate's common name on its JSON gateway (the transport this client speaks; a CVE fix of
  3.4.x), so role-based access needs the user and password.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

from flashckpt import envnames

__all__ = ["EtcdSecurity"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EtcdSecurity:
    """TLS files and credentials of an etcd client.

    Raises:
        ValueError: A key without a certificate, a user without a password (or the reverse), or a
            file that cannot be read; the message names the option and the fix.
    """

    ca_file: str | None = None
    """PEM bundle of the CA that signed etcd's server certificate (``None``: the system's)."""
    cert_file: str | None = None
    """This client's certificate (PEM), for an etcd run with ``--client-cert-auth``."""
    key_file: str | None = None
    """The private key of ``cert_file`` (``None``: it is in ``cert_file``)."""
    user: str | None = None
    """etcd user name (etcd's ``auth enable``); needs ``password``."""
    password: str | None = field(default=None, repr=False)
    """The user's password."""
    probe_key: bytes = b"/flashckpt/"
    """A key the user may read (the jobs' prefix), read to learn the store's revision."""

    def __post_init__(self) -> None:
        if self.key_file and not self.cert_file:
            raise ValueError(
                f"an etcd client key ({self.key_file}) was given without its certificate: pass "
                "--etcd-cert (rendezvous option ssl_cert, $FLASHCKPT_ETCD_CERT) too"
            )
        if self.user and self.password is None:
            raise ValueError(
                f"etcd user {self.user!r} has no password: set $FLASHCKPT_ETCD_PASSWORD or pass "
                "--etcd-password-file (rendezvous option password_file)"
            )
        if self.password is not None and not self.user:
            raise ValueError(
                "an etcd password was given without a user: pass --etcd-user (rendezvous option "
                "user, $FLASHCKPT_ETCD_USER)"
            )
        for option, path in (
            ("--etcd-ca", self.ca_file),
            ("--etcd-cert", self.cert_file),
            ("--etcd-key", self.key_file),
        ):
            if path and not os.access(path, os.R_OK):
                raise ValueError(
                    f"{option} {path}: the file does not exist or is not readable by this "
                    "process; mount the secret that holds it, or fix the path"
                )

    @property
    def tls(self) -> bool:
        """Whether a CA or a client certificate was given (endpoints without a scheme are then
        ``https://``)."""
        return bool(self.ca_file or self.cert_file)

    @property
    def auth(self) -> bool:
        """Whether requests carry an etcd auth token (user and password given)."""
        return bool(self.user)

    def ssl_context(self) -> ssl.SSLContext:
        """A TLS context for HTTP/1.1 connections to etcd: its server certificate verified
        against ``ca_file``, this client's certificate presented.

        Raises:
            ValueError: If a file is not a valid PEM certificate or key.
        """
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"--etcd-ca {self.ca_file}: not a PEM CA certificate ({exc}); pass the CA that "
                "signed etcd's server certificate (ca.crt of its secret)"
            ) from exc
        if self.cert_file:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(
                    f"--etcd-cert {self.cert_file} / --etcd-key {self.key_file}: cannot load the "
                    f"client certificate and key ({exc}); pass a PEM certificate and its "
                    "matching key (tls.crt and tls.key of the client secret)"
                ) from exc
        # The gateway and the watch speak HTTP/1.1 on these connections: an etcd that picked
        # h2 would answer frames http.client cannot read.
        context.set_alpn_protocols(["http/1.1"])
        return context

    @classmethod
    def from_options(
        cls,
        *,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        user: str | None = None,
        password_file: str | None = None,
        key_prefix: str = "/flashckpt",
        env: Mapping[str, str] | None = None,
    ) -> EtcdSecurity | None:
        """The security an option set asks for, each option missing taken from the environment
        (``FLASHCKPT_ETCD_*``); ``None`` when neither gives anything.

        Args:
            ca_file: ``--etcd-ca``.
            cert_file: ``--etcd-cert``.
            key_file: ``--etcd-key``.
            user: ``--etcd-user``.
            password_file: ``--etcd-password-file``: a file whose first line is the password
                (a mounted secret); else ``$FLASHCKPT_ETCD_PASSWORD``.
            key_prefix: The jobs' key prefix (the rendezvous option ``key_prefix``).
            env: The environment (default ``os.environ``).

        Raises:
            ValueError: See :class:`EtcdSecurity`; or the password file cannot be read.
        """
        environ = os.environ if env is None else env

        def pick(given: str | None, name: str) -> str | None:
            return given or environ.get(name) or None

        password: str | None = None
        password_path = pick(password_file, envnames.ETCD_PASSWORD_FILE)
        if password_path:
            try:
                with open(password_path, encoding="utf-8") as f:
                    password = f.readline().rstrip("\r\n")
            except OSError as exc:
                raise ValueError(
                    f"--etcd-password-file {password_path}: cannot read it ({exc}); mount the "
                    "secret that holds the etcd password, or set $FLASHCKPT_ETCD_PASSWORD"
                ) from exc
        elif environ.get(envnames.ETCD_PASSWORD):
            password = environ[envnames.ETCD_PASSWORD]
        security = cls(
            ca_file=pick(ca_file, envnames.ETCD_CA),
            cert_file=pick(cert_file, envnames.ETCD_CERT),
            key_file=pick(key_file, envnames.ETCD_KEY),
            user=pick(user, envnames.ETCD_USER),
            password=password,
            probe_key=(key_prefix.rstrip("/") + "/").encode(),
        )
        if not (security.tls or security.auth):
            return None
        return security

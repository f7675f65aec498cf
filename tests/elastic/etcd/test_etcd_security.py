"""A real etcd with TLS, client-certificate admission and user/password auth (issue 44).

One etcd per module (``--client-cert-auth``, ``auth enable``, auth tokens that expire after 1 s
idle): the client's refusals, each with the fix in its message, the token renewed after it
expired, and a rendezvous with a failover (rank 0 SIGKILLed, a newcomer joins) through it, the
nodes configured only through the ``FLASHCKPT_ETCD_*`` environment.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from rdzvprocs import rdzv_env, run_failover

from flashckpt import envnames
from flashckpt.elastic.etcd.client import EtcdAuthError, EtcdClient, EtcdSecurity
from flashckpt.elastic.etcd.server import EtcdV3Server, enable_auth
from flashckpt.testing.elastic import make_client_certificate, make_test_certificates

pytestmark = pytest.mark.etcd

_USER, _PASSWORD, _ROOT_PASSWORD = "job", "s3cret-pw", "r00t-pw"


@dataclasses.dataclass(frozen=True)
class Secured:
    url: str
    ca: str
    cert: str
    key: str
    cn_cert: str
    cn_key: str
    wrong_ca: str

    def security(self, **changes: str | None) -> EtcdSecurity:
        fields: dict[str, str | None] = {
            "ca_file": self.ca,
            "cert_file": self.cert,
            "key_file": self.key,
            "user": _USER,
            "password": _PASSWORD,
        }
        fields.update(changes)
        return EtcdSecurity(**fields)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make test certificates (apt-get install openssl)")
    tmp = tmp_path_factory.mktemp("secured")
    tls = dataclasses.replace(make_test_certificates(tmp / "certs"), client_cert_auth=True)
    cert, key = make_client_certificate(tmp / "certs", tls)
    cn_cert, cn_key = make_client_certificate(tmp / "certs", tls, "withcn", cn=True)
    wrong = make_test_certificates(tmp / "other-ca")
    # Tokens expire after 1 s without use: the rendezvous below renews them again and again.
    with EtcdV3Server(tmp / "etcd", tls=tls, extra_args=["--auth-token-ttl=1"]) as server:
        admin = EtcdClient(
            server.client_url,
            timeout=timedelta(seconds=10),
            security=EtcdSecurity(ca_file=tls.ca_file, cert_file=cert, key_file=key),
        )
        enable_auth(admin, root_password=_ROOT_PASSWORD, user=_USER, password=_PASSWORD)
        admin.close()
        yield Secured(server.client_url, tls.ca_file, cert, key, cn_cert, cn_key, wrong.ca_file)


def _refusal(secured: Secured, security: EtcdSecurity) -> str:
    client = EtcdClient(secured.url, timeout=timedelta(seconds=5), security=security)
    with pytest.raises(EtcdAuthError) as caught:
        client.put("/flashckpt/probe", b"1")
    client.close()
    return str(caught.value)


def test_the_client_is_refused_without_each_credential(secured: Secured) -> None:
    # No client certificate: etcd ends the TLS handshake; reported at once, not retried.
    assert "--etcd-cert" in _refusal(secured, secured.security(cert_file=None, key_file=None))
    # etcd's certificate signed by a CA the client does not trust.
    assert "--etcd-ca" in _refusal(secured, secured.security(ca_file=secured.wrong_ca))
    # A client certificate with a CommonName: etcd refuses it on its JSON gateway.
    message = _refusal(
        secured, secured.security(cert_file=secured.cn_cert, key_file=secured.cn_key)
    )
    assert "without a CN" in message
    # No user, then a wrong password.
    assert "--etcd-user" in _refusal(secured, secured.security(user=None, password=None))
    assert "refused the user name or password" in _refusal(secured, secured.security(password="x"))
    # Plain http to the TLS port, with TLS files: refused before anything is sent.
    with pytest.raises(ValueError, match="https://"):
        EtcdClient(secured.url.replace("https", "http"), timeout=timedelta(seconds=1),
                   security=secured.security())  # fmt: skip


def test_the_user_reads_and_writes_its_prefix_only_and_renews_an_expired_token(
    secured: Secured,
) -> None:
    client = EtcdClient(secured.url, timeout=timedelta(seconds=10), security=secured.security())
    try:
        revision = client.put("/flashckpt/t/a", b"1")
        assert client.get("/flashckpt/t/a") == (b"1", revision)
        assert client.authentications == 1
        with pytest.raises(EtcdAuthError, match="grant-permission"):
            client.put("/elsewhere", b"1")
        # The watch carries the token too.
        client.put("/flashckpt/t/b", b"2")
        batch = client.watch_events(
            "/flashckpt/t/", after_revision=revision, timeout=timedelta(seconds=10), prefix=True
        )
        assert [e.kv.key for e in batch.events] == [b"/flashckpt/t/b"]
        # An operator turns auth off and on (root's token): every token issued so far is void.
        root = EtcdClient(
            secured.url,
            timeout=timedelta(seconds=10),
            security=secured.security(user="root", password=_ROOT_PASSWORD),
        )
        root._call("/v3/auth/disable", {}, timeout=None, idempotent=False)
        root._call("/v3/auth/enable", {}, timeout=None, idempotent=False)
        root.close()
        assert client.get("/flashckpt/t/a") == (b"1", revision)  # re-authenticated, retried
        assert client.authentications == 2
    finally:
        client.close()


def test_a_client_that_logged_in_while_auth_was_off_logs_in_once_it_is_on(
    secured: Secured,
) -> None:
    """An operator securing a running etcd: a client that logged in while auth was off sends
    no token (it warned); once auth is on, its next request is refused for want of a user, and
    it logs in then and goes on."""
    root = EtcdClient(
        secured.url,
        timeout=timedelta(seconds=10),
        security=secured.security(user="root", password=_ROOT_PASSWORD),
    )
    late = EtcdClient(secured.url, timeout=timedelta(seconds=10), security=secured.security())
    try:
        root._call("/v3/auth/disable", {}, timeout=None, idempotent=False)
        try:
            revision = late.put("/flashckpt/late/a", b"1")  # auth off: sent without a token
            assert late.authentications == 0
        finally:
            root._call("/v3/auth/enable", {}, timeout=None, idempotent=False)
        assert late.get("/flashckpt/late/a") == (b"1", revision)
        assert late.authentications == 1
        late.put("/flashckpt/late/b", b"2")  # with its token from now on
        assert late.authentications == 1
    finally:
        late.close()
        root.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rendezvous_and_failover_through_tls_and_auth(secured: Secured, tmp_path: Path) -> None:
    """The failover of ``test_rendezvous_multiprocess`` through the secured etcd: the nodes get
    the CA, their certificate and key, the user and the password from the environment only
    (torchrun's ``--rdzv-endpoint`` is the https URL)."""
    env = rdzv_env()
    env.update(
        {
            envnames.ETCD_CA: secured.ca,
            envnames.ETCD_CERT: secured.cert,
            envnames.ETCD_KEY: secured.key,
            envnames.ETCD_USER: _USER,
            envnames.ETCD_PASSWORD: _PASSWORD,
        }
    )
    env.pop(envnames.ETCD_PASSWORD_FILE, None)
    run_failover(secured.url.removeprefix("https://"), tmp_path, env)
    assert os.environ.get(envnames.ETCD_PASSWORD) is None  # nothing leaked into the test's env


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_flashckpt_run_and_status_take_the_etcd_flags(secured: Secured, tmp_path: Path) -> None:
    """``flashckpt run --etcd-ca/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file``: the
    job runs through the secured etcd and its keys are removed at the end (the finish path's
    client is secured too); ``flashckpt status`` reads the job with the same flags and names
    the missing flag without them. Nothing comes from the environment."""
    password = tmp_path / "etcd-password"
    password.write_text(_PASSWORD + "\n")
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('trained as rank', os.environ['RANK'])\n")
    endpoint = secured.url.removeprefix("https://")
    flags = [
        *("--etcd-ca", secured.ca, "--etcd-cert", secured.cert, "--etcd-key", secured.key),
        *("--etcd-user", _USER, "--etcd-password-file", str(password)),
    ]
    env = {k: v for k, v in rdzv_env().items() if not k.startswith("FLASHCKPT_ETCD_")}
    job = f"sec-{os.getpid()}"
    run = subprocess.run(
        [sys.executable, "-m", "flashckpt", "run", "--nnodes", "1", "--nproc-per-node", "1",
         "--rdzv-endpoint", endpoint, "--rdzv-id", job, *flags, "--run-dir",
         str(tmp_path / "run"), "--local-addr", "127.0.0.1", "--node-id", "n0", str(script)],
        env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained as rank 0" in run.stdout
    assert "removed" in run.stderr and "keys of the finished job" in run.stderr, run.stderr[-2000:]

    def status(*extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "flashckpt", "status", "--etcd", endpoint, "--job", job]
        return subprocess.run(
            [*command, *extra], env=env, capture_output=True, text=True, timeout=60
        )

    answered = status(*flags)  # etcd answered: the job is over, no machine is registered
    assert answered.returncode == 1 and "no machine registered" in answered.stdout, answered
    refused = status("--etcd-ca", secured.ca)
    assert refused.returncode == 1 and "--etcd-cert" in refused.stderr, refused

"""The ``flashckpt-etcd`` rendezvous: torchrun's parameters -> etcd client, store and handler.

``create_handler`` is what ``torchrun --rdzv-backend=flashckpt-etcd`` (through
:mod:`flashckpt.elastic.rendezvous.registry`) and ``flashckpt run`` build:
:class:`flashckpt.elastic.rendezvous.handler.RdzvHandler`,
torch's ``RendezvousHandler`` implemented on per-machine etcd keys (O(1) work and bytes per
machine; it replaced torch's ``DynamicRendezvousHandler`` on a compare-and-set blob, whose cost
grew as N^2 with the job, issue 31).

The store handed to torch (for ``MASTER_ADDR``/``MASTER_PORT`` and the agents' barriers) is an
:class:`flashckpt.elastic.etcd.store.EtcdV3Store` under ``<key_prefix>/<run_id>/store/``, one prefix
per round.

Creating the handler turns off torch's shared rendezvous TCPStore for the process
(:func:`use_fresh_worker_store`): with it, a restarted worker group can hang (see there).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousParameters

from flashckpt.elastic.etcd.client import EtcdClient, EtcdSecurity, parse_endpoints
from flashckpt.elastic.etcd.store import EtcdV3Store
from flashckpt.elastic.rendezvous.handler import RdzvHandler, settings_from_params

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "SHARE_STORE_ENV",
    "create_client",
    "create_handler",
    "job_prefix",
    "use_fresh_worker_store",
]

logger = logging.getLogger(__name__)

SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torch's switch of the TCPStore shared between its rendezvous and the workers."""

DEFAULT_KEY_PREFIX = "/flashckpt"
_DEFAULT_READ_TIMEOUT_S = 60  # torch's etcd-v2 default
_DEFAULT_STORE_TIMEOUT_S = 300  # c10d's default


def job_prefix(run_id: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The etcd prefix that holds everything of one job: ``<key_prefix>/<run_id>/``.

    Raises:
        ValueError: If ``run_id`` is empty or contains ``/``.
    """
    if not run_id:
        raise ValueError("the run id must be a non-empty string (torchrun --rdzv-id)")
    if "/" in run_id:
        raise ValueError(
            f"the run id {run_id!r} must not contain '/': it is one level of the etcd key "
            "hierarchy, and a nested id would share keys with its parent job"
        )
    return f"{key_prefix.rstrip('/')}/{run_id}/"


def create_client(params: RendezvousParameters) -> EtcdClient:
    """Builds an :class:`EtcdClient` from torchrun's rendezvous parameters.

    +--------------+----------------------------------------------------------------------+
    | Parameter    | Meaning                                                              |
    +==============+======================================================================+
    | endpoint     | ``--rdzv-endpoint``: one or more comma-separated etcd client URLs or |
    |              | ``host:port`` (default port 2379).                                   |
    | read_timeout | Deadline in seconds of each etcd call, retries included (60).        |
    | protocol     | ``http`` or ``https`` for endpoints given without a scheme (http).   |
    | ca_cert      | CA bundle that signs etcd's server certificate; endpoints without a  |
    |              | scheme are then https ($FLASHCKPT_ETCD_CA).                          |
    | ssl_cert     | Client certificate for etcd's ``--client-cert-auth``                 |
    |              | ($FLASHCKPT_ETCD_CERT).                                              |
    | ssl_cert_key | Key of ``ssl_cert`` ($FLASHCKPT_ETCD_KEY).                           |
    | user         | etcd user, for etcd's auth ($FLASHCKPT_ETCD_USER); its password in   |
    |              | $FLASHCKPT_ETCD_PASSWORD or the file ``password_file`` (never here:  |
    |              | ``ps`` shows the command line).                                      |
    +--------------+----------------------------------------------------------------------+

    Raises:
        ValueError: If a parameter is invalid; the message names it.
    """
    read_timeout = params.get_as_int("read_timeout", _DEFAULT_READ_TIMEOUT_S)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError(
            f"rendezvous option read_timeout must be a positive number of seconds, got "
            f"{params.get('read_timeout')!r}"
        )
    security = EtcdSecurity.from_options(
        ca_file=_option(params, "ca_cert"),
        cert_file=_option(params, "ssl_cert"),
        key_file=_option(params, "ssl_cert_key"),
        user=_option(params, "user"),
        password_file=_option(params, "password_file"),
        key_prefix=str(params.get("key_prefix", DEFAULT_KEY_PREFIX)),
    )
    if params.get("password"):
        raise ValueError(
            "rendezvous option password: a password on the command line is visible to every "
            "user of the machine (ps); set $FLASHCKPT_ETCD_PASSWORD or password_file=<file>"
        )
    default_protocol = "https" if security is not None and security.tls else "http"
    protocol = str(params.get("protocol", default_protocol)).strip().lower()
    if protocol not in ("http", "https"):
        raise ValueError(f"rendezvous option protocol must be http or https, got {protocol!r}")
    if not params.endpoint or not params.endpoint.strip():
        raise ValueError(
            "the flashckpt-etcd rendezvous needs an etcd endpoint: pass "
            "--rdzv-endpoint=host:2379 (several: host1:2379,host2:2379)"
        )
    endpoints = [
        e if "://" in e else f"{protocol}://{e}"
        for e in (part.strip() for part in params.endpoint.split(","))
        if e
    ]
    endpoints = parse_endpoints(endpoints)
    return EtcdClient(endpoints, timeout=timedelta(seconds=read_timeout), security=security)


def _option(params: RendezvousParameters, name: str) -> str | None:
    value = params.get(name)
    return str(value) if value else None


def use_fresh_worker_store() -> None:
    """Makes every worker group host its own TCPStore (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).

    By default (torch >= 2.4) the elastic agent of group rank 0 creates one TCPStore server the
    first time it is rank 0, and hands the same ``MASTER_ADDR:MASTER_PORT`` to the workers of
    every later round; they connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``)
    with no per-attempt key prefix (torch's ``_create_c10d_store`` assumes a new store per
    attempt). After a worker is killed, the restarted group therefore meets the previous
    attempt's keys: gloo's full-mesh setup can read the dead rank's old address before the new
    rank overwrites it and connect to its old port, which hangs until gloo's timeout (seen in 2
    of 6 ``torchrun --max-restarts`` runs). With sharing off, worker rank 0 hosts a new store on
    a port the agent picks for each round, so no key of an earlier attempt exists.

    torch reads the variable in the agent (``use_agent_store``, ``next_rendezvous``) and the
    workers inherit it, so setting it in the agent's process when our handler is created is
    enough. An explicit ``0`` is overridden with a warning: it is known to hang restarts.
    """
    if os.environ.get(SHARE_STORE_ENV, "1") != "1":
        logger.warning(
            "%s=%s overridden with 1: sharing the rendezvous TCPStore with the workers can hang "
            "a restarted worker group on stale keys of the previous attempt",
            SHARE_STORE_ENV,
            os.environ[SHARE_STORE_ENV],
        )
    os.environ[SHARE_STORE_ENV] = "1"


def create_handler(params: RendezvousParameters) -> RdzvHandler:
    """Builds the ``flashckpt-etcd`` handler (:mod:`flashckpt.elastic.rendezvous.handler`) from
    torchrun's rendezvous parameters: :func:`create_client`'s, and

    +---------------+---------------------------------------------------------------------+
    | key_prefix    | Root of flashckpt's keys in etcd (``/flashckpt``).                  |
    | store_timeout | Seconds the store's ``get``/``wait`` block for a missing key (300). |
    +---------------+---------------------------------------------------------------------+

    with the handler's own (:func:`flashckpt.elastic.rendezvous.handler.settings_from_params`:
    ``join_timeout``, ``last_call_timeout``, ``lease_ttl``, ``state_ttl``). Each worker group gets
    its own TCPStore (:func:`use_fresh_worker_store`).

    Raises:
        ValueError: If a parameter is invalid; the message names it.
    """
    client = create_client(params)
    key_prefix = str(params.get("key_prefix", DEFAULT_KEY_PREFIX))
    store_timeout_s = params.get_as_int("store_timeout", _DEFAULT_STORE_TIMEOUT_S)
    if store_timeout_s is None or store_timeout_s <= 0:
        raise ValueError(
            f"rendezvous option store_timeout must be a positive number of seconds, got "
            f"{params.get('store_timeout')!r}"
        )
    prefix = job_prefix(params.run_id, key_prefix)
    settings = settings_from_params(params, prefix)
    store = EtcdV3Store(client, prefix + "store/", timeout=timedelta(seconds=store_timeout_s))
    use_fresh_worker_store()
    return RdzvHandler(client, store, settings)

"""An etcd v3 backend for torch's dynamic rendezvous (``torch.distributed.elastic``).

torch's ``DynamicRendezvousHandler`` keeps the whole rendezvous state (participants, wait list,
heartbeats) as one opaque blob in a backend that offers compare-and-set. Its ``etcd-v2`` backend
needs etcd's v2 API, which is off by default since etcd 3.4 and removed in 3.6; this is the same
contract on v3:

- the state is stored under ``<key_prefix>/<run_id>/rdzv/state`` in a frame
  (:func:`encode_state`): a magic, a format version, the length and a CRC-32 around
  torch's bytes. A value that is not such a frame (corrupted, truncated, written by something
  else, or by another format version) raises torch's ``RendezvousStateError`` naming the key and
  the fix, before torch's handler unpickles anything;
- the fencing token is the key's ``mod_revision``; ``set_state`` is one etcd transaction that
  writes only if the revision is still the token (``None`` or ``0``: only if absent);
- on a stale token, nothing is written and the current state and token come back with
  ``False``, exactly like torch's etcd-v2 and c10d backends;
- connection failures become ``RendezvousConnectionError`` after the client's bounded retries.

The state key is attached to a lease of ``state_ttl`` (2 h, like torch's etcd-v2 TTL) that is
renewed by writing, so a finished job's state disappears on its own while live nodes, which
write a heartbeat every few seconds, keep it.

The store handed to torch (for ``MASTER_ADDR``/``MASTER_PORT`` and the agents' barriers) is an
:class:`elastic.store.EtcdStore` under ``<key_prefix>/<run_id>/store/``.

Creating the handler turns off torch's shared rendezvous TCPStore for the process
(:func:`use_fresh_worker_store`): with it, a restarted worker group can hang (see there). It also
replaces torch's numbering of the machines of each round (sorted node descriptors) with one that
keeps a surviving machine's group rank (:mod:`elastic.stable_ranks`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler as _torch_create_handler,
)

from elastic.etcd import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdOutcomeUnknown,
    KeyValue,
    Lease,
    parse_endpoints,
)
from elastic.rdzv_handler import RdzvHandler, settings_from_params
from elastic.rdzv_name import BACKEND_NAME
from elastic.stable_ranks import install_stable_ranks
from elastic.store import EtcdStore

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "SHARE_STORE_ENV",
    "EtcdRendezvousBackend",
    "create_backend",
    "create_client",
    "create_handler",
    "create_rdzv_handler",
    "decode_state",
    "encode_state",
    "use_fresh_worker_store",
]

logger = logging.getLogger(__name__)

SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torch's switch of the TCPStore shared between its rendezvous and the workers."""

DEFAULT_KEY_PREFIX = "/flashckpt"
_DEFAULT_STATE_TTL = timedelta(hours=2)
_DEFAULT_READ_TIMEOUT_S = 60  # torch's etcd-v2 default
_DEFAULT_STORE_TIMEOUT_S = 300  # c10d's default

_FRAME_MAGIC = b"FCRDZV"
_FRAME_VERSION = 1
# magic, version, payload length; then the payload; then the CRC-32 of everything before it.
_FRAME_HEAD = struct.Struct("<6sBI")
_FRAME_TAIL = struct.Struct("<I")
# etcd refuses values over 1.5 MiB by default; this bounds what a foreign value can announce.
_MAX_STATE_BYTES = 64 << 20


def encode_state(state: bytes) -> bytes:
    """Frames torch's rendezvous state for etcd: magic, version, length, bytes, CRC-32.

    Raises:
        ValueError: If the state is larger than any rendezvous state can be (64 MiB).
    """
    if len(state) > _MAX_STATE_BYTES:
        raise ValueError(f"rendezvous state of {len(state)} bytes exceeds {_MAX_STATE_BYTES}")
    head = _FRAME_HEAD.pack(_FRAME_MAGIC, _FRAME_VERSION, len(state))
    return head + state + _FRAME_TAIL.pack(zlib.crc32(state, zlib.crc32(head)))


def decode_state(value: bytes, key: str) -> bytes:
    """Checks a framed state read from etcd and returns torch's bytes in it.

    Args:
        value: The etcd value.
        key: Its key, for the error message.

    Raises:
        RendezvousStateError: If ``value`` is not a frame of this format version, or its length
            or checksum do not match: nothing of it may reach torch's unpickler.
    """
    fix = (
        f"delete it (etcdctl del {key}) once no launcher of the job runs, or use another "
        "--rdzv-id; every machine of a job must run the same flashckpt version"
    )
    head_size, tail_size = _FRAME_HEAD.size, _FRAME_TAIL.size
    if len(value) < head_size + tail_size or not value.startswith(_FRAME_MAGIC):
        raise RendezvousStateError(
            f"the rendezvous state at {key!r} ({len(value)} bytes) was not written by "
            f"flashckpt's etcd backend (no {_FRAME_MAGIC.decode()} frame): {fix}"
        )
    _, version, length = _FRAME_HEAD.unpack_from(value)
    if version != _FRAME_VERSION:
        raise RendezvousStateError(
            f"the rendezvous state at {key!r} has frame version {version}, this flashckpt "
            f"reads version {_FRAME_VERSION}: {fix}"
        )
    if length != len(value) - head_size - tail_size:
        raise RendezvousStateError(
            f"the rendezvous state at {key!r} is truncated or padded: its frame announces "
            f"{length} bytes of state, the value holds {len(value) - head_size - tail_size}: "
            f"{fix}"
        )
    state = value[head_size : head_size + length]
    (stored,) = _FRAME_TAIL.unpack_from(value, head_size + length)
    if zlib.crc32(state, zlib.crc32(value[:head_size])) != stored:
        raise RendezvousStateError(
            f"the rendezvous state at {key!r} is corrupt (its CRC-32 does not match): {fix}"
        )
    return state


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


class EtcdRendezvousBackend(RendezvousBackend):
    """Holds torch's dynamic-rendezvous state in etcd v3.

    Args:
        client: The etcd client.
        run_id: The job's rendezvous id.
        key_prefix: Root of all flashckpt keys in etcd.
        state_ttl: The state is deleted this long (at least half of it) after the last write;
            ``None`` keeps it forever.

    Raises:
        ValueError: If ``run_id`` is empty or contains ``/``, or ``state_ttl`` is under 1 s.
    """

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        state_ttl: timedelta | None = _DEFAULT_STATE_TTL,
    ) -> None:
        if state_ttl is not None and state_ttl < timedelta(seconds=1):
            raise ValueError(f"state_ttl must be at least 1 second or None, got {state_ttl!r}")
        self._client = client
        self._job_prefix = job_prefix(run_id, key_prefix)
        self._key = self._job_prefix + "rdzv/state"
        self._state_ttl = state_ttl
        self._lease_lock = threading.Lock()
        self._lease: Lease | None = None
        self._lease_granted_at = 0.0
        self._local = threading.local()

    @property
    def name(self) -> str:
        """See base class."""
        return BACKEND_NAME

    @property
    def key(self) -> str:
        """The etcd key that holds the state."""
        return self._key

    @property
    def client(self) -> EtcdClient:
        """The etcd client."""
        return self._client

    @property
    def job_prefix(self) -> str:
        """The etcd prefix of everything of the job (:func:`job_prefix`)."""
        return self._job_prefix

    @contextlib.contextmanager
    def call_timeout(self, timeout: timedelta) -> Iterator[None]:
        """Caps the deadline of this thread's etcd calls (retries included) inside the block.

        Used where waiting the client's full ``read_timeout`` helps nobody: the launcher's
        shutdown, and its poll for waiting machines while workers train.
        """
        previous = getattr(self._local, "timeout", None)
        self._local.timeout = timeout if previous is None else min(previous, timeout)
        try:
            yield
        finally:
            self._local.timeout = previous

    def _timeout(self) -> timedelta | None:
        return getattr(self._local, "timeout", None)

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class.

        Raises:
            RendezvousConnectionError: etcd could not be read.
            RendezvousStateError: The stored value is not a frame this backend wrote.
        """
        try:
            found = self._client.get(self._key, timeout=self._timeout())
        except EtcdError as exc:
            raise self._connection_error("read", exc) from exc
        if found is None:
            return None
        return decode_state(found[0], self._key), found[1]

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class.

        The write is one etcd transaction comparing the key's ``mod_revision`` with ``token``.
        """
        if token is None or token == 0:
            revision = 0
        elif type(token) is int and token > 0:
            revision = token
        else:
            # Not a token this backend ever issued: it cannot match, so report the current state.
            return self._current_state_as_stale()
        try:
            succeeded, current = self._compare_and_set(state, revision)
        except EtcdOutcomeUnknown:
            # Our write may or may not have landed. Re-reading tells the caller what is stored;
            # reporting it as not-ours is safe: torch then re-evaluates from that state.
            return self._current_state_as_stale()
        except EtcdError as exc:
            raise self._connection_error("write", exc) from exc
        if current is None:
            return None
        if succeeded:
            return state, current.mod_revision, True
        return decode_state(current.value, self._key), current.mod_revision, False

    def _compare_and_set(self, state: bytes, revision: int) -> tuple[bool, KeyValue | None]:
        framed = encode_state(state)
        timeout = self._timeout()
        lease = self._lease_for_write()
        try:
            return self._client.compare_and_set(
                self._key, framed, mod_revision=revision, lease=lease, timeout=timeout
            )
        except EtcdLeaseNotFound:
            # The lease ended early (revoked by an operator, or this process slept past it).
            lease = self._lease_for_write(renew=True)
            return self._client.compare_and_set(
                self._key, framed, mod_revision=revision, lease=lease, timeout=timeout
            )

    def _lease_for_write(self, *, renew: bool = False) -> Lease | None:
        if self._state_ttl is None:
            return None
        with self._lease_lock:
            age = time.monotonic() - self._lease_granted_at
            if renew or self._lease is None or age > self._state_ttl.total_seconds() / 2:
                self._lease = self._client.grant_lease(self._state_ttl, timeout=self._timeout())
                self._lease_granted_at = time.monotonic()
            return self._lease

    def _current_state_as_stale(self) -> tuple[bytes, Token, bool] | None:
        current = self.get_state()
        return None if current is None else (current[0], current[1], False)

    def _connection_error(self, action: str, exc: EtcdError) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            f"could not {action} the rendezvous state {self._key!r} in etcd at "
            f"{','.join(self._client.endpoints)}: {exc}"
        )


def create_client(params: RendezvousParameters) -> EtcdClient:
    """Builds an :class:`EtcdClient` from torchrun's rendezvous parameters.

    +--------------+----------------------------------------------------------------------+
    | Parameter    | Meaning                                                              |
    +==============+======================================================================+
    | endpoint     | ``--rdzv-endpoint``: one or more comma-separated etcd client URLs or |
    |              | ``host:port`` (default port 2379).                                   |
    | read_timeout | Deadline in seconds of each etcd call, retries included (60).        |
    | protocol     | ``http`` or ``https`` for endpoints given without a scheme (http).   |
    | ca_cert      | CA bundle that signs etcd's server certificate (https).              |
    | ssl_cert     | Client certificate for etcd's client-cert auth (https).              |
    | ssl_cert_key | Key of ``ssl_cert``.                                                 |
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
    protocol = str(params.get("protocol", "http")).strip().lower()
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
    ssl_context: ssl.SSLContext | None = None
    if any(e.startswith("https://") for e in endpoints):
        ssl_context = ssl.create_default_context(cafile=params.get("ca_cert"))
        cert = params.get("ssl_cert")
        if cert:
            ssl_context.load_cert_chain(cert, params.get("ssl_cert_key"))
    return EtcdClient(endpoints, timeout=timedelta(seconds=read_timeout), ssl_context=ssl_context)


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """Builds the backend and store from torchrun's rendezvous parameters.

    Besides :func:`create_client`'s parameters:

    +---------------+---------------------------------------------------------------------+
    | key_prefix    | Root of flashckpt's keys in etcd (``/flashckpt``).                  |
    | state_ttl     | Seconds after the last write until the state expires; 0: never      |
    |               | (7200).                                                             |
    | store_timeout | Seconds the store's ``get``/``wait`` block for a missing key (300). |
    +---------------+---------------------------------------------------------------------+

    Raises:
        ValueError: If a parameter is invalid; the message names it.
    """
    client = create_client(params)
    key_prefix = str(params.get("key_prefix", DEFAULT_KEY_PREFIX))
    state_ttl_s = params.get_as_int("state_ttl", int(_DEFAULT_STATE_TTL.total_seconds()))
    if state_ttl_s is None or state_ttl_s < 0:
        raise ValueError(
            f"rendezvous option state_ttl must be >= 0 seconds (0: never expire), got "
            f"{params.get('state_ttl')!r}"
        )
    store_timeout_s = params.get_as_int("store_timeout", _DEFAULT_STORE_TIMEOUT_S)
    if store_timeout_s is None or store_timeout_s <= 0:
        raise ValueError(
            f"rendezvous option store_timeout must be a positive number of seconds, got "
            f"{params.get('store_timeout')!r}"
        )
    backend = EtcdRendezvousBackend(
        client,
        params.run_id,
        key_prefix=key_prefix,
        state_ttl=timedelta(seconds=state_ttl_s) if state_ttl_s else None,
    )
    store = EtcdStore(
        client,
        job_prefix(params.run_id, key_prefix) + "store/",
        timeout=timedelta(seconds=store_timeout_s),
    )
    return backend, store


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


def create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """Builds torch's ``DynamicRendezvousHandler`` on our etcd v3 backend.

    This is what ``--rdzv-backend=flashckpt-etcd`` runs. torch's own options (``join_timeout``,
    ``last_call_timeout``, ``close_timeout``, ``heartbeat_timeout``, ``keep_alive_interval``,
    ``keep_alive_max_attempt``) are passed through; see :func:`create_backend` for ours. Each
    worker group gets its own TCPStore (:func:`use_fresh_worker_store`), and a machine that
    stays keeps its group rank in the next round (:mod:`elastic.stable_ranks`).

    Raises:
        ValueError: If a parameter is invalid.
        RendezvousConnectionError: If etcd cannot be reached when the handler needs it.
        RendezvousError: If this torch's handler lacks the internals stable ranks need.
    """
    backend, store = create_backend(params)
    use_fresh_worker_store()
    handler = _torch_create_handler(store, backend, params)
    install_stable_ranks(handler, backend)
    return handler


def create_rdzv_handler(params: RendezvousParameters) -> RdzvHandler:
    """Builds the O(1)-per-machine handler (:mod:`elastic.rdzv_handler`) from torchrun's
    rendezvous parameters: :func:`create_client`'s, ``key_prefix``, ``store_timeout`` and
    :func:`elastic.rdzv_handler.settings_from_params`'s.

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
    store = EtcdStore(client, prefix + "store/", timeout=timedelta(seconds=store_timeout_s))
    use_fresh_worker_store()
    return RdzvHandler(client, store, settings)

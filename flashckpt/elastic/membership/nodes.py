"""Machine liveness for elastic jobs: lease-bound node keys in etcd, and fast death detection.

Every launcher of a job registers itself under ``<key_prefix>/<run_id>/nodes/<node_id>`` with a
key bound to an etcd lease that it renews every ``ttl / 5``. When a machine dies, nobody renews
its lease, etcd deletes its key after at most ``ttl``, and the watches of its ring neighbours
(:data:`_WINDOW` on each side in the ring of node ids: each machine watches those keys only, so
a change costs O(1) per machine whatever the job's size) see the deletion at once; its join keys
of the rendezvous, on the same lease, go with it, which is how every other machine learns it
(:mod:`flashckpt.elastic.rendezvous.handler`). That is the authority on liveness, and it works
whatever killed the machine (power, kernel panic, network partition). A launcher starts its
watch (and its links, below) once it has its rank, or at once when it joins a job that already
runs (:meth:`NodeRegistry.watch_peers`): nothing on the way to the first round needs them, and
a machine that knows no peer yet, with no workers, has nothing to fence.

It is also slow compared with what a survivor already knows: when a peer's *processes* die and
its host stays up (OOM kill, segfault, ``kill -9``, a crashed launcher), the survivor's
collectives fail within milliseconds. So each launcher also listens on a small TCP *probe* port
(advertised in its key) that answers with the launcher's instance token. When a launcher's
workers fail, it probes its peers: a peer whose host refuses the connection, or answers with
another token (the port was reused), is certainly dead, and its lease is revoked at once, which
deletes its key just as the lease's expiry would. A probe that merely times out proves nothing
(a slow network, a busy host), so it is left to the lease. Healthy machines are therefore never
declared dead by a probe, only by their lease.

What the job does with a death is up to the ``on_lost`` callback (the launcher revokes the dead
machine's rendezvous lease, so its join key goes and the next round forms without it at once,
see :mod:`flashckpt.elastic.rendezvous.handler`).

*Fencing* is the other side of the lease: a machine that is cut off (a network partition) is
alive, its workers may still write, while the others, once its lease lapses, form a new world
without it. So the renew loop records when the last successful renewal was *sent* (etcd counts
the TTL from when it received it, later); at :func:`fence_deadline` (``ttl - ttl/5`` after it)
without a renewal, and with no peer answering its probe port either (cut off from the others
too, not only from etcd: an etcd outage that every machine sees lapses no lease and lets no
new world form), or with peers that answer and say they renewed their own leases since (cut
off from etcd alone: the others will form a new world without it; :func:`peer_etcd_age`),
the machine is fenced: ``on_fenced`` stops its workers and its node agent's
commits before :func:`lease_expiry`, the earliest moment the others can act. The renewals stop;
the stale lease and token are never used again: once etcd answers, :meth:`NodeRegistry.rejoin`
registers the machine afresh (new lease, new token, next generation), as a standby.
"""

from __future__ import annotations

import base64
import contextlib
import enum
import heapq
import itertools
import json
import logging
import os
import random
import selectors
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdOutcomeUnknown,
    KeyValue,
    Lease,
    WatchClosed,
    WatchCompacted,
    WatchEvent,
    WatchStream,
    prefix_end,
)
from flashckpt.elastic.membership.peerlinks import (
    HOLD_ANSWER,
    HOLD_QUESTION,
    LinkTarget,
    PeerLinks,
    connect_probe_port,
    read_line,
    ring_successors,
)
from flashckpt.errors import FlashckptError

__all__ = [
    "FenceNotice",
    "NodeIdInUse",
    "NodeRecord",
    "NodeRegistry",
    "ProbeResult",
    "fence_deadline",
    "lease_expiry",
    "nodes_prefix",
    "peer_etcd_age",
    "probe",
]

logger = logging.getLogger(__name__)

_RENEW_RETRY_FIRST = 0.1
"""A failed renewal is retried after this share of the renewal interval, doubling with each
failure in a row (with jitter), up to :data:`_RENEW_RETRY_SHARE` of the time the lease has left
and at most one interval: N machines on a slow or failing etcd do not multiply its load by
retrying every tenth of an interval (issue 31: 13,000 failed renewals logged by one host)."""
_RENEW_RETRY_SHARE = 0.25
_PROBE_TIMEOUT_S = 0.5
_PROBE_ATTEMPTS = 3
_PROBE_RETRY_S = 0.1
_WATCH_SLICE = timedelta(seconds=5)
_WINDOW = 4
"""Peers a machine watches on each side of it in the ring of node ids (at least ``links + 1``):
its node-key watch covers those keys only, so a change costs O(1) watch messages per machine
whatever the job's size, and every machine is watched by this many on each side. The outage
probes ask the watched peers (:data:`_OUTAGE_SAMPLE`, ring successors first)."""
_SPAN_LIMITS = (16, 128)
"""Keys read at most of the spans from this node id cut short by one and by two characters up
to this key, in the registration's read of its window (:meth:`NodeRegistry._registration_ranges`):
about 10 and 100 keys for decimal ids."""
_SEGMENT_SLICE = timedelta(seconds=0.05)
"""How long the watch waits on each of its two streams in turn when its window wraps around the
end of the ring (the first and last few machines of the job only)."""
_QUIET_CHECK_S = 60.0
"""A node-key watch quiet this long moves its revision on (:meth:`NodeRegistry._quiet_revision`)."""
# Probing the peers while renewals fail: one try each (a cut-off host fails at once with "network
# unreachable", a silent drop times out). In the background after each failed renewal, with a
# loaded host's patience; at the fence deadline, when none answered lately, once more, short.
_OUTAGE_PROBE_TIMEOUT_S = 1.0
_FENCE_PROBE_TIMEOUT_S = 0.25
_OUTAGE_SAMPLE = 8
"""Peers probed at most per round of outage probes (whether this machine is cut off)."""


def fence_deadline(last_ok: float, ttl_s: float) -> float:
    """When a machine whose last successful lease renewal was sent at ``last_ok`` (monotonic
    seconds) is fenced if no renewal succeeded since: ``ttl - ttl/5`` after it. The lease
    lapses on etcd ``ttl`` after etcd *received* that renewal, so no other machine can act on
    its loss before :func:`lease_expiry`: ``ttl/5`` is left to stop the workers."""
    return last_ok + ttl_s - ttl_s / 5


def _renew_retry_delay(failures: int, interval: float, left: float) -> float:
    """Seconds before retrying after ``failures`` failed renewals in a row, with the lease
    ``left`` seconds before it may lapse: ``interval / 10`` doubled per failure, capped at a
    quarter of ``left`` and at one interval (never below ``interval / 10``; one interval once the
    lease may have lapsed: etcd's answer then only says so), jittered down by up to half so
    machines that failed together do not retry together."""
    first = interval * _RENEW_RETRY_FIRST
    cap = interval if left <= 0 else max(first, min(interval, left * _RENEW_RETRY_SHARE))
    return min(first * 2 ** min(failures - 1, 30), cap) * random.uniform(0.5, 1.0)


def lease_expiry(last_ok: float, ttl_s: float) -> float:
    """The earliest moment etcd may drop a lease last renewed by a request sent at ``last_ok``
    (monotonic seconds): the others may form a new world from then on."""
    return last_ok + ttl_s


@dataclass(frozen=True, slots=True)
class FenceNotice:
    """What :class:`NodeRegistry` tells ``on_fenced``."""

    reason: str
    """Why, for the log."""
    last_ok: float
    """Monotonic time the last successful renewal was sent."""
    expiry: float
    """Monotonic time from which etcd may have dropped the lease (:func:`lease_expiry`): the
    workers must be gone by then."""
    generation: int
    """The registration that is fenced (1 for the first)."""


def nodes_prefix(job_prefix: str) -> str:
    """The etcd prefix of a job's node keys, given the job's prefix (ending in ``/``)."""
    return job_prefix + "nodes/"


class NodeIdInUse(FlashckptError, RuntimeError):
    """Another live launcher of this job already registered the same node id."""


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a launcher publishes about itself under its node key."""

    node_id: str
    """The launcher's ``--node-id``."""
    host: str
    """The host name of its machine."""
    pid: int
    """The launcher's process id."""
    token: str
    """A random id of this launcher instance (answered by its probe port)."""
    probe: str
    """``host:port`` of its probe listener; empty if it has none."""
    state: str = "starting"
    """``starting``, ``waiting`` (in the rendezvous, standby included), ``active`` or
    ``leaving``."""
    rdzv_node: str | None = None
    """torch's rendezvous node descriptor of this launcher (``addr_pid_localid``)."""
    group_rank: int | None = None
    """Its rank among the machines of the current round, when active."""
    lease: int = 0
    """The etcd lease the key is bound to (filled in when read)."""
    replica: str = ""
    """``host:port`` of its node agent's replica server (other machines send it replicas of
    their snapshots there); empty if it holds none."""
    done: bool = False
    """Set as it leaves (``leaving``): its workers finished the job. A machine that left done
    broke nothing for workers still running elsewhere; one that left otherwise (signalled,
    preempted, retired for a standby, failed) took its workers out of their round."""
    rdzv_member: int | None = None
    """While ``active``: its id among the members of its rendezvous round (its join key's
    ``create_revision``, :attr:`RdzvHandler.member_id
    <flashckpt.elastic.rendezvous.handler.RdzvHandler.member_id>`): whether a peer that went
    was in this machine's round is read from its last record, not from the round's join keys."""

    @property
    def left_done(self) -> bool:
        """It left with its workers done: nothing of its round was broken by its leaving."""
        return self.state == "leaving" and self.done

    def to_json(self) -> bytes:
        """The key's value."""
        data = asdict(self)
        data.pop("lease")
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_kv(cls, kv: KeyValue) -> NodeRecord | None:
        """Parses a node key; ``None`` if it is not one of ours."""
        try:
            data = json.loads(kv.value)
            fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data and k != "lease"}
            # Only a true JSON boolean says done: anything else is the safer "not done".
            fields["done"] = fields.get("done") is True
            if type(fields.get("rdzv_member")) is not int:
                fields["rdzv_member"] = None
            return cls(**fields, lease=kv.lease)
        except (ValueError, TypeError, KeyError):
            return None


class ProbeResult(enum.Enum):
    """What a probe of a peer's launcher says."""

    ALIVE = "alive"
    """It answered with its token."""
    DEAD = "dead"
    """Its host refused the connection, or another process answered: the launcher is gone."""
    UNKNOWN = "unknown"
    """No answer in time: only the lease can tell."""


def probe(record: NodeRecord, timeout: float = _PROBE_TIMEOUT_S) -> ProbeResult:
    """Checks whether a peer's launcher is still running.

    Args:
        record: The peer's node record.
        timeout: Seconds to wait for the connection and the answer.

    Returns:
        :attr:`ProbeResult.DEAD` only when the peer is certainly gone.
    """
    if not record.probe:
        return ProbeResult.UNKNOWN
    try:
        with connect_probe_port(record.probe, timeout) as sock:
            answer = b""
            while not answer.endswith(b"\n") and len(answer) < 256:
                chunk = sock.recv(256)
                if not chunk:
                    break
                answer += chunk
    except ConnectionRefusedError:
        return ProbeResult.DEAD
    except (OSError, ValueError):
        return ProbeResult.UNKNOWN
    if not answer:
        return ProbeResult.UNKNOWN
    return (
        ProbeResult.ALIVE
        if answer.strip().decode(errors="replace") == record.token
        else (ProbeResult.DEAD)
    )


def _probe_patiently(record: NodeRecord) -> ProbeResult:
    """Probes up to three times while the answer is inconclusive.

    A launcher killed an instant ago may still be exiting: its listening socket accepts the
    connection but nobody answers. A moment later the port refuses.
    """
    result = ProbeResult.UNKNOWN
    for attempt in range(_PROBE_ATTEMPTS):
        if attempt:
            time.sleep(_PROBE_RETRY_S)
        result = probe(record)
        logger.debug("probe of node %s at %s: %s", record.node_id, record.probe, result.value)
        if result is not ProbeResult.UNKNOWN:
            break
    return result


_ETCD_QUESTION = b"etcd?\n"
"""What a prober sends after the token line to ask when the peer last renewed its lease."""
_ETCD_ANSWER_MAX = 64
"""Bytes of the answer to the etcd question a prober reads at most (it is one short line)."""
_MAX_HELD = 256
"""Links a probe port holds at most (a job's ring needs a few; more is somebody's mistake)."""
_QUESTION_WAIT_S = 1.0
"""How long a probe port waits for what a connection asks after the token (a plain probe
asks nothing and closes)."""


def peer_etcd_age(record: NodeRecord, timeout: float) -> float | None:
    """How many seconds ago a live peer's launcher last renewed its etcd lease (sent), as it
    answers on its probe port; None if it does not answer with its token, has no lease (it is
    fenced), or answers something else.

    Used when this machine's renewals fail while the peer answers: a peer that still reaches
    etcd says this machine alone is cut off from etcd (its lease will lapse and the others will
    form a new world without it), not an etcd outage that every machine sees.
    """
    if not record.probe:
        return None
    try:
        with connect_probe_port(record.probe, timeout) as sock:
            token = read_line(sock, 256).strip().decode(errors="replace")
            if token != record.token:
                return None
            sock.sendall(_ETCD_QUESTION)
            answer = read_line(sock, _ETCD_ANSWER_MAX).decode(errors="replace").split()
    except (OSError, ValueError):
        return None
    if len(answer) != 2 or answer[0] != "etcd":
        return None
    try:
        age = float(answer[1])
    except ValueError:
        return None  # "none": no lease
    return age if 0.0 <= age < 1e9 else None


class _ProbeServer:
    """Answers every connection with the launcher's token, from a daemon thread; a prober that
    then asks (:data:`_ETCD_QUESTION`) gets how long ago this launcher last renewed its lease
    (``etcd_age``; ``none`` while it holds no lease); a linker that asks
    (:data:`~flashckpt.elastic.membership.peerlinks.HOLD_QUESTION`) gets ``held`` and the connection
    stays open, silent, until this launcher exits (:mod:`flashckpt.elastic.membership.peerlinks`):
    its closing is what tells the
    linker that this launcher is gone. At most :data:`_MAX_HELD` links are held.

    No connection holds up another: the token is sent as the connection is accepted, and the
    question is read when it comes (within :data:`_QUESTION_WAIT_S`; a plain probe closes at
    once). A server that waited for each connection's question in turn would keep every
    probe behind a slow linker waiting, on a loaded host long enough for the probe to time
    out and learn nothing."""

    def __init__(
        self, token: str, bind_host: str, etcd_age: Callable[[], float | None] | None = None
    ) -> None:
        self.token = token
        self._etcd_age = etcd_age
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._sock = socket.create_server((bind_host, 0), family=family, backlog=128)
        self._sock.setblocking(False)
        self.port = int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._held: set[socket.socket] = set()
        # Connections that got the token and may ask a question: when they are given up.
        self._asking: dict[socket.socket, float] = {}
        self._thread = threading.Thread(target=self._serve, name="flashckpt-probe", daemon=True)
        self._thread.start()

    @property
    def held(self) -> int:
        """How many links are held now."""
        return len(self._held)

    def _serve(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for conn in [c for c, until in self._asking.items() if until <= now]:
                self._drop(conn)  # no question in time: a probe that went, or a stuck peer
            # Asleep until a connection comes or one asking runs out of time (close wakes it):
            # no timer per machine (1,024 wakes a second on a host of 1,024 simulated ones).
            wait = min((until - now for until in self._asking.values()), default=None)
            try:
                events = self._selector.select(None if wait is None else max(0.0, wait))
            except OSError:
                return
            for key, _ in events:
                sock = key.fileobj
                if sock is self._wake_r:
                    continue
                assert isinstance(sock, socket.socket)
                if sock is self._sock:
                    self._accept()
                elif sock in self._asking:
                    self._question(sock)
                else:
                    self._held_readable(sock)

    def _accept(self) -> None:
        for _ in range(64):  # what is waiting now; the rest at the next turn
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._stop.set()
                return
            try:
                conn.setblocking(False)
                line = self.token.encode() + b"\n"
                if conn.send(line) != len(line):  # a fresh connection's buffer takes it
                    raise OSError("the token did not fit in the socket's buffer")
                self._selector.register(conn, selectors.EVENT_READ)
            except (OSError, ValueError):
                with contextlib.suppress(OSError):
                    conn.close()
                continue
            self._asking[conn] = time.monotonic() + _QUESTION_WAIT_S

    def _question(self, conn: socket.socket) -> None:
        """What a connection that got the token says next: nothing (a plain probe closed), the
        etcd question, or a request to hold the link."""
        del self._asking[conn]
        try:
            question = conn.recv(len(_ETCD_QUESTION))
        except BlockingIOError:
            self._asking[conn] = time.monotonic() + _QUESTION_WAIT_S
            return
        except OSError:
            question = b""
        try:
            if question == _ETCD_QUESTION:
                age = self._etcd_age() if self._etcd_age is not None else None
                conn.send(b"etcd none\n" if age is None else f"etcd {age:.3f}\n".encode())
            elif question == HOLD_QUESTION and len(self._held) < _MAX_HELD:
                conn.send(HOLD_ANSWER)
                self._held.add(conn)
                return
        except OSError:
            pass
        self._drop(conn)

    def _held_readable(self, conn: socket.socket) -> None:
        """A held link's holder closed it (or sent something it should not): let it go."""
        try:
            if conn.recv(64):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._held.discard(conn)
        self._asking.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        with contextlib.suppress(OSError):
            conn.close()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=2)
        # The held links close here, after the lease was revoked (NodeRegistry.close): a
        # linker that sees them close finds the key gone and declares nothing.
        for sock in (self._sock, *self._held, *self._asking, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        self._held.clear()
        self._asking.clear()
        with contextlib.suppress(OSError):
            self._selector.close()


class _Later:
    """Runs the deferred record writes (:meth:`NodeRegistry.update`'s ``publish_after``) of
    every registry in the process, each when it is due, on one thread started at the first
    deferral (a launcher has one registry; the benchmark's hosts hold hundreds: one thread, not
    one per machine per restart)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        """Calls ``fn()`` on this thread at ``when`` (``time.monotonic()``) or soon after."""
        with self._cond:
            heapq.heappush(self._due, (when, next(self._seq), fn))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="flashckpt-node-later", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._due and self._due[0][0] <= now:
                        _, _, fn = heapq.heappop(self._due)
                        break
                    self._cond.wait(self._due[0][0] - now if self._due else None)
            try:
                fn()
            except Exception:
                logger.exception("a deferred write of this node's record failed")


_LATER = _Later()


class NodeRegistry:
    """This launcher's node key, its lease, its probe port, and a watch on its peers' keys.

    Args:
        client: The etcd client.
        job_prefix: The job's key prefix (``<key_prefix>/<run_id>/``).
        node_id: This machine's node id, unique in the job.
        ttl: Lease TTL: a machine that stops renewing is dropped this long after its last
            renewal. Renewals happen every ``ttl / 5``, so four in a row may fail (an etcd
            restart, a busy host) before a healthy machine is declared dead.
        advertise_host: Address peers use to reach the probe port (default: the host name).
        bind_host: Address the probe port listens on (default: every interface).
        on_lost: Called with the record of every peer whose key disappeared (its lease lapsed
            or was revoked) and how that was learnt: ``"link"`` (its held link broke and a probe
            found it dead), ``"probe"`` (:meth:`reap_dead_peers` found it dead) or ``"watch"``
            (the key went: its lease lapsed, another machine found it dead, or it left).
            Called once per peer instance, from the thread that learnt it. Exceptions are
            logged.
        on_fenced: Called once from the renew thread when this machine is fenced (see the
            module docstring): it must stop everything that writes for the job before
            :attr:`FenceNotice.expiry`. ``None``: never fenced (a lapsed lease is registered
            again under the same token, as for a private etcd nobody else uses).
        links: How many peers to hold a link to (:mod:`flashckpt.elastic.membership.peerlinks`: the
        next ones in
            the ring of node ids), so that a peer launcher's death is seen when its sockets
            close, whatever the workers do; 0: none (deaths are learnt from failed workers'
            probes and from lapsed leases only).
        compact_every: The machine with the lowest node id of the job compacts etcd's history
            to the revision it saw this long before, every this long (the job's writes leave
            history that etcd keeps until compacted; a server's own auto-compaction makes
            this a no-op); None: never.
    """

    def __init__(
        self,
        client: EtcdClient,
        job_prefix: str,
        node_id: str,
        *,
        ttl: timedelta = timedelta(seconds=5),
        advertise_host: str | None = None,
        bind_host: str = "",
        on_lost: Callable[[NodeRecord, str], None] | None = None,
        on_fenced: Callable[[FenceNotice], None] | None = None,
        links: int = 2,
        compact_every: timedelta | None = timedelta(minutes=5),
    ) -> None:
        if ttl < timedelta(seconds=2):
            raise ValueError(
                f"the node lease TTL must be at least 2 s (etcd's granularity is 1 s and a "
                f"renewal must fit in it), got {ttl.total_seconds():g} s"
            )
        self._client = client
        self._prefix = nodes_prefix(job_prefix)
        self._key = self._prefix + node_id
        self._ttl = ttl
        self._on_lost = on_lost
        self._on_fenced = on_fenced
        # Monotonic send time of the last successful renewal (or registration).
        self._last_ok = time.monotonic()
        self._fenced = False
        self._stale_lease: Lease | None = None  # the lease of a fenced registration
        self._warned_cut_off = False
        # Monotonic time peers last answered their probe while renewals failed, and which.
        self._peer_answered_at = float("-inf")
        self._peers_answering: dict[str, float | None] = {}
        self._probe_wake = threading.Event()
        self._prober: threading.Thread | None = None
        self._generation = 1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._peers: dict[str, NodeRecord] = {}  # the window's peers (see _read_window)
        self._view_loaded = False  # the watch read the node keys at least once
        self._view_revision = 0  # the view holds every change of the node keys up to it
        # The window's keys as the registration read them, and the read's revision: where the
        # watch thread starts (taken once, see _first_window).
        self._registered_window: tuple[list[dict[str, Any]], int] | None = None
        self._window_k = max(_WINDOW, links + 1)
        # The watched window: every node key (a job of at most 2k + 1 machines: _whole), or the
        # ring from the k-th predecessor (_lo) to the k-th successor (_hi) of this machine.
        self._whole = True
        self._lo = self._hi = ""
        self.watch_reads = 0
        """How often the watch read its window's keys (its start, a neighbour gone, each
        compaction)."""
        self.watch_events = 0
        """Changes of node keys the watch received (its own key's included)."""
        self.window_requests = 0
        """Requests the watch sent to read its window (registration's read excluded)."""
        self.window_moves = 0
        """How often the watched window narrowed to nearer neighbours without a read."""
        self.view_answers = 0
        """How often :meth:`records` was answered from the watch's view."""
        self.watch_slices = 0
        """How often the watch returned (with events, quiet, or compacted)."""
        self.quiet_moves = 0
        """How often the quiet watch moved its revision on (:meth:`_quiet_revision`)."""
        self._seen_lost: set[str] = set()
        self._reaping: set[str] = set()  # tokens of peers found dead here, being revoked
        self._lease: Lease | None = None
        # start(with_join=True): the node key is not created yet (the rendezvous' first join
        # creates it, fold_registration); the registration's timeout. None: created.
        self._unregistered: timedelta | None = None
        self._fold_value = b""  # the record the last fold_registration created the key with
        # (lease id, value) of the node key as this launcher last wrote it, for update() to
        # skip a write that changes nothing; None when unknown.
        self._written: tuple[int, bytes] | None = None
        self._update_seq = 0  # update() writes started
        self._changes = 0  # update() calls (a deferred write is made only if it was the last)
        self._updates_in_flight = 0
        self._lease_listeners: list[Callable[[Lease], None]] = []
        self._renew_wake = threading.Event()  # renew now (a user of the lease saw it gone)
        self._streams: list[WatchStream] = []  # the node keys' watch (two: a wrapped window)
        self._watching = False  # the watch (and links, compaction) started: watch_peers
        self._threads: list[threading.Thread] = []
        self._probe_server: _ProbeServer | None = None
        self._bind_host = bind_host
        self._record = NodeRecord(
            node_id=node_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            token=uuid.uuid4().hex,
            probe="",
        )
        self._advertise_host = advertise_host or socket.getfqdn()
        if links < 0:
            raise ValueError(f"links must be 0 (none) or more, got {links}")
        self._fanout = links
        self._links: PeerLinks | None = None
        if compact_every is not None and compact_every <= timedelta(0):
            raise ValueError(f"compact_every must be positive or None, got {compact_every!r}")
        self._compact_every = compact_every
        self.compactions = 0
        """How often this launcher compacted etcd's history."""
        self.peers_probed = 0
        """Peers :meth:`reap_dead_peers` probed (each probe up to :data:`_PROBE_ATTEMPTS` tries)."""
        self.links_trusted = 0
        """Peers :meth:`reap_dead_peers` did not probe: their link was held and intact."""
        self.failed_renewals = 0
        """How often a lease renewal failed (etcd did not answer in time, or with an error)."""

    @property
    def key(self) -> str:
        """This node's key."""
        return self._key

    @property
    def record(self) -> NodeRecord:
        """What this launcher currently publishes."""
        with self._lock:
            return self._record

    @property
    def ttl(self) -> timedelta:
        """The lease TTL."""
        return self._ttl

    @property
    def fenced(self) -> bool:
        """Whether this registration was fenced (and not registered again yet)."""
        with self._lock:
            return self._fenced

    @property
    def generation(self) -> int:
        """The registration: 1, then one more at each :meth:`rejoin`."""
        with self._lock:
            return self._generation

    def start(
        self,
        timeout: timedelta,
        *,
        watch: bool = True,
        watch_if: str | None = None,
        with_join: bool = False,
        **fields: Any,
    ) -> None:
        """Opens the probe port, registers the node key and starts renewing (and watching).

        A key left by a dead launcher with the same node id (a machine restarted quickly) is
        taken over once its owner is found dead, or once its lease lapses.

        Args:
            timeout: Deadline for the registration, etcd retries included.
            watch: Start the peers' watch (and the links, the compaction) now; ``False``: only
                once :meth:`watch_peers` is called. A launcher calls it once it has its rank:
                nothing on the way to a first round needs the peers (the rendezvous keys are on
                the lease), and at 1,024 machines the watches of machines still registering
                (each neighbour's registration an event, each nearer one a new stream) were
                most of what the liveness layer added to round 1 (issue 31).
            watch_if: With ``watch=False``: a key whose existence, read in the registration's
                own transaction, starts the watch at once (the rendezvous' round key: the job
                is running, and a machine joining it as a standby follows its peers while it
                waits, as before).
            with_join: The node key is created by the rendezvous' first join, in the join's
                own transaction (:meth:`fold_registration`; the handler shares this registry's
                lease: :meth:`RdzvHandler.share_lease
                <flashckpt.elastic.rendezvous.handler.RdzvHandler.share_lease>` returned True):
                here only the lease is granted and renewed, and the key does not exist until
                that join. One transaction per machine on the way to its first round, not two
                (issue 31: at 1,024 machines the registration's transaction was about 8% of
                round 1's CPU). Every outcome of the registration stays as it was: a node id
                held by a live launcher raises :class:`NodeIdInUse` (from that join), a dead
                launcher's key is taken over, a lost answer is read, never resent. Not with
                ``watch`` or ``watch_if``: a machine that finds the job running starts its
                watch when it waits in a later round (the handler's ``on_waiting``). The
                launcher reads its node key and the round key first (with its health-check
                key, one request) and registers without ``with_join`` when either exists: a
                held id is refused before anything starts, and a machine joining a running job
                follows its peers from its registration on.
            **fields: Fields of the record to publish with the registration itself (a
                launcher's ``rdzv_node`` and ``state="waiting"``): the key's creation carries
                them, instead of an :meth:`update` right after it (one more put per machine,
                seen by every neighbour watching it).

        Raises:
            NodeIdInUse: If a live launcher already holds this node id.
            EtcdUnavailable: If etcd cannot be reached in time.
        """
        self._probe_server = _ProbeServer(self._record.token, self._bind_host, self._etcd_age)
        host = self._advertise_host
        host = f"[{host}]" if ":" in host else host
        with self._lock:
            self._record = replace(
                self._record, **fields, probe=f"{host}:{self._probe_server.port}"
            )
        if with_join:
            if watch or watch_if is not None:
                raise ValueError("with_join registers in the first join: no watch or watch_if")
            sent = time.monotonic()
            lease = self._client.grant_lease(self._ttl, timeout=timeout)
            with self._lock:
                self._lease = lease
                self._last_ok = sent
                self._unregistered = timeout
            self._start_thread(self._renew_loop, "renew")
            return
        found = self._register(
            Deadline.after(timeout), read_window=watch, read_key=None if watch else watch_if
        )
        self._start_thread(self._renew_loop, "renew")
        if watch or found:
            self.watch_peers()

    def fold_registration(
        self,
        lease: Lease,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
    ) -> dict[str, Any] | None:
        """The body of one etcd transaction that creates the node key (as :meth:`_register`
        does: if absent, on ``lease``) and runs the transaction ``compare``/``success``/
        ``failure`` nested in it (the rendezvous' join, on the same lease): see ``with_join``
        of :meth:`start`. None when the key needs no creation (registered already, or
        ``lease`` is not this registry's lease now): the caller sends its own transaction.
        Its answer goes to :meth:`fold_answered`."""
        with self._lock:
            if self._unregistered is None or self._lease is None or self._lease.id != lease.id:
                return None
            value = self._record.to_json()
            self._fold_value = value
        key_b64 = base64.b64encode(self._key.encode()).decode("ascii")
        put = {
            "key": key_b64,
            "value": base64.b64encode(value).decode("ascii"),
            "lease": str(lease.id),
        }
        nested: dict[str, Any] = {"success": success}
        if compare:
            nested["compare"] = compare
        if failure:
            nested["failure"] = failure
        return {
            "compare": [{"key": key_b64, "target": "MOD", "result": "EQUAL", "mod_revision": "0"}],
            "success": [{"request_put": put}, {"request_txn": nested}],
            "failure": [{"request_range": {"key": key_b64}}],
        }

    def fold_answered(self, lease: Lease, response: dict[str, Any] | None) -> dict[str, Any] | None:
        """Takes etcd's answer to a :meth:`fold_registration` transaction (``None``: its outcome
        is unknown). Returns the nested transaction's answer (``succeeded``, ``responses``,
        the outer ``header``) when the node key was created by it; None when it was not (the
        key was there, or the outcome was unknown): then the registration is settled here the
        way :meth:`_register` settles it (a lost answer by reading the key, never by sending it
        again; a dead launcher's key taken over, our own from before a lost lease adopted), and
        the caller sends its nested transaction on its own.

        Raises:
            NodeIdInUse: A live launcher holds this node id.
            EtcdError: etcd did not take the registration in time.
        """
        with self._lock:
            timeout, value = self._unregistered, self._fold_value
        if timeout is None:
            return None  # registered meanwhile (a lapsed lease registered again)
        if response is not None and response.get("succeeded"):
            responses = response.get("responses") or []
            inner = responses[1].get("response_txn", {}) if len(responses) > 1 else {}
            self._registered(lease, value)
            return {
                "header": response.get("header", {}),
                "succeeded": bool(inner.get("succeeded")),
                "responses": inner.get("responses") or [],
            }
        deadline = Deadline.after(timeout)
        if response is None:  # the answer was lost: did etcd create the key?
            found = self._client.get_kv(self._key, timeout=_remaining(deadline))
            if found is not None and found.lease == lease.id:
                self._registered(lease, value)
                return None  # the nested transaction's outcome is unknown: the caller's call
        # The key is held (a dead launcher's, a live one's, ours from before a lost lease), or
        # was not created: the registration's own transaction settles it, on this lease.
        self._register(deadline, lease=lease)
        return None

    def _registered(self, lease: Lease, value: bytes) -> None:
        """The node key was created on ``lease`` with ``value`` by a folded registration;
        writes the record once more if it changed meanwhile (:meth:`update` writes nothing
        while the key does not exist)."""
        with self._lock:
            if self._lease is None or self._lease.id != lease.id:
                return
            self._unregistered = None
            self._written = (lease.id, value)
            changed = self._record.to_json() != value
        if changed:
            self.update()

    def watch_peers(self) -> None:
        """Starts the peers' watch, the links to the ring successors and the compaction, if not
        started yet (see :meth:`start`). Any thread; returns at once (the watch reads its
        window in its own thread)."""
        with self._lock:
            if self._watching or self._stop.is_set() or self._probe_server is None:
                return
            self._watching = True
            if self._fanout:
                self._links = PeerLinks(self._on_link_broken)
        self._start_thread(self._watch_loop, "watch")
        if self._compact_every is not None:
            self._start_thread(self._compact_loop, "compact")

    @property
    def watching(self) -> bool:
        """Whether the peers' watch was started (:meth:`watch_peers`)."""
        with self._lock:
            return self._watching

    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=f"flashckpt-node-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def rejoin(self, timeout: timedelta) -> int:
        """Registers this machine afresh after it was fenced: a new token, a new lease, the
        next generation, state ``waiting``; the stale lease is revoked if etcd still has it
        (its key goes, so every peer sees the old membership end). Renewals start again.

        Returns:
            The new generation.

        Raises:
            NodeIdInUse: Another live launcher took this node id meanwhile.
            EtcdError: etcd did not take the registration in time.
        """
        deadline = Deadline.after(timeout)
        with self._lock:
            if not self._fenced:
                return self._generation
            stale, self._stale_lease = self._stale_lease, None
            self._record = replace(
                self._record,
                token=uuid.uuid4().hex,
                state="waiting",
                group_rank=None,
                rdzv_member=None,
            )
            token = self._record.token
        if stale is not None:
            with contextlib.suppress(EtcdError):
                self._client.revoke_lease(stale, timeout=_remaining(deadline))
        if self._probe_server is not None:
            self._probe_server.token = token
        self._register(deadline)
        with self._lock:
            self._fenced = False
            self._generation += 1
            generation = self._generation
        self._start_thread(self._renew_loop, "renew")
        logger.warning(
            "registered again after the fence: generation %d (new lease and token), as a standby",
            generation,
        )
        return generation

    def shared_lease(self) -> Lease | None:
        """This machine's lease, for other keys that live and die with the machine (the
        rendezvous handler's, :meth:`RdzvHandler.share_lease
        <flashckpt.elastic.rendezvous.handler.RdzvHandler.share_lease>`); None while it holds
        none (not registered yet, fenced, closed)."""
        with self._lock:
            return None if self._fenced else self._lease

    def lease_failed(self, lease: Lease) -> None:
        """A user of the lease was told by etcd that it is gone: renew now (the renewal finds
        out, and registers again or fences) instead of at the next interval."""
        with self._lock:
            current = self._lease
        if current is not None and current.id == lease.id:
            self._renew_wake.set()

    def on_lease_ended(self, callback: Callable[[Lease], None]) -> None:
        """Calls ``callback(lease)`` (from the renew thread) when etcd says the lease is gone,
        before this machine registers again or is fenced. A fence for a lease etcd may still
        hold is ``on_fenced``'s business, not this callback's."""
        with self._lock:
            self._lease_listeners.append(callback)

    def _lease_ended(self, lease: Lease) -> None:
        with self._lock:
            listeners = list(self._lease_listeners)
        for callback in listeners:
            try:
                callback(lease)
            except Exception:
                logger.exception("telling a user of this node's lease that it ended failed")

    def update(
        self,
        *,
        timeout: timedelta | None = None,
        publish_after: timedelta | None = None,
        **fields: Any,
    ) -> None:
        """Changes fields of the published record (``state``, ``group_rank``, ``rdzv_node``).

        A failure to publish is logged, not raised: the record is informative, liveness rests
        on the lease alone. A change that changes nothing (the record as last written under
        the current lease) writes nothing: its neighbours would each receive it for nothing.

        Args:
            timeout: Deadline of the etcd write (default: the client's).
            publish_after: Change :attr:`record` now, but write it to etcd only if no other
                update came within this time (a record that holds so briefly is not worth a
                write and a message to each of its watchers): the launcher's ``waiting``
                between two rounds, which a restart that forms its next round sooner
                replaces with the new rank (issue 31: at 1,024 machines, 1,023 writes and
                8,000 watch messages on the kill path that nobody acts on). Its write is
                made from a thread of its own; a later update (or :meth:`close`) cancels it.
            **fields: The fields to change.
        """
        with self._lock:
            self._record = replace(self._record, **fields)
            self._changes += 1
            if publish_after is not None:
                if self._lease is not None and not self._stop.is_set():
                    change = self._changes
                    _LATER.call_at(
                        time.monotonic() + publish_after.total_seconds(),
                        lambda: self._publish_deferred(change, timeout),
                    )
                return
            record, lease = self._record, self._lease
            value = record.to_json()
            if lease is None or self._written == (lease.id, value):
                return
            if self._unregistered is not None:
                return  # the key's creation (fold_registration) carries the record
            # Until this write is known to be the last one etcd took, what the key holds is
            # unknown: two writes in flight at once may land in either order.
            self._written = None
            self._update_seq += 1
            mine, overlapped = self._update_seq, self._updates_in_flight > 0
            self._updates_in_flight += 1
        try:
            self._client.put(self._key, value, lease=lease, timeout=timeout)
        except EtcdError as exc:
            logger.warning("could not publish this node's state %r: %s", fields, exc)
            return
        finally:
            with self._lock:
                self._updates_in_flight -= 1
        with self._lock:
            if self._lease is lease and self._update_seq == mine and not overlapped:
                self._written = (lease.id, value)

    def _publish_deferred(self, change: int, timeout: timedelta | None) -> None:
        """Writes the record an ``update(publish_after=...)`` changed, unless another update
        (``change`` is not the last) or :meth:`close` came since."""
        with self._lock:
            if change != self._changes or self._stop.is_set():
                return
        self.update(timeout=timeout)

    def publish(self, key: str, value: bytes) -> bool:
        """Writes ``key`` bound to this node's lease, so it disappears with the machine.

        Used for the machine's monitoring summary (:mod:`flashckpt.elastic.membership.jobview`).
        After the lease lapsed and was registered again, the next call writes the key with the new
        lease.

        Returns:
            False when the node holds no lease (not registered, or closed).

        Raises:
            EtcdError: etcd did not take the write.
        """
        with self._lock:
            lease = self._lease
        if lease is None:
            return False
        self._client.put(key, value, lease=lease)
        return True

    def peers(self) -> dict[str, NodeRecord]:
        """The live peers this machine watches, as last seen by the watch: its ring neighbours
        (:data:`_WINDOW` on each side of it in the ring of node ids; every peer in a job of at
        most ``2 * _WINDOW + 1`` machines). The whole job is :meth:`records`."""
        with self._lock:
            return dict(self._peers)

    @property
    def watches_whole_job(self) -> bool:
        """Whether the watch follows every node key (a small job), not the neighbours only."""
        with self._lock:
            return self._whole

    def records(self, timeout: timedelta | None = None) -> list[NodeRecord]:
        """Every live node record of the job (this one's too), as etcd holds them now.

        In a small job, whose every key the watch follows, the watch's view answers when etcd
        confirms it is current (one transaction of counts: as many node keys as the view
        holds, none written after the view's revision; the view may lag a record written just
        before a rendezvous completed). Otherwise (a larger job, whose watch follows the
        neighbours only), the keys are read: a read of N records, for what needs the whole job
        (status, the replica ring), never on a round's path.

        Raises:
            EtcdError: etcd did not answer.
        """
        with self._lock:
            loaded, revision = self._view_loaded and self._whole, self._view_revision
            peers, own, lease = list(self._peers.values()), self._record, self._lease
        if loaded and lease is not None:
            # This machine's own key is not in the view (its own writes are not the view's
            # business): the newer keys are counted on both sides of it.
            key, end = self._key.encode(), prefix_end(self._prefix)
            (total, newer_before, newer_after, own_count), _ = self._client.counts(
                [
                    (self._prefix, end, 0),
                    (self._prefix, key, revision + 1),
                    (key + b"\x00", end, revision + 1),
                    (key, None, 0),
                ],
                timeout=timeout,
            )
            if newer_before + newer_after == 0 and own_count == 1 and total == len(peers) + 1:
                self.view_answers += 1
                return [*peers, replace(own, lease=lease.id)]
        kvs = self._client.get_prefix(self._prefix, timeout=timeout)
        return [r for r in (NodeRecord.from_kv(kv) for kv in kvs) if r is not None]

    def linked(self) -> set[str]:
        """The peers this launcher holds a link to now
        (:mod:`flashckpt.elastic.membership.peerlinks`)."""
        return self._links.held() if self._links is not None else set()

    def reap_dead_peers(
        self, candidates: Collection[str] | None = None, *, via: str = "probe"
    ) -> list[NodeRecord]:
        """Probes peers and revokes the lease of every one that is certainly dead.

        Revoking deletes the peer's key, so every launcher's watch reports it as lost at once,
        as if its lease had lapsed.

        Without ``candidates`` (a sweep before a new round), this machine walks the ring of
        node ids from itself: it checks its successors until it has met ``max(2, links)``
        that are not dead, probing as many at once as it still needs. Every machine sweeping
        so, each dead machine is checked by its nearest live predecessors (two of them, so one
        that hangs or was cut off does not hide the dead one after it), and the sweep costs
        each machine O(1 + dead) probes instead of one per peer (N*N for the job).

        In that sweep, a peer whose link this machine holds
        (:mod:`flashckpt.elastic.membership.peerlinks`: its ring successors) and finds intact
        now is not probed (named ``candidates`` always are): its launcher holds the link's
        socket open, which says as much as a probe it answers (a probe finds dead only a peer
        whose port refuses or answers another token, and a launcher that is gone closed its
        link; a hung or cut-off one keeps both the link and a probe silent). So in a job whose
        links are held, a sweep probes only the successors past a broken or missing link: the
        dead machine's nearest live predecessors probe it and the machines after it, the
        others nothing (at 1,024 machines, a few probes for the job instead of two per
        machine).

        Args:
            candidates: Node ids to probe; default: the ring walk above.
            via: Why they are probed, for ``on_lost``.

        Returns:
            The records of the peers found dead.
        """
        own = self._record.node_id
        with self._lock:
            loaded, known = self._view_loaded, list(self._peers.values())
            if not self._whole:  # the window's successor side: the ring walk goes that way
                known = [r for r in known if self._on_successor_side(r.node_id)]
        try:
            if candidates is not None:
                # The named peers' keys only: a broken link costs one key, not every one.
                names = sorted(n for n in set(candidates) if n != own)
                found, _ = self._client.get_many([self._prefix + n for n in names])
                records = [r for r in map(_record_or_none, found) if r is not None]
            elif loaded:
                records = known  # the watch's view: up to date but for the last milliseconds
            else:
                kvs = self._client.get_prefix(self._prefix)
                records = [r for r in map(NodeRecord.from_kv, kvs) if r is not None]
        except EtcdError as exc:
            logger.warning("cannot list the job's nodes to probe them: %s", exc)
            return []
        records = [r for r in records if r.node_id != own]
        if not records:
            return []
        if candidates is None and loaded:
            probed = self._walk_ring(records, max(2, self._fanout))
            missing = max(2, self._fanout) - sum(r is not ProbeResult.DEAD for _, r in probed)
            if missing > 0 and not self.watches_whole_job:
                # More dead successors in a row than the watched window holds: the ring beyond
                # it is read (rare: a rack of consecutive node ids lost at once).
                seen = {r.node_id for r, _ in probed}
                try:
                    kvs = self._client.get_prefix(self._prefix)
                except EtcdError as exc:
                    logger.warning("cannot list the job's nodes to probe them: %s", exc)
                    kvs = []
                rest = [
                    r
                    for r in map(NodeRecord.from_kv, kvs)
                    if r is not None and r.node_id != own and r.node_id not in seen
                ]
                probed += self._walk_ring(rest, missing)
        else:
            # Named peers (a worker failure or a broken link asks) are probed, never taken for
            # alive on their link's word: the link of a machine killed this instant may not be
            # closed yet (its kernel closes it a moment after its processes are gone), and the
            # workers' failure would then be judged their own.
            probed = self._probe_unlinked(records, 32, trust_links=False)
        dead = [r for r, result in probed if result is ProbeResult.DEAD]
        for record in dead:
            logger.warning(
                "node %s (launcher pid %d on %s) no longer answers on %s: declaring it dead",
                record.node_id,
                record.pid,
                record.host,
                record.probe,
            )
            with self._lock:
                # Revoking deletes its key, and this launcher's own watch may see the deletion
                # before the revocation returns: the loss is reported as found here, by ``via``.
                self._reaping.add(record.token)
            try:
                self._client.revoke_lease(record.lease)
            except EtcdError as exc:
                logger.warning(
                    "could not revoke the lease of dead node %s: %s", record.node_id, exc
                )
            self._report_lost(record, via)
        return dead

    def _walk_ring(
        self, records: list[NodeRecord], wanted: int
    ) -> list[tuple[NodeRecord, ProbeResult]]:
        """Checks ``records`` in ring order after this machine until ``wanted`` of them are not
        dead (see :meth:`reap_dead_peers`): those linked and intact without a probe, the others
        probed as many at once as are still wanted."""
        by_id = {r.node_id: r for r in records}
        order = ring_successors(self._record.node_id, by_id, len(by_id))
        checked: list[tuple[NodeRecord, ProbeResult]] = []
        not_dead = at = 0
        while not_dead < wanted and at < len(order):
            batch = [by_id[n] for n in order[at : at + wanted - not_dead]]
            at += len(batch)
            for record, result in self._probe_unlinked(batch, len(batch)):
                checked.append((record, result))
                not_dead += result is not ProbeResult.DEAD
        return checked

    def _probe_unlinked(
        self, records: list[NodeRecord], workers: int, *, trust_links: bool = True
    ) -> list[tuple[NodeRecord, ProbeResult]]:
        """Each of ``records`` with what it is found to be: :attr:`ProbeResult.ALIVE` without
        a probe when this machine holds an intact link to it (unless not ``trust_links``), else
        what a patient probe says (up to ``workers`` at once; one alone in this thread)."""
        links = self._links if trust_links else None
        results: list[ProbeResult | None] = [
            ProbeResult.ALIVE if links is not None and links.intact(r.token) else None
            for r in records
        ]
        unlinked = [i for i, result in enumerate(results) if result is None]
        with self._lock:
            self.links_trusted += len(records) - len(unlinked)
            self.peers_probed += len(unlinked)
        if len(unlinked) == 1:
            results[unlinked[0]] = _probe_patiently(records[unlinked[0]])
        elif unlinked:
            count = min(workers, len(unlinked))
            with ThreadPoolExecutor(count, thread_name_prefix="flashckpt-probe") as ex:
                found = ex.map(_probe_patiently, [records[i] for i in unlinked])
                for i, result in zip(unlinked, found, strict=True):
                    results[i] = result
        return [
            (r, result or ProbeResult.UNKNOWN) for r, result in zip(records, results, strict=True)
        ]

    def close(self, timeout: timedelta = timedelta(seconds=2), *, revoke: bool = True) -> None:
        """Stops renewing and revokes the lease, which deletes the node key. Never raises.

        Args:
            timeout: Deadline of the revocation; if etcd does not take it, the key goes when
                the lease lapses (``ttl``).
            revoke: ``False`` when etcd is known to be unreachable: the lease lapses.
        """
        self._stop.set()
        self._renew_wake.set()
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.close()  # wakes the watch thread
        with self._lock:
            links = self._links
        if links is not None:
            links.close()
        with self._lock:
            lease, self._lease = self._lease, None
            lease = lease or self._stale_lease
            self._stale_lease = None
        if lease is not None and revoke:
            try:
                self._client.revoke_lease(lease, timeout=timeout)
            except EtcdError as exc:
                logger.info("could not revoke this node's lease (it lapses on its own): %s", exc)
        if self._probe_server is not None:
            self._probe_server.close()
        for thread in self._threads:
            thread.join(timeout=0.5)

    # ------------------------------------------------------------------------ internals

    def _register(
        self,
        deadline: Deadline,
        *,
        read_window: bool = False,
        read_key: str | None = None,
        lease: Lease | None = None,
    ) -> bool:
        """Creates the node key on a new lease (taking over a dead launcher's key); returns
        whether ``read_key`` exists (read in the creation's transaction; False without one).

        ``read_window``: the creation's transaction also reads the watched window's keys
        (:meth:`_registration_ranges`: ascending ranges of a bounded number of keys, no sort:
        the transaction runs in etcd's serial apply loop, where a sorted range would fetch
        every key of its span), which the watch thread then starts from (:meth:`_watch_loop`):
        one request per machine for both, not two (:meth:`_read_window` only when those
        ranges did not settle the window).

        ``lease``: the registry's lease, granted already and renewed (a folded registration
        that found the key held, :meth:`fold_answered`): kept, not revoked, while the key is
        taken over."""
        given = lease
        while True:
            sent = time.monotonic()
            if given is None:
                lease = self._client.grant_lease(self._ttl, timeout=_remaining(deadline))
            else:
                lease = given
                with self._lock:
                    sent = self._last_ok
            assert lease is not None
            with self._lock:
                value = self._record.to_json()
            key_b64 = base64.b64encode(self._key.encode()).decode("ascii")
            own = {"request_range": {"key": key_b64}}
            put = {"key": key_b64, "value": base64.b64encode(value).decode("ascii")}
            window = self._registration_ranges() if read_window else []
            extra = (
                [{"request_range": {"key": base64.b64encode(read_key.encode()).decode("ascii")}}]
                if read_key is not None
                else []
            )
            body = {
                "compare": [
                    {"key": key_b64, "target": "MOD", "result": "EQUAL", "mod_revision": "0"}
                ],
                "success": [{"request_put": {**put, "lease": str(lease.id)}}, own, *window, *extra],
                "failure": [own],
            }
            answers: list[dict[str, Any]] | None = None
            exists = False
            try:
                response = self._client._call(
                    "/v3/kv/txn", body, timeout=_remaining(deadline), idempotent=False
                )
                done = bool(response.get("succeeded"))
                responses = response.get("responses") or []
                found = responses[1 if done else 0].get("response_range", {})
                current = _kv_of(found["kvs"][0]) if found.get("kvs") else None
                if done and window:
                    answers = [r.get("response_range", {}) for r in responses[2 : 2 + len(window)]]
                    revision = int(response.get("header", {}).get("revision", 0))
                if done and extra:
                    exists = bool(responses[-1].get("response_range", {}).get("kvs"))
            except EtcdOutcomeUnknown:
                found_kv = self._client.get_kv(self._key, timeout=_remaining(deadline))
                done, current = (found_kv is not None and found_kv.lease == lease.id), found_kv
                if done and read_key is not None:
                    exists = self._client.get_kv(read_key, timeout=_remaining(deadline)) is not None
            if not done and given is not None and current is not None and current.lease == lease.id:
                done = True  # created on this lease already (a folded registration's lost answer)
            if done:
                with self._lock:
                    self._lease = lease
                    self._last_ok = max(self._last_ok, sent) if given is not None else sent
                    self._written = (lease.id, value)
                    self._unregistered = None
                    if answers is not None:
                        self._registered_window = (answers, revision)
                changed = given is not None and self.record.to_json() != value
                if changed:
                    self.update()
                return exists
            if given is None:
                with contextlib.suppress(EtcdError):
                    self._client.revoke_lease(lease, timeout=_remaining(deadline))
            holder = NodeRecord.from_kv(current) if current is not None else None
            if holder is not None and holder.token == self._record.token:
                # Our own key from before a lost lease was re-created: adopt it.
                self._client.revoke_lease(holder.lease, timeout=_remaining(deadline))
                continue
            verdict = probe(holder) if holder is not None else ProbeResult.UNKNOWN
            if holder is not None and verdict is ProbeResult.DEAD:
                logger.info(
                    "node id %s was held by a dead launcher (pid %d on %s); taking it over",
                    holder.node_id,
                    holder.pid,
                    holder.host,
                )
                self._client.revoke_lease(holder.lease, timeout=_remaining(deadline))
                continue
            if verdict is ProbeResult.ALIVE or deadline.expired():
                who = f"pid {holder.pid} on {holder.host}" if holder else "another launcher"
                raise NodeIdInUse(
                    f"node id {self._record.node_id!r} is already used in this job by a running "
                    f"launcher ({who}, key {self._key}); give every machine its own --node-id "
                    "(simulated machines on one host need distinct ids)"
                )
            # The holder may be a launcher that died on another host: its lease will lapse.
            deadline.sleep(0.5)

    def _renew_loop(self) -> None:
        """Renews the lease every ``ttl / 5``, one renewal in flight at a time.

        A renewal's request may take as long as the lease has left (less a margin), not just
        one interval: under load etcd answers late, and a renewal abandoned after one interval
        is one the lease needed (and the next one only adds to the load). This loop waits for
        it in slices (``EtcdClient.renew_lease(keep=True)``: the keep-alive stays on the wire
        between them, and the next slice takes its answer), so it still wakes on time to probe
        the peers while it is late and to decide at the fence deadline, without a thread of its
        own for the request (the keep-alive stream has none either: this thread reads its
        answer; issue 31, one thread per machine for its lease, was three). A failed renewal is
        retried after a pause that doubles with each failure in a row
        (:func:`_renew_retry_delay`).
        """
        interval = self._ttl.total_seconds() / 5
        ttl_s = self._ttl.total_seconds()
        fencing = self._on_fenced is not None
        next_at = time.monotonic() + interval  # the next renewal
        started: float | None = None  # when the renewal in flight was started, if one is
        until = probe_at = 0.0  # its deadline, and when to probe the peers while it is late
        failed_sent = float("-inf")  # when the last renewal that failed was sent
        failures = 0  # renewals that failed in a row
        while True:
            with self._lock:
                lease, last_ok, fenced = self._lease, self._last_ok, self._fenced
            if lease is None or fenced or self._stop.is_set():
                return
            deadline = fence_deadline(last_ok, ttl_s)
            now = time.monotonic()
            if started is None:
                # Wake for the next renewal, or at the fence deadline if that comes first.
                wake = next_at
                if fencing and now < deadline:
                    wake = min(wake, deadline)
                nudged = self._renew_wake.wait(max(0.0, wake - now))
                self._renew_wake.clear()
                if self._stop.is_set():
                    return
                if nudged:
                    next_at = time.monotonic()  # a user of the lease saw it gone: renew now
                now = time.monotonic()
                if fencing and now >= deadline:
                    # A peer's renewal shows that this machine alone is cut off from etcd when
                    # one of this machine's renewals was sent after it and failed; not when the
                    # only one that failed was sent before it (etcd came back for those sent
                    # later).
                    reason = self._cut_off(last_ok, (failed_sent, float("inf")))
                    if reason is not None:
                        self._fence(reason, last_ok)
                        return
                if now < next_at:
                    continue  # woke for the fence deadline only
                # The request may take what the lease has left, less a margin (etcd must
                # receive it before the lease lapses); with nothing left, an interval (etcd's
                # answer tells).
                left = lease_expiry(last_ok, ttl_s) - now - interval / 2
                started, until = now, now + (left if left >= interval else interval)
                probe_at = now + interval
            # Wait for the answer until the next moment this loop must act: probing the peers
            # while it is late, the fence deadline, the renewal's own deadline.
            wake = min(probe_at, until)
            if fencing and now < deadline:
                wake = min(wake, deadline)
            slice_s = max(0.001, wake - now)
            error: BaseException | None = None
            sent = started
            called = time.monotonic()
            try:
                # Kept on the wire between slices; its last slice gives it up (and a stream
                # that answered nothing since is closed).
                _, sent = self._client.renew_lease(
                    lease, timeout=timedelta(seconds=slice_s), keep=wake < until
                )
            except EtcdLeaseNotFound as exc:
                error = exc
            except EtcdError as exc:
                now = time.monotonic()
                if now >= called + slice_s and now < until and not self._stop.is_set():
                    # The slice ended with the renewal still unanswered (it stays on the wire,
                    # or is sent again on a new stream): act on the time, then wait on.
                    if now >= probe_at:
                        probe_at = now + interval
                        if fencing:  # late by an interval: do the peers answer?
                            self._probe_in_background()
                    with self._lock:
                        last_ok = self._last_ok
                    if fencing and now >= fence_deadline(last_ok, ttl_s):
                        # A peer's renewal shows this machine alone is cut off from etcd when
                        # it came after a renewal of this machine's that failed, or that has
                        # gone unanswered for an interval while the peer's went through.
                        reason = self._cut_off(last_ok, (failed_sent, started + interval))
                        if reason is not None:
                            self._fence(reason, last_ok)
                            return
                    continue
                error = exc
            self._renew_wake.clear()  # this answer says what a nudge meanwhile asked
            if self._stop.is_set():
                return
            with self._lock:
                current = self._lease
            if current is None or current.id != lease.id:
                started = None
                continue  # a renewal of a lease given up meanwhile
            if not self._renewal_answered(lease, error, sent, fencing):
                return
            # The next renewal an interval after this one was sent; after a failure, after a
            # pause that backs off (a final error must not spin, nor N machines flood etcd).
            if error is None:
                failures, next_at = 0, sent + interval
            else:
                failed_sent = max(failed_sent, sent)
                failures += 1
                with self._lock:
                    last_ok = self._last_ok
                now = time.monotonic()
                left = lease_expiry(last_ok, ttl_s) - now
                next_at = now + _renew_retry_delay(failures, interval, left)
            started = None

    def _renewal_answered(
        self, lease: Lease, error: BaseException | None, sent: float, fencing: bool
    ) -> bool:
        """Takes a renewal's answer; False when the renew loop must end (fenced, stopped)."""
        ttl_s = self._ttl.total_seconds()
        if error is None:
            with self._lock:
                self._last_ok = max(self._last_ok, sent)
                self._warned_cut_off = False
            return True
        if isinstance(error, EtcdLeaseNotFound):
            if self._stop.is_set():
                return False
            with self._lock:
                last_ok = self._last_ok
            self._lease_ended(lease)
            if self._on_fenced is not None:
                # The job dropped this machine: its workers must stop, and it may come back
                # only as a new member, never under the old token.
                self._fence(
                    f"this node's etcd lease lapsed (etcd was unreachable for more than "
                    f"{ttl_s:g} s)",
                    last_ok,
                )
                return False
            logger.warning(
                "this node's etcd lease lapsed (etcd was unreachable for more than %g s?); "
                "registering again",
                ttl_s,
            )
            with self._lock:
                if self._lease is not None and self._lease.id == lease.id:
                    self._lease = None  # nobody uses it meanwhile (shared_lease)
            try:
                self._register(Deadline.after(self._ttl * 4))
            except Exception as exc:  # keep renewing; the next round retries
                logger.error("registering this node again failed: %s", exc)
            return True
        # One failed renewal must not stop the thread: the next one goes after a backoff.
        self.failed_renewals += 1
        logger.warning("renewing this node's etcd lease failed (will retry): %s", error)
        if fencing:
            self._probe_in_background()
        return True

    def _etcd_age(self) -> float | None:
        """Seconds since the last lease renewal that succeeded was sent (what this launcher
        answers a peer that asks); None while it holds no lease (fenced, not registered)."""
        with self._lock:
            if self._lease is None or self._fenced:
                return None
            return max(0.0, time.monotonic() - self._last_ok)

    def _probe_in_background(self) -> None:
        """Probes the peers from a thread of its own (the renew loop keeps its pace)."""
        if self._prober is None:
            self._prober = threading.Thread(
                target=self._probe_loop, name="flashckpt-node-outage-probe", daemon=True
            )
            self._prober.start()
        self._probe_wake.set()

    def _probe_loop(self) -> None:
        while not self._stop.is_set():
            if not self._probe_wake.wait(0.5):
                continue
            self._probe_wake.clear()
            alive = self._alive_peers(_OUTAGE_PROBE_TIMEOUT_S)
            if alive:
                with self._lock:
                    self._peer_answered_at, self._peers_answering = time.monotonic(), alive

    def _alive_peers(self, timeout: float) -> dict[str, float | None] | None:
        """The peers that answer their probe port, each with when it last renewed its own lease
        (``time.monotonic()`` here, as it answers; None if it holds none); None when no peer is
        known."""
        peers = [r for r in self.peers().values() if r.probe]
        if not peers:
            return None
        if len(peers) > _OUTAGE_SAMPLE:
            # Every machine probes during an etcd outage: a bounded sample keeps it O(1) per
            # machine (its ring successors, then others at random), not N*N for the job.
            by_id = {r.node_id: r for r in peers}
            chosen = ring_successors(self._record.node_id, by_id, _OUTAGE_SAMPLE // 2)
            others = [n for n in by_id if n not in chosen]
            chosen += random.sample(others, _OUTAGE_SAMPLE - len(chosen))
            peers = [by_id[n] for n in chosen]

        def ask(r: NodeRecord) -> tuple[bool, float | None]:
            if probe(r, timeout) is not ProbeResult.ALIVE:
                return False, None
            age = peer_etcd_age(r, timeout)
            return True, None if age is None else time.monotonic() - age

        with ThreadPoolExecutor(min(16, len(peers)), thread_name_prefix="flashckpt-fence") as ex:
            answers = list(ex.map(ask, peers))
        return {r.node_id: renewed for r, (ok, renewed) in zip(peers, answers, strict=True) if ok}

    def _cut_off(
        self, last_ok: float, tried: tuple[float, float] = (float("inf"), float("inf"))
    ) -> str | None:
        """Why this machine is cut off from the job (from the others too, or from etcd alone
        while they reach it), or None when it is not.

        A peer that answers its probe port means etcd is what is unreachable (an outage every
        machine sees lapses no lease, so no new world forms without this one): training goes
        on, as it always did through an etcd outage. A machine that knows no peer (one
        machine, no standby) has nobody to take its place and is not fenced either. The peers
        are probed in the background after each failed renewal (a loaded peer gets 1 s to
        answer); at the deadline, if none answered in the last two renewal intervals, once
        more, briefly. (A partition that follows an etcd outage is thus fenced up to two
        intervals late.) A peer's renewal (monotonic time here) shows that this machine alone
        is cut off from etcd only before ``tried[0]`` or after ``tried[1]`` (default: any).
        """
        with self._lock:
            # Answers of the last two renewal intervals count (the background probes).
            lately = self._peer_answered_at >= time.monotonic() - 2 * self._ttl.total_seconds() / 5
            answered = dict(self._peers_answering)
        alive = answered if lately else self._alive_peers(_FENCE_PROBE_TIMEOUT_S)
        ttl_s = self._ttl.total_seconds()
        if alive is None:
            return None
        if not alive:
            return (
                f"no etcd lease renewal for {time.monotonic() - last_ok:.1f} s (TTL {ttl_s:g} s) "
                "and no other machine of the job answers"
            )
        # A peer that renewed its lease well after this machine's last renewal (1.5 intervals:
        # more than the renewals' phase difference) reaches etcd: this machine alone does not.
        # Its lease will lapse and a new world will form without it, so it fences as if cut off
        # from everyone.
        margin = 1.5 * ttl_s / 5
        reaching = {
            n: t
            for n, t in alive.items()
            if t is not None and t > last_ok + margin and not tried[0] <= t <= tried[1]
        }
        if reaching:
            return (
                f"no etcd lease renewal for {time.monotonic() - last_ok:.1f} s, while node(s) "
                f"{', '.join(sorted(reaching))} renewed theirs since: this machine alone is "
                "cut off from etcd, and the others will form a new world without it"
            )
        if not self._warned_cut_off:
            self._warned_cut_off = True
            logger.warning(
                "no etcd lease renewal for %.1f s, but node(s) %s answer: etcd is unreachable, "
                "this machine is not cut off from the job; not fencing",
                time.monotonic() - last_ok,
                ", ".join(sorted(alive)),
            )
        return None

    def _fence(self, reason: str, last_ok: float) -> None:
        ttl_s = self._ttl.total_seconds()
        with self._lock:
            if self._fenced:
                return
            self._fenced = True
            # Never used again: no record, summary or renewal is written under it.
            self._stale_lease, self._lease = self._lease, None
            generation = self._generation
        logger.warning(
            "FENCED (generation %d): %s; this machine stops its workers and commits nothing "
            "more; it registers again as a standby once etcd answers",
            generation,
            reason,
        )
        assert self._on_fenced is not None
        try:
            self._on_fenced(FenceNotice(reason, last_ok, lease_expiry(last_ok, ttl_s), generation))
        except Exception:
            logger.exception("fencing this machine failed")

    def _watch_loop(self) -> None:
        """Keeps :meth:`peers` up to date from the watched changes of the neighbours' keys.

        The watch follows a *window* of the ring of node ids: this machine's ``k`` successors
        and ``k`` predecessors (:data:`_WINDOW`; every key in a job of at most ``2k + 1``), so
        a change anywhere in the job costs O(1) watch messages per machine, not one per peer
        (N*N for the job). The window is read once when the watch starts (one transaction of
        four ranges of at most ``k`` keys: O(k), whatever the job's size), again when a
        neighbour went (the window is widened to the next one) and when etcd compacted the
        history the watch needs; every other change arrives on a long-lived stream
        (:class:`WatchStream`) as an event, applied to the view as it is (a delete reports the
        record the view holds, the key as last written). A machine registering inside the
        window narrows it, without a read (a new stream from the same revision). A window
        that wraps around the end of the ring is two key ranges, two streams read in turn.
        Each machine being in the window of ``k`` machines on each side, its key going is seen
        by ``2k`` of them.
        """
        revision: int | None = None
        quiet_since = time.monotonic()
        streams: list[WatchStream] = []
        # Where the streams given up last were: (range start, range end, next revision). A new
        # stream whose range lies inside one of them goes on from there: nothing is lost, and
        # nothing is received twice (a window only narrows without a read).
        resume: list[tuple[bytes, bytes, int]] = []

        def drop_streams(*, keep_positions: bool = False) -> None:
            resume[:] = (
                [(a, b, s.next_revision) for (a, b), s in zip(ranges, streams, strict=True)]
                if keep_positions
                else []
            )
            for old in streams:
                old.close()
            streams.clear()

        def start_of(a: bytes, b: bytes, revision: int) -> int:
            for a0, b0, next_revision in resume:
                if a0 <= a and b <= b0:
                    return next_revision
            return revision + 1

        ranges: list[tuple[bytes, bytes]] = []
        try:
            while not self._stop.is_set():
                if revision is None:
                    drop_streams()
                    revision = self._first_window() or self._read_window()
                    if revision is None:
                        self._stop.wait(0.5)
                        continue
                with self._lock:
                    self._view_revision = revision  # the view holds every change up to it
                if not streams:
                    with self._lock:
                        ranges = self._ranges()
                    streams.extend(
                        # No previous values: the view holds every key of the window as
                        # last written (read, then each change applied), so a deleted peer's
                        # record is the view's; etcd would fetch each previous value for
                        # every watcher of the key, and each watcher decode it, for nothing.
                        WatchStream(self._client, a, b, start_of(a, b, revision))
                        for a, b in ranges
                    )
                    with self._lock:
                        self._streams = list(streams)
                    if self._stop.is_set():
                        return
                slice_ = _WATCH_SLICE if len(streams) == 1 else _SEGMENT_SLICE
                events: list[WatchEvent] = []
                try:
                    for stream in streams:
                        events += stream.next_events(slice_)
                except WatchClosed:
                    return
                except WatchCompacted as exc:
                    logger.info(
                        "the node keys' history up to revision %d was compacted; reading the keys",
                        exc.compact_revision,
                    )
                    revision = None
                    continue
                except Exception as exc:
                    logger.warning("watching the job's node keys failed (will retry): %s", exc)
                    drop_streams(keep_positions=True)  # again from where each stream was
                    self._stop.wait(0.5)
                    continue
                self.watch_slices += 1
                if events:
                    self.watch_events += len(events)
                    changed = self._apply_events(events)
                    revision = min(s.next_revision for s in streams) - 1
                    quiet_since = time.monotonic()
                    moved = self._move_window() if changed else False
                    if moved is None:
                        revision = None  # a neighbour went: read the window again
                    elif moved:
                        drop_streams(keep_positions=True)  # narrowed: new streams go on
                elif time.monotonic() - quiet_since >= _QUIET_CHECK_S:
                    quiet_since = time.monotonic()
                    moved_to = self._quiet_revision(revision)
                    if moved_to > revision:
                        # Reopened from there: a stream that breaks later (an etcd restart)
                        # resumes from a revision etcd still has.
                        self.quiet_moves += 1
                        revision = moved_to
                        drop_streams()
        finally:
            drop_streams()

    # ---------------------------------------------------------------- the watched window

    def _ring_key(self, node_id: str) -> tuple[bool, str]:
        """Sorts node ids in ring order starting after this machine's."""
        return (node_id < self._record.node_id, node_id)

    def _on_successor_side(self, node_id: str) -> bool:
        """Whether ``node_id`` is between this machine and its window's last successor (the
        lock held; window mode)."""
        return self._ring_key(node_id) <= self._ring_key(self._hi)

    def _ranges(self) -> list[tuple[bytes, bytes]]:
        """The key ranges the window covers (the lock held)."""
        start, end = self._prefix.encode(), prefix_end(self._prefix)
        if self._whole:
            return [(start, end)]
        lo = (self._prefix + self._lo).encode()
        hi = (self._prefix + self._hi).encode() + b"\x00"
        if self._lo < self._hi:
            return [(lo, hi)]
        return [(lo, end), (start, hi)]  # it wraps around the end of the ring

    def _window_ranges(self) -> list[dict[str, Any]]:
        """A transaction's reads of the window's keys: four ranges of at most ``k`` keys each
        (the ``k`` after this key and before it, from both ends of the ring)."""
        k = self._window_k
        start, end = self._prefix.encode(), prefix_end(self._prefix)
        own = self._key.encode()
        after, before = (own + b"\x00", end), (start, own)
        return [
            _limited_range(*after, k, descend=False),
            _limited_range(*before, k, descend=False),
            _limited_range(*before, k, descend=True),
            _limited_range(*after, k, descend=True),
        ]

    def _read_window(self) -> int | None:
        """Reads the window's keys into the view (a neighbour gone, after a compaction, or at
        the watch's start when the registration's ranges did not settle it): one transaction
        of :meth:`_window_ranges`, O(k) keys whatever the job's size. Reports the peers of the
        window gone since the last read (none on the first). Returns the read's revision,
        None if etcd did not answer."""
        read = self._read_ranges(self._window_ranges())
        if read is None:
            return None
        answers, revision = read
        try:
            self._take_window(answers)
        except Exception as exc:
            logger.warning("reading the job's node keys failed (will retry): %s", exc)
            return None
        return revision

    def _read_ranges(self, ranges: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int] | None:
        """One read-only transaction of ``ranges``: each range's answer and the revision, or
        None (logged) if etcd did not answer."""
        self.window_requests += 1
        try:
            response = self._client._call(
                "/v3/kv/txn", {"success": ranges}, timeout=None, idempotent=True
            )
            answers = [r.get("response_range", {}) for r in response.get("responses") or []]
            revision = int(response.get("header", {}).get("revision", 0))
        except Exception as exc:
            logger.warning("reading the job's node keys failed (will retry): %s", exc)
            return None
        return answers, revision

    def _spans_read(self) -> int | None:
        """Reads the window with :meth:`_registration_ranges` and loads it
        (:meth:`_settle_window`); its revision, or None if etcd did not answer or the ranges
        did not settle the window."""
        read = self._read_ranges(self._registration_ranges())
        return None if read is None else self._settle_window(*read)

    def _registration_ranges(self) -> list[dict[str, Any]]:
        """The window's reads folded into the registration's transaction (see
        :meth:`_register`), none of them sorted (etcd 3.5 fetches every key of a sorted range's
        span, whatever its limit): the ``2k`` keys after this one and the ``2k`` first of the
        ring (every key of a small job, the successors), and for the predecessors the spans
        from this node id cut short by one and by two characters up to this key (``m537``:
        ``[m53, m537)`` and ``[m5, m537)``), whose last ``k`` keys are the nearest ones before
        it when the span holds at least ``k`` and the answer holds the whole span. The wider
        span is read without values (keys only): it settles the window only where the
        narrower one holds fewer than ``k`` keys, and then only its last ``k`` values are
        needed (:meth:`_settle_window` reads them); at 1,024 machines its ~60 values were
        most of the read (1.8 ms of etcd's CPU and 0.7 ms of the machine's per read)."""
        k = self._window_k
        start, end = self._prefix.encode(), prefix_end(self._prefix)
        own = self._key.encode()
        node = self._record.node_id.encode()
        ranges = [
            _limited_range(own + b"\x00", end, 2 * k, descend=False),
            _limited_range(start, own, 2 * k, descend=False),
        ]
        for cut, limit in ((1, _SPAN_LIMITS[0]), (2, _SPAN_LIMITS[1])):
            if len(node) > cut:
                ranges.append(
                    _limited_range(
                        start + node[:-cut], own, limit, descend=False, keys_only=cut == 2
                    )
                )
        return ranges

    def _first_window(self) -> int | None:
        """The window as the registration read it (once; see :meth:`_register`), loaded into
        the view; its revision, or None when the registration did not read it or its ranges
        did not settle the window (the watch then reads it itself)."""
        with self._lock:
            taken, self._registered_window = self._registered_window, None
            first = not self._view_loaded
        if taken is None and first:
            # A watch started after the registration (watch_peers): the same unsorted bounded
            # ranges in a read of their own (the DESCEND ranges of _read_window make etcd read
            # every key of their span: at 1,024 machines, all starting at once, 2 ms each).
            return self._spans_read()
        if taken is None:
            return None
        return self._settle_window(*taken)

    def _settle_window(self, answers: list[dict[str, Any]], revision: int) -> int | None:
        """Loads the window from the answers to :meth:`_registration_ranges` (read at
        ``revision``); returns the revision the view holds, or None when they did not settle
        the window (a window that wraps around the end of the ring, in a job too large for
        the ranges). Where the predecessors come from the span read without values, their
        values and the successors' are read in one more transaction of ``2k`` keys, which
        also counts the keys between the window's ends: the window is loaded only if it
        still holds exactly those keys then."""
        k = self._window_k
        try:
            lists = [[_kv_of(raw) for raw in a.get("kvs") or []] for a in answers]
            counts = [int(a.get("count", 0)) for a in answers]
        except Exception as exc:
            logger.warning("the read of the node keys was unusable: %s", exc)
            return None
        if len(lists) < 2:
            return None
        (after, before), (n_after, n_before) = lists[:2], counts[:2]
        if n_after + n_before <= 2 * k:  # a small job: every key is in the two lists
            self._load_view(after + before, (True, "", ""))
            return revision
        successors = (after + before)[:k]
        predecessors: list[KeyValue] | None = None
        keys_only = False
        for at, (span, n) in enumerate(zip(lists[2:], counts[2:], strict=True), start=2):
            if n >= k:
                if n == len(span):  # the whole span: its last k are the nearest before
                    predecessors = span[-k:][::-1]
                    keys_only = at == 3  # the wider span: read without values
                break
        if predecessors is None and n_before < k and n_after == len(after):
            # Near the start of the ring: the rest wraps around to its end.
            predecessors = (before[::-1] + after[::-1])[:k]
        if predecessors is None or len(successors) < k or len(predecessors) < k:
            return None
        n = len(self._prefix)
        window = (False, predecessors[-1].key[n:].decode(), successors[-1].key[n:].decode())
        if not keys_only:
            self._load_view(successors + predecessors, window)
            return revision
        return self._read_window_keys([kv.key for kv in successors + predecessors], window)

    def _read_window_keys(self, keys: list[bytes], window: tuple[bool, str, str]) -> int | None:
        """Reads ``keys`` (the window's, from its ends ``window``) and loads them, if the window
        holds exactly them and this machine's key now (one transaction: the keys, and a count
        of the range between the window's ends); the read's revision, or None (etcd did not
        answer, the window changed meanwhile, or it wraps around the end of the ring)."""
        _, lo, hi = window
        own = self._record.node_id
        if not lo < own < hi:
            return None
        first, last = (self._prefix + lo).encode(), (self._prefix + hi).encode() + b"\x00"
        b64 = base64.b64encode
        ops: list[dict[str, Any]] = [
            {"request_range": {"key": b64(key).decode("ascii")}} for key in keys
        ]
        ops.append(
            {
                "request_range": {
                    "key": b64(first).decode("ascii"),
                    "range_end": b64(last).decode("ascii"),
                    "count_only": True,
                }
            }
        )
        self.window_requests += 1
        try:
            response = self._client._call(
                "/v3/kv/txn", {"success": ops}, timeout=None, idempotent=True
            )
            answers = [r.get("response_range", {}) for r in response.get("responses") or []]
            revision = int(response.get("header", {}).get("revision", 0))
            found = [_kv_of(a["kvs"][0]) for a in answers[:-1] if a.get("kvs")]
            between = int(answers[-1].get("count", 0)) if len(answers) == len(ops) else -1
        except Exception as exc:
            logger.warning("reading the job's node keys failed (will retry): %s", exc)
            return None
        if len(found) != len(keys) or between != len(keys) + 1:
            return None  # one went or came meanwhile: read the window again
        self._load_view(found, window)
        return revision

    def _take_window(self, answers: list[dict[str, Any]]) -> None:
        """Loads the answers to :meth:`_window_ranges` into the view."""
        k = self._window_k
        if len(answers) != 4:
            raise EtcdError(f"etcd answered {len(answers)} of 4 ranges")
        lists = [[_kv_of(raw) for raw in a.get("kvs") or []] for a in answers]
        others = int(answers[0].get("count", 0)) + int(answers[1].get("count", 0))
        if others <= 2 * k:
            # A small job: every key is in the four lists (k from each end of each side).
            kvs = list({kv.key: kv for kv in itertools.chain(*lists)}.values())
            window: tuple[bool, str, str] = (True, "", "")
        else:
            successors, predecessors = (lists[0] + lists[1])[:k], (lists[2] + lists[3])[:k]
            kvs = successors + predecessors
            n = len(self._prefix)
            window = (False, predecessors[-1].key[n:].decode(), successors[-1].key[n:].decode())
        self._load_view(kvs, window)

    def _move_window(self) -> bool | None:
        """After changes were applied: whether the window narrowed to nearer neighbours (a
        machine registered inside it: from the view alone, which holds every key in it), or
        None when it must be read again (it holds fewer than ``k`` on a side: a neighbour
        went). The peers left outside are dropped from the view (their own neighbours watch
        them)."""
        k = self._window_k
        with self._lock:
            order = sorted(self._peers, key=self._ring_key)
            if self._whole:
                if len(order) <= 2 * k + 2:  # a margin: no back and forth at the threshold
                    return False
                successors, predecessors = order[:k], order[-k:]
            else:
                successors = [n for n in order if self._on_successor_side(n)]
                predecessors = [n for n in order if not self._on_successor_side(n)]
                if len(successors) < k or len(predecessors) < k:
                    return None
                successors, predecessors = successors[:k], predecessors[-k:]
                if (predecessors[0], successors[-1]) == (self._lo, self._hi):
                    return False
            self._whole, self._lo, self._hi = False, predecessors[0], successors[-1]
            keep = set(successors) | set(predecessors)
            self._peers = {n: r for n, r in self._peers.items() if n in keep}
            self.window_moves += 1
        self._update_links()
        return True

    def _quiet_revision(self, revision: int) -> int:
        """The revision a quiet watch can go on from: etcd's current one when the window's keys
        provably did not change since ``revision`` (as many keys as the view holds, none
        written after it: a delete lowers the count, a put or a re-creation is newer), else
        ``revision``. A watch that stayed on an old revision while the rest of the job moved
        etcd's revision on would find its history compacted, and read its keys again; this
        costs one small transaction of counts instead."""
        own = self._key
        with self._lock:
            ranges = self._ranges()
        try:
            counted, current = self._client.counts(
                [(a, b, 0) for a, b in ranges]
                + [(a, b, revision + 1) for a, b in ranges]
                + [(own, None, 0)]
            )
        except EtcdError as exc:
            logger.debug("could not check the node keys' revision: %s", exc)
            return revision
        total, newer = sum(counted[: len(ranges)]), sum(counted[len(ranges) : -1])
        with self._lock:
            expected = len(self._peers) + counted[-1]
        if newer == 0 and total == expected and current > revision:
            return current
        return revision

    def _load_view(self, kvs: list[KeyValue], window: tuple[bool, str, str]) -> None:
        """Replaces the view with the window's keys as read; reports the peers of the window
        gone since the last read (none on the first)."""
        self.watch_reads += 1
        current: dict[str, NodeRecord] = {}
        for kv in kvs:
            record = NodeRecord.from_kv(kv)
            node_id = kv.key[len(self._prefix) :].decode(errors="replace")
            if record is not None and record.node_id == node_id != self._record.node_id:
                current[node_id] = record
        with self._lock:
            first = not self._view_loaded
            self._whole, self._lo, self._hi = window
            # A peer that should be in the window and is not is gone; one that is outside it
            # now is no longer a neighbour (its own neighbours watch it). A node id whose token
            # changed was registered again: its old instance is gone.
            vanished = [
                r
                for n, r in self._peers.items()
                if (n not in current and (self._whole or self._in_window(n)))
                or (n in current and current[n].token != r.token)
            ]
            self._peers = current
            self._view_loaded = True
        self._update_links()
        if not first:
            for record in vanished:
                self._report_lost(record, "watch")

    def _in_window(self, node_id: str) -> bool:
        """Whether ``node_id`` is inside the window (the lock held; window mode)."""
        ring = self._ring_key(node_id)
        return ring <= self._ring_key(self._hi) or ring >= self._ring_key(self._lo)

    def _apply_events(self, events: list[WatchEvent]) -> bool:
        """Applies watched changes of node keys to the view; reports deleted peers. Returns
        whether the window's peers changed (one came, went, or was registered again, or its
        probe port moved): only then can the window or the links change. A peer's new state
        (``waiting``, ``active``: every machine writes both at each restart, and each write
        reaches the ``2k`` machines watching it) changes neither, and costs no more."""
        own = self._record.node_id
        lost: list[NodeRecord] = []
        changed = False
        with self._lock:
            for event in events:
                node_id = event.kv.key[len(self._prefix) :].decode(errors="replace")
                if node_id == own:
                    continue
                if event.deleted:
                    # The view holds the key as last written (the watch carries no previous
                    # values, see _watch_loop); a peer already reported and dropped (found dead
                    # here) is not reported again.
                    known = self._peers.pop(node_id, None)
                    changed = True
                    if known is not None:
                        lost.append(known)
                    continue
                record = NodeRecord.from_kv(event.kv)
                if record is None:
                    continue
                if record.node_id != node_id:
                    logger.warning(
                        "node key %s holds the record of node %r; ignoring it",
                        event.kv.key.decode(errors="replace"),
                        record.node_id,
                    )
                    continue
                known = self._peers.get(node_id)
                if known is not None and known.token != record.token:
                    lost.append(known)  # registered again: its old instance is gone
                if known is None or known.token != record.token or known.probe != record.probe:
                    changed = True
                self._peers[node_id] = record
        if changed:
            self._update_links()
        for record in lost:
            self._report_lost(record, "watch")
        return changed

    def _compact_loop(self) -> None:
        """Compacts etcd's history once a period, to the revision of one period before, while
        this machine has the lowest node id of the job (one machine, chosen by the watch's
        view without a race that matters: two that both think so compact to about the same
        revision, and compacting twice is harmless)."""
        assert self._compact_every is not None
        period = self._compact_every.total_seconds()
        remembered: int | None = None
        while not self._stop.wait(period):
            with self._lock:
                own = self._record.node_id
                chosen = (
                    self._view_loaded
                    and self._lease is not None
                    and not self._fenced
                    and all(own < n for n in self._peers)
                )
            if not chosen:
                remembered = None
                continue
            try:
                now = self._client.revision()
                if remembered is not None and self._client.compact(remembered):
                    self.compactions += 1
                    logger.debug("compacted etcd's history to revision %d", remembered)
                remembered = now
            except EtcdError as exc:
                logger.info("compacting etcd's history failed (will retry): %s", exc)

    def _update_links(self) -> None:
        """Links the ring successors among the peers the watch sees (and no others)."""
        if self._links is None:
            return
        with self._lock:
            peers = {n: r for n, r in self._peers.items() if r.probe}
            own = self._record.node_id
        self._links.set_targets(
            [
                LinkTarget(n, peers[n].token, peers[n].probe)
                for n in ring_successors(own, peers, self._fanout)
            ]
        )

    def _on_link_broken(self, target: LinkTarget, why: str) -> None:
        """The link thread: a linked peer's launcher may be gone; probe it (from a thread of
        its own: a probe may take seconds, the other links are watched meanwhile)."""
        logger.info("node %s: %s; probing it", target.node_id, why)
        threading.Thread(
            target=self.reap_dead_peers,
            args=({target.node_id},),
            kwargs={"via": "link"},
            name="flashckpt-node-link-probe",
            daemon=True,
        ).start()

    def _report_lost(self, record: NodeRecord, via: str) -> None:
        with self._lock:
            if record.token in self._seen_lost:
                return
            if via == "watch" and record.token in self._reaping:
                return  # found dead here, its lease being revoked: reported by the reaper
            self._reaping.discard(record.token)
            self._seen_lost.add(record.token)
            known = self._peers.get(record.node_id)
            if known is not None and known.token == record.token:
                del self._peers[record.node_id]  # not a newer instance of the same node id
        self._update_links()
        if record.left_done:
            logger.info("node %s left the job, its workers done", record.node_id)
        elif record.state == "leaving":
            logger.warning(
                "node %s left the job before its workers were done (stopped, preempted or "
                "retired): its workers left their round",
                record.node_id,
            )
        else:
            logger.warning("node %s (%s) is gone (%s)", record.node_id, record.state, via)
        if self._on_lost is not None:
            try:
                self._on_lost(record, via)
            except Exception:
                logger.exception("handling the loss of node %s failed", record.node_id)


def _limited_range(
    start: bytes, end: bytes, limit: int, *, descend: bool, keys_only: bool = False
) -> dict[str, Any]:
    """A transaction's read of at most ``limit`` keys of ``[start, end)``, nearest ``start``
    first (``descend``: nearest ``end`` first; ``keys_only``: without their values); its
    ``count`` is every key of the range."""
    request: dict[str, Any] = {
        "key": base64.b64encode(start).decode("ascii"),
        "range_end": base64.b64encode(end).decode("ascii"),
        "limit": str(limit),
    }
    if keys_only:
        request["keys_only"] = True
    if descend:
        request["sort_order"] = "DESCEND"
        request["sort_target"] = "KEY"
    return {"request_range": request}


def _kv_of(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=base64.b64decode(raw.get("key") or ""),
        value=base64.b64decode(raw.get("value") or ""),
        mod_revision=int(raw.get("mod_revision", 0)),
        create_revision=int(raw.get("create_revision", 0)),
        version=int(raw.get("version", 0)),
        lease=int(raw.get("lease", 0)),
    )


def _record_or_none(kv: KeyValue | None) -> NodeRecord | None:
    return NodeRecord.from_kv(kv) if kv is not None else None


def _remaining(deadline: Deadline) -> timedelta:
    return timedelta(seconds=max(0.05, deadline.remaining()))


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

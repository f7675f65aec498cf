"""The state of the node registry: :class:`_NodeState`, the base of its parts (probing,
the ring watch, the lease) and of :class:`~flashckpt.elastic.membership.nodes.NodeRegistry`.
Split out of :mod:`flashckpt.elastic.membership.nodes` (issue 45).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd.client import (
    EtcdClient,
    Lease,
    WatchStream,
)
from flashckpt.elastic.etcd.ops import RangeResult
from flashckpt.elastic.membership.fencing import (
    FenceNotice,
)
from flashckpt.elastic.membership.peerlinks import (
    LinkTarget,
    PeerLinks,
    ring_successors,
)
from flashckpt.elastic.membership.probes import (
    _ProbeServer,
)
from flashckpt.elastic.membership.records import (
    NodeRecord,
    nodes_prefix,
)

logger = logging.getLogger("flashckpt.elastic.membership.nodes")  # its log, as before the split

_WINDOW = 4
"""Peers a machine watches on each side of it in the ring of node ids (at least ``links + 1``):
its node-key watch covers those keys only, so a change costs O(1) watch messages per machine
whatever the job's size, and every machine is watched by this many on each side. The outage
probes ask the watched peers (:data:`_OUTAGE_SAMPLE`, ring successors first)."""


def _remaining(deadline: Deadline) -> timedelta:
    return timedelta(seconds=max(0.05, deadline.remaining()))


class _NodeState:
    """The state of a :class:`~flashckpt.elastic.membership.nodes.NodeRegistry` (built from
    its constructor's arguments, see there) and what every part of it reads: the record, the
    watched peers, the ring order, a peer's loss reported."""

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
        self._registered_window: tuple[list[RangeResult], int] | None = None
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

    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=f"flashckpt-node-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

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

    def _ring_key(self, node_id: str) -> tuple[bool, str]:
        """Sorts node ids in ring order starting after this machine's."""
        return (node_id < self._record.node_id, node_id)

    def _on_successor_side(self, node_id: str) -> bool:
        """Whether ``node_id`` is between this machine and its window's last successor (the
        lock held; window mode)."""
        return self._ring_key(node_id) <= self._ring_key(self._hi)

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

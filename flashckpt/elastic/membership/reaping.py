"""Probing peers: the dead ones found and their keys revoked (:meth:`_Reaping.reap_dead_peers`),
and, while this machine's renewals fail, whether its peers still answer (whether it is cut
off). Split out of
:mod:`flashckpt.elastic.membership.nodes` (issue 45).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

from flashckpt.elastic.etcd.client import (
    EtcdError,
)
from flashckpt.elastic.membership.nodestate import _NodeState
from flashckpt.elastic.membership.peerlinks import (
    ring_successors,
)
from flashckpt.elastic.membership.probes import (
    ProbeResult,
    _probe_patiently,
    peer_etcd_age,
    probe,
)
from flashckpt.elastic.membership.records import (
    NodeRecord,
    _record_or_none,
)

logger = logging.getLogger("flashckpt.elastic.membership.nodes")  # its log, as before the split

"""A node-key watch quiet this long moves its revision on (:meth:`NodeRegistry._quiet_revision`)."""
# Probing the peers while renewals fail: one try each (a cut-off host fails at once with "network
# unreachable", a silent drop times out). In the background after each failed renewal, with a
# loaded host's patience; at the fence deadline, when none answered lately, once more, short.
_OUTAGE_PROBE_TIMEOUT_S = 1.0
_FENCE_PROBE_TIMEOUT_S = 0.25
_OUTAGE_SAMPLE = 8
"""Peers probed at most per round of outage probes (whether this machine is cut off)."""


class _Reaping(_NodeState):
    """The registry's probing of its peers (see
    :class:`~flashckpt.elastic.membership.nodes.NodeRegistry`)."""

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

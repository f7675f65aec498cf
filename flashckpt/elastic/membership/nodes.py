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

import contextlib
import logging
import time
import uuid
from dataclasses import replace
from datetime import timedelta
from typing import Any

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd.client import (
    EtcdError,
    Lease,
    prefix_end,
)
from flashckpt.elastic.etcd.ops import Compare, Put, Range, Txn, TxnResult
from flashckpt.elastic.membership.fencing import (
    FenceNotice,
    fence_deadline,
    lease_expiry,
)
from flashckpt.elastic.membership.leasing import _Leasing
from flashckpt.elastic.membership.nodestate import _remaining
from flashckpt.elastic.membership.peerlinks import (
    PeerLinks,
)
from flashckpt.elastic.membership.probes import (
    ProbeResult,
    _ProbeServer,
    peer_etcd_age,
    probe,
)
from flashckpt.elastic.membership.records import (
    NodeIdInUse,
    NodeRecord,
    nodes_prefix,
)

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


class NodeRegistry(_Leasing):
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
        join: Txn,
    ) -> Txn | None:
        """One etcd transaction that creates the node key (as :meth:`_register` does: if
        absent, on ``lease``) and runs the transaction ``join`` nested in it (the rendezvous'
        join, on the same lease): see ``with_join``
        of :meth:`start`. None when the key needs no creation (registered already, or
        ``lease`` is not this registry's lease now): the caller sends its own transaction.
        Its answer goes to :meth:`fold_answered`."""
        with self._lock:
            if self._unregistered is None or self._lease is None or self._lease.id != lease.id:
                return None
            value = self._record.to_json()
            self._fold_value = value
        return Txn(
            [Compare.modified(self._key, 0)],
            [Put(self._key, value, lease.id), join],
            [Range(self._key)],
        )

    def fold_answered(self, lease: Lease, response: TxnResult | None) -> TxnResult | None:
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
        if response is not None and response.succeeded:
            self._registered(lease, value)
            return response.txn(1)
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

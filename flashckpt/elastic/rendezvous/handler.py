"""A rendezvous whose cost per machine does not grow with the job: torch's ``RendezvousHandler``
implemented directly on etcd v3, with one small key per machine and one small write per round.

torch's ``DynamicRendezvousHandler`` keeps the whole job (participants, wait list, heartbeats) in
one value that every machine rewrites by compare-and-set on each join and heartbeat: O(N) bytes
per write, O(N) collisions per join, N^2 for the job; past a few dozen machines most writes are
retries (``benchmarks/README.md``, issue 31). Here:

Keys (under the job's prefix ``<key_prefix>/<run_id>/rdzv/``; ``<R>`` is a round, 12 digits):

- ``r/<R>/a/<node>``: machine ``<node>`` joined round ``R``. Bound to the machine's lease (the
  launcher's node lease, :meth:`RdzvHandler.share_lease`, renewed every ``lease_ttl / 5``; under
  torchrun a lease of the handler's own, renewed every ``lease_ttl / 3``: the keep-alive is the
  heartbeat, nothing is rewritten), so it disappears with the machine. Value: a small JSON
  object (node, its last group rank and the round of it: its *claim*).
- ``r/<R>/c/lead``: the machine that decides when round ``R`` closes (its *lead*), bound to its
  lease: created if absent by a waiting machine; when the lead dies, another takes over.
- ``r/<R>/c/result``: the round's outcome, written once by the lead in one transaction that
  creates it only if absent: round number, world size and the members in rank order, as the
  ``create_revision`` of their join keys, packed in fixed width (2-3 bytes each; a machine
  finds its rank with one search of the bytes, :class:`PackedMembers`). The packed members go
  in parts of at most :data:`_RESULT_PART_CHARS` (~1,000-1,500 machines): ``c/result`` holds
  the first, ``c/result.1``, ``c/result.2``, ... the others, written in the same transaction,
  so no value is larger than ~3.3 KiB at any size and a waiter receives them together.
- ``r/<R>/c/next-member``, ``r/<R>/c/next-other``: a member of round ``R`` (or another
  machine) joined round ``R + 1``: created by the first such join, inside its transaction (no
  request of its own), on its lease; ``r/<R>/c/next-result``: round ``R + 1`` formed (written
  with its result); ``r/<R>/c/room``: written once by the lead of ``R + 1`` when round ``R``
  was full and lost a member (a machine not of ``R`` now counts as waiting, below). What the
  next round says to the members of ``R`` is one key each, under ``R``'s control keys: their
  watch never follows the next round's N join keys.
- ``round``: the newest closed round. Every join is a transaction that compares this key's
  revision with the one the machine last read, so no machine can join a round that closed
  meanwhile (a stale round number is refused, and the refusal carries the key: the machine joins
  again from it, never joins a world it is not in). A join is one request when the machine's
  knowledge is current (round 1; a member's join of the round after its own).
- ``closed``: the rendezvous is closed (the job finished); on a lease of ``state_ttl``.

A round ``R`` closes when every live member of round ``R - 1`` joined it (a dead member's key
went with its lease, or was deleted by a peer that found it dead: :meth:`expire_nodes`) and
``max_nodes`` machines joined, or ``min_nodes`` did and ``last_call_timeout`` passed since. The
lead follows the joins with one watch (O(1) work per join); the others wait on a watch of the
round's control keys, whose event carries the result (no read).
The lead of ``R`` deletes
the keys of round ``R - 2`` and its store keys, so a job holds at most three rounds of keys at
any time.

Group ranks are stable: a member of the previous round keeps its rank if it is below the new
world size (:func:`flashckpt.elastic.rendezvous.stable_ranks.assign_ranks`); standbys and new
machines take the free ranks (a standby takes a dead machine's rank). Only the lead computes them.

While its workers train, a member answers ``num_nodes_waiting()`` from the watch its wait for
the result followed, which goes on with the ``next-*`` and ``room`` keys of its round, never
from an etcd read and without a watch of its own. A joining member of its round always counts;
another machine counts only while the round has room: it had fewer than ``max_nodes``
members, or its next round's lead said it lost one (``room``; a standby of a full round waits
without restarting anybody, as in torch's redundancy list).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    Lease,
)
from flashckpt.elastic.etcd.ops import Compare, Delete, Op, Put, Range, Txn, TxnResult
from flashckpt.elastic.etcd.watchstream import (
    prefix_end,
)
from flashckpt.elastic.rendezvous.name import BACKEND_NAME
from flashckpt.elastic.rendezvous.result import (
    _MAX_ROUND,
    PackedMembers,
    decode_members,
    encode_members,
)
from flashckpt.elastic.rendezvous.rounds import RoundState
from flashckpt.elastic.rendezvous.settings import DEFAULT_LEASE_TTL, LeaseSource, RdzvSettings

__all__ = [
    "DEFAULT_LEASE_TTL",
    "LeaseSource",
    "PackedMembers",
    "RdzvHandler",
    "RdzvSettings",
    "decode_members",
    "encode_members",
]

logger = logging.getLogger(__name__)


class RdzvHandler(RoundState, RendezvousHandler):
    """torch's ``RendezvousHandler`` on per-machine etcd keys (see the module docstring).

    Args:
        client: The etcd client.
        store: The store handed to torch for each round (under a per-round prefix), usually an
            :class:`flashckpt.elastic.etcd.store.EtcdV3Store` under ``<job>/store/``.
        settings: Sizes, timeouts, lease TTLs.
    """

    def __init__(self, client: EtcdClient, store: dist.Store, settings: RdzvSettings) -> None:
        RoundState.__init__(self, client, store, settings)

    # -------------------------------------------------------------------- torch's interface
    def get_backend(self) -> str:
        """See base class."""
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        """See base class: the workers of each round get a fresh TCPStore."""
        return False

    def get_run_id(self) -> str:
        """See base class."""
        return self._s.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Joins the next round and returns this machine's rank in it (see the module
        docstring).

        Raises:
            RendezvousClosedError: The rendezvous is closed (the job finished).
            RendezvousGracefulExitError: It closed while this machine waited as a standby.
            RendezvousTimeoutError: No round took this machine within ``join_timeout``.
            RendezvousConnectionError: etcd failed beyond the client's retries.
            RendezvousStateError: The job's keys hold something this handler never writes.
        """
        self._stop_member_watch()
        if self._closed:
            raise RendezvousClosedError(f"the rendezvous {self._s.run_id!r} is closed")
        deadline = Deadline.after(self._s.join_timeout)
        self.phases = {"start": time.time()}
        warned = 0.0
        try:
            while True:
                if deadline.expired():
                    raise RendezvousTimeoutError(
                        f"no rendezvous round of job {self._s.run_id!r} took this machine "
                        f"({self._node}) within {self._s.join_timeout.total_seconds():g} s "
                        f"(join_timeout); {self._s.min_nodes} to {self._s.max_nodes} machines "
                        "must join"
                    )
                try:
                    info = self._attempt(deadline)
                except EtcdLeaseNotFound as exc:
                    # The shared lease ended and its owner has not registered again yet (it
                    # does within a renewal interval): wait for it, however far we got.
                    if deadline.expired():
                        raise RendezvousTimeoutError(
                            f"this machine ({self._node}) had no lease to join the rendezvous "
                            f"of job {self._s.run_id!r} with: {exc}"
                        ) from exc
                    logger.info("waiting for this machine's next lease: %s", exc)
                    deadline.sleep(0.2)
                    continue
                except EtcdError as exc:
                    # etcd answered before: an outage (a leader election, a restart) is waited
                    # out until join_timeout; one that never answered is a configuration error.
                    if not self._reached or deadline.expired():
                        raise RendezvousConnectionError(
                            f"the rendezvous of job {self._s.run_id!r} failed to reach etcd at "
                            f"{','.join(self._client.endpoints)}: {exc}"
                        ) from exc
                    if time.monotonic() - warned > 10:
                        warned = time.monotonic()
                        logger.warning("etcd failed during the rendezvous (retrying): %s", exc)
                    deadline.sleep(1.0)
                    continue
                if info is not None:
                    return info
        finally:
            self._waiting_in = None

    def is_closed(self) -> bool:
        """See base class (one etcd read)."""
        if self._closed:
            return True
        try:
            return self._client.get(self._p + "closed") is not None
        except EtcdError as exc:
            raise RendezvousConnectionError(f"cannot read {self._p}closed: {exc}") from exc

    def set_closed(self, *, done: bool = False) -> None:
        """See base class: closes the rendezvous for every machine; deletes the rounds' keys.

        Args:
            done: This machine's workers finished the job: the job-level ``done`` key is
                written in the same transaction (:meth:`finished_done`: a standby that finds
                the rendezvous closed learns from it that it was not needed).
        """
        lease = self._new_state_lease()
        ops: list[Op] = [
            Put(self._p + "closed", json.dumps({"by": self._node}).encode(), lease),
            Delete.prefix(self._p + "r/"),
            Delete(self._p + "round"),
        ]
        if done:
            ops.append(Put(self._p + "done", json.dumps({"by": self._node}).encode(), lease))
        try:
            self._txn([], ops, [])
        except EtcdError as exc:
            raise RendezvousConnectionError(f"could not close the rendezvous: {exc}") from exc
        self._closed = True

    def num_nodes_waiting(self) -> int:
        """See base class: machines waiting to join the next round that it has room for (a
        restarting member of this round always counts). Answered from a watch, no etcd call."""
        watch = self._member_watch
        if watch is None:
            return 0
        if self._lease_lost.is_set():
            return max(1, watch.waiting())  # dropped from its round: the workers restart
        return watch.waiting()

    def finished_done(self, timeout: timedelta | None = None) -> bool:
        """Whether a machine closed the rendezvous with its workers done (the job succeeded):
        one read of the job-level ``done`` key, whatever the size of the job.

        Raises:
            EtcdError: etcd did not answer.
        """
        return self._client.get(self._p + "done", timeout=timeout) is not None

    def shutdown(self, *, done: bool = False) -> bool:
        """See base class: closes the rendezvous (``done``: see :meth:`set_closed`) and gives
        up this machine's keys."""
        try:
            self.set_closed(done=done)
        except RendezvousError as exc:
            logger.warning("could not close the rendezvous %r: %s", self._s.run_id, exc)
            self.leave()
            return False
        self.leave()
        return True

    # -------------------------------------------------------------------- flashckpt's extras
    @property
    def client(self) -> EtcdClient:
        """The etcd client."""
        return self._client

    @contextlib.contextmanager
    def call_timeout(self, timeout: timedelta) -> Iterator[None]:
        """Caps the deadline of this thread's etcd calls of the handler inside the block (the
        launcher's teardown: waiting the client's full ``read_timeout`` helps nobody)."""
        previous = getattr(self._local, "timeout", None)
        self._local.timeout = timeout if previous is None else min(previous, timeout)
        try:
            yield
        finally:
            self._local.timeout = previous

    def note_reachable(self) -> None:
        """Tells the handler that etcd answered (the launcher checked it): from now on an etcd
        failure in ``next_rendezvous`` is an outage, waited out until ``join_timeout``, not a
        configuration error that fails at once."""
        self._reached = True

    @property
    def node(self) -> str:
        """This machine's descriptor in the rendezvous (``addr_pid_n``), as in the keys."""
        return self._node

    @property
    def round_key(self) -> str:
        """The key of the newest closed round: it exists once the job's first round formed."""
        return self._p + "round"

    @property
    def join_timeout(self) -> timedelta:
        """How long ``next_rendezvous`` waits for a round."""
        return self._s.join_timeout

    @property
    def round(self) -> int | None:
        """The round this machine is a member of (``None`` before the first)."""
        return self._round

    @property
    def waiting_in(self) -> int | None:
        """The round this machine waits in right now (inside ``next_rendezvous``), if any."""
        return self._waiting_in

    def members(self) -> frozenset[int]:
        """The members of this machine's round, from its result (no etcd call): the
        ``create_revision`` of each member's join key, which identifies the member in this round
        only (a machine that joins again gets another). Empty before the first round."""
        with self._lock:
            packed, decoded = self._members, self._member_set
        if decoded is None and packed is not None:
            decoded = frozenset(packed.tolist())
            with self._lock:
                if self._members is packed:
                    self._member_set = decoded
        return decoded if decoded is not None else frozenset()

    @property
    def member_id(self) -> int | None:
        """This machine's id among :meth:`members` (its join key's ``create_revision`` in its
        round); ``None`` before the first round. The launcher publishes it in its node record
        (:attr:`~flashckpt.elastic.membership.nodes.NodeRecord.rdzv_member`), so a peer's record
        says whether it was in this machine's round without reading the round's N join keys."""
        with self._lock:
            return self._member_id

    def members_gone(self, timeout: timedelta | None = None) -> int:
        """How many members of this machine's round hold no join key now (dead, found dead, or
        left): one count of the round's join keys, O(1) bytes whatever the size of the round.
        A machine the round did not take holds its key only until it read the result, so
        while one does, a gone member may be missed (never the other way round).

        Raises:
            EtcdError: etcd did not answer.
        """
        with self._lock:
            rnd, world = self._round, len(self._members or ())
        if rnd is None:
            return 0
        with self.call_timeout(timeout) if timeout is not None else contextlib.nullcontext():
            count = Range.prefix(self._rp(rnd) + "a/", count_only=True)
            response = self._txn([], [count], [])
        held = response.count(0)
        return max(0, world - held)

    def participants(self) -> set[str] | None:
        """The descriptors of the members of this machine's round: one etcd read of the round's
        N join keys, keys only (a join key's name is its machine's descriptor, its create
        revision the member id), cached for the round. Not for every machine of a large job
        every round: the launcher identifies members by :meth:`members` and :attr:`member_id`,
        from the result it holds, and its replica ring asks this only when a member's node
        record does not carry its member id yet. ``None`` before the first round or when etcd
        fails."""
        with self._lock:
            if self._participants is not None or self._round is None:
                return self._participants
            rnd = self._round
        members = self.members()
        joins = self._rp(rnd) + "a/"
        try:
            kvs = self._client.get_range(joins, prefix_end(joins), keys_only=True)
        except EtcdError as exc:
            logger.warning("cannot read the members of round %d: %s", rnd, exc)
            return None
        start = len(joins.encode())
        nodes = {
            urllib.parse.unquote(kv.key[start:].decode())
            for kv in kvs
            if kv.create_revision in members
        }
        with self._lock:
            if self._round == rnd:
                self._participants = nodes
        return nodes

    def expire_nodes(self, nodes: Sequence[str]) -> int:
        """Ends the rendezvous lease of machines found dead, as its lapse would: their join
        keys (of every round) and their lead key go at once, and a machine that was wrongly
        found dead joins again with a new lease. Returns how many leases were revoked. Never
        raises for etcd (the leases lapse anyway)."""
        try:
            head = self._txn([], [Range(self._p + "round")], [])
            kvs = head.kvs(0)
            newest = self._parse_round(kvs[0]) if kvs else -1
            keys = [
                self._rp(r) + "a/" + urllib.parse.quote(node, safe="")
                for node in nodes
                for r in (newest, newest + 1)
                if r >= 0
            ]
            found = self._txn([], [Range(k) for k in keys], []) if keys else TxnResult(False, 0)
            leases = {kv.lease for i in range(len(keys)) for kv in found.kvs(i) if kv.lease}
            revoked = 0
            for lease in sorted(leases):
                revoked += int(self._client.revoke_lease(lease, timeout=self._timeout()))
            return revoked
        except (EtcdError, RendezvousStateError) as exc:
            logger.warning("could not drop %s from the rendezvous: %s", list(nodes), exc)
            return 0

    def leave(self) -> None:
        """Gives up this machine's place: its lease (and every key on it) goes. Never raises."""
        self._left = True
        self._wake_waits()
        self._stop_member_watch()
        self._keepalive_stop.set()
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None and self._source is not None:
            # The lease is the machine's (its node key lives on it, and says how it left):
            # only this handler's keys go.
            self._delete_own_keys()
        elif lease is not None:
            try:
                self._client.revoke_lease(lease, timeout=self._timeout() or timedelta(seconds=2))
            except EtcdError as exc:
                logger.info("could not revoke the rendezvous lease (it lapses): %s", exc)

    def share_lease(self, source: LeaseSource) -> bool:
        """Binds this machine's rendezvous keys to ``source``'s lease (the launcher's node
        lease) instead of a lease of the handler's own: one lease and one renewal per machine
        (issue 31). The keys still go with the machine: its node lease lapsing, or being
        revoked by a peer that found it dead, is its rendezvous lease lapsing; the handler
        then joins again with the source's next lease. Call before the first
        ``next_rendezvous``.

        Returns:
            False (nothing shared) when the source's TTL is not this handler's ``lease_ttl``:
            the rendezvous keys keep their own lease and TTL.
        """
        if source.ttl != self._s.lease_ttl:
            logger.info(
                "the rendezvous keeps a lease of its own: its lease_ttl %g s is not the node "
                "lease's %g s",
                self._s.lease_ttl.total_seconds(),
                source.ttl.total_seconds(),
            )
            return False
        with self._lock:
            if self._lease is not None:
                raise RuntimeError("share_lease must be called before the first next_rendezvous")
            self._source = source
        source.on_lease_ended(self._shared_lease_ended)
        return True

    def _shared_lease_ended(self, lease: Lease) -> None:
        """The source's lease ended: a wait in ``next_rendezvous`` joins again, and a member
        counts as waiting (its workers restart), as when a lease of its own lapses."""
        with self._lock:
            current = self._lease
        if current is None or current.id != lease.id:
            return
        logger.warning(
            "this machine's lease is gone (it lapsed, or a peer found this machine dead); it "
            "joins the rendezvous again with its next one"
        )
        self._lease_lost.set()
        self._wake_waits()

    def _delete_own_keys(self) -> None:
        """Deletes this machine's join keys of the rounds it may be in, and the lead key of
        such a round while it holds it (a shared lease is not revoked on leave)."""
        rounds = {self._round, self._waiting_in, self._known[0], self._known[0] + 1}
        ops: list[Op] = []
        for rnd in sorted(r for r in rounds if r is not None and 0 <= r <= _MAX_ROUND):
            ops.append(Delete(self._rp(rnd) + "a/" + self._qnode))
            lead = self._rp(rnd) + "c/lead"
            ops.append(
                Txn(compare=[Compare.value_is(lead, self._node.encode())], success=[Delete(lead)])
            )
        try:
            self._txn([], ops, [])
        except EtcdError as exc:
            logger.info("could not delete this machine's rendezvous keys (they lapse): %s", exc)

    def suspend(self) -> None:
        """Stops renewing this machine's lease (a fenced machine: its keys lapse with it); the
        next ``next_rendezvous`` takes a new lease."""
        self._stop_member_watch()
        self._keepalive_stop.set()
        with self._lock:
            self._lease = None
        self._lease_lost.set()  # a wait in next_rendezvous joins again, with a new lease
        self._wake_waits()


# ------------------------------------------------------------------------------ creation
def settings_from_params(params: RendezvousParameters, job_prefix: str) -> RdzvSettings:
    """The handler's settings from torchrun's rendezvous parameters.

    +-------------------+--------------------------------------------------------------+
    | join_timeout      | Seconds ``next_rendezvous`` waits for a round (600).         |
    | last_call_timeout | Seconds a round waits for more machines once ``min_nodes``   |
    |                   | joined (30).                                                 |
    | lease_ttl         | Seconds after its last renewal a dead machine's keys go (10; |
    |                   | torch's keep_alive_interval x keep_alive_max_attempt when    |
    |                   | those are given instead).                                    |
    | state_ttl         | Seconds the round keys outlive the job's last round; 0:      |
    |                   | forever (7200).                                              |
    +-------------------+--------------------------------------------------------------+

    Raises:
        ValueError: If a parameter is invalid; the message names it.
    """

    def seconds(name: str, default: float, minimum: float) -> float:
        raw = params.get(name, default)
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"rendezvous option {name} must be a number, got {raw!r}") from None
        if value < minimum:
            raise ValueError(f"rendezvous option {name} must be >= {minimum:g}, got {raw!r}")
        return value

    state_ttl = seconds("state_ttl", 7200, 0)
    lease_default = DEFAULT_LEASE_TTL.total_seconds()
    if params.get("lease_ttl") is None and params.get("keep_alive_interval") is not None:
        # torch's own options: a machine is dead after keep_alive_max_attempt missed beats.
        interval = seconds("keep_alive_interval", 5, 0.1)
        attempts = seconds("keep_alive_max_attempt", 3, 1)
        lease_default = max(2.0, interval * attempts)
    return RdzvSettings(
        run_id=params.run_id,
        job_prefix=job_prefix,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        join_timeout=timedelta(seconds=seconds("join_timeout", 600, 1)),
        last_call_timeout=timedelta(seconds=seconds("last_call_timeout", 30, 0)),
        lease_ttl=timedelta(seconds=seconds("lease_ttl", lease_default, 2)),
        state_ttl=timedelta(seconds=state_ttl) if state_ttl else None,
        local_addr=params.local_addr,
    )

"""The node key's lease: the registration, the renewals, fencing when they fail for too long,
the record's updates on the lease. Split out of
:mod:`flashckpt.elastic.membership.nodes` (issue 45).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd.client import (
    EtcdError,
    EtcdLeaseNotFound,
    EtcdOutcomeUnknown,
    Lease,
)
from flashckpt.elastic.etcd.ops import Compare, Put, Range, RangeResult, Txn
from flashckpt.elastic.membership.fencing import (
    FenceNotice,
    _renew_retry_delay,
    fence_deadline,
    lease_expiry,
)
from flashckpt.elastic.membership.nodestate import _remaining
from flashckpt.elastic.membership.probes import (
    ProbeResult,
    probe,
)
from flashckpt.elastic.membership.reaping import (
    _FENCE_PROBE_TIMEOUT_S,
)
from flashckpt.elastic.membership.records import (
    NodeIdInUse,
    NodeRecord,
)
from flashckpt.elastic.membership.ringwatch import (
    _RingWatch,
)

logger = logging.getLogger("flashckpt.elastic.membership.nodes")  # its log, as before the split


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


class _Leasing(_RingWatch):
    """The registry's lease and fencing (see
    :class:`~flashckpt.elastic.membership.nodes.NodeRegistry`)."""

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
            own = Range(self._key)
            window = self._registration_ranges() if read_window else []
            extra = [Range(read_key)] if read_key is not None else []
            txn = Txn(
                [Compare.modified(self._key, 0)],
                [Put(self._key, value, lease.id), own, *window, *extra],
                [own],
            )
            answers: list[RangeResult] | None = None
            exists = False
            try:
                result = self._client.txn(txn, timeout=_remaining(deadline), idempotent=False)
                done = result.succeeded
                found = result.kvs(1 if done else 0)
                current = found[0] if found else None
                if done and window:
                    got = min(len(result), 2 + len(window))
                    answers = [result.range(i) for i in range(2, got)]
                    revision = result.revision
                if done and extra:
                    exists = bool(result.kvs(len(result) - 1))
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

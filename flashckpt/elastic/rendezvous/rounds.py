"""The round logic of the rendezvous: :class:`RoundState`, the handler's state and what it does
with it (join, wait, lead, close, take the result). Split out of
:mod:`flashckpt.elastic.rendezvous.handler` (issue 45).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.utils.distributed import get_free_port

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdOutcomeUnknown,
    KeyValue,
    Lease,
)
from flashckpt.elastic.etcd.ops import Compare, Delete, Op, Put, Range, Txn, TxnResult
from flashckpt.elastic.etcd.watchstream import (
    WatchClosed,
    WatchCompacted,
    WatchEvent,
    WatchStream,
    prefix_end,
)
from flashckpt.elastic.rendezvous.memberwatch import (
    _NEXT_KEYS,
    _NEXT_MEMBER,
    _NEXT_OTHER,
    _NEXT_RESULT,
    _ROOM,
    _MemberWatch,
)
from flashckpt.elastic.rendezvous.result import (
    _JOIN_VERSION,
    _MAX_RESULT_PARTS,
    _MAX_ROUND,
    _RESULT_PART_CHARS,
    _RESULT_VERSION,
    PackedMembers,
    _decode_join,
    _decode_result,
    _digest,
    _Join,
    _result_kvs,
    encode_members,
)
from flashckpt.elastic.rendezvous.settings import LeaseSource, RdzvSettings, _Stats
from flashckpt.elastic.rendezvous.stable_ranks import RankClaim, assign_ranks

logger = logging.getLogger("flashckpt.elastic.rendezvous.handler")  # its log, as before the split

_WAIT_SLICE_S = 30.0  # a waiter re-checks its lease at least this often
_QUIET_READ_S = 30.0  # a waiter reads its round's control keys after a watch this quiet
_node_ids = itertools.count()


class RoundState:
    """The state of :class:`~flashckpt.elastic.rendezvous.handler.RdzvHandler` (this machine's
    round, its lease, its waits) and the round logic on it: one attempt to join a round, the
    wait for its result, the lead that closes it, the result taken (see the handler module's
    docstring). The handler is this state with torch's ``RendezvousHandler`` face."""

    def __init__(self, client: EtcdClient, store: dist.Store, settings: RdzvSettings) -> None:
        self._client = client
        self._store = store
        self._s = settings
        self._addr = settings.local_addr or socket.getfqdn()
        self._node = f"{self._addr}_{os.getpid()}_{next(_node_ids)}"
        self._qnode = urllib.parse.quote(self._node, safe="")
        self._p = settings.job_prefix + "rdzv/"
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._source: LeaseSource | None = None  # the lease's owner, when shared
        self._keepalive: threading.Thread | None = None
        self._keepalive_stop = threading.Event()
        self._lease_lost = threading.Event()
        self._closed = False
        self._left = False
        # The round this machine is a member of, and what it knows of it.
        self._round: int | None = None
        self._rank: int | None = None
        self._standby_said = -1  # the round this machine last said it stands by in
        self._members: PackedMembers | None = None
        self._member_set: frozenset[int] | None = None  # members(), decoded once asked
        self._member_id: int | None = None
        self._result_rev = 0
        self._round_lease = 0  # the lease of the round and result keys (state_ttl)
        self._claim: RankClaim | None = None
        self._participants: set[str] | None = None
        self._waiting = 0
        self._member_watch: _MemberWatch | None = None
        self._waiting_in: int | None = None  # the round this machine waits in, if any
        self._local = threading.local()
        self._reached = False  # etcd answered this handler once
        self._streams: set[WatchStream] = set()  # the watches next_rendezvous waits on
        self.phases: dict[str, float] = {}
        """Wall-clock times (``time.time()``) of the last ``next_rendezvous``: ``start``,
        ``joined`` (its join transaction answered), ``result`` (it read the round's result),
        ``done`` (rank 0's ``MASTER_ADDR``/``MASTER_PORT`` read): for the scale benchmark."""
        self._newest_seen = -1  # the newest closed round this machine read
        # The newest closed round this machine knows of: (round, the round key's mod_revision,
        # its lease); (-1, 0, 0): none. A join compares it (see _attempt).
        self._known: tuple[int, int, int] = (-1, 0, 0)
        self._joined = False  # joined a round since it was last admitted to one
        # The round this machine joined and has not read the result of yet, and its join key's
        # create_revision (how a result names it): (-1, 0) when none.
        self._pending: tuple[int, int] = (-1, 0)
        self.stats = _Stats()
        self.on_waiting: Callable[[int], None] | None = None
        """Called (from ``next_rendezvous``' thread, exceptions logged) with the round this
        machine starts to wait in when that is not the job's first round (a standby, or a
        member joining again): the launcher starts its peers' watch then, if not yet (a machine
        forming the first round starts it once it has its rank)."""

    def _timeout(self) -> timedelta | None:
        timeout: timedelta | None = getattr(self._local, "timeout", None)
        return timeout

    # -------------------------------------------------------------------- one attempt
    def _rp(self, rnd: int) -> str:
        return f"{self._p}r/{rnd:012d}/"

    def _check_left(self) -> None:
        if self._left:
            raise RendezvousClosedError(
                f"this machine ({self._node}) left the rendezvous {self._s.run_id!r}"
            )

    def _attempt(self, deadline: Deadline) -> RendezvousInfo | None:
        """One join: a single transaction on the round this machine believes is the newest
        closed one (``_known``: none at first, then the last result it read). Its compare
        (the round key's revision, no ``closed`` key) refuses a stale belief, and the refusal
        carries the round key and ``closed``: the next attempt joins from them. A round-1 join,
        or a member's join of the round after its own, is one request. A machine that joined
        this round before and stopped waiting (an etcd error, its lease lapsed) also gets the
        round's result in the refusal, and takes its rank from it if the round took it."""
        self._check_left()
        lease = self._ensure_lease()
        newest, round_rev, round_lease = self._known
        self._round_lease = round_lease
        rnd = newest + 1
        if rnd > _MAX_ROUND:
            raise RendezvousStateError(f"the rendezvous ran out of round numbers ({rnd})")
        join_key = self._rp(rnd) + "a/" + self._qnode
        claim = self._claim
        value = json.dumps(
            {
                "v": _JOIN_VERSION,
                "node": self._node,
                "claim": [claim.round, claim.rank] if claim else None,
                # Should it be rank 0: where the workers meet (torch's RendezvousStoreInfo
                # picks a free port on rank 0's host the same way). In the result, so nobody
                # waits for rank 0 to publish it in the store.
                "master": [self._addr, get_free_port()],
            },
            separators=(",", ":"),
        ).encode()
        compare = [
            Compare.modified(self._p + "round", round_rev),
            Compare.created(self._p + "closed", 0),
        ]
        lead_key = self._rp(rnd) + "c/lead"
        success: list[Op] = [
            Put(join_key, value, lease.id),
            Range(join_key),
            # The first machine to join leads the round: decided in the same transaction (a
            # nested one), so nobody races for it.
            Txn(
                compare=[Compare.created(lead_key, 0)],
                success=[Put(lead_key, self._node.encode(), lease.id)],
            ),
            Range.prefix(self._rp(rnd) + "c/"),
        ]
        if rnd >= 1:
            # Tells the previous round's members that one of them (or another machine) joined
            # this round: one key of theirs, created by the first such join (_NEXT_KEYS).
            member = claim is not None and claim.round == rnd - 1
            marker = self._rp(rnd - 1) + "c/" + (_NEXT_MEMBER if member else _NEXT_OTHER)
            success.append(
                Txn(
                    compare=[Compare.created(marker, 0)],
                    success=[Put(marker, self._node.encode(), lease.id)],
                )
            )
        failure: list[Op] = [Range(self._p + "round"), Range(self._p + "closed")]
        pending_round, pending_create = self._pending
        if pending_round == rnd:
            # This machine joined round rnd before and stopped waiting for its result (an etcd
            # error, its lease lost): if rnd closed meanwhile, the refusal carries the result,
            # which may name this machine (see below).
            failure.append(Range.prefix(self._rp(rnd) + "c/result"))
        try:
            found = self._join_txn(lease, compare, success, failure, write=len(value))
        except EtcdLeaseNotFound:
            self._lease_failed(lease)
            return None
        except EtcdOutcomeUnknown:
            return None  # again: the join is a put, repeating it is harmless
        self._reached = True
        if found is None:
            return None  # the node key's registration was settled apart from it: join again
        response = found
        if not response.succeeded:
            # A round closed meanwhile, or this machine's belief was stale, or the job closed:
            # the refusal says which; join again from what it read.
            if response.kvs(1):
                self._raise_closed()
            round_kvs = response.kvs(0)
            if round_kvs:
                kv = round_kvs[0]
                self._known = (self._parse_round(kv), kv.mod_revision, kv.lease)
            else:
                self._known = (-1, 0, 0)
            self._newest_seen = max(self._newest_seen, self._known[0])
            result_kvs = response.kvs(2) if pending_round == rnd else []
            if result_kvs and self._known[0] == rnd:
                # The round this machine joined closed while it was not waiting, and it is still
                # the newest: its result decides. A member takes its rank (joining the next
                # round instead would leave its group waiting for it forever, issue 31); a
                # machine the round did not take stands by for the next one.
                return self._take_result(rnd, result_kvs, pending_create)
            return None
        self._newest_seen = max(self._newest_seen, newest)
        mine = response.kvs(1)
        if not mine:
            return None
        my_create = mine[0].create_revision
        self._pending = (rnd, my_create)
        ctl = {kv.key.decode().rsplit("/", 1)[-1]: kv for kv in response.kvs(3)}
        self._waiting_in = rnd
        self._joined = True
        self.phases["joined"] = time.time()
        if rnd > 0 and self.on_waiting is not None:
            try:
                self.on_waiting(rnd)
            except Exception:
                logger.exception("the rendezvous' on_waiting callback failed")
        if rnd > 0 and self._rank is None and self._standby_said != rnd:
            # Never a member of this job: a standby (or a machine joining a running job). Said
            # once per round it waits in, at info level, so its log says what it is doing.
            self._standby_said = rnd
            logger.info(
                "standby: job %r runs without this machine (%s); it waits in round %d and joins "
                "when the job takes it (a machine leaves or fails, or the round has room)",
                self._s.run_id,
                self._node,
                rnd,
            )
        logger.debug("joined round %d as %s (revision %d)", rnd, self._node, my_create)
        return self._wait_round(rnd, round_rev, my_create, response.revision, ctl, deadline)

    def _wait_round(
        self,
        rnd: int,
        round_rev: int,
        my_create: int,
        rev: int,
        ctl: dict[str, KeyValue],
        deadline: Deadline,
    ) -> RendezvousInfo | None:
        """Waits for round ``rnd``'s result (or leads the round), from the control keys as read
        at ``rev``. One watch of the control keys follows them for the whole wait: a quiet slice
        changes nothing (no read, no new watch), a change comes with the event and is applied as
        it is; the keys are read again only when the lead went (every waiter races for it), the
        watch ended (closed, compacted, failed) or stayed quiet for ``_QUIET_READ_S``."""
        ctl_prefix = self._rp(rnd) + "c/"
        watch: WatchStream | None = None
        quiet_since = time.monotonic()
        try:
            while True:
                if "result" in ctl:
                    handed, watch = watch, None
                    if handed is not None:
                        with self._lock:
                            self._streams.discard(handed)
                    # What the next round said so far (the member watch goes on with the
                    # stream, from after it).
                    said = [WatchEvent(False, kv, None) for n, kv in ctl.items() if n in _NEXT_KEYS]
                    return self._take_result(
                        rnd, _result_kvs(list(ctl.values())), my_create, handed=handed, pending=said
                    )
                mine = "lead" in ctl and ctl["lead"].value == self._node.encode()
                read = True
                if "lead" not in ctl and not mine:
                    # The lead died (the first joiner leads, chosen in its join): every waiter
                    # sees it at once. Each first waits a moment for another to take over, so
                    # that not all of them race for it.
                    self._drop_watch(watch)
                    watch = None
                    self._wait_ctl_once(
                        ctl_prefix, rev, min(deadline.remaining(), random.random() * 0.3)
                    )
                    self._check_left()
                    if self._lease_lost.is_set() or deadline.expired():
                        return None
                    response = self._read_ctl(ctl_prefix)
                    rev = response.revision
                    ctl = {kv.key.decode().rsplit("/", 1)[-1]: kv for kv in response.kvs(0)}
                    if "result" in ctl or "lead" in ctl:
                        continue
                if "lead" not in ctl or mine:
                    self._drop_watch(watch)
                    watch = None
                    if self._try_lead(rnd, round_rev, ctl.get("lead")):
                        result = self._lead(rnd, round_rev, deadline)
                        if result is not None:
                            return self._take_result(rnd, result, my_create)
                    # Lost the race, or stopped leading: read what is there now.
                elif deadline.expired():
                    return None
                else:
                    if watch is None:
                        watch = self._open_ctl_watch(ctl_prefix, rev)
                    events = self._wait_ctl(
                        watch,
                        min(deadline.remaining(), _WAIT_SLICE_S, self._lease_ttl_s()),
                    )
                    if events:
                        quiet_since = time.monotonic()
                    if events is not None and time.monotonic() - quiet_since < _QUIET_READ_S:
                        # The watch carries every change, the result itself included: no read
                        # (one request less for every waiter of the round, and none per slice).
                        for ev in events:
                            name = ev.kv.key.decode(errors="replace").rsplit("/", 1)[-1]
                            if ev.deleted:
                                if name not in _NEXT_KEYS:  # what they said stays said
                                    ctl.pop(name, None)
                            else:
                                ctl[name] = ev.kv
                        rev = max(rev, watch.next_revision - 1)
                        read = False
                    else:
                        # The watch ended (closed, compacted, failed), or stayed quiet for
                        # _QUIET_READ_S: read the keys, and watch again from that read.
                        self._drop_watch(watch)
                        watch = None
                        quiet_since = time.monotonic()
                self._check_left()
                if self._lease_lost.is_set() or deadline.expired():
                    return None
                if not read:
                    continue
                response = self._read_ctl(ctl_prefix)
                rev = response.revision
                ctl = {kv.key.decode().rsplit("/", 1)[-1]: kv for kv in response.kvs(0)}
        finally:
            self._drop_watch(watch)

    def _read_ctl(self, ctl_prefix: str) -> TxnResult:
        """The round's control keys; raises if the rendezvous closed."""
        response = self._txn([], [Range.prefix(ctl_prefix), Range(self._p + "closed")], [])
        if response.kvs(1):
            self._raise_closed()
        return response

    def _open_ctl_watch(self, ctl_prefix: str, rev: int) -> WatchStream:
        """A watch of the round's control keys after ``rev`` (the next round's say among them:
        :data:`_NEXT_KEYS`), closed by :meth:`_wake_waits`."""
        key = ctl_prefix.encode()
        stream = WatchStream(self._client, key, prefix_end(key), rev + 1)
        with self._lock:
            self._streams.add(stream)
        with self.stats.lock:
            self.stats.wait_watches += 1
        return stream

    def _drop_watch(self, stream: WatchStream | None) -> None:
        """Closes ``stream``, if any."""
        if stream is not None:
            with self._lock:
                self._streams.discard(stream)
            stream.close()

    def _wait_ctl(self, stream: WatchStream, seconds: float) -> list[WatchEvent] | None:
        """The changes of the round's control keys on ``stream`` within ``seconds`` (``[]``:
        none, or this machine's lease was lost or it left: the caller checks); None when the
        stream ended (closed by :meth:`_wake_waits`, compacted, failed): read the keys again."""
        if self._lease_lost.is_set() or self._left:
            return []
        if seconds <= 0:
            return []
        with self.stats.lock:
            self.stats.waits += 1
        try:
            return stream.next_events(timedelta(seconds=seconds))
        except (WatchClosed, WatchCompacted):
            return None
        except EtcdError as exc:
            logger.debug("watching the round's control keys failed (reading them): %s", exc)
            return None

    def _wait_ctl_once(self, ctl_prefix: str, rev: int, seconds: float) -> None:
        """Waits for a change of the round's control keys after ``rev``, at most ``seconds``;
        woken at once when this machine's lease is lost or it leaves."""
        if seconds <= 0:
            return
        stream = self._open_ctl_watch(ctl_prefix, rev)
        try:
            self._wait_ctl(stream, seconds)
        finally:
            self._drop_watch(stream)

    def _wake_waits(self) -> None:
        """Ends this machine's watches in ``next_rendezvous`` (its lease is gone, or it left)."""
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.close()

    def _try_lead(self, rnd: int, round_rev: int, current: KeyValue | None) -> bool:
        lease = self._lease
        if lease is None:
            return False
        lead_key = self._rp(rnd) + "c/lead"
        if current is not None:
            return current.lease == lease.id  # ours already (after a broken watch)
        compare = [Compare.created(lead_key, 0), Compare.modified(self._p + "round", round_rev)]
        try:
            response = self._txn(compare, [Put(lead_key, self._node.encode(), lease.id)], [])
        except EtcdOutcomeUnknown:
            kv = self._client.get_kv(lead_key)
            return kv is not None and kv.lease == lease.id
        except EtcdLeaseNotFound:
            self._lease_failed(lease)
            return False
        return response.succeeded

    # -------------------------------------------------------------------- the lead
    def _lead(self, rnd: int, round_rev: int, deadline: Deadline) -> list[KeyValue] | None:
        """Follows the joins of round ``rnd`` and closes it; returns its result's keys, or ``None``
        when this machine stopped leading (its lease ended, its watch fell too far behind)."""
        prev, cur = self._rp(rnd - 1), self._rp(rnd)
        ops = [
            Range.prefix(prev + "c/result"),
            # The previous round's joins: their keys name their machines (no values: N of
            # them, ~150 bytes each, for nothing).
            Range.prefix(prev + "a/", keys_only=True),
            Range.prefix(cur + "a/"),
            Range.prefix(cur + "c/"),
            Range(prev + "c/" + _ROOM),
        ]
        snap = self._txn([], ops, [])
        ctl = {kv.key.decode().rsplit("/", 1)[-1]: kv for kv in snap.kvs(3)}
        if "result" in ctl:
            return _result_kvs(snap.kvs(3))
        lead_kv = ctl.get("lead")
        if lead_kv is None or self._lease is None or lead_kv.lease != self._lease.id:
            return None
        prev_members: set[int] = set()
        if rnd > 0:
            prev_result = snap.kvs(0)
            if prev_result:
                prev_members = set(_decode_result(prev_result, rnd - 1)[0].members.tolist())
        alive_prev: dict[bytes, str] = {}
        prev_a = (prev + "a/").encode()
        for kv in snap.kvs(1):
            if kv.create_revision in prev_members and kv.key.startswith(prev_a):
                alive_prev[kv.key] = urllib.parse.unquote(kv.key[len(prev_a) :].decode())
        joins: dict[bytes, _Join] = {}
        for kv in snap.kvs(2):
            j = _decode_join(kv)
            if j is not None:
                joins[kv.key] = j
        cur_a = (cur + "a/").encode()
        lead_key, result_key = (cur + "c/lead").encode(), (cur + "c/result").encode()
        # No previous values: a deleted key is all the lead needs to know.
        stream = WatchStream(self._client, prev_a, prefix_end(cur.encode()), snap.revision + 1)
        with self._lock:
            self._streams.add(stream)
        last_call_at: float | None = None
        # The previous round was full: once it lost a member, machines not of it count as
        # waiting for its members (_MemberWatch); said once, in r/<rnd - 1>/c/room.
        room_said = bool(snap.kvs(4)) or len(prev_members) < self._s.max_nodes
        logger.info(
            "leading round %d: %d joined, %d live members of round %d", rnd, len(joins),
            len(alive_prev), rnd - 1,
        )  # fmt: skip
        try:
            while True:
                if not room_said and len(alive_prev) < len(prev_members):
                    room_said = self._say_room(prev, len(prev_members) - len(alive_prev))
                joined_nodes = {j.node for j in joins.values()}
                ready = all(node in joined_nodes for node in alive_prev.values())
                n = len(joins)
                now = time.monotonic()
                if n < self._s.min_nodes:
                    last_call_at = None
                close = False
                if ready and n >= self._s.max_nodes:
                    close = True
                elif ready and n >= self._s.min_nodes:
                    if last_call_at is None:
                        last_call_at = now + self._s.last_call_timeout.total_seconds()
                    close = now >= last_call_at
                if close:
                    result = self._close_round(rnd, round_rev, joins, set(alive_prev.values()))
                    if result is not None:
                        return result
                    return None
                if deadline.expired() or self._lease_lost.is_set() or self._left:
                    return None
                wait = min(deadline.remaining(), self._lease_ttl_s())
                if last_call_at is not None and ready:
                    wait = min(wait, max(0.0, last_call_at - now))
                try:
                    events = stream.next_events(timedelta(seconds=wait))
                except (WatchCompacted, WatchClosed):
                    return None  # read everything again (or the lease is gone: join again)
                for ev in events:
                    key = ev.kv.key
                    if key.startswith(prev_a):
                        if ev.deleted:
                            alive_prev.pop(key, None)
                    elif key.startswith(cur_a):
                        if ev.deleted:
                            joins.pop(key, None)
                        else:
                            j = _decode_join(ev.kv)
                            if j is not None:
                                joins[key] = j
                    elif key == lead_key and (ev.deleted or ev.kv.lease != self._lease_id()):
                        logger.info("no longer leading round %d (its lead key went)", rnd)
                        return None
                    elif key == result_key and not ev.deleted:
                        # Another machine closed it: its parts are in the same revision.
                        return _result_kvs(self._client.get_prefix(result_key.decode()))
        finally:
            with self._lock:
                self._streams.discard(stream)
            stream.close()

    def _say_room(self, prev: str, gone: int) -> bool:
        """Writes the previous round's room key (see :data:`_ROOM`) on this lead's lease;
        whether it was written (else it is tried again at the lead's next wake-up)."""
        lease = self._lease
        if lease is None:
            return False
        try:
            self._client.put(prev + "c/" + _ROOM, str(gone).encode(), lease=lease)
        except EtcdError as exc:
            logger.info("could not tell the members that their round lost one: %s", exc)
            return False
        return True

    def _close_round(
        self, rnd: int, round_rev: int, joins: dict[bytes, _Join], survivors: set[str]
    ) -> list[KeyValue] | None:
        # Members: the live members of the previous round (all joined), then the others in
        # the order they joined, up to max_nodes.
        order = sorted(
            joins.values(), key=lambda j: (j.node not in survivors, j.create_revision, j.node)
        )
        chosen = order[: self._s.max_nodes]
        nodes = [j.node for j in chosen]
        claims = {j.node: j.claim for j in chosen if j.claim is not None}
        ranks = assign_ranks(nodes, claims)
        by_rank = sorted(chosen, key=lambda j: ranks[j.node])
        members = [j.create_revision for j in by_rank]
        packed = encode_members(members)
        digest = _digest(packed)
        parts = [
            packed[i : i + _RESULT_PART_CHARS] for i in range(0, len(packed), _RESULT_PART_CHARS)
        ]
        parts = parts or [""]
        if len(parts) - 1 > _MAX_RESULT_PARTS:
            raise RendezvousStateError(
                f"a round of {len(members)} machines is more than this rendezvous can write "
                f"({_MAX_RESULT_PARTS + 1} parts of {_RESULT_PART_CHARS} characters)"
            )
        value = json.dumps(
            {
                "v": _RESULT_VERSION,
                "round": rnd,
                "world": len(members),
                "m": parts[0],
                "parts": len(parts) - 1,
                "digest": digest,
                "closer": self._node,
                "master": by_rank[0].master,
            },
            separators=(",", ":"),
        ).encode()
        cur = self._rp(rnd)
        result_key = cur + "c/result"
        state_lease = self._state_lease()
        success: list[Op] = [
            Put(result_key, value, state_lease),
            Put(self._p + "round", str(rnd).encode(), state_lease),
            *(
                Put(f"{result_key}.{i}", part.encode(), state_lease)
                for i, part in enumerate(parts[1:], 1)
            ),
        ]
        read_at = len(success)  # the result as written, its parts included
        success.append(Range.prefix(result_key))
        if rnd >= 1:  # the previous round's members that are not in this one learn it here
            success.append(
                Put(self._rp(rnd - 1) + "c/" + _NEXT_RESULT, str(rnd).encode(), state_lease)
            )
        if rnd >= 2:
            success.append(Delete.prefix(self._rp(rnd - 2)))
            success.append(
                Delete.prefix(
                    f"{self._s.job_prefix}store/torch.rendezvous.{self._s.run_id}.{rnd - 2}/"
                )
            )
        compare = [Compare.created(result_key, 0), Compare.modified(self._p + "round", round_rev)]
        try:
            response = self._txn(
                compare,
                success,
                [Range.prefix(result_key)],
                write=len(value) + sum(len(p) for p in parts[1:]),
                largest=max([len(value), *(len(p) for p in parts[1:])]),
            )
        except EtcdOutcomeUnknown:
            # The answer was lost; whether it was applied or not, the key says: never close
            # twice, never guess.
            return _result_kvs(self._client.get_prefix(result_key)) or None
        kept = sum(1 for j in chosen if j.claim is not None and ranks[j.node] == j.claim.rank)
        if response.succeeded:
            logger.info(
                "closed round %d: %d machines (%d kept their rank, %d standing by), result %s "
                "(%d bytes)",
                rnd,
                len(members),
                kept,
                len(order) - len(chosen),
                digest,
                len(value),
            )
            found = response.kvs(read_at)
        else:
            found = response.kvs(0)
        return _result_kvs(found) or None

    # -------------------------------------------------------------------- the outcome
    def _take_result(
        self,
        rnd: int,
        kvs: list[KeyValue],
        my_create: int,
        *,
        handed: WatchStream | None = None,
        pending: Sequence[WatchEvent] = (),
    ) -> RendezvousInfo | None:
        """This machine's rank from round ``rnd``'s result (``kvs``: ``c/result`` and its
        parts), or None if the round did not take it. ``handed``: the stream the wait followed
        (the round's control keys; ``pending``: what the next round said on it so far), which
        the member watch goes on with (closed here otherwise)."""
        try:
            return self._take_result_of(rnd, kvs, my_create, handed, pending)
        finally:
            if handed is not None and self._member_watch is None:
                handed.close()  # not taken, or a bad result: nobody goes on with it

    def _take_result_of(
        self,
        rnd: int,
        kvs: list[KeyValue],
        my_create: int,
        handed: WatchStream | None,
        pending: Sequence[WatchEvent],
    ) -> RendezvousInfo | None:
        result, kv = _decode_result(kvs, rnd)
        self._pending = (-1, 0)
        # The result and the round key are written in one transaction (_close_round): the
        # round key's revision and lease are the result's. The next join compares them.
        if rnd > self._known[0]:
            self._known = (rnd, kv.mod_revision, kv.lease)
        self._newest_seen = max(self._newest_seen, rnd)
        try:
            rank = result.members.rank_of(my_create)
        except ValueError as exc:
            raise RendezvousStateError(
                f"the rendezvous result of round {rnd} is inconsistent: {exc}; use another "
                "--rdzv-id"
            ) from None
        if rank is None:
            # Not taken (the round was full, or this machine's key lapsed before it closed):
            # a standby for the next round. Its key of this round goes.
            logger.info(
                "round %d formed with %d machines without this one (%s): a standby, waiting for "
                "the next",
                rnd,
                len(result.members),
                self._node,
            )
            with contextlib.suppress(EtcdError):
                self._client.delete(self._rp(rnd) + "a/" + self._qnode)
            return None
        world = len(result.members)
        self.phases["result"] = time.time()
        with self._lock:
            self._round, self._rank, self._members = rnd, rank, result.members
            self._member_set, self._member_id = None, my_create
            self._result_rev = kv.mod_revision
            self._round_lease = kv.lease
            self._joined = False
            self._participants = None
            self._claim = RankClaim(round=rnd, rank=rank)
        store = dist.PrefixStore(f"torch.rendezvous.{self._s.run_id}.{rnd}", self._store)
        if result.master is not None:
            bootstrap = RendezvousStoreInfo(result.master[0], result.master[1])
        else:  # a closer that did not carry it: torch's exchange through the store
            bootstrap = RendezvousStoreInfo.build(rank, store, local_addr=self._addr)
        self.phases["done"] = time.time()
        self._member_watch = _MemberWatch(
            self, rnd, result.members, kv.mod_revision, rank, handed, pending
        )
        logger.info(
            "round %d of %r: group rank %d of %d (result %s)",
            rnd,
            self._s.run_id,
            rank,
            world,
            result.digest,
        )
        return RendezvousInfo(store, rank, world, bootstrap)

    def _raise_closed(self) -> None:
        self._closed = True
        # A machine that joined and was not in the newest round stood by: torch's redundancy
        # list, which leaves with success. Members (and machines that never joined) did not.
        if self._joined and (self._round is None or self._round < self._newest_seen):
            raise RendezvousGracefulExitError(
                f"the rendezvous {self._s.run_id!r} closed (the job finished) while this "
                "machine stood by; it was not needed"
            )
        raise RendezvousClosedError(
            f"the rendezvous {self._s.run_id!r} is closed: the job finished, or a machine gave "
            "up; start a new job with another --rdzv-id"
        )

    # -------------------------------------------------------------------- plumbing
    def _parse_round(self, kv: KeyValue) -> int:
        try:
            rnd = int(kv.value)
        except ValueError:
            rnd = -1
        if not 0 <= rnd <= _MAX_ROUND:
            raise RendezvousStateError(
                f"{kv.key.decode(errors='replace')!r} holds {kv.value[:40]!r}, not a round "
                "number: something else wrote the job's keys; use another --rdzv-id"
            )
        return rnd

    def _lease_ttl_s(self) -> float:
        return self._s.lease_ttl.total_seconds()

    def _lease_id(self) -> int:
        lease = self._lease
        return lease.id if lease is not None else 0

    def _lease_failed(self, lease: Lease) -> None:
        """etcd said ``lease`` is gone: join again with a new one (the source's, if shared)."""
        self._lease_lost.set()
        source = self._source
        if source is not None:
            source.lease_failed(lease)

    def _ensure_lease(self) -> Lease:
        self._check_left()
        with self._lock:
            if self._lease is not None and not self._lease_lost.is_set():
                return self._lease
            source, lost = self._source, self._lease
        if source is not None:
            shared = source.shared_lease()
            if shared is None or (lost is not None and shared.id == lost.id):
                raise EtcdLeaseNotFound(
                    "this machine's node lease is gone and not registered again yet; the "
                    "rendezvous joins with the next one"
                )
            with self._lock:
                self._lease = shared
                self._lease_lost.clear()
            return shared
        lease = self._client.grant_lease(self._s.lease_ttl)
        self._keepalive_stop.set()
        if self._keepalive is not None:
            self._keepalive.join(timeout=2)
        stop = threading.Event()
        with self._lock:
            self._lease = lease
            self._keepalive_stop = stop
            self._lease_lost.clear()
        thread = threading.Thread(
            target=self._renew, args=(lease, stop), name="flashckpt-rdzv-lease", daemon=True
        )
        thread.start()
        self._keepalive = thread
        return lease

    def _renew(self, lease: Lease, stop: threading.Event) -> None:
        interval = max(0.5, lease.ttl.total_seconds() / 3)
        while not stop.wait(interval):
            try:
                self._client.refresh_lease(lease, timeout=timedelta(seconds=interval))
            except EtcdLeaseNotFound:
                if not stop.is_set():
                    logger.warning(
                        "this machine's rendezvous lease is gone (it lapsed, or a peer found "
                        "this machine dead); it joins again with a new one"
                    )
                    self._lease_lost.set()
                    self._wake_waits()
                return
            except EtcdError as exc:
                logger.debug("renewing the rendezvous lease failed (retrying): %s", exc)

    def _new_state_lease(self) -> int | None:
        if self._s.state_ttl is None:
            return None
        try:
            return self._client.grant_lease(self._s.state_ttl, timeout=self._timeout()).id
        except EtcdError:
            return None

    def _state_lease(self) -> int | None:
        """The lease of the job's round keys: the newest round's (renewed), or a new one."""
        if self._s.state_ttl is None:
            return None
        if self._round_lease:
            try:
                self._client.refresh_lease(self._round_lease)
                return self._round_lease
            except EtcdLeaseNotFound:
                pass
        self._round_lease = self._client.grant_lease(self._s.state_ttl).id
        return self._round_lease

    def _refresh_state_lease(self) -> None:
        lease = self._round_lease
        if lease:
            with contextlib.suppress(EtcdError):
                self._client.refresh_lease(lease, timeout=timedelta(seconds=5))

    def _txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op],
        *,
        write: int = 0,
        largest: int | None = None,
    ) -> TxnResult:
        """One transaction; ``write``: the bytes of the values it writes (``largest``: the
        largest of them, when it writes several), for :attr:`stats`."""
        response = self._client.txn(
            Txn(compare, success, failure), timeout=self._timeout(), idempotent=None
        )
        with self.stats.lock:
            self.stats.txns += 1
            if compare and not response.succeeded:
                self.stats.txns_failed += 1
            elif write:
                self.stats.bytes_written += write
                self.stats.max_value = max(self.stats.max_value, largest or write)
        return response

    def _join_txn(
        self,
        lease: Lease,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op],
        *,
        write: int,
    ) -> TxnResult | None:
        """A join's transaction (:meth:`_txn`). While the lease's source has not created its
        node key yet (``NodeRegistry.start(with_join=True)``), the key's creation and the join
        go in one transaction (:meth:`NodeRegistry.fold_registration
        <flashckpt.elastic.membership.nodes.NodeRegistry.fold_registration>`): one request per
        machine on the way to its first round, not two (issue 31). Returns None when the join
        was not made because the registration was settled apart from it (the key was held, or
        the answer was lost: the source reads or takes the key over, never resends blindly;
        the caller joins again).

        Raises:
            NodeIdInUse: A live launcher holds this machine's node id (from the source).
        """
        fold = getattr(self._source, "fold_registration", None)
        answered = getattr(self._source, "fold_answered", None)
        join = Txn(compare, success, failure)
        folded: Txn | None = fold(lease, join) if fold and answered else None
        if folded is None:
            return self._txn(compare, success, failure, write=write)
        assert answered is not None
        try:
            outer: TxnResult | None = self._client.txn(
                folded, timeout=self._timeout(), idempotent=False
            )
        except EtcdOutcomeUnknown:
            outer = None
        response: TxnResult | None = answered(lease, outer)
        with self.stats.lock:
            self.stats.txns += 1
            if response is not None and not response.succeeded:
                self.stats.txns_failed += 1
            elif response is not None:
                self.stats.bytes_written += write
                self.stats.max_value = max(self.stats.max_value, write)
        return response

    def _stop_member_watch(self) -> None:
        watch, self._member_watch = self._member_watch, None
        if watch is not None:
            watch.stop()

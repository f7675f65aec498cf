"""A member's count of the machines waiting for the next round (``num_nodes_waiting``), from
one watch of its round's control keys (:class:`_MemberWatch`). Split out of
:mod:`flashckpt.elastic.rendezvous.handler` (issue 45).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

from flashckpt.elastic.etcd.client import (
    EtcdClient,
    EtcdError,
)
from flashckpt.elastic.etcd.ops import Compare, Op, Range, TxnResult
from flashckpt.elastic.etcd.watchstream import (
    WatchClosed,
    WatchCompacted,
    WatchEvent,
    WatchStream,
    prefix_end,
)
from flashckpt.elastic.rendezvous.result import (
    PackedMembers,
)
from flashckpt.elastic.rendezvous.settings import RdzvSettings

logger = logging.getLogger("flashckpt.elastic.rendezvous.handler")  # its log, as before the split

_ROOM = "room"
"""``r/<R>/c/room``: written once by round ``R + 1``'s lead when round ``R`` was full and lost
a member: a machine that is not of round ``R`` now counts as waiting for its members."""
_NEXT_MEMBER = "next-member"
"""``r/<R>/c/next-member``: a member of round ``R`` joined round ``R + 1`` (created by the first
such join, in its transaction, on its lease; a later one creates it again if it went)."""
_NEXT_OTHER = "next-other"
"""``r/<R>/c/next-other``: a machine not of round ``R`` joined round ``R + 1`` (the same way)."""
_NEXT_RESULT = "next-result"
"""``r/<R>/c/next-result``: round ``R + 1`` formed (written with its result)."""
_NEXT_KEYS = frozenset({_ROOM, _NEXT_MEMBER, _NEXT_OTHER, _NEXT_RESULT})
"""The control keys of a round that its members' watches follow (:class:`_MemberWatch`): what
the next round's joins, lead and result say to them, one key each, whatever the size of the
round (the next round's join keys themselves are not watched: a member's watch received every
join of the next round until it stopped, up to N each, N^2 for the job; issue 31)."""


class _Host(Protocol):
    """What a member watch uses of its handler
    (:class:`~flashckpt.elastic.rendezvous.rounds.RoundState`)."""

    _client: EtcdClient
    _s: RdzvSettings
    _node: str

    def _rp(self, rnd: int) -> str: ...

    def _refresh_state_lease(self) -> None: ...

    def _txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op],
        *,
        write: int = 0,
        largest: int | None = None,
    ) -> TxnResult: ...


class _MemberWatch:
    """A member's view of who waits for the next round, fed by one watch (see the module
    docstring); the thread ends once someone counts (torch restarts the workers then).

    It follows the round's control keys (``r/R/c/``), going on with the stream its wait for
    the result followed (``handed``), so a member opens no watch once it has its rank (issue
    31: at 1,024 machines one watch opened and one closed per member per round). What it
    counts is said there, one key each (:data:`_NEXT_KEYS`): that a member of the round joined
    the next one, that another machine did, that the next round formed, and whether a full
    round lost a member, which lets a machine that is not of the round count (the next round's
    lead follows the round's join keys anyway and writes ``r/R/c/room`` once). It never
    follows the next round's join keys: until its thread stopped it, a member's watch received
    every join of the next round (at 1,024 machines, 9-50 messages per machine after a kill,
    N^2 for the job at worst). What was said stays said (a ``next-*`` key goes with the lease
    of the machine that wrote it, a ``room`` key with its lead's): the count never goes back
    down, as it did when a joined machine's key went, which once counted restarts the workers
    anyway."""

    def __init__(
        self,
        handler: _Host,
        rnd: int,
        members: PackedMembers,
        result_rev: int,
        rank: int,
        handed: WatchStream | None = None,
        pending: Sequence[WatchEvent] = (),
    ) -> None:
        self._h = handler
        self._rnd = rnd
        self._world = len(members)
        self._room = False  # the next round's lead said a member of this full round went
        self._rank = rank
        self._lock = threading.Lock()
        self._count = 0
        self._member_joined = False  # a member of this round joined the next one
        self._other_joined = False  # a machine not of this round joined the next one
        self._excluded = False
        self._stop = threading.Event()
        self._stream: WatchStream | None = handed
        self._pending = list(pending)
        self._start = handed.next_revision if handed is not None else result_rev + 1
        self._thread = threading.Thread(
            target=self._run, name="flashckpt-rdzv-members", daemon=True
        )
        self._thread.start()

    def waiting(self) -> int:
        with self._lock:
            return self._count

    def stop(self) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()

    def _run(self) -> None:
        h = self._h
        ctl = h._rp(self._rnd) + "c/"
        keys = _MemberKeys(ctl)
        start = self._start
        refresh_every = 60.0
        if h._s.state_ttl is not None:
            refresh_every = min(refresh_every, h._s.state_ttl.total_seconds() / 4)
        last_refresh = time.monotonic()
        pending, self._pending = self._pending, []
        if pending and self._apply(pending, keys):
            self._close_stream()
            return
        while not self._stop.is_set():
            stream = self._stream
            if stream is None:
                stream = WatchStream(h._client, ctl.encode(), prefix_end(ctl.encode()), start)
                self._stream = stream
            if self._stop.is_set():
                stream.close()
                return
            try:
                while not self._stop.is_set():
                    events = stream.next_events(timedelta(seconds=refresh_every))
                    if self._rank == 0 and time.monotonic() - last_refresh >= refresh_every:
                        h._refresh_state_lease()
                        last_refresh = time.monotonic()
                    if self._apply(events, keys):
                        return  # counted: torch restarts the workers, next_rendezvous follows
            except WatchClosed:
                return
            except WatchCompacted as exc:
                start = self._resync(exc.compact_revision, ctl)
            except EtcdError as exc:
                logger.debug("the rendezvous watch failed (retrying): %s", exc)
                start = stream.next_revision
                self._stop.wait(1.0)
            finally:
                stream.close()
                self._stream = None

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def _apply(self, events: Sequence[WatchEvent], keys: _MemberKeys) -> bool:
        mine = self._h._node.encode()
        for ev in events:
            if ev.deleted:
                continue  # what the next round said stays said (a marker goes with its lease)
            key = ev.kv.key
            if key == keys.member:
                if ev.kv.value != mine:  # not this machine's own join (it stopped watching)
                    self._member_joined = True
            elif key == keys.other:
                self._other_joined = True
            elif key == keys.result:
                self._excluded = True  # the next round formed without this machine
            elif key == keys.room:
                self._room = True
        room = self._room or self._world < self._h._s.max_nodes
        count = int(self._member_joined) + int(self._other_joined and room)
        if self._excluded:
            count = max(count, 1)
        with self._lock:
            self._count = count
        return count > 0

    def _resync(self, compacted: int, ctl: str) -> int:
        """After a compaction: the round's control keys from one read, the watch from after it."""
        h = self._h
        while not self._stop.is_set():
            try:
                snap = h._txn([], [Range.prefix(ctl)], [])
            except EtcdError:
                self._stop.wait(1.0)
                continue
            events = [WatchEvent(False, kv, None) for kv in snap.kvs(0)]
            self._apply(events, _MemberKeys(ctl))
            return snap.revision + 1
        return compacted + 1


class _MemberKeys:
    """The keys of a round a member watch tells apart (:data:`_NEXT_KEYS`)."""

    __slots__ = ("member", "other", "result", "room")

    def __init__(self, ctl: str) -> None:
        self.member = (ctl + _NEXT_MEMBER).encode()
        self.other = (ctl + _NEXT_OTHER).encode()
        self.result = (ctl + _NEXT_RESULT).encode()
        self.room = (ctl + _ROOM).encode()

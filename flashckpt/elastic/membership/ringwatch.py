"""The ring watch: a machine's watch of its neighbours' node keys in the ring of node ids (a
window of :data:`~flashckpt.elastic.membership.nodestate._WINDOW` on each side), the links to
its successors, etcd's history compacted. Split out of
:mod:`flashckpt.elastic.membership.nodes` (issue 45).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from datetime import timedelta

from flashckpt.elastic.etcd.client import (
    EtcdError,
    KeyValue,
    WatchClosed,
    WatchCompacted,
    WatchEvent,
    WatchStream,
    prefix_end,
)
from flashckpt.elastic.etcd.ops import Op, Range, RangeResult, Txn
from flashckpt.elastic.membership.peerlinks import (
    LinkTarget,
)
from flashckpt.elastic.membership.reaping import (
    _Reaping,
)
from flashckpt.elastic.membership.records import (
    NodeRecord,
)

logger = logging.getLogger("flashckpt.elastic.membership.nodes")  # its log, as before the split

_WATCH_SLICE = timedelta(seconds=5)
_SPAN_LIMITS = (16, 128)
"""Keys read at most of the spans from this node id cut short by one and by two characters up
to this key, in the registration's read of its window (:meth:`NodeRegistry._registration_ranges`):
about 10 and 100 keys for decimal ids."""
_SEGMENT_SLICE = timedelta(seconds=0.05)
"""How long the watch waits on each of its two streams in turn when its window wraps around the
end of the ring (the first and last few machines of the job only)."""
_QUIET_CHECK_S = 60.0


def _limited_range(
    start: bytes, end: bytes, limit: int, *, descend: bool, keys_only: bool = False
) -> Range:
    """A transaction's read of at most ``limit`` keys of ``[start, end)``, nearest ``start``
    first (``descend``: nearest ``end`` first; ``keys_only``: without their values); its
    ``count`` is every key of the range."""
    return Range(start, end, limit=limit, keys_only=keys_only, descend=descend)


class _RingWatch(_Reaping):
    """The registry's watch of its window of the ring (see
    :class:`~flashckpt.elastic.membership.nodes.NodeRegistry`)."""

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

    def _window_ranges(self) -> list[Range]:
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

    def _read_ranges(self, ranges: list[Range]) -> tuple[list[RangeResult], int] | None:
        """One read-only transaction of ``ranges``: each range's answer and the revision, or
        None (logged) if etcd did not answer."""
        self.window_requests += 1
        try:
            result = self._client.txn(Txn(success=ranges), timeout=None)
            answers = [result.range(i) for i in range(len(result))]
            revision = result.revision
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

    def _registration_ranges(self) -> list[Range]:
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

    def _settle_window(self, answers: list[RangeResult], revision: int) -> int | None:
        """Loads the window from the answers to :meth:`_registration_ranges` (read at
        ``revision``); returns the revision the view holds, or None when they did not settle
        the window (a window that wraps around the end of the ring, in a job too large for
        the ranges). Where the predecessors come from the span read without values, their
        values and the successors' are read in one more transaction of ``2k`` keys, which
        also counts the keys between the window's ends: the window is loaded only if it
        still holds exactly those keys then."""
        k = self._window_k
        try:
            lists = [a.kvs for a in answers]
            counts = [a.count for a in answers]
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
        ops: list[Op] = [Range(key) for key in keys]
        ops.append(Range(first, last, count_only=True))
        self.window_requests += 1
        try:
            result = self._client.txn(Txn(success=ops), timeout=None)
            answers = [result.range(i) for i in range(len(result))]
            revision = result.revision
            found = [a.kvs[0] for a in answers[:-1] if a.kvs]
            between = answers[-1].count if len(answers) == len(ops) else -1
        except Exception as exc:
            logger.warning("reading the job's node keys failed (will retry): %s", exc)
            return None
        if len(found) != len(keys) or between != len(keys) + 1:
            return None  # one went or came meanwhile: read the window again
        self._load_view(found, window)
        return revision

    def _take_window(self, answers: list[RangeResult]) -> None:
        """Loads the answers to :meth:`_window_ranges` into the view."""
        k = self._window_k
        if len(answers) != 4:
            raise EtcdError(f"etcd answered {len(answers)} of 4 ranges")
        lists = [a.kvs for a in answers]
        others = answers[0].count + answers[1].count
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

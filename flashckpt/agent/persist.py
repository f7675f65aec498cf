"""The node agent's persistence: which step to persist, and writing it.

The newest step that every local rank of the current world holds complete in memory, and storage
lacks, is written in the background: one safetensors file per shard (by replica 0 only, with
``O_DIRECT`` straight from the slot where the file system allows), one JSON file per rank (also
written through at once, when a snapshot completes), and this node's part record; the node that
hosts rank 0 then hands the step to the :class:`~flashckpt.agent.commit.Committer`.

A slot that changes under the read (the trainer rewrote it, or wants it: yielded twice at most)
abandons the step; a committed step hidden to be rewritten is tried again until it is committed
again. Each complete snapshot's data is hashed here too (xxh3_64, recorded in the slot, in a
thread of its own).

Hashed once more, not twice: a shard is written from the slot while its data is hashed, each
chunk after it was written, and the manifest records that hash of the data apart from the hash
of the file's header (the split form of :class:`~flashckpt.format.manifest.FileEntry`). It must
equal the hash recorded when the snapshot completed, and the slot's sequence number must be the same
after the last chunk was hashed as when the step was picked: a trainer that began rewriting the
slot (the seqlock moved) tears nothing into a commit, and memory scribbled since the completion
(the hash differs) is never committed. Restores from storage check the same two hashes.

Background work gives way: the hash and persist threads run at a low CPU and IO priority
(:func:`~flashckpt.agent.state.lower_thread_priority`), hash and write in chunks of
:data:`~flashckpt.agent.state.BACKGROUND_CHUNK`, and pause between chunks while a trainer
copies into a slot (:class:`~flashckpt.agent.state.Pacer`, bounded pauses).
"""

from __future__ import annotations

import json
import logging
import mmap
import queue
import time
from collections.abc import Callable

import xxhash

from flashckpt.agent.commit import Committer
from flashckpt.agent.mirror import Mirrorer, MirrorJob
from flashckpt.agent.state import (
    BACKGROUND_CHUNK,
    RETRY_SOON_S,
    AgentState,
    RankRecord,
    lower_thread_priority,
    read_meta,
)
from flashckpt.errors import CorruptSnapshotError as _Scribbled  # the data fails its hash
from flashckpt.errors import TornSnapshot as _Torn  # a slot changed while the agent read it
from flashckpt.format.layout import safetensors_header
from flashckpt.format.manifest import FileEntry, RankEntry, ShardEntry
from flashckpt.format.shm import Slot, SlotInfo
from flashckpt.format.snapmeta import NodePart, SnapshotMeta
from flashckpt.format.storage import (
    FORMAT,
    FileRecord,
    Storage,
    rank_file_name,
    shard_file_name,
)
from flashckpt.format.storage_owner import guard_step
from flashckpt.protocol.messages import PersistAbandoned, Persisted, Persisting

__all__ = ["Persister", "hash_snapshot"]

log = logging.getLogger("flashckpt.agent.daemon")

HASH_CHUNK = BACKGROUND_CHUNK
"""Bytes hashed between two looks at the trainers (and at the slot's sequence number)."""
WRITE_CHUNK = BACKGROUND_CHUNK
"""Bytes of a shard written (then hashed) between two looks."""


def hash_snapshot(
    slot: Slot,
    info: SlotInfo,
    pace: Callable[[], None] | None = None,
    chunk: int = HASH_CHUNK,
    give_up: Callable[[], bool] | None = None,
) -> int | None:
    """xxh3_64 of a complete snapshot's data (as :meth:`~flashckpt.format.shm.Slot.data_hash`), in
    chunks of ``chunk`` bytes with ``pace()`` called before each; None as soon as the slot's
    sequence number moved (a trainer rewrites it: the hash would be of torn bytes), or as soon
    as ``give_up()`` says so (checked before each chunk)."""
    if info.data_len > slot.data_cap:
        raise ValueError(f"{slot.path}: data length {info.data_len} exceeds the slot")
    if chunk <= 0:
        raise ValueError(f"chunk {chunk} must be positive")
    h = xxhash.xxh3_64()
    with slot.data(info.data_len) as data:
        for off in range(0, info.data_len, chunk):
            # Torn: given up at once, before and after a pause (a pause for the trainer's copy
            # into this very slot would only wait for the end of the snapshot it tears).
            if slot.seq() != info.seq or (give_up is not None and give_up()):
                return None
            if pace is not None:
                pace()
                if slot.seq() != info.seq:
                    return None
            h.update(data[off : off + chunk])
    return None if slot.seq() != info.seq else int(h.intdigest())


class Persister:
    """Writes the newest complete step to storage, hashes snapshots, writes rank state through."""

    def __init__(
        self, state: AgentState, committer: Committer, mirrorer: Mirrorer | None = None
    ) -> None:
        self.st = state
        self.committer = committer
        self.mirrorer = mirrorer
        """Copies the mirror-marked steps to the remote tier (None: no remote tier)."""
        # slot path -> ((seq, step, meta crc), (world id, marked for storage)) of its last
        # complete snapshot
        self._snap_worlds: dict[
            str, tuple[tuple[int, int, int], tuple[str | None, bool, str | None]]
        ] = {}
        # A mirror-marked step skipped for a newer one (the persister was behind): the mirror
        # root it was marked for, carried to the next step persisted, so a slow persister
        # delays the remote tier's step rather than dropping it until the next mark.
        self._mirror_owed: str | None = None
        # The exit's mirror: the newest step persisted here (step, part, committed here), the
        # mirror root of the newest marked step seen, and the newest step handed to the mirror.
        self._last_part: tuple[int, NodePart, bool] | None = None
        self._mirror_url: str | None = None
        self._mirror_handed = -1
        self._yields = 0  # persists abandoned in a row to let a trainer have its slot
        self._write_s_per_byte = 0.0  # the last shard write's speed (0: none yet)
        self._paused_s = 0.0  # the last shard write's pauses for the trainers' copies
        # The snapshot whose shard the persister writes without a recorded hash, (slot path,
        # seq): the hash thread leaves it alone (the write hashes it, once).
        self._writing: tuple[str, int] | None = None
        self._retry_after = 0.0  # after a persistence error: no attempt before this time
        # The adopted snapshots storage lacks, owed to it since a trainer's hello named the
        # storage (:meth:`owe_adopted`): persisted before anything else, until written.
        self._owed: tuple[int, dict[int, tuple[int, SlotInfo]]] | None = None
        self._failures = 0  # persistence errors in a row (the backoff)

    def init_storage_state(self) -> None:
        assert self.st.storage is not None
        try:
            self.st.committed = self.st.storage.committed_steps()
            self.st.storage.remove_partial_steps(self.st.committed)  # left by an earlier agent
        except OSError as e:
            self.st.record_error(None, f"cannot list storage {self.st.storage.url}: {e}")
            return
        self.st.persisted_high = max(self.st.committed, default=-1)

    def owe_adopted(self) -> None:
        """Called when a trainer's hello names the storage of an agent that had none (the
        script's ``storage=``, no ``--storage`` on the launcher), before its new world is
        recorded: the newest step the adopted snapshots of the previous world hold and storage
        lacks (a run whose storage failed kept them in memory) is owed to storage, as an agent
        started with ``--storage`` persists it at once. Without this the new world's trainers
        restored that step from memory and storage never got it (issue 41)."""
        owed = self.pending_step(force=True)
        if owed is not None:
            log.info("step %d of the adopted snapshots is owed to storage: writing it", owed[0])
        self._owed = owed

    def _still_held(self, picks: dict[int, tuple[int, SlotInfo]]) -> bool:
        """Whether every slot of ``picks`` still holds the snapshot picked."""
        with self.st.lock:
            for r, (idx, info) in picks.items():
                rec = self.st.ranks.get(r)
                slot = rec.slots[idx] if rec is not None else None
                try:
                    now = slot.header() if slot is not None else None
                except ValueError:  # closed meanwhile
                    return False
                if now is None or now.seq != info.seq or not now.complete:
                    return False
        return True

    def persist_loop(self) -> None:
        """Persists the pending step whenever ``wake`` says something changed: a snapshot
        completed, a trainer said hello, done or flush, or went away, the timeline was set back.
        Uninvited it looks again only after work it left unfinished (a persist that gave way to
        a trainer or found a slot torn: soon; after an error: ``retry_interval``), or after
        ``poll_interval`` (a safety net): an idle agent's persister sleeps."""
        lower_thread_priority()
        timeout = self.st.cfg.poll_interval
        while not self.st.stopping.is_set():
            self.st.wake.wait(timeout)
            self.st.wake.clear()
            timeout = self.st.cfg.poll_interval
            if self.st.stopping.is_set() or self.st.storage is None:
                continue
            wait = self._retry_after - time.monotonic()
            if wait > 0:
                timeout = min(timeout, wait)
                continue
            pending = None
            try:
                pending = self.pending_step()
                if pending is not None:
                    self.persist(*pending)
                    with self.st.lock:
                        unfinished = self.st.persisted_high < pending[0]
                    if unfinished:  # gave way, or torn while rewriting: tried again soon
                        timeout = min(timeout, RETRY_SOON_S)
                self.exit_mirror()
            except Exception as e:  # the daemon lives on; the error is reported
                # The store's URL names the bucket (an S3 error alone often does not); the
                # snapshot stays in memory and is persisted again, after a wait that doubles
                # with each failure in a row (up to 4x retry_interval): a store that throttles
                # or is away for a minute is not hammered, and is used again once it is back.
                where = self.st.storage.url if self.st.storage is not None else "storage"
                self.st.record_error(
                    pending[0] if pending else None,
                    f"{type(e).__name__} persisting to {where}: {e}",
                )
                pause = self.st.cfg.retry_interval * 2 ** min(self._failures, 2)
                self._failures += 1
                self._retry_after = time.monotonic() + pause
                timeout = min(timeout, pause)
            else:
                self._failures = 0

    def hash_loop(self) -> None:
        """Hashes the complete snapshots lacking a hash whenever ``hash_wake`` says one may
        have completed (a snapshot, a hello, the start's adopted ones), else every
        ``poll_interval`` (a safety net)."""
        lower_thread_priority()
        while not self.st.stopping.is_set():
            self.st.hash_wake.wait(self.st.cfg.poll_interval)
            self.st.hash_wake.clear()
            if self.st.stopping.is_set():
                break
            try:
                self.hash_pass(background=True)
            except Exception:  # the daemon lives on
                log.exception("hashing snapshots failed")

    def hash_pass(self, rank: int | None = None, background: bool = False) -> None:
        """Records the data hash of every complete snapshot (of one position) lacking one.

        ``background`` (the hash thread's pass): a snapshot whose shard the persister writes
        now is left to it (the write hashes every chunk, and that hash is recorded), so the
        data is read once, not twice; on demand (a trainer about to restore) every one is
        hashed here."""
        with self.st.lock:
            slots = [
                s
                for r in self.st.ranks.values()
                if rank is None or r.rank == rank
                for s in r.slots
                if s is not None
            ]
        watch = self.st.active_slots()
        for s in slots:
            self.ensure_hash(s, watch=watch, background=background)

    def ensure_hash(
        self,
        slot: Slot,
        info: SlotInfo | None = None,
        watch: list[Slot] | None = None,
        background: bool = False,
    ) -> int | None:
        """The data hash of the slot's complete snapshot (``info``'s, if given), computed and
        recorded now if missing; None if the slot holds no such snapshot (any more), or
        (``background``) the persister is writing it and hashes it meanwhile.

        Hashed in chunks, giving way between them to a trainer copying into one of ``watch``
        (the connected positions' slots if None; taken here, before ``map_lock``)."""
        pace = self.st.pacer(watch if watch is not None else self.st.active_slots())
        with self.st.map_lock:
            try:
                now = slot.header()
                if now is None or not now.complete or (info is not None and now != info):
                    return None
                have = slot.recorded_hash(now)
                if have is not None:
                    return have
                tag = (slot.path, now.seq)
                if background and self._writing == tag:
                    return None
                value = hash_snapshot(
                    slot,
                    now,
                    pace,
                    give_up=(lambda: self._writing == tag) if background else None,
                )
                if value is None or slot.seq() != now.seq:
                    return None  # rewritten while hashed
                slot.record_hash(now.seq, value)
                self.st.replica_wake.set()
                return value
            except ValueError:  # unmapped (replaced) meanwhile
                return None

    def _record_written_hash(self, slot: Slot, info: SlotInfo, got: int) -> int | None:
        """The completion hash of a snapshot whose shard was just written without one: the one
        the hash thread recorded meanwhile if it did, else ``got`` (the write's hash of the
        data) recorded now; None if the slot moved on (rewritten)."""
        with self.st.map_lock:  # not while the hash thread records one
            try:
                have = slot.recorded_hash(info)
                if have is not None:
                    return have
                if slot.seq() != info.seq:
                    return None
                slot.record_hash(info.seq, got)
            except ValueError:  # unmapped (replaced) meanwhile
                return None
        self.st.replica_wake.set()
        return got

    def private_loop(self) -> None:
        """Writes a completed snapshot's rank state through, as the queue hands them over (the
        stop queues a negative position to end the wait; ``poll_interval``: a safety net)."""
        while not self.st.stopping.is_set():
            try:
                rank, step = self.st.private_q.get(timeout=self.st.cfg.poll_interval)
            except queue.Empty:
                continue
            if rank < 0 or self.st.stopping.is_set():
                break
            storage = self.st.storage
            if storage is None or step <= max(self.st.committed, default=-1):
                continue  # committed, or never will be: a write would leave a partial step
            if self._failures and time.monotonic() < self._retry_after:
                # The store failed and persistence waits out its backoff: a write-through per
                # snapshot would hammer a store that throttles or is away (and log an error
                # each); the persist after the wait writes this state with the step.
                continue
            with self.st.lock:
                rec = self.st.ranks.get(rank)
                slots = [s for s in (rec.slots if rec else []) if s is not None]
            for slot in slots:
                try:
                    info = slot.header()
                    ok = info is not None and info.complete and info.step == step
                    meta = read_meta(slot, info) if ok and info is not None else None
                except ValueError:  # the slot was just reallocated (closed): the snapshot is gone
                    break
                if not ok:
                    continue
                if meta is None:
                    break
                try:
                    guard_step(storage, step, self.st.cfg.job)
                    storage.write_private(step, meta.rank, meta.world_size, meta.private)
                except Exception as e:  # reported; the big persist path retries later
                    self.st.record_error(
                        step,
                        f"{type(e).__name__} writing rank {rank} state to {storage.url}: {e}",
                    )
                break

    def pending_step(
        self, force: bool = False
    ) -> tuple[int, dict[int, tuple[int, SlotInfo]]] | None:
        """The newest step every local rank holds complete and storage lacks, with its slots.

        ``force`` (the agent's stop): the newest such step whether or not its trainers marked
        it for storage (``persist_every``), as when a trainer died: memory is all there is."""
        if self.st.storage is None:
            return None  # memory only: nothing is ever pending
        if self._owed is not None:
            if self._still_held(self._owed[1]):
                return self._owed
            self._owed = None  # its snapshots were overwritten since: newer ones are pending
        with self.st.lock:
            # Positions whose trainer belongs to an older world (a rank this node no longer
            # runs after a membership change) are left out: they would stall persistence.
            ranks = [
                r
                for r in self.st.ranks.values()
                if any(s is not None for s in r.slots) and r.world_id == self.st.world_id
            ]
            if not ranks:
                return None
            expected = max(r.local_world_size for r in ranks)
            if len(ranks) < expected:
                return None
            per_rank: dict[int, dict[int, tuple[int, SlotInfo]]] = {}
            for rec in ranks:
                have: dict[int, tuple[int, SlotInfo]] = {}
                for i, s in enumerate(rec.slots):
                    info = s.header() if s is not None else None
                    # A snapshot of another world (taken before the position changed hands)
                    # is not part of this world's steps.
                    if (
                        s is not None
                        and info is not None
                        and info.complete
                        and (s.path, info.seq) not in self.st.corrupt
                        and self.snap_world(s, info) == rec.world_id
                    ):
                        have[info.step] = (i, info)
                per_rank[rec.rank] = have
            common = set.intersection(*(set(h) for h in per_rank.values()))
            common = {s for s in common if s > self.st.persisted_high}
            if not common:
                return None
            # persist_every: the newest snapshot the trainers marked; the newest of all when a
            # flush waits, or a trainer of this world died or finished (its memory is all there
            # is: save at breakpoint, and the exit's final snapshot).
            forced = force or self.st.flush_waiting > 0 or any(r.conn is None for r in ranks)
            marked = common if forced else {s for s in common if self._marked(ranks, per_rank, s)}
            if not marked:
                with self.st.lock:
                    self.st.unmarked_high = max(self.st.unmarked_high, max(common))
                return None
            step = max(marked)
            for older in common:
                url = self._mirror_mark(ranks, per_rank, older) if older < step else None
                if url is not None:
                    self._mirror_owed = url
            return step, {r: have[step] for r, have in per_rank.items()}

    def newest_in_memory(self) -> int | None:
        """The newest step a restart could take from this node's memory: the newest step every
        local rank of the current world holds complete, or, while not every local position is
        known (or no world is), the newest complete snapshot of any (kept, not guessed away);
        None when memory holds no complete snapshot."""
        with self.st.lock:
            recs = [r for r in self.st.ranks.values() if any(s is not None for s in r.slots)]
            per_rank: dict[int, set[int]] = {}
            for rec in recs:
                have = set()
                for s in rec.slots:
                    try:
                        info = s.header() if s is not None else None
                    except ValueError:  # closed meanwhile
                        continue
                    if (
                        s is not None
                        and info is not None
                        and info.complete
                        and (s.path, info.seq) not in self.st.corrupt
                    ):
                        have.add(info.step)
                per_rank[rec.rank] = have
            anything = set().union(*per_rank.values()) if per_rank else set()
            if not anything:
                return None
            world = [r for r in recs if r.world_id == self.st.world_id]
            expected = max((r.local_world_size for r in world), default=0)
            if world and len(world) >= expected:
                common = set.intersection(*(per_rank[r.rank] for r in world))
                if common:
                    return max(common)
            return max(anything)

    def _mirror_mark(
        self,
        ranks: list[RankRecord],
        per_rank: dict[int, dict[int, tuple[int, SlotInfo]]],
        step: int,
    ) -> str | None:
        """The mirror root every local rank's snapshot of ``step`` is marked for, or None."""
        urls = set()
        for rec in ranks:
            idx, info = per_rank[rec.rank][step]
            slot = rec.slots[idx]
            urls.add(self.snap_info(slot, info)[2] if slot is not None else None)
        return urls.pop() if len(urls) == 1 else None

    def _marked(
        self,
        ranks: list[RankRecord],
        per_rank: dict[int, dict[int, tuple[int, SlotInfo]]],
        step: int,
    ) -> bool:
        """Whether every local rank's snapshot of ``step`` is marked for storage."""
        for rec in ranks:
            idx, info = per_rank[rec.rank][step]
            slot = rec.slots[idx]
            if slot is None or not self.snap_info(slot, info)[1]:
                return False
        return True

    def persist(self, step: int, picks: dict[int, tuple[int, SlotInfo]]) -> None:
        """Writes this node's part of ``step`` (the snapshots in ``picks``) to storage. Once
        the snapshots are read and pinned the trainers hear ``persisting``, then ``persisted``
        or, when the write ends without it (it gave way, a slot changed, storage failed),
        ``persist_abandoned``; ``status()['persisting']`` says the same meanwhile."""
        try:
            self._persist(step, picks)
            if self._owed is not None and self._owed[0] == step:
                self._owed = None  # written, or its snapshots changed (not owed any more)
        finally:
            with self.st.lock:
                abandoned = self.st.persisting == step
                if abandoned:
                    self.st.persisting = None
            if abandoned:
                self.st.broadcast(PersistAbandoned(step=step))

    def _persist(self, step: int, picks: dict[int, tuple[int, SlotInfo]]) -> None:
        storage = self.st.storage
        assert storage is not None
        t0 = time.monotonic()
        files: dict[str, FileEntry] = {}
        ranks_out: dict[int, RankEntry] = {}
        shards_out: dict[int, ShardEntry] = {}
        world = num_shards = 0
        written = 0
        rewriting = False  # a committed step was hidden to be rewritten
        # Where a persist's time goes (the log line; benchmarks/persist_throughput.py reads it):
        # the completion hash waited for or computed, the shards (written from the slot, each
        # chunk hashed after it was written), pauses for trainers' copies within them, and the
        # rank files.
        phase = dict.fromkeys(("lock", "hash", "shard", "paused", "rank"), 0.0)
        with self.st.io_lock:
            phase["lock"] = time.monotonic() - t0
            slots: dict[int, tuple[Slot, SlotInfo]] = {}
            with self.st.lock:
                for r, (idx, info) in picks.items():
                    s = self.st.ranks[r].slots[idx]
                    if s is None:
                        return
                    slots[r] = (s, info)
            metas: dict[int, SnapshotMeta] = {}
            for s, info in slots.values():
                s.pin(info.seq)
            try:
                for r, (s, info) in slots.items():
                    meta = read_meta(s, info)
                    if meta is None or meta.step != step:
                        raise _Torn(f"rank {r}")
                    metas[r] = meta
                # From here the step is this persist's (pinned, or soon copied out): a trainer
                # whose marked snapshot leaves its slot meanwhile does not mark another.
                with self.st.lock:
                    self.st.persisting = step
                self.st.broadcast(Persisting(step=step))
                hosts_rank0 = any(m.rank == 0 for m in metas.values())
                world_id = next(iter(metas.values())).world_id if metas else ""
                # Never into another job's committed step (raises, issue 41).
                committed_here = guard_step(storage, step, self.st.cfg.job)
                if hosts_rank0 and step > self.st.resumed_at:
                    # Only the committing node (it hosts rank 0) hides a step it will rewrite;
                    # the other nodes' parts are rewritten under the hidden step.
                    if committed_here:
                        with self.st.lock:
                            self.st.rewrites.add(step)
                    rewriting = step in self.st.rewrites
                    storage.uncommit(step)
                for r, (s, info) in slots.items():
                    meta = metas[r]
                    g, world, num_shards = meta.rank, meta.world_size, meta.num_shards
                    rank_name = rank_file_name(g, world)
                    t1 = time.monotonic()
                    rec = storage.write_private(step, g, world, meta.private)
                    phase["rank"] += time.monotonic() - t1
                    files[rank_name] = rec.entry()
                    ranks_out[g] = RankEntry(rank_name, meta.shard)
                    if meta.replica != 0:
                        continue
                    shard_name = shard_file_name(meta.shard, num_shards)
                    # The hash recorded when the snapshot completed (what memory restores and
                    # replicas check), computed now if the hash thread has not yet.
                    # The hash recorded when the snapshot completed (what memory restores and
                    # replicas check). When the hash thread has not recorded it yet, the write
                    # hashes the data (each chunk after it was written) and that hash is
                    # recorded: the data is read once, and the hash thread leaves this snapshot
                    # alone meanwhile (it gives up at its next chunk if it had begun).
                    t1 = time.monotonic()
                    want = s.recorded_hash(info)
                    self._writing = None if want is not None else (s.path, info.seq)
                    # This write will not give way (it did twice in a row already), or storage
                    # writes slower than the trainer snapshots (it will want the slot before
                    # the end, and a yield waits for a chunk's write): a trainer would wait for
                    # storage. The data is copied out first (a memory copy, ~0.1 s per GB) and
                    # the slot let go, so training waits for that copy at most (issue 30).
                    stage = self._yields >= 2 or self._outpaced(r, s, info)
                    staged = self._stage(s, info) if stage else None
                    try:
                        rec = self.write_shard(storage, step, shard_name, s, info, meta, staged)
                    finally:
                        self._writing = None
                        if staged is not None:
                            _free(staged)
                    phase["shard"] += time.monotonic() - t1
                    phase["paused"] += self._paused_s
                    if info.data_len >= 1 << 20:
                        self._write_s_per_byte = (time.monotonic() - t1) / info.data_len
                    # The bytes written must be the ones hashed when the snapshot completed.
                    # Each chunk was hashed after it was written (the only read of the data
                    # here): the sequence number unchanged after the last one says no trainer
                    # began rewriting the slot meanwhile (checked first: a torn read is no
                    # corruption), the hash equal to the completion hash (when one was
                    # recorded before or during the write) says nothing else scribbled over it
                    # since. A step failing either is never committed.
                    if staged is None and s.seq() != info.seq:
                        raise _Torn(f"shard {shard_name}")
                    got = int(rec.data_xxh3_64 or "", 16)
                    t1 = time.monotonic()
                    if want is None:
                        # A staged copy was taken whole under the unchanged sequence number:
                        # its hash is the snapshot's even once the slot was rewritten.
                        want = self._record_written_hash(s, info, got)
                        if want is None and staged is not None:
                            want = got
                    phase["hash"] += time.monotonic() - t1
                    if want is None:
                        raise _Torn(f"shard {shard_name}")
                    if got != want:
                        with self.st.lock:
                            self.st.corrupt[(s.path, info.seq)] = step
                        raise _Scribbled(
                            f"rank {g} (local rank {r}) step {step}: the data in {s.path} no "
                            f"longer matches its hash (shared memory was overwritten); the "
                            f"step is not committed",
                            rank=g,
                            step=step,
                            source=s.path,
                        )
                    written += rec.size
                    files[shard_name] = rec.entry()
                    shards_out[meta.shard] = ShardEntry(shard_name, g)
            except _Torn as e:
                if rewriting:
                    # The step was committed and is hidden now, its files half rewritten: it is
                    # tried again (a trainer is yielded to twice at most), never left lost.
                    log.info("step %d changed while rewriting it (%s); trying again", step, e)
                    return
                log.info("step %d changed in memory while persisting (%s); skipped", step, e)
                with self.st.lock:
                    self.st.persisted_high = max(self.st.persisted_high, step)
                return
            except _Scribbled as e:
                # The error is on record before the step counts as passed: whoever waits for
                # the persister to pass it finds why it was not committed.
                self.st.record_error(step, str(e))
                with self.st.lock:
                    self.st.persisted_high = max(self.st.persisted_high, step)
                return
            finally:
                for s, _ in slots.values():
                    s.unpin()
        part = NodePart(
            node=self.st.cfg.node,
            step=step,
            world_id=world_id,
            world_size=world,
            num_shards=num_shards,
            ranks=ranks_out,
            shards=shards_out,
            files=files,
        )
        t1 = time.monotonic()
        storage.write_part(step, self.st.cfg.node, part.to_json())
        part_s = time.monotonic() - t1
        with self.st.lock:
            self.st.persisted_high = max(self.st.persisted_high, step)
            self.st.persisting = None
        self._yields = 0
        # The trainers carry a mark for storage forward until they hear this (or the commit):
        # a marked snapshot replaced before its persist began is made up for by the next one.
        self.st.broadcast(Persisted(step=step))
        if hosts_rank0:
            # Committed by the commit thread once every node's part is in: persistence of newer
            # steps goes on meanwhile (a step whose parts never arrive, because a machine died,
            # no longer blocks it).
            self.committer.enqueue(step, world, num_shards, world_id)
        self._last_part = (step, part, hosts_rank0)
        self._mirror(step, metas, part, hosts_rank0)
        dt = time.monotonic() - t0
        shard_s = phase["shard"]
        log.info(
            "persisted step %d: %.1f MiB in %.2f s (%.0f MiB/s; lock %.3f s, completion hash "
            "%.3f s, shards %.3f s at %.0f MiB/s of which paused %.3f s, rank files %.3f s, "
            "part %.3f s)",
            step,
            written / 2**20,
            dt,
            written / 2**20 / max(dt, 1e-9),
            phase["lock"],
            phase["hash"],
            shard_s,
            written / 2**20 / max(shard_s, 1e-9),
            phase["paused"],
            phase["rank"],
            part_s,
        )

    def _mirror(
        self, step: int, metas: dict[int, SnapshotMeta], part: NodePart, commits: bool
    ) -> None:
        """Hands a persisted step to the mirror when its trainers marked it for the remote
        tier: every local rank's snapshot must be marked, for the same root (a disagreement is
        no step to mirror half of: it is reported and the step stays in the primary tier)."""
        urls = {m.mirror for m in metas.values()}
        if urls == {None} and self._mirror_owed is not None:
            urls = {self._mirror_owed}  # an older marked step was skipped for this one
        self._mirror_owed = None
        if self.mirrorer is None or urls == {None}:
            return
        if len(urls) != 1:
            self.mirrorer.error(
                step,
                f"the local ranks mark step {step} for different mirrors ({sorted(map(str, urls))}"
                "): give every rank the same mirror=; the step is not mirrored",
            )
            return
        url = next(iter(urls))
        assert url is not None
        self._mirror_url, self._mirror_handed = url, max(self._mirror_handed, step)
        self.mirrorer.enqueue(MirrorJob(step, url, part, commits))

    def exit_mirror(self) -> None:
        """The trainers finished (every position of the current world said done): the newest
        step persisted here goes to the mirror too, marked or not (to the root of the newest
        marked step seen), so the end of a run reaches the remote tier. Every node of the world
        does the same with the same step (the exit's flush persisted it everywhere)."""
        if self.mirrorer is None or self._mirror_url is None or self._last_part is None:
            return
        with self.st.lock:
            ranks = [r for r in self.st.ranks.values() if r.world_id == self.st.world_id]
            if not ranks or not all(r.done for r in ranks):
                return
        step, part, commits = self._last_part
        if step <= self._mirror_handed:
            return
        self._mirror_handed = step
        log.info("the trainers finished: mirroring the last persisted step %d", step)
        self.mirrorer.enqueue(MirrorJob(step, self._mirror_url, part, commits))

    def _outpaced(self, rank: int, slot: Slot, info: SlotInfo) -> bool:
        """Whether writing this snapshot (at the last shard write's speed) takes longer than
        its trainer took between its two newest snapshots: it would want the slot mid-write."""
        if self._write_s_per_byte <= 0.0:
            return False
        with self.st.lock:
            rec = self.st.ranks.get(rank)
            others = [o for o in (rec.slots if rec else []) if o is not None and o is not slot]
        for other in others:
            try:
                o = other.header()
            except ValueError:  # closed meanwhile
                continue
            if o is not None and o.complete and o.time_complete and info.time_complete:
                interval = abs(info.time_complete - o.time_complete)
                return info.data_len * self._write_s_per_byte > interval
        return False

    def _stage(self, slot: Slot, info: SlotInfo) -> mmap.mmap:
        """A private, page-aligned copy of the snapshot's data, taken while the slot is pinned;
        the slot is then unpinned (the trainer may rewrite it). Raises :class:`_Torn` if the
        slot changed meanwhile."""
        n = info.data_len
        buf = mmap.mmap(-1, max(n, 1))
        try:
            view = slot.data(n)
            try:
                buf[:n] = view
            finally:
                view.release()
            if slot.seq() != info.seq:
                raise _Torn(f"{slot.path}: rewritten while staged")
        except BaseException:
            buf.close()
            raise
        slot.unpin()
        with self.st.lock:
            self.st.staged_writes += 1
        log.info(
            "step %d: %.1f MiB copied out of %s so the trainer need not wait for storage",
            info.step,
            n / 2**20,
            slot.path,
        )
        return buf

    def write_shard(
        self,
        storage: Storage,
        step: int,
        name: str,
        slot: Slot,
        info: SlotInfo,
        meta: SnapshotMeta,
        staged: mmap.mmap | None = None,
    ) -> FileRecord:
        header = safetensors_header(
            meta.layout,
            {
                "format": FORMAT,
                "step": str(step),
                "skeleton": json.dumps(meta.skeleton, separators=(",", ":")),
            },
            # The slot's data region is page-aligned: with a header of whole pages the tensor
            # bytes land at page-aligned file offsets too, so a local file is written with
            # O_DIRECT straight from the slot (no page-cache copy).
            align=4096,
        )
        whole = memoryview(staged) if staged is not None else None
        data = slot.data(info.data_len) if whole is None else whole[: info.data_len]
        pace = self.st.pacer()
        self._paused_s = 0.0

        def check() -> None:
            if staged is not None:  # our own copy: nothing to give way to but the copies
                pace()
                return
            if slot.seq() != info.seq:
                raise _Torn(f"shard {name}")
            pace()  # a trainer copying into another slot goes first
            if slot.seq() != info.seq:
                raise _Torn(f"shard {name}")
            if slot.wanted() and self._yields < 2:
                # The trainer waits for this slot and already holds a newer snapshot: let it
                # have the slot and persist the newer one next (at most twice in a row, so
                # persistence cannot starve).
                self._yields += 1
                raise _Torn(f"shard {name}: yielded to the trainer")

        try:
            rec = storage.write_buffer(
                storage.step_path(step, name), header, data, check, split=True, chunk=WRITE_CHUNK
            )
        finally:
            data.release()
            if whole is not None:
                whole.release()
            self._paused_s = pace.waited_s
        if staged is None and slot.seq() != info.seq:
            raise _Torn(f"shard {name}")
        with self.st.lock:
            self.st.shard_writes["direct" if rec.direct else "buffered"] += 1
        return rec

    def snap_world(self, slot: Slot, info: SlotInfo) -> str | None:
        """The world id a complete snapshot was taken in (cached per slot generation)."""
        return self.snap_info(slot, info)[0]

    def snap_info(self, slot: Slot, info: SlotInfo) -> tuple[str | None, bool, str | None]:
        """The world id of a complete snapshot, whether its trainer marked it for storage, and
        the mirror root it marked it for (cached per slot generation; an unreadable meta: no
        world, unmarked)."""
        # The sequence number alone does not name a snapshot: a slot file that was replaced
        # (a bigger state) starts counting again.
        tag = (info.seq, info.step, info.meta_crc)
        cached = self._snap_worlds.get(slot.path)
        if cached is not None and cached[0] == tag:
            return cached[1]
        meta = read_meta(slot, info)
        if meta is None:
            return None, False, None
        out = (meta.world_id, meta.persist_wanted, meta.mirror)
        self._snap_worlds[slot.path] = (tag, out)
        return out


def _free(buf: mmap.mmap) -> None:
    """Unmaps a staged copy now (not at the garbage collector's leisure). The write released
    every view of it, even when it failed; were one still alive, the close's ``BufferError``
    must not replace the write's own error (an EIO is reported as the I/O error it is)."""
    try:
        buf.close()
    except BufferError as e:
        log.warning("the staged copy of a shard (%d B) is still referenced: %s", len(buf), e)

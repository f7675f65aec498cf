"""The node agent's ``pull_replica``: a trainer whose own memory lacks its snapshot (its machine
was lost, this one replaces it) has its agent fetch a peer agent's replica of it into one of its
own slots, where the trainer then reads it as memory.

For a global rank, a least step and the world it must have been taken in, the agent asks every
known peer (the replica servers of :attr:`flashckpt.agent.replicas.holder.Replicator.peers`) which
replicas of that rank it holds (:func:`~flashckpt.agent.replicas.transport.query_replicas`), picks
the most recently taken that fits and, with ``fetch``, streams it
(:func:`~flashckpt.agent.replicas.transport.fetch_replica`) into a new slot file of the position
(allocated as a trainer's slot is, after the same capacity check), hashing as it arrives. A fetch
that names the holder an earlier look found goes to it directly (one query, not two). Only a replica
whose bytes hash to the holder's recorded value and whose description passes the same checks as a
slot's (:class:`~flashckpt.format.snapmeta.SnapshotMeta`: rank, world size, world id, step) replaces
a slot of the position, complete with its data hash recorded; the trainer re-checks that hash before
it loads a byte. Every peer answer is bounded (a timeout per peer, a number of peers, the
replica's size against the tmpfs), nothing is trusted; a failure is a reply naming rank, step and
source, never a half-written slot (the incoming file is removed).

Torch-free (the agent layer).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from flashckpt.agent.replicas.transport import (
    ReplicaError,
    ReplicaHeader,
    fetch_replica,
    host_port,
    query_replicas,
)
from flashckpt.agent.segments import slot_file_bytes
from flashckpt.agent.state import AgentState, Conn, RankRecord, slot_room
from flashckpt.errors import CorruptCheckpointError, CorruptSnapshotError, ShmSpaceError
from flashckpt.format.shm import Slot, allocate_slot_file, slot_path
from flashckpt.format.snapmeta import SnapshotMeta
from flashckpt.protocol.messages import ErrorReply, PullReplica, PullReplicaReply, Reply

__all__ = ["MAX_PEERS", "Puller"]

log = logging.getLogger("flashckpt.agent.daemon")

MAX_PEERS = 256
"""The most peers one pull asks (the known peers beyond it are not asked; logged)."""
QUERY_TIMEOUT_S = 10.0
"""The longest one peer may take to say what it holds."""
MAX_REASON = 2000
"""The longest ``reason`` a reply carries (one line per peer, cut)."""

Peers = Callable[[], Mapping[str, tuple[str, int]]]


@dataclass(frozen=True, slots=True)
class _Found:
    """A replica a peer holds."""

    holder: str
    """The peer's node id."""
    addr: tuple[str, int]
    """Its replica server."""
    header: ReplicaHeader | None
    """What it holds, as its ``query`` answer said (None: not asked, see ``sender``)."""
    sender: str = ""
    """The machine whose snapshot it is, where ``header`` is None."""

    @property
    def source(self) -> str:
        return host_port(*self.addr)

    @property
    def sender_node(self) -> str:
        return self.header.sender_node if self.header is not None else self.sender


class Puller:
    """Serves ``pull_replica`` for one agent.

    Args:
        state: the agent's shared state.
        peers: the known peers (node id -> replica server), read at each pull: the
            replicator's current peer list.
    """

    def __init__(self, state: AgentState, peers: Peers) -> None:
        self.st = state
        self.peers = peers

    def pull(self, conn: Conn, req: PullReplica) -> Reply:
        """Handles one request (see the module)."""
        cfg = self.st.cfg
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        rec = self._position(conn, req)
        known = {n: a for n, a in self.peers().items() if n != cfg.node}
        peers = sorted(known.items())
        if len(peers) > MAX_PEERS:
            log.warning("pull_replica: asking %d of the %d known peers", MAX_PEERS, len(peers))
            peers = peers[:MAX_PEERS]
        if not peers:
            return PullReplicaReply(
                found=False,
                reason=f"agent {cfg.node!r} knows no peer agents (--replica-peers is empty)",
            )
        if req.fetch and req.holder in known and req.sender is not None:
            # The trainer's look (fetch=False) just found it there: fetched at once, without
            # asking every peer again; every byte and field of it is checked all the same.
            direct = _Found(req.holder, known[req.holder], None, req.sender)
            reply = self._fetched(rec, conn, req, direct, phases, t0)
            if reply is not None:
                return reply
            phases.clear()  # no longer held there: every peer is asked
        found, reasons = self._ask(peers, req)
        phases["ask"] = time.perf_counter() - t0
        if not found:
            why = "; ".join(reasons) or "no peer holds a replica of it"
            return PullReplicaReply(
                found=False,
                reason=f"rank {req.rank} step >= {req.min_step}: {why}"[:MAX_REASON],
            )
        best = found[0]
        h = best.header
        assert h is not None
        if not req.fetch:
            phases["total"] = time.perf_counter() - t0
            return PullReplicaReply(
                phases_s=_rounded(phases),
                found=True,
                step=h.step,
                holder=best.holder,
                source=best.source,
                sender=h.sender_node,
                world_id=h.world,
                bytes=h.data_len,
            )
        reply = self._fetched(rec, conn, req, best, phases, t0)
        if reply is None:
            return PullReplicaReply(
                found=False,
                reason=f"{best.source} no longer holds step {h.step} of rank {req.rank}",
            )
        return reply

    def _fetched(
        self,
        rec: RankRecord,
        conn: Conn,
        req: PullReplica,
        best: _Found,
        phases: dict[str, float],
        t0: float,
    ) -> Reply | None:
        """Fetches ``best`` into a slot of the position: the reply, or None when the holder
        no longer has it."""
        want = f"step {best.header.step}" if best.header is not None else f"step {req.min_step}"
        try:
            got = self._fetch(rec, conn, req, best, phases)
        except (CorruptSnapshotError, CorruptCheckpointError) as e:
            log.warning("pull_replica: %s", e)
            return ErrorReply(error=str(e), kind=type(e).__name__)
        except (ReplicaError, OSError, ValueError, ShmSpaceError) as e:
            msg = (
                f"replica of rank {req.rank} {want} from {best.holder!r} "
                f"({best.source}) not pulled: {e}"
            )
            log.warning("pull_replica: %s", msg)
            return ErrorReply(error=msg, kind=type(e).__name__)
        if got is None:
            return None
        path, idx, h = got
        phases["total"] = time.perf_counter() - t0
        log.info(
            "pulled the replica of rank %d step %d (%.1f MiB, machine %s) from %s (%s) into %s "
            "(%s)",
            req.rank,
            h.step,
            h.data_len / 2**20,
            h.sender_node,
            best.holder,
            best.source,
            path,
            ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()),
        )
        return PullReplicaReply(
            phases_s=_rounded(phases),
            found=True,
            step=h.step,
            holder=best.holder,
            source=best.source,
            sender=h.sender_node,
            world_id=h.world,
            bytes=h.data_len,
            path=path,
            slot=idx,
        )

    def _position(self, conn: Conn, req: PullReplica) -> RankRecord:
        """The position the request is for: only the trainer that said hello for it (on this
        connection, in the current world) may have a slot of it replaced."""
        with self.st.lock:
            rec = self.st.ranks.get(req.key)
            if req.key not in conn.ranks or rec is None or rec.conn is not conn:
                raise ValueError(
                    f"pull_replica for local rank {req.key} refused: this connection did not say "
                    "hello for it; a trainer pulls only into its own position"
                )
            if rec.global_rank != req.rank:
                raise ValueError(
                    f"pull_replica: local rank {req.key} is global rank {rec.global_rank} here, "
                    f"not {req.rank}"
                )
            if rec.world_id != self.st.world_id:
                raise ValueError(
                    f"pull_replica for local rank {req.key} refused: its trainer belongs to world "
                    f"{rec.world_id!r}, the current world is {self.st.world_id!r}"
                )
        return rec

    def _ask(
        self, peers: list[tuple[str, tuple[str, int]]], req: PullReplica
    ) -> tuple[list[_Found], list[str]]:
        """Every peer's held replicas of the rank that fit, newest first; and why each peer
        that gave none did not. The peers are asked at once: a dead one (the lost machine may
        still be listed) costs one timeout, not one per peer."""
        job = self.st.cfg.job
        timeout = min(req.timeout_s, QUERY_TIMEOUT_S)

        def ask(addr: tuple[str, int]) -> list[ReplicaHeader]:
            return query_replicas(
                addr, job=job, rank=req.rank, min_step=req.min_step, timeout=timeout
            )

        found: list[_Found] = []
        reasons: list[str] = []
        with ThreadPoolExecutor(max_workers=min(16, len(peers))) as pool:
            futures = [(node, addr, pool.submit(ask, addr)) for node, addr in peers]
            for node, addr, fut in futures:
                try:
                    held = fut.result()
                except (ReplicaError, OSError, ValueError) as e:
                    reasons.append(f"{node}: {e}")
                    continue
                fits = [h for h in held if req.world_id is None or h.world == req.world_id]
                if not fits:
                    reasons.append(f"{node}: holds none" + (" of that world" if held else ""))
                found.extend(_Found(node, addr, h) for h in fits)
        # The most recently taken first: within a world that is the newest step; across worlds
        # (a replica of an abandoned timeline's higher step still held for a machine that now
        # holds other ranks) the newer world's (the senders' clocks, roughly in step).
        found.sort(key=lambda f: (*_newest_first(f.header), f.holder))
        return found, reasons

    def _slot_index(self, rec: RankRecord) -> int:
        """The slot the replica goes into: an unused one, else one without a complete snapshot,
        else the one holding the older step (the newest own snapshot stays)."""
        with self.st.lock:
            slots = list(rec.slots)
        steps: list[int] = []
        for i, s in enumerate(slots):
            if s is None:
                return i
            try:
                info = s.header()
            except ValueError:  # closed
                return i
            if info is None or not info.complete:
                return i
            steps.append(info.step)
        return 0 if steps[0] <= steps[1] else 1

    def _fetch(
        self,
        rec: RankRecord,
        conn: Conn,
        req: PullReplica,
        best: _Found,
        phases: dict[str, float],
    ) -> tuple[str, int, ReplicaHeader] | None:
        """Streams the replica into a new slot file, checks it, and installs it as one of the
        position's slots; returns (its path, its index, its header), or None when the holder no
        longer holds it.

        Before a byte of data is taken: the holder's header must be what was asked for (the
        step its query listed, or with a direct fetch the requested step and world), and the
        tmpfs must have room for the new slot plus what the agent already holds, checked as a
        trainer's ``alloc`` is (:attr:`AgentState.capacity_check`, then the file's own
        allocation): a full tmpfs is a :class:`ShmSpaceError` with the numbers, never a SIGBUS.
        """
        cfg, listed = self.st.cfg, best.header
        idx = self._slot_index(rec)
        path = slot_path(cfg.shm_dir, cfg.job, cfg.node, req.key, idx)
        incoming = f"{path}.tmp-pull"  # a dead agent's leftover is removed at the next adopt
        box: list[tuple[Slot, int]] = []  # the incoming slot and its write's seq

        def alloc(got: ReplicaHeader) -> memoryview:
            if listed is not None:
                if (got.step, got.sender_node, got.data_len, got.meta_len) != (
                    listed.step,
                    listed.sender_node,
                    listed.data_len,
                    listed.meta_len,
                ):
                    raise ReplicaError(
                        f"{best.source} now holds step {got.step} of {got.sender_node!r} "
                        f"({got.data_len} B), not the step {listed.step} it listed"
                    )
            elif got.step != req.min_step:
                raise ReplicaError(
                    f"{best.source} holds step {got.step} of {got.sender_node!r}, "
                    f"not the step {req.min_step} asked for"
                )
            if req.world_id is not None and got.world != req.world_id:
                raise ReplicaError(
                    f"{best.source} holds step {got.step} of world {got.world!r}, "
                    f"not of world {req.world_id!r}"
                )
            self.reserve(rec, idx, incoming, got)
            slot = Slot(incoming)
            box.append((slot, slot.begin_write()))
            return slot.data(got.data_len)

        step = listed.step if listed is not None else req.min_step
        try:
            got = fetch_replica(
                best.addr,
                job=cfg.job,
                sender_node=best.sender_node,
                rank=req.rank,
                min_step=step,
                max_bytes=listed.data_len if listed is not None else 2**62,
                alloc=alloc,
                timeout=req.timeout_s,
                phases=phases,
            )
            if got is None or not box:
                return None
            slot, seq = box[0]
            where = f"the replica of rank {req.rank} step {got.header.step} from {best.holder!r}"
            meta = _checked_meta(got.meta, where, req, got.header, cfg.job)
            slot.write_meta(got.meta)
            slot.end_write(seq, got.header.step, got.meta, got.header.data_len)
            # Verified as it arrived (fetch_replica): the trainer re-checks it before loading.
            slot.record_hash(seq + 1, got.header.data_hash)
            slot.close()
            box.clear()
            t = time.perf_counter()
            self._install(rec, conn, idx, path, incoming)
            phases["install"] = time.perf_counter() - t
        except BaseException:
            for s, _ in box:
                with contextlib.suppress(BufferError, ValueError):
                    s.close()
            with contextlib.suppress(OSError):
                os.unlink(incoming)
            with self.st.lock:
                self.st.incoming.pop(incoming, None)
            raise
        log.debug("replica meta: rank %d world %s", meta.rank, meta.world_id)
        return path, idx, got.header

    def reserve(self, rec: RankRecord, idx: int, incoming: str, h: ReplicaHeader) -> None:
        """Checks and takes the room of the incoming slot file for the position's slot ``idx``
        (as a trainer's ``alloc`` does, never at the same time as one or another pull:
        ``room_lock``): this machine's slots after the pull (every position's, the other pulls
        in flight as the slots they will become) plus the replicas it holds must fit the tmpfs;
        then the file is allocated (the tmpfs's room, too) and counted as in flight until it is
        installed or removed."""
        new = slot_file_bytes(h.meta_len, h.data_len)
        with self.st.room_lock:
            check = self.st.capacity_check
            if check is not None:
                own, present = slot_room(
                    self.st, lambda other, i, size: new if (other is rec and i == idx) else size
                )
                check(own, present)
            allocate_slot_file(incoming, h.meta_len, h.data_len)
            with self.st.lock:
                self.st.incoming[incoming] = (rec, idx, new)

    def _install(self, rec: RankRecord, conn: Conn, idx: int, path: str, incoming: str) -> None:
        """Puts the complete replica in place of the position's slot ``idx`` (as an alloc
        replaces a slot: never while the persister reads it)."""
        with self.st.io_lock:
            if self.st.stopping.is_set():
                raise ReplicaError("the node agent is shutting down: no new slots")
            with self.st.lock:
                if rec.conn is not conn:
                    raise ReplicaError("the trainer went away during the pull")
                old = rec.slots[idx]
                rec.slots[idx] = None
                # A verdict on the old file of this path must not stick to the new one.
                for key in [k for k in self.st.corrupt if k[0] == path]:
                    del self.st.corrupt[key]
            if old is not None:
                with self.st.map_lock:  # never under the hasher
                    try:
                        old.close()
                    except (BufferError, OSError, ValueError) as e:
                        log.warning("closing %s: %s (replaced anyway)", old.path, e)
            os.replace(incoming, path)
            new = Slot(path)
            with self.st.lock:
                rec.slots[idx] = new
                self.st.incoming.pop(incoming, None)
        self.st.wake.set()


def _newest_first(h: ReplicaHeader | None) -> tuple[float, int]:
    return (-h.time_complete, -h.step) if h is not None else (0.0, 0)


def _rounded(phases: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 6) for k, v in phases.items()}


def _checked_meta(
    raw: bytes, where: str, req: PullReplica, h: ReplicaHeader, job: str
) -> SnapshotMeta:
    """The replica's snapshot description, checked as a slot's and against the request."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(where, f"has a description that is not JSON ({e})") from None
    meta = SnapshotMeta.from_json(doc, where)
    problems = []
    if meta.rank != req.rank:
        problems.append(f"is of rank {meta.rank}, not {req.rank}")
    if meta.world_size != req.world_size:
        problems.append(f"was taken by {meta.world_size} ranks, not {req.world_size}")
    if meta.world_id != h.world or (req.world_id is not None and meta.world_id != req.world_id):
        problems.append(f"was taken in world {meta.world_id!r}")
    if meta.step != h.step:
        problems.append(f"describes step {meta.step}, its header says {h.step}")
    if meta.layout.nbytes != h.data_len:
        problems.append(f"describes {meta.layout.nbytes} B of data, {h.data_len} B were sent")
    if meta.job != job:
        problems.append(f"is of job {meta.job!r}")
    if problems:
        raise CorruptCheckpointError(where, "; ".join(problems) + "; not used")
    return meta

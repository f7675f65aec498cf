"""The node agent's replicas: it holds other machines' newest snapshots and sends its own.

With ``replica_listen`` set the agent runs a
:class:`~flashckpt.agent.replicas.transport.ReplicaServer` whose
:class:`~flashckpt.agent.replicas.transport.ReplicaStore` keeps the replicas in the agent's tmpfs
(files with the agent's own prefix: removed at its exit, found by the orphan sweep and ``flashckpt
clean`` when it died). With ``replicas`` > 0 and ``replica_peers`` a low-priority sender thread
pushes, once the hash thread recorded the data hash of a local rank's newest complete snapshot of
the current world, that snapshot to :func:`~flashckpt.agent.replicas.transport.replica_targets` of
the world: one transfer at a time, the newest only (a snapshot superseded before its turn is never
sent), pacing itself while a trainer copies into a slot. A failure is logged, counted and shown in
``status``, the target is retried after a backoff; it never stops the agent nor makes a trainer wait
(the sender maps the slot file itself and never pins it: a trainer overwriting it aborts the
transfer). Replication runs between the agents over TCP, never through the trainers' process group.

The peers come from ``replica_peers`` at start (fixed) or, under the launcher, from its
``replica_peers`` request at every rendezvous round (:meth:`Replicator.set_peers`): the peer
list is replaced whole, the targets re-derived, every rank's newest snapshot sent again to its
(new) targets, and the replicas of machines that left the world are dropped once the new world
has taken a snapshot on this machine (until then a replacement may still restore the lost
machine's ranks from them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from flashckpt import names
from flashckpt.agent.replicas.transport import (
    HeldReplica,
    ReplicaError,
    ReplicaNotReady,
    ReplicaServer,
    ReplicaStore,
    check_replica_capacity,
    host_port,
    push_replica,
    replica_targets,
)
from flashckpt.agent.state import AgentState, lower_thread_priority, read_meta
from flashckpt.errors import FlashckptError, ShmSpaceError
from flashckpt.format.shm import Slot, SlotInfo
from flashckpt.names import check_name

__all__ = ["Replicator"]

log = logging.getLogger("flashckpt.agent.daemon")

PACE_WAIT_S = 2.0
"""The longest one pause of a transfer waits for a trainer's copy to end (then it goes on: a
trainer that copies all the time must not starve replication)."""
MAX_BACKOFF_S = 30.0
NOT_READY_RETRY_S = 0.5
"""A holder not ready for replicas yet (its trainers' slots not set up) is asked again this
often: not a failure, no growing back-off."""
MAX_PEERS = 4096
"""The most machines a peer list may name (it comes from a socket)."""


class Replicator:
    """The replica server (holder side) and the sender thread of one agent."""

    def __init__(self, state: AgentState) -> None:
        self.st = state
        cfg = state.cfg
        self.peers: dict[str, tuple[str, int]] = cfg.replica_peer_addrs()
        """Node id -> the (host, port) of its replica server: the other machines of the world.
        Replaced whole by :meth:`set_peers`, never changed in place, so a reader on another
        thread (the sender, a pull) takes it once (``peers = replicator.peers``) and uses that
        dict: it is always one consistent peer list."""
        self._dynamic = False  # set_peers was called: the launcher tells the world
        self._known: set[str] = set(self.peers)  # every machine ever in the world
        self._peers_world: str | None = None  # the trainers' world when the peers last changed
        # prune_stale_worlds: the steps of world _seen_world seen held from each sender.
        self._seen_world: str | None = None
        self._seen_steps: dict[str, set[int]] = {}
        self.listen = cfg.replica_listen_addr()
        self.store: ReplicaStore | None = None
        self.server: ReplicaServer | None = None
        self.wake = state.replica_wake
        """Set when a snapshot's hash is recorded (there may be something to send)."""
        self._lock = threading.Lock()
        self.sent: dict[tuple[str, int], dict[str, Any]] = {}
        """(target node, global rank) -> the last replica it took: step, seq, time."""
        self._done: dict[tuple[str, int], tuple[str, int, int]] = {}  # -> (path, seq, step)
        self.failures = 0
        self.errors: list[dict[str, Any]] = []
        self._retry_at: dict[str, float] = {}  # target -> no attempt before (monotonic)
        self._backoff: dict[str, float] = {}
        self._not_ready: set[str] = set()  # targets that said "not ready" (logged once each)
        # The sender thread's own slot mappings (only it touches them), by path.
        self._maps: dict[str, tuple[tuple[int, int, int], Slot]] = {}
        self._metas: dict[str, tuple[tuple[int, int, int], tuple[str, int] | None]] = {}

    @property
    def sending(self) -> bool:
        """Whether this agent sends replicas at all."""
        return self.st.cfg.replicas > 0 and bool(self.peers)

    # -- holder side -------------------------------------------------------------------------
    def start_server(self) -> None:
        """Starts the replica server (if ``replica_listen``); a previous agent's replica files
        of this job and node are removed first (nothing indexes them any more)."""
        if self.listen is None:
            return
        cfg = self.st.cfg
        prefix = names.slot_prefix(cfg.job, cfg.node) + "rep."
        for name in os.listdir(cfg.shm_dir):
            if name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(cfg.shm_dir, name))
                log.info("removed a previous agent's replica file %s", name)
        limit = cfg.replica_limit_bytes  # 0: derived once the own slots are known (at alloc)
        store = ReplicaStore(cfg.shm_dir, cfg.job, cfg.node, limit, pending=limit == 0)
        host, port = self.listen
        try:
            self.server = ReplicaServer(store, host, port, pace=self._receive_pace)
        except OSError as e:
            if port == 0:
                # Replicas protect; snapshots and persistence must go on without them.
                log.error(
                    "no replica server on %s (%s): this machine holds no replicas",
                    host_port(*self.listen),
                    e,
                )
                return
            # The port of a previous agent was taken meanwhile: another one (the launcher
            # reads it back from status and publishes it).
            log.warning("replica port %d is taken (%s): listening on another one", port, e)
            try:
                self.server = ReplicaServer(store, host, 0, pace=self._receive_pace)
            except OSError as e2:
                log.error("no replica server on %s (%s): this machine holds no replicas", host, e2)
                return
        self.store = store
        host, port = self.server.address
        log.info(
            "replica server listening on %s (limit %s)",
            host_port(host, port),
            f"{limit / 2**20:.1f} MiB" if limit else "derived from this machine's slots",
        )

    def _receive_pace(self) -> None:
        if self.st.stopping.is_set():  # a transfer under way does not hold up the exit
            raise ReplicaError("the holder's agent is stopping: transfer abandoned")

    def check_capacity(self, own_bytes: int, present_bytes: int) -> None:
        """At a trainer's alloc: can the tmpfs hold ``own_bytes`` of this machine's slots (after
        the alloc) plus the replicas it holds? ``present_bytes``: of those, already in the
        tmpfs. Raises :class:`~flashckpt.errors.ShmSpaceError` with the numbers; on success a
        derived limit is set from ``own_bytes``."""
        store, cfg = self.store, self.st.cfg
        if store is None or cfg.replicas == 0:
            return
        # own_bytes counts two slots per rank; a held replica is one snapshot per rank, and the
        # other half is the file it replaced, kept as the next push's target (or the transfer
        # in flight): what the tmpfs really holds at the peak.
        limit = cfg.replica_limit_bytes or cfg.replicas * own_bytes
        held = store.held_bytes()
        try:
            check_replica_capacity(
                cfg.shm_dir, own_bytes, limit, present_bytes=present_bytes + held
            )
        except ShmSpaceError:
            if not store.drop_spares():  # replaced replicas kept for reuse yield their room
                raise
            check_replica_capacity(
                cfg.shm_dir, own_bytes, limit, present_bytes=present_bytes + held
            )
        if not cfg.replica_limit_bytes:
            store.set_limit(limit)

    def close(self) -> None:
        """Stops the server and removes every replica file (the agent's exit)."""
        self.drop_mappings()
        if self.server is not None:
            try:
                self.server.close()
            except Exception:
                log.exception("closing the replica server failed")
        if self.store is not None:
            self.store.close()
            cfg = self.st.cfg  # and any file a transfer cut short left
            prefix = names.slot_prefix(cfg.job, cfg.node) + "rep."
            with contextlib.suppress(OSError):
                for name in os.listdir(cfg.shm_dir):
                    if name.startswith(prefix):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(cfg.shm_dir, name))

    # -- sender side -------------------------------------------------------------------------
    def world_nodes(self) -> list[str]:
        return sorted({self.st.cfg.node, *self.peers})

    def send_loop(self) -> None:
        """Sends what a target lacks whenever ``wake`` says there may be something (a hash was
        recorded, the peers or the world changed, the stop); a target that failed is tried
        again when its back-off ends (the wait ends then); otherwise it looks again every
        ``poll_interval`` only (a safety net, and the pruning of replicas that a departed
        machine pushed after its departure was noted)."""
        lower_thread_priority()  # background work, like hashing and persisting: never the trainer's
        while not self.st.stopping.is_set():
            self.wake.wait(self._next_wait())
            self.wake.clear()
            if self.st.stopping.is_set():
                break
            self.prune()
            if not self.sending:
                continue
            try:
                while not self.st.stopping.is_set() and self.send_one():
                    pass
            except Exception:  # the daemon lives on
                log.exception("replicating snapshots failed")

    def _next_wait(self) -> float:
        """Seconds the sender may sleep uninvited: until the first back-off still running ends
        (a retry due), ``poll_interval`` at most. A retry time already past is not waited for:
        its target was tried at the last wake, or nothing is left to send to it."""
        now = time.monotonic()
        with self._lock:
            due = [t - now for t in self._retry_at.values() if t > now]
        return max(0.05, min([self.st.cfg.poll_interval, *due]))

    def set_peers(self, peers: Mapping[str, tuple[str, int]]) -> list[str]:
        """Replaces the peer list (the launcher's, at each rendezvous round); returns the new
        targets. Thread-safe: the sender picks the new list at its next transfer.

        Every rank's newest snapshot is sent again (a machine that joined, or came back under
        the same id with an empty memory, lacks it). Replicas of machines no longer in the
        world are dropped by :meth:`prune_departed` once the new world has a complete snapshot
        here: a replacement of a lost machine restores its ranks from them first.

        Raises:
            ValueError: an invalid node id or port, more than ``MAX_PEERS`` machines, or this
                machine's own node among them (a replica never sits on the machine it protects).
        """
        if len(peers) > MAX_PEERS:
            raise ValueError(f"replica peers: {len(peers)} machines, more than {MAX_PEERS}")
        new: dict[str, tuple[str, int]] = {}
        for node, (host, port) in peers.items():
            check_name("node", node)
            if node == self.st.cfg.node:
                raise ValueError(
                    f"replica peers name this machine's own node {node!r}: a replica must sit "
                    "on another machine; list only the other machines of the world"
                )
            if not host or not isinstance(port, int) or not 1 <= port <= 65535:
                raise ValueError(f"replica peer {node!r}: {host!r}:{port!r} is not host:port")
            new[node] = (str(host), port)
        with self.st.lock:
            world = self.st.world_id
        with self._lock:
            old, self.peers = self.peers, new
            self._dynamic = True
            self._known |= set(new)
            self._peers_world = world
            # Sent again to every target: the transfer state of the old list is forgotten.
            self._done.clear()
            self.sent = {k: v for k, v in self.sent.items() if k[0] in new}
            self._retry_at = {t: v for t, v in self._retry_at.items() if t in new}
            self._backoff = {t: v for t, v in self._backoff.items() if t in new}
        targets = replica_targets(self.world_nodes(), self.st.cfg.node, self.st.cfg.replicas)
        if old != new:
            log.info(
                "replica peers now %s (were %s); sending to %s",
                ", ".join(f"{n}={host_port(h, p)}" for n, (h, p) in sorted(new.items())) or "none",
                ", ".join(sorted(old)) or "none",
                ", ".join(targets) or "nobody",
            )
        self.wake.set()
        self.prune()
        return targets if self.sending else []

    def prune(self) -> None:
        """Drops the held replicas that protect nobody any more (:meth:`prune_departed`,
        :meth:`prune_stale_worlds`)."""
        self.prune_departed()
        self.prune_stale_worlds()

    def prune_stale_worlds(self) -> None:
        """Drops the held replicas of an older world that no push of the current world will
        replace: their sender is still in the world, but it no longer sends here (the ring of
        machines changed), or its ranks were numbered anew (it sent replicas of the current
        world here of two steps already, a whole round, none under that rank). Only with the
        launcher's peer list (the world is known) and once this machine's trainers have a
        complete snapshot of the current world, as for :meth:`prune_departed`. Left alone, such
        a replica held its room until its sender left, and its bytes counted against this
        machine's own slots at the next alloc."""
        store, cfg = self.store, self.st.cfg
        with self._lock:
            dynamic = self._dynamic
        if store is None or not dynamic or cfg.replicas == 0:
            return
        with self.st.lock:
            world = self.st.world_id
        held = store.held()
        if world is None or all(h.header.world == world for h in held):
            return
        if not self.candidates():
            return  # the current world has no snapshot here yet
        nodes = self.world_nodes()
        # Sender -> steps of the current world seen held from it (at this and earlier calls:
        # a rank's replica replaces the previous one, so one look sees one step per rank).
        with self._lock:
            if self._seen_world != world:
                self._seen_world, self._seen_steps = world, {}
            for h in held:
                if h.header.world == world:
                    steps = self._seen_steps.setdefault(h.header.sender_node, set())
                    if len(steps) < 2:
                        steps.add(h.header.step)
            current = {n: set(v) for n, v in self._seen_steps.items()}

        def stale(h: HeldReplica) -> bool:
            sender = h.header.sender_node
            if h.header.world == world or sender not in nodes:
                return False  # current, or departed (prune_departed's)
            if cfg.node not in replica_targets(nodes, sender, cfg.replicas):
                return True
            return len(current.get(sender, ())) >= 2

        for h in store.drop_where(stale):
            log.info(
                "dropped the replica of %s rank %d step %d of world %r: no push of world %r "
                "replaces it",
                h.header.sender_node,
                h.header.rank,
                h.header.step,
                h.header.world,
                world,
            )

    def prune_departed(self) -> None:
        """Drops the held replicas of machines that left the world: they protect nobody now.

        With a fixed peer list (``replica_peers``), every sender not in it. With the launcher's
        (:meth:`set_peers`), only machines that were in an earlier list and are not in this one
        (a newcomer may send before this agent hears of it), and only once the trainers of this
        machine have a complete snapshot of a world newer than the one of that change: until
        then a replacement may restore the lost machine's ranks from its replica. Without a peer
        list this agent does not know the world: it keeps what it was sent."""
        store = self.store
        with self._lock:
            peers, dynamic, known, since = self.peers, self._dynamic, self._known, self._peers_world
            departed = known - set(peers)
        if store is None or not (peers or dynamic):
            return
        keep = set(self.world_nodes())
        if dynamic:
            held = {h.header.sender_node for h in store.held()}
            if not held & departed:
                return
            with self.st.lock:
                world = self.st.world_id
            if world is None or world == since or not self.candidates():
                return  # the new world has no snapshot here yet
            keep |= held - departed
        for h in store.prune(keep):
            log.info(
                "dropped the replica of %s rank %d step %d: no longer in the world",
                h.header.sender_node,
                h.header.rank,
                h.header.step,
            )

    def _snap_ident(self, slot: Slot, info: SlotInfo) -> tuple[str, int] | None:
        """(world id, global rank) of a complete snapshot (cached per slot generation)."""
        tag = (info.seq, info.step, info.meta_crc)
        cached = self._metas.get(slot.path)
        if cached is not None and cached[0] == tag:
            return cached[1]
        meta = read_meta(slot, info)
        ident = (meta.world_id, meta.rank) if meta is not None else None
        self._metas[slot.path] = (tag, ident)
        return ident

    def candidates(self) -> list[tuple[str, int, SlotInfo, str]]:
        """The newest complete, hashed snapshot of each local rank of the current world:
        (slot path, global rank, header, world id). A rank whose newest snapshot is not hashed
        yet has none (its older one is never sent instead)."""
        with self.st.lock:
            world = self.st.world_id
            recs = [
                (r.world_id, [s for s in r.slots if s is not None]) for r in self.st.ranks.values()
            ]
        out = []
        for rec_world, slots in recs:
            if world is None or rec_world != world:
                continue
            best: tuple[Slot, SlotInfo] | None = None
            for s in slots:
                try:
                    info = s.header()
                except ValueError:  # closed (reallocated) meanwhile
                    continue
                if info is None or not info.complete:
                    continue
                if (s.path, info.seq) in self.st.corrupt:
                    continue
                if best is None or info.step > best[1].step:
                    best = (s, info)
            if best is None:
                continue
            s, info = best
            try:
                if s.recorded_hash(info) is None:
                    continue
                ident = self._snap_ident(s, info)
            except ValueError:
                continue
            if ident is None or ident[0] != world:
                continue
            out.append((s.path, ident[1], info, world))
        return out

    def send_one(self) -> bool:
        """Sends one replica that a target lacks; whether one was attempted."""
        cfg = self.st.cfg
        peers = self.peers  # one consistent list for this pass (set_peers replaces it whole)
        targets = replica_targets(sorted({cfg.node, *peers}), cfg.node, cfg.replicas)
        now = time.monotonic()
        self._drop_stale_mappings()
        for path, rank, info, world in self.candidates():
            for target in targets:
                key = (target, rank)
                with self._lock:
                    done = self._done.get(key) == (path, info.seq, info.step)
                    retry_at = self._retry_at.get(target, 0.0)
                if done or now < retry_at:
                    continue
                self.push(target, peers[target], path, rank, info, world)
                return True
        return False

    def push(
        self,
        target: str,
        addr: tuple[str, int],
        path: str,
        rank: int,
        info: SlotInfo,
        world: str,
    ) -> None:
        cfg = self.st.cfg
        key = (target, rank)
        try:
            # A mapping of its own: the agent may close (reallocate) its slot meanwhile, and the
            # sender never holds a lock a trainer or the persister waits for.
            slot = self._mapping(path)
        except (OSError, ValueError) as e:
            log.debug("replica of %s not sent: %s", path, e)
            return
        t0 = time.monotonic()
        try:
            now = slot.header()
            if now != info:
                return  # superseded since picked: the next round takes the newer one
            h = push_replica(
                addr,
                slot,
                job=cfg.job,
                node=cfg.node,
                rank=rank,
                world=world,
                info=info,
                pace=self._pacer(slot, info),
            )
        except ReplicaNotReady as e:
            # The holder's trainers have not set up their slots yet (a job's start): soon again,
            # without the failure back-off, so the first snapshot gets its replica.
            with self._lock:
                first = target not in self._not_ready
                self._not_ready.add(target)
                self._retry_at[target] = time.monotonic() + NOT_READY_RETRY_S
            (log.info if first else log.debug)(
                "replica of rank %d step %d to %s: not ready yet, again in %.1f s (%s)",
                rank,
                info.step,
                target,
                NOT_READY_RETRY_S,
                e,
            )
            return
        except (FlashckptError, OSError, ValueError) as e:
            superseded = slot_changed(slot, info)
            if superseded:
                # The trainer overwrote it: the newer snapshot goes next, no failure.
                log.info("replica of rank %d step %d to %s superseded", rank, info.step, target)
                return
            self._failed(target, rank, info.step, f"{type(e).__name__}: {e}")
            return
        dt = time.monotonic() - t0
        with self._lock:
            self._done[key] = (path, info.seq, info.step)
            self.sent[key] = {
                "target": target,
                "rank": rank,
                "step": h.step,
                "bytes": h.data_len,
                "seconds": round(dt, 3),
                "time": time.time(),
            }
            self._backoff.pop(target, None)
            self._retry_at.pop(target, None)
            self._not_ready.discard(target)
        log.info(
            "replica of rank %d step %d (%.1f MiB) sent to %s in %.2f s",
            rank,
            h.step,
            h.data_len / 2**20,
            target,
            dt,
        )

    def _mapping(self, path: str) -> Slot:
        """The sender's own mapping of slot file ``path``, kept from push to push while the
        file is the same (a fresh mapping of a 0.5 GB slot cost ~8,000 page faults, ~0.04
        CPU-s, per push); a file reallocated meanwhile is mapped anew, the old one unmapped."""
        st = os.stat(path)
        ident = (st.st_dev, st.st_ino, st.st_size)
        cached = self._maps.get(path)
        if cached is not None:
            if cached[0] == ident:
                return cached[1]
            del self._maps[path]
            with contextlib.suppress(BufferError, ValueError):
                cached[1].close()
        slot = Slot(path)
        self._maps[path] = (ident, slot)
        return slot

    def _drop_stale_mappings(self) -> None:
        """Unmaps cached mappings of files that are no longer a slot of this machine's ranks
        (a trainer left, a slot was reallocated): their pages are not held on."""
        if not self._maps:
            return
        with self.st.lock:
            live = {s.path for r in self.st.ranks.values() for s in r.slots if s is not None}
        for path in list(self._maps):
            ident, slot = self._maps[path]
            try:
                st = os.stat(path)
                same = (st.st_dev, st.st_ino, st.st_size) == ident
            except OSError:
                same = False
            if not same or path not in live:
                del self._maps[path]
                with contextlib.suppress(BufferError, ValueError):
                    slot.close()

    def drop_mappings(self) -> None:
        """Unmaps every cached slot mapping of the sender (the agent's exit)."""
        for _, slot in list(self._maps.values()):
            with contextlib.suppress(BufferError, ValueError):
                slot.close()
        self._maps.clear()

    def _failed(self, target: str, rank: int, step: int, error: str) -> None:
        with self._lock:
            self.failures += 1
            self.errors.append(
                {"target": target, "rank": rank, "step": step, "error": error, "time": time.time()}
            )
            del self.errors[:-20]
            back = min(MAX_BACKOFF_S, max(self._backoff.get(target, 0.0) * 2, 0.5))
            self._backoff[target] = back
            self._retry_at[target] = time.monotonic() + back
        log.warning(
            "replica of rank %d step %d to %s failed (retry in %.1f s): %s",
            rank,
            step,
            target,
            back,
            error,
        )

    def _pacer(self, sent: Slot, info: SlotInfo) -> Any:
        """Between chunks: gives way while a trainer copies into a slot of this machine (its
        seq is odd) or waits for one (wanted), at most :data:`PACE_WAIT_S` per pause; stops the
        transfer when the agent stops or the trainer overwrites the slot being sent."""

        def pace() -> None:
            deadline = time.monotonic() + PACE_WAIT_S
            while True:
                if self.st.stopping.is_set():
                    raise ReplicaError("the agent is stopping: transfer abandoned")
                if sent.seq() != info.seq:
                    raise ReplicaError("overwritten by a newer snapshot: transfer abandoned")
                if not self._trainer_busy() or time.monotonic() >= deadline:
                    return
                time.sleep(0.005)

        return pace

    def _trainer_busy(self) -> bool:
        with self.st.lock:
            slots = [s for r in self.st.ranks.values() for s in r.slots if s is not None]
        for s in slots:
            with contextlib.suppress(ValueError):  # closed meanwhile
                if s.seq() % 2 == 1 or s.wanted():
                    return True
        return False

    def status(self) -> dict[str, Any] | None:
        """Replicas sent and held (the agent's ``status`` reply)."""
        if self.listen is None and not self.sending:
            return None
        with self._lock:
            sent = [dict(v) for _, v in sorted(self.sent.items())]
            errors = list(self.errors[-10:])
            failures = self.failures
        held = []
        if self.store is not None:
            for h in self.store.held():
                held.append(
                    {
                        "sender": h.header.sender_node,
                        "rank": h.header.rank,
                        "step": h.header.step,
                        "world_id": h.header.world,
                        "bytes": h.header.data_len,
                    }
                )
        server = self.server
        peers = self.peers
        return {
            "replicas": self.st.cfg.replicas,
            "listen": host_port(*server.address) if server is not None else None,
            "peers": {n: host_port(h, p) for n, (h, p) in sorted(peers.items())},
            "targets": (
                replica_targets(self.world_nodes(), self.st.cfg.node, self.st.cfg.replicas)
                if self.sending
                else []
            ),
            "limit_bytes": self.store.limit_bytes if self.store is not None else 0,
            "spare_bytes": self.store.spare_bytes() if self.store is not None else 0,
            "sent": sent,
            "held": held,
            "failures": failures,
            "errors": errors,
            "refused": list(server.errors[-10:]) if server is not None else [],
        }


def slot_changed(slot: Slot, info: SlotInfo) -> bool:
    try:
        return slot.seq() != info.seq
    except ValueError:
        return True

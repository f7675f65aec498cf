"""Replicas of snapshots in another machine's memory: the transport between node agents.

A fully sharded job that loses a machine loses that machine's shards from memory; a copy of each
machine's newest snapshot in another machine's shared memory lets the replacement restore without
storage. This module is the part of that between two agents:

- :func:`push_replica` streams one complete, hashed snapshot slot to a peer agent's
  :class:`ReplicaServer`, straight from the slot, in bounded chunks, with an optional ``pace``
  callback between chunks (the agent passes one that yields while a trainer copies);
- the server admits it only after checking it (job, that it does not protect the holder's own
  machine, bounds, that it is newer than what is held, room in ``limit_bytes`` and in the tmpfs),
  writes it into a slot file of the same format as a trainer's slot (:mod:`flashckpt.format.shm`),
  hashes the bytes as they arrive and keeps it only if the hash equals the sender's: a torn or
  corrupted transfer leaves nothing behind. One replica per (sender machine, rank): a newer step
  replaces the older one (the older stays valid until the newer is complete), never accumulates;
- :func:`fetch_replica` reads a held replica back from a peer (the restore side) and verifies its
  hash before handing it over (:class:`~flashckpt.errors.CorruptSnapshotError` on mismatch,
  naming rank, step and source).

Nothing read from the socket is trusted: every frame is bounded and validated in
:meth:`ReplicaHeader.from_json` and :func:`_recv_frame`. No pickle. Torch-free (the agent imports
it). :func:`replica_targets` picks where a machine's replicas go: the next machines in ring order
of the current world, never the machine itself.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import xxhash

from flashckpt.errors import AgentDaemonError, CorruptSnapshotError, ShmSpaceError
from flashckpt.format.shm import (
    Slot,
    SlotInfo,
    allocate_slot_file,
    buffer_address,
    exchange_files,
    prefault,
    round_up,
    shm_free_bytes,
)
from flashckpt.names import check_name, replica_path

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FetchedReplica",
    "HeldReplica",
    "ReplicaError",
    "ReplicaHeader",
    "ReplicaNotReady",
    "ReplicaServer",
    "ReplicaStore",
    "check_replica_capacity",
    "fetch_replica",
    "host_port",
    "push_replica",
    "query_replicas",
    "replica_targets",
]

FRAME_MAGIC = b"FCRPL001"
_FRAME = struct.Struct("<8sI")
MAX_FRAME = 64 * 1024
"""A control frame (JSON) is never longer than this: bounds what a peer can make us buffer."""
MAX_META = 64 * 2**20
"""A snapshot description larger than this is refused (a trainer's is KiB to a few MiB)."""
MAX_RANK = 2**20
MAX_QUERY = 64
"""The most held replicas one ``query`` answer lists (the newest first): bounds the frame."""
DEFAULT_CHUNK_BYTES = 8 * 2**20
_U64 = 2**64


class ReplicaError(AgentDaemonError):
    """A peer refused a replica, or a transfer failed; the message says why and what to do."""


class ReplicaHashMismatch(ReplicaError):
    """The bytes a holder received do not hash to the sender's recorded hash."""


class ReplicaNotReady(ReplicaError):
    """The holder cannot size its replica room yet (its own trainers have not set up their
    slots): not a failure; the sender tries again shortly."""


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:7070``): the form the agent's
    ``--replica-listen`` and ``--replica-peers`` parse back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- framing -----------------------------------------------------------------------------------


def _send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_FRAME:
        raise ValueError(f"replica control frame of {len(body)} B exceeds {MAX_FRAME} B")
    sock.sendall(_FRAME.pack(FRAME_MAGIC, len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection ({got} of {n} bytes received)")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> dict[str, Any]:
    magic, length = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if magic != FRAME_MAGIC:
        raise ReplicaError(f"not a flashckpt replica peer (bad frame magic {magic!r})")
    if length > MAX_FRAME:
        raise ReplicaError(f"replica control frame of {length} B exceeds {MAX_FRAME} B")
    try:
        obj = json.loads(_recv_exact(sock, length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReplicaError(f"replica control frame is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ReplicaError("replica control frame is not a JSON object")
    return obj


def _recv_into(
    sock: socket.socket, view: memoryview, hasher: Any, chunk: int, pace: Callable[[], None] | None
) -> None:
    got, n = 0, len(view)
    while got < n:
        want = min(chunk, n - got)
        end = got + want
        while got < end:
            k = sock.recv_into(view[got:end], end - got)
            if k == 0:
                raise ConnectionError(f"peer closed the connection ({got} of {n} bytes received)")
            got += k
        hasher.update(view[end - want : end])
        if pace is not None:
            pace()


def _send_from(
    sock: socket.socket,
    view: memoryview,
    chunk: int,
    pace: Callable[[], None] | None,
) -> None:
    for off in range(0, len(view), chunk):
        sock.sendall(view[off : off + chunk])
        if pace is not None:
            pace()


# -- the header --------------------------------------------------------------------------------


def _int(obj: Any, key: str, lo: int, hi: int) -> int:
    v = getattr(obj, key)
    if type(v) is not int or not lo <= v < hi:
        raise ReplicaError(
            f"replica header field {key!r} = {v!r} is not an integer in [{lo}, {hi})"
        )
    return v


@dataclass(frozen=True, slots=True)
class ReplicaHeader:
    """What a replica is: which snapshot of which rank of which machine, and how to check it."""

    job: str
    """The job id (a holder refuses replicas of another job)."""
    sender_node: str
    """The machine whose snapshot this is (the one it protects)."""
    rank: int
    """The sender's global rank whose slot this is."""
    step: int
    """The snapshot's step (steps done)."""
    world: str
    """The world id the snapshot was taken in (restore checks it matches; "" without the
    elastic launcher)."""
    seq: int
    """The sender slot's sequence number of the snapshot (even: complete)."""
    meta_len: int
    """Bytes of the snapshot description (JSON) that follow the header."""
    data_len: int
    """Bytes of tensor data that follow the description."""
    data_hash: int
    """xxh3_64 of the data bytes, as recorded by the sender's agent."""
    time_complete: float
    """When the snapshot completed on the sender (seconds since the epoch)."""

    def __post_init__(self) -> None:
        check_name("job", self.job)
        check_name("node", self.sender_node)
        for key, lo, hi in (
            ("rank", 0, MAX_RANK),
            ("step", 0, 2**62),
            ("seq", 0, _U64),
            ("meta_len", 0, MAX_META + 1),
            ("data_len", 0, 2**62),
            ("data_hash", 0, _U64),
        ):
            _int(self, key, lo, hi)
        # "" is the world of a job run without the elastic launcher (no rendezvous rounds).
        if not isinstance(self.world, str) or len(self.world) > 256:
            raise ReplicaError("replica header: world must be a string of at most 256 characters")
        if not isinstance(self.time_complete, float) or not math.isfinite(self.time_complete):
            raise ReplicaError("replica header: time_complete must be a finite number")

    @property
    def nbytes(self) -> int:
        """Bytes a holder needs for it (a slot file of its size)."""
        return 4096 + round_up(max(self.meta_len, 4096)) + round_up(max(self.data_len, 4096))

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "sender_node": self.sender_node,
            "rank": self.rank,
            "step": self.step,
            "world": self.world,
            "seq": self.seq,
            "meta_len": self.meta_len,
            "data_len": self.data_len,
            "data_hash": self.data_hash,
            "time_complete": self.time_complete,
        }

    @classmethod
    def from_json(cls, obj: Any) -> ReplicaHeader:
        """The header from untrusted JSON; :class:`ReplicaError` names the bad field."""
        if not isinstance(obj, dict):
            raise ReplicaError("replica header is not a JSON object")
        for key in ("job", "sender_node", "world"):
            if not isinstance(obj.get(key), str):
                raise ReplicaError(f"replica header field {key!r} is missing or not a string")
        t = obj.get("time_complete")
        if not isinstance(t, (int, float)) or isinstance(t, bool):
            raise ReplicaError("replica header field 'time_complete' is not a number")
        try:
            return cls(
                job=obj["job"],
                sender_node=obj["sender_node"],
                rank=obj.get("rank"),  # type: ignore[arg-type]  # checked in __post_init__
                step=obj.get("step"),  # type: ignore[arg-type]
                world=obj["world"],
                seq=obj.get("seq"),  # type: ignore[arg-type]
                meta_len=obj.get("meta_len"),  # type: ignore[arg-type]
                data_len=obj.get("data_len"),  # type: ignore[arg-type]
                data_hash=obj.get("data_hash"),  # type: ignore[arg-type]
                time_complete=float(t),
            )
        except ValueError as e:  # check_name
            raise ReplicaError(f"replica header: {e}") from None


# -- where replicas go -------------------------------------------------------------------------


def replica_targets(nodes: Iterable[str], me: str, replicas: int) -> list[str]:
    """The machines that hold ``me``'s replicas: the next ``replicas`` in ring order of the
    sorted machine ids of the current world, never ``me`` (fewer when the world is smaller).
    Re-derived from the world each round, so every agent agrees without talking."""
    ring = sorted(set(nodes))
    if me not in ring:
        raise ValueError(f"machine {me!r} is not in the world {ring}")
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, not {replicas}")
    i = ring.index(me)
    count = min(replicas, len(ring) - 1)
    return [ring[(i + k) % len(ring)] for k in range(1, count + 1)]


def check_replica_capacity(
    shm_dir: str, own_bytes: int, replica_bytes: int, *, present_bytes: int = 0
) -> None:
    """Up front, before any snapshot: can this machine's tmpfs hold its own slots plus the
    replicas it will receive? :class:`ShmSpaceError` with the numbers if not (never a SIGBUS or a
    refused replica later). ``present_bytes``: how much of the two is in the tmpfs already
    (slot files and replicas that exist: their room counts as available)."""
    free = shm_free_bytes(shm_dir) + present_bytes
    need = own_bytes + replica_bytes
    if need > free:
        raise ShmSpaceError(
            f"{shm_dir} has {free / 2**20:.1f} MiB available but this machine needs "
            f"{own_bytes / 2**20:.1f} MiB for its own snapshot slots plus "
            f"{replica_bytes / 2**20:.1f} MiB for the replicas of other machines it holds. "
            "Enlarge the tmpfs, or lower replicas= (0 turns replication off)."
        )


# -- the holder --------------------------------------------------------------------------------


def _supersedes(old: ReplicaHeader, new: ReplicaHeader) -> str | None:
    """Why ``new`` (same sender machine and rank as the held ``old``) must not replace it, or
    None.

    Within one world the steps only grow: an older step is refused (a late, slow transfer).
    A snapshot of another world (the world id changed: a rendezvous round, a restart) replaces
    the held one whatever its step: after a rollback (restored from an older step, storage
    fallback) the new world's steps are lower than the abandoned timeline's, and refusing them
    would leave only the abandoned timeline's replica for a later loss. Which of two worlds is
    the newer is told by when the snapshot completed on the sender (both times are of the same
    machine's clock): a late push of the world that ended is refused."""
    if new.world == old.world:
        if new.step < old.step:
            return (
                f"holds step {old.step} of {old.sender_node!r} rank {old.rank} (world "
                f"{old.world!r}); step {new.step} of the same world is older"
            )
        return None
    if new.time_complete < old.time_complete:
        return (
            f"holds step {old.step} of {old.sender_node!r} rank {old.rank} of world "
            f"{old.world!r}, taken after this snapshot of world {new.world!r} (step {new.step}): "
            "a snapshot of the world that ended is not kept over the newer one"
        )
    return None


@dataclass(frozen=True, slots=True)
class HeldReplica:
    """A replica this machine holds."""

    header: ReplicaHeader
    """What it is."""
    path: str
    """Its slot file (same format as a trainer's slot; the hash record is set)."""


class ReplicaStore:
    """The replicas one agent holds for other machines, in slot files in its tmpfs.

    Args:
        shm_dir: the tmpfs (the agent's ``--shm-dir``).
        job: the job id; replicas of other jobs are refused.
        node: this machine's id; replicas that claim to protect it are refused.
        limit_bytes: the most bytes of replicas held at once (checked before a transfer starts).
        pending: the limit derives from this machine's own slots, not known yet: until
            :meth:`set_limit`, pushes are refused with :class:`ReplicaNotReady` (the sender
            retries soon) rather than as "no room" (a failure, retried with a growing back-off,
            which left a job's first snapshot without its replica).
    """

    def __init__(
        self, shm_dir: str, job: str, node: str, limit_bytes: int, *, pending: bool = False
    ) -> None:
        self.shm_dir = shm_dir
        self.job = check_name("job", job)
        self.node = check_name("node", node)
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, not {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.pending = pending
        self._lock = threading.Lock()
        self._held: dict[tuple[str, int], HeldReplica] = {}
        self._incoming: dict[tuple[str, int], int] = {}  # bytes reserved by transfers under way
        # Each held replica's file stays mapped, and the file a newer one replaced is kept
        # (mapped) as the next push's target: a push then writes into pages that exist and are
        # mapped, where a new file cost its allocation, a page fault per page and the old file's
        # release (~0.3 of ~0.5 CPU-s per 0.5 GB received). A spare only holds room a transfer
        # needs anyway (old and new coexist until the new one is complete); it is released
        # whenever the room is wanted (drop_spares) and is never counted as held.
        self._maps: dict[tuple[str, int], Slot] = {}
        self._spares: dict[tuple[str, int], Slot] = {}

    def set_limit(self, limit_bytes: int) -> None:
        """Sets the limit (a derived one, once the own slots are known); pushes are admitted
        from now on."""
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, not {limit_bytes}")
        with self._lock:
            self.limit_bytes = limit_bytes
            self.pending = False

    def held(self) -> list[HeldReplica]:
        with self._lock:
            return sorted(self._held.values(), key=lambda h: (h.header.sender_node, h.header.rank))

    def get(self, sender_node: str, rank: int) -> HeldReplica | None:
        with self._lock:
            return self._held.get((sender_node, rank))

    def spare_bytes(self) -> int:
        with self._lock:
            return sum(sp.size for sp in self._spares.values())

    def drop_spares(self) -> int:
        """Releases every spare file (their room is wanted); returns the bytes freed."""
        with self._lock:
            spares, self._spares = list(self._spares.values()), {}
        freed = 0
        for sp in spares:
            freed += sp.size
            _discard(sp)
        return freed

    def held_bytes(self) -> int:
        with self._lock:
            return sum(h.header.nbytes for h in self._held.values()) + sum(self._incoming.values())

    def _admit(self, h: ReplicaHeader, dropped: bool = False) -> str | None:
        """Why ``h`` is refused, or None (then its bytes are reserved). Raises
        :class:`ReplicaNotReady` while the limit is pending."""
        if h.job != self.job:
            return f"replica of job {h.job!r} sent to an agent of job {self.job!r}"
        if h.sender_node == self.node:
            return (
                f"machine {self.node!r} was sent a replica of its own snapshot: a replica must "
                "sit on another machine than the one it protects"
            )
        key = (h.sender_node, h.rank)
        with self._lock:
            if self.pending:
                raise ReplicaNotReady(
                    f"machine {self.node!r} cannot hold replicas yet: its replica room derives "
                    "from its own trainers' slots, which are not set up yet"
                )
            if key in self._incoming:
                return f"a replica of {h.sender_node!r} rank {h.rank} is already being received"
            old = self._held.get(key)
            why = _supersedes(old.header, h) if old is not None else None
            if why is not None:
                return why
            held = sum(x.header.nbytes for k, x in self._held.items() if k != key)
            held += sum(self._incoming.values())
            if held + h.nbytes > self.limit_bytes:
                return (
                    f"no room: holds {held / 2**20:.1f} MiB of replicas, this one needs "
                    f"{h.nbytes / 2**20:.1f} MiB, the limit is {self.limit_bytes / 2**20:.1f} MiB"
                )
            free = shm_free_bytes(self.shm_dir)
            spare = self._spares.get(key)
            if spare is not None and spare.size == h.nbytes:
                free += spare.size  # this push writes into it
            if h.nbytes > free:
                if not self._spares or dropped:
                    return (
                        f"{self.shm_dir} has {free / 2**20:.1f} MiB free, the replica needs "
                        f"{h.nbytes / 2**20:.1f} MiB"
                    )
            else:
                self._incoming[key] = h.nbytes
                return None
        self.drop_spares()  # their room is wanted: released, then asked again
        return self._admit(h, dropped=True)

    def receive(
        self,
        h: ReplicaHeader,
        sock: socket.socket,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        pace: Callable[[], None] | None = None,
    ) -> HeldReplica:
        """Reads the description and data of an admitted ``h`` from ``sock`` into a new slot
        file and keeps it if the data hashes to ``h.data_hash`` and the sender ends with "ok";
        else removes the file and raises :class:`ReplicaError`. The older replica of the same
        (machine, rank) is replaced only once the newer one is complete."""
        key = (h.sender_node, h.rank)
        final = replica_path(self.shm_dir, self.job, self.node, h.sender_node, h.rank)
        incoming = final + ".in"
        with self._lock:
            slot: Slot | None = self._spares.pop(key, None)
        try:
            if slot is not None and slot.size == h.nbytes:
                os.rename(slot.path, incoming)  # the mapping stays valid across the rename
                slot.path = incoming
            else:
                if slot is not None:
                    _discard(slot)
                allocate_slot_file(incoming, h.meta_len, h.data_len)
                slot = Slot(incoming)
                # One madvise maps every page now instead of a fault per page as bytes arrive.
                addr = buffer_address(slot.buf)
                if addr is not None:
                    prefault(addr, slot.size)
            seq = slot.begin_write()
            meta = _recv_exact(sock, h.meta_len)
            slot.write_meta(meta)
            hasher = xxhash.xxh3_64()
            _recv_into(sock, slot.data(h.data_len), hasher, chunk_bytes, pace)
            end = _recv_frame(sock)
            if end.get("end") != "ok":
                raise ReplicaError(
                    f"the sender aborted the replica of {h.sender_node!r} rank {h.rank} step "
                    f"{h.step}: {_abort_why(end)}"
                )
            got = int(hasher.intdigest())
            if got != h.data_hash:
                raise ReplicaHashMismatch(
                    f"replica of {h.sender_node!r} rank {h.rank} step {h.step}: data hash "
                    f"{got:016x} != {h.data_hash:016x} sent (corrupted in transfer, or in the "
                    "sender's memory since it was hashed); discarded"
                )
            slot.end_write(seq, h.step, meta, h.data_len)
            slot.record_hash(seq + 1, got)
            with self._lock:
                old = self._maps.pop(key, None)
            swapped = False
            if old is not None:
                try:
                    # One step: a fetch of `final` sees the old replica or the new one, never
                    # none; the old one's file is then at `incoming`.
                    swapped = exchange_files(incoming, final)
                except OSError:
                    swapped = False
            if not swapped:
                os.replace(incoming, final)
        except BaseException:
            if slot is not None:
                _discard(slot)
            with contextlib.suppress(OSError):
                os.unlink(incoming)
            with self._lock:
                self._incoming.pop(key, None)
            raise
        slot.path = final
        held = HeldReplica(h, final)
        with self._lock:
            self._incoming.pop(key, None)
            self._held[key] = held
            self._maps[key] = slot
        if old is not None:
            self._keep_spare(key, old, incoming if swapped else None)
        return held

    def _keep_spare(self, key: tuple[str, int], old: Slot, path: str | None) -> None:
        """The replaced replica ``old`` (its file at ``path``; None: already unlinked by the
        replacing rename) becomes ``key``'s spare; a fetch still sending it notices the next
        push's rewrite by its seq and aborts."""
        if path is None:
            with contextlib.suppress(BufferError, ValueError):
                old.close()
            return
        spare = replica_path(self.shm_dir, self.job, self.node, *key) + ".spare"
        try:
            os.rename(path, spare)
        except OSError:
            old.path = path
            _discard(old)
            return
        old.path = spare
        with self._lock:
            if key in self._held and key not in self._spares:  # not pruned meanwhile
                self._spares[key] = old
                return
        _discard(old)

    def prune(self, keep_nodes: Iterable[str]) -> list[HeldReplica]:
        """Drops the replicas of machines no longer in the world; returns what was dropped."""
        keep = set(keep_nodes)
        return self.drop_where(lambda h: h.header.sender_node not in keep)

    def drop_where(self, doomed: Callable[[HeldReplica], bool]) -> list[HeldReplica]:
        """Drops the held replicas for which ``doomed`` is true (their spares too); returns
        what was dropped."""
        with self._lock:
            gone = [h for h in self._held.values() if doomed(h)]
            maps = []
            for h in gone:
                key = (h.header.sender_node, h.header.rank)
                del self._held[key]
                maps += [m for m in (self._maps.pop(key, None), self._spares.pop(key, None)) if m]
        for m in maps:
            _discard(m)
        for h in gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(h.path)
        return gone

    def close(self) -> None:
        """Removes every replica file (the agent's exit)."""
        self.prune(())
        self.drop_spares()


def _discard(slot: Slot) -> None:
    """Unmaps ``slot`` and removes its file."""
    with contextlib.suppress(BufferError, ValueError):
        slot.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(slot.path)


# -- the sender --------------------------------------------------------------------------------


def _slot_snapshot(slot: Slot, info: SlotInfo | None) -> tuple[SlotInfo, bytes, int]:
    """A complete, hashed snapshot's header, description bytes and recorded hash."""
    info = info if info is not None else slot.header()
    if info is None or not info.complete:
        raise ReplicaError(f"{slot.path}: no complete snapshot to replicate")
    if info.meta_len > slot.meta_cap or info.data_len > slot.data_cap:
        raise ReplicaError(f"{slot.path}: header lengths exceed the slot (corrupted)")
    want = slot.recorded_hash(info)
    if want is None:
        raise ReplicaError(
            f"{slot.path}: step {info.step} has no data hash yet; the agent replicates a "
            "snapshot only after hashing it"
        )
    meta = bytes(slot.buf[slot.meta_off : slot.meta_off + info.meta_len])
    if slot.seq() != info.seq:
        raise ReplicaError(f"{slot.path}: step {info.step} was overwritten while being read")
    return info, meta, want


def _connect(addr: tuple[str, int], timeout: float) -> socket.socket:
    sock = socket.create_connection(addr, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def push_replica(
    addr: tuple[str, int],
    slot: Slot,
    *,
    job: str,
    node: str,
    rank: int,
    world: str,
    info: SlotInfo | None = None,
    timeout: float = 60.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    pace: Callable[[], None] | None = None,
) -> ReplicaHeader:
    """Streams the complete, hashed snapshot in ``slot`` (of ``rank`` on machine ``node``) to
    the replica server at ``addr``. If the trainer overwrites the slot meanwhile, the transfer is
    aborted (the holder keeps its older replica). Raises :class:`ReplicaError` when the holder
    refuses it or the transfer fails."""
    info, meta, data_hash = _slot_snapshot(slot, info)
    h = ReplicaHeader(
        job=job,
        sender_node=node,
        rank=rank,
        step=info.step,
        world=world,
        seq=info.seq,
        meta_len=len(meta),
        data_len=info.data_len,
        data_hash=data_hash,
        time_complete=float(info.time_complete),
    )
    try:
        with _connect(addr, timeout) as sock:
            _send_frame(sock, {"op": "push", "header": h.to_json()})
            reply = _recv_frame(sock)
            if reply.get("go") is not True:
                cls = ReplicaNotReady if reply.get("not_ready") is True else ReplicaError
                raise cls(f"{host_port(*addr)} refused the replica: {_why(reply)}")
            sock.sendall(meta)
            # Not hashed as sent: the holder hashes what it receives against data_hash, which
            # catches a corruption in this machine's memory as well as one in transfer; which
            # of the two is told only when that happens (below). Hashing here too cost the
            # sender a pass over the snapshot (~0.07 CPU-s per 0.5 GB) on every push.
            _send_from(sock, slot.data(info.data_len), chunk_bytes, pace)
            if slot.seq() != info.seq:
                _send_frame(sock, {"end": "abort", "why": "overwritten by a newer snapshot"})
                _recv_frame(sock)
                raise ReplicaError(
                    f"{slot.path}: step {info.step} was overwritten while being sent; aborted"
                )
            _send_frame(sock, {"end": "ok"})
            reply = _recv_frame(sock)
            if reply.get("ok") is not True:
                if reply.get("hash_mismatch") is True and slot.seq() == info.seq:
                    got = int(xxhash.xxh3_64_intdigest(slot.data(info.data_len)))
                    if got != data_hash:
                        raise CorruptSnapshotError(
                            f"{slot.path}: rank {rank} step {info.step} no longer matches its "
                            "data hash (corrupted in this machine's memory); not replicated",
                            rank=rank,
                            step=info.step,
                            source=slot.path,
                        )
                raise ReplicaError(f"{host_port(*addr)} did not keep the replica: {_why(reply)}")
    except OSError as e:
        raise ReplicaError(f"replica transfer to {host_port(*addr)} failed: {e}") from None
    return h


def _why(reply: dict[str, Any]) -> str:
    err = reply.get("error")
    return err[:1000] if isinstance(err, str) else "no reason given"


def _abort_why(end: dict[str, Any]) -> str:
    """The reason of an ``{"end": "abort", "why": ...}`` frame (pushes and fetches alike)."""
    why = end.get("why")
    return why[:1000] if isinstance(why, str) else "no reason given"


# -- the restore side --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FetchedReplica:
    """A replica read back from a peer, its data verified against its hash."""

    header: ReplicaHeader
    """What it is."""
    meta: bytes
    """The snapshot description (JSON bytes, as the trainer wrote it)."""
    data: memoryview
    """The tensor bytes (``header.data_len``), in the buffer ``alloc`` gave (or a new one)."""
    source: str
    """Where it came from (``host:port``), for messages."""


def fetch_replica(
    addr: tuple[str, int],
    *,
    job: str,
    sender_node: str,
    rank: int,
    min_step: int = 0,
    max_bytes: int = 2**40,
    alloc: Callable[[ReplicaHeader], memoryview] | None = None,
    timeout: float = 60.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    phases: dict[str, float] | None = None,
) -> FetchedReplica | None:
    """Reads the replica of ``sender_node``'s ``rank`` held by the agent at ``addr``; None if it
    holds none (of step >= ``min_step``). ``alloc(header)`` gives the buffer for the data
    (e.g. a slot's data region); by default a new bytearray. The data is hashed as it arrives;
    a mismatch raises :class:`CorruptSnapshotError` naming rank, step and source, so the caller
    falls back to its next source. ``phases`` (if given) gets the seconds of each phase:
    ``connect`` (to the holder's answer), ``alloc``, ``recv`` (the bytes received and hashed)."""
    src = host_port(*addr)
    ph = phases if phases is not None else {}
    t = time.perf_counter()
    try:
        with _connect(addr, timeout) as sock:
            _send_frame(
                sock,
                {
                    "op": "fetch",
                    "job": job,
                    "sender_node": sender_node,
                    "rank": rank,
                    "min_step": min_step,
                },
            )
            reply = _recv_frame(sock)
            if reply.get("ok") is not True:
                if reply.get("none") is True:
                    return None
                raise ReplicaError(f"{src} could not serve the replica: {_why(reply)}")
            h = ReplicaHeader.from_json(reply.get("header"))
            if (h.job, h.sender_node, h.rank) != (job, sender_node, rank) or h.step < min_step:
                raise ReplicaError(
                    f"{src} answered with {h.sender_node!r} rank {h.rank} step {h.step} of job "
                    f"{h.job!r} for a request of {sender_node!r} rank {rank} step >= {min_step}"
                )
            if h.data_len > max_bytes:
                raise ReplicaError(
                    f"{src}: replica of {h.data_len} B exceeds the expected {max_bytes} B"
                )
            meta = _recv_exact(sock, h.meta_len)
            ph["connect"] = time.perf_counter() - t
            t = time.perf_counter()
            view = alloc(h) if alloc is not None else memoryview(bytearray(h.data_len))
            ph["alloc"] = time.perf_counter() - t
            t = time.perf_counter()
            if len(view) < h.data_len:
                raise ValueError(f"alloc gave {len(view)} B for a replica of {h.data_len} B")
            view = view[: h.data_len]
            hasher = xxhash.xxh3_64()
            _recv_into(sock, view, hasher, chunk_bytes, None)
            end = _recv_frame(sock)
            ph["recv"] = time.perf_counter() - t
            if end.get("end") != "ok":
                raise ReplicaError(f"{src} aborted sending the replica: {_abort_why(end)}")
    except OSError as e:
        raise ReplicaError(f"replica fetch from {src} failed: {e}") from None
    got = int(hasher.intdigest())
    if got != h.data_hash:
        raise CorruptSnapshotError(
            f"replica of rank {rank} (machine {sender_node!r}) step {h.step} from {src}: data "
            f"hash {got:016x} != recorded {h.data_hash:016x}; not loaded",
            rank=rank,
            step=h.step,
            source=src,
        )
    return FetchedReplica(h, meta, view, src)


def query_replicas(
    addr: tuple[str, int], *, job: str, rank: int, min_step: int = 0, timeout: float = 10.0
) -> list[ReplicaHeader]:
    """The replicas of global rank ``rank`` (of any machine, step >= ``min_step``) that the
    agent at ``addr`` holds, newest first; every header validated (nothing from the socket is
    trusted). Raises :class:`ReplicaError` when the peer refuses or cannot be reached."""
    src = host_port(*addr)
    try:
        with _connect(addr, timeout) as sock:
            _send_frame(sock, {"op": "query", "job": job, "rank": rank, "min_step": min_step})
            reply = _recv_frame(sock)
    except OSError as e:
        raise ReplicaError(f"replica query to {src} failed: {e}") from None
    if reply.get("ok") is not True:
        raise ReplicaError(f"{src} refused the replica query: {_why(reply)}")
    held = reply.get("held")
    if not isinstance(held, list) or len(held) > MAX_QUERY:
        raise ReplicaError(f"{src} answered the replica query with a malformed list")
    out = []
    for raw in held:
        h = ReplicaHeader.from_json(raw)
        if h.job != job or h.rank != rank or h.step < min_step:
            raise ReplicaError(
                f"{src} answered a query of rank {rank} step >= {min_step} of job {job!r} with "
                f"{h.sender_node!r} rank {h.rank} step {h.step} of job {h.job!r}"
            )
        out.append(h)
    return sorted(out, key=lambda h: (-h.step, h.sender_node))


# -- the server --------------------------------------------------------------------------------


def _family(host: str, port: int) -> socket.AddressFamily:
    """The address family of the address to listen on: IPv6 for an IPv6 address (``::1``,
    ``::``) or a name that resolves only to one, else IPv4."""
    if ":" in host:
        return socket.AF_INET6
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve the replica server's address {host!r}: {e}") from None
    families = {i[0] for i in infos}
    return socket.AF_INET if socket.AF_INET in families or not families else socket.AF_INET6


class ReplicaServer:
    """Accepts replicas from peer agents and serves held ones back, on a TCP port.

    Args:
        store: where replicas are kept.
        host: the address to listen on (the machine's address on the cluster network).
        port: 0 asks the OS for a free port (see :attr:`address`).
        max_connections: transfers served at once; more wait in the listen queue.
        timeout: a peer silent this long is dropped (its partial replica removed).
        pace: called between received chunks (bounded, yielding background work).
        background: called on the thread that receives a push before it takes a byte: the
            agent lowers that thread's priority (receiving another machine's replica is
            background work, like hashing and persisting; serving a restore's ``fetch`` and
            ``query`` is not, and runs at the agent's priority).
    """

    def __init__(
        self,
        store: ReplicaStore,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int = 4,
        timeout: float = 60.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        pace: Callable[[], None] | None = None,
        background: Callable[[], object] | None = None,
    ) -> None:
        self.store = store
        self.background = background
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.pace = pace
        self.errors: list[str] = []
        """The last refusals and failed transfers (newest last, bounded), for status/logs."""
        self._sock = socket.create_server((host, port), family=_family(host, port), backlog=16)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._accept = threading.Thread(target=self._serve, name="fc-replica-accept", daemon=True)
        self._accept.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def _note(self, msg: str) -> None:
        with self._lock:
            self.errors.append(msg)
            del self.errors[:-50]

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._slots.acquire()
            t = threading.Thread(target=self._handle, args=(conn,), name="fc-replica", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(self.timeout)
                try:
                    req = _recv_frame(conn)
                    op = req.get("op")
                    if op == "push":
                        self._push(conn, req)
                    elif op == "fetch":
                        self._fetch(conn, req)
                    elif op == "query":
                        self._query(conn, req)
                    else:
                        raise ReplicaError(f"unknown replica op {op!r} (push, fetch or query)")
                except (ReplicaError, ValueError) as e:
                    self._note(str(e))
                    reply = {"ok": False, "go": False, "error": str(e)[:4000]}
                    if isinstance(e, ReplicaNotReady):
                        reply["not_ready"] = True
                    elif isinstance(e, ReplicaHashMismatch):
                        reply["hash_mismatch"] = True
                    with contextlib.suppress(OSError, ValueError):
                        _send_frame(conn, reply)
                except OSError as e:
                    self._note(f"replica connection failed: {e}")
        finally:
            self._slots.release()
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _push(self, conn: socket.socket, req: dict[str, Any]) -> None:
        if self.background is not None:
            self.background()  # this thread serves this one connection: it ends with it
        h = ReplicaHeader.from_json(req.get("header"))
        why = self.store._admit(h)
        if why is not None:
            raise ReplicaError(why)
        try:
            _send_frame(conn, {"go": True})
        except BaseException:
            with self.store._lock:
                self.store._incoming.pop((h.sender_node, h.rank), None)
            raise
        self.store.receive(h, conn, chunk_bytes=self.chunk_bytes, pace=self.pace)
        _send_frame(conn, {"ok": True, "step": h.step})

    def _query(self, conn: socket.socket, req: dict[str, Any]) -> None:
        rank, min_step = req.get("rank"), req.get("min_step", 0)
        if req.get("job") != self.store.job:
            raise ReplicaError(f"this agent holds replicas of job {self.store.job!r} only")
        if type(rank) is not int or type(min_step) is not int:
            raise ReplicaError("query needs rank and min_step (integers)")
        held = [
            h.header
            for h in self.store.held()
            if h.header.rank == rank and h.header.step >= min_step
        ]
        held.sort(key=lambda h: (-h.step, h.sender_node))
        _send_frame(conn, {"ok": True, "held": [h.to_json() for h in held[:MAX_QUERY]]})

    def _fetch(self, conn: socket.socket, req: dict[str, Any]) -> None:
        node, rank, min_step = req.get("sender_node"), req.get("rank"), req.get("min_step", 0)
        if req.get("job") != self.store.job:
            raise ReplicaError(f"this agent holds replicas of job {self.store.job!r} only")
        if not isinstance(node, str) or type(rank) is not int or type(min_step) is not int:
            raise ReplicaError("fetch needs sender_node (string), rank and min_step (integers)")
        held = self.store.get(node, rank)
        if held is None or held.header.step < min_step:
            _send_frame(conn, {"ok": False, "none": True, "error": "no such replica held"})
            return
        slot = Slot(held.path)
        try:
            info = slot.header()
            h = held.header
            if info is None or not info.complete or info.step != h.step:
                raise ReplicaError(f"{held.path}: the held replica is no longer complete")
            if info.data_len != h.data_len or info.meta_len != h.meta_len:
                raise ReplicaError(f"{held.path}: the held replica's lengths changed")
            _send_frame(conn, {"ok": True, "header": h.to_json()})
            conn.sendall(slot.buf[slot.meta_off : slot.meta_off + h.meta_len])
            _send_from(conn, slot.data(h.data_len), self.chunk_bytes, self.pace)
            # A newer push may have renamed this file away as its spare and be writing into it.
            if slot.seq() != info.seq:
                _send_frame(conn, {"end": "abort", "why": "the replica changed while sent"})
                return
            _send_frame(conn, {"end": "ok"})
        finally:
            slot.close()

    def close(self) -> None:
        """Stops accepting, closes the listener and waits briefly for transfers under way."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._accept.join(timeout=5)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=self.timeout)

"""The node agent's shared-memory segments: its slot files (adopted at start, allocated for the
trainer holding a position, removed at the end), its owner file, and the abandoned segments of
dead agents.

On start the agent adopts its own job's slot files (clearing the pin and wanted flags a dead agent
or trainer left set), and removes only those segments of other jobs that are *abandoned*: their
agent is dead and no file of the group changed for ``orphan_age_s``, since a dead agent's
snapshots are still wanted by its own job's next agent (``flashckpt clean`` removes abandoned
segments on demand). Slot files not owned by this user or with a mode looser than 0600 are
neither adopted nor served. Only the trainer that said hello for a position gets its slots.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import time
from dataclasses import dataclass

import psutil

from flashckpt import names
from flashckpt.agent.state import AgentState, Conn, RankRecord, header_ok, read_meta, slot_room
from flashckpt.errors import AgentError
from flashckpt.format.shm import (
    HEADER_SIZE,
    PAGE,
    Slot,
    allocate_slot_file,
    file_problem,
    require_room,
    round_up,
    slot_path,
    slot_prefix,
)
from flashckpt.protocol.messages import Alloc, AllocReply

__all__ = ["SegmentGroup", "Segments", "abandoned_segments", "foreign_file", "planted_message"]

log = logging.getLogger("flashckpt.agent.daemon")

_SLOT_RE = names.SLOT_NAME_RE
_GROUP_RE = names.GROUP_NAME_RE


class Segments:
    """The slot files of one agent (job, node) and its owner file."""

    def __init__(self, state: AgentState) -> None:
        self.st = state
        cfg = state.cfg
        self.owner_path = names.owner_path(cfg.shm_dir, cfg.job, cfg.node)
        """Names this agent's process (pid, start time) for ``abandoned_segments``."""

    def write_owner(self, kept: dict[str, object] | None = None) -> None:
        """Writes the owner file (this process's pid and start time; ``kept``: what the kept
        slots hold that storage lacks, for ``flashckpt clean``, see :meth:`mark_kept`).

        Raises:
            AgentError: the shared-memory directory is full (its free space and the fix), or a
                file of another user sits under one of the job's names there (the file, its
                owner and the fix). Nothing is left behind either way.
        """
        me = psutil.Process()
        owner = {"pid": me.pid, "create_time": me.create_time(), "job": self.st.cfg.job}
        if kept is not None:
            owner["kept"] = kept
        tmp = f"{self.owner_path}.tmp{me.pid}"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            # O_EXCL | O_NOFOLLOW: a link planted under this name is never written through.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(owner, f)
            os.replace(tmp, self.owner_path)
        except OSError as e:
            if foreign_file(tmp) is None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
                raise AgentError(self.full_message(e)) from None
            planted = foreign_file(self.owner_path) or foreign_file(tmp)
            if planted is not None:
                raise AgentError(
                    planted_message(planted, self.st.cfg.job, self.st.cfg.shm_dir)
                ) from None
            raise AgentError(
                f"the node agent cannot write its owner file {self.owner_path}: {e}"
            ) from None

    def mark_kept(self, storage: str, step: int, reason: str) -> None:
        """Records in the owner file that the kept slots hold ``step``, the only copy of it
        (``storage`` lacks it, ``reason`` says why): ``flashckpt clean`` then leaves them
        unless told ``--force`` (issue 41: it deleted the only copy without a word). A failure
        is logged: the slots stay either way."""
        try:
            self.write_owner({"storage": storage, "step": step, "reason": reason})
        except AgentError as e:
            log.warning("cannot mark the kept snapshots as the only copy of step %d: %s", step, e)

    def full_message(self, e: OSError) -> str:
        """The error of a shared-memory directory too full for the agent's own small files:
        the directory, its free space, this job's snapshots there, and the fix."""
        shm = self.st.cfg.shm_dir
        try:
            st = os.statvfs(shm)
            free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
            space = f"{free / 2**20:.1f} MiB free of {total / 2**20:.1f} MiB"
        except OSError:
            space = "its free space unknown"
        prefix = slot_prefix(self.st.cfg.job, self.st.cfg.node)
        mine = 0
        with contextlib.suppress(OSError):
            for name in os.listdir(shm):
                if _SLOT_RE.match(name) and name.startswith(prefix):
                    with contextlib.suppress(OSError):
                        mine += os.lstat(os.path.join(shm, name)).st_size
        kept = (
            f"; this job's snapshot slots there ({mine / 2**20:.1f} MiB) are kept: the next "
            "start resumes from them"
            if mine
            else ""
        )
        return (
            f"the shared-memory directory {shm} is full ({space}; {e.strerror}): the node "
            f"agent cannot write its owner file there{kept}. Free space in {shm} (`df -h {shm}` "
            f"and `ls -la {shm}` show what holds it; `flashckpt clean --shm-dir {shm}` removes "
            "the segments of dead flashckpt agents), enlarge it (docker: --shm-size, or mount "
            "a larger tmpfs), or pass --shm-dir / shm_dir= a directory with room; then run again"
        )

    def clean_orphans(self) -> None:
        """Removes the abandoned segments of other jobs: agent dead, untouched for
        ``orphan_age_s``. A dead agent's younger snapshots may still be wanted by that job."""
        for group in abandoned_segments(
            self.st.cfg.shm_dir, self.st.cfg.orphan_age_s, skip=(self.st.cfg.job, self.st.cfg.node)
        ):
            removed = group.remove()
            if removed:
                log.info(
                    "removed %d segment files of job %s node %s: %s",
                    removed,
                    *group.key,
                    group.reason,
                )

    def adopt(self) -> None:
        """Maps the slot files our job left here (a previous agent died): snapshots survive."""
        prefix = slot_prefix(self.st.cfg.job, self.st.cfg.node)
        newest = -1
        for name in sorted(os.listdir(self.st.cfg.shm_dir)):
            m = _SLOT_RE.match(name)
            if not name.startswith(prefix) or not m:
                if name.startswith(prefix) and ".tmp" in name:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.st.cfg.shm_dir, name))
                continue
            rank, idx = int(m.group(3)), int(m.group(4))
            path = os.path.join(self.st.cfg.shm_dir, name)
            slot = self.open_trusted(path)
            if slot is None:
                continue
            # A dead agent's pin (it crashed mid-persist) or a dead trainer's wanted flag would
            # make every trainer wait for a slot nobody releases.
            slot.clear_flags()
            rec = self.st.ranks.setdefault(rank, RankRecord(rank))
            rec.slots[idx] = slot
            info = slot.header()
            meta = read_meta(slot, info) if info is not None else None
            why = slot.meta_problem(info) if info is not None and meta is None else None
            if why is not None and info is not None:
                # Kept (the trainer's next save replaces it), never served as a snapshot: the
                # trainer's restore names it too, with the step it takes instead.
                log.warning("the snapshot of step %d in %s is not used: %s", info.step, path, why)
            if meta is not None and info is not None:
                if info.step >= newest:
                    newest, self.st.world_id = info.step, meta.world_id
                rec.global_rank = meta.rank
                rec.world_id = meta.world_id
                rec.world_size = meta.world_size
                rec.local_world_size = meta.local_world_size
                rec.shard = meta.shard
                rec.num_shards = meta.num_shards
                rec.replica = meta.replica
        if self.st.ranks:
            log.info("adopted the slots of ranks %s", sorted(self.st.ranks))
        self.st.hash_wake.set()

    def open_trusted(self, path: str) -> Slot | None:
        """Maps a slot file found in shared memory, or None (refused or discarded, and why).

        Files of another user or with group/other access are left alone: not ours to trust,
        nor to delete. Our own files whose header fails its check are removed (never served).
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            self.st.refuse(path, f"cannot open it: {e}")
            return None
        try:
            problem = file_problem(path, fd)
            if problem is not None:
                self.st.refuse(path, f"not trusted ({problem}); left in place")
                return None
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            except (OSError, ValueError) as e:
                problem = f"cannot map it: {e}"
        finally:
            os.close(fd)
        if problem is None:
            try:
                return Slot(path, buf=mm, own=True)
            except ValueError as e:
                problem = str(e)
        self.st.refuse(path, f"discarded: {problem}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return None

    def remove_segments(self, keep_slots: bool = False) -> list[str]:
        """Unmaps the slots and unlinks this agent's segment files; returns the files kept.

        ``keep_slots`` (memory holds snapshots storage lacks): the slot files and the owner file
        stay for the next agent of the job to adopt (the owner names this, then dead, agent:
        another job's agent or ``flashckpt clean`` removes them once abandoned); the rest (the
        trainers' step rings, replicas of other machines) goes."""
        for rec in self.st.ranks.values():
            for i, s in enumerate(rec.slots):
                if s is not None:
                    try:
                        s.close()
                    except (BufferError, OSError, ValueError) as e:  # a view still exported
                        log.warning("closing %s: %s (removed anyway)", s.path, e)
                    rec.slots[i] = None
        prefix = slot_prefix(self.st.cfg.job, self.st.cfg.node)
        owner = os.path.basename(self.owner_path)
        kept = []
        for name in sorted(os.listdir(self.st.cfg.shm_dir)):
            if not name.startswith(prefix):
                continue
            path = os.path.join(self.st.cfg.shm_dir, name)
            if keep_slots and (_SLOT_RE.match(name) or name == owner):
                if name != owner:
                    kept.append(path)
                continue
            planted = foreign_file(path)
            if planted is not None:
                # Not this agent's (it creates every file as this user): another user's file
                # under the job's names is left alone, whoever runs the agent (root may
                # delete it in a sticky directory; it must not).
                log.info(
                    "left %s alone: it belongs to another user (uid %d, %s), not to this agent",
                    *planted,
                )
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("cannot remove %s: %s", path, e)
        return kept

    def slot_bytes_after(
        self, rec: RankRecord, meta_cap: int, data_cap: int, keep: set[int]
    ) -> tuple[int, int]:
        """(bytes of every slot file of this agent once ``rec``'s alloc is done, bytes of slot
        files that exist now, pulls in flight counted): for the replicas' capacity check."""

        def after(other: RankRecord, i: int, size: int) -> int:
            if other is not rec:
                return size
            s = other.slots[i]
            kept = s is not None and (
                i in keep or (s.meta_cap >= meta_cap and s.data_cap >= data_cap)
            )
            return size if kept else slot_file_bytes(meta_cap, data_cap)

        return slot_room(self.st, after)

    def alloc(self, conn: Conn, msg: Alloc) -> AllocReply:
        rank, meta_cap, data_cap = msg.key, msg.meta_cap, msg.data_cap
        # Slots the trainer needs as they are (the newest snapshot, maybe of an older layout):
        # never replaced here, whatever their size.
        keep = set(msg.keep or ())
        cfg = self.st.cfg
        with self.st.lock:
            # Only the trainer that holds the position (said hello for it on this connection,
            # in the current world) gets its slots: a stray or stale alloc would create a
            # position no trainer fills, and persistence would wait for it forever.
            rec = self.st.ranks.get(rank)
            if rank not in conn.ranks or rec is None or rec.conn is not conn:
                owner = "no trainer" if rec is None or rec.conn is None else "another trainer"
                raise ValueError(
                    f"alloc for local rank {rank} refused: this connection did not say hello for "
                    f"it ({owner} holds it); a trainer allocates only its own position"
                )
            if rec.world_id != self.st.world_id:
                raise ValueError(
                    f"alloc for local rank {rank} refused: its trainer belongs to world "
                    f"{rec.world_id!r}, the current world is {self.st.world_id!r}"
                )
        paths = []
        # Never remap a slot the persister is reading (io_lock); the room is checked and taken
        # with no pull's doing the same meanwhile (room_lock).
        with self.st.io_lock, self.st.room_lock:
            if self.st.stopping.is_set():
                raise ValueError("the node agent is shutting down: no new slots")
            check = self.st.capacity_check
            if check is not None:
                # Before any file is made: a tmpfs too small for the slots plus the replicas of
                # other machines this one holds says so now, with the numbers.
                own, present = self.slot_bytes_after(rec, meta_cap, data_cap, keep)
                check(own, present)
            if msg.check_only:
                # The files the alloc would (re)create, against the free space as it would
                # find it (a replaced file's bytes come back first).
                need = replaced = 0
                for i, s in enumerate(rec.slots):
                    if not _kept(s, i, keep, meta_cap, data_cap):
                        need += slot_file_bytes(meta_cap, data_cap)
                        with contextlib.suppress(ValueError):  # closed meanwhile
                            replaced += s.size if s is not None else 0
                require_room(self.st.cfg.shm_dir, need, replaced)
                return AllocReply(slots=[])
            for i in range(2):
                s = rec.slots[i]
                if _kept(s, i, keep, meta_cap, data_cap):
                    assert s is not None
                    paths.append(s.path)
                    continue
                path = slot_path(self.st.cfg.shm_dir, self.st.cfg.job, self.st.cfg.node, rank, i)
                if s is not None:
                    with self.st.lock:  # the status and pending-step readers hold it
                        rec.slots[i] = None
                    with self.st.map_lock:  # never under the hasher
                        s.close()
                try:
                    allocate_slot_file(path, meta_cap, data_cap)
                except PermissionError as e:
                    # Another user's file under the slot's name (or its temporary name): the
                    # rename over it is refused in a sticky directory. Named, with its owner.
                    planted = foreign_file(path) or foreign_file(f"{path}.tmp{os.getpid()}")
                    if planted is None:
                        raise
                    raise ValueError(planted_message(planted, cfg.job, cfg.shm_dir)) from e
                new = Slot(path)
                with self.st.lock:
                    rec.slots[i] = new
                paths.append(path)
        return AllocReply(slots=paths)


def foreign_file(path: str) -> tuple[str, int, str] | None:
    """(path, uid, user name) when ``path`` exists and belongs to another user, else None."""
    try:
        uid = os.lstat(path).st_uid
    except OSError:
        return None
    if uid == os.geteuid():
        return None
    try:
        import pwd

        user = pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        user = "no such user"
    return path, uid, user


def planted_message(planted: tuple[str, int, str], job: str, shm_dir: str) -> str:
    """The error for a file of another user under one of the job's names in ``shm_dir``."""
    path, uid, user = planted
    return (
        f"{path} belongs to another user (uid {uid}, {user}), not to you (uid "
        f"{os.geteuid()}): a file under one of job {job!r}'s names in {shm_dir} that this agent "
        "may neither use nor replace. Have it removed (by that user or root: "
        f"`sudo rm {path}`), or run with another job id (job= / --job) or a shared-memory "
        "directory of your own (shm_dir= / --shm-dir, mode 0700)"
    )


def _kept(s: Slot | None, i: int, keep: set[int], meta_cap: int, data_cap: int) -> bool:
    """Whether an alloc keeps slot ``i`` as it is (asked to, or big enough), not recreated."""
    return (
        s is not None
        and header_ok(s)
        and (i in keep or (s.meta_cap >= meta_cap and s.data_cap >= data_cap))
    )


def slot_file_bytes(meta_cap: int, data_cap: int) -> int:
    """Size of a slot file of these capacities (as
    :func:`flashckpt.format.shm.allocate_slot_file`)."""
    return HEADER_SIZE + round_up(max(meta_cap, PAGE)) + round_up(max(data_cap, PAGE))


@dataclass(frozen=True, slots=True)
class SegmentGroup:
    """The shared-memory files of one job's agent on one node (slots, rings, owner file)."""

    key: tuple[str, str]
    """(job, node)."""
    paths: tuple[str, ...]
    """The files (all owned by this user)."""
    nbytes: int
    """Their total size."""
    age_s: float
    """Seconds since the newest of them was modified."""
    reason: str
    """Why the group counts as abandoned."""
    only_copy: str | None = None
    """What the group holds that storage lacks (``step N, which storage URL lacks``: its
    agent kept it there when the final write to storage failed; ``step N (the job has no
    storage)``: a memory-only job's agent stopped before its trainers finished), else None."""

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("a segment group has at least one file")

    def remove(self) -> int:
        """Unlinks the files; returns how many were removed."""
        n = 0
        for p in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
                n += 1
        return n


def abandoned_segments(
    shm_dir: str, older_than: float, skip: tuple[str, str] | None = None
) -> list[SegmentGroup]:
    """The segment groups in ``shm_dir`` whose agent is dead and that nothing modified for
    ``older_than`` seconds. Files of other users are never listed (not ours to remove).

    Args:
        shm_dir: the tmpfs of the slots.
        older_than: least age in seconds (0: every dead agent's segments).
        skip: a (job, node) never listed (the caller's own).
    """
    groups: dict[tuple[str, str], list[tuple[str, os.stat_result]]] = {}
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return []
    for name in entries:
        m = _GROUP_RE.match(name)
        if not m:
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != os.geteuid():
            continue
        groups.setdefault((m.group(1), m.group(2)), []).append((path, st))
    out = []
    now = time.time()
    for key, files in sorted(groups.items()):
        if key == skip:
            continue
        owner = names.owner_path(shm_dir, key[0], key[1])
        if _owner_alive(owner):
            continue
        age = now - max(st.st_mtime for _, st in files)
        if age < older_than:
            continue
        why = "no owner file" if not os.path.exists(owner) else "its agent is dead"
        out.append(
            SegmentGroup(
                key=key,
                paths=tuple(sorted(p for p, _ in files)),
                nbytes=sum(st.st_size for _, st in files),
                age_s=age,
                reason=f"{why}, unchanged for {age / 3600:.1f} h",
                only_copy=_only_copy(owner),
            )
        )
    return out


def _only_copy(owner_path: str) -> str | None:
    """What a dead agent's kept slots hold that storage lacks (its owner file's ``kept``,
    :meth:`Segments.mark_kept`), unless storage holds that step by now; None otherwise. A
    storage that cannot be looked at lacks it."""
    try:
        with open(owner_path, "rb") as f:
            kept = json.loads(f.read(1 << 16)).get("kept")
        url, step = kept["storage"], kept["step"]
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None
    if not isinstance(url, str) or isinstance(step, bool) or not isinstance(step, int):
        return None
    if not url:  # a job without storage: memory is the only copy there is
        return f"step {step} (the job has no storage)"
    try:
        from flashckpt.format.storage import MANIFEST, Storage

        st = Storage(url)
        if st.fs.exists(st.step_path(step, MANIFEST)):
            return None
    except Exception:  # any backend's failure: it does not have it, as far as we can tell
        pass
    return f"step {step}, which storage {url} lacks"


def _owner_alive(owner_path: str) -> bool:
    try:
        with open(owner_path) as f:
            owner = json.load(f)
        proc = psutil.Process(int(owner["pid"]))
        return abs(proc.create_time() - float(owner["create_time"])) < 1.0
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return False

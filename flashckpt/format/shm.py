"""Shared-memory snapshot slots: one file per slot in a tmpfs (``/dev/shm``), mapped shared.

A slot file is ``[header 4 KiB][meta region][data region]``. The meta region holds a JSON
description of the snapshot (tensor layout, skeleton, per-rank private state); the data region
holds the tensor bytes exactly as a safetensors byte buffer, so persisting is one sequential write.

The header works as a seqlock: a writer makes ``seq`` odd and the state WRITING before it touches
the meta or data, and makes ``seq`` even and the state COMPLETE after the last byte. A reader
(another process) takes the header, copies what it needs, and re-reads ``seq``: if it moved, the
copy is discarded. A snapshot torn by a crash stays WRITING forever and is never served. The header
carries a CRC of its own fields and of the meta bytes, so garbage is detected too.

The node agent creates slot files (``posix_fallocate`` reserves every page up front, so a full
tmpfs is an error at allocation, never a SIGBUS during training) and removes them; trainers map
them and write snapshots.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import stat
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from flashckpt.errors import ShmSpaceError, UnsafeLocalStateError
from flashckpt.names import check_name, slot_path, slot_prefix  # re-exported: built in names

__all__ = [
    "HEADER_SIZE",
    "Prefaulter",
    "ShmSpaceError",
    "Slot",
    "SlotInfo",
    "allocate_slot_file",
    "check_name",
    "check_private_dir",
    "ensure_private_dir",
    "file_problem",
    "require_room",
    "slot_path",
    "slot_prefix",
]

HEADER_SIZE = 4096
PAGE = 4096
MAGIC = b"FLCKSLT1"
VERSION = 1

EMPTY, WRITING, COMPLETE = 0, 1, 2

# magic, seq, state, version, step, meta_len, data_len, meta_cap, data_cap, t_complete, meta_crc
_HDR = struct.Struct("<8sQIIqQQQQdI")
_HDR_CRC_OFF = _HDR.size  # u32 crc32 of the bytes before it
# Fields outside the header CRC: pinned u32 (written by the agent), wanted u32 (written by the
# trainer: it waits for this slot), pinned_seq u64.
_AGENT_OFF = 1024
# The data hash record, written by the agent once a snapshot is complete: seq u64 (the snapshot it
# belongs to), xxh3_64 u64 of the data region's ``data_len`` bytes, crc32 u32 of those two.
_HASH_OFF = _AGENT_OFF + 64
_HASH = struct.Struct("<QQ")


def round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def shm_free_bytes(shm_dir: str) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def allocate_slot_file(path: str, meta_cap: int, data_cap: int) -> int:
    """Creates (or replaces) a slot file with every page reserved; returns its size.

    Raises:
        ShmSpaceError: the file system lacks room; names the needed and free sizes.
    """
    meta_cap = round_up(max(meta_cap, PAGE))
    data_cap = round_up(max(data_cap, PAGE))
    total = HEADER_SIZE + meta_cap + data_cap
    shm_dir = os.path.dirname(path)
    old = os.path.getsize(path) if os.path.exists(path) else 0
    require_room(shm_dir, total, old)
    tmp = f"{path}.tmp{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover (or a planted link): never written through
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                free = shm_free_bytes(shm_dir)
                raise ShmSpaceError(_space_message(shm_dir, total, free + old)) from None
            raise
        # A fresh header: EMPTY, with the capacities, so readers see a valid empty slot.
        hdr = bytearray(HEADER_SIZE)
        _HDR.pack_into(hdr, 0, MAGIC, 0, EMPTY, VERSION, -1, 0, 0, meta_cap, data_cap, 0.0, 0)
        struct.pack_into("<I", hdr, _HDR_CRC_OFF, zlib.crc32(hdr[:_HDR_CRC_OFF]))
        os.pwrite(fd, bytes(hdr), 0)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    return total


def require_room(shm_dir: str, need: int, replaced: int = 0) -> None:
    """Raises :class:`ShmSpaceError` (with the numbers and the fix) unless ``shm_dir`` has room
    for ``need`` more bytes once files of ``replaced`` bytes are replaced."""
    free = shm_free_bytes(shm_dir)
    if need > free + replaced:
        raise ShmSpaceError(_space_message(shm_dir, need, free + replaced))


def _space_message(shm_dir: str, need: int, free: int) -> str:
    return (
        f"{shm_dir} has {free / 2**20:.1f} MiB free but a snapshot slot needs "
        f"{need / 2**20:.1f} MiB (two slots per rank are kept). Enlarge it (docker: "
        f"--shm-size={max(1, -(-2 * need // 2**30))}g or more, or mount a larger tmpfs), or pass "
        "shm_dir= a directory on a local disk with room (slower snapshots, same guarantees)."
    )


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """A consistent view of a slot header."""

    seq: int
    state: int
    step: int
    meta_len: int
    data_len: int
    meta_cap: int
    data_cap: int
    time_complete: float
    meta_crc: int

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE and self.seq % 2 == 0


class Slot:
    """One mapped slot file. Used by the trainer (writer) and the agent (reader).

    Args:
        path: the slot file.
        buf: a writable buffer mapping the whole file (``mmap`` or a numpy view of a torch tensor
            from ``torch.from_file``); ``None`` maps the file with ``mmap``.
        own: ``buf`` is an ``mmap`` this slot closes (as one it mapped itself).
    """

    def __init__(self, path: str, buf: Any = None, own: bool = False) -> None:
        self.path = path
        self._mm: mmap.mmap | None = buf if own and isinstance(buf, mmap.mmap) else None
        if buf is None:
            fd = os.open(path, os.O_RDWR)
            try:
                self._mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            buf = self._mm
        self.buf = memoryview(buf).cast("B")
        if len(self.buf) < HEADER_SIZE:
            self.close()
            raise ValueError(f"{path} is not a flashckpt slot (only {len(self.buf)} bytes)")
        magic = bytes(self.buf[:8])
        if magic != MAGIC:
            self.close()
            raise ValueError(f"{path} is not a flashckpt slot (bad magic {magic!r})")
        # The capacities place the regions: never taken from a header that fails its CRC. A
        # writer rewrites the header in one short copy, so a torn read is retried a few times.
        got = None
        for _ in range(5):
            got = self.header()
            if got is not None:
                break
            time.sleep(0.002)
        if got is None:
            self.close()
            raise ValueError(f"{path}: the slot header fails its CRC (corrupted)")
        info = got
        self.meta_cap = info.meta_cap
        self.data_cap = info.data_cap
        self.meta_off = HEADER_SIZE
        self.data_off = HEADER_SIZE + info.meta_cap
        if self.data_off + self.data_cap > len(self.buf):
            self.close()
            raise ValueError(f"{path}: header capacities exceed the file size")

    @property
    def size(self) -> int:
        return len(self.buf)

    def close(self) -> None:
        self.buf.release()
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None

    # -- header ------------------------------------------------------------------------------
    def _raw_header(self) -> SlotInfo:
        f = _HDR.unpack_from(self.buf, 0)
        return SlotInfo(*f[1:3], *f[4:])

    def header(self) -> SlotInfo | None:
        """The header if it is intact (magic and CRC), else None."""
        raw = bytes(self.buf[: _HDR_CRC_OFF + 4])
        (crc,) = struct.unpack_from("<I", raw, _HDR_CRC_OFF)
        if raw[:8] != MAGIC or zlib.crc32(raw[:_HDR_CRC_OFF]) != crc:
            return None
        f = _HDR.unpack_from(raw, 0)
        return SlotInfo(*f[1:3], *f[4:])

    def seq(self) -> int:
        return int(struct.unpack_from("<Q", self.buf, 8)[0])

    def _write_header(self, info: SlotInfo) -> None:
        hdr = bytearray(_HDR_CRC_OFF + 4)
        _HDR.pack_into(
            hdr,
            0,
            MAGIC,
            info.seq,
            info.state,
            VERSION,
            info.step,
            info.meta_len,
            info.data_len,
            info.meta_cap,
            info.data_cap,
            info.time_complete,
            info.meta_crc,
        )
        struct.pack_into("<I", hdr, _HDR_CRC_OFF, zlib.crc32(hdr[:_HDR_CRC_OFF]))
        # seq goes first on its own: a reader that sees new data must also see an odd/new seq.
        self.buf[8:16] = hdr[8:16]
        self.buf[: len(hdr)] = hdr

    # -- writer ------------------------------------------------------------------------------
    def begin_write(self) -> int:
        """Marks the slot WRITING; returns the (odd) sequence number."""
        cur = self._raw_header()
        seq = cur.seq + 1 if cur.seq % 2 == 0 else cur.seq + 2
        self._write_header(SlotInfo(seq, WRITING, -1, 0, 0, self.meta_cap, self.data_cap, 0.0, 0))
        return seq

    def write_meta(self, meta: bytes) -> None:
        if len(meta) > self.meta_cap:
            raise ValueError(f"snapshot description ({len(meta)} B) exceeds slot meta region")
        self.buf[self.meta_off : self.meta_off + len(meta)] = meta

    def end_write(self, seq: int, step: int, meta: bytes, data_len: int) -> None:
        """Marks the slot COMPLETE with its step (after every data byte is in place)."""
        assert seq % 2 == 1, "end_write without begin_write"
        self._write_header(
            SlotInfo(
                seq + 1,
                COMPLETE,
                step,
                len(meta),
                data_len,
                self.meta_cap,
                self.data_cap,
                time.time(),
                zlib.crc32(meta),
            )
        )

    def invalidate(self) -> None:
        """Marks the slot EMPTY (its snapshot must never be served again)."""
        cur = self._raw_header()
        seq = cur.seq + 2 if cur.seq % 2 == 0 else cur.seq + 1
        self._write_header(SlotInfo(seq, EMPTY, -1, 0, 0, self.meta_cap, self.data_cap, 0.0, 0))

    # -- reader ------------------------------------------------------------------------------
    def read_meta(self, info: SlotInfo) -> dict[str, Any] | None:
        """The snapshot description of a COMPLETE header, or None if torn or corrupt (which
        of the two, and how, :meth:`meta_problem` says)."""
        return self._read_meta(info)[0]

    def meta_problem(self, info: SlotInfo) -> str | None:
        """Why the description of a COMPLETE snapshot cannot be read: its damage, named; None
        where it reads, or where the slot is being rewritten (a torn read is no damage)."""
        return self._read_meta(info)[1]

    def _read_meta(self, info: SlotInfo) -> tuple[dict[str, Any] | None, str | None]:
        if not info.complete:
            return None, None
        if info.meta_len > self.meta_cap:
            return None, (
                f"its header gives a description of {info.meta_len} B, more than the slot's "
                f"{self.meta_cap} B"
            )
        if info.data_len > self.data_cap:
            return None, (
                f"its header gives {info.data_len} B of data, more than the slot's "
                f"{self.data_cap} B"
            )
        meta = bytes(self.buf[self.meta_off : self.meta_off + info.meta_len])
        if self.seq() != info.seq:
            return None, None
        if zlib.crc32(meta) != info.meta_crc:
            return None, "its description (meta JSON) is damaged (its CRC does not match)"
        try:
            out = json.loads(meta)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            return None, f"its description (meta JSON) does not parse: {e}"
        if not isinstance(out, dict):
            return None, f"its description is a JSON {type(out).__name__}, not an object"
        return out, None

    def data(self, length: int) -> memoryview:
        return self.buf[self.data_off : self.data_off + length]

    # -- agent pin (a hint to the writer; correctness rests on the seqlock) ----------------------
    def pin(self, seq: int) -> None:
        struct.pack_into("<I", self.buf, _AGENT_OFF, 1)
        struct.pack_into("<Q", self.buf, _AGENT_OFF + 8, seq)

    def unpin(self) -> None:
        struct.pack_into("<I", self.buf, _AGENT_OFF, 0)

    def pinned(self) -> bool:
        return bool(struct.unpack_from("<I", self.buf, _AGENT_OFF)[0])

    def want(self, flag: bool) -> None:
        """The trainer needs this slot (the agent may abandon persisting it)."""
        struct.pack_into("<I", self.buf, _AGENT_OFF + 4, int(flag))

    def wanted(self) -> bool:
        return bool(struct.unpack_from("<I", self.buf, _AGENT_OFF + 4)[0])

    def clear_flags(self) -> None:
        """Clears the pin and wanted flags (left set by an agent or trainer that died)."""
        struct.pack_into("<IIQ", self.buf, _AGENT_OFF, 0, 0, 0)

    # -- data hash (written by the agent; checked on restore and before a commit) ---------------
    def data_hash(self, info: SlotInfo) -> int:
        """xxh3_64 of the data region of a snapshot (``info.data_len`` bytes)."""
        if info.data_len > self.data_cap:
            raise ValueError(f"{self.path}: data length {info.data_len} exceeds the slot")
        return int(xxhash.xxh3_64_intdigest(self.data(info.data_len)))

    def record_hash(self, seq: int, value: int) -> None:
        rec = _HASH.pack(seq, value)
        self.buf[_HASH_OFF : _HASH_OFF + _HASH.size + 4] = rec + struct.pack("<I", zlib.crc32(rec))

    def recorded_hash(self, info: SlotInfo) -> int | None:
        """The data hash recorded for this snapshot (same ``seq``), or None if there is none."""
        raw = bytes(self.buf[_HASH_OFF : _HASH_OFF + _HASH.size + 4])
        (crc,) = struct.unpack_from("<I", raw, _HASH.size)
        if zlib.crc32(raw[: _HASH.size]) != crc:
            return None
        seq, value = _HASH.unpack_from(raw, 0)
        return int(value) if seq == info.seq and info.complete else None

    def verify_data(self, info: SlotInfo) -> bool | None:
        """Whether the data still hashes to the recorded value (None: no hash recorded)."""
        want = self.recorded_hash(info)
        if want is None:
            return None
        return self.data_hash(info) == want


def file_problem(path: str, fd: int | None = None) -> str | None:
    """Why a slot (or other private file) must not be trusted, or None if it may.

    A slot file is trusted only when it is a regular file (no link), owned by this process's
    user, with no access for group or others: another user of the machine could otherwise plant
    the state a trainer restores, or read it.
    """
    try:
        st = os.fstat(fd) if fd is not None else os.lstat(path)
    except OSError as e:
        return f"cannot stat it: {e}"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o} is looser than 0600"
    return None


def check_private_dir(path: str, what: str = "run dir") -> None:
    """Refuses a directory another user could write into, swap, or read.

    Raises:
        UnsafeLocalStateError: it is a symlink, not a directory, owned by another user, or
            grants group/other access; the message names the fix.
    """
    try:
        st = os.lstat(path)
    except OSError as e:
        raise UnsafeLocalStateError(f"{what} {path} cannot be checked: {e}") from None
    fix = (
        f"remove it (or pass another directory) so flashckpt creates it with mode 0700, or "
        f"`chmod 700 {path}` if it is yours"
    )
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeLocalStateError(f"{what} {path} is a symbolic link: {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeLocalStateError(f"{what} {path} is not a directory: {fix}")
    if st.st_uid != os.geteuid():
        raise UnsafeLocalStateError(
            f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): "
            f"another user could swap the agent's socket or log; {fix}"
        )
    if st.st_mode & 0o077:
        raise UnsafeLocalStateError(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users could swap the "
            f"agent's socket or log; {fix}"
        )


def ensure_private_dir(path: str, what: str = "run dir") -> None:
    """Creates ``path`` with mode 0700 if missing (parents too), then checks it is private."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    check_private_dir(path, what)


_libc: Any = None

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23


def madvise(ptr: int, length: int, advice: int) -> bool:
    """``madvise(2)`` on the pages covering ``[ptr, ptr+length)``; False if the kernel refused.

    ctypes releases the GIL for the call.
    """
    global _libc
    if length <= 0:
        return True
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    start = ptr - ptr % PAGE
    rc = _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length + ptr - start), advice)
    return bool(rc == 0)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange_files(a: str, b: str) -> bool:
    """Swaps the files at paths ``a`` and ``b`` in one step (``renameat2(RENAME_EXCHANGE)``):
    a reader of either name sees the old file or the new one, never none. Both must exist.
    Returns False where the C library or the file system lacks it (the caller falls back)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def prefault(ptr: int, length: int) -> bool:
    """Maps every page of ``[ptr, ptr+length)`` writable now (MADV_POPULATE_WRITE).

    First-touch page faults cost ~10x a memcpy; doing them here keeps them off the save path.
    Returns False where the kernel lacks MADV_POPULATE_WRITE (Linux < 5.14).
    """
    return madvise(ptr, length, MADV_POPULATE_WRITE)


def buffer_address(buf: Any) -> int | None:
    """Address of the first byte of a writable, contiguous buffer (None if read-only or empty).

    Used to check the alignment ``O_DIRECT`` needs; the buffer export is released before return.
    """
    mv = memoryview(buf)
    try:
        if mv.readonly or not mv.c_contiguous or mv.nbytes == 0:
            return None
        ref = ctypes.c_char.from_buffer(mv.cast("B") if mv.format != "B" else mv)
        addr = ctypes.addressof(ref)
        del ref
        return addr
    finally:
        mv.release()


def anonymous_buffer(nbytes: int, huge: bool = False) -> tuple[mmap.mmap, int]:
    """Anonymous private memory for ``nbytes`` bytes, every page mapped now, in one call.

    Fresh memory costs a page fault per 4 KiB on first touch; a copy into it took ~5x as long as
    a copy into touched memory. ``MADV_POPULATE_WRITE`` maps the whole range in one system call.
    The start is 2 MiB-aligned, so the kernel can back it with transparent huge pages where it
    does so unasked (``always`` mode). ``huge`` asks for them (``MADV_HUGEPAGE``); it is off by
    default: on the benchmark VM (THP ``madvise`` mode, ``defrag=madvise``) it made the kernel
    compact memory synchronously, and populating 680 MiB took 2x the CPU of 4 KiB pages.

    Returns:
        The mapping (unmapped when the last reference goes) and the offset of the first
        2 MiB-aligned byte in it, where the ``nbytes`` usable bytes start.
    """
    mm = mmap.mmap(-1, max(nbytes, 1) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = buffer_address(mm)
    assert base is not None
    skip = -base % HUGE_PAGE
    if nbytes > 0:
        if huge:
            madvise(base + skip, nbytes, MADV_HUGEPAGE)
        madvise(base + skip, nbytes, MADV_POPULATE_WRITE)
    return mm, skip


PREFAULT_CHUNK = 64 << 20


class Prefaulter:
    """Maps the pages of memory ranges (slots) in a background thread, a chunk at a time.

    A fresh slot page costs a fault on first write, and tmpfs zeroes it then: populating a 4 GiB
    slot takes 1-2 s, a copy into a populated one 0.4 s, a copy that faults as it goes 1.0 s.
    Ranges are populated one after another in the order given (the slot the next snapshot goes to
    first), each from its end towards its start: a copy that starts before its slot is done writes
    from the start, faulting those pages itself, while this thread maps the rest from the other
    end, so no page is faulted twice and the copy never waits for the thread.

    Between chunks (64 MiB, ~30 ms) the thread stops for good once ``alive(i)`` is False (range
    ``i`` was unmapped or replaced), and pauses while ``busy(i)`` is True (a copy runs into another
    range: populating would take memory bandwidth and a core from that copy).

    Args:
        ranges: ``(address, length, keep)`` of each range; ``keep`` is any object that keeps the
            mapping alive (held until the thread is done with the range).
        alive: whether range ``i`` is still in use.
        busy: whether populating range ``i`` now would slow a running copy.
    """

    def __init__(
        self,
        ranges: Sequence[tuple[int, int, Any]],
        *,
        alive: Callable[[int], bool],
        busy: Callable[[int], bool] | None = None,
        chunk: int = PREFAULT_CHUNK,
        name: str = "flashckpt-prefault",
    ) -> None:
        self._ranges: list[tuple[int, int, Any] | None] = list(ranges)
        self._alive: Callable[[int], bool] | None = alive
        self._busy = busy
        self._chunk = max(PAGE, chunk - chunk % PAGE)
        self._stop = threading.Event()
        self.done = [threading.Event() for _ in self._ranges]
        """Set when range ``i`` is populated (or given up: stopped, unsupported)."""
        self.seconds = [0.0 for _ in self._ranges]
        """Time spent populating range ``i`` (pauses excluded)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Prefaulter:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops after the chunk in progress (does not wait)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the thread to finish; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            for i in range(len(self._ranges)):
                self._populate(i)
        finally:
            # The mappings may go now: nothing here may keep them (the callbacks may reach them).
            self._ranges = [None] * len(self._ranges)
            self._alive = self._busy = None
            for ev in self.done:
                ev.set()

    def _populate(self, i: int) -> None:
        rng = self._ranges[i]
        assert rng is not None
        ptr, length, _keep = rng
        end = ptr + length
        while end > ptr:
            if self._stop.is_set() or self._alive is None or not self._alive(i):
                return
            if self._busy is not None and self._busy(i):
                # The copy gives no signal when it ends; it runs for a fraction of a second.
                self._stop.wait(0.01)
                continue
            start = max(ptr, end - self._chunk)
            t0 = time.perf_counter()
            ok = prefault(start, end - start)
            self.seconds[i] += time.perf_counter() - t0
            if not ok:  # no MADV_POPULATE_WRITE (Linux < 5.14): the copies fault the pages
                self._stop.set()
                return
            end = start
        self._ranges[i] = None
        self.done[i].set()

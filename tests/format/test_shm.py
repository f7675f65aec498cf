from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid

import pytest
from fchelpers import sized_tmpfs

from flashckpt.format.shm import (
    COMPLETE,
    HUGE_PAGE,
    Prefaulter,
    ShmSpaceError,
    Slot,
    allocate_slot_file,
    anonymous_buffer,
    buffer_address,
)


@pytest.fixture
def slot_file():
    path = f"/dev/shm/fc.shmtest{uuid.uuid4().hex[:8]}.n0.r00000.s0"
    allocate_slot_file(path, 4096, 1 << 16)
    yield path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def test_complete_snapshot_is_served(slot_file: str) -> None:
    s = Slot(slot_file)
    seq = s.begin_write()
    s.write_meta(b'{"a":1}')
    s.data(4)[:] = b"abcd"
    s.end_write(seq, 7, b'{"a":1}', 4)
    info = s.header()
    assert info is not None and info.complete and info.state == COMPLETE and info.step == 7
    assert s.read_meta(info) == {"a": 1}
    assert bytes(s.data(4)) == b"abcd"
    s.close()


def test_torn_write_is_never_served(slot_file: str) -> None:
    # A writer killed with SIGKILL between begin_write and end_write.
    code = (
        "import os, signal\n"
        "from flashckpt.format.shm import Slot\n"
        f"s = Slot({slot_file!r})\n"
        "q = s.begin_write(); s.end_write(q, 1, b'{}', 0)\n"  # one complete snapshot first
        "q = s.begin_write(); s.write_meta(b'{\"x\": 2}'); s.data(3)[:] = b'xyz'\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert r.returncode == -9
    s = Slot(slot_file)
    info = s.header()
    assert info is not None and not info.complete
    assert s.read_meta(info) is None
    s.close()


def test_reader_detects_change_during_read(slot_file: str) -> None:
    s = Slot(slot_file)
    seq = s.begin_write()
    s.end_write(seq, 1, b"{}", 0)
    info = s.header()
    assert info is not None
    s.begin_write()  # the writer starts a new snapshot while a reader holds `info`
    assert s.seq() != info.seq
    assert s.read_meta(info) is None
    s.close()


def test_corrupt_header_is_rejected(slot_file: str) -> None:
    s = Slot(slot_file)
    seq = s.begin_write()
    s.end_write(seq, 5, b"{}", 0)
    s.buf[30] ^= 0xFF  # flip a bit inside the step field
    assert s.header() is None
    s.close()


def test_too_small_tmpfs_fails_up_front(tmp_path) -> None:
    with sized_tmpfs(tmp_path / "small", "8m") as mnt:
        with pytest.raises(ShmSpaceError, match=r"MiB free but a snapshot slot needs .*shm-size"):
            allocate_slot_file(str(mnt / "fc.j.n.r00000.s0"), 4096, 64 << 20)
        assert not [n for n in os.listdir(mnt) if n.startswith("fc.")]  # nothing left behind


def test_buffer_address_is_the_first_byte() -> None:
    import ctypes
    import mmap

    m = mmap.mmap(-1, 3 * 4096)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    view = memoryview(m)[4096:]
    assert buffer_address(view) == base + 4096
    assert buffer_address(b"read-only") is None
    assert buffer_address(bytearray()) is None
    view.release()
    m.close()  # no buffer export was left behind


def test_anonymous_buffer_is_aligned_and_populated() -> None:
    n = 8 << 20
    mm, skip = anonymous_buffer(n)
    addr = buffer_address(mm)
    assert addr is not None and (addr + skip) % HUGE_PAGE == 0 and len(mm) >= skip + n
    # Every page is mapped before the first write (MADV_POPULATE_WRITE, Linux >= 5.14).
    rss = 0
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr + skip < hi
            elif inside and head == "Rss:":
                rss = int(line.split()[1]) * 1024
    assert rss >= n
    mm[skip : skip + n] = b"\x01" * n
    mm.close()


def _rss_of_mapping(addr: int) -> int:
    """Bytes of the mapping holding ``addr`` that are mapped into this process."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("alive", [True, False])
def test_prefaulter_maps_slot_pages_until_the_slot_goes(slot_file: str, alive: bool) -> None:
    import mmap

    n = 8 << 20
    allocate_slot_file(slot_file, 4096, n)
    fd = os.open(slot_file, os.O_RDWR)
    try:
        mms = [mmap.mmap(fd, os.fstat(fd).st_size) for _ in range(2)]
    finally:
        os.close(fd)
    addrs = [buffer_address(m) or 0 for m in mms]
    assert all(addrs) and all(_rss_of_mapping(a) == 0 for a in addrs)
    busy_calls: list[int] = []

    def busy(i: int) -> bool:  # a copy runs into the other range for the first two looks
        busy_calls.append(i)
        return len(busy_calls) <= 2

    pf = Prefaulter(
        [(a, len(m), m) for a, m in zip(addrs, mms, strict=True)],
        alive=lambda i: alive,
        busy=busy,
        chunk=1 << 20,
    ).start()
    assert pf.join(timeout=60)
    assert all(ev.is_set() for ev in pf.done)
    for a, m in zip(addrs, mms, strict=True):
        assert _rss_of_mapping(a) == (len(m) if alive else 0)
    if alive:
        assert len(busy_calls) > 2  # consulted before each chunk; went on once it was False
    for m in mms:
        m.close()

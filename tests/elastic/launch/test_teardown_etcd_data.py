"""The standalone etcd's data (~125 MB a launcher) does not pile up under the run directory
(issue 30): a launcher that ends removes it; one killed with SIGKILL cannot, so the next
standalone launcher removes it, once its launcher is gone and nothing uses it, and never a live
launcher's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from flashckpt.elastic.etcd.standalone import StandaloneEtcd, remove_leftovers
from flashckpt.testing.elastic import process_tree

pytestmark = pytest.mark.etcd

# A launcher's part in it: starts the private etcd, prints its data directory, waits.
_HOLDER = textwrap.dedent(
    """
    import sys, time
    from flashckpt.elastic.etcd.standalone import StandaloneEtcd
    etcd = StandaloneEtcd(parent_dir=sys.argv[1])
    etcd.start()
    print(etcd.data_dir, flush=True)
    time.sleep(3600)
    """
)


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        tree = process_tree(proc.pid)
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)


def _hold(parent: Path, procs: list[subprocess.Popen[str]]) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(parent)], stdout=subprocess.PIPE, text=True
    )
    procs.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the holder did not start its etcd"
    return proc, Path(line)


def _leftovers(parent: Path) -> list[Path]:
    return sorted(parent.glob("flashckpt-etcd-*"))


def test_a_closed_standalone_etcd_leaves_no_data(tmp_path: Path) -> None:
    with StandaloneEtcd(parent_dir=str(tmp_path)) as etcd:
        data = Path(etcd.data_dir)
        assert (data / "data" / "member").is_dir()  # etcd wrote there
    assert not data.exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.slow
def test_a_killed_launchers_etcd_data_is_removed_by_the_next_one_a_live_ones_is_not(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    killed, killed_dir = _hold(tmp_path, holders)
    _, live_dir = _hold(tmp_path, holders)
    killed_etcd = [p for p in process_tree(killed.pid) if p.pid != killed.pid]
    assert killed_etcd, "the holder's etcd is not its child"
    assert json.loads((killed_dir / "flashckpt-owner.json").read_text())["pid"] == killed.pid

    # A live launcher's directory is kept, its etcd running.
    assert remove_leftovers(str(tmp_path)) == []
    assert killed_dir.is_dir() and live_dir.is_dir()

    os.kill(killed.pid, signal.SIGKILL)  # the launcher alone: its etcd gets SIGTERM (parent death)
    killed.wait()
    assert killed_dir.is_dir()  # nobody removed it: the launcher could not
    _, alive = psutil.wait_procs(killed_etcd, timeout=30)
    assert not alive, alive

    # The next standalone launcher removes the dead one's data and keeps the live one's.
    with StandaloneEtcd(parent_dir=str(tmp_path)) as etcd:
        assert not killed_dir.exists()
        assert live_dir.is_dir()
        assert _leftovers(tmp_path) == sorted([live_dir, Path(etcd.data_dir)])


def test_a_directory_whose_owner_lives_or_that_is_in_use_is_kept(tmp_path: Path) -> None:
    # Owner alive (this process) without its lock held: kept.
    mine = tmp_path / "flashckpt-etcd-mine"
    mine.mkdir()
    (mine / "flashckpt-owner.json").write_text(json.dumps({"pid": os.getpid(), "start": None}))
    # Owner gone, but a process still has a file open under it (an etcd shutting down): kept.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    busy = tmp_path / "flashckpt-etcd-busy"
    busy.mkdir()
    (busy / "flashckpt-owner.json").write_text(json.dumps({"pid": int(gone.stdout), "start": "1"}))
    # Owner gone, nothing uses it: removed.
    dead = tmp_path / "flashckpt-etcd-dead"
    dead.mkdir()
    (dead / "flashckpt-owner.json").write_text(json.dumps({"pid": int(gone.stdout), "start": "1"}))
    (dead / "member").mkdir()
    # No owner file, just made (a launcher between mkdtemp and writing it): kept.
    fresh = tmp_path / "flashckpt-etcd-fresh"
    fresh.mkdir()
    with open(busy / "wal", "w"):
        assert remove_leftovers(str(tmp_path)) == [str(dead)]
    assert mine.is_dir() and busy.is_dir() and fresh.is_dir() and not dead.exists()

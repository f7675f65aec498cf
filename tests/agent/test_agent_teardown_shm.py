"""The agent's shared-memory directory as others leave it (issue 30): full to the last byte, or
holding files another user planted under the job's names. Either is an error at the agent's
start (and at the trainer's allocation) that names the directory or the file, its owner, and the
fix, and leaves no stray file; once the space is freed the job resumes from the memory it kept."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from agentproc import start_agent
from fchelpers import (
    FcEnv,
    kill_job_processes,
    private_shm,
    start_tinytrain,
)
from waiting import wait_until

from flashckpt.format.shm import Slot

pytestmark = pytest.mark.slow

STEPS = 30


@pytest.fixture
def env(fc_env: FcEnv, tmp_path: Path) -> Iterator[FcEnv]:
    if os.geteuid() != 0:
        pytest.skip("needs root: a tmpfs of the test's own, files of another uid")
    with private_shm(tmp_path / "shm", "32m") as shm:
        if not os.path.ismount(shm):
            pytest.skip("cannot mount a tmpfs here")
        fc_env.shm_dir = shm
        try:
            yield fc_env
        finally:
            kill_job_processes(fc_env.job)


def _train(
    env: FcEnv, log: Path, *extra: str, wrap: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    flags = ("--steps", str(STEPS), "--every", "2", "--quiet", *extra)
    return start_tinytrain(env, log, *flags, wrap=wrap)


def _refused_agent(env: FcEnv, *wrap: str) -> str:
    """An agent that must refuse to start (exit code 1); its output."""
    b = start_agent(env, wrap=wrap, ready=False)
    assert b.wait(timeout=240) == 1, b.log_tail()
    return b.log.read_text()


def _newest_in_memory(env: FcEnv) -> int:
    newest = -1
    for name in os.listdir(env.shm_dir):
        if name.startswith(f"fc.{env.job}.") and name[-3:] in (".s0", ".s1"):
            slot = Slot(os.path.join(env.shm_dir, name))
            try:
                info = slot.header()
                if info is not None and info.complete:
                    newest = max(newest, info.step)
            finally:
                slot.close()
    return newest


def _fill(shm: str) -> str:
    """Fills the tmpfs to its last byte with a file of its own; returns its path."""
    path = os.path.join(shm, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        st = os.statvfs(shm)
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize)
        off = os.fstat(fd).st_size
        with contextlib.suppress(OSError):
            while True:
                os.pwrite(fd, b"\0" * 4096, off)
                off += 4096
    finally:
        os.close(fd)
    assert os.statvfs(shm).f_bavail == 0
    return path


@pytest.mark.timeout(900)  # five training runs and agents: minutes on a loaded machine
def test_full_shm_at_agent_start_names_it_and_the_job_resumes_once_freed(
    tmp_path: Path, env: FcEnv
) -> None:
    ref_log = tmp_path / "ref.log"
    # Not in the test's small tmpfs (the fixture clears it).
    ref = env.reference(tmp_path, shm_dir="/dev/shm")
    try:
        assert _train(ref, ref_log).wait(timeout=240) == 0
    finally:
        kill_job_processes(ref.job)
    ref_final = safetensors.torch.load_file(str(ref_log) + ".final.safetensors")

    # A run whose trainer and agent crash, leaving their snapshots in memory.
    log, report = tmp_path / "run.log", tmp_path / "report.txt"
    a = start_agent(env)
    t = _train(env, log, "--step-sleep", "0.05")
    wait_until(lambda: _newest_in_memory(env) >= 10, "snapshots in memory", timeout=120.0)
    for p in (t, a):
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    newest = _newest_in_memory(env)
    os.unlink(os.path.join(env.shm_dir, f"fc.{env.job}.{env.node}.owner"))
    filler = _fill(env.shm_dir)
    for _ in range(2):
        text = _refused_agent(env)
        assert f"the shared-memory directory {env.shm_dir} is full (0.0 MiB free" in text, text
        assert "--shm-size" in text and "flashckpt clean" in text, text
        assert "snapshot slots there" in text, text  # the kept memory is named, not lost
    # A trainer's entry (it starts its own agent) says the same, not "did not start in 30 s".
    entry = tmp_path / "entry.log"
    assert _train(env, entry).wait(timeout=240) != 0
    err = Path(str(entry) + ".err").read_text()
    assert f"could not start: the shared-memory directory {env.shm_dir} is full" in err, err
    left = sorted(os.listdir(env.shm_dir))
    assert [n for n in left if ".tmp" in n] == [], left
    # Space freed: the rerun (its own agent) resumes from the snapshots memory kept.
    os.unlink(filler)
    rerun = _train(env, log, "--report", str(report))
    assert rerun.wait(timeout=240) == 0, Path(str(log) + ".err").read_text()[-4000:]
    assert report.read_text().split() == [str(newest), "memory"]
    final = safetensors.torch.load_file(str(log) + ".final.safetensors")
    for k in final:
        assert torch.equal(final[k], ref_final[k]), k


OTHER_UID = 54321


def _plant(path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"planted")
    os.chown(path, OTHER_UID, OTHER_UID)
    os.chmod(path, 0o644)


def _as_a_user(env: FcEnv) -> tuple[str, ...]:
    """The shm dir made like /dev/shm (mode 1777, not the victim's own) and the command prefix
    that runs the victim as an ordinary user would be: without CAP_FOWNER, so a rename over
    another user's file in a sticky directory fails with EPERM (root's uid is kept: the test's
    Python lives where only root may read)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("needs setpriv (util-linux) to drop CAP_FOWNER")
    os.chown(env.shm_dir, OTHER_UID + 1, OTHER_UID + 1)
    os.chmod(env.shm_dir, 0o1777)
    return (setpriv, "--bounding-set=-fowner")


def test_planted_owner_file_is_named_with_its_owner(env: FcEnv) -> None:
    wrap = _as_a_user(env)
    owner = os.path.join(env.shm_dir, f"fc.{env.job}.{env.node}.owner")
    _plant(owner)
    for _ in range(2):
        text = _refused_agent(env, *wrap)
        assert f"{owner} belongs to another user (uid {OTHER_UID}" in text, text
        assert "sudo rm" in text and "--job" in text and "--shm-dir" in text, text
        assert sorted(os.listdir(env.shm_dir)) == [os.path.basename(owner)]  # nothing left
    # Removed (as the message says): the job starts.
    os.unlink(owner)
    b = start_agent(env, wrap=wrap)  # answers on the job's socket
    b.stop(timeout=60)


def test_planted_slot_file_is_named_at_the_trainers_entry(tmp_path: Path, env: FcEnv) -> None:
    wrap = _as_a_user(env)
    slot = os.path.join(env.shm_dir, f"fc.{env.job}.{env.node}.r00000.s1")
    _plant(slot)
    log = tmp_path / "run.log"
    t = _train(env, log, wrap=wrap)
    assert t.wait(timeout=240) != 0
    err = Path(str(log) + ".err").read_text()
    assert f"{slot} belongs to another user (uid {OTHER_UID}" in err, err[-4000:]
    assert [n for n in os.listdir(env.shm_dir) if ".tmp" in n] == []

"""deploy/slurm's stop path, with the signals sent as slurmstepd sends them (no Slurm here): the
real flashckpt.sbatch under bash, with stand-ins for srun, scancel, sbcast, the launcher and etcd
(tests/deploy/slurmfake; the TLS files are made with the real openssl).

- ``--signal=B:TERM@120``: SIGTERM to the batch shell only.
- ``--signal=TERM@120``: SIGTERM to every task of every step, not to the batch shell.

Either way every launcher gets SIGTERM, persists while etcd still answers (each waits for the
test's go file: as long as persisting takes), and only then is etcd stopped and its data and the
job's TLS files removed. The srun stand-in SIGKILLs its tasks on SIGTERM, as the real one does, so
a script that passed the signal with ``kill $srun_pid`` fails here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
from deployhelpers import DEPLOY
from waiting import wait_until

SBATCH = DEPLOY / "slurm" / "flashckpt.sbatch"
FAKES = Path(__file__).with_name("slurmfake")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _events(fake: Path) -> list[str]:
    path = fake / "events"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("to", ["batch shell (B:)", "steps"])
def test_every_launcher_persists_before_etcd_goes(to: str, tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI (apt-get install openssl)")
    fake = tmp_path / "slurm"
    fake.mkdir()
    job = f"9{uuid.uuid4().int % 10**6}"
    data = tmp_path / "etcd-data"
    env = {
        "PATH": f"{FAKES}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "FAKE_SLURM": str(fake),
        "SLURM_JOB_ID": job,
        "FC_HOSTS": "node1 node2 node3",
        "FC_STORAGE": str(tmp_path / "ckpt"),
        "FC_ETCD_BIN": str(FAKES / "etcd"),
        "FC_ETCD_ADDR": "127.0.0.1",
        "FC_ETCD_PORT": str(_free_port()),
        "FC_ETCD_DATA_DIR": str(data),
    }
    batch = subprocess.Popen(
        ["bash", str(SBATCH), "train.py"],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        launchers = [f"launcher{i}" for i in range(3)]
        wait_until(
            lambda: all(f"{n} start" in _events(fake) for n in launchers),
            timeout=60,
            what="three launchers started",
        )
        if to == "steps":
            subprocess.run([str(FAKES / "scancel"), "--signal=TERM", job], env=env, check=True)
        else:
            os.kill(batch.pid, signal.SIGTERM)
        wait_until(
            lambda: all(f"{n} SIGTERM" in _events(fake) for n in launchers),
            timeout=30,
            what="SIGTERM reached every launcher",
        )
        # Persisting takes as long as it takes: etcd and its data must still be there.
        assert "etcd SIGTERM" not in _events(fake), _events(fake)
        assert (data / "db").exists()
        (fake / "go").touch()
        output, _ = batch.communicate(timeout=60)
    finally:
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
            batch.wait()
        for step in (fake / "steps").glob("*"):
            try:
                os.killpg(int(step.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    events = _events(fake)
    log = output.decode(errors="replace")
    assert batch.returncode == 0, (events, log)
    assert not any(e.startswith("srun SIGTERM") for e in events), events
    stopped = events.index("etcd SIGTERM")
    for name in launchers:
        assert events.index(f"{name} persisted (etcd answered)") < stopped, events
    # B: the batch shell passed the signal on to the steps, once; without B: it never had it.
    assert events.count("scancel TERM") == 1, events
    assert ("SIGTERM: passing it to the launchers" in log) == (to != "steps"), log
    assert not data.exists(), "etcd's data outlived the job"
    assert not list(Path("/tmp").glob(f"flashckpt-etcd-{job}-tls-*")), "TLS files left in /tmp"
    assert "older than 3.5.3" in log  # the stand-in says 3.5.1

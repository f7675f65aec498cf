"""deploy/slurm for real, on a single-machine Slurm started by the test (Debian's slurm-wlm and
munge: munged, slurmctld and slurmd on OS-chosen ports, every file in tmp_path): submit.sh
submits flashckpt.sbatch, which starts etcd for the job with srun and one `flashckpt run` per
machine with srun; the job trains examples/gpt_train.py. Slurm SIGKILLs it mid-training; the job
submitted again with the same --job-id (a requeue) resumes from a snapshot of the first and
trains to the end (the job tier of deploy/slurm/README.md's failure table).

One machine only: the hot spares of --nnodes MIN:MAX need a second slurmd; the dry-run test
(test_deploy_slurm.py) checks the MIN:MAX the template computes for larger allocations.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from deployhelpers import DEPLOY, ROOT
from waiting import wait_until

pytestmark = pytest.mark.slow

SUBMIT = DEPLOY / "slurm" / "submit.sh"
TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo")


def _free_port(pairs: bool = False) -> int:
    """A free TCP port (and the next one too, with ``pairs``: etcd's peer port)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not pairs:
            return port
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


class Slurm:
    """munged, slurmctld and slurmd of a one-machine cluster in ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        root.mkdir()
        (root / "state").mkdir()
        (root / "spool").mkdir()
        key, sock = root / "munge.key", root / "munge.sock"
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
        host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=fctest",
                    f"SlurmctldHost={host}(127.0.0.1)",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={sock}",
                    "CredType=cred/munge",
                    "MpiDefault=none",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"StateSaveLocation={root / 'state'}",
                    f"SlurmdSpoolDir={root / 'spool'}",
                    f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={root / 'slurmctld.log'}",
                    f"SlurmdLogFile={root / 'slurmd.log'}",
                    "ReturnToService=2",
                    f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
                    "OverSubscribe=YES",
                    "",
                ]
            )
        )
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._start(
            ["munged", "-F", "-f", f"--socket={sock}", f"--key-file={key}",
             f"--log-file={root / 'munged.log'}", f"--pid-file={root / 'munged.pid'}",
             f"--seed-file={root / 'munged.seed'}"],
            "munged",
        )  # fmt: skip
        self._wait(lambda: sock.exists(), "munged's socket")
        self._start(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._start(["slurmd", "-D", "-f", str(self.conf)], "slurmd")
        self._wait(self._idle, "an idle node in sinfo")

    def _start(self, cmd: list[str], name: str) -> None:
        with open(self.root / f"{name}.out", "ab") as out:
            self.procs.append(
                subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
            )

    def _idle(self) -> bool:
        done = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=self.env
        )
        return done.stdout.strip() == "idle"

    def _wait(self, cond: Callable[[], object], what: str, timeout: float = 60.0) -> None:
        """:func:`waiting.wait_until` ``cond()``; fails at once (with the daemons' logs) when a
        daemon exits first, and with them when time runs out."""

        def check() -> object:
            for p in self.procs:
                if p.poll() is not None:
                    pytest.fail(
                        f"{p.args[0]} exited ({p.returncode}) before {what}:\n{self.logs()}"
                    )
            return cond()

        try:
            wait_until(check, what, timeout=timeout, interval=0.1)
        except AssertionError as e:
            pytest.fail(f"{e}:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log"))
        )

    def close(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], capture_output=True, env=self.env)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=30)


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[Slurm]:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{missing} not installed (Debian: apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("the test's slurmd and munged run as root")
    s = Slurm(tmp_path / "slurm")
    try:
        yield s
    finally:
        s.close()


def _steps(progress: Path) -> list[int]:
    if not progress.exists():
        return []
    return [json.loads(ln)["step"] for ln in progress.read_text().splitlines() if ln.strip()]


def _submit(slurm: Slurm, tmp: Path, env: dict[str, str], *args: str, wait: bool) -> str:
    done = subprocess.run(
        ["bash", str(SUBMIT), *(["--wait"] if wait else []), *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    outputs = "\n".join(p.read_text() for p in tmp.glob("flashckpt-*.out"))
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{outputs}\n{slurm.logs()}"
    return done.stdout.split()[-1]  # "Submitted batch job N"


def test_sbatch_template_trains_and_a_requeued_job_resumes(slurm: Slurm, tmp_path: Path) -> None:
    """Job 1 is SIGKILLed by Slurm mid-training (scancel --signal=KILL: batch script, launcher,
    workers); job 2, submitted with the same --job-id on the same machine, resumes from a
    snapshot of job 1 and trains to the end."""
    job = "sl" + uuid.uuid4().hex[:10]
    storage = f"file://{tmp_path / 'ckpt'}"
    # Short: the agent's socket path has a length limit.
    run_dir, shm_dir = Path(f"/tmp/fct-{job}"), Path(f"/dev/shm/{job}")
    shm_dir.mkdir(mode=0o700)
    env = {
        **slurm.env,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "FC_PYTHON": sys.executable,
        "FC_ETCD_PORT": str(_free_port(pairs=True)),
    }
    flags = [
        "--nodes", "1", "--min-nodes", "1", "--job-id", job, "--storage", storage,
        "--nproc-per-node", "1", "--run-dir", str(run_dir), "--shm-dir", str(shm_dir), "--",
        str(ROOT / "examples" / "gpt_train.py"), "--storage", storage, "--every", "2",
    ]  # fmt: skip
    progress = [tmp_path / "first" / "progress-r0.txt", tmp_path / "second" / "progress-r0.txt"]
    try:
        env["FC_ETCD_DATA_DIR"] = str(tmp_path / "etcd1")
        first = _submit(
            slurm, tmp_path, env, *flags, "--steps", "100000", "--out", str(tmp_path / "first"),
            wait=False,
        )  # fmt: skip
        slurm._wait(lambda: len(_steps(progress[0])) >= 8, "8 steps of job 1", timeout=240)
        subprocess.run(["scancel", "--full", "--signal=KILL", first], check=True, env=slurm.env)
        slurm._wait(lambda: _job_state(slurm, first) in ("", "CANCELLED", "FAILED"), "job 1 gone")
        last = max(_steps(progress[0]))
        env["FC_ETCD_DATA_DIR"] = str(tmp_path / "etcd2")
        # A port of its own, as the template gives each job (job 1's etcd may still be dying).
        env["FC_ETCD_PORT"] = str(_free_port(pairs=True))
        _submit(
            slurm, tmp_path, env, *flags, "--steps", str(last + 4),
            "--out", str(tmp_path / "second"), wait=True,
        )  # fmt: skip
        report = json.loads((tmp_path / "second" / "report.txt").read_text().splitlines()[0])
        assert report["restored_from"] in ("memory", "storage"), report
        assert 2 <= report["start_step"] <= last + 1, (report, last)
        assert _steps(progress[1]) == list(range(report["start_step"], last + 4))
        assert (tmp_path / "ckpt" / f"step-{last + 4:09d}").is_dir()
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(64)
    except TimeoutError:
        return b""


def _job_state(slurm: Slurm, job: str) -> str:
    done = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, env=slurm.env
    )
    return done.stdout.strip()


def test_requeued_job_resumes_from_the_memory_of_the_systemd_agent(
    slurm: Slurm, tmp_path: Path
) -> None:
    """--agent systemd: the node agent runs outside the job, as deploy/systemd's unit runs it
    (its ExecStart, started here by the test, readiness through $NOTIFY_SOCKET), and the job's
    workers run under torchrun with the flashckpt-etcd rendezvous. Slurm SIGKILLs job 1; the agent
    is no process of the job and keeps the slots, so job 2 resumes from memory."""
    job = "sd" + uuid.uuid4().hex[:10]
    storage = f"file://{tmp_path / 'ckpt'}"
    run_dir = Path(f"/run/flashckpt/{job}")
    unit = (DEPLOY / "systemd" / "flashckpt-agent@.service").read_text()
    (line,) = [ln for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    words = shlex.split(line.removeprefix("ExecStart=").replace("%i", job))
    words = [w.replace("${FC_STORAGE}", storage).replace("${FC_METRICS_PORT}", "0") for w in words]
    assert words[:2] == ["/opt/flashckpt/bin/flashckpt", "agent"]
    # What RuntimeDirectory= and ExecStartPre= make (a directory here, not a tmpfs).
    run_dir.parent.mkdir(exist_ok=True)
    run_dir.mkdir(mode=0o700)
    (run_dir / "shm").mkdir(mode=0o700)
    notify = tmp_path / "notify.sock"
    ready = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ready.bind(str(notify))
    ready.settimeout(1)
    with open(tmp_path / "agent.log", "ab") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "flashckpt", *words[1:]],
            env={**os.environ, "NOTIFY_SOCKET": str(notify)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    env = {
        **slurm.env,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "FC_PYTHON": sys.executable,
        "FC_ETCD_PORT": str(_free_port(pairs=True)),
    }
    flags = [
        "--nodes", "1", "--min-nodes", "1", "--job-id", job, "--storage", storage,
        "--nproc-per-node", "1", "--agent", "systemd", "--",
        str(ROOT / "examples" / "gpt_train.py"), "--storage", storage, "--every", "2",
    ]  # fmt: skip
    progress = [tmp_path / "first" / "progress-r0.txt", tmp_path / "second" / "progress-r0.txt"]
    try:
        slurm._wait(lambda: agent.poll() is None and _recv(ready) == b"READY=1", "READY=1")
        env["FC_ETCD_DATA_DIR"] = str(tmp_path / "etcd1")
        first = _submit(
            slurm, tmp_path, env, *flags, "--steps", "100000", "--out", str(tmp_path / "first"),
            wait=False,
        )  # fmt: skip
        slurm._wait(lambda: len(_steps(progress[0])) >= 8, "8 steps of job 1", timeout=240)
        subprocess.run(["scancel", "--full", "--signal=KILL", first], check=True, env=slurm.env)
        slurm._wait(lambda: _job_state(slurm, first) in ("", "CANCELLED", "FAILED"), "job 1 gone")
        last = max(_steps(progress[0]))
        env["FC_ETCD_DATA_DIR"] = str(tmp_path / "etcd2")
        # A port of its own, as the template gives each job (job 1's etcd may still be dying).
        env["FC_ETCD_PORT"] = str(_free_port(pairs=True))
        _submit(
            slurm, tmp_path, env, *flags, "--steps", str(last + 4),
            "--out", str(tmp_path / "second"), wait=True,
        )  # fmt: skip
        report = json.loads((tmp_path / "second" / "report.txt").read_text().splitlines()[0])
        assert report["restored_from"] == "memory", report  # the agent outlived job 1
        # The unit runs it with --free-finished: job 2 finished and storage holds its newest
        # step, so it frees the slots and exits 0 (the unit's Restart=always starts an empty
        # one); no memory stays held after the job (issue 44).
        assert agent.wait(timeout=150) == 0, (tmp_path / "agent.log").read_text()
        log = (tmp_path / "agent.log").read_text()
        assert "the job finished and storage holds its newest step" in log, log
        assert sorted((run_dir / "shm").iterdir()) == [], log
        assert 2 <= report["start_step"] <= last + 1, (report, last)
        assert _steps(progress[1]) == list(range(report["start_step"], last + 4))
    finally:
        ready.close()
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(timeout=120)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            run_dir.parent.rmdir()  # only when no other job's is there

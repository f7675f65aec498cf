"""Helpers shared by the benchmarks: a synthetic training state, a tiny training loop, timing
statistics, and a workspace that cleans up every agent, shared-memory file and temp dir it made.

Nothing here imports flashckpt internals: the benchmarks use the public API only.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

GiB = 1 << 30
MiB = 1 << 20


# -- statistics -------------------------------------------------------------------------------
def median(xs: list[float] | None) -> float | None:
    xs = [x for x in (xs or []) if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def fmt_s(x: float | None, width: int = 8) -> str:
    if x is None:
        return "-".rjust(width)
    if x < 0.0095:
        return f"{x * 1000:.1f}ms".rjust(width)
    return f"{x:.3f}".rjust(width)


def fmt_x(x: float | None, width: int = 7) -> str:
    if x is None:
        return "-".rjust(width)
    return f"{x:.2f}x".rjust(width)


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


# -- the training state -----------------------------------------------------------------------
@dataclass
class Trainer:
    """A stack of big Linear layers with AdamW: params + exp_avg + exp_avg_sq ~= the size asked.

    ``step()`` is one training iteration (forward, backward, optimizer step) on a fixed batch.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    width: int
    layers: int
    batch: int = 8
    x: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    @staticmethod
    def build(size_gib: float, seed: int = 0) -> Trainer:
        torch.manual_seed(seed)
        params = size_gib * GiB / 12  # fp32 params + two fp32 AdamW moments
        width = 2048 if params >= 2048 * 2048 else 1024
        layers = max(1, round(params / (width * width + width)))
        with torch.no_grad():
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        try:  # fused: one pass, no temporaries (what a tuned training job uses)
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        except (RuntimeError, TypeError, ValueError):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        tr = Trainer(model, opt, width, layers)
        tr.set_batch(1)
        tr.step()  # creates the optimizer state (exp_avg, exp_avg_sq, step)
        return tr

    def set_batch(self, batch: int) -> None:
        self.batch = batch
        self.x = torch.randn(batch, self.width)

    def fwd_bwd(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.model(self.x).square().mean()
        loss.backward()

    def opt_step(self) -> None:
        self.optimizer.step()

    def step(self) -> None:
        self.fwd_bwd()
        self.opt_step()

    def calibrate(self, target_fwd_bwd_s: float) -> dict[str, float]:
        """Picks a batch so forward+backward takes about ``target_fwd_bwd_s``."""
        self.set_batch(16)
        for _ in range(2):
            self.fwd_bwd()
        t = median([timed(self.fwd_bwd)[0] for _ in range(3)]) or 1e-3
        batch = int(max(1, min(1024, round(16 * target_fwd_bwd_s / max(t, 1e-4)))))
        self.set_batch(batch)
        self.fwd_bwd()
        fb = median([timed(self.fwd_bwd)[0] for _ in range(3)]) or 0.0
        opt = median([timed(self.opt_step)[0] for _ in range(3)]) or 0.0
        return {"batch": batch, "fwd_bwd_s": fb, "opt_step_s": opt, "step_s": fb + opt}

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Model parameters/buffers and optimizer state tensors (what a checkpoint holds)."""
        out = [(f"model/{k}", v) for k, v in self.model.state_dict().items()]
        for i, st in enumerate(self.optimizer.state_dict()["state"].values()):
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    out.append((f"optim/{i}/{k}", v))
        return out

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.state_tensors())


# -- files ------------------------------------------------------------------------------------
def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            fsync_path(os.path.join(dirpath, f))
        fsync_path(dirpath)


def drop_file_cache(root: str) -> int:
    """Evicts the (clean) page-cache pages of every file under ``root``; returns files touched.

    POSIX_FADV_DONTNEED on one's own files needs no privileges and affects nobody else.
    """
    n = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def disk_write_speed(
    directory: str, nbytes: int, chunk: int = 64 * MiB, direct: bool = False
) -> float:
    """dd-like: writes ``nbytes`` with os.write in ``chunk`` pieces + fsync; returns seconds.

    ``direct`` opens the file with O_DIRECT (no page cache: the disk's own speed, and almost no
    CPU); the default goes through the page cache like every buffered writer.
    """
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(chunk))
    mv = memoryview(buf)
    if direct:
        nbytes = -(-nbytes // 4096) * 4096
    path = os.path.join(directory, f"dd-{os.getpid()}.bin")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, mv[: min(left, chunk)])
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    mv.release()
    buf.close()
    return dt


def dir_bytes(root: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, f))
    return total


# -- memory -----------------------------------------------------------------------------------
def available_bytes() -> int:
    return int(psutil.virtual_memory().available)


def shm_free_bytes(shm_dir: str = "/dev/shm") -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def machine_info() -> dict[str, Any]:
    vm = psutil.virtual_memory()
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(vm.total / GiB, 1),
        "shm_gib": round(shm_free_bytes() / GiB, 1),
        "gpu": torch.cuda.is_available(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "kernel": os.uname().release,
    }


# -- workspace: everything made here is removed on exit --------------------------------------
class Workspace:
    """A temp dir under /tmp (short: the agent socket path must stay < 100 chars), unique job ids,
    and a registry of agent pids and shared-memory files to remove on exit, even on failure."""

    def __init__(self, prefix: str = "fcb") -> None:
        self.root = tempfile.mkdtemp(prefix=f"{prefix}-", dir="/tmp")
        self.run_dir = os.path.join(self.root, "run")
        os.makedirs(self.run_dir, mode=0o700)
        self.tag = f"b{os.getpid() % 100000}"
        self._n = 0
        self.jobs: list[str] = []
        self.agents: dict[int, str] = {}  # pid -> job
        self.shm_files: list[str] = []
        self._popen: dict[int, subprocess.Popen[bytes]] = {}

    def new_job(self, what: str) -> str:
        self._n += 1
        job = f"{self.tag}-{what}{self._n}"
        self.jobs.append(job)
        return job

    def path(self, *parts: str) -> str:
        p = os.path.join(self.root, *parts)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p

    def shm_path(self, what: str) -> str:
        self._n += 1
        p = os.path.join("/dev/shm", f"fcbench-{self.tag}-{what}{self._n}")
        self.shm_files.append(p)
        return p

    def log_path(self, job: str, node: str) -> str:
        return os.path.join(self.run_dir, f"{job}.{node}.log")

    def track_agent(self, pid: int | None, job: str) -> None:
        if pid:
            self.agents[int(pid)] = job

    def start_agent(self, job: str, node: str, storage: str | None, timeout: float = 60) -> int:
        """Starts a node agent (``python -m flashckpt agent``) in its own session, as the
        checkpointer's auto-start does; waits until it listens; returns its pid."""
        cmd = [sys.executable, "-m", "flashckpt", "agent", "--job", job, "--node", node]
        # A short idle timeout: if this benchmark dies (e.g. SIGKILL), the agent persists,
        # removes its slots and leaves within two minutes instead of ten.
        cmd += ["--run-dir", self.run_dir, "--keep", "2", "--idle-timeout", "120"]
        if storage:
            cmd += ["--storage", storage]
        with open(self.log_path(job, node), "ab") as logf:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True
            )
        self.track_agent(proc.pid, job)
        self._popen[proc.pid] = proc
        sock_path = os.path.join(self.run_dir, f"{job}.{node}.sock")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"agent exited with code {proc.returncode}; see its log")
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
                s.connect(sock_path)
                return proc.pid
            time.sleep(0.02)
        raise TimeoutError(f"agent did not listen on {sock_path} within {timeout:.0f} s")

    def stop_agent(self, pid: int, timeout: float = 120.0) -> bool:
        """SIGTERMs an agent we started (checked by its command line); True if it exited."""
        job = self.agents.get(pid)
        try:
            proc = psutil.Process(pid)
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            self.agents.pop(pid, None)
            return True
        if "flashckpt" not in cmdline or (job is not None and job not in cmdline):
            self.agents.pop(pid, None)  # pid reused by something else: not ours
            return True
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except psutil.TimeoutExpired:
            with contextlib.suppress(psutil.Error):
                proc.kill()
                proc.wait(10)
        except psutil.Error:
            pass
        self._forget(pid)
        return True

    def _forget(self, pid: int) -> None:
        self.agents.pop(pid, None)
        proc = self._popen.pop(pid, None)
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.wait(5)

    def wait_agent_exit(self, pid: int, timeout: float) -> bool:
        """Waits for an agent to exit by itself; True if it did."""
        try:
            psutil.Process(pid).wait(timeout)
        except psutil.TimeoutExpired:
            return False
        except psutil.Error:
            pass
        self._forget(pid)
        return True

    def job_shm_files(self, job: str) -> list[str]:
        return sorted(glob.glob(f"/dev/shm/fc.{job}.*"))

    def remove_job_shm(self, job: str) -> None:
        for p in self.job_shm_files(job):
            with contextlib.suppress(OSError):
                os.unlink(p)

    def cleanup(self) -> None:
        for pid in list(self.agents):
            with contextlib.suppress(Exception):
                self.stop_agent(pid, timeout=30)
        for job in self.jobs:
            self.remove_job_shm(job)
        for p in self.shm_files:
            with contextlib.suppress(OSError):
                os.unlink(p)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


@contextlib.contextmanager
def terminate_as_exception() -> Iterator[None]:
    """SIGTERM/SIGHUP raise SystemExit so ``finally`` blocks (the cleanup) run."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)

"""Helpers shared by the benchmarks: a synthetic training state, a tiny training loop, timing
statistics, and a workspace that cleans up every agent, shared-memory file and temp dir it made.

Nothing here imports flashckpt internals: the benchmarks use the public API only.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
import resource
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
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the model and optimizer state live; on CUDA each step waits for its kernels, so
    every time measured is of work done."""

    @staticmethod
    def build(size_gib: float, seed: int = 0, device: str = "cpu") -> Trainer:
        torch.manual_seed(seed)
        dev = torch.device(device)
        params = size_gib * GiB / 12  # fp32 params + two fp32 AdamW moments
        width = 2048 if params >= 2048 * 2048 else 1024
        layers = max(1, round(params / (width * width + width)))
        with torch.no_grad():
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
            model = model.to(dev)
        try:  # fused: one pass, no temporaries (what a tuned training job uses)
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        except (RuntimeError, TypeError, ValueError):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        tr = Trainer(model, opt, width, layers, device=dev)
        tr.set_batch(1)
        tr.step()  # creates the optimizer state (exp_avg, exp_avg_sq, step)
        return tr

    def set_batch(self, batch: int) -> None:
        self.batch = batch
        self.x = torch.randn(batch, self.width, device=self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def fwd_bwd(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.sync()

    def opt_step(self) -> None:
        self.optimizer.step()
        self.sync()

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


# -- per-thread CPU, context switches and disk writes, read from /proc -------------------------
PROBE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_probe")
"""Put first on ``PYTHONPATH`` (with ``$FCBENCH_THREAD_LOG`` set) of a measured process: its
``sitecustomize`` logs each Python thread's name and, when the thread ends, its CPU time."""

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_cpu(path: str) -> float | None:
    """utime + stime in seconds from a /proc stat file (None if it is gone)."""
    try:
        with open(path) as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw.rsplit(")", 1)[1].split()  # comm may hold spaces and parentheses
    return (int(rest[11]) + int(rest[12])) / _CLK_TCK


def process_cpu(pid: int) -> float:
    """utime + stime of a live process in seconds (raises if it is gone)."""
    cpu = _stat_cpu(f"/proc/{pid}/stat")
    if cpu is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return cpu


def own_cpu() -> float:
    """CPU seconds of this process so far, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _status_fields(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0])
    return out


def _io_fields(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            k, _, v = line.partition(":")
            with contextlib.suppress(ValueError):
                out[k.strip()] = int(v)
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def proc_snapshot(pid: int) -> dict[str, Any]:
    """CPU seconds of a process (its threads that ended included) and of each live thread, the
    thread's comm and context switches, and the process's I/O counters."""
    base = f"/proc/{pid}"
    threads: dict[int, dict[str, Any]] = {}
    with contextlib.suppress(OSError):
        for t in os.listdir(f"{base}/task"):
            tid = int(t)
            cpu = _stat_cpu(f"{base}/task/{t}/stat")
            if cpu is None:
                continue
            sw = _status_fields(
                f"{base}/task/{t}/status",
                ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"),
            )
            threads[tid] = {
                "cpu_s": cpu,
                "comm": _read(f"{base}/task/{t}/comm"),
                "vol_cs": sw.get("voluntary_ctxt_switches", 0),
                "invol_cs": sw.get("nonvoluntary_ctxt_switches", 0),
            }
    return {
        "pid": pid,
        "t": time.monotonic(),
        "cpu_s": _stat_cpu(f"{base}/stat"),
        "io": _io_fields(f"{base}/io"),
        "threads": threads,
    }


def thread_log(directory: str, pid: int) -> dict[int, dict[str, Any]]:
    """What the probe's ``sitecustomize`` logged for ``pid``: tid -> name, and CPU at its end."""
    out: dict[int, dict[str, Any]] = {}
    with contextlib.suppress(OSError), open(os.path.join(directory, f"{pid}.threads")) as f:
        for line in f:
            parts = line.rstrip("\n").split(" ", 4)
            if len(parts) != 5:
                continue
            kind, _pid, tid_s, cpu_s, name = parts
            rec = out.setdefault(int(tid_s), {"name": name})
            if kind == "exit" and cpu_s != "-":
                rec["exit_cpu_s"] = float(cpu_s)
    return out


def thread_cpu_delta(
    before: dict[str, Any],
    after: dict[str, Any],
    log_before: dict[int, dict[str, Any]],
    log_after: dict[int, dict[str, Any]],
    main_name: str = "main",
) -> dict[str, Any]:
    """CPU seconds (and involuntary context switches) per thread name between two
    ``proc_snapshot``s of one process, with the probe's ``thread_log`` read at each.

    A thread alive at both counts its difference; one that started in between counts all it
    used (its /proc figure, or the CPU logged at its end); one that ended in between counts its
    logged end CPU minus the first figure; one that had ended before the first snapshot counts
    nothing. Threads without a logged name: the process's main thread (tid == pid) is
    ``main_name``, others ``native`` (no Python code started them: torch's intra-op OpenMP
    workers). ``unattributed_s`` is the process total minus the sum (threads that ended without
    a log entry; clock-tick rounding).
    """
    pid = after["pid"]
    per: dict[str, float] = {}
    invol: dict[str, int] = {}
    for tid in set(before["threads"]) | set(after["threads"]) | set(log_after):
        if "exit_cpu_s" in log_before.get(tid, {}):
            continue  # ended before the first snapshot
        b, a = before["threads"].get(tid), after["threads"].get(tid)
        rec = log_after.get(tid, {})
        end = a["cpu_s"] if a is not None else rec.get("exit_cpu_s")
        if end is None:
            continue  # ended in between without a log entry: left in unattributed_s
        name = rec.get("name") or (main_name if tid == pid else "native")
        per[name] = per.get(name, 0.0) + max(0.0, end - (b["cpu_s"] if b is not None else 0.0))
        if a is not None:
            invol[name] = invol.get(name, 0) + a["invol_cs"] - (b["invol_cs"] if b else 0)
    total = None
    if before.get("cpu_s") is not None and after.get("cpu_s") is not None:
        total = after["cpu_s"] - before["cpu_s"]
    io_b, io_a = before.get("io", {}), after.get("io", {})
    return {
        "threads_cpu_s": dict(sorted(per.items())),
        "invol_cs": dict(sorted(invol.items())),
        "cpu_s": total,
        "unattributed_s": None if total is None else total - sum(per.values()),
        "write_bytes": io_a.get("write_bytes", 0) - io_b.get("write_bytes", 0),
        "wchar": io_a.get("wchar", 0) - io_b.get("wchar", 0),
        "read_bytes": io_a.get("read_bytes", 0) - io_b.get("read_bytes", 0),
    }

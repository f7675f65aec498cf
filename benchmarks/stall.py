"""Checkpoint stall benchmark: flashckpt against its peers, measured side by side in one run.

For each state size (a stack of Linear layers + AdamW; params + exp_avg + exp_avg_sq ~= size):

1. the lower bound: ``copy_`` of every state tensor into a pre-faulted /dev/shm mapping, and the
   first-touch cost (the same copy into a fresh, never-touched mapping);
2. flashckpt ``mode="sync"``: stall of ``save()``, first and steady;
3. flashckpt ``mode="overlap"``: stall of ``save()``, and with the wait the next
   ``optimizer.step()`` incurs (``stats.wait_s``) when it follows at once or after a fwd/bwd pass;
4. ``torch.save`` + fsync, ``safetensors.torch.save_file`` + fsync;
5. ``torch.distributed.checkpoint`` ``save`` and ``async_save`` with the staging options torch
   offers (default, cached ``DefaultStager`` sync/async staging, ``AsyncCheckpointerType.PROCESS``);
6. the loop of issue 14 (``--only loop``, its own sizes ``--loop-sizes``): training time lost per
   checkpoint in a real loop, every variant in a process of its own per round, best of
   ``--rounds``, with where the time goes: the training thread's phases and the CPU of every
   thread of the trainer and of the node agent, and the disk bytes written, from /proc;
7. the agent's persist throughput against the disk's sequential write speed;
8. hot reload from memory against reload from storage.

Run from the repository root::

    python benchmarks/stall.py --quick               # smoke run of every phase (~90 s)
    python benchmarks/stall.py --out results.json    # 0.25, 1 and 4 GiB + the loop at 0.5 GB
    python benchmarks/stall.py --only loop --loop-sizes 0.5,2 --out loop.json
    python benchmarks/stall.py --report loop.json    # markdown tables
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import random
import re
import resource
import shutil
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

import flashckpt

try:
    from benchmarks import _common as C
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import _common as C  # type: ignore[no-redef]

NODE = "n0"
Row = dict[str, Any]


def _row(
    first: float | None,
    steady: list[float],
    note: str = "",
    *,
    first_samples: list[float] | None = None,
    **extra: Any,
) -> Row:
    return {
        "first_s": first,
        "steady_s": C.median(steady),
        "samples_s": steady,
        "first_samples_s": first_samples if first_samples is not None else [first],
        "note": note,
        **extra,
    }


def _error_row(e: BaseException, note: str = "") -> Row:
    msg = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return {"first_s": None, "steady_s": None, "samples_s": [], "note": note, "error": msg}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- 1. the memcpy lower bound ----------------------------------------------------------------
def _shm_views(buf: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for t in tensors:
        nb = t.numel() * t.element_size()
        out.append(buf[off : off + nb].view(t.dtype).view(t.shape))
        off += nb
    return out


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> float:
    """Copies every tensor; device tensors asynchronously into (registered) host memory, then
    waits: the time a device->host snapshot needs."""
    cuda = any(s.is_cuda for s in src)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _map_fresh(ws: C.Workspace, nbytes: int, fallocate: bool) -> tuple[str, torch.Tensor]:
    path = ws.shm_path("memcpy")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if fallocate:
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path, torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class ShmBound:
    """A /dev/shm file mapped with ``torch.from_file(shared=True)``, pages touched, with the
    state tensors' views laid back to back: ``copy()`` is the lower bound of a snapshot."""

    def __init__(self, ws: C.Workspace, src: list[torch.Tensor], dev: Any = None) -> None:
        self.src = src
        self.nbytes = sum(t.numel() * t.element_size() for t in src)
        self.path, buf = _map_fresh(ws, self.nbytes, fallocate=False)
        self.registered = None
        if any(t.is_cuda for t in src):  # device -> host: DMA from registered (pinned) memory
            buf.fill_(0)  # registering pins the pages: touch them first, untimed
            _cuda_register(buf)
            self.registered = buf
        self.views = _shm_views(buf, src)
        # The first copy lands on never-touched pages: each fault allocates and zeroes a page.
        self.first_touch_s = _copy_all(self.views, src)
        buf.fill_(0)  # every page touched (it already is after the copy; this makes it explicit)
        del buf

    def copy(self) -> float:
        return _copy_all(self.views, self.src)

    def close(self) -> None:
        self.views = []
        if self.registered is not None:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self.registered.data_ptr())
            self.registered = None
        gc.collect()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def bench_memcpy(
    tr: C.Trainer, ws: C.Workspace, repeats: int, first_repeats: int, keep: bool
) -> tuple[Row, ShmBound | None]:
    """The bound and the first-touch costs; with ``keep`` the bound's buffer stays mapped so the
    flashckpt sync stall can be measured interleaved with it (same noise, paired samples)."""
    src = [t for _, t in tr.state_tensors()]
    first, first_falloc = [], []
    for _ in range(first_repeats - 1):
        b = ShmBound(ws, src)
        first.append(b.first_touch_s)
        b.close()
    bound = ShmBound(ws, src)
    first.append(bound.first_touch_s)
    bound.copy()
    steady = [bound.copy() for _ in range(repeats)]
    if not keep:
        bound.close()
    for _ in range(first_repeats):
        # A posix_fallocate'd file (as flashckpt's agent makes them) mapped fresh: minor faults.
        path, buf = _map_fresh(ws, bound.nbytes, fallocate=True)
        first_falloc.append(_copy_all(_shm_views(buf, src), src))
        del buf
        os.unlink(path)
    gc.collect()
    row = _row(
        C.median(first),
        steady,
        "first = copy into a fresh never-touched mapping",
        first_samples=first,
        first_touch_fallocated_s=C.median(first_falloc),
        first_touch_fallocated_samples_s=first_falloc,
        nbytes=bound.nbytes,
    )
    return row, (bound if keep else None)


# -- 2./3. flashckpt stall --------------------------------------------------------------------
def _enter_fc(ws: C.Workspace, tr: C.Trainer, job: str, **opts: Any) -> tuple[Any, float, int]:
    opts.setdefault("agent_idle_timeout", 120.0)  # an orphaned agent leaves soon
    opts.setdefault("every", 0)  # manual: each benchmark snapshots where it measures
    ck = flashckpt.checkpointing(
        tr.model, tr.optimizer, job=job, node=NODE, run_dir=ws.run_dir, **opts
    )
    t0 = time.perf_counter()
    ck.__enter__()
    enter_s = time.perf_counter() - t0
    pid = 0
    try:
        pid = int(ck.status()["agent"].get("pid") or 0)
    except Exception:
        pass
    ws.track_agent(pid, job)
    return ck, enter_s, pid


def _exit_fc(ws: C.Workspace, ck: Any, job: str, pid: int, wait_self_exit: float = 0.0) -> dict:
    """Leaves the block, stops the agent (if it did not exit by itself), checks its segments."""
    info: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        ck.__exit__(None, None, None)
    finally:
        info["exit_s"] = time.perf_counter() - t0
        if pid:
            info["agent_exited_by_itself"] = (
                ws.wait_agent_exit(pid, wait_self_exit) if wait_self_exit > 0 else None
            )
            ws.stop_agent(pid)
        info["shm_left_after_agent_stop"] = len(ws.job_shm_files(job))
        ws.remove_job_shm(job)
    return info


def bench_fc_sync(
    tr: C.Trainer, ws: C.Workspace, repeats: int, bound: ShmBound | None
) -> dict[str, Row]:
    """Stall of ``save()`` in sync mode; with ``bound``, each sample is paired with a memcpy-bound
    sample taken right before or after it (alternating), so both see the same machine noise."""
    job = ws.new_job("sync")
    ck, enter_s, pid = _enter_fc(ws, tr, job, mode="sync", restore=False)
    info: dict[str, Any] = {}
    paired: list[float] = []
    try:
        tr.step()
        ck.step()
        first = C.timed(ck.save)[0]
        load_at_first = os.getloadavg()  # the machine may be shared: say how busy it was
        steady = []
        for i in range(repeats):
            tr.step()
            ck.step()
            if bound is not None and i % 2 == 0:
                paired.append(bound.copy())
            steady.append(C.timed(ck.save)[0])
            if bound is not None and i % 2 == 1:
                paired.append(bound.copy())
        stats = ck.stats
        assert stats.saves == repeats + 1 and not stats.skips, (stats.saves, stats.skips)
    finally:
        # storage=None: does the auto-started agent (--exit-when-done) leave by itself?
        info = _exit_fc(ws, ck, job, pid, wait_self_exit=1.5)
    rows = {
        "fc_sync": _row(
            first,
            steady,
            "first save after __enter__ + 1 training step; memory only (storage=None)",
            enter_s=enter_s,
            load_avg_at_first=load_at_first,
            **info,
        )
    }
    if paired:
        rows["fc_sync"]["pair_ratio"] = C.median(
            [a / b for a, b in zip(steady, paired, strict=True) if b > 0]
        )
        rows["memcpy_paired"] = _row(
            None, paired, "memcpy bound, interleaved with the flashckpt sync samples"
        )
    return rows


def bench_fc_overlap(tr: C.Trainer, ws: C.Workspace, repeats: int) -> dict[str, Row]:
    job = ws.new_job("ovl")
    ck, enter_s, pid = _enter_fc(ws, tr, job, mode="overlap", restore=False)
    calls: list[float] = []
    imm: list[float] = []
    fb: list[float] = []
    fb_wait: list[float] = []
    try:
        tr.step()

        def save_then(step: int, between: Callable[[], None] | None) -> tuple[float, float]:
            n_wait = len(ck.stats.wait_s)
            ck.step(step)  # the training step just done (checked against the library's count)
            call = C.timed(ck.save)[0]
            if between is not None:
                between()
            tr.opt_step()  # the pre-step hook waits for the background copy
            waits = ck.stats.wait_s[n_wait:]
            return call, sum(waits)

        first_call, first_wait = save_then(1, None)
        step = 2
        for _ in range(repeats):
            tr.step()
            c, w = save_then(step, None)
            step += 1
            calls.append(c)
            imm.append(c + w)
            tr.step()
            c, w = save_then(step, tr.fwd_bwd)
            step += 1
            calls.append(c)
            fb.append(c + w)
            fb_wait.append(w)
    finally:
        info = _exit_fc(ws, ck, job, pid)
    return {
        "fc_overlap_call": _row(
            first_call, calls, "save() returns; copy unfinished (guarded by optimizer hook)"
        ),
        "fc_overlap_imm": _row(
            first_call + first_wait,
            imm,
            "save() + wait in the optimizer.step() that follows at once",
            enter_s=enter_s,
            **info,
        ),
        "fc_overlap_fb": _row(
            None,
            fb,
            "save() + wait in optimizer.step() after a fwd/bwd pass",
            wait_samples_s=fb_wait,
        ),
    }


# -- 4. torch.save / safetensors --------------------------------------------------------------
def bench_torch_save(tr: C.Trainer, ws: C.Workspace, repeats: int) -> Row:
    times = []
    for i in range(repeats + 1):
        path = ws.path("tsave", f"ckpt-{i}.pt")
        t0 = time.perf_counter()
        sd = {"model": tr.model.state_dict(), "optimizer": tr.optimizer.state_dict()}
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - t0)
        del sd
        os.unlink(path)
    return _row(times[0], times[1:], "to local disk, + fsync")


def bench_safetensors(tr: C.Trainer, ws: C.Workspace, repeats: int) -> Row:
    from safetensors.torch import save_file

    times = []
    for i in range(repeats + 1):
        path = ws.path("st", f"ckpt-{i}.safetensors")
        t0 = time.perf_counter()
        tensors = {k.replace("/", "."): v.contiguous() for k, v in tr.state_tensors()}
        save_file(tensors, path)
        C.fsync_path(path)
        times.append(time.perf_counter() - t0)
        del tensors
        os.unlink(path)
        gc.collect()
    return _row(times[0], times[1:], "model+optimizer tensors flattened, + fsync")


# -- 5. torch.distributed.checkpoint ----------------------------------------------------------
def _dcp_state(tr: C.Trainer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(tr.model, tr.optimizer)
    return {"model": msd, "optim": osd}


def bench_dcp_save(tr: C.Trainer, ws: C.Workspace, repeats: int) -> Row:
    import torch.distributed.checkpoint as dcp

    times = []
    for i in range(repeats + 1):
        d = ws.path("dcp", f"save-{i}", "x")
        d = os.path.dirname(d)
        t0 = time.perf_counter()
        dcp.save(_dcp_state(tr), checkpoint_id=d)
        times.append(time.perf_counter() - t0)
        shutil.rmtree(d, ignore_errors=True)
    return _row(times[0], times[1:], "get_state_dict + save (FileSystemWriter fsyncs)")


def _dcp_release(state_bytes: int) -> None:
    """Stops DCP's checkpoint daemon between phases when the state is big enough for its memory
    to matter (it keeps the last staged state mapped); small states keep it (spawn costs ~5 s)."""
    if state_bytes >= C.GiB // 2:
        _dcp_process_shutdown()


def _dcp_process_shutdown() -> None:
    """Stops DCP's checkpoint daemon process (AsyncCheckpointerType.PROCESS), if started."""
    try:
        import torch.distributed.checkpoint._async_process_executor as ape
    except ImportError:
        return
    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is not None:
        with contextlib.suppress(Exception):
            proc.__del__()
        ape._CHECKPOINT_PROCESS = None


def bench_dcp_async(
    tr: C.Trainer,
    ws: C.Workspace,
    repeats: int,
    name: str,
    make_stager: Callable[[], Any] | None,
    process: bool,
) -> dict[str, Row]:
    """async_save; 'call' = blocking time of the call; 'imm'/'fb' = call + the wait for the
    staging copy before the next optimizer.step() (at once / after a fwd/bwd pass)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    ptype = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
    stager = make_stager() if make_stager is not None else None
    calls: list[float] = []
    imm: list[float] = []
    fb: list[float] = []
    uploads: list[float] = []
    first_call = first_imm = None
    async_staging = False
    prev_dir = None
    try:
        schedule = ["imm"] + ["imm", "fb"] * repeats
        for i, case in enumerate(schedule):
            tr.step()
            d = os.path.dirname(ws.path("dcp", f"{name}-{i}", "x"))
            t0 = time.perf_counter()
            kw: dict[str, Any] = {"checkpoint_id": d, "async_checkpointer_type": ptype}
            if stager is not None:
                kw["async_stager"] = stager
            resp = dcp.async_save(_dcp_state(tr), **kw)
            call = time.perf_counter() - t0
            staging = getattr(resp, "staging_completion", None)
            upload = getattr(resp, "upload_completion", resp)
            wait = 0.0
            if staging is not None:
                async_staging = True
                if case == "fb":
                    tr.fwd_bwd()
                t1 = time.perf_counter()
                staging.result()
                wait = time.perf_counter() - t1
            tr.opt_step()
            upload.result()  # DCP docs: wait for the previous save before the next one
            uploads.append(time.perf_counter() - t0)
            if i == 0:
                first_call, first_imm = call, call + wait
            else:
                calls.append(call)
                (imm if case == "imm" else fb).append(call + wait)
            if prev_dir:
                shutil.rmtree(prev_dir, ignore_errors=True)
            prev_dir = d
            if not async_staging and i >= repeats:
                break  # without async staging 'fb' is the same as 'imm'
    finally:
        if stager is not None:
            with contextlib.suppress(Exception):
                stager.close()
        if prev_dir:
            shutil.rmtree(prev_dir, ignore_errors=True)
        gc.collect()
    rows = {
        f"{name}_call": _row(
            first_call,
            calls,
            "call returns; staging copy NOT guarded" if async_staging else "call (staging sync)",
            unguarded=async_staging,
            upload_s=C.median(uploads[1:]),
            first_upload_s=uploads[0] if uploads else None,
        )
    }
    if async_staging:
        rows[f"{name}_imm"] = _row(first_imm, imm, "call + staging wait before optimizer.step()")
        rows[f"{name}_fb"] = _row(None, fb, "call + staging wait after a fwd/bwd pass")
    return rows


def dcp_variants(cuda: bool = False) -> list[tuple[str, str, Callable[[], Any] | None, bool]]:
    from torch.distributed.checkpoint.staging import (
        BlockingAsyncStager,
        DefaultStager,
        StagingOptions,
    )

    if cuda:  # DCP's best GPU configuration: pinned staging buffers, async, non-blocking copies

        def pinned() -> Any:
            return DefaultStager(StagingOptions(True, False, True, True))

        return [
            (
                "dcp_async_pinned",
                "cached DefaultStager, pinned memory, async staging, non-blocking copies",
                pinned,
                False,
            )
        ]

    # On CPU-only torch: pinned memory is ignored with a warning and non-blocking copies need an
    # accelerator, so the best options are: cached staging buffers, async staging, and shared
    # memory for the PROCESS checkpointer (staged tensors cross to it without a copy).
    def cached_sync() -> Any:
        return DefaultStager(StagingOptions(False, False, False, False))

    def cached_async() -> Any:
        return DefaultStager(StagingOptions(False, False, True, False))

    def cached_async_shm() -> Any:
        return DefaultStager(StagingOptions(False, True, True, False))

    def blocking_cached() -> Any:
        return BlockingAsyncStager(cache_staged_state_dict=True)

    return [
        ("dcp_async_default", "default (uncached) staging", None, False),
        ("dcp_async_cached", "cached DefaultStager, sync staging", cached_sync, False),
        ("dcp_async_astage", "cached DefaultStager, async staging", cached_async, False),
        (
            "dcp_async_proc",
            "PROCESS, cached shm DefaultStager, async staging",
            cached_async_shm,
            True,
        ),
        ("dcp_async_blocking", "BlockingAsyncStager(cache=True)", blocking_cached, False),
    ]


# -- 6. the training loop: time lost per checkpoint, and where it goes -------------------------
# The loop of issue 14: N x Linear(2048, 2048) + Adam (10 layers ~ 0.5 GB of state), a checkpoint
# every 5 steps over 30 timed steps, torch.set_num_threads(2); each (variant, round) runs in a
# process of its own; rounds interleave the variants; the best of the rounds counts.
LOOP_VARIANTS: list[tuple[str, str]] = [
    ("baseline", "no checkpoints"),
    ("memcpy", "synchronous memcpy into touched buffers (the limit)"),
    (
        "fc_default",
        'flashckpt defaults (storage=file://; mode="auto": sync on CPU, overlap on GPU; '
        'persist_every="5m": the first snapshot to storage, the rest in memory, the exit\'s '
        "flush persists the newest)",
    ),
    ("fc_overlap", 'flashckpt mode="overlap" (a background copy thread), persist_every default'),
    ("fc_sync", 'flashckpt mode="sync" (on CPU the same copy as the defaults), persist default'),
    ("fc_persist1", "flashckpt persist_every=1 (every snapshot to storage), mode default"),
    ("fc_persist6", "flashckpt persist_every=6 (1 snapshot in 6 to storage), mode default"),
    ("fc_memory", "flashckpt memory only (storage=None), mode default"),
    ("dcp_async", "DCP async_save (cached stager, async staging, waited before optimizer.step)"),
    ("torch_save", "torch.save + fsync"),
]
# What the flashckpt variants measured in runs recorded before mode="auto" and
# persist_every="5m" became the defaults (their JSON has no "fc_config" in the runs' teardown):
# the defaults then copied on a background thread (overlap) and persisted every snapshot.
LOOP_LABELS_BEFORE_AUTO: dict[str, str] = {
    "fc_default": "flashckpt defaults then: overlap, every snapshot persisted (storage=file://)",
    "fc_sync": 'flashckpt mode="sync", every snapshot persisted',
    "fc_memory": "flashckpt overlap, memory only",
    "fc_persist6": "flashckpt overlap, persist_every=6 (1 snapshot in 6 to storage)",
}
LOOP_LABELS = dict(LOOP_VARIANTS)
LOOP_WIDTH = 2048


def loop_layers(size_gb: float, width: int = LOOP_WIDTH) -> int:
    """Layers of Linear(width, width) whose params + Adam's two moments hold ``size_gb`` GB."""
    return max(1, round(size_gb * 1e9 / 12 / (width * width + width)))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _cuda_register(buf: torch.Tensor) -> None:
    """Pins a shared mapping for DMA (as flashckpt does with its slots); raises on failure."""
    rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(getattr(rc, "value", rc)) != 0:
        raise RuntimeError(f"cudaHostRegister failed with code {rc}")


class _LoopMethod:
    """A variant of the loop: setup/teardown untimed; ``after_step`` runs in each timed step."""

    def __init__(self, tr: C.Trainer, ws: C.Workspace, spec: dict[str, Any]) -> None:
        self.tr, self.ws, self.spec = tr, ws, spec
        self.every = int(spec["every"])
        self.dev = torch.device(spec["device"])
        self.agent_pid = 0

    def setup(self) -> None: ...

    def before_opt(self) -> None: ...

    def hook_waits(self) -> list[float]:
        """Waits the library recorded inside ``optimizer.step()`` (its pre-step hook)."""
        return []

    def after_step(self, done: int, timed: bool) -> bool:
        """Called after ``optimizer.step()``; checkpoints when due; True if it did."""
        if timed and done % self.every == 0:
            self.ckpt()
            return True
        return False

    def ckpt(self) -> None: ...

    def teardown(self) -> dict[str, Any]:
        return {}


class _LoopMemcpy(_LoopMethod):
    def setup(self) -> None:
        self.bound = ShmBound(self.ws, [t for _, t in self.tr.state_tensors()], self.dev)

    def ckpt(self) -> None:
        self.bound.copy()

    def teardown(self) -> dict[str, Any]:
        self.bound.close()
        return {}


class _LoopFc(_LoopMethod):
    """flashckpt: ``every=5`` and ``ckpt.step()`` after each step (the library snapshots)."""

    def __init__(self, tr: C.Trainer, ws: C.Workspace, spec: dict[str, Any], **opts: Any):
        super().__init__(tr, ws, spec)
        self.opts = opts

    def setup(self) -> None:
        self.job = self.ws.new_job("loop")
        self.root = os.path.dirname(self.ws.path("loop-store", self.job, "x"))
        opts = dict(self.opts)
        if opts.pop("storage", True):
            opts["storage"] = f"file://{self.root}"
        self.ck, self.enter_s, self.agent_pid = _enter_fc(
            self.ws, self.tr, self.job, every=self.every, restore=False, **opts
        )
        self.n_stall = len(self.ck.stats.stall_s)

    def hook_waits(self) -> list[float]:
        return self.ck.stats.wait_s

    def after_step(self, done: int, timed: bool) -> bool:
        return self.ck.step() is not None

    def teardown(self) -> dict[str, Any]:
        s = self.ck.stats
        out: dict[str, Any] = {
            "enter_s": self.enter_s,
            "stall_s": s.stall_s[self.n_stall :],
            "first_save_s": s.first_save_s,
            "saves": s.saves,
            "skips": s.skips,
            "persist_errors": len(s.persist_errors),
            # What this variant ran with (the report labels old runs, which lack it, by what
            # the defaults were then).
            "fc_config": {
                "mode": self.ck.config.mode,
                "copy_mode": s.copy_mode,
                "persist_every": self.ck.config.persist_every,
                "storage": self.ck.config.storage is not None,
                "persist_marked": s.persist_marked,
            },
        }
        t0 = time.perf_counter()
        try:
            out["flush_committed"] = self.ck.flush() if self.opts.get("storage", True) else None
        except Exception as e:
            out["flush_error"] = f"{type(e).__name__}: {e}"[:200]
        out["flush_after_loop_s"] = time.perf_counter() - t0
        out["last_committed_step"] = s.last_committed_step
        out.update(_exit_fc(self.ws, self.ck, self.job, self.agent_pid))
        shutil.rmtree(self.root, ignore_errors=True)
        return out


class _LoopDcp(_LoopMethod):
    """``dcp.async_save`` with a cached ``DefaultStager`` and async staging (on CUDA also pinned
    memory and non-blocking copies: its best GPU configuration); the staging copy is waited for
    before ``optimizer.step()``, the previous upload before the next save."""

    def setup(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = self.dev.type == "cuda"
        self.stager: Any = DefaultStager(StagingOptions(cuda, False, True, cuda))
        self.staging: Any = None
        self.upload: Any = None
        self.dirs: list[str] = []
        self.upload_waits: list[float] = []
        self.staging_waits: list[float] = []

    def before_opt(self) -> None:
        if self.staging is not None:  # the optimizer mutates the state the stager copies
            t0 = time.perf_counter()
            self.staging.result()
            self.staging_waits.append(time.perf_counter() - t0)
            self.staging = None

    def ckpt(self) -> None:
        import torch.distributed.checkpoint as dcp

        if self.upload is not None:
            t0 = time.perf_counter()
            self.upload.result()
            self.upload_waits.append(time.perf_counter() - t0)
            while len(self.dirs) > 1:
                shutil.rmtree(self.dirs.pop(0), ignore_errors=True)
        d = os.path.dirname(self.ws.path("loop-dcp", f"c{len(self.dirs)}-{time.time_ns()}", "x"))
        self.dirs.append(d)
        resp: Any = dcp.async_save(_dcp_state(self.tr), checkpoint_id=d, async_stager=self.stager)
        self.staging = resp.staging_completion
        self.upload = resp.upload_completion

    def teardown(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "upload_wait_s": self.upload_waits,
            "staging_wait_s": self.staging_waits,
        }
        t0 = time.perf_counter()
        with contextlib.suppress(Exception):
            if self.staging is not None:
                self.staging.result()
            if self.upload is not None:
                self.upload.result()
        out["flush_after_loop_s"] = time.perf_counter() - t0
        self.stager.close()
        self.stager = self.staging = self.upload = None
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        gc.collect()
        return out


class _LoopTorchSave(_LoopMethod):
    def setup(self) -> None:
        self.path = self.ws.path("loop-tsave", "ckpt.pt")

    def ckpt(self) -> None:
        sd = {"model": self.tr.model.state_dict(), "optimizer": self.tr.optimizer.state_dict()}
        with open(self.path + ".tmp", "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.path + ".tmp", self.path)

    def teardown(self) -> dict[str, Any]:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        return {}


def _loop_method(tr: C.Trainer, ws: C.Workspace, spec: dict[str, Any]) -> _LoopMethod:
    v = spec["variant"]
    if v == "baseline":
        return _LoopMethod(tr, ws, spec)
    if v == "memcpy":
        return _LoopMemcpy(tr, ws, spec)
    if v == "fc_default":
        return _LoopFc(tr, ws, spec)
    if v == "fc_overlap":
        return _LoopFc(tr, ws, spec, mode="overlap")
    if v == "fc_sync":
        return _LoopFc(tr, ws, spec, mode="sync")
    if v == "fc_persist1":
        return _LoopFc(tr, ws, spec, persist_every=1)
    if v == "fc_memory":
        return _LoopFc(tr, ws, spec, storage=False)
    if v == "fc_persist6":
        return _LoopFc(tr, ws, spec, persist_every=6)
    if v == "dcp_async":
        return _LoopDcp(tr, ws, spec)
    if v == "torch_save":
        return _LoopTorchSave(tr, ws, spec)
    raise ValueError(f"unknown loop variant {v!r}; known: {', '.join(LOOP_LABELS)}")


def _loop_trainer(spec: dict[str, Any]) -> C.Trainer:
    dev = torch.device(spec["device"])
    torch.manual_seed(0)
    w, n = int(spec["width"]), int(spec["layers"])
    with torch.no_grad():
        model = torch.nn.Sequential(*[torch.nn.Linear(w, w) for _ in range(n)]).to(dev)
    opt = torch.optim.Adam(model.parameters())  # torch's defaults, as the loop
    tr = C.Trainer(model, opt, w, n, device=dev)
    tr.set_batch(int(spec["batch"]))
    tr.step()  # creates Adam's state
    _sync(dev)
    return tr


def _thread_names(log_dir: str, pid: int, own: bool) -> dict[int, dict[str, Any]]:
    names = C.thread_log(log_dir, pid) if log_dir else {}
    if own:  # this process: its live Python threads' names without the probe too
        import threading

        main = threading.main_thread()
        for t in threading.enumerate():
            if t is not main and t.native_id is not None and t.native_id not in names:
                names[t.native_id] = {"name": t.name}
    return names


def loop_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One (variant, round) of the loop in this process; returns its timings and counters."""
    import torch.distributed as dist

    torch.set_num_threads(int(spec["threads"]))
    dev = torch.device(spec["device"])
    steps, warmup, every = int(spec["steps"]), int(spec["warmup"]), int(spec["every"])
    log_dir = spec.get("thread_log") or ""
    out: dict[str, Any] = {"variant": spec["variant"], "round": spec.get("round")}
    out["load_start"] = os.getloadavg()
    tr = _loop_trainer(spec)
    out["state_bytes"] = tr.state_bytes()
    me = os.getpid()
    with C.terminate_as_exception(), C.Workspace() as ws:
        pg = spec["variant"] == "dcp_async"
        if pg:
            dist.init_process_group(
                "gloo", init_method=f"file://{ws.path('pg')}", rank=0, world_size=1
            )
        try:
            m = _loop_method(tr, ws, spec)
            m.setup()
            rows: list[list[float]] = []
            ckpt_cpu: list[float] = []
            snaps: dict[str, Any] = {}
            t_start = 0.0
            try:
                for i in range(warmup + steps):
                    timed = i >= warmup
                    if i == warmup:
                        pids = {"trainer": me} | ({"agent": m.agent_pid} if m.agent_pid else {})
                        snaps = {
                            k: (C.proc_snapshot(p), _thread_names(log_dir, p, p == me))
                            for k, p in pids.items()
                        }
                        t_start = time.perf_counter()
                    t0 = time.perf_counter()
                    tr.fwd_bwd()
                    _sync(dev)
                    t1 = time.perf_counter()
                    m.before_opt()
                    t2 = time.perf_counter()
                    nw = len(m.hook_waits())
                    f2 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                    tr.opt_step()
                    _sync(dev)
                    t3 = time.perf_counter()
                    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f2
                    hook_wait = sum(m.hook_waits()[nw:])
                    c3 = time.thread_time()
                    did = m.after_step(i + 1, timed)
                    _sync(dev)
                    t4 = time.perf_counter()
                    if timed:
                        rows.append(
                            [t1 - t0, t2 - t1, t3 - t2, hook_wait, t4 - t3, float(did), faults]
                        )
                        if did:  # the training thread's own CPU in the checkpoint call
                            ckpt_cpu.append(time.thread_time() - c3)
                loop_s = time.perf_counter() - t_start
                cpu: dict[str, Any] = {}
                for k, (before, names0) in snaps.items():
                    p = before["pid"]
                    after = C.proc_snapshot(p)
                    names1 = _thread_names(log_dir, p, p == me)
                    main = "training" if k == "trainer" else "agent-main"
                    cpu[k] = C.thread_cpu_delta(before, after, names0, names1, main)
                out["cpu"] = cpu
            finally:
                out["teardown"] = m.teardown()
        finally:
            if pg:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
    cols = ("fwd_bwd_s", "pre_opt_wait_s", "opt_step_s", "hook_wait_s", "after_step_s")
    out.update(
        loop_s=loop_s,
        steps=steps,
        every=every,
        ckpts=int(sum(r[5] for r in rows)),
        phases={c: sum(r[j] for r in rows) for j, c in enumerate(cols)},
        ckpt_call_s=[r[4] for r in rows if r[5]],
        ckpt_call_cpu_s=ckpt_cpu,
        per_step=[[round(x, 6) for x in r] for r in rows],
        per_step_columns=[*cols, "checkpointed", "opt_step_minor_faults"],
        opt_step_minor_faults=sum(int(r[6]) for r in rows),
        malloc_tunables=os.environ.get("GLIBC_TUNABLES", ""),
        load_end=os.getloadavg(),
    )
    return out


def _loop_group(name: str) -> str:
    """Which column of the report a thread's CPU goes to."""
    if name.startswith("flashckpt-copy"):
        return "copy"
    if name.startswith("flashckpt-prefault"):
        return "prefault"
    if name == "flashckpt-agent-hash":
        return "hash"
    if name == "flashckpt-agent-persist":
        return "persist"
    if name.startswith("fc-direct-write"):
        return "write"
    return name


# glibc's heap trimming makes torch's default (single-tensor) Adam on CPU bimodal: each step
# allocates two temporaries per parameter (16 MiB for a 2048 x 2048 weight) and frees them; when
# they sit at the top of the heap, free() hands them back to the kernel (the trim threshold is
# twice the dynamic mmap threshold, which those very temporaries set) and the next step
# page-faults them in again: 81,632 minor faults per step here and an optimizer step twice as
# long (0.22 vs 0.11 s at 0.5 GB). Whether a process lands there depends on where earlier
# allocations left the heap's top, so it changes from run to run for every variant, with or
# without checkpoints (a plain loop with no checkpoints was seen in both regimes). Pinning the
# thresholds (no trimming below 256 MiB, allocations up to 32 MiB from the heap) takes that
# noise out of the comparison; `--malloc system` measures with glibc's defaults.
PINNED_MALLOC = "glibc.malloc.trim_threshold=268435456:glibc.malloc.mmap_threshold=33554432"


def _loop_spawn(
    spec: dict[str, Any], timeout: float, log_root: str
) -> tuple[dict[str, Any] | None, str]:
    """Runs one (variant, round) in a fresh process with the thread-name probe; returns its
    result (None on failure) and a note."""
    import subprocess

    tag = f"{spec['variant']}-r{spec['round']}"
    log_dir = os.path.join(log_root, tag)
    os.makedirs(log_dir, exist_ok=True)
    spec = dict(spec, thread_log=log_dir)
    part = os.path.join(log_root, f"{tag}.json")
    env = dict(os.environ, FCBENCH_THREAD_LOG=log_dir)
    if spec.get("malloc") == "pinned":
        env["GLIBC_TUNABLES"] = ":".join(
            filter(None, [os.environ.get("GLIBC_TUNABLES"), PINNED_MALLOC])
        )
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(
        [C.PROBE_DIR, os.path.dirname(here), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    cmd = [sys.executable, os.path.abspath(__file__), "--loop-child", json.dumps(spec)]
    cmd += ["--out", part]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: its workspace cleanup (agent, /dev/shm) runs
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        return None, f"timed out after {timeout:.0f} s"
    except BaseException:
        proc.terminate()
        proc.wait(120)
        raise
    if rc != 0 or not os.path.exists(part):
        return None, f"exit code {rc}"
    with open(part) as f:
        return json.load(f), ""


def bench_loop(args: argparse.Namespace, size_gb: float) -> dict[str, Any]:
    """Every variant x ``--rounds`` (interleaved, one process each) at one state size."""
    import tempfile

    layers = loop_layers(size_gb)
    variants = [v for v, _ in LOOP_VARIANTS if not args.variants or v in args.variants]
    if "baseline" not in variants:
        variants.insert(0, "baseline")
    spec = {
        "layers": layers,
        "width": LOOP_WIDTH,
        "batch": args.loop_batch,
        "threads": args.threads,
        "steps": args.steps,
        "every": args.every,
        "warmup": args.warmup,
        "device": args.device,
        "malloc": args.malloc,
    }
    S = layers * (LOOP_WIDTH * LOOP_WIDTH + LOOP_WIDTH) * 4 * 3
    res: dict[str, Any] = {
        "size_gb": size_gb,
        "state_bytes": S,
        **spec,
        "rounds": args.rounds,
        "load_start": os.getloadavg(),
        "runs": [],
        "errors": [],
    }
    need = {
        "fc_default": 3.3,
        "fc_overlap": 3.3,
        "fc_sync": 3.3,
        "fc_persist1": 3.3,
        "fc_memory": 3.3,
        "fc_persist6": 3.3,
        "dcp_async": 2.3,
    }
    with tempfile.TemporaryDirectory(prefix="fcb-loop-") as log_root:
        for r in range(args.rounds):
            # A new order each round (seeded: reproducible), so no variant always follows the
            # same one (a rotation would keep each one's neighbour, and its after-effects).
            order = list(variants)
            random.Random(r).shuffle(order)
            for v in order:
                want = need.get(v, 1.5) * S + 1.0 * C.GiB
                if C.available_bytes() < want:
                    msg = f"{v} round {r + 1}: skipped, needs ~{want / C.GiB:.1f} GiB RAM"
                    log("  " + msg)
                    res["errors"].append(msg)
                    continue
                log(f"  loop {size_gb:g} GB: {v}, round {r + 1}/{args.rounds}")
                got, why = _loop_spawn(
                    dict(spec, variant=v, round=r + 1), args.loop_timeout, log_root
                )
                if got is None:
                    res["errors"].append(f"{v} round {r + 1}: {why}")
                    log(f"  {v} round {r + 1}: {why}")
                    continue
                res["runs"].append(got)
                log(
                    f"    loop {got['loop_s']:.2f} s, {got['ckpts']} checkpoints, load "
                    f"{got['load_start'][0]:.1f} -> {got['load_end'][0]:.1f}"
                )
    res["load_end"] = os.getloadavg()
    res["summary"] = summarize_loop(res)
    return res


def summarize_loop(res: dict[str, Any]) -> dict[str, Any]:
    """Time lost per checkpoint (best of the rounds, as issue 14 defines it, and of the
    medians), the noise floor, and per variant the medians over its rounds of where it went."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in res["runs"]:
        by.setdefault(r["variant"], []).append(r)
    base = by.get("baseline", [])
    if not base:
        return {"error": "no baseline run"}
    b_loop = [r["loop_s"] for r in base]
    b_best, b_med = min(b_loop), C.median(b_loop) or 0.0

    def med(rs: list[dict[str, Any]], f: Callable[[dict[str, Any]], float]) -> float:
        return C.median([f(r) for r in rs]) or 0.0

    b_fb = med(base, lambda r: r["phases"]["fwd_bwd_s"])
    b_opt = med(base, lambda r: r["phases"]["opt_step_s"])
    b_train_cpu = med(base, lambda r: r["cpu"]["trainer"]["threads_cpu_s"].get("training", 0.0))
    b_invol = med(base, lambda r: r["cpu"]["trainer"]["invol_cs"].get("training", 0))
    ckpts = max((r["ckpts"] for rs in by.values() for r in rs), default=0) or 1
    out: dict[str, Any] = {
        "baseline_loop_s": b_loop,
        "baseline_best_s": b_best,
        "noise_floor_s": max(b_loop) - min(b_loop),
        "noise_floor_per_ckpt_s": (max(b_loop) - min(b_loop)) / ckpts,
        "ckpts": ckpts,
        "variants": {},
    }
    for v, _label in LOOP_VARIANTS:
        rs = by.get(v)
        if v == "baseline" or not rs:
            continue
        n = max(1, rs[0]["ckpts"])

        def per(
            f: Callable[[dict[str, Any]], float], rs: list[dict[str, Any]] = rs, n: int = n
        ) -> float:
            return med(rs, f) / n

        def grp(r: dict[str, Any], who: str, g: str) -> float:
            cpu = r["cpu"].get(who)
            if not cpu:
                return 0.0
            return sum(s for k, s in cpu["threads_cpu_s"].items() if _loop_group(k) == g)

        def bg(r: dict[str, Any]) -> float:  # trainer threads besides training + intra-op
            t = r["cpu"]["trainer"]["threads_cpu_s"]
            return sum(s for k, s in t.items() if k not in ("training", "native"))

        def agent_other(r: dict[str, Any]) -> float:
            cpu = r["cpu"].get("agent")
            if not cpu:
                return 0.0
            main = ("hash", "persist", "write")
            rest = [s for k, s in cpu["threads_cpu_s"].items() if _loop_group(k) not in main]
            return sum(rest) + max(0.0, cpu.get("unattributed_s") or 0.0)

        def agent_total(r: dict[str, Any]) -> float:
            cpu = r["cpu"].get("agent")
            return (cpu.get("cpu_s") or 0.0) if cpu else 0.0

        loops = [r["loop_s"] for r in rs]
        out["variants"][v] = {
            "loop_s": loops,
            "lost_per_ckpt_s": (min(loops) - b_best) / n,
            "lost_per_ckpt_median_s": ((C.median(loops) or 0.0) - b_med) / n,
            "save_call_s": per(lambda r: sum(r["ckpt_call_s"])),
            "save_call_max_s": med(rs, lambda r: max(r["ckpt_call_s"], default=0.0)),
            "save_call_cpu_s": (
                per(lambda r: sum(r["ckpt_call_cpu_s"]))
                if all("ckpt_call_cpu_s" in r for r in rs)
                else None  # runs from before the benchmark recorded it
            ),
            "wait_s": per(lambda r: r["phases"]["hook_wait_s"] + r["phases"]["pre_opt_wait_s"]),
            "d_fwd_bwd_s": per(lambda r: r["phases"]["fwd_bwd_s"] - b_fb),
            "d_opt_step_s": per(
                lambda r: r["phases"]["opt_step_s"] - r["phases"]["hook_wait_s"] - b_opt
            ),
            "d_training_thread_cpu_s": per(
                lambda r: r["cpu"]["trainer"]["threads_cpu_s"].get("training", 0.0) - b_train_cpu
            ),
            "copy_cpu_s": per(lambda r: grp(r, "trainer", "copy")),
            "prefault_cpu_s": per(lambda r: grp(r, "trainer", "prefault")),
            "trainer_bg_cpu_s": per(bg),
            "agent_hash_cpu_s": per(lambda r: grp(r, "agent", "hash")),
            "agent_persist_cpu_s": per(lambda r: grp(r, "agent", "persist")),
            "agent_write_cpu_s": per(lambda r: grp(r, "agent", "write")),
            "agent_other_cpu_s": per(agent_other),
            "agent_cpu_s": per(agent_total),
            "opt_step_faults_per_step": (
                [r["opt_step_minor_faults"] / max(1, r["steps"]) for r in rs]
                if all("opt_step_minor_faults" in r for r in rs)
                else None  # runs from before the benchmark counted them
            ),
            "written_bytes": per(lambda r: sum(c.get("write_bytes", 0) for c in r["cpu"].values())),
            "training_invol_cs": med(
                rs, lambda r: r["cpu"]["trainer"]["invol_cs"].get("training", 0)
            ),
            "baseline_training_invol_cs": b_invol,
        }
    vs = out["variants"]

    def lost(v: str) -> float | None:
        return vs.get(v, {}).get("lost_per_ckpt_s")

    lim, fc, dcp_l, ts = lost("memcpy"), lost("fc_default"), lost("dcp_async"), lost("torch_save")
    t: dict[str, Any] = {}
    if lim is not None and fc is not None:
        bound = max(1.5 * lim, lim + 0.05)
        t["defaults_vs_limit"] = {
            "value": [fc, bound],
            "target": "<= max(1.5 x limit, limit + 50 ms)",
            "met": fc <= bound,
        }
    if fc is not None and dcp_l is not None:
        t["defaults_vs_dcp"] = {"value": [fc, dcp_l], "target": "< DCP", "met": fc < dcp_l}
    if fc is not None and ts is not None:
        t["defaults_vs_torch_save"] = {
            "value": [fc, ts / 2],
            "target": "< torch.save / 2",
            "met": fc < ts / 2,
        }
    for v in t.values():  # a difference inside the noise floor ranks nothing
        a, b = v["value"]
        v["within_noise"] = abs(a - b) < out["noise_floor_per_ckpt_s"]
        if len(b_loop) < 2:  # one run without checkpoints: no noise floor, so no verdict
            v["met"] = v["within_noise"] = None
    out["targets"] = t
    return out


def loop_labels(res: dict[str, Any]) -> dict[str, str]:
    """The row labels of one size of the loop phase: what each variant measured. A run recorded
    before the flashckpt variants wrote their ``fc_config`` ran under the defaults of then
    (overlap, every snapshot persisted): its rows say so."""
    fc_runs = [r for r in res.get("runs") or [] if str(r.get("variant", "")).startswith("fc_")]
    if fc_runs and not any("fc_config" in (r.get("teardown") or {}) for r in fc_runs):
        return {**LOOP_LABELS, **LOOP_LABELS_BEFORE_AUTO}
    return dict(LOOP_LABELS)


def loop_markdown(res: dict[str, Any]) -> list[str]:
    """Markdown tables of one size of the loop phase."""
    labels = loop_labels(res)
    s = summarize_loop(res) if res.get("runs") else (res.get("summary") or {})
    if "variants" not in s:
        return [f"Loop {res.get('size_gb')} GB: {s.get('error', 'no result')}"]
    ms = 1000.0

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x * ms:.0f}"

    lines = [
        f"**Loop, {res['state_bytes'] / 1e9:.2f} GB** ({res['layers']} x Linear({res['width']}, "
        f"{res['width']}) + Adam, batch {res['batch']}, {res['steps']} steps, checkpoint every "
        f"{res['every']} = {s['ckpts']} checkpoints, {res['threads']} torch threads, "
        f"{res['device']}; best of {res['rounds']} runs, interleaved, one process each; load "
        f"average {res['load_start'][0]:.1f} at start, {res['load_end'][0]:.1f} at end). "
        f"Baseline loop {min(s['baseline_loop_s']):.2f} s (runs: "
        + ", ".join(f"{x:.2f}" for x in s["baseline_loop_s"])
        + f"); **noise floor** {s['noise_floor_s']:.2f} s = {f(s['noise_floor_per_ckpt_s'])} ms "
        "per checkpoint.",
        "",
        "| variant | lost per checkpoint (ms), best of runs | median of runs | loop (s), runs "
        "| opt.step minor faults per step, runs |",
        "|---|---:|---:|---|---|",
    ]
    for v, _ in LOOP_VARIANTS:
        r = s["variants"].get(v)
        if r is None:
            continue
        label = labels[v]
        faults = r.get("opt_step_faults_per_step")
        lines.append(
            f"| {label} | {f(r['lost_per_ckpt_s'])} | {f(r['lost_per_ckpt_median_s'])} | "
            + ", ".join(f"{x:.2f}" for x in r["loop_s"])
            + " | "
            + (", ".join(f"{x:.0f}" for x in faults) if faults is not None else "-")
            + " |"
        )
    lines += [
        "",
        "Where it goes, ms per checkpoint (medians over the runs; the training thread's phases "
        "against the baseline's; CPU of threads over the loop):",
        "",
        "| variant | save() / ckpt call | its CPU | waits before/in opt.step | Δ fwd+bwd "
        "| Δ opt.step compute | Δ training-thread CPU | copy thread CPU | prefault CPU "
        "| other trainer threads CPU | agent: hash | agent: persist (hash+write) "
        "| agent: write thread | agent: other | MB written "
        "| training thread invol. cs (baseline) |",
        "|---|" + "---:|" * 15,
    ]
    for v, _ in LOOP_VARIANTS:
        r = s["variants"].get(v)
        if r is None:
            continue
        label = labels[v]
        other_bg = r["trainer_bg_cpu_s"] - r["copy_cpu_s"] - r["prefault_cpu_s"]
        lines.append(
            f"| {label} | {f(r['save_call_s'])} | {f(r.get('save_call_cpu_s'))} | "
            f"{f(r['wait_s'])} | {f(r['d_fwd_bwd_s'])} | "
            f"{f(r['d_opt_step_s'])} | {f(r['d_training_thread_cpu_s'])} | {f(r['copy_cpu_s'])} | "
            f"{f(r['prefault_cpu_s'])} | {f(other_bg)} | {f(r['agent_hash_cpu_s'])} | "
            f"{f(r['agent_persist_cpu_s'])} | {f(r['agent_write_cpu_s'])} | "
            f"{f(r['agent_other_cpu_s'])} | {r['written_bytes'] / 1e6:.0f} | "
            f"{r['training_invol_cs']:.0f} ({r['baseline_training_invol_cs']:.0f}) |"
        )
    for k, t in s.get("targets", {}).items():
        a, b = t["value"]
        lines.append(
            f"\nTarget {k}: {f(a)} ms vs {f(b)} ms ({t['target']}): "
            + (
                "no verdict (one run without checkpoints: no noise floor)"
                if t["met"] is None
                else ("met" if t["met"] else "**missed**")
            )
            + (" (the difference is within the noise floor)" if t.get("within_noise") else "")
        )
    for e in res.get("errors", []):
        lines.append(f"\nNot measured: {e}")
    return lines


# -- 7./8. persist throughput and hot reload ----------------------------------------------------
_PERSIST_RE = re.compile(r"persisted step (\d+): ([\d.]+) MiB in ([\d.]+) s")


def bench_persist_reload(
    tr: C.Trainer, ws: C.Workspace, repeats: int, reload_repeats: int, skipped: list[str]
) -> dict[str, Any]:
    """7. save + ``flush()`` (agent commit) alternating with a dd-like write of as many bytes;
    8. hot reload from the agent's memory alternating with reload from storage (agent stopped,
    slots removed, a fresh agent started untimed), storage cold and page-cached in turn."""
    job = ws.new_job("pr")
    root = os.path.dirname(ws.path("store", job, "x"))
    url = f"file://{root}"
    pid = ws.start_agent(job, NODE, url)
    opts: dict[str, Any] = {"storage": url, "agent": "connect", "mode": "sync", "keep": 2}
    flush_s: list[float] = []
    dd_s: list[float] = []
    dd_direct_s: list[float] = []
    shard_bytes = 0
    nbytes = tr.state_bytes()
    step = 0
    ck, _, _ = _enter_fc(ws, tr, job, restore=False, **opts)
    try:
        tr.step()
        dd_s.append(C.disk_write_speed(root, nbytes))
        dd_direct_s.append(C.disk_write_speed(root, nbytes, direct=True))
        for _ in range(repeats):
            tr.step()
            step += 1
            ck.step(step)
            ck.save()
            t0 = time.perf_counter()
            committed = ck.flush()
            flush_s.append(time.perf_counter() - t0)
            assert committed == step, f"flush returned {committed}, expected {step}"
            dd_s.append(C.disk_write_speed(root, nbytes))
            dd_direct_s.append(C.disk_write_speed(root, nbytes, direct=True))
        shard_dir = os.path.join(root, f"step-{step:09d}")
        shard_bytes = sum(
            os.path.getsize(os.path.join(shard_dir, f))
            for f in os.listdir(shard_dir)
            if f.endswith(".safetensors")
        )
    finally:
        ck.__exit__(None, None, None)
    logged = []
    with contextlib.suppress(OSError), open(ws.log_path(job, NODE)) as f:
        for line in f:
            m = _PERSIST_RE.search(line)
            if m:
                logged.append((int(m.group(1)), float(m.group(2)), float(m.group(3))))
    agent_s = [s for _, _, s in logged]
    mib = shard_bytes / C.MiB
    pair = [
        (shard_bytes / fl) / (nbytes / ((dd_s[i] + dd_s[i + 1]) / 2))
        for i, fl in enumerate(flush_s)
    ]
    out: dict[str, Any] = {}
    out["persist"] = {
        "shard_bytes": shard_bytes,
        "flush_s": flush_s,
        "flush_median_s": C.median(flush_s),
        "flush_mib_s": mib / (C.median(flush_s) or 1e-9),
        "agent_log_s": agent_s,
        "agent_mib_s": mib / C.median(agent_s) if agent_s else None,
        "dd_s": dd_s,
        "dd_mib_s": (nbytes / C.MiB) / (C.median(dd_s) or 1e-9),
        "dd_direct_s": dd_direct_s,
        "dd_direct_mib_s": (nbytes / C.MiB) / (C.median(dd_direct_s) or 1e-9),
        "pair_ratio": C.median(pair),
        "pair_ratios": pair,
    }
    log(
        f"  persist: flush {C.fmt_s(C.median(flush_s))} s, agent {C.fmt_s(C.median(agent_s))} s, "
        f"dd {C.fmt_s(C.median(dd_s))} s for {mib:.0f} MiB"
    )

    # 8. hot reload. The agent holds both slots; the newest (step `step`) is committed too.
    mem: list[float] = []
    cold: list[float] = []
    warm: list[float] = []
    S = tr.state_bytes()
    for i in range(2 * reload_repeats):
        # A restore from memory clones the optimizer state; one from storage reads the file.
        tr.optimizer.zero_grad(set_to_none=True)
        if not _mem_ok(f"reload round {i + 1}", 1.2 * S + 1.5 * C.GiB, skipped):
            break
        ck, enter_s, _ = _enter_fc(ws, tr, job, restore=True, **opts)
        src = ck.restored_from
        ck.__exit__(None, None, None)
        assert src == "memory", f"restored_from={src!r}, expected 'memory'"
        mem.append(enter_s)
        # Storage: stop the agent (it removes its slots), start a fresh one (untimed).
        ws.stop_agent(pid)
        left = ws.job_shm_files(job)
        assert not left, f"agent left its slots behind: {left}"
        cache = "cold" if i % 2 == 0 else "warm"
        if cache == "cold":
            C.drop_file_cache(root)
        pid = ws.start_agent(job, NODE, url)
        ck, enter_s, _ = _enter_fc(ws, tr, job, restore=True, **opts)
        try:
            src = ck.restored_from
            assert src == "storage", f"restored_from={src!r}, expected 'storage'"
            (cold if cache == "cold" else warm).append(enter_s)
            tr.step()  # a new snapshot in the fresh agent's memory for the next memory reload
            tr.optimizer.zero_grad(set_to_none=True)
            step += 1
            ck.step(step)
            ck.save()
            ck.flush()
        finally:
            ck.__exit__(None, None, None)
    ws.stop_agent(pid)
    ws.remove_job_shm(job)
    shutil.rmtree(root, ignore_errors=True)
    out["reload"] = {
        "memory_s": mem,
        "memory_median_s": C.median(mem),
        "storage_cold_s": cold,
        "storage_cold_median_s": C.median(cold),
        "storage_warm_s": warm,
        "storage_warm_median_s": C.median(warm),
        "note": "time of `with checkpointing(...)` entry (connect, find, read, load_state_dict); "
        "cold = page cache of the step files dropped with POSIX_FADV_DONTNEED first",
    }
    log(
        f"  reload: memory {C.fmt_s(C.median(mem))} s, storage cold {C.fmt_s(C.median(cold))} s,"
        f" warm {C.fmt_s(C.median(warm))} s"
    )
    return out


# -- driver -----------------------------------------------------------------------------------
ROW_ORDER: list[tuple[str, str]] = [
    ("memcpy", "memcpy -> pre-faulted /dev/shm (the bound)"),
    ("memcpy_paired", "  same, interleaved with flashckpt sync"),
    ("fc_sync", "flashckpt sync: save()"),
    ("fc_overlap_call", "flashckpt overlap: save() returns"),
    ("fc_overlap_imm", "flashckpt overlap: + wait, opt.step at once"),
    ("fc_overlap_fb", "flashckpt overlap: + wait after fwd/bwd"),
    ("torch_save", "torch.save + fsync"),
    ("safetensors", "safetensors save_file + fsync"),
    ("dcp_save", "DCP save (sync)"),
    ("dcp_async_default_call", "DCP async_save, default stager"),
    ("dcp_async_cached_call", "DCP async_save, cached stager, sync stage"),
    ("dcp_async_astage_call", "DCP async_save, async stage: call"),
    ("dcp_async_astage_imm", "DCP async_save, async stage: + wait"),
    ("dcp_async_astage_fb", "DCP async_save, async stage: wait aft f/b"),
    ("dcp_async_proc_call", "DCP async_save PROCESS, async stage: call"),
    ("dcp_async_proc_imm", "DCP async_save PROCESS: + wait"),
    ("dcp_async_proc_fb", "DCP async_save PROCESS: wait after f/b"),
    ("dcp_async_blocking_call", "DCP async_save, BlockingAsyncStager"),
    ("dcp_async_pinned_call", "DCP async_save, pinned async stage: call"),
    ("dcp_async_pinned_imm", "DCP async_save, pinned: + wait"),
    ("dcp_async_pinned_fb", "DCP async_save, pinned: wait after f/b"),
]


def _mem_ok(what: str, need: float, skipped: list[str]) -> bool:
    """True if ``need`` bytes of RAM are available now; else logs and records a skip."""
    avail = C.available_bytes()
    if avail >= need:
        return True
    msg = f"{what}: skipped, needs ~{need / C.GiB:.1f} GiB RAM, {avail / C.GiB:.1f} GiB available"
    log("  " + msg)
    skipped.append(msg)
    return False


def bench_size(
    size: float,
    args: argparse.Namespace,
    ws: C.Workspace,
    res: dict[str, Any],
    save: Callable[[], None],
) -> dict[str, Any]:
    """Runs every phase for one size into ``res`` (calling ``save`` after each phase, so a crash
    keeps what was measured). Phases that do not fit in the RAM available now are skipped."""
    res.update({"size_gib": size, "rows": {}, "skipped_phases": []})
    only = set(args.only.split(",")) if args.only else None
    skipped: list[str] = res["skipped_phases"]

    def want(phase: str) -> bool:
        return only is None or phase in only

    log(f"== {size:g} GiB: building the model")
    tr = C.Trainer.build(size, device=args.device)
    cal = tr.calibrate(args.fwd_bwd)
    n_tensors = len(tr.state_tensors())
    S = tr.state_bytes()
    res.update(state_bytes=S, tensors=n_tensors, layers=tr.layers, width=tr.width, **cal)
    log(
        f"   {tr.layers} x Linear({tr.width}, {tr.width}) + AdamW: "
        f"{S / C.GiB:.3f} GiB in {n_tensors} tensors; batch {cal['batch']}: "
        f"fwd+bwd {cal['fwd_bwd_s']:.3f} s, optimizer step {cal['opt_step_s']:.3f} s"
    )
    rows = res["rows"]
    reps = args.repeats
    disk_reps = max(2, min(reps, 3)) if size >= 1 else reps
    first_reps = 3 if size <= 1 else 2
    margin = 1.5 * C.GiB

    def run(key: str, fn: Callable[[], Any]) -> None:
        log(f"  {key}")
        try:
            out = fn()
        except Exception as e:
            traceback.print_exc()
            out = _error_row(e)
        if isinstance(out, dict) and "steady_s" not in out:
            rows.update(out)
        else:
            rows[key] = out
        gc.collect()
        save()

    bound: ShmBound | None = None
    if want("memcpy") and _mem_ok("memcpy", 1.1 * S + margin, skipped):
        # Keep the bound's buffer for paired samples if memory allows (buffer + 2 slots).
        keep = want("fc") and C.available_bytes() > S * 3.4 + 2 * C.GiB
        log("  memcpy" + (" (kept for paired samples)" if keep else ""))
        try:
            rows["memcpy"], bound = bench_memcpy(tr, ws, reps, first_reps, keep)
        except Exception as e:
            traceback.print_exc()
            rows["memcpy"] = _error_row(e)
    if want("fc"):
        try:
            if bound is not None or _mem_ok("fc_sync", 2.2 * S + margin, skipped):
                run("fc_sync", lambda: bench_fc_sync(tr, ws, reps, bound))
        finally:
            if bound is not None:
                bound.close()
                bound = None
        if _mem_ok("fc_overlap", 2.2 * S + margin, skipped):
            run("fc_overlap", lambda: bench_fc_overlap(tr, ws, reps))
    cuda = args.device == "cuda"  # on a GPU: only the peers issue 14 compares with, to fit
    res["device"] = args.device
    if want("files") and _mem_ok("files", 1.1 * S + margin, skipped):
        run("torch_save", lambda: bench_torch_save(tr, ws, disk_reps))
        if not cuda:
            run("safetensors", lambda: bench_safetensors(tr, ws, disk_reps))
    if want("dcp"):
        if not cuda and _mem_ok("dcp_save", 0.2 * S + margin, skipped):
            run("dcp_save", lambda: bench_dcp_save(tr, ws, disk_reps))
        for key, _label, make, process in dcp_variants(cuda):
            r = disk_reps if make is None or key == "dcp_async_cached" else max(2, disk_reps - 1)
            if not _mem_ok(key, (2.1 if process else 1.1) * S + margin, skipped):
                continue

            def one(key: str = key, make: Any = make, process: bool = process, r: int = r) -> Any:
                return bench_dcp_async(tr, ws, r, key, make, process)

            run(key, one)
            if key in rows:  # an error row under the bare key
                rows[f"{key}_call"] = rows.pop(key)
        # DCP's checkpoint daemon keeps the last staged state mapped (state-size of shared
        # memory) until its next request: stop it so later phases have the memory.
        _dcp_release(S)
    if want("persist"):
        tr.optimizer.zero_grad(set_to_none=True)  # the gradients are not needed to reload
        if _mem_ok("persist+reload", 3.4 * S + margin, skipped):
            log("  persist + reload")
            try:
                n = max(2, min(reps, 3))
                res.update(bench_persist_reload(tr, ws, n, 1 if args.quick else n, skipped))
            except Exception as e:
                traceback.print_exc()
                res["persist_error"] = f"{type(e).__name__}: {e}"[:300]
        save()
    gc.collect()
    res["targets"] = evaluate(res)
    save()
    return res


def evaluate(res: dict[str, Any]) -> dict[str, Any]:
    rows = res["rows"]
    t: dict[str, Any] = {}

    def steady(k: str) -> float | None:
        return rows.get(k, {}).get("steady_s")

    def first(k: str) -> float | None:
        return rows.get(k, {}).get("first_s")

    r = rows.get("fc_sync", {}).get("pair_ratio")
    if r is None:
        r = C.ratio(steady("fc_sync"), steady("memcpy"))
    ok = r is not None and r <= 1.15
    t["sync_stall_vs_memcpy"] = {
        "value": r,
        "unpaired_value": C.ratio(steady("fc_sync"), steady("memcpy")),
        "target": "<= 1.15",
        "met": ok,
    }
    r = C.ratio(first("fc_sync"), steady("fc_sync"))
    t["first_vs_steady"] = {"value": r, "target": "<= 1.5", "met": r is not None and r <= 1.5}
    r2 = C.ratio(first("fc_overlap_imm"), steady("fc_overlap_imm"))
    t["first_vs_steady"]["overlap_value"] = r2
    p = res.get("persist", {})
    r = p.get("pair_ratio")
    t["persist_vs_disk"] = {
        "value": r,
        "unpaired_value": C.ratio(p.get("flush_mib_s"), p.get("dd_mib_s")),
        "vs_o_direct_value": C.ratio(p.get("flush_mib_s"), p.get("dd_direct_mib_s")),
        "agent_log_value": C.ratio(p.get("agent_mib_s"), p.get("dd_mib_s")),
        "target": ">= 0.70",
        "met": r is not None and r >= 0.7,
    }
    rl = res.get("reload", {})
    r = C.ratio(rl.get("storage_cold_median_s"), rl.get("memory_median_s"))
    t["reload_memory_vs_storage"] = {
        "value": r,
        "warm_value": C.ratio(rl.get("storage_warm_median_s"), rl.get("memory_median_s")),
        "target": ">= 5x faster",
        "met": r is not None and r >= 5,
    }
    if res.get("device") == "cuda":  # issue 14's GPU targets
        call = rows.get("fc_overlap_call", {})
        worst = max(
            [x for x in [call.get("first_s"), *call.get("samples_s", [])] if x], default=None
        )
        t["gpu_save_returns_5ms"] = {
            "value": worst,
            "target": "<= 0.005 s (every sample)",
            "met": worst is not None and worst <= 0.005,
        }
        r = C.ratio(steady("memcpy"), steady("fc_sync"))
        t["gpu_d2h_vs_registered"] = {
            "value": r,
            "target": ">= 0.80 of the registered-memory copy",
            "met": r is not None and r >= 0.8,
        }
        r = C.ratio(first("fc_sync"), steady("fc_sync"))
        t["gpu_first_vs_steady"] = {
            "value": r,
            "target": "<= 1.2",
            "met": r is not None and r <= 1.2,
        }
        w = rows.get("fc_overlap_fb", {}).get("wait_samples_s") or None
        wmax = max(w) if w else None
        t["gpu_no_wait_after_fwd_bwd"] = {
            "value": wmax,
            "target": "<= 0.001 s wait in optimizer.step()",
            "met": wmax is not None and wmax <= 0.001,
        }
    for v in t.values():
        val = v["value"]
        if val is None or (isinstance(val, list) and None in val):
            v["met"] = None
    return t


def print_size(res: dict[str, Any]) -> None:
    rows = res["rows"]
    print()
    print(
        f"=== state {res['state_bytes'] / C.GiB:.2f} GiB: {res['layers']} x Linear({res['width']},"
        f" {res['width']}) + AdamW, {res['tensors']} tensors; batch {res['batch']}: fwd+bwd "
        f"{res['fwd_bwd_s']:.3f} s + optimizer step {res['opt_step_s']:.3f} s ==="
    )
    bound = rows.get("memcpy_paired", rows.get("memcpy", {})).get("steady_s")
    ref = rows.get("fc_sync", {}).get("steady_s")
    print(
        f"{'stall per checkpoint (s)':<44}{'first':>8}{'steady':>8}{'/memcpy':>9}{'/fc-sync':>9}"
        "  notes"
    )
    for key, label in ROW_ORDER:
        r = rows.get(key)
        if r is None:
            continue
        if r.get("error"):
            print(f"{label:<44}{'error':>8}{'':>8}{'':>9}{'':>9}  {r['error'][:70]}")
            continue
        s = r.get("steady_s")
        note = r.get("note", "")
        if key == "memcpy" and r.get("first_touch_fallocated_s") is not None:
            note += f"; fallocated file: {r['first_touch_fallocated_s']:.3f}"
        if r.get("pair_ratio") is not None:
            note += f"; paired ratio to memcpy {r['pair_ratio']:.2f}x"
        print(
            f"{label:<44}{C.fmt_s(r.get('first_s'))}{C.fmt_s(s)}{C.fmt_x(C.ratio(s, bound), 9)}"
            f"{C.fmt_x(C.ratio(s, ref), 9)}  {note}"
        )
    p = res.get("persist")
    if p:
        print(
            f"\npersist {p['shard_bytes'] / C.MiB:.0f} MiB: flush {C.fmt_s(p['flush_median_s'], 0)}"
            f" s = {p['flush_mib_s'] or 0:.0f} MiB/s (agent log: "
            f"{p['agent_mib_s'] or 0:.0f} MiB/s); disk dd+fsync {p['dd_mib_s'] or 0:.0f} MiB/s,"
            f" with O_DIRECT {p.get('dd_direct_mib_s') or 0:.0f} MiB/s"
        )
    rl = res.get("reload")
    if rl:
        print(
            f"hot reload: memory {C.fmt_s(rl['memory_median_s'], 0)} s; storage cold "
            f"{C.fmt_s(rl['storage_cold_median_s'], 0)} s, page-cached "
            f"{C.fmt_s(rl['storage_warm_median_s'], 0)} s"
        )
    if res.get("persist_error"):
        print(f"persist/reload error: {res['persist_error']}")
    print("targets:")
    for k, v in res.get("targets", {}).items():
        val = v["value"]
        if isinstance(val, list):
            vs = " vs ".join(C.fmt_s(x, 0).strip() for x in val) + " s"
        else:
            vs = f"{val:.2f}" if val is not None else "-"
        verdict = "n/a" if v["met"] is None else ("MET" if v["met"] else "MISSED")
        print(f"  {k:<28} {vs:<22} target {v['target']:<34} {verdict}")


def markdown(out: dict[str, Any]) -> str:
    """Markdown tables of a results file (``--report``), as pasted into benchmarks/README.md."""
    lines: list[str] = []
    m = out.get("machine", {})
    lines.append(
        f"Run {out.get('date')}: {m.get('cpus')} CPUs ({m.get('cpu_model')}), "
        f"{m.get('ram_gib')} GiB RAM, GPU: {m.get('gpu')}, torch {m.get('torch')}, "
        f"Python {m.get('python')}, kernel {m.get('kernel')}."
    )
    for res in out["sizes"]:
        rows = res.get("rows", {})
        bound = rows.get("memcpy_paired", rows.get("memcpy", {})).get("steady_s")
        ref = rows.get("fc_sync", {}).get("steady_s")
        lines += [
            "",
            f"**{res['state_bytes'] / C.GiB:.2f} GiB** ({res['layers']} x Linear({res['width']}) + "
            f"AdamW, {res['tensors']} tensors; batch {res['batch']}: fwd+bwd "
            f"{res['fwd_bwd_s']:.2f} s, optimizer step {res['opt_step_s']:.2f} s"
            + ("; partial: the process was killed" if res.get("partial") else "")
            + ")",
            "",
            "| stall per checkpoint (s) | first | steady | x memcpy | x fc sync |",
            "|---|---:|---:|---:|---:|",
        ]
        for key, label in ROW_ORDER:
            r = rows.get(key)
            if r is None:
                continue
            if r.get("error"):
                lines.append(f"| {label.strip()} | error: {r['error'][:60]} | | | |")
                continue
            st = r.get("steady_s")
            unguarded = " (unguarded)" if r.get("unguarded") else ""
            lines.append(
                f"| {label.strip()}{unguarded} | {C.fmt_s(r.get('first_s'), 0).strip()} | "
                f"{C.fmt_s(st, 0).strip()} | {C.fmt_x(C.ratio(st, bound), 0).strip()} | "
                f"{C.fmt_x(C.ratio(st, ref), 0).strip()} |"
            )
        p, rl = res.get("persist"), res.get("reload")
        if p:
            lines += [
                "",
                f"Persist {p['shard_bytes'] / C.MiB:.0f} MiB: save + flush "
                f"{C.fmt_s(p['flush_median_s'], 0).strip()} s = {p['flush_mib_s']:.0f} MiB/s "
                f"(agent log {p.get('agent_mib_s') or 0:.0f} MiB/s); dd + fsync "
                f"{p['dd_mib_s']:.0f} MiB/s, O_DIRECT {p.get('dd_direct_mib_s') or 0:.0f} MiB/s.",
            ]
        if rl:
            lines.append(
                f"Hot reload: memory {C.fmt_s(rl['memory_median_s'], 0).strip()} s, storage cold "
                f"{C.fmt_s(rl['storage_cold_median_s'], 0).strip()} s, page-cached "
                f"{C.fmt_s(rl['storage_warm_median_s'], 0).strip()} s."
            )
        if res.get("skipped_phases"):
            lines.append("Skipped: " + "; ".join(res["skipped_phases"]) + ".")
        lines += ["", "| target | value | met |", "|---|---|---|"]
        for k, v in res.get("targets", {}).items():
            val = v["value"]
            if isinstance(val, list):
                vs = " vs ".join(C.fmt_s(x, 0).strip() for x in val) + " s"
            else:
                vs = f"{val:.2f}" if val is not None else "-"
            verdict = "n/a" if v["met"] is None else ("met" if v["met"] else "**missed**")
            lines.append(f"| {k} ({v['target']}) | {vs} | {verdict} |")
    for sk in out.get("skipped", []):
        lines.append(f"\nSkipped {sk['size_gib']:g} GiB: {sk['reason']}")
    for res in out.get("loop", []):
        lines += ["", *loop_markdown(res)]
    if out.get("load_start") is not None:
        lines.append(
            f"\nLoad average (1 min) at start {out['load_start'][0]:.2f}, at end "
            f"{(out.get('load_end') or [float('nan')])[0]:.2f}."
        )
    return "\n".join(lines)


SIZE_PHASES = ("memcpy", "fc", "files", "dcp", "persist")
ALL_PHASES = (*SIZE_PHASES, "loop")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="0.25,1,4", help="state sizes in GiB (default 0.25,1,4)")
    p.add_argument("--quick", action="store_true", help="smoke run: 0.05 GiB, few repeats")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--repeats", type=int, default=5, help="steady-state samples (default 5)")
    p.add_argument("--fwd-bwd", type=float, default=0.3, help="target fwd+bwd seconds per step")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the model and optimizer state live (cuda: device->host snapshots)",
    )
    p.add_argument(
        "--only",
        default=None,
        help="comma list of phases: memcpy,fc,files,dcp,persist,loop (e2e = loop)",
    )
    g = p.add_argument_group("loop phase (issue 14)")
    g.add_argument(
        "--loop-sizes", default="0.5", help="loop: GB (1e9 bytes) of state, comma list (0.5,2)"
    )
    g.add_argument("--rounds", type=int, default=3, help="loop: runs per variant (best counts)")
    g.add_argument("--steps", type=int, default=30, help="loop: timed steps per run")
    g.add_argument("--every", type=int, default=5, help="loop: checkpoint every K steps")
    g.add_argument("--warmup", type=int, default=2, help="loop: untimed steps before")
    g.add_argument("--loop-batch", type=int, default=64, help="loop: batch rows (default 64)")
    g.add_argument("--threads", type=int, default=2, help="loop: torch.set_num_threads")
    g.add_argument(
        "--variants",
        default=None,
        help="loop: comma list of " + ",".join(v for v, _ in LOOP_VARIANTS) + " (default all)",
    )
    g.add_argument(
        "--malloc",
        choices=("pinned", "system"),
        default="pinned",
        help="loop: pinned (default) runs every child with glibc's trim and mmap thresholds fixed "
        "(GLIBC_TUNABLES, see PINNED_MALLOC), system with glibc's defaults",
    )
    g.add_argument("--loop-timeout", type=float, default=900.0, help="loop: seconds per run")
    g.add_argument("--loop-child", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--report", nargs="+", default=None, metavar="JSON", help="print markdown tables of results"
    )
    args = p.parse_args(argv)
    if args.quick:
        given = " ".join(argv if argv is not None else sys.argv)
        if "--sizes" not in given:
            args.sizes = "0.05"
        if "--loop-sizes" not in given:
            args.loop_sizes = "0.05"
        args.repeats = min(args.repeats, 3)
        args.fwd_bwd = min(args.fwd_bwd, 0.08)
        args.rounds = min(args.rounds, 1)
        args.steps = min(args.steps, 6)
        args.every = min(args.every, 3)
        args.warmup = min(args.warmup, 1)
        args.loop_batch = min(args.loop_batch, 16)
    only = {x.strip() for x in args.only.split(",") if x.strip()} if args.only else None
    if only is not None and "e2e" in only:
        only = (only - {"e2e"}) | {"loop"}
    if only is not None and only - set(ALL_PHASES):
        p.error(f"--only: unknown phase(s) {sorted(only - set(ALL_PHASES))}; known: {ALL_PHASES}")
    args.phases = sorted(only) if only is not None else list(ALL_PHASES)
    args.only = ",".join(args.phases) if only is not None else None
    if args.variants:
        args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in args.variants if v not in LOOP_LABELS]
        if bad:
            p.error(f"--variants: unknown {bad}; known: {', '.join(LOOP_LABELS)}")
    cuda_asked = args.device == "cuda" and args.loop_child is None and not args.report
    if cuda_asked and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available to this torch")
    return args


def run_children(args: argparse.Namespace, sizes: list[float], out: dict[str, Any]) -> None:
    """One process per size: memory freed by a size never lingers in the next one's way."""
    import subprocess
    import tempfile

    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="fcb-out-") as d:
            part = os.path.join(d, "part.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--sizes", f"{size:g}"]
            cmd += ["--out", part, "--repeats", str(args.repeats), "--fwd-bwd", str(args.fwd_bwd)]
            cmd += ["--device", args.device]
            cmd += ["--only", ",".join(p for p in args.phases if p != "loop")]
            if args.quick:
                cmd += ["--quick"]
            proc = subprocess.Popen(cmd)
            try:
                rc = proc.wait()
            except BaseException:
                proc.terminate()
                proc.wait(120)
                raise
            if rc != 0:
                why = "killed (SIGKILL: out of memory?)" if rc == -9 else f"exit code {rc}"
                out["skipped"].append({"size_gib": size, "reason": f"child {why}; partial"})
            if not os.path.exists(part):
                continue
            with open(part) as f:
                sub = json.load(f)
            for res in sub["sizes"]:
                if "targets" not in res and "rows" in res:
                    res["targets"] = evaluate(res)
                    res["partial"] = True
            out["sizes"] += sub["sizes"]
            out["skipped"] += sub["skipped"]
            if args.out:
                _write(args.out, out)


def print_summary(out: dict[str, Any]) -> None:
    print("\n=== summary (medians; s) ===")
    hdr = (
        f"{'GiB':>5} {'memcpy':>7} {'fc sync':>8} {'ratio':>6} {'first':>6} {'fc ovl+w':>8} "
        f"{'DCP a+w':>8} {'persist':>8} {'reload':>7}"
    )
    print(hdr)
    for res in out["sizes"]:
        rows, t = res["rows"], res["targets"]

        def g(k: str, f: str = "steady_s", rows: dict[str, Any] = rows) -> float | None:
            return rows.get(k, {}).get(f)

        print(
            f"{res['state_bytes'] / C.GiB:>5.2f} "
            f"{C.fmt_s(g('memcpy_paired') or g('memcpy'), 7)} {C.fmt_s(g('fc_sync'))} "
            f"{C.fmt_x(t['sync_stall_vs_memcpy']['value'], 6)} "
            f"{C.fmt_x(t['first_vs_steady']['value'], 6)} {C.fmt_s(g('fc_overlap_imm'))} "
            f"{C.fmt_s(g('dcp_async_astage_imm'))} "
            f"{C.fmt_x(t['persist_vs_disk']['value'], 8)} "
            f"{C.fmt_x(t['reload_memory_vs_storage']['value'], 7)}"
        )
    for sk in out["skipped"]:
        print(f"skipped {sk['size_gib']:g} GiB: {sk['reason']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        for path in args.report:
            with open(path) as f:
                print(markdown(json.load(f)))
            print()
        return 0
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.loop_child is not None:  # one (variant, round) of the loop phase
        got = loop_child(json.loads(args.loop_child))
        if args.out:
            _write(args.out, got)
        return 0
    sizes = sorted(float(s) for s in args.sizes.split(",") if s.strip())
    out: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": C.machine_info(),
        "args": vars(args),
        "load_start": os.getloadavg(),
        "sizes": [],
        "skipped": [],
        "loop": [],
    }
    t_start = time.perf_counter()
    if set(args.phases) & set(SIZE_PHASES):
        if len(sizes) > 1:
            with C.terminate_as_exception():
                run_children(args, sizes, out)
            print_summary(out)
        else:
            run_sizes(args, sizes, out)
    if "loop" in args.phases:
        log("== loop phase (training time lost per checkpoint; one process per run)")
        with C.terminate_as_exception():
            for size in sorted(float(x) for x in args.loop_sizes.split(",") if x.strip()):
                res = bench_loop(args, size)
                out["loop"].append(res)
                if args.out:
                    _write(args.out, out)
                print("\n" + "\n".join(loop_markdown(res)) + "\n", flush=True)
    out["load_end"] = os.getloadavg()
    out["wall_s"] = time.perf_counter() - t_start
    if args.out:
        _write(args.out, out)
        log(f"wrote {args.out}")
    log(f"done in {out['wall_s']:.0f} s")
    return 0


def run_sizes(args: argparse.Namespace, sizes: list[float], out: dict[str, Any]) -> None:
    import torch.distributed as dist

    with C.terminate_as_exception(), C.Workspace() as ws:
        log(f"workspace {ws.root}; machine {out['machine']}")
        # DCP needs a process group: one rank, gloo, file:// rendezvous in the temp dir.
        dist.init_process_group("gloo", init_method=f"file://{ws.path('pg')}", rank=0, world_size=1)
        try:
            for size in sizes:
                need = int(size * C.GiB * 4.2 + 1.5 * C.GiB)
                avail, shm = C.available_bytes(), C.shm_free_bytes()
                if avail < need or shm < int(size * C.GiB * 2.3):
                    msg = (
                        f"skipping {size:g} GiB: needs ~{need / C.GiB:.1f} GiB RAM and "
                        f"{size * 2.3:.1f} GiB /dev/shm; {avail / C.GiB:.1f} GiB RAM and "
                        f"{shm / C.GiB:.1f} GiB /dev/shm available"
                    )
                    log(msg)
                    out["skipped"].append({"size_gib": size, "reason": msg})
                    continue
                res: dict[str, Any] = {}
                out["sizes"].append(res)

                def save() -> None:
                    if args.out:  # partial results survive a crash (or the OOM killer)
                        _write(args.out, out)

                bench_size(size, args, ws, res, save)
                print_size(res)
        finally:
            _dcp_process_shutdown()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _write(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())

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
6. training time lost per checkpoint inside a real training loop;
7. the agent's persist throughput against the disk's sequential write speed;
8. hot reload from memory against reload from storage.

Run from the repository root::

    python benchmarks/stall.py --quick               # smoke run, < 60 s
    python benchmarks/stall.py --out results.json    # 0.25, 1 and 4 GiB (10-20 min)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import re
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
    t0 = time.perf_counter()
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)
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


def bench_memcpy(tr: C.Trainer, ws: C.Workspace, repeats: int, first_repeats: int) -> Row:
    src = [t for _, t in tr.state_tensors()]
    nbytes = sum(t.numel() * t.element_size() for t in src)
    first, first_falloc, steady = [], [], []
    for i in range(first_repeats):
        # A fresh sparse file: every page is allocated and zeroed by the fault of the copy.
        path, buf = _map_fresh(ws, nbytes, fallocate=False)
        first.append(_copy_all(_shm_views(buf, src), src))
        if i == first_repeats - 1:
            # The pages are touched now: this is the pre-faulted buffer of the bound.
            buf.fill_(0)
            views = _shm_views(buf, src)
            _copy_all(views, src)
            steady = [_copy_all(views, src) for _ in range(repeats)]
            del views
        del buf
        os.unlink(path)
        # A posix_fallocate'd file (as flashckpt's agent makes them) mapped fresh: minor faults.
        path, buf = _map_fresh(ws, nbytes, fallocate=True)
        first_falloc.append(_copy_all(_shm_views(buf, src), src))
        del buf
        os.unlink(path)
    gc.collect()
    return _row(
        C.median(first),
        steady,
        "first = copy into a fresh never-touched mapping",
        first_samples=first,
        first_touch_fallocated_s=C.median(first_falloc),
        first_touch_fallocated_samples_s=first_falloc,
        nbytes=nbytes,
    )


# -- 2./3. flashckpt stall --------------------------------------------------------------------
def _enter_fc(ws: C.Workspace, tr: C.Trainer, job: str, **opts: Any) -> tuple[Any, float, int]:
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


def bench_fc_sync(tr: C.Trainer, ws: C.Workspace, repeats: int) -> Row:
    job = ws.new_job("sync")
    ck, enter_s, pid = _enter_fc(ws, tr, job, mode="sync", restore=False)
    info: dict[str, Any] = {}
    try:
        tr.step()
        first = C.timed(ck.save, 1)[0]
        steady = []
        for i in range(repeats):
            tr.step()
            steady.append(C.timed(ck.save, 2 + i)[0])
        stats = ck.stats
        assert stats.saves == repeats + 1 and not stats.skips, (stats.saves, stats.skips)
    finally:
        # storage=None: does the auto-started agent (--exit-when-done) leave by itself?
        info = _exit_fc(ws, ck, job, pid, wait_self_exit=1.5)
    return _row(
        first,
        steady,
        "first save after __enter__ + 1 training step; memory only (storage=None)",
        enter_s=enter_s,
        **info,
    )


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
            call = C.timed(ck.save, step)[0]
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


def dcp_variants() -> list[tuple[str, str, Callable[[], Any] | None, bool]]:
    from torch.distributed.checkpoint.staging import (
        BlockingAsyncStager,
        DefaultStager,
        StagingOptions,
    )

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


# -- 6. end to end ----------------------------------------------------------------------------
class _Method:
    name = "baseline"

    def setup(self) -> None: ...

    def before_opt(self) -> None: ...

    def ckpt(self, step: int) -> None: ...

    def teardown(self) -> dict[str, Any]:
        return {}


class _FcMethod(_Method):
    def __init__(self, tr: C.Trainer, ws: C.Workspace, mode: str) -> None:
        self.tr, self.ws, self.mode = tr, ws, mode
        self.name = f"flashckpt {mode}"

    def setup(self) -> None:
        self.job = self.ws.new_job("e2e")
        self.root = self.ws.path("e2e", self.job, "x").rsplit("/", 1)[0]
        self.ck, _, self.pid = _enter_fc(
            self.ws,
            self.tr,
            self.job,
            mode=self.mode,
            storage=f"file://{self.root}",
            keep=2,
            restore=False,
        )
        self.tr.step()
        self.ck.save(1)
        self.tr.step()
        self.ck.flush()  # start the timed loop with nothing in flight (as for DCP)
        self.n0 = len(self.ck.stats.stall_s)
        self.w0 = len(self.ck.stats.wait_s)

    def ckpt(self, step: int) -> None:
        self.ck.save(step + 10)

    def teardown(self) -> dict[str, Any]:
        s = self.ck.stats
        out = {
            "stall_s": C.median(s.stall_s[self.n0 :]),
            "wait_s": C.median(s.wait_s[self.w0 :]),
            "skips": s.skips,
        }
        out.update(_exit_fc(self.ws, self.ck, self.job, self.pid))
        out["persist_errors"] = len(s.persist_errors)
        shutil.rmtree(self.root, ignore_errors=True)
        return out


class _DcpMethod(_Method):
    def __init__(self, tr: C.Trainer, ws: C.Workspace, process: bool) -> None:
        self.tr, self.ws, self.process = tr, ws, process
        self.name = "DCP async_save" + (" PROCESS" if process else " THREAD")

    def setup(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(False, self.process, True, False))
        self.staging: Any = None
        self.upload: Any = None
        self.dirs: list[str] = []
        self.n = 0
        self.upload_waits: list[float] = []
        self.staging_waits: list[float] = []
        self.tr.step()
        self.ckpt(0)
        self.tr.fwd_bwd()
        self.before_opt()
        self.tr.opt_step()
        self.upload.result()
        self.upload_waits.clear()
        self.staging_waits.clear()

    def before_opt(self) -> None:
        if self.staging is not None:  # guard the staging copy: the optimizer mutates the state
            t0 = time.perf_counter()
            self.staging.result()
            self.staging_waits.append(time.perf_counter() - t0)
            self.staging = None

    def ckpt(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.upload is not None:
            t0 = time.perf_counter()
            self.upload.result()
            self.upload_waits.append(time.perf_counter() - t0)
            while len(self.dirs) > 1:
                shutil.rmtree(self.dirs.pop(0), ignore_errors=True)
        self.n += 1
        d = os.path.dirname(self.ws.path("e2e-dcp", f"c{self.n}", "x"))
        self.dirs.append(d)
        ptype = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        resp = dcp.async_save(
            _dcp_state(self.tr),
            checkpoint_id=d,
            async_stager=self.stager,
            async_checkpointer_type=ptype,
        )
        self.staging = resp.staging_completion
        self.upload = resp.upload_completion

    def teardown(self) -> dict[str, Any]:
        out = {
            "upload_wait_s": C.median(self.upload_waits),
            "staging_wait_s": C.median(self.staging_waits),
        }
        with contextlib.suppress(Exception):
            if self.staging is not None:
                self.staging.result()
            if self.upload is not None:
                self.upload.result()
        self.stager.close()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        gc.collect()
        return out


class _TorchSaveMethod(_Method):
    name = "torch.save + fsync"

    def __init__(self, tr: C.Trainer, ws: C.Workspace) -> None:
        self.tr, self.ws = tr, ws

    def setup(self) -> None:
        self.path = self.ws.path("e2e-tsave", "ckpt.pt")
        self.tr.step()
        self.ckpt(0)

    def ckpt(self, step: int) -> None:
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


def _loop(tr: C.Trainer, m: _Method, steps: int, every: int) -> tuple[float, list[float], int]:
    """Runs ``steps`` iterations, checkpointing after 0, K, 2K, ... (K-1 steps follow the last
    one); returns the loop time, each iteration's time, and the number of checkpoints."""
    n = 0
    durs = []
    t0 = time.perf_counter()
    for i in range(steps):
        ts = time.perf_counter()
        tr.fwd_bwd()
        m.before_opt()
        tr.opt_step()
        if i % every == 0:
            m.ckpt(i)
            n += 1
        durs.append(time.perf_counter() - ts)
    return time.perf_counter() - t0, durs, n


def bench_e2e(tr: C.Trainer, ws: C.Workspace, ckpts: int, every: int) -> dict[str, Any]:
    """Time lost per checkpoint = (loop time - baseline loop time) / checkpoints, and a version
    robust to bursts of noise from other processes: for each position in the checkpoint cycle
    (the step that checkpoints, the step after it, ...) the median over cycles, summed, minus K
    times the baseline's median step."""
    steps = ckpts * every
    methods: list[_Method] = [
        _Method(),
        _FcMethod(tr, ws, "overlap"),
        _FcMethod(tr, ws, "sync"),
        _DcpMethod(tr, ws, process=False),
        _DcpMethod(tr, ws, process=True),
        _TorchSaveMethod(tr, ws),
        _Method(),
    ]
    runs: list[dict[str, Any]] = []
    _loop(tr, _Method(), steps, every)  # warm-up, untimed
    for m in methods:
        log(f"  e2e: {m.name} ({steps} steps, checkpoint every {every})")
        try:
            m.setup()
            try:
                dt, durs, n = _loop(tr, m, steps, every)
            finally:
                extra = m.teardown()
            runs.append({"method": m.name, "loop_s": dt, "ckpts": n, "step_s": durs, **extra})
        except Exception as e:
            traceback.print_exc()
            runs.append({"method": m.name, "error": f"{type(e).__name__}: {e}"[:200]})
        gc.collect()
    base_runs = [r for r in runs if r["method"] == "baseline" and "loop_s" in r]
    base = [r["loop_s"] for r in base_runs]
    base_s = sum(base) / len(base) if base else None
    base_step = C.median([d for r in base_runs for d in r["step_s"]])
    for r in runs:
        if r["method"] == "baseline" or "loop_s" not in r or base_s is None:
            continue
        r["lost_per_ckpt_total_s"] = (r["loop_s"] - base_s) / r["ckpts"]
        cycle = [C.median(r["step_s"][p::every]) or 0.0 for p in range(every)]
        r["cycle_median_step_s"] = cycle
        r["lost_per_ckpt_s"] = sum(cycle) - every * (base_step or 0.0)
    noise = (max(base) - min(base)) / ckpts if len(base) > 1 else None
    return {
        "steps": steps,
        "every": every,
        "baseline_loop_s": base_s,
        "baseline_step_median_s": base_step,
        "baseline_noise_per_ckpt_s": noise,
        "runs": runs,
    }


# -- 7./8. persist throughput and hot reload ----------------------------------------------------
_PERSIST_RE = re.compile(r"persisted step (\d+): ([\d.]+) MiB in ([\d.]+) s")


def bench_persist_reload(
    tr: C.Trainer, ws: C.Workspace, repeats: int, reload_repeats: int
) -> dict[str, Any]:
    job = ws.new_job("pr")
    root = os.path.dirname(ws.path("store", job, "x"))
    url = f"file://{root}"
    pid = ws.start_agent(job, NODE, url)
    opts: dict[str, Any] = {"storage": url, "agent": "connect", "mode": "sync", "keep": 2}
    out: dict[str, Any] = {}
    flush_s: list[float] = []
    dd_s: list[float] = []
    shard_bytes = 0
    ck, _, _ = _enter_fc(ws, tr, job, restore=False, **opts)
    try:
        tr.step()
        nbytes = tr.state_bytes()
        dd_s.append(C.disk_write_speed(root, nbytes))
        for i in range(repeats):
            tr.step()
            ck.save(i + 1)
            t0 = time.perf_counter()
            committed = ck.flush()
            flush_s.append(time.perf_counter() - t0)
            assert committed == i + 1, f"flush returned {committed}, expected {i + 1}"
            dd_s.append(C.disk_write_speed(root, nbytes))
        last = repeats
        shard_dir = os.path.join(root, f"step-{last:09d}")
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
    agent_mib = [mib for _, mib, _ in logged]
    mib = shard_bytes / C.MiB
    out["persist"] = {
        "shard_bytes": shard_bytes,
        "flush_s": flush_s,
        "flush_median_s": C.median(flush_s),
        "flush_mib_s": mib / C.median(flush_s) if flush_s else None,
        "agent_log_s": agent_s,
        "agent_log_mib": agent_mib,
        "agent_mib_s": mib / C.median(agent_s) if agent_s else None,
        "dd_s": dd_s,
        "dd_mib_s": (nbytes / C.MiB) / C.median(dd_s) if dd_s else None,
    }
    log(
        f"  persist: flush {C.fmt_s(C.median(flush_s))} s, agent {C.fmt_s(C.median(agent_s))} s, "
        f"dd {C.fmt_s(C.median(dd_s))} s for {mib:.0f} MiB"
    )

    # 8. hot reload: the agent still holds both slots (the newest is step `repeats`).
    mem: list[float] = []
    for _ in range(reload_repeats):
        ck, enter_s, _ = _enter_fc(ws, tr, job, restore=True, **opts)
        src = ck.restored_from
        ck.__exit__(None, None, None)
        assert src == "memory", f"restored_from={src!r}, expected 'memory'"
        mem.append(enter_s)
    # From storage: the agent stops (and removes its slots); a fresh agent starts (untimed).
    cold: list[float] = []
    warm: list[float] = []
    for i in range(2 * reload_repeats):
        ws.stop_agent(pid)
        left = ws.job_shm_files(job)
        assert not left, f"agent left its slots behind: {left}"
        cache = "warm" if i % 2 else "cold"
        if cache == "cold":
            C.drop_file_cache(root)
        pid = ws.start_agent(job, NODE, url)
        ck, enter_s, _ = _enter_fc(ws, tr, job, restore=True, **opts)
        src = ck.restored_from
        ck.__exit__(None, None, None)
        assert src == "storage", f"restored_from={src!r}, expected 'storage'"
        (cold if cache == "cold" else warm).append(enter_s)
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
]


def bench_size(size: float, args: argparse.Namespace, ws: C.Workspace) -> dict[str, Any]:
    res: dict[str, Any] = {"size_gib": size, "rows": {}}
    only = set(args.only.split(",")) if args.only else None

    def want(phase: str) -> bool:
        return only is None or phase in only

    log(f"== {size:g} GiB: building the model")
    tr = C.Trainer.build(size)
    cal = tr.calibrate(args.fwd_bwd)
    n_tensors = len(tr.state_tensors())
    res.update(
        state_bytes=tr.state_bytes(),
        tensors=n_tensors,
        layers=tr.layers,
        width=tr.width,
        **cal,
    )
    log(
        f"   {tr.layers} x Linear({tr.width}, {tr.width}) + AdamW: "
        f"{tr.state_bytes() / C.GiB:.3f} GiB in {n_tensors} tensors; batch {cal['batch']}: "
        f"fwd+bwd {cal['fwd_bwd_s']:.3f} s, optimizer step {cal['opt_step_s']:.3f} s"
    )
    rows = res["rows"]
    reps = args.repeats
    disk_reps = max(2, min(reps, 3)) if size >= 1 else reps
    first_reps = 3 if size <= 1 else 2

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

    if want("memcpy"):
        run("memcpy", lambda: bench_memcpy(tr, ws, reps, first_reps))
    if want("fc"):
        run("fc_sync", lambda: bench_fc_sync(tr, ws, reps))
        run("fc_overlap", lambda: bench_fc_overlap(tr, ws, reps))
    if want("files"):
        run("torch_save", lambda: bench_torch_save(tr, ws, disk_reps))
        run("safetensors", lambda: bench_safetensors(tr, ws, disk_reps))
    if want("dcp"):
        run("dcp_save", lambda: bench_dcp_save(tr, ws, disk_reps))
        for key, _label, make, process in dcp_variants():
            r = disk_reps if make is None or key == "dcp_async_cached" else max(2, disk_reps - 1)

            def one(key: str = key, make: Any = make, process: bool = process, r: int = r) -> Any:
                return bench_dcp_async(tr, ws, r, key, make, process)

            run(key, one)
            if key in rows:  # an error row under the bare key
                rows[f"{key}_call"] = rows.pop(key)
    if want("e2e"):
        log("  e2e")
        try:
            res["e2e"] = bench_e2e(tr, ws, args.ckpts, args.every)
        except Exception as e:
            traceback.print_exc()
            res["e2e"] = {"error": str(e)}
    _dcp_process_shutdown()
    if want("persist"):
        log("  persist + reload")
        try:
            n = max(2, min(reps, 3))
            res.update(bench_persist_reload(tr, ws, n, 1 if args.quick else n))
        except Exception as e:
            traceback.print_exc()
            res["persist_error"] = f"{type(e).__name__}: {e}"[:300]
    gc.collect()
    res["targets"] = evaluate(res)
    return res


def evaluate(res: dict[str, Any]) -> dict[str, Any]:
    rows = res["rows"]
    t: dict[str, Any] = {}

    def steady(k: str) -> float | None:
        return rows.get(k, {}).get("steady_s")

    def first(k: str) -> float | None:
        return rows.get(k, {}).get("first_s")

    r = C.ratio(steady("fc_sync"), steady("memcpy"))
    ok = r is not None and r <= 1.15
    t["sync_stall_vs_memcpy"] = {"value": r, "target": "<= 1.15", "met": ok}
    r = C.ratio(first("fc_sync"), steady("fc_sync"))
    t["first_vs_steady"] = {"value": r, "target": "<= 1.5", "met": r is not None and r <= 1.5}
    r2 = C.ratio(first("fc_overlap_imm"), steady("fc_overlap_imm"))
    t["first_vs_steady"]["overlap_value"] = r2
    e2e = {x["method"]: x for x in res.get("e2e", {}).get("runs", [])}
    fc = [e2e.get(m, {}).get("lost_per_ckpt_s") for m in ("flashckpt overlap", "flashckpt sync")]
    dcp_l = [e2e.get(m, {}).get("lost_per_ckpt_s") for m in e2e if m.startswith("DCP")]
    fc_best = min([x for x in fc if x is not None], default=None)
    dcp_best = min([x for x in dcp_l if x is not None], default=None)
    t["e2e_lost_vs_dcp_async"] = {
        "value": [fc_best, dcp_best],
        "target": "flashckpt < best DCP async_save",
        "met": fc_best is not None and dcp_best is not None and fc_best < dcp_best,
    }
    p = res.get("persist", {})
    r = C.ratio(p.get("flush_mib_s"), p.get("dd_mib_s"))
    t["persist_vs_disk"] = {
        "value": r,
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
    return t


def print_size(res: dict[str, Any]) -> None:
    rows = res["rows"]
    print()
    print(
        f"=== state {res['state_bytes'] / C.GiB:.2f} GiB: {res['layers']} x Linear({res['width']},"
        f" {res['width']}) + AdamW, {res['tensors']} tensors; batch {res['batch']}: fwd+bwd "
        f"{res['fwd_bwd_s']:.3f} s + optimizer step {res['opt_step_s']:.3f} s ==="
    )
    bound = rows.get("memcpy", {}).get("steady_s")
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
        print(
            f"{label:<44}{C.fmt_s(r.get('first_s'))}{C.fmt_s(s)}{C.fmt_x(C.ratio(s, bound), 9)}"
            f"{C.fmt_x(C.ratio(s, ref), 9)}  {note}"
        )
    e2e = res.get("e2e")
    if e2e and "runs" in e2e:
        print(
            f"\n{'time lost per checkpoint in the loop (s)':<44}{'loop s':>8}{'lost/ck':>8}"
            f"{'/fc-ovl':>9}{'(total)':>9}  {e2e['steps']} steps, checkpoint every "
            f"{e2e['every']}; baseline step {C.fmt_s(e2e['baseline_step_median_s'], 0)} s, "
            f"baseline runs differ by {(e2e.get('baseline_noise_per_ckpt_s') or 0):.3f} s/ckpt"
        )
        fc = next(
            (r.get("lost_per_ckpt_s") for r in e2e["runs"] if r["method"] == "flashckpt overlap"),
            None,
        )
        for r in e2e["runs"]:
            if "error" in r:
                print(f"{r['method']:<44}{'error':>8}  {r['error'][:70]}")
                continue
            lost = r.get("lost_per_ckpt_s")
            extra = ""
            if r.get("stall_s") is not None:
                extra = f"save {C.fmt_s(r['stall_s'], 0)} wait {C.fmt_s(r.get('wait_s'), 0)}"
            if r.get("upload_wait_s") is not None or r.get("staging_wait_s") is not None:
                extra = (
                    f"staging wait {C.fmt_s(r.get('staging_wait_s'), 0)} "
                    f"upload wait {C.fmt_s(r.get('upload_wait_s'), 0)}"
                )
            rel = C.ratio(lost, fc) if lost is not None and fc and fc > 0 else None
            print(
                f"{r['method']:<44}{r['loop_s']:>8.2f}{C.fmt_s(lost)}{C.fmt_x(rel, 9)}"
                f"{C.fmt_s(r.get('lost_per_ckpt_total_s'), 9)}  {extra}"
            )
    p = res.get("persist")
    if p:
        print(
            f"\npersist {p['shard_bytes'] / C.MiB:.0f} MiB: flush {C.fmt_s(p['flush_median_s'], 0)}"
            f" s = {p['flush_mib_s'] or 0:.0f} MiB/s (agent log: "
            f"{p['agent_mib_s'] or 0:.0f} MiB/s); disk dd+fsync {p['dd_mib_s'] or 0:.0f} MiB/s"
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
        print(f"  {k:<28} {vs:<22} target {v['target']:<34} {'MET' if v['met'] else 'MISSED'}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="0.25,1,4", help="state sizes in GiB (default 0.25,1,4)")
    p.add_argument("--quick", action="store_true", help="smoke run: 0.05 GiB, few repeats")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--repeats", type=int, default=5, help="steady-state samples (default 5)")
    p.add_argument("--every", type=int, default=4, help="loop: checkpoint every K steps")
    p.add_argument("--ckpts", type=int, default=5, help="loop: checkpoints per timed run")
    p.add_argument("--fwd-bwd", type=float, default=0.3, help="target fwd+bwd seconds per step")
    p.add_argument(
        "--only", default=None, help="comma list of phases: memcpy,fc,files,dcp,e2e,persist"
    )
    args = p.parse_args(argv)
    if args.quick:
        if "--sizes" not in " ".join(argv or sys.argv):
            args.sizes = "0.05"
        args.repeats = min(args.repeats, 3)
        args.ckpts = min(args.ckpts, 2)
        args.every = min(args.every, 2)
        args.fwd_bwd = min(args.fwd_bwd, 0.08)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = sorted(float(s) for s in args.sizes.split(",") if s.strip())
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    out: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": C.machine_info(),
        "args": vars(args),
        "sizes": [],
        "skipped": [],
    }
    t_start = time.perf_counter()
    import torch.distributed as dist

    with C.terminate_as_exception(), C.Workspace() as ws:
        log(f"workspace {ws.root}; machine {out['machine']}")
        # DCP needs a process group: one rank, gloo, file:// rendezvous in the temp dir.
        dist.init_process_group("gloo", init_method=f"file://{ws.path('pg')}", rank=0, world_size=1)
        try:
            for size in sizes:
                need = int(size * C.GiB * 4.4 + 1.5 * C.GiB)
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
                res = bench_size(size, args, ws)
                out["sizes"].append(res)
                print_size(res)
                if args.out:  # keep partial results if a later size fails
                    _write(args.out, out)
        finally:
            _dcp_process_shutdown()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    out["wall_s"] = time.perf_counter() - t_start
    if args.out:
        _write(args.out, out)
        log(f"wrote {args.out}")
    log(f"done in {out['wall_s']:.0f} s")
    return 0


def _write(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())

"""Plain ``torchrun --rdzv-backend=flashckpt-etcd``: a SIGKILLed worker is recovered from memory.

No flashckpt launcher, no variable set by the user: torchrun loads our handler through its entry
point, the trainers start their own node agent (``agent="auto"``), and after one worker is
killed torchrun restarts the group, which restores from the agent's memory. With torch's shared
rendezvous TCPStore (its default) this hung in 2 of 6 runs; our handler turns the sharing off for
its users, so each round's worker rank 0 hosts a fresh store on a fresh port.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from elastic.testing import kill_job, loopback_env, read_jsonl

WORKER = Path(__file__).with_name("_torchrun_worker.py")
RUNS = 10
EVERY = 2

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


def _one_run(etcd_url: str, root: Path) -> tuple[int, list[dict[str, object]], str]:
    run_id = f"tr-{uuid.uuid4().hex[:10]}"
    out = root / run_id
    out.mkdir(parents=True)
    run_dir, shm_dir = Path(f"/tmp/{run_id}"), Path(f"/dev/shm/{run_id}")
    shm_dir.mkdir()
    env = loopback_env()
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # nothing set by the user
    env["FLASHCKPT_RUN_DIR"] = str(run_dir)
    env["FLASHCKPT_SHM_DIR"] = str(shm_dir)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "flashckpt-etcd", "--rdzv-endpoint", etcd_url, "--rdzv-id", run_id,
        "--max-restarts", "3", "--monitor-interval", "0.1",
        str(WORKER), "--out", str(out), "--storage", f"file://{out / 'ckpt'}",
        "--steps", "12", "--every", str(EVERY), "--kill-rank", "1", "--kill-at", "5",
    ]  # fmt: skip
    log = out / "torchrun.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        code = proc.wait(timeout=150)
    except subprocess.TimeoutExpired:
        code = -1  # hung
    finally:
        kill_job([proc], run_id)  # torchrun, its workers, the trainers' auto-started agent
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    return code, read_jsonl(out / "events.jsonl"), log.read_text(errors="replace")[-4000:]


@pytest.mark.timeout(RUNS * 170)
def test_torchrun_recovers_a_killed_worker_from_memory_every_time(
    etcd_server: str, tmp_path: Path
) -> None:
    failures = []
    for attempt in range(RUNS):
        code, events, log = _one_run(etcd_server, tmp_path)
        restored = [e for e in events if e["event"] == "restored" and e["restart"] == 1]
        done = sorted(e["rank"] for e in events if e["event"] == "done")  # type: ignore[type-var]
        problems = []
        if code != 0:
            problems.append("hung" if code == -1 else f"exit code {code}")
        if max((int(e["restart"]) for e in events), default=0) != 1:  # type: ignore[call-overload]
            problems.append("not exactly one restart")
        if sorted(e["rank"] for e in restored) != [0, 1]:  # type: ignore[type-var]
            problems.append(f"restored ranks {restored}")
        elif not all(e["restored_from"] == "memory" for e in restored):
            problems.append(f"not from memory: {restored}")
        elif not all(int(e["start_step"]) >= EVERY for e in restored):  # type: ignore[call-overload]
            problems.append(f"resumed from the start: {restored}")
        if done != [0, 1]:
            problems.append(f"ranks done: {done}")
        if problems:
            failures.append(f"run {attempt}: {'; '.join(problems)}\n{log}")
    assert not failures, f"{len(failures)} of {RUNS} runs failed:\n" + "\n".join(failures)

"""Plain ``torchrun --rdzv-backend=flashckpt-etcd``: a SIGKILLed worker is recovered from memory.

No flashckpt launcher, no variable set by the user: torchrun loads our handler through its entry
point, the trainers start their own node agent (``agent="auto"``), and after one worker is
killed torchrun restarts the group, which restores from the agent's memory. With torch's shared
rendezvous TCPStore (its default) this hung in 2 of 6 runs; our handler turns the sharing off for
its users, so each round's worker rank 0 hosts a fresh store on a fresh port.

The hang was a race of each restart (the restarted group read the previous attempt's keys), so
the test repeats the restart, not the whole job: one torchrun whose group is killed and restarted
KILLS times, each restart one more trial of that race (before the fix, of 5 runs with one restart
each, 1 hung, 1 failed all 3 restarts and 1 wasted a restart). The ten trials the test has always
made now share one torchrun, one rendezvous and one node agent instead of starting ten. Every
worker of every round also reports that it was handed its own store, not the agent's (torch's
``TORCHELASTIC_USE_AGENT_STORE``): that catches the sharing coming back in any one run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from flashckpt.testing.elastic import kill_job, loopback_env, read_jsonl

WORKER = Path(__file__).resolve().parents[2] / "support" / "_torchrun_worker.py"
KILLS = 10  # restarts, each a trial of the stale-store race
EVERY = 2
KILL_AT = 5  # iterations after each attempt's start step
# Each attempt resumes at most KILL_AT + 1 steps further on: every attempt reaches its kill.
STEPS = (KILL_AT + 1) * (KILLS + 1)

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


def _run(etcd_url: str, root: Path) -> tuple[int, list[dict[str, object]], str]:
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
        # Two restarts to spare, so that a wasted restart shows as one too many.
        "--max-restarts", str(KILLS + 2), "--monitor-interval", "0.1",
        str(WORKER), "--out", str(out), "--storage", f"file://{out / 'ckpt'}",
        "--steps", str(STEPS), "--every", str(EVERY), "--kill-rank", "1",
        "--kill-at", str(KILL_AT), "--kills", str(KILLS),
    ]  # fmt: skip
    log = out / "torchrun.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        code = proc.wait(timeout=60 + 30 * KILLS)
    except subprocess.TimeoutExpired:
        code = -1  # hung
    finally:
        kill_job([proc], run_id)  # torchrun, its workers, the trainers' auto-started agent
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    return code, read_jsonl(out / "events.jsonl"), log.read_text(errors="replace")[-6000:]


@pytest.mark.timeout(120 + 30 * KILLS)
def test_torchrun_recovers_a_killed_worker_from_memory_every_time(
    etcd_server: str, tmp_path: Path
) -> None:
    code, events, log = _run(etcd_server, tmp_path)
    problems = []
    if code != 0:
        problems.append("hung" if code == -1 else f"exit code {code}")
    restarts = max((int(e["restart"]) for e in events), default=0)  # type: ignore[call-overload]
    if restarts != KILLS:
        problems.append(f"{restarts} restarts, not {KILLS}")
    shared = [e for e in events if e["event"] == "start" and e["use_agent_store"] != "False"]
    if shared:
        problems.append(f"workers handed the agent's shared store: {shared}")
    previous = 0
    for attempt in range(1, KILLS + 1):
        restored = [e for e in events if e["event"] == "restored" and e["restart"] == attempt]
        if sorted(e["rank"] for e in restored) != [0, 1]:  # type: ignore[type-var]
            problems.append(f"restart {attempt}: restored ranks {restored}")
        elif not all(e["restored_from"] == "memory" for e in restored):
            problems.append(f"restart {attempt}: not from memory: {restored}")
        elif not all(int(e["start_step"]) >= previous + EVERY for e in restored):  # type: ignore[call-overload]
            problems.append(f"restart {attempt}: resumed before {previous + EVERY}: {restored}")
        else:
            previous = int(restored[0]["start_step"])  # type: ignore[call-overload]
    done = sorted((e["rank"], e["restart"]) for e in events if e["event"] == "done")  # type: ignore[type-var]
    if done != [(0, KILLS), (1, KILLS)]:
        problems.append(f"(rank, restart) done: {done}")
    assert not problems, "\n".join(problems) + f"\n{log}"

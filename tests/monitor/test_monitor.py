"""Step monitoring: rings, live status and Prometheus metrics, stragglers, hangs, goodput."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_step
from waiting import wait_until

import flashckpt
from flashckpt import cli
from flashckpt.monitor.goodput import compute_goodput, incarnations_from_events, read_events
from flashckpt.monitor.rankview import RingReader
from flashckpt.monitor.ring import EXITED, RUNNING, StepRecorder, ring_path
from flashckpt.monitor.step_monitor import MonitorConfig

HERE = Path(__file__).resolve().parents[1] / "support"


def _events(env: FcEnv) -> list[dict[str, Any]]:
    return read_events([os.path.join(env.run_dir, f"{env.job}.{env.node}.events.jsonl")])


def _monitor(agent: RunningAgent) -> dict[str, Any]:
    return agent.agent.status()["monitor"]


# -- the ring ------------------------------------------------------------------------------------
def test_ring_records_phases_and_overwritten_records(tmp_path: Path) -> None:
    path = str(tmp_path / "fc.j.n.r00003.mon")
    rec = StepRecorder(path, rank=3, world=4, enter_wall=time.time(), capacity=8)
    ring = RingReader(path)
    assert (ring.rank, ring.world, ring.pid, ring.cap) == (3, 4, os.getpid(), 8)
    assert ring.phase() != RUNNING
    rec.ready(resume_step=7, restored_from="memory")
    assert ring.phase() == RUNNING
    info = ring.info()
    assert info["resume_step"] == 7 and info["restored_from"] == "memory"
    assert info["ready"] >= info["enter"]
    for s in range(7, 12):
        rec.ckpt_stall(0.002, snapshot=s == 9)
        rec.step(s)
    recs, lost = ring.read_new()
    assert lost == 0 and [r[0] for r in recs] == [7, 8, 9, 10, 11]
    assert [r[7] for r in recs] == pytest.approx([2.0] * 5)  # checkpoint ms
    assert all(r[2] > 0 for r in recs)  # step ms
    assert [r[8] & 1 for r in recs] == [0, 0, 1, 0, 0]
    # 20 more records overflow the 8-record ring: the overwritten ones are counted, never misread
    for s in range(12, 32):
        rec.step(s)
    recs, lost = ring.read_new()
    assert len(recs) + lost == 20
    assert [r[0] for r in recs] == list(range(32 - len(recs), 32)) and len(recs) >= 7
    rec.close(exit_code=0)
    assert ring.phase() == EXITED and ring.info()["exit_code"] == 0
    ring.close()


def test_the_monitor_polls_rings_often_and_looks_for_them_once_a_second(tmp_path: Path) -> None:
    """An agent with no trainer's ring wakes its monitor once a second (IDLE_POLL_S), not at
    poll_s; once a ring is found it reads it every poll_s."""
    from flashckpt.monitor.step_monitor import IDLE_POLL_S, AgentMonitor

    shm, run = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    run.mkdir()
    mon = AgentMonitor(
        job="j", node="n", shm_dir=str(shm), run_dir=str(run), config=MonitorConfig(poll_s=0.25)
    )
    assert IDLE_POLL_S > 0.25
    mon.poll()
    assert mon.next_wait() == IDLE_POLL_S
    rec = StepRecorder(ring_path(str(shm), "j", "n", 0), rank=0, world=1, enter_wall=time.time())
    try:
        mon.poll()
        assert mon.next_wait() == 0.25
    finally:
        rec.close(exit_code=0)


# -- live status, metrics, events ------------------------------------------------------------------
def test_live_status_prometheus_and_events(fc_env: FcEnv, capsys: pytest.CaptureFixture) -> None:
    cfg = MonitorConfig(
        poll_s=0.05, metrics_port=0, metrics_addr="127.0.0.1", events_interval_s=0.2
    )
    agent = RunningAgent(fc_env.agent_config(monitor=cfg))
    try:
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, every=4, **fc_env.ckpt_kwargs(agent="connect")
        ) as ck:
            for step in range(12):
                train_step(model, opt, sched, step)
                ck.step()
            mon = wait_until(
                lambda: (
                    (r := (m := _monitor(agent))["ranks"].get("0", {})).get("step") == 11
                    and r.get("steps") == 12
                    and m
                ),
                "rank 0 at step 11",
                timeout=30.0,
            )
            r0 = mon["ranks"]["0"]
            assert r0["state"] == "running" and r0["pid"] == os.getpid()
            assert r0["steps"] == 12
            assert 0 < r0["p50_ms"] <= r0["p99_ms"]
            assert r0["p50_parts_ms"]["forward"] > 0 and r0["p50_parts_ms"]["optimizer"] > 0
            assert r0["ckpt_total_s"] > 0  # three snapshots were taken
            assert mon["alerts"] == []

            port = mon["metrics_port"]
            assert isinstance(port, int) and port > 0
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            text = body.decode()
            labels = f'job="{fc_env.job}",node="n0",rank="0"'
            assert f"flashckpt_step{{{labels}}} 12.0" in text  # steps completed, as everywhere
            assert f"flashckpt_steps_total{{{labels}}} 12.0" in text
            assert re.search(r'flashckpt_step_time_seconds\{.*quantile="0.99".*\} \d', text)
            assert f"flashckpt_last_snapshot_step{{{labels}}} 12.0" in text
            assert f"flashckpt_hung{{{labels}}} 0.0" in text

            assert cli.main(["status", "--run-dir", fc_env.run_dir]) == 0
            out = capsys.readouterr().out
            assert f"job {fc_env.job}: 1 machine(s) reachable, 1 rank(s)" in out
            row = next(line for line in out.splitlines() if line.startswith("n0 "))
            assert row.split()[1:5] == ["0", str(os.getpid()), "running", "12"]
            assert "alerts: none" in out
        wait_until(
            lambda: _monitor(agent)["ranks"]["0"]["state"] == "exit", "the exit", timeout=30.0
        )
    finally:
        agent.stop()
    events = _events(fc_env)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "agent_start" and kinds[-1] == "goodput"
    start = next(e for e in events if e["event"] == "start")
    assert start["rank"] == 0 and start["resume_step"] == 0 and start["restore_s"] >= 0
    assert sum(e["n"] for e in events if e["event"] == "steps") == 12
    end = next(e for e in events if e["event"] == "end")
    assert end["reason"] == "exit" and end["last_step"] == 12
    report = Path(fc_env.run_dir, f"{fc_env.job}.n0.goodput.txt").read_text()
    assert report.startswith("goodput report: 1 rank(s)")


# -- stragglers ----------------------------------------------------------------------------------
class _Sleepy(torch.nn.Module):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return x


def test_straggler_is_flagged(fc_env: FcEnv) -> None:
    agent = RunningAgent(fc_env.agent_config(monitor=MonitorConfig(poll_s=0.05)))
    recs: list[StepRecorder] = []
    try:
        delays = {0: 0.001, 1: 0.001, 2: 0.008}  # rank 2's forward is 8x slower
        models = {r: _Sleepy(d) for r, d in delays.items()}
        for r in delays:
            rec = StepRecorder(
                ring_path(fc_env.shm_dir, fc_env.job, "n0", r),
                rank=r,
                world=3,
                enter_wall=time.time(),
            )
            rec.attach(models[r], None)
            rec.ready(resume_step=0, restored_from=None)
            recs.append(rec)
        x = torch.zeros(1)
        for step in range(30):
            for r, rec in enumerate(recs):
                models[r](x)
                rec.step(step)
        mon = wait_until(
            lambda: (m := _monitor(agent))["alerts"] and m, "a straggler alert", timeout=10
        )
        assert [a["rank"] for a in mon["alerts"]] == [2]
        alert = mon["alerts"][0]
        assert alert["kind"] == "straggler" and alert["metric"] == "compute"
        assert alert["ratio"] > 1.5 and "rank 2 is a straggler" in alert["message"]
        assert [mon["ranks"][str(r)]["straggler"] for r in range(3)] == [False, False, True]
        assert agent.agent.monitor is not None
        families = {f.name: f for f in agent.agent.monitor.metric_families()}
        flagged = {s.labels["rank"]: s.value for s in families["flashckpt_straggler"].samples}
        assert flagged == {"0": 0.0, "1": 0.0, "2": 1.0}
    finally:
        for rec in recs:
            rec.close()
        agent.stop()
    stragglers = [e for e in _events(fc_env) if e["event"] == "straggler"]
    assert [e["rank"] for e in stragglers] == [2]


# -- hangs ---------------------------------------------------------------------------------------
_HUNG_TRAINER = """
import sys, threading
sys.path.insert(0, {tests!r})
import torch
import flashckpt
from tinytrain import make, train_step

def wait_for_a_peer_that_never_comes():
    threading.Event().wait()

torch.set_num_threads(1)
model, opt, sched = make(0)
with flashckpt.checkpointing(model, opt, scheduler=sched, every=4, job={job!r}, node="n0",
                             run_dir={run_dir!r}, storage={storage!r}, agent="connect") as ck:
    print("resumed at", ck.start_step, ck.restored_from, flush=True)
    for step in range(ck.start_step, {steps}):
        train_step(model, opt, sched, step)
        ck.step()
    if {hang}:
        wait_for_a_peer_that_never_comes()
"""


def _trainer(env: FcEnv, tmp_path: Path, steps: int, hang: bool) -> subprocess.Popen[str]:
    script = tmp_path / f"trainer_{steps}.py"
    script.write_text(
        _HUNG_TRAINER.format(
            tests=str(HERE),
            job=env.job,
            run_dir=env.run_dir,
            storage=env.storage,
            steps=steps,
            hang=hang,
        )
    )
    # As under torchrun / `flashckpt run`: hung workers are killed so the launcher restarts them.
    child_env = {**os.environ, "TORCHELASTIC_RUN_ID": env.job}
    return subprocess.Popen(
        [sys.executable, str(script)],
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_hang_dumps_stacks_kills_and_the_restart_resumes(
    fc_env: FcEnv, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = MonitorConfig(poll_s=0.05, hang_floor_s=2.0, hang_factor=5.0, hang_dump_wait_s=1.0)
    agent = RunningAgent(fc_env.agent_config(monitor=cfg))
    try:
        with caplog.at_level("WARNING", logger="flashckpt.monitor.step_monitor"):
            hung = _trainer(fc_env, tmp_path, steps=15, hang=True)
            out, _ = hung.communicate(timeout=120)
        assert hung.returncode == -9, out  # SIGKILLed by the agent after the stack dump
        stacks = Path(fc_env.run_dir, f"{fc_env.job}.n0.r00000.stacks.log").read_text()
        assert "wait_for_a_peer_that_never_comes" in stacks
        assert "Python stacks of rank 0" in caplog.text
        assert "wait_for_a_peer_that_never_comes" in caplog.text  # copied into the agent's log
        mon = wait_until(
            lambda: (m := _monitor(agent))["ranks"]["0"]["state"] == "killed" and m,
            "the end",
            timeout=30.0,
        )
        assert mon["ranks"]["0"]["step"] == 14
        assert [a["kind"] for a in mon["recent_alerts"]] == ["hang"]

        # The launcher's restart: resumes from memory at the last snapshot (after step 11).
        again = _trainer(fc_env, tmp_path, steps=20, hang=False)
        out, _ = again.communicate(timeout=120)
        assert again.returncode == 0, out
        assert "resumed at 12 memory" in out
        mon = wait_until(
            lambda: (m := _monitor(agent))["ranks"]["0"]["state"] == "exit" and m,
            "the exit",
            timeout=30.0,
        )
        assert mon["ranks"]["0"]["restarts"] == 1
    finally:
        agent.stop()
    events = _events(fc_env)
    kinds = [e["event"] for e in events]
    assert kinds.count("hang") == 1 and kinds.count("hang_kill") == 1
    hang = next(e for e in events if e["event"] == "hang")
    assert hang["rank"] == 0 and hang["step"] == 15 and hang["threshold_s"] >= 2.0
    ends = [e["reason"] for e in events if e["event"] == "end"]
    assert ends == ["killed", "exit"]
    rep = compute_goodput(incarnations_from_events(events))
    assert rep.incarnations[0] == 2 and rep.restarts == 1
    assert rep.steps[0] == 15 + 8 and rep.recomputed_steps[0] == 3  # steps 12, 13, 14 re-run
    cats = rep.ranks[0]
    assert cats["failure_detection"] >= 2.0  # the hang threshold, at least
    assert cats["recomputed"] > 0 and cats["restore"] > 0 and cats["useful"] > 0
    assert sum(cats.values()) == pytest.approx(rep.walls[0])


# -- goodput -------------------------------------------------------------------------------------
def _write_jsonl(path: Path, events: list[dict[str, Any]], torn: bool = False) -> None:
    lines = [json.dumps(e) for e in events]
    if torn:
        lines.append('{"event": "steps", "rank": 0, "tok')  # a line cut by a crash
    path.write_text("\n".join(lines) + "\n")


def _hand_made_logs(tmp_path: Path) -> tuple[Path, Path]:
    n0, n1 = tmp_path / "j.n0.events.jsonl", tmp_path / "j.n1.events.jsonl"
    _write_jsonl(
        n0,
        [
            {"event": "agent_start", "t": 999.0},
            # rank 0, first process: started at 1000, entered at 1010, first step at 1012
            {"event": "start", "rank": 0, "token": "a", "proc_start": 1000, "enter": 1010,
             "ready": 1012},
            {"event": "steps", "rank": 0, "token": "a", "n": 100, "t1": 1112, "step_s": 100,
             "ckpt_s": 5, "recomputed_s": 0, "recomputed_n": 0, "last": 99},
            {"event": "end", "rank": 0, "token": "a", "reason": "died", "t": 1130},
            # its replacement: started at 1140, entered at 1150, first step at 1153; re-ran
            # 20 steps (20 s), then 80 new ones with 4 s of checkpoint stalls; exited at 1255
            {"event": "start", "rank": 0, "token": "b", "proc_start": 1140, "enter": 1150,
             "ready": 1153},
            {"event": "start", "rank": 0, "token": "b", "proc_start": 1140, "enter": 1150,
             "ready": 1153, "adopted": True},  # re-announced by a restarted agent: ignored
            {"event": "steps", "rank": 0, "token": "b", "n": 20, "t1": 1173, "step_s": 20,
             "ckpt_s": 0, "recomputed_s": 20, "recomputed_n": 20},
            {"event": "steps", "rank": 0, "token": "b", "n": 80, "t1": 1253, "step_s": 80,
             "ckpt_s": 4, "recomputed_s": 0, "recomputed_n": 0},
            {"event": "end", "rank": 0, "token": "b", "reason": "exit", "t": 1255},
        ],
        torn=True,
    )  # fmt: skip
    _write_jsonl(
        n1,
        [
            {"event": "start", "rank": 1, "token": "c", "proc_start": 1000, "enter": 1012,
             "ready": 1013},
            {"event": "steps", "rank": 1, "token": "c", "n": 100, "t1": 1113, "step_s": 100,
             "ckpt_s": 10, "recomputed_s": 0, "recomputed_n": 0},
            {"event": "end", "rank": 1, "token": "c", "reason": "exit", "t": 1115},
        ],
    )  # fmt: skip
    return n0, n1


def test_goodput_of_a_hand_made_event_log(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    n0, n1 = _hand_made_logs(tmp_path)
    rep = compute_goodput(incarnations_from_events(read_events([str(tmp_path / "j.*.jsonl")])))
    # rank 0, by hand: wall = 1255 - 1000 = 255 s
    #   rendezvous  (1010 - 1000) + (1150 - 1140)     = 20
    #   restore     (1012 - 1010) + (1153 - 1150)     = 5
    #   useful      (100 - 5) + (20 - 20) + (80 - 4)  = 171
    #   checkpoint  5 + 4 + final save (1255 - 1253) = 11
    #   failure     next start 1140 - last step 1112  = 28
    #   recomputed  20;  other 0;   sum = 255
    assert rep.walls[0] == pytest.approx(255)
    assert rep.ranks[0] == pytest.approx(
        {
            "useful": 171,
            "checkpoint": 11,
            "failure_detection": 28,
            "rendezvous": 20,
            "restore": 5,
            "recomputed": 20,
            "other": 0,
        }
    )
    assert (rep.incarnations[0], rep.steps[0], rep.recomputed_steps[0]) == (2, 200, 20)
    # rank 1: wall 115 = rendezvous 12 + restore 1 + useful 90 + checkpoint 10 + 2
    assert rep.walls[1] == pytest.approx(115)
    assert rep.ranks[1]["useful"] == pytest.approx(90)
    assert rep.ranks[1]["checkpoint"] == pytest.approx(12)
    # the job: means over the ranks; goodput = 130.5 / 185
    assert rep.wall == pytest.approx(185)
    assert rep.job["useful"] == pytest.approx(130.5)
    assert rep.goodput == pytest.approx(130.5 / 185)
    assert rep.restarts == 1

    assert cli.main(["goodput", str(n0), str(n1)]) == 0
    text = capsys.readouterr().out
    assert "goodput report: 2 rank(s), wall 185.0 s, restarts 1, goodput 70.5%" in text
    assert re.search(r"failure detection\s+14\.0 s\s+7\.6%", text)
    assert cli.main(["goodput", str(n0), str(n1), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["ranks"]["0"]["failure_detection_s"] == pytest.approx(28)
    assert cli.main(["goodput", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_goodput_chart(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    n0, n1 = _hand_made_logs(tmp_path)
    png = tmp_path / "goodput.png"
    assert cli.main(["goodput", str(n0), str(n1), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"chart written to {png}" in capsys.readouterr().out

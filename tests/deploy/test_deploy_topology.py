"""The node agent DaemonSet layout of deploy/kubernetes, for real, with Linux namespaces
(tests/deploy/podns.py): the agent "pod" in PID and mount namespaces of its own, with the host's
snapshot directory and socket directory bind-mounted; two trainer "pods" (the two ranks of a DDP
job), each in namespaces of its own, sharing only those two directories with the agent, each
with its own 64 MiB /dev/shm, all of them running as an unprivileged user that owns the host
directories (the DaemonSet's runAsUser and init container).

One run goes through both failures a DaemonSet layout must survive, at known steps (the ranks
wait at a gate there), and ends bitwise equal to an uninterrupted run:

1. the agent pod is killed (SIGKILL to its pid 1: every process of the pod) and a new agent pod
   starts; the trainers reconnect to it and go on;
2. both trainer pods are killed the same way (a group restart, as JobSet or torchrun does when
   a rank dies) and recreated; they resume from the new agent's memory (``restored_from`` is
   ``memory``), at a step past the agent's restart: the new agent adopted the slots in the host
   directory and kept serving them.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml
from deployhelpers import KUSTOMIZE, expand
from podns import CONTAINER, UID, Pod, PodSim, unavailable
from waiting import wait_until

from flashckpt import envnames
from flashckpt.monitor.goodput import read_events
from flashckpt.names import events_path
from flashckpt.protocol.channel import socket_path

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
STEPS = 30
GATE_AGENT = 8  # the ranks wait before this step while the agent pod is replaced
GATE_KILL = 18  # ... and before this one when their pods are killed


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[PodSim]:
    why = unavailable()
    if why:
        pytest.skip(why)
    s = PodSim(tmp_path)
    try:
        yield s
    finally:
        s.close()


def wait_pods(
    cond: Callable[[], object], what: str, pods: list[Pod], timeout: float = 180.0
) -> None:
    """:func:`waiting.wait_until` ``cond()``; fails at once (with the pods' output) when a pod
    exits first, and with their output when time runs out."""

    def check() -> object:
        for pod in pods:
            if pod.proc.poll() is not None:
                pytest.fail(
                    f"pod {pod.name} exited ({pod.proc.returncode}) before {what}:\n{pod.output()}"
                )
        return cond()

    try:
        wait_until(check, what, timeout=timeout, interval=0.05)
    except AssertionError as e:
        pytest.fail(f"{e}:\n" + "\n".join(p.output() for p in pods))


class Job:
    """The job's names, as the ConfigMap and the downward API give them to every pod."""

    def __init__(self, sim: PodSim, tag: str) -> None:
        self.sim = sim
        self.id = f"k{uuid.uuid4().hex[:10]}{tag}"
        self.node = "node-a"
        self.storage = f"file://{sim.vol / 'ckpt' / tag}"
        # The trainer container's directories, as the JobSet sets them.
        js = yaml.safe_load((KUSTOMIZE / "base" / "jobset" / "jobset.yaml").read_text())
        pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        dirs = {
            e["name"]: e["value"].replace("/flashckpt/", f"{CONTAINER}/")
            for e in pod["containers"][0]["env"]
            if e["name"] in (envnames.RUN_DIR, envnames.SHM_DIR)
        }
        assert dirs == {envnames.RUN_DIR: f"{CONTAINER}/run", envnames.SHM_DIR: f"{CONTAINER}/shm"}
        self.env = {
            **os.environ,
            envnames.JOB: self.id,
            envnames.NODE: self.node,
            **dirs,
            "PYTHONUNBUFFERED": "1",
        }

    def agent(self, name: str) -> Pod:
        """The DaemonSet's container, as deploy/kubernetes/base/agent/daemonset.yaml writes it:
        its command line with the pod's variables, /flashckpt where the pods mount the host
        directories, and only the metrics port turned off (a fixed port on a shared network)."""
        ds = yaml.safe_load((KUSTOMIZE / "base" / "agent" / "daemonset.yaml").read_text())
        (c,) = ds["spec"]["template"]["spec"]["containers"]
        values = {envnames.JOB: self.id, envnames.NODE: self.node, envnames.STORAGE: self.storage}
        args = [
            a.replace("/flashckpt/", f"{CONTAINER}/")
            for a in expand(c["args"], values)
            if not a.startswith(("--metrics-port=", "--metrics-host="))
        ]
        assert c["command"] == ["flashckpt", "agent"]
        argv = [sys.executable, "-m", "flashckpt", "agent", *args]
        return self.sim.start(name, argv, self.env)

    def events_file(self) -> Path:
        """The agents' events file (in their run directory) as the host sees it."""
        return Path(events_path(str(self.sim.host / "run"), self.id, self.node))

    def started(self) -> set[int]:
        """The ranks with a ``start`` event in the events file."""
        if not self.events_file().exists():
            return set()
        return {e["rank"] for e in read_events([str(self.events_file())]) if e["event"] == "start"}

    def socket_file(self) -> Path:
        """The agent's socket as the host sees it."""
        return Path(socket_path(str(self.sim.host / "run"), self.id, self.node))

    def trainers(self, tag: str, *gates: tuple[int, Path]) -> list[Pod]:
        vol = self.sim.vol
        init = vol / f"init-{tag}-{time.monotonic_ns()}"
        pods = []
        for rank in (0, 1):
            argv = [
                sys.executable, str(HERE / "_podtrain.py"), "--rank", str(rank),
                "--storage", self.storage, "--steps", str(STEPS),
                "--log", str(vol / f"{tag}-r{rank}.log"),
                "--init-file", str(init), "--report", str(vol / f"{tag}-report.txt"),
                *(a for step, path in gates for a in ("--gate", f"{step}:{path}")),
            ]  # fmt: skip
            pods.append(self.sim.start(f"{tag}-r{rank}", argv, self.env))
        return pods


def _listening(agent: Pod) -> bool:
    """The agent pod's agent said it listens on its socket (it runs as the pods' user: the run
    dir is private to that user, so this test, another user, does not ping it)."""
    return " listening on " in agent.output()


def _at_gate(gate: Path) -> bool:
    return all(Path(f"{gate}.at{r}").exists() for r in (0, 1))


def _log(path: Path) -> list[tuple[int, str]]:
    return [(int(a), b) for a, b in (ln.split() for ln in path.read_text().splitlines())]


def test_daemonset_layout_survives_agent_and_trainer_pod_restarts(sim: PodSim) -> None:
    # The uninterrupted run: the same layout, no failure.
    ref = Job(sim, "ref")
    agent = ref.agent("ref-agent")
    wait_pods(lambda: _listening(agent), "reference agent", [agent])
    for pod in ref.trainers("ref"):
        assert pod.wait(timeout=240) == 0, pod.output()
    agent.kill()

    job = Job(sim, "run")
    agent1 = job.agent("agent-1")
    wait_pods(lambda: _listening(agent1), "agent", [agent1])
    gate1, gate2 = sim.vol / "gate-agent", sim.vol / "gate-kill"
    first = job.trainers("run", (GATE_AGENT, gate1), (GATE_KILL, gate2))
    wait_pods(lambda: _at_gate(gate1), "ranks at the agent gate", [agent1, *first])
    # The trainers never started an agent of their own: each pod holds one process.
    assert [len(p.pids()) for p in first] == [1, 1]
    # The host directory holds the slots; the trainer pods' own /dev/shm does not.
    assert any((sim.host / "shm").iterdir())
    # ... written by the pods' user, and the agent's socket is there.
    assert {p.stat().st_uid for p in (sim.host / "shm").iterdir()} == {UID}
    assert job.socket_file().is_socket()

    # The agent's monitor has seen both ranks start (it reads the rings every second or so).
    wait_pods(lambda: job.started() == {0, 1}, "agent 1's start events", [agent1, *first])
    agent1.kill()  # the agent pod dies with everything in it
    agent2 = job.agent("agent-2")
    wait_pods(lambda: _listening(agent2), "new agent", [agent2, *first])
    gate1.touch()
    wait_pods(lambda: _at_gate(gate2), "ranks at the kill gate", [agent2, *first])

    for pod in first:  # both trainer pods, all their processes
        pod.kill()
    second = job.trainers("run")
    for pod in second:
        assert pod.wait(timeout=240) == 0, pod.output()
    # The DaemonSet runs the agent with --free-finished: the job finished and storage holds its
    # newest step, so it frees the job's slots and exits 0 (its DaemonSet restarts it empty).
    assert agent2.proc.wait(timeout=120) == 0, f"the agent pod failed:\n{agent2.output()}"
    assert "freeing its snapshot slots" in agent2.output(), agent2.output()
    # The agents' step monitor followed the trainers in their own PID namespaces by the locks on
    # their step rings: the killed pods' ranks died, the recreated ones ran to the end (with the
    # pids of the rings, every rank was 'died' at once).
    events = job.events_file()  # (both agents': the second one read the first one's)

    def ends() -> dict[int, list[str]]:
        out: dict[int, list[str]] = {0: [], 1: []}
        for e in read_events([str(events)]):
            if e["event"] == "end":
                out[e["rank"]].append(e["reason"])
        return out

    try:
        wait_pods(lambda: all(len(v) >= 2 for v in ends().values()), "the ranks' ends", [])
    except pytest.fail.Exception as e:
        pytest.fail(f"{e}\nends: {ends()}\n{events}:\n{events.read_text()[-6000:]}")
    assert ends() == {0: ["died", "exit"], 1: ["died", "exit"]}, ends()
    starts = [e for e in read_events([str(events)]) if e["event"] == "start"]
    assert len(starts) == 4 and all(e["other_pid_ns"] for e in starts), starts

    vol = sim.vol
    reports = [ln.split() for ln in (vol / "run-report.txt").read_text().splitlines()]
    assert [r[2] for r in reports[:2]] == ["None", "None"], reports  # the first start: fresh
    resumed = reports[2:]
    assert sorted(int(r[0]) for r in resumed) == [0, 1], reports
    assert {r[2] for r in resumed} == {"memory"}, reports
    start = {int(r[1]) for r in resumed}
    assert len(start) == 1, reports
    # Past the agent's replacement: the new agent held snapshots taken after it started.
    assert GATE_AGENT < start.pop() <= GATE_KILL, reports

    for rank in (0, 1):
        want = _log(vol / f"ref-r{rank}.log")
        assert [s for s, _ in want] == list(range(STEPS))
        got = _log(vol / f"run-r{rank}.log")  # both attempts: steps after resume repeat
        assert {s for s, _ in got} == set(range(STEPS)), rank
        for step, loss in got:
            assert loss == want[step][1], (rank, step)
        final = f"run-r{rank}.log.final.safetensors"
        got_t = safetensors.torch.load_file(str(vol / final))
        want_t = safetensors.torch.load_file(str(vol / f"ref-r{rank}.log.final.safetensors"))
        assert got_t.keys() == want_t.keys()
        for k in want_t:
            assert torch.equal(got_t[k], want_t[k]), (rank, k)

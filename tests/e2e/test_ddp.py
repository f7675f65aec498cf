"""Two DDP ranks (gloo) on one machine: one replica persists, and ranks agree on the resume step."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fchelpers import FcEnv
from rankprocs import RankProcs

from flashckpt.format.storage import Storage

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parents[1] / "support"


def _launch(
    env: FcEnv,
    tmp: Path,
    tag: str,
    steps: int,
    kill: dict[int, int] | None = None,
    storage: str | None = None,
    nodes: tuple[str, str] | None = None,
    world_id: str | None = None,
    world: int = 2,
    extra: tuple[str, ...] = (),
) -> RankProcs:
    import os

    proc_env = {**os.environ, "FLASHCKPT_WORLD_ID": world_id} if world_id else None
    init = tmp / f"init-{tag}-{time.monotonic_ns()}"
    procs = RankProcs(tmp, tag)
    for rank in range(world):
        cmd = [
            sys.executable,
            str(HERE / "ddptrain.py"),
            "--rank",
            str(rank),
            "--storage",
            storage or env.storage,
            "--job",
            env.job,
            "--run-dir",
            env.run_dir,
            "--log",
            str(tmp / f"{tag}-r{rank}.log"),
            "--init-file",
            str(init),
            "--steps",
            str(steps),
            "--report",
            str(tmp / f"{tag}-report.txt"),
            "--world",
            str(world),
            *extra,
        ]
        if nodes:
            cmd += ["--node", nodes[rank], "--local-world", "1"]
        if kill and rank in kill:
            cmd += ["--kill-in-copy", str(kill[rank])]
        procs.start(cmd, env=proc_env)
    return procs


def _wait_all(procs: RankProcs, timeout: float = 180) -> list[int]:
    """Waits for the ranks; once one dies by a signal, the survivors (stuck in a collective)
    are SIGKILLed too, as torchrun's agent would do."""
    return procs.wait(timeout, stop_on_signal=True)


def _assert_same_as_reference(tmp_path: Path, world: int = 2) -> None:
    """Every logged loss and the final model of each rank equal the uninterrupted run's."""
    for rank in range(world):
        ref = dict(_log(tmp_path / f"ref-r{rank}.log"))
        for step, loss in _log(tmp_path / f"run-r{rank}.log"):
            assert loss == ref[step], (rank, step)
        got = safetensors.torch.load_file(str(tmp_path / f"run-r{rank}.log") + ".final.safetensors")
        want = safetensors.torch.load_file(
            str(tmp_path / f"ref-r{rank}.log") + ".final.safetensors"
        )
        for k in want:
            assert torch.equal(got[k], want[k]), (rank, k)


def _log(path: Path) -> list[tuple[int, str]]:
    return [(int(a), b) for a, b in (ln.split() for ln in path.read_text().splitlines())]


def test_ddp_kill_mid_copy_resumes_at_common_step(tmp_path: Path, fc_env: FcEnv) -> None:
    steps = 20
    ref_env = fc_env.reference(tmp_path)
    procs = _launch(ref_env, tmp_path, "ref", steps)
    assert _wait_all(procs) == [0, 0], procs.tails(2000)

    # Rank 1 dies by SIGKILL halfway through its 3rd snapshot copy (label 9): rank 0 holds 9,
    # rank 1 only 6. They must both resume at 6.
    procs = _launch(fc_env, tmp_path, "run", steps, kill={1: 3})
    codes = _wait_all(procs)
    assert codes[1] == -signal.SIGKILL
    procs = _launch(fc_env, tmp_path, "run", steps)
    assert _wait_all(procs) == [0, 0], procs.tails(2000)

    report = (tmp_path / "run-report.txt").read_text().splitlines()
    assert sorted(report[:2]) == ["0 0 None", "1 0 None"], report  # the first, fresh start
    assert sorted(report[2:]) == ["0 6 memory", "1 6 memory"], report
    for rank in range(2):
        ref = dict(_log(tmp_path / f"ref-r{rank}.log"))
        for step, loss in _log(tmp_path / f"run-r{rank}.log"):
            assert loss == ref[step], (rank, step)
    for rank in range(2):
        got = safetensors.torch.load_file(str(tmp_path / f"run-r{rank}.log") + ".final.safetensors")
        want = safetensors.torch.load_file(
            str(tmp_path / f"ref-r{rank}.log") + ".final.safetensors"
        )
        for k in want:
            assert torch.equal(got[k], want[k]), (rank, k)

    # One replica persisted the replicated shard: one tensor file per step, a rank file per rank.
    st = Storage(fc_env.storage)
    last = st.committed_steps()[-1]
    assert last == steps
    manifest = json.loads((fc_env.storage_path / f"step-{last:09d}" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == [
        "rank-00000-of-00002.json",
        "rank-00001-of-00002.json",
        "shard-00000-of-00001.safetensors",
    ]
    assert st.verify(last) == []


def test_replacement_rank_restores_from_a_replica_in_memory(tmp_path: Path, fc_env: FcEnv) -> None:
    """Each rank on its own (simulated) machine. Machine n1 dies with its memory; its replacement
    n2 gets the newest step from rank 0's memory over gloo, and its RNG/extras from the small
    per-rank file written through at snapshot time, even though the step is not committed."""
    import os

    import psutil

    steps = 20
    ref_env = fc_env.reference(tmp_path)
    procs = _launch(ref_env, tmp_path, "ref", steps, nodes=("n0", "n1"))
    assert _wait_all(procs) == [0, 0], procs.tails(2000)

    # Rank 1 dies halfway through copying snapshot 12; rank 0 completed it and then hangs.
    procs = _launch(fc_env, tmp_path, "run", steps, kill={1: 4}, nodes=("n0", "n1"))
    assert _wait_all(procs)[1] == -signal.SIGKILL
    # Machine n1 is gone: its agent and its memory.
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if fc_env.job in cmd and "agent" in cmd and "--node n1" in cmd:
            p.kill()
            p.wait(timeout=30)
    for n in os.listdir("/dev/shm"):
        if n.startswith(f"fc.{fc_env.job}.n1."):
            os.unlink(f"/dev/shm/{n}")
    # Step 9 is not committed yet (as if persistence lagged); rank 1's small state file is there.
    (fc_env.storage_path / "step-000000009" / "manifest.json").unlink(missing_ok=True)
    assert (fc_env.storage_path / "step-000000009" / "rank-00001-of-00002.json").exists(), sorted(
        str(p.relative_to(fc_env.storage_path)) for p in fc_env.storage_path.rglob("*")
    )

    procs = _launch(fc_env, tmp_path, "run", steps, nodes=("n0", "n2"))
    assert _wait_all(procs) == [0, 0], procs.tails(2000)
    report = (tmp_path / "run-report.txt").read_text().splitlines()
    assert sorted(report[2:]) == ["0 9 memory", "1 9 replica"], report
    _assert_same_as_reference(tmp_path)


def test_renumbered_ranks_reload_from_their_machines_memory(tmp_path: Path, fc_env: FcEnv) -> None:
    """A new world (rendezvous round) gives the surviving machines other global ranks: machine n0
    ran rank 0 and now runs rank 1, n1 the other way round. Each rank still reloads from its own
    machine's memory (the agent keys slots by local rank), takes its own RNG/extras from the file
    written through at snapshot time, trains on bitwise like an uninterrupted run, and the agents
    (which stayed up across the change) go on persisting the new world's steps."""
    steps = 20
    ref_env = fc_env.reference(tmp_path)
    procs = _launch(ref_env, tmp_path, "ref", steps, nodes=("n0", "n1"))
    assert _wait_all(procs) == [0, 0], procs.tails(2000)

    # World 1: rank 1 dies halfway through its 4th snapshot copy (step 12): the common step is 9.
    procs = _launch(fc_env, tmp_path, "run", steps, kill={1: 4}, nodes=("n0", "n1"), world_id="w1")
    assert _wait_all(procs)[1] == -signal.SIGKILL
    agents_before = _agent_pids(fc_env.job)
    assert set(agents_before) == {"n0", "n1"}, agents_before

    # World 2: the same machines, ranks swapped.
    procs = _launch(fc_env, tmp_path, "run", steps, nodes=("n1", "n0"), world_id="w2")
    assert _wait_all(procs) == [0, 0], procs.tails(2000)
    report = (tmp_path / "run-report.txt").read_text().splitlines()
    # Rank 1 (DDP broadcasts rank 0's buffers at each forward) reloads from its machine's memory,
    # although that snapshot was taken by rank 0. Rank 0's BatchNorm statistics are its own and
    # differ from rank 1's: it takes its old snapshot from the other machine's memory over gloo.
    assert sorted(report[2:]) == ["0 9 replica", "1 9 memory"], report
    _assert_same_as_reference(tmp_path)
    # The same agent processes served both worlds, and the new world's last step is committed
    # with the new world's rank files.
    still = _agent_pids(fc_env.job)
    same = all(still.get(n) in (None, pid) for n, pid in agents_before.items())
    assert same, (agents_before, still)
    st = Storage(fc_env.storage)
    assert st.committed_steps()[-1] == steps
    assert st.verify(steps) == []


def _agent_pids(job: str) -> dict[str, int]:
    import psutil

    out = {}
    for p in psutil.process_iter(["cmdline", "pid"]):
        cmd = p.info["cmdline"] or []
        if job in " ".join(cmd) and "agent" in cmd and "--node" in cmd:
            out[cmd[cmd.index("--node") + 1]] = p.info["pid"]
    return out

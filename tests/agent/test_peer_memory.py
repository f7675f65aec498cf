"""A lost machine's ranks restore from a peer agent's replica (issue 11, restore side): real node
agents (separate processes, node ids ``a``, ``b``, ``c``, each with its own tmpfs, replica
servers on 127.0.0.1 port 0), a sharded (FSDP2, gloo) job of 2 machines x 1 rank.

Machine ``b``'s agent replicates its rank's snapshots to ``a``; then ``b`` is lost (its agent
SIGKILLed, its memory removed) and a fresh standby agent ``c`` (peers: ``a``) takes rank 1:
the rank restores ``restored_from="peer-memory"``, bitwise equal to the state at that step. A
replica corrupted in the holder's memory is refused (a warning naming rank, step and source)
and the restore falls back to storage. Bad ``pull_replica`` requests get a ProtocolError reply.

Run as a script, this file is one rank of the job (``--rank``): shardtrain.py's model, data and
optimizer, one process per rank, so each rank is on a "machine" of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(900)

STEPS_BEFORE = 8  # the lost machine's newest snapshot: step 8 (every=2)
EVERY = 2


# -- one rank (run as a script) ---------------------------------------------------------------


def worker(a: argparse.Namespace) -> int:
    import safetensors.torch
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # run as a script
    from shardtrain import batch, full_state, make_model, make_optim
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import flashckpt

    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{a.init_file}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=120),
    )
    mesh = init_device_mesh("cpu", (a.world,))
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = make_optim(model)
    rows = 12 // a.world
    lo = a.rank * rows
    with flashckpt.checkpointing(
        model,
        opt,
        scheduler=sched,
        storage=a.storage or None,
        every=EVERY,
        job=a.job,
        node=a.node,
        run_dir=a.run_dir,
        mode="sync",
        agent="connect",
        agent_timeout=120,
    ) as ckpt:
        with open(a.report, "a") as f:
            f.write(
                json.dumps(
                    {
                        "rank": a.rank,
                        "start": ckpt.start_step,
                        "from": ckpt.restored_from,
                        "restore": ckpt.status()["restore"],
                    }
                )
                + "\n"
            )
        if ckpt.start_step:
            restored = full_state(model, opt)
            if a.rank == 0:
                safetensors.torch.save_file(restored, a.out + ".restored.safetensors")
        for step in range(ckpt.start_step, a.steps):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x[lo : lo + rows]), y[lo : lo + rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            ckpt.step()
            if step + 1 == a.exit_after:
                crash = full_state(model, opt)
                if a.rank == 0:
                    safetensors.torch.save_file(crash, a.out + ".crash.safetensors")
                dist.barrier()
                os._exit(3)  # as if killed: the agents keep the snapshots in memory
    dist.destroy_process_group()
    return 0


# -- the test side ------------------------------------------------------------------------------


def _wait(cond: Callable[[], Any], what: str, timeout: float = 180.0) -> Any:
    from waiting import wait_until

    return wait_until(cond, what, timeout=timeout, interval=0.1)


def _client(env: Any) -> Any:
    from flashckpt import names
    from flashckpt.protocol.channel import AgentClient

    return AgentClient(names.socket_path(env.run_dir, env.job, env.node), timeout=10.0)


def _status(env: Any) -> dict[str, Any]:
    from agentproc import agent_status

    return agent_status(env)


class Machines:
    """The agent and rank processes of one test; all killed at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def agent(self, env: Any, *extra: str, storage: bool) -> subprocess.Popen[bytes]:
        from agentproc import start_agent

        log = self.tmp / f"agent-{env.node}-{time.monotonic_ns()}.log"
        flags = ("--poll-interval", "0.05", "--log-file", str(log), *extra)
        p = start_agent(env, *flags, idle_timeout=300, storage=None if storage else "")
        self.procs.append(p)
        return p

    def run_job(
        self, envs: list[Any], tag: str, *, steps: int, exit_after: int, storage: bool, code: int
    ) -> list[str]:
        """Runs one rank per env (rank i on envs[i]'s machine) to the end; returns stderrs."""
        init = self.tmp / f"init-{tag}"
        procs = []
        for rank, env in enumerate(envs):
            err = open(self.tmp / f"{tag}-r{rank}.stderr", "wb")  # noqa: SIM115
            cmd = [
                sys.executable,
                __file__,
                "--rank",
                str(rank),
                "--world",
                str(len(envs)),
                "--job",
                env.job,
                "--node",
                env.node,
                "--run-dir",
                env.run_dir,
                "--storage",
                env.storage if storage else "",
                "--init-file",
                str(init),
                "--steps",
                str(steps),
                "--exit-after",
                str(exit_after),
                "--report",
                str(self.tmp / f"{tag}.jsonl"),
                "--out",
                str(self.tmp / tag),
            ]
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
            self.procs.append(p)
            procs.append((p, err))
        for p, err in procs:
            try:
                p.wait(timeout=400)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
            err.close()
        errs = [(self.tmp / f"{tag}-r{r}.stderr").read_text() for r in range(len(envs))]
        for (p, _), e in zip(procs, errs, strict=True):
            assert p.returncode == code, e[-6000:]
        return errs

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)


@pytest.fixture
def three(fc_env: Any, tmp_path: Path) -> Iterator[tuple[Any, Any, Any, Machines]]:
    from fchelpers import machines

    with machines(fc_env, tmp_path, ["a", "b", "c"]) as (a, b, c):
        m = Machines(tmp_path)
        try:
            yield a, b, c, m
        finally:
            m.close()


def _listen(env: Any) -> str:
    listen = _status(env)["replication"]["listen"]
    assert listen.startswith("127.0.0.1:") and int(listen.rsplit(":", 1)[1]) > 0, listen
    return str(listen)


def _lose_b(
    a: Any, b: Any, c: Any, m: Machines, *, storage: bool
) -> tuple[subprocess.Popen[bytes], str]:
    """Trains 2 ranks on a and b (b replicating to a) to step 8, then loses machine b: its
    agent SIGKILLed, its memory gone. Returns a's agent and its replica server."""
    pa = m.agent(a, "--replica-listen", "127.0.0.1:0", storage=storage)
    addr_a = _listen(a)
    pb = m.agent(
        b, "--replica-listen", "127.0.0.1:0", "--replica-peers", f"a={addr_a}", storage=storage
    )
    m.run_job([a, b], "before", steps=20, exit_after=STEPS_BEFORE, storage=storage, code=3)

    def held() -> bool:
        rep = _status(a)["replication"]
        return any(
            (h["sender"], h["rank"], h["step"]) == ("b", 1, STEPS_BEFORE) for h in rep["held"]
        )

    _wait(held, "a to hold b's replica of step 8")
    if storage:
        from flashckpt.format.storage import Storage

        st = Storage(a.storage)
        _wait(lambda: STEPS_BEFORE in st.committed_steps(), "step 8 committed")
    pb.send_signal(signal.SIGKILL)
    pb.wait(timeout=30)
    b.remove_segments()  # the lost machine's memory is gone with it
    assert pa.poll() is None
    return pa, addr_a


def _report(tmp: Path, tag: str) -> dict[int, dict[str, Any]]:
    rows = [json.loads(x) for x in (tmp / f"{tag}.jsonl").read_text().splitlines()]
    return {int(r["rank"]): r for r in rows}


def _same_state(tmp: Path) -> None:
    import safetensors.torch
    import torch

    want = safetensors.torch.load_file(str(tmp / "before.crash.safetensors"))
    got = safetensors.torch.load_file(str(tmp / "after.restored.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_a_lost_machines_rank_restores_from_a_peer_agents_replica(
    three: tuple[Any, Any, Any, Machines], tmp_path: Path
) -> None:
    a, b, c, m = three
    _, addr_a = _lose_b(a, b, c, m, storage=False)  # memory only: no other way back
    m.agent(c, "--replica-peers", f"a={addr_a}", storage=False)
    m.run_job([a, c], "after", steps=12, exit_after=-1, storage=False, code=0)
    rep = _report(tmp_path, "after")
    assert (rep[0]["start"], rep[0]["from"]) == (STEPS_BEFORE, "memory"), rep
    assert (rep[1]["start"], rep[1]["from"]) == (STEPS_BEFORE, "peer-memory"), rep
    info = rep[1]["restore"]
    assert info["replica_holder"] == "a" and info["replica_source"] == addr_a, info
    assert info["replica_of"] == "b" and info["replica_bytes"] > 0, info
    _same_state(tmp_path)


def test_a_corrupted_replica_is_refused_with_a_warning_and_storage_serves(
    three: tuple[Any, Any, Any, Machines], tmp_path: Path
) -> None:
    from flashckpt import names
    from flashckpt.format.shm import Slot

    a, b, c, m = three
    _, addr_a = _lose_b(a, b, c, m, storage=True)
    path = names.replica_path(a.shm_dir, a.job, "a", "b", 1)
    rep = Slot(path)
    try:
        rep.data(64)[17] ^= 0x40  # a bit flips in the holder's memory
    finally:
        rep.close()
    m.agent(c, "--replica-peers", f"a={addr_a}", storage=True)
    errs = m.run_job([a, c], "after", steps=12, exit_after=-1, storage=True, code=0)
    rows = _report(tmp_path, "after")
    assert (rows[0]["start"], rows[0]["from"]) == (STEPS_BEFORE, "memory"), rows
    assert (rows[1]["start"], rows[1]["from"]) == (STEPS_BEFORE, "storage"), rows
    warned = [ln for ln in errs[1].splitlines() if "replica of step 8" in ln]
    assert warned, errs[1][-4000:]
    assert "rank 1" in warned[0] and "'a'" in warned[0] and addr_a in warned[0], warned
    assert "data hash" in warned[0] and "trying another source" in warned[0], warned
    assert not [n for n in os.listdir(c.shm_dir) if "tmp" in n]  # the refused pull left nothing
    _same_state(tmp_path)


def test_a_corrupted_replica_without_storage_starts_fresh_with_the_warning(
    three: tuple[Any, Any, Any, Machines], tmp_path: Path
) -> None:
    from flashckpt import names
    from flashckpt.format.shm import Slot

    a, b, c, m = three
    _, addr_a = _lose_b(a, b, c, m, storage=False)
    rep = Slot(names.replica_path(a.shm_dir, a.job, "a", "b", 1))
    try:
        rep.data(64)[3] ^= 0x01
    finally:
        rep.close()
    m.agent(c, "--replica-peers", f"a={addr_a}", storage=False)
    errs = m.run_job([a, c], "after", steps=2, exit_after=-1, storage=False, code=0)
    rows = _report(tmp_path, "after")
    assert [(rows[r]["start"], rows[r]["from"]) for r in (0, 1)] == [(0, None), (0, None)], rows
    warned = [ln for ln in errs[1].splitlines() if "replica of step 8" in ln]
    assert warned and "rank 1" in warned[0] and "data hash" in warned[0], errs[1][-4000:]
    assert not [n for n in os.listdir(c.shm_dir) if "tmp" in n]


def test_bad_pull_replica_requests_get_a_protocol_error_and_the_agent_serves_on(
    fc_env: Any, tmp_path: Path
) -> None:
    from fchelpers import private_shm

    from flashckpt.protocol.channel import AgentError

    with private_shm(tmp_path / "shm", "64m") as shm:
        env = dataclasses.replace(fc_env, node="a", shm_dir=shm)
        m = Machines(tmp_path)
        try:
            m.agent(env, "--replica-peers", "z=127.0.0.1:9", storage=False)
            c = _client(env)
            try:
                bad: list[dict[str, Any]] = [
                    {"rank": 0},  # no world_size
                    {"rank": -1, "world_size": 2},
                    {"rank": 2, "world_size": 2},
                    {"rank": 0, "world_size": 2, "min_step": -5},
                    {"rank": 0, "world_size": 2, "fetch": "yes"},
                    {"rank": 0, "world_size": 2, "timeout_s": 1e9},
                    {"rank": 0, "world_size": 2, "world_id": "w" * 5000},
                    {"rank": 0, "world_size": 2, "peer": "a"},  # no such field
                    {"rank": 0, "world_size": 2, "holder": 5},
                ]
                for fields in bad:
                    with pytest.raises(AgentError) as e:
                        c.request("pull_replica", timeout=30, **fields)
                    assert e.value.kind == "ProtocolError", (fields, e.value)
                # Well formed, but this connection holds no position: refused, nothing pulled.
                with pytest.raises(AgentError, match="did not say hello"):
                    c.request("pull_replica", timeout=30, rank=0, world_size=2)
                assert int(c.request("ping", timeout=30)["pid"]) > 0
                # A trainer's position, and a peer that does not answer: no replica, and why.
                c.request("hello", timeout=30, rank=0, world_size=2, local_rank=0, world_id="w")
                for fetch in (False, True):
                    got = c.request(
                        "pull_replica", timeout=60, rank=0, local_rank=0, world_size=2, fetch=fetch
                    )
                    assert got["found"] is False and got["step"] == -1, got
                    assert "rank 0 step >= 0: z: replica query to 127.0.0.1:9" in got["reason"]
                # Straight from the holder a look named: it does not answer, a clear error.
                with pytest.raises(AgentError, match=r"from 'z' \(127.0.0.1:9\) not pulled"):
                    c.request(
                        "pull_replica",
                        timeout=60,
                        rank=0,
                        local_rank=0,
                        world_size=2,
                        min_step=8,
                        holder="z",
                        sender="b",
                    )
                # Another position than the one this connection said hello for: refused.
                with pytest.raises(AgentError, match="global rank 0 here, not 1"):
                    c.request("pull_replica", timeout=30, rank=1, local_rank=0, world_size=2)
                assert not [n for n in os.listdir(shm) if "tmp" in n]
                assert int(c.request("ping", timeout=30)["pid"]) > 0
            finally:
                c.close()
        finally:
            m.close()
            env.remove_segments()


def test_a_replica_of_another_timelines_step_is_never_mixed_in() -> None:
    """Rank 0 holds step 10 from world w2 (the timeline resumed at 8 and redid it); a peer still
    holds rank 1's step 10 of world w1 (the abandoned timeline): same number, other state."""
    from flashckpt.trainer.restore.sources import world_conflict

    same = [{"mem": {"10": "w1", "8": "w1"}, "peer": None}, {"mem": {}, "peer": [10, "w1"]}]
    assert world_conflict(10, "w1", same) is None
    mixed = [{"mem": {"10": "w2"}, "peer": None}, {"mem": {}, "peer": [10, "w1"]}]
    why = world_conflict(10, "w1", mixed)
    assert why is not None and "ranks [0] hold it from world 'w2'" in why, why
    two_peers = [{"mem": {}, "peer": [10, "w2"]}, {"mem": {}, "peer": [10, "w1"]}]
    assert world_conflict(10, "w1", two_peers) is not None
    assert world_conflict(10, "w1", [{"mem": {}, "peer": [10, "w1"]}, {"peer": None}]) is not None
    assert world_conflict(8, "w1", mixed) is None  # another step: no snapshot of 8 to compare


def test_a_replica_is_not_offered_over_storages_step_of_another_world(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The ranks compare the worlds of what they hold in memory; storage's committed step of
    the same number may be another timeline's (the other ranks would read theirs from there):
    its manifest's world must be the replica's, else the replica is not offered."""
    import logging

    from flashckpt.format.storage import MANIFEST, Storage
    from flashckpt.protocol.messages import PullReplicaReply
    from flashckpt.trainer.rankctx import RankContext
    from flashckpt.trainer.restore.saved import RestoreEnv
    from flashckpt.trainer.restore.sources import ReplicaPullSource

    root = tmp_path / "storage"
    st = Storage(str(root))
    reply = PullReplicaReply(
        found=True, step=10, holder="a", source="127.0.0.1:1", sender="b", world_id="w1"
    )

    class Link:
        def alive(self) -> bool:
            return True

        def pull_replica(self, **kw: Any) -> PullReplicaReply:
            return reply

    class Snap:
        link = Link()

    def offered(manifest_world: str | None) -> list[int]:
        step_dir = Path(st.step_path(10))
        step_dir.mkdir(parents=True, exist_ok=True)
        doc = {"step": 10} | ({} if manifest_world is None else {"world_id": manifest_world})
        (step_dir / MANIFEST).write_text(json.dumps(doc))
        env = RestoreEnv.__new__(RestoreEnv)
        env.ctx, env.snap, env.mem = RankContext(), Snap(), {}  # type: ignore[assignment]
        env.storage, env.stored = st, {10}
        return ReplicaPullSource(env).offer(set(), lambda _: True)

    assert offered("w1") == [10]
    with caplog.at_level(logging.WARNING, logger="flashckpt"):
        assert offered("w2") == []
    assert "storage's committed step 10 is of world 'w2'" in caplog.text, caplog.text
    assert offered(None) == []  # a manifest without a world: storage serves the step


def test_the_trainer_rechecks_the_pulled_replicas_hash_before_loading(tmp_path: Path) -> None:
    """The agent verified the replica as it arrived; the trainer checks the slot's data hash
    again before reading a byte of it (the memory could be scribbled on in between)."""
    import threading

    from flashckpt import names
    from flashckpt.format.shm import Slot, allocate_slot_file
    from flashckpt.protocol.messages import PullReplicaReply
    from flashckpt.trainer.rankctx import RankContext
    from flashckpt.trainer.restore.saved import RestoreEnv, RestorePlan
    from flashckpt.trainer.restore.sources import ReplicaPullSource
    from flashckpt.trainer.snapshot import BadMemory, Snapshotter

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    path = names.slot_path(str(shm), "j", "c", 0, 0)
    meta, data = b'{"not": "a snapshot description"}', os.urandom(50_000)
    allocate_slot_file(path, len(meta), len(data))
    slot = Slot(path)
    seq = slot.begin_write()
    slot.write_meta(meta)
    slot.data(len(data))[:] = data
    slot.end_write(seq, 8, meta, len(data))
    info = slot.header()
    assert info is not None
    slot.record_hash(info.seq, slot.data_hash(info))
    reply = PullReplicaReply(
        found=True,
        step=8,
        holder="a",
        source="127.0.0.1:1",
        sender="b",
        bytes=len(data),
        path=path,
        slot=0,
    )

    class Link:
        def alive(self) -> bool:
            return True

        def hash_now(self) -> None:
            pass

        def pull_replica(self, **kw: Any) -> PullReplicaReply:
            return reply

    class Snap:
        map = Snapshotter.map
        verify = Snapshotter.verify

        def __init__(self) -> None:
            self.slots: list[Any] = [None, None]
            self.slot_lock = threading.Lock()
            self.link = Link()
            self.ctx = RankContext()

    env = RestoreEnv.__new__(RestoreEnv)
    env.ctx, env.snap, env.mem = RankContext(), Snap(), {}  # type: ignore[assignment]
    env.storage, env.stored = None, set()
    src = ReplicaPullSource(env)
    assert src.offer(set(), lambda _: True) == [8]
    plan = RestorePlan(8, {0: "peer-memory"}, tier=3)
    src.prepare(plan)
    assert env.snap.slots[0] is not None and env.snap.slots[0].slot.path == path
    slot.data(len(data))[123] ^= 0x10  # scribbled after the agent verified it
    with pytest.raises(BadMemory) as e:
        src.read(plan)
    msg = str(e.value)
    assert "rank 0" in msg and "step 8" in msg and "'a' (127.0.0.1:1)" in msg, msg
    assert "fails its data hash" in msg, msg
    slot.data(len(data))[123] ^= 0x10  # as it was: the hash holds, the description does not
    with pytest.raises(BadMemory, match=r"description .* is unreadable"):
        src.read(plan)
    src.drop(8)
    assert src.offer(set(), lambda _: True) == []  # a dropped step is not offered again
    slot.close()


def test_the_restart_line_names_peer_memory() -> None:
    from flashckpt.elastic.launch.restore_report import format_restore_line

    line = format_restore_line(
        2,
        [
            {"rank": 0, "resume_step": 8, "restored_from": "memory", "restore_s": 0.5},
            {"rank": 1, "resume_step": 8, "restored_from": "peer-memory", "restore_s": 0.7},
        ],
    )
    assert "rank 1 restored step 8 from peer-memory" in line, line
    assert "another machine's replica" in line, line


def _main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--job", "--node", "--run-dir", "--init-file", "--report", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--storage", default="")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--exit-after", type=int, default=-1)
    return worker(p.parse_args())


if __name__ == "__main__":
    sys.exit(_main())

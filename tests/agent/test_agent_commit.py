"""The committing node agent: a step whose parts never all arrive (a machine died) does not hold
up newer steps, and parts of another world (rendezvous round) are never mixed into a manifest."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from fchelpers import FcEnv, RunningAgent

from flashckpt.agent.daemon import AgentConfig, NodeAgent
from flashckpt.format.storage import Storage


def _part(node: str, step: int, world_id: str, rank: int, world: int = 2) -> dict[str, Any]:
    # The records tell the node that wrote them by their size (node "n<k>": k bytes).
    rec = {"size": int(node[1:]), "xxh3_64": "0" * 16}
    files: dict[str, Any] = {f"rank-{rank:05d}-of-{world:05d}.json": rec}
    shards: dict[str, Any] = {}
    if rank == 0:
        files["shard-00000-of-00001.safetensors"] = rec
        shards["0"] = {"file": "shard-00000-of-00001.safetensors", "writer": rank}
    return {
        "node": node,
        "step": step,
        "world_id": world_id,
        "world_size": world,
        "num_shards": 1,
        "ranks": {str(rank): {"file": f"rank-{rank:05d}-of-{world:05d}.json", "shard": 0}},
        "shards": shards,
        "files": files,
    }


def _agent(fc_env: FcEnv, **over: Any) -> NodeAgent:
    cfg = AgentConfig(
        job=fc_env.job, node="n0", storage=fc_env.storage, run_dir=fc_env.run_dir, **over
    )
    return NodeAgent(cfg)


def _wait_for(agent: NodeAgent, step: int) -> None:
    agent.committer.commits[step] = (2, 1, "w1", time.monotonic() + 60)


def test_a_step_missing_a_part_does_not_hold_up_newer_steps(fc_env: FcEnv) -> None:
    agent = _agent(fc_env)
    st = Storage(fc_env.storage)
    # Step 5: the other machine died before writing its part.
    st.write_part(5, "n0", _part("n0", 5, "w1", 0))
    _wait_for(agent, 5)
    agent.committer.commit_round()
    assert st.committed_steps() == []
    assert agent.committer.commits.keys() == {5}
    # Step 10 of the same world: every part is in; it commits, and the older step is dropped.
    st.write_part(10, "n0", _part("n0", 10, "w1", 0))
    st.write_part(10, "n1", _part("n1", 10, "w1", 1))
    _wait_for(agent, 10)
    agent.committer.commit_round()
    assert st.committed_steps() == [10]
    agent.committer.commit_round()
    assert agent.committer.commits == {}, "step 5 must be dropped once a newer step is committed"
    assert agent.status()["committing"] == []


def test_a_step_whose_parts_never_arrive_is_reported_after_the_timeout(fc_env: FcEnv) -> None:
    agent = _agent(fc_env, commit_timeout=0.01)
    st = Storage(fc_env.storage)
    st.write_part(5, "n0", _part("n0", 5, "w1", 0))
    agent.committer.commits[5] = (2, 1, "w1", time.monotonic() - 1)
    agent.committer.commit_round()
    assert agent.committer.commits == {}
    errors = agent.status()["errors"]
    assert errors and errors[-1]["step"] == 5 and "[1]" in errors[-1]["error"], errors
    assert st.committed_steps() == []


def test_parts_of_another_world_are_never_mixed_in(fc_env: FcEnv) -> None:
    agent = _agent(fc_env)
    st = Storage(fc_env.storage)
    # World w0 reached step 15 on machine n2 (now dead) and wrote its part for rank 1.
    st.write_part(15, "n2", _part("n2", 15, "w0", 1))
    # World w1 reaches step 15 again: rank 0 here, rank 1 on n1 has not written yet.
    st.write_part(15, "n0", _part("n0", 15, "w1", 0))
    _wait_for(agent, 15)
    agent.committer.commit_round()
    assert st.committed_steps() == [], "the stale part of world w0 completed the step"
    st.write_part(15, "n1", _part("n1", 15, "w1", 1))
    agent.committer.commit_round()
    assert st.committed_steps() == [15]
    manifest = json.loads(st.fs.cat_file(st.step_path(15, "manifest.json")))
    assert manifest["nodes"] == ["n0", "n1"]
    assert manifest["files"]["rank-00001-of-00002.json"]["size"] == 1, "not n1's record"


def test_an_auto_started_agent_nobody_uses_leaves(fc_env: FcEnv) -> None:
    """An agent a trainer started while another agent was still answering (it waited for the
    lock) must not linger when no trainer ever connects and it holds no snapshots."""
    import os
    import threading

    agent = _agent(fc_env, exit_when_done=True, unused_timeout=0.3)
    agent.start()
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(agent.run()), daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the unused agent did not leave"
    assert out == [0]
    assert not os.path.exists(agent.socket_path)
    assert not os.path.exists(agent.owner_path)


def test_an_agent_removes_partial_steps_left_behind_at_start(fc_env: FcEnv) -> None:
    """Partial steps older than the newest committed one (an earlier agent died mid-persist, or
    the disk was full) go when an agent starts, not only at its first commit; newer ones (maybe
    in flight on another machine) stay."""
    from stephelpers import write_step

    st = Storage(fc_env.storage)
    st.commit(1, write_step(st, 1))
    write_step(st, 2)
    st.commit(3, write_step(st, 3))
    write_step(st, 4)
    agent = RunningAgent(fc_env.agent_config())
    try:
        assert st.all_step_dirs() == [1, 3, 4]
        assert st.committed_steps() == [1, 3]
    finally:
        agent.stop()


def test_a_part_naming_a_file_outside_the_format_is_never_committed(fc_env: FcEnv) -> None:
    """A part (from another node's agent, or planted) that names a file outside the step
    directory: the commit is refused and reported, nothing readers would reject is committed."""
    agent = _agent(fc_env)
    st = Storage(fc_env.storage)
    st.write_part(20, "n0", _part("n0", 20, "w1", 0))
    evil = _part("n1", 20, "w1", 1)
    evil["files"]["../../elsewhere/evil.json"] = evil["files"].pop("rank-00001-of-00002.json")
    evil["ranks"]["1"]["file"] = "../../elsewhere/evil.json"
    st.write_part(20, "n1", evil)
    agent.committer.commits[20] = (2, 1, "w1", time.monotonic() + 60)
    agent.committer.commit_round()
    assert st.committed_steps() == []
    errors = agent.status()["errors"]
    assert errors and "format says" in errors[-1]["error"], errors


def test_a_fifo_among_the_parts_does_not_hang_the_commit(fc_env: FcEnv) -> None:
    import os
    import threading

    agent = _agent(fc_env)
    st = Storage(fc_env.storage)
    st.write_part(25, "n0", _part("n0", 25, "w1", 0))
    st.write_part(25, "n1", _part("n1", 25, "w1", 1))
    os.mkfifo(fc_env.storage_path / "step-000000025" / "_parts" / "n9.json")
    (fc_env.storage_path / "step-000000025" / "_parts" / "n8.json").write_text("{half")
    agent.committer.commits[25] = (2, 1, "w1", time.monotonic() + 60)
    t = threading.Thread(target=agent.committer.commit_round, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the commit hung on a FIFO in _parts"
    assert st.committed_steps() == [25]


def test_a_malformed_part_of_this_world_is_refused_naming_the_field(fc_env: FcEnv) -> None:
    agent = _agent(fc_env)
    st = Storage(fc_env.storage)
    st.write_part(30, "n0", _part("n0", 30, "w1", 0))
    bad = _part("n1", 30, "w1", 1)
    bad["ranks"]["1"]["shard"] = "zero"
    st.write_part(30, "n1", bad)
    agent.committer.commits[30] = (2, 1, "w1", time.monotonic() + 60)
    agent.committer.commit_round()
    assert st.committed_steps() == []
    errors = agent.status()["errors"]
    assert errors and "node part field 'ranks'" in errors[-1]["error"], errors
    assert "'n1'" in errors[-1]["error"], errors


def test_flush_on_the_committing_node_waits_for_the_rewrite_of_a_hidden_step(
    fc_env: FcEnv,
) -> None:
    """A restored message set the timeline back to step 3 (a relinked resumed run) while step 5
    was committed: this node (it hosts rank 0) rewrites step 5. Flush must not answer from the
    old manifest, and the rewrite's commit must write the manifest again (it once took the step
    flush had seen for committed already, and storage ended older than what flush answered)."""
    from flashckpt.agent.state import RankRecord
    from flashckpt.protocol.messages import ErrorReply, FlushReply, Restored

    agent = _agent(fc_env, commit_timeout=60.0)
    st = Storage(fc_env.storage)
    for step in (3, 5):
        st.write_part(step, "n0", _part("n0", step, "w1", 0, world=1))
        agent.committer.commits[step] = (1, 1, "w1", time.monotonic() + 60)
        agent.committer.commit_round()
    assert st.committed_steps() == [3, 5]
    agent.st.world_id = "w1"
    agent.st.ranks[0] = RankRecord(0, global_rank=0, world_id="w1", world_size=1)
    # From the connection of the trainer that said hello for local rank 0 (the only one the
    # agent takes a timeline from).
    trainer = SimpleNamespace(ranks={0})
    agent.server.handle(trainer, Restored(step=3))  # type: ignore[arg-type]
    # The persister hides step 5 to rewrite it; a flush comes in meanwhile (or just before).
    reply = agent.server.flush(5, 0.6)
    assert isinstance(reply, ErrorReply), f"flush answered {reply} from the old manifest"
    st.uncommit(5)
    agent.committer.commits[5] = (1, 1, "w1", time.monotonic() + 60)
    agent.committer.commit_round()
    assert st.committed_steps() == [3, 5], "the rewritten step 5 was never committed again"
    assert agent.server.flush(5, 5.0) == FlushReply(committed=5)


# -- latest never moves backwards: a machine cut off from the job (issue 11, partition) -----------


def _commit_as(agent: NodeAgent, step: int, world_id: str, nodes: tuple[str, ...] = ("n0", "n1")):
    """Writes every part of ``step`` for ``world_id`` and lets the agent commit it."""
    st = Storage(agent.st.cfg.storage or "")
    for rank, node in enumerate(nodes):
        st.write_part(step, node, _part(node, step, world_id, rank, world=len(nodes)))
    agent.committer.enqueue(step, len(nodes), 1, world_id)
    agent.committer.commit_round()


def _other_world_commits(fc_env: FcEnv, step: int, world_id: str) -> None:
    """Another machine's agent (the new world's rank-0 host) commits ``step``."""
    other = NodeAgent(
        AgentConfig(job=fc_env.job, node="n2", storage=fc_env.storage, run_dir=fc_env.run_dir)
    )
    _commit_as(other, step, world_id, nodes=("n2", "n1"))


def test_a_commit_refuses_a_step_older_than_another_worlds_newer_commit(fc_env: FcEnv) -> None:
    agent = _agent(fc_env)
    st = Storage(fc_env.storage)
    _commit_as(agent, 20, "w1")
    assert st.committed_steps() == [20]
    # This machine was cut off; a new world (w2, the survivor and a standby) committed step 24.
    _other_world_commits(fc_env, 24, "w2")
    assert st.committed_steps() == [20, 24]
    # The cut-off machine's old world completes step 22 (the survivor had written its part).
    _commit_as(agent, 22, "w1")
    assert st.committed_steps() == [20, 24], "a step of the abandoned world was committed"
    assert json.loads(st.fs.cat_file(st.path("latest")))["step"] == 24
    errors = agent.status()["errors"]
    assert errors and errors[-1]["step"] == 22, errors
    assert "another world ('w2')" in errors[-1]["error"], errors
    assert "step 24" in errors[-1]["error"], errors


def test_a_commit_refuses_a_step_another_world_committed_already(fc_env: FcEnv) -> None:
    agent = _agent(fc_env)
    st = Storage(fc_env.storage)
    _commit_as(agent, 20, "w1")
    # The new world restored step 20 and committed its own step 22 first.
    _other_world_commits(fc_env, 22, "w2")
    before = st.fs.cat_file(st.step_path(22, "manifest.json"))
    _commit_as(agent, 22, "w1")
    assert st.fs.cat_file(st.step_path(22, "manifest.json")) == before, "manifest overwritten"
    assert json.loads(before)["world_id"] == "w2"
    errors = agent.status()["errors"]
    assert errors and "already committed by another world ('w2')" in errors[-1]["error"], errors


def test_steps_committed_before_this_world_began_do_not_block_it(fc_env: FcEnv) -> None:
    # An older run (or an abandoned timeline the persister rewrites) left step 100 committed.
    _other_world_commits(fc_env, 100, "w0")
    agent = _agent(fc_env)
    _commit_as(agent, 10, "w1")
    assert Storage(fc_env.storage).committed_steps() == [10, 100]
    assert agent.status()["errors"] == []


def test_an_older_step_of_the_same_world_is_dropped_quietly(fc_env: FcEnv) -> None:
    agent = _agent(fc_env)
    st = Storage(fc_env.storage)
    _commit_as(agent, 10, "w1")
    # Step 5's parts arrive late (a slow persist): step 10 of the same world is committed.
    _commit_as(agent, 5, "w1")
    assert st.committed_steps() == [10], "a step older than the newest one was committed"
    assert agent.committer.commits == {}
    assert agent.status()["errors"] == [], "a superseded step of this world is no error"


def test_a_fenced_agent_commits_nothing_until_a_new_world_says_hello(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    from flashckpt.errors import AgentError
    from flashckpt.protocol.channel import AgentClient
    from flashckpt.protocol.messages import Fence, OkReply

    a = agent.agent
    st = Storage(fc_env.storage)
    hello = {"rank": 0, "world_size": 2, "local_rank": 0, "storage": fc_env.storage}
    c = AgentClient(a.socket_path)
    try:
        c.request("hello", world_id="w1", **hello)
        assert a.st.world_id == "w1"
        st.write_part(7, "n0", _part("n0", 7, "w1", 0))
        _wait_for(a, 7)
        assert c.call(Fence(reason="lease lapsing", timeout_s=5)) == OkReply()
        assert a.committer.fenced == "lease lapsing" and a.committer.fenced_world == "w1"
        assert a.st.world_id is None, "the fenced world's snapshots would still be persisted"
        # Step 7's last part arrives: nothing is committed, nothing can be queued.
        st.write_part(7, "n1", _part("n1", 7, "w1", 1))
        a.committer.commit_round()
        a.committer.enqueue(7, 2, 1, "w1")
        a.committer.commit_round()
        assert st.committed_steps() == [] and a.committer.commits == {}
        # A trainer of the fenced world (restarted, or late) is refused.
        with pytest.raises(AgentError, match="fenced"):
            c.request("hello", world_id="w1", **hello)
        assert a.committer.fenced is not None
        # A trainer of a new world lifts the fence: its steps commit again.
        c.request("hello", world_id="w3", **hello)
        assert a.committer.fenced is None and a.st.world_id == "w3"
        _commit_as(a, 9, "w3")
        assert st.committed_steps() == [9]
    finally:
        c.close()


def test_a_bad_fence_request_is_refused_and_the_agent_serves_on(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    from flashckpt.errors import AgentError, ProtocolError
    from flashckpt.protocol.channel import AgentClient
    from flashckpt.protocol.messages import Fence, parse_request

    for bad, why in (
        ({"op": "fence", "timeout_s": "soon"}, "field 'timeout_s'"),
        ({"op": "fence", "timeout_s": -1}, "outside 0..600"),
        ({"op": "fence", "reason": "x" * 5000}, "longer than 4096"),
        ({"op": "fence", "world": "w1"}, "unknown field"),
    ):
        with pytest.raises(ProtocolError, match=why):
            parse_request(bad)
    assert isinstance(parse_request({"id": 1, "op": "fence"}).body, Fence)
    c = AgentClient(agent.agent.socket_path)
    try:
        with pytest.raises(AgentError, match=r"outside 0\.\.600") as ei:
            c.request("fence", timeout_s=1e9)
        assert ei.value.kind == "ProtocolError"
        assert agent.agent.committer.fenced is None, "a refused request fenced the agent"
        assert c.request("ping")["pid"] > 0
    finally:
        c.close()


def test_a_late_step_of_an_older_world_is_checked_against_that_world(fc_env: FcEnv) -> None:
    agent = _agent(fc_env)
    st = Storage(fc_env.storage)
    _commit_as(agent, 20, "w1")
    # World w2 begins on this agent too (a membership change) and commits step 24.
    _commit_as(agent, 24, "w2")
    # A late step 22 of w1 (its last part arrives now) must not take w2's commit as "before".
    _commit_as(agent, 22, "w1")
    assert st.committed_steps() == [20, 24]


def test_the_commit_is_announced_before_retention_deletes_old_steps(fc_env: FcEnv) -> None:
    """Retention (deleting a GB-sized step takes a while) runs after the commit is known: a
    flush waiting for the step returns at once, and the steps retention removed leave the
    agent's list afterwards."""
    agent = _agent(fc_env, keep=1)
    st = Storage(fc_env.storage)
    seen: list[list[int]] = []
    retain = st.retain
    agent_storage = agent.st.storage
    assert agent_storage is not None

    def spy(keep: int, hold: frozenset[int] = frozenset()) -> list[int]:
        seen.append(list(agent.st.committed))  # what a flush sees while retention runs
        return retain(keep, hold)

    agent_storage.retain = spy  # type: ignore[method-assign]
    for step in (5, 10):
        st.write_part(step, "n0", _part("n0", step, "w1", 0))
        st.write_part(step, "n1", _part("n1", step, "w1", 1))
        _wait_for(agent, step)
        agent.committer.commit_round()
    assert seen == [[5], [5, 10]]  # step 10 was known committed before step 5 was deleted
    assert agent.st.committed == [10] and st.committed_steps() == [10]

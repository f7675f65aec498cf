"""The committing node agent: a step whose parts never all arrive (a machine died) does not hold
up newer steps, and parts of another world (rendezvous round) are never mixed into a manifest."""

from __future__ import annotations

import json
import time
from typing import Any

from fchelpers import FcEnv, RunningAgent

from flashckpt.agent import AgentConfig, NodeAgent
from flashckpt.storage import Storage


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
    agent._commits[step] = (2, 1, "w1", time.monotonic() + 60)


def test_a_step_missing_a_part_does_not_hold_up_newer_steps(fc_env: FcEnv) -> None:
    agent = _agent(fc_env)
    st = Storage(fc_env.storage)
    # Step 5: the other machine died before writing its part.
    st.write_part(5, "n0", _part("n0", 5, "w1", 0))
    _wait_for(agent, 5)
    agent._commit_round()
    assert st.committed_steps() == []
    assert agent._commits.keys() == {5}
    # Step 10 of the same world: every part is in; it commits, and the older step is dropped.
    st.write_part(10, "n0", _part("n0", 10, "w1", 0))
    st.write_part(10, "n1", _part("n1", 10, "w1", 1))
    _wait_for(agent, 10)
    agent._commit_round()
    assert st.committed_steps() == [10]
    agent._commit_round()
    assert agent._commits == {}, "step 5 must be dropped once a newer step is committed"
    assert agent.status()["committing"] == []


def test_a_step_whose_parts_never_arrive_is_reported_after_the_timeout(fc_env: FcEnv) -> None:
    agent = _agent(fc_env, commit_timeout=0.01)
    st = Storage(fc_env.storage)
    st.write_part(5, "n0", _part("n0", 5, "w1", 0))
    agent._commits[5] = (2, 1, "w1", time.monotonic() - 1)
    agent._commit_round()
    assert agent._commits == {}
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
    agent._commit_round()
    assert st.committed_steps() == [], "the stale part of world w0 completed the step"
    st.write_part(15, "n1", _part("n1", 15, "w1", 1))
    agent._commit_round()
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
    agent._commits[20] = (2, 1, "w1", time.monotonic() + 60)
    agent._commit_round()
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
    agent._commits[25] = (2, 1, "w1", time.monotonic() + 60)
    t = threading.Thread(target=agent._commit_round, daemon=True)
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
    agent._commits[30] = (2, 1, "w1", time.monotonic() + 60)
    agent._commit_round()
    assert st.committed_steps() == []
    errors = agent.status()["errors"]
    assert errors and "node part field 'ranks'" in errors[-1]["error"], errors
    assert "'n1'" in errors[-1]["error"], errors

"""A committed step the agent hides (uncommits) to rewrite it is never left lost: when the rewrite
is abandoned (the trainer wants the slot, the snapshot changed), it is tried again until the
step is committed again."""

from __future__ import annotations

from fchelpers import FcEnv, RunningAgent
from tinytrain import make, persisted_steps
from waiting import wait_until

import flashckpt
from flashckpt.format.storage import Storage
from flashckpt.protocol.channel import AgentClient


def test_a_hidden_step_whose_rewrite_yields_is_committed_again(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    a = agent.agent
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(persist_every=1)  # the rewrite of a step the trainer marked
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        persisted_steps(ck, model, opt, sched, 0, 2)
        st = Storage(fc_env.storage)
        assert st.committed_steps() == [1, 2]
        writes = sum(a.status()["shard_writes"].values())
        with a.st.lock:
            slots = [s for r in a.st.ranks.values() for s in r.slots if s is not None]
        held = [s for s in slots if (h := s.header()) is not None and h.complete and h.step == 2]
        assert len(held) == 1
        # The trainer wants the slot (as while it waits to write its next snapshot): the agent
        # yields to it twice before it writes anyway.
        held[0].want(True)
        try:
            c = AgentClient(a.socket_path)
            try:
                # A relinked resumed run (it says hello for its position first, as a trainer
                # does) says its timeline began at 1: step 2 is rewritten.
                world = a.st.world_id
                c.request("hello", rank=0, world_size=1, local_rank=0, world_id=world, timeout=10)
                c.request("restored", step=1, timeout=10)
            finally:
                c.close()
            # Step 2 rewritten, and committed (it was hidden, left uncommitted).
            wait_until(
                lambda: (
                    sum(a.status()["shard_writes"].values()) > writes
                    and st.committed_steps() == [1, 2]
                ),
                "step 2 rewritten and committed",
                120,
                0.1,
                state=lambda: (
                    f"shard writes {a.status()['shard_writes']} (were {writes}), "
                    f"committed {st.committed_steps()}"
                ),
            )
            assert st.check_step(2).status == "ok", st.check_step(2)
        finally:
            held[0].want(False)

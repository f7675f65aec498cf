"""The typed agent protocol: the JSON on the wire is what the trainer sends today (bare dicts
still accepted), and whatever else arrives on the socket gets a clear error reply naming the
problem, never a crash nor a silently ignored field."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import pytest
from fchelpers import FcEnv, RunningAgent

from flashckpt.errors import AgentError, ProtocolError
from flashckpt.protocol.channel import AgentClient
from flashckpt.protocol.messages import (
    REQUESTS,
    Alloc,
    Committed,
    ErrorReply,
    Flush,
    Hello,
    HelloReply,
    PersistErrorEvent,
    Ping,
    PingReply,
    Snap,
    StatusReply,
    parse_event,
    parse_reply,
    parse_request,
)

# What the trainer side sends today (flashckpt/trainer/checkpointer.py and the tools), field for
# field.
WIRE: list[dict[str, Any]] = [
    {
        "id": 1,
        "op": "hello",
        "rank": 1,
        "local_rank": 1,
        "world_id": "h:29500/2",
        "world_size": 2,
        "local_world_size": 2,
        "shard": 1,
        "num_shards": 2,
        "replica": 0,
        "storage": "file:///tmp/x",
        "pid": 1234,
    },
    {"id": 2, "op": "alloc", "rank": 1, "local_rank": 1, "meta_cap": 4096, "data_cap": 1 << 20},
    {"id": 3, "op": "alloc", "rank": 1, "local_rank": 1, "meta_cap": 1, "data_cap": 2, "keep": [0]},
    {
        "id": 3,
        "op": "alloc",
        "rank": 1,
        "local_rank": 1,
        "meta_cap": 1,
        "data_cap": 2,
        "check_only": True,
    },
    {"op": "snap", "rank": 1, "local_rank": 1, "step": 7},
    {"id": 4, "op": "hash", "rank": 1, "local_rank": 1},
    {"id": 5, "op": "restored", "step": -1},
    {"id": 6, "op": "flush", "step": 7, "timeout_s": 300.0},
    {"id": 7, "op": "done", "rank": 1, "local_rank": 1},
    {"id": 8, "op": "status"},
    {"id": 9, "op": "ping"},
    {"id": 10, "op": "done", "rank": 0},  # an older client: the rank alone keys the position
    # takeover (issue 41): False takes the root only where no other job owns it, atomically;
    # a client that sends none gets True (the rewrite it always asked for)
    {"id": 11, "op": "claim_storage", "delete_steps": False, "takeover": False},
]


@pytest.mark.parametrize("doc", WIRE, ids=lambda d: str(d["op"]))
def test_the_wire_format_is_unchanged(doc: dict[str, Any]) -> None:
    env = parse_request(doc)
    assert type(env.body) is REQUESTS[doc["op"]] and env.rid == doc.get("id")
    extra_identity = {"hash"}  # sent with the position; the agent hashes every one
    want = {k: v for k, v in doc.items() if not (doc["op"] in extra_identity and "rank" in k)}
    assert env.body.to_json(env.rid) == want


def test_replies_and_events_keep_their_json() -> None:
    hello = {"id": 1, "ok": True, "slots": [None, "/dev/shm/x"], "pid": 5, "committed": [3]}
    hello |= {"shm_dir": "/dev/shm", "auto_started": False}
    rep = parse_reply("hello", hello)
    assert isinstance(rep, HelloReply) and rep.to_json(1) == hello
    # To a trainer without storage=: the agent's own root, its steps and whose it is.
    own = hello | {"storage": "file:///r", "storage_steps": [3], "storage_foreign": "job 'a'"}
    rep = parse_reply("hello", own)
    assert isinstance(rep, HelloReply) and rep.to_json(1) == own
    assert rep.storage_steps == [3] and rep.storage_foreign == "job 'a'"
    err = {"id": 2, "ok": False, "error": "no", "kind": "ShmSpaceError"}
    assert parse_reply("alloc", err).to_json(2) == err
    assert ErrorReply(error="x").to_json(3) == {"id": 3, "ok": False, "error": "x"}
    assert StatusReply(status={"job": "j"}).to_json(4) == {"id": 4, "ok": True, "job": "j"}
    assert Committed(step=5).to_json() == {"event": "committed", "step": 5}
    pe = {"event": "persist_error", "step": None, "error": "disk full"}
    assert PersistErrorEvent(step=None, error="disk full").to_json() == pe
    assert parse_event(pe) == PersistErrorEvent(step=None, error="disk full")
    with pytest.raises(ProtocolError, match="unknown event"):
        parse_event({"event": "boom"})


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"op": "nope"}, "unknown request 'nope'"),
        ({"id": 1}, "unknown request None"),
        ({"op": "hello", "rank": 0}, "missing field 'world_size'"),
        ({"op": "hello", "rank": 0, "world_size": 1, "evil": 1}, "unknown field(s) ['evil']"),
        ({"op": "hello", "rank": "0", "world_size": 1}, "field 'rank' is '0', not int"),
        ({"op": "hello", "rank": True, "world_size": 1}, "field 'rank' is True"),
        ({"op": "hello", "rank": 3, "world_size": 2}, "outside the world of 2"),
        ({"op": "hello", "rank": 0, "world_size": 1, "storage": 5}, "field 'storage'"),
        ({"op": "alloc", "rank": 0, "meta_cap": 1}, "missing field 'data_cap'"),
        ({"op": "alloc", "rank": 0, "meta_cap": 1, "data_cap": 1 << 60}, "slot sizes"),
        ({"op": "alloc", "rank": 0, "meta_cap": 1, "data_cap": 1, "keep": [2]}, "keep=[2]"),
        ({"op": "alloc", "rank": 0, "meta_cap": 1, "data_cap": 1, "keep": "0"}, "field 'keep'"),
        ({"op": "flush", "step": 1, "timeout_s": "soon"}, "field 'timeout_s'"),
        ({"op": "flush", "step": 1, "timeout_s": 1e12}, "timeout_s=1000000000000.0 is outside"),
        ({"op": "restored", "step": -2}, "step=-2 is outside"),
        ({"op": "snap", "rank": 0, "step": 1.5}, "field 'step' is 1.5, not int"),
        ({"op": "done", "rank": 0, "local_rank": 99999}, "local rank=99999 is outside"),
        ({"op": "ping", "id": [1]}, "invalid id"),
        ({"op": "ping", "id": -1}, "id -1 is outside"),
    ],
)
def test_bad_requests_are_refused_naming_the_problem(doc: dict[str, Any], says: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        parse_request(doc)
    assert says in str(ei.value)


def test_from_json_on_the_classes() -> None:
    from flashckpt.protocol.messages import Event, Reply, Request

    assert Request.from_json({"op": "ping"}) == Ping()
    assert Flush.from_json({"op": "flush", "step": 2}) == Flush(step=2)
    with pytest.raises(ProtocolError, match="not a Flush request"):
        Flush.from_json({"op": "ping"})
    assert Reply.from_json("ping", {"ok": True, "pid": 3}) == PingReply(pid=3)
    assert Event.from_json({"event": "committed", "step": 4}) == Committed(step=4)


def test_typed_construction_checks_too() -> None:
    with pytest.raises(ProtocolError, match="outside this machine's 2 ranks"):
        Hello(rank=0, world_size=4, local_rank=2, local_world_size=2)
    assert Alloc(rank=0, meta_cap=1, data_cap=2).key == 0
    assert Snap(rank=4, local_rank=1, step=3).key == 1
    assert Flush(step=3).to_json(9) == {"id": 9, "op": "flush", "step": 3, "timeout_s": 300.0}


def _raw(path: str, lines: list[bytes]) -> list[dict[str, Any]]:
    """Sends raw lines on one connection; returns the replies (read until 'ping' answers)."""
    out = []
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(60)
        s.connect(path)
        s.sendall(b"".join(lines) + json.dumps({"id": 999, "op": "ping"}).encode() + b"\n")
        buf = b""
        while True:
            chunk = s.recv(1 << 16)
            assert chunk, f"the agent hung up; replies so far: {out}"
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if msg.get("id") == 999:
                    return out
                out.append(msg)


def test_a_live_agent_answers_bad_messages_with_errors_and_keeps_serving(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    bad = [
        {"id": 1, "op": "launch_missiles"},
        {"id": 2, "op": "hello", "rank": 0},
        {"id": 3, "op": "hello", "rank": 0, "world_size": 1, "extra": 1},
        {"id": 4, "op": "flush", "step": "7"},
        {"id": "x5", "op": "alloc", "rank": 0, "meta_cap": -1, "data_cap": 0},
        {"op": "snap", "rank": 0, "step": "bad"},  # one-way: nothing comes back
        {"id": 6, "op": "done"},
    ]
    lines = [json.dumps(d).encode() + b"\n" for d in bad]
    replies = _raw(agent.agent.socket_path, lines)
    assert [r["id"] for r in replies] == [1, 2, 3, 4, "x5", 6]
    for r in replies:
        assert r["ok"] is False and r["kind"] == "ProtocolError", r
    assert "unknown request 'launch_missiles'" in replies[0]["error"]
    assert "missing field 'world_size'" in replies[1]["error"]
    assert "'extra'" in replies[2]["error"]
    assert "field 'step'" in replies[3]["error"]
    assert "missing field 'rank'" in replies[5]["error"]
    # Nothing of it took a position or changed state; the agent still serves typed clients.
    client = AgentClient(agent.agent.socket_path)
    try:
        rep = client.call(Ping())
        assert isinstance(rep, PingReply) and rep.pid > 0
        with pytest.raises(AgentError, match="missing field 'world_size'") as ei:
            client.request("hello", rank=0)
        assert ei.value.kind == "ProtocolError"
        status = client.call(parse_request({"op": "status"}).body)
        assert isinstance(status, StatusReply) and status.status["ranks"] == {}
    finally:
        client.close()


def test_the_agent_replies_parse_as_the_typed_replies(fc_env: FcEnv, agent: RunningAgent) -> None:
    """The reply classes are what a real agent sends: a hello, an alloc, a flush and a status
    through AgentClient.call parse (a field renamed on either side would fail here)."""
    from flashckpt.protocol.messages import Alloc, AllocReply, Done, OkReply, Restored, Status

    client = AgentClient(agent.agent.socket_path)
    try:
        hello = client.call(Hello(rank=0, world_size=1, local_rank=0, world_id="w"))
        assert isinstance(hello, HelloReply) and hello.slots == [None, None]
        assert hello.pid > 0 and hello.shm_dir == fc_env.shm_dir and hello.auto_started is False
        alloc = client.call(Alloc(rank=0, local_rank=0, meta_cap=4096, data_cap=4096))
        assert isinstance(alloc, AllocReply) and len(alloc.slots) == 2
        assert all(os.path.basename(p).startswith(f"fc.{fc_env.job}.") for p in alloc.slots)
        assert client.call(Restored(step=-1)) == OkReply()
        status = client.call(Status())
        assert isinstance(status, StatusReply) and status.status["ranks"]["0"]["rank"] == 0
        with pytest.raises(AgentError, match="not committed within"):
            client.call(Flush(step=1, timeout_s=0.2))
        assert client.call(Done(rank=0, local_rank=0)) == OkReply()
    finally:
        client.close()


def test_the_client_drops_malformed_events(tmp_path: Any) -> None:
    """Events are checked where they arrive: the trainer's handler sees only well-formed ones."""
    import threading

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    path = str(run_dir / "fake.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    got: list[dict[str, Any]] = []
    seen = threading.Event()

    def on_event(msg: dict[str, Any]) -> None:
        got.append(msg)
        if msg.get("step") == 9:
            seen.set()

    client = AgentClient(path, on_event=on_event)
    conn, _ = srv.accept()
    try:
        for ev in (
            {"event": "committed", "step": "7"},  # ill-typed
            {"event": "launch", "step": 1},  # unknown
            {"event": "persist_error", "error": "x"},  # missing step
            {"event": "committed", "step": 9},
        ):
            conn.sendall(json.dumps(ev).encode() + b"\n")
        assert seen.wait(30), got
        assert got == [{"event": "committed", "step": 9}]
    finally:
        client.close()
        conn.close()
        srv.close()


def test_a_failed_send_marks_the_connection_lost_at_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A send that fails (the agent went away, e.g. one exiting while a trainer says hello) marks
    the client disconnected before its reader sees the end of the stream, so the trainer's hello
    connects again instead of failing (fresh-ci saw the hello fail with a broken pipe)."""
    from flashckpt.protocol import channel as protocol

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    path = str(run_dir / "fake.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    client = AgentClient(path)
    conn, _ = srv.accept()  # kept open: the reader thread sees no end of stream
    try:
        assert client.connected

        def broken(*_: Any) -> None:
            raise BrokenPipeError(32, "Broken pipe")

        monkeypatch.setattr(protocol, "send_msg", broken)
        with pytest.raises(AgentError, match="lost the node agent"):
            client.request("ping", timeout=5)
        assert not client.connected
    finally:
        client.close()
        conn.close()
        srv.close()

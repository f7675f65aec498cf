"""The node agent's guards on its socket and its shared-memory names (issue 41's small items):

- ``done``, ``restored`` and ``hello`` for a position this connection did not take are refused
  (as ``alloc`` is): a stray connection cannot finish a live trainer's position, move the run's
  timeline, or take a live trainer's slots from under it;
- a message nested too deeply is refused before it is parsed, with one log line (it left a
  ``RecursionError`` traceback from the connection's thread);
- at exit the agent deletes only its own files: another user's file under the job's names stays.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from typing import Any

import pytest
from fchelpers import FcEnv, RunningAgent

from flashckpt.errors import ProtocolError
from flashckpt.names import slot_prefix
from flashckpt.protocol.channel import MAX_DEPTH, check_depth


class _Conn:
    """One raw connection to the agent (requests and their replies, one at a time)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(60)
        self.sock.connect(path)
        self.buf = b""
        self.rid = 0

    def send_line(self, line: bytes) -> None:
        self.sock.sendall(line + b"\n")

    def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        self.rid += 1
        self.send_line(json.dumps({"id": self.rid, "op": op, **fields}).encode())
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                msg = json.loads(line)
                if msg.get("id") == self.rid:
                    return msg
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the agent closed the connection")
            self.buf += chunk

    def close(self) -> None:
        self.sock.close()


HELLO = {"rank": 0, "world_size": 1, "local_rank": 0, "world_id": "w1"}

_OTHER_PROCESS = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(60)
s.connect(sys.argv[1])
s.sendall(json.dumps({"id": 1, "op": "hello", **json.loads(sys.argv[2])}).encode() + b"\\n")
buf = b""
while b"\\n" not in buf:
    buf += s.recv(1 << 16)
print(buf.split(b"\\n", 1)[0].decode())
"""


def _hello_from_another_process(path: str) -> dict[str, Any]:
    """A hello for local rank 0 sent by another process (a second trainer of the same rank)."""
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS, path, json.dumps(HELLO)],
        capture_output=True,
        timeout=60,
        check=True,
    )
    return dict(json.loads(out.stdout))


def test_a_connection_may_only_speak_for_the_position_it_took(
    fc_env: FcEnv, agent: RunningAgent, caplog: pytest.LogCaptureFixture
) -> None:
    a = agent.agent
    path = a.socket_path
    trainer = _Conn(path)
    stray = _Conn(path)
    try:
        assert trainer.ask("hello", **HELLO)["ok"] is True
        with a.st.lock:
            resumed_at = a.st.resumed_at
        # A connection that said no hello: done and restored refused, naming why.
        got = stray.ask("done", rank=0, local_rank=0)
        assert got["ok"] is False and "did not say hello for it" in got["error"], got
        got = stray.ask("restored", step=0)
        assert got["ok"] is False and "did not say hello for any position" in got["error"], got
        with a.st.lock:
            assert a.st.ranks[0].done is False and a.st.resumed_at == resumed_at
            assert a.st.ranks[0].conn is not None
        # Another process's hello for the position a live trainer holds: refused.
        got = _hello_from_another_process(path)
        assert got["ok"] is False and "holds it on another connection" in got["error"], got
        # The trainer's own messages pass.
        assert trainer.ask("restored", step=-1)["ok"] is True
        assert trainer.ask("done", rank=0, local_rank=0)["ok"] is True
        with a.st.lock:
            assert a.st.ranks[0].done is True
        # A finished position is taken by the next trainer.
        assert _hello_from_another_process(path)["ok"] is True
        # A message nested deeper than the bound: refused unread, the connection closed, one
        # log line, no thread dies (no RecursionError anywhere); the agent serves on.
        died: list[Any] = []
        hook = threading.excepthook
        threading.excepthook = died.append
        try:
            with caplog.at_level(logging.DEBUG, logger="flashckpt"):
                caplog.clear()
                stray.send_line(
                    b'{"id":1,"op":"ping","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
                )
                with pytest.raises(ConnectionError):
                    stray.ask("ping")
        finally:
            threading.excepthook = hook
        assert not died, died
        lines = [r for r in caplog.records if "nested deeper" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING, caplog.text
        assert "connection closed: message nested deeper than 64 levels" in lines[0].getMessage()
        assert not any(r.exc_info for r in caplog.records), caplog.text
        fresh = _Conn(path)
        try:
            assert fresh.ask("ping")["ok"] is True
        finally:
            fresh.close()
    finally:
        trainer.close()
        stray.close()


def test_the_depth_bound_counts_nesting_not_brackets_in_text() -> None:
    check_depth(b'{"a":"' + b"[" * 1000 + b'"}')  # brackets inside a string are text
    check_depth(b'{"a":"\\"' + b"{" * 1000 + b'"}')  # an escaped quote does not end it
    check_depth(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)
    check_depth(b"[1]," * 1000)  # many, never deep
    with pytest.raises(ProtocolError, match=f"nested deeper than {MAX_DEPTH} levels"):
        check_depth(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))


OTHER_UID = 54321


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root")
def test_at_exit_the_agent_leaves_another_users_files_under_the_jobs_names(
    fc_env: FcEnv, caplog: pytest.LogCaptureFixture
) -> None:
    agent = RunningAgent(fc_env.agent_config())
    planted = os.path.join(fc_env.shm_dir, slot_prefix(fc_env.job, fc_env.node) + "r00007.s0")
    try:
        with open(planted, "wb") as f:
            f.write(b"planted")
        os.chown(planted, OTHER_UID, OTHER_UID)
        with caplog.at_level(logging.INFO, logger="flashckpt"):
            agent.stop()  # the agent runs as root here: it could delete it, and must not
        assert os.path.exists(planted), "the agent deleted another user's file"
        assert os.stat(planted).st_uid == OTHER_UID
        assert f"left {planted} alone: it belongs to another user (uid {OTHER_UID}" in caplog.text
        assert not any(n for n in fc_env.segments() if not planted.endswith(n)), fc_env.segments()
    finally:
        if agent.thread.is_alive():
            agent.stop()
        if os.path.exists(planted):
            os.unlink(planted)

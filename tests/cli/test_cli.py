"""The `flashckpt` command: agent daemon (detached, pid file, 0600 socket), ls, verify."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from stephelpers import write_step
from tinytrain import make, train_step

import flashckpt
from flashckpt import cli
from flashckpt.format.storage import Storage


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flashckpt", *args], capture_output=True, text=True, timeout=120
    )


def _make_steps(env: FcEnv, steps: int = 4) -> None:
    a = RunningAgent(env.agent_config())
    try:
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, **env.ckpt_kwargs(agent="connect", every=2)
        ) as ck:
            for step in range(steps):
                train_step(model, opt, sched, step)
                if ck.step() is not None:
                    ck.flush()
    finally:
        a.stop()


def test_ls_and_verify(fc_env: FcEnv) -> None:
    _make_steps(fc_env)
    r = _cli("ls", fc_env.storage, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["step"] for row in rows] == [2, 4]
    assert all(row["bytes"] > 10_000 and row["files"] == 2 for row in rows)
    r = _cli("ls", fc_env.storage)
    assert r.returncode == 0 and "step" in r.stdout and "KiB" in r.stdout
    r = _cli("verify", fc_env.storage)
    assert r.returncode == 0 and r.stdout.count(": ok") == 2
    # Truncate a shard: verify names the file and fails.
    shard = fc_env.storage_path / "step-000000004" / "shard-00000-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    r = _cli("verify", fc_env.storage)
    assert r.returncode == 1
    assert "step 4: CORRUPT" in r.stdout and "shard-00000-of-00001.safetensors" in r.stdout
    assert "step 2: ok" in r.stdout
    r = _cli("verify", fc_env.storage + "-nothing-here")
    assert r.returncode == 1 and "no committed steps" in r.stderr


def test_load_reads_newest_intact_step(fc_env: FcEnv) -> None:
    _make_steps(fc_env)
    shard = fc_env.storage_path / "step-000000004" / "shard-00000-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[200] ^= 0xFF
    shard.write_bytes(bytes(raw))
    import pytest

    with pytest.warns(UserWarning, match="skipping step 4.*checksum"):
        ck = flashckpt.load(fc_env.storage)
    assert ck.step == 2
    assert isinstance(ck.state["model"]["0.weight"], torch.Tensor)
    with pytest.raises(flashckpt.CorruptCheckpointError, match="step-000000004"):
        flashckpt.load(fc_env.storage, step=4)


def test_detached_agent_with_pid_file_and_private_socket(fc_env: FcEnv, tmp_path: Path) -> None:
    pid_file = tmp_path / "agent.pid"
    r = _cli(
        "agent",
        "--job",
        fc_env.job,
        "--node",
        fc_env.node,
        "--run-dir",
        fc_env.run_dir,
        "--storage",
        fc_env.storage,
        "--detach",
        "--pid-file",
        str(pid_file),
    )
    assert r.returncode == 0, r.stderr
    pid = int(pid_file.read_text())
    proc = psutil.Process(pid)
    assert proc.is_running() and os.getsid(pid) != os.getsid(0)  # its own session
    sock = Path(fc_env.run_dir) / f"{fc_env.job}.{fc_env.node}.sock"
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(fc_env.run_dir).stat().st_mode) == 0o700
    # A second agent for the same job and node refuses to start (exit code 3).
    r2 = _cli("agent", "--job", fc_env.job, "--node", fc_env.node, "--run-dir", fc_env.run_dir)
    assert r2.returncode == 3
    # Also one told to wait for the lock (as trainers start theirs): the first one answers, so
    # it does not wait (it used to, then took over once the first exited at the job's end and
    # sat out its idle timeout with nobody to serve). _cli gives up after 120 s.
    flags = ("--job", fc_env.job, "--node", fc_env.node, "--run-dir", fc_env.run_dir)
    r3 = _cli("agent", *flags, "--lock-wait", "600")
    assert r3.returncode == 3 and "already serves" in r3.stderr, r3.stderr
    # A second --detach: its agent exits at once; it must not report the first one's socket
    # as its own ("listening") but fail, naming the agent that serves the job.
    r4 = _cli("agent", *flags, "--storage", fc_env.storage, "--detach")
    assert r4.returncode != 0 and "listening" not in r4.stdout, (r4.stdout, r4.stderr)
    assert f"another agent (pid {pid}) already serves" in r4.stderr, r4.stderr
    assert proc.is_running()
    # Trainers use it (agent="connect" requires it to be there).
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect", every=2)
    ) as ck:
        assert ck.status()["agent"]["pid"] == pid
        for step in range(2):
            train_step(model, opt, sched, step)
            ck.step()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert not sock.exists()
    assert fc_env.segments() == []
    assert flashckpt.load(fc_env.storage).step == 2


def test_connect_without_agent_is_a_clear_error(fc_env: FcEnv) -> None:
    import pytest

    from flashckpt.protocol.channel import AgentError

    model, opt, sched = make(0)
    t0 = time.monotonic()
    with pytest.raises(AgentError, match=r"no flashckpt node agent.*flashckpt agent --job"):
        flashckpt.checkpointing(
            model, opt, scheduler=sched, **fc_env.ckpt_kwargs(agent="connect")
        ).__enter__()
    assert time.monotonic() - t0 < 30


def test_bad_options_are_clear_errors() -> None:
    import pytest

    model, opt, _ = make(0)
    with pytest.raises(TypeError, match=r"unknown keyword.*'evry' \(did you mean 'every'\?\)"):
        flashckpt.checkpointing(model, opt, evry=3)
    with pytest.raises(ValueError, match="every=-1"):
        flashckpt.checkpointing(model, opt, every=-1)
    with pytest.raises(ValueError, match="when_busy='maybe'"):
        flashckpt.checkpointing(model, opt, when_busy="maybe")
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module"):
        flashckpt.checkpointing(opt)  # type: ignore[arg-type]


def _small_root(tmp_path: Path, steps: tuple[int, ...] = (1, 2, 3)) -> Storage:
    st = Storage(f"file://{tmp_path}/ckpt")
    for s in steps:
        st.commit(s, write_step(st, s))
    return st


VERBS = ("agent", "ls", "verify", "clean", "plan", "run", "status", "goodput", "export")


def test_help_lists_every_verb_with_one_line_each(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps help text at the terminal width
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    # "verbs:", "  VERB", then one line per verb up to the blank line
    rows = list(itertools.takewhile(str.strip, lines[lines.index("verbs:") + 2 :]))
    assert [r.split()[0] for r in rows] == list(VERBS), rows
    assert all(len(r.split()) > 1 for r in rows), rows  # the help is on the verb's line


LISTING = {
    "help": ["--help"],
    "plan help": ["plan", "--help"],
    "plan": ["plan", "--params", "7e9", "--tokens", "2e12", "--gpus", "1024"],
    "ls": ["ls", "{url}"],
    "ls json": ["ls", "{url}", "--json"],
    "verify": ["verify", "{url}"],
    "goodput": ["goodput", "{events}"],
    "status": ["status", "--run-dir", "{run_dir}"],
}


@pytest.mark.parametrize("name", sorted(LISTING))
def test_listing_commands_survive_a_closed_pipe(tmp_path: Path, name: str) -> None:
    """`flashckpt plan ... | head -1`: the reader is gone before the command writes a byte (the
    read end is closed before it starts); it ends quietly, no BrokenPipeError traceback."""
    st = _small_root(tmp_path)
    events = tmp_path / "events.jsonl"
    events.write_text("")
    args = [a.format(url=st.url, events=events, run_dir=tmp_path / "run") for a in LISTING[name]]
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(
            [sys.executable, "-m", "flashckpt", *args],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(w)
    assert "BrokenPipeError" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert p.returncode in (0, 1, -signal.SIGPIPE), (p.returncode, p.stderr)


def test_ls_reports_a_corrupt_manifest_as_a_line(tmp_path: Path) -> None:
    st = _small_root(tmp_path)
    (tmp_path / "ckpt" / "step-000000002" / "manifest.json").write_text("{not json")
    doc = json.loads((tmp_path / "ckpt" / "step-000000003" / "manifest.json").read_text())
    del doc["shards"]
    (tmp_path / "ckpt" / "step-000000003" / "manifest.json").write_text(json.dumps(doc))
    r = _cli("ls", st.url)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r
    lines = r.stdout.splitlines()
    assert any(ln.split()[0] == "1" and "CORRUPT" not in ln for ln in lines[1:]), r
    assert any(ln.split()[:2] == ["2", "CORRUPT:"] and "not valid JSON" in ln for ln in lines), r
    assert any(ln.split()[:2] == ["3", "CORRUPT:"] and "'shards'" in ln for ln in lines), r
    r = _cli("ls", st.url, "--json")
    rows = {row["step"]: row for row in json.loads(r.stdout)}
    assert r.returncode == 1 and rows[1]["files"] == 2 and "manifest.json" in rows[2]["error"]


def test_verify_racing_retention_reports_no_corrupt_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Retention deletes the oldest step while verify reads it (deterministically, from inside
    verify's read of that step's first file): the step is reported removed, not CORRUPT."""
    from flashckpt import cli

    st = _small_root(tmp_path)
    real = Storage.read_file
    raced = []

    def racing(self: Storage, step: int, name: str, manifest: dict) -> bytearray:
        if step == 1 and not raced:
            raced.append(self.retain(2))  # what a committing agent does meanwhile
        return real(self, step, name, manifest)

    monkeypatch.setattr(Storage, "read_file", racing)
    rc = cli.main(["verify", st.url])
    out = capsys.readouterr().out
    assert raced == [[1]]
    assert rc == 0 and "CORRUPT" not in out, out
    assert "step 1: removed" in out and "step 2: ok" in out and "step 3: ok" in out, out


def test_verify_a_listed_step_whose_directory_vanished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The other order of the race: listed, then deleted before verify opens its manifest."""
    import shutil

    from flashckpt import cli

    st = _small_root(tmp_path)
    listed = st.committed_steps()
    shutil.rmtree(tmp_path / "ckpt" / "step-000000001")
    monkeypatch.setattr(Storage, "committed_steps", lambda self: listed)
    rc = cli.main(["verify", st.url])
    out = capsys.readouterr().out
    assert rc == 0 and "CORRUPT" not in out and "step 1: removed" in out, out
    # Asked for by number, a step that is not there is an error (not "removed").
    rc = cli.main(["verify", st.url, "--step", "1"])
    out = capsys.readouterr().out
    assert rc == 1 and "step 1: not committed" in out, out
    # A truly corrupt step is still CORRUPT (the race check does not hide corruption).
    shard = tmp_path / "ckpt" / "step-000000002" / "shard-00000-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"!")
    monkeypatch.undo()
    rc = cli.main(["verify", st.url])
    out = capsys.readouterr().out
    assert rc == 1 and "step 2: CORRUPT" in out and "checksum" in out, out


def test_agent_writes_checkpoints_private_by_default_or_shared(fc_env: FcEnv) -> None:
    """What the node agent commits is 0600/0700 by default; with storage_file_mode=0o644 (the
    agent's --shared-read) others may read it."""
    _make_steps(fc_env, steps=2)
    step_dir = fc_env.storage_path / "step-000000002"
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    assert len(files) >= 3  # shard, rank file, part, manifest
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), files
    assert stat.S_IMODE(step_dir.stat().st_mode) == 0o700
    a = RunningAgent(fc_env.agent_config(storage_file_mode=0o644))
    try:
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model,
            opt,
            scheduler=sched,
            **fc_env.ckpt_kwargs(agent="connect", every=0, restore=False, overwrite=True),
        ) as ck:
            for _ in range(50):  # every=0: marks steps done, snapshots nothing
                ck.step()
            ck.save()
            assert ck.flush() == 50
    finally:
        a.stop()
    step_dir = fc_env.storage_path / "step-000000050"
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in files), files
    assert stat.S_IMODE(step_dir.stat().st_mode) == 0o755


def _agent_options() -> tuple[argparse.ArgumentParser, dict[str, argparse.Action]]:
    from flashckpt.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    agent_parser = sub.choices["agent"]
    return agent_parser, {a.dest: a for a in agent_parser._actions}


def test_every_agent_config_field_has_a_flag_listed_in_help() -> None:
    from flashckpt.agent.daemon import AgentConfig
    from flashckpt.monitor.step_monitor import MonitorConfig

    agent_parser, by_dest = _agent_options()
    text = agent_parser.format_help()
    for cls, prefix in ((AgentConfig, ""), (MonitorConfig, "")):
        for f in dataclasses.fields(cls):
            if f.name == "monitor":  # the monitoring group: MonitorConfig's fields below
                continue
            action = by_dest.get(prefix + f.name)
            assert action is not None, f"{cls.__name__}.{f.name} has no flag"
            assert action.help, f"{cls.__name__}.{f.name}'s flag has no help"
            assert action.option_strings[0] in text, f"{action.option_strings[0]} not in --help"


def test_agent_flag_defaults_are_the_dataclass_defaults() -> None:
    from flashckpt.agent.daemon import AgentConfig
    from flashckpt.cli import agent_config

    agent_parser, _ = _agent_options()
    cfg = agent_config(agent_parser.parse_args(["--job", "j1"]))
    assert cfg == AgentConfig(job="j1")
    cfg = agent_config(
        agent_parser.parse_args(
            [
                "--job",
                "j1",
                "--node",
                "n7",
                "--keep",
                "5",
                "--shared-read",
                "--orphan-age",
                "60",
                "--commit-timeout",
                "9",
                "--no-write-through-private",
                "--metrics-port",
                "0",
                "--hang-kill",
                "on",
                "--straggler-metric",
                "step",
                "--no-monitor",
            ]
        )
    )
    assert (cfg.node, cfg.keep, cfg.storage_file_mode, cfg.orphan_age_s) == ("n7", 5, 0o644, 60.0)
    assert cfg.commit_timeout == 9.0 and cfg.write_through_private is False
    assert cfg.monitor.metrics_port is None  # 0: off on the command line
    assert cfg.monitor.hang_kill == "on" and cfg.monitor.straggler_metric == "step"
    assert cfg.monitor.enabled is False
    port = agent_config(agent_parser.parse_args(["--job", "j1", "--metrics-port", "9100"]))
    assert port.monitor.metrics_port == 9100


def test_agent_with_a_missing_shm_dir_is_a_clear_error(fc_env: FcEnv, tmp_path: Path) -> None:
    """A --shm-dir that does not exist: a message naming it and the fix, exit 1, nothing left
    running and no traceback (it used to be a bare FileNotFoundError from the owner file)."""
    missing = tmp_path / "no-such-tmpfs"
    env = dataclasses.replace(fc_env, shm_dir=str(missing))
    r = _cli("agent", *env.cli_flags(), "--idle-timeout", "5")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert str(missing) in r.stderr and "--shm-dir" in r.stderr and "create it" in r.stderr
    assert not missing.exists()


def test_ls_of_a_missing_root_fails(tmp_path: Path) -> None:
    """A mistyped root is an error (exit 2, naming the URL), not "no committed steps" (exit 0),
    which an existing empty root still is."""
    missing = _cli("ls", f"file://{tmp_path}/no-such-root")
    assert missing.returncode == 2 and "does not exist" in missing.stderr, missing
    assert f"{tmp_path}/no-such-root" in missing.stderr
    (tmp_path / "empty").mkdir()
    empty = _cli("ls", f"file://{tmp_path}/empty")
    assert empty.returncode == 0 and "no committed steps" in empty.stdout, empty

"""A bad store is loud, and nothing is lost (issue 43): a real trainer and its node agent
persisting to ``s3://`` on the real S3 server through the fault proxy
(flashckpt/testing/s3proxy.py), which answers 403 AccessDenied, 500 InternalError and 503
SlowDown, stalls past the client's read timeout, and refuses connections for an outage of
``FLASHCKPT_TEST_S3_OUTAGE_S`` seconds (16 here; run once by hand with 60 for "a minute").
The run's key, secret and endpoint are given only in ``storage_options=``."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest
from fchelpers import FcEnv, kill_job_processes, tinytrain_command

from flashckpt.format.storage import Storage
from flashckpt.names import agent_log_path
from flashckpt.testing.s3 import SeaweedS3
from flashckpt.testing.s3proxy import S3FaultProxy

pytestmark = pytest.mark.slow

OUTAGE_S = float(os.environ.get("FLASHCKPT_TEST_S3_OUTAGE_S", "16"))

_ERROR_LINE = re.compile(r"^(\S+ \S+) .* persist step \S+ failed: (.*)$")


def _wait(what: str, cond, proc=None, timeout: float = 120, tail=str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the trainer exited ({proc.returncode}) before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {tail()}"
        time.sleep(0.05)


@pytest.mark.timeout(600)  # five faults and an outage, each waited out (~4 min, loaded)
def test_a_failing_store_is_loud_keeps_the_snapshot_and_commits_once_back(
    s3_server: SeaweedS3, s3_prefix: str, fc_env_private: FcEnv, tmp_path: Path
) -> None:
    """One training run through the proxy meets, in turn, 403, 500, 503 SlowDown, a stalled
    store and an unreachable one (``OUTAGE_S``): each failure is a line in the agent's log and a
    warning in the trainer's naming the bucket (the storage URL) and the store's answer, with
    no traceback; training goes on; persistence retries with a growing pause; ``latest`` stays
    on a committed step. The run is then SIGKILLed with its agent while the store is away: the
    newer snapshot stayed in memory, and the rerun (the store back) restores from memory at a
    step newer than any committed, then commits the next steps; a third run on wiped shared
    memory restores that step from S3; every step verifies. The credentials and endpoint are
    only in ``storage_options=`` (none in the environment): the agent gets them from a 0600
    file, and the secret is in no process's ``/proc/<pid>/cmdline``, log, warning or
    manifest."""
    env = fc_env_private
    url = f"{s3_prefix}/run"
    env.storage = url
    proxy = S3FaultProxy(s3_server.endpoint)
    proxy.start()
    secret = s3_server.secret_key
    # The key, secret and endpoint only in storage_options= (none in the environment), with
    # the client's own knobs: a stalled request times out in 1 s, botocore tries each request
    # twice (its default is 5 tries).
    opts = {
        **s3_server.storage_options(),
        "client_kwargs": {"endpoint_url": proxy.endpoint, "region_name": s3_server.region},
        "config_kwargs": {
            "read_timeout": 1,
            "connect_timeout": 1,
            "retries": {"max_attempts": 2},
        },
    }
    opts_file = tmp_path / "opts.json"
    opts_file.write_text(json.dumps(opts))
    penv = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    penv["AWS_EC2_METADATA_DISABLED"] = "true"  # no cloud metadata lookups here
    penv["AWS_SHARED_CREDENTIALS_FILE"] = penv["AWS_CONFIG_FILE"] = str(tmp_path / "none")
    st = Storage(url, storage_options=s3_server.storage_options())  # the server, not the proxy
    agent_log = Path(agent_log_path(env.run_dir, env.job, env.node))
    steps_log = tmp_path / "a.log"
    errs = [tmp_path / "a.err", tmp_path / "b.err", tmp_path / "c.err"]

    def start(tag: str, err: Path, *extra: str) -> subprocess.Popen[bytes]:
        cmd = tinytrain_command(
            env,
            tmp_path / f"{tag}.log",
            *("--width", "64", "--report", str(tmp_path / "r")),
            *("--storage-options", str(opts_file)),
            *extra,
        )
        with open(err, "ab") as f:
            return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env=penv)

    def errors() -> list[tuple[float, str]]:
        """The agent's failure lines: (time, message)."""
        out = []
        text = agent_log.read_text(errors="replace") if agent_log.exists() else ""
        for line in text.splitlines():
            m = _ERROR_LINE.match(line)
            if m:
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                out.append((t, m.group(2)))
        return out

    def latest() -> int:
        return int(json.loads(st.fs.cat_file(st.path("latest")))["step"])

    def steps() -> int:
        return len(steps_log.read_text().splitlines())

    p = start("a", errs[0], "--steps", "1000000", "--every", "2", "--step-sleep", "0.05")
    try:
        _wait("a committed step", lambda: st.fs.exists(st.path("latest")), p)
        cmdlines = {pr.pid: _cmdline(pr) for pr in psutil.process_iter() if env.job in _cmdline(pr)}
        assert any("agent" in c for c in cmdlines.values()), cmdlines  # the trainer's agent
        for pid in cmdlines:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert secret.encode() not in f.read(), pid
        seen: dict[str, str] = {}
        for name, fault, answer in [
            # a HEAD's answer has no body: its cause is the HTTP status's (as from AWS)
            ("403", lambda: proxy.fail(403), "access denied|forbidden"),
            ("500", lambda: proxy.fail(500), "internal"),
            ("503", lambda: proxy.fail(503), "reduce your request rate|service unavailable"),
            ("stall", proxy.stall, "read timeout"),
        ]:
            n0, s0 = len(errors()), steps()
            fault()
            got = _wait(
                f"the agent's error for {name}",
                lambda a=answer, n=n0: [e for _, e in errors()[n:] if re.search(a, e, re.I)],  # type: ignore[misc]
                p,
                tail=lambda: errors()[-3:],
            )
            seen[name] = got[0]
            _wait(f"training going on through {name}", lambda s=s0: steps() > s + 5, p)  # type: ignore[misc]
            proxy.heal()
        # back: the next persist commits (and the backoff starts over)
        before = latest()
        _wait("a commit once the store is back", lambda: latest() > before, p)
        # the store unreachable for OUTAGE_S: failures keep coming, each pause longer
        n0, s0 = len(errors()), steps()
        committed_then = latest()
        proxy.refuse()
        t0 = time.monotonic()
        _wait("the outage's length", lambda: time.monotonic() - t0 >= OUTAGE_S, p)
        during = [
            (t, e) for t, e in errors()[n0:] if "connect" in e.lower() and "persisting to" in e
        ]
        assert len(during) >= 3, errors()[n0:]
        seen["unreachable"] = during[0][1]
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(during)]
        # backoff: retry_interval (2 s), twice, then four times that; never a burst
        assert gaps[-1] > gaps[0] and min(gaps) > 1.5, gaps
        assert steps() > s0 + 20  # training went on through the outage
        assert latest() == committed_then  # nothing moved, nothing torn
        # killed with its agent while the store is away: the snapshots are in shared memory
        kill_job_processes(env.job)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            kill_job_processes(env.job)
            p.wait(timeout=60)
    ran_to = steps()
    for name, line in seen.items():
        assert url in line, (name, line)  # names the bucket (the storage URL)
        print(f"{name}: {line}")
    trainer_err = errs[0].read_text(errors="replace")
    assert f"persisting to {url}" in trainer_err  # the trainer's warning
    assert "Traceback" not in agent_log.read_text(errors="replace")

    # the store is back: the rerun restores from memory, then commits the next steps
    proxy.heal()
    (tmp_path / "r").unlink(missing_ok=True)
    try:
        b = start("b", errs[1], "--steps", str(ran_to + 6), "--every", "2")
        assert b.wait(timeout=300) == 0, errs[1].read_text(errors="replace")[-3000:]
        start_step, source = (tmp_path / "r").read_text().split()[:2]
        assert source == "memory" and int(start_step) > committed_then, (start_step, source)
        assert latest() == ran_to + 6
        # a new machine (no shared memory): the storage_options= read the step back from S3
        for n in os.listdir(env.shm_dir):
            os.unlink(os.path.join(env.shm_dir, n))
        (tmp_path / "r").unlink()
        c = start("c", errs[2], "--steps", str(ran_to + 8), "--every", "2")
        assert c.wait(timeout=300) == 0, errs[2].read_text(errors="replace")[-3000:]
        start_step, source = (tmp_path / "r").read_text().split()[:2]
        assert (int(start_step), source) == (ran_to + 6, "storage")
    finally:
        kill_job_processes(env.job)
        proxy.close()
    assert latest() == ran_to + 8
    for step in st.committed_steps():
        assert st.check_step(step).status == "ok", step

    # the secret: in the agent's 0600 options file alone
    opt_files = list(Path(env.run_dir).glob("storage-options.*.json"))
    assert len(opt_files) == 1 and opt_files[0].stat().st_mode & 0o777 == 0o600
    texts = [f.read_text(errors="replace") for f in errs]
    texts += [
        f.read_text(errors="replace")
        for f in Path(env.run_dir).rglob("*")
        if f.is_file() and f not in opt_files
    ]
    texts += [
        st.fs.cat_file(st.step_path(x, "manifest.json")).decode() for x in st.committed_steps()
    ]
    assert all(secret not in t for t in texts)
    assert proxy.counts["PutObject"] > 0 and proxy.faulted > 0


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""

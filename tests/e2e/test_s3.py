"""Checkpoints on a real S3 server (SeaweedFS, tests/support/s3fixtures.py): a training run
persisting to ``s3://``, its node agent SIGKILLed in the middle of a shard's multipart upload,
the S3 server SIGKILLed and restarted mid-persist; what restore, ``flashckpt ls``/``verify``/
``export`` and ``flashckpt.load`` then see, and the uploads left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import safetensors.torch
import torch
from fchelpers import FcEnv, kill_job_processes, tinytrain_command

import flashckpt
from flashckpt.format.storage import Storage
from flashckpt.names import agent_log_path
from flashckpt.testing.s3 import SeaweedS3

pytestmark = pytest.mark.slow

# ~75 MB of state: the shard (> s3fs's 50 MiB part) goes up as a multipart upload, for long
# enough on a loaded machine to be caught in the middle of it
WIDTH = 300_000


def _trainer(env: FcEnv, tmp: Path, tag: str, *extra: str) -> subprocess.Popen[bytes]:
    cmd = tinytrain_command(
        env, tmp / f"{tag}.log", "--width", str(WIDTH), "--report", str(tmp / "report.txt"), *extra
    )
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashckpt", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def _wait(what: str, cond, proc=None, timeout: float = 180):  # type: ignore[no-untyped-def]
    """Waits for ``cond()`` to be truthy (the store's own state, polled), failing early if
    ``proc`` dies."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            pytest.fail(
                f"trainer exited ({proc.returncode}) before {what}: "
                f"{proc.stderr.read().decode()[-3000:] if proc.stderr else ''}"
            )
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _upload_step(upload: dict) -> int:
    return int(upload["Key"].split("step-")[1][:9])


def _agent_pids(job: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if job in cmd and " agent" in cmd and "tinytrain" not in cmd:
            out.append(p.info["pid"])
    return out


def test_agent_killed_mid_multipart_upload_commits_nothing_torn(
    s3_server: SeaweedS3, s3_prefix: str, s3_env: dict, fc_env_private: FcEnv, tmp_path: Path
) -> None:
    """The node agent (and its trainer) SIGKILLed while a shard's multipart upload is open: the
    step has no manifest, so ``ls``, ``verify``, ``load`` and ``latest`` show the step before
    it; the rerun resumes from S3 (shared memory wiped) and the next retention aborts the
    orphaned upload. ``export`` and ``flashckpt.load`` read the committed steps from S3."""
    env = fc_env_private
    url = f"{s3_prefix}/run"
    env.storage = url
    st = Storage(url)
    bucket, root = "ckpts", url.removeprefix("s3://ckpts/")
    uploads = lambda: s3_server.multipart_uploads(bucket, root + "/")  # noqa: E731

    p = _trainer(env, tmp_path, "a", "--steps", "60", "--every", "3", "--step-sleep", "0.05")
    try:
        # a committed step that `latest` names already (it is written after the manifest)
        _wait("a committed step and latest", lambda: st.fs.exists(st.path("latest")), p)

        def open_upload_while_stopped() -> list[dict]:
            """The agent stopped (SIGSTOP: it can neither finish nor commit meanwhile), an
            upload into a step newer than every committed one, open right now; else the agent
            goes on and []. (Looked at while it ran, an upload could finish before the kill.)"""
            pids = _agent_pids(env.job)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            newest = max(st.committed_steps(), default=-1)
            found = [u for u in uploads() if _upload_step(u) > newest]
            if not found:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            return found

        open_up = _wait("a multipart upload of a later step", open_upload_while_stopped, p)
        for pid in _agent_pids(env.job):
            os.kill(pid, signal.SIGKILL)
        kill_job_processes(env.job)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    torn_key = open_up[0]["Key"]
    torn_step = _upload_step(open_up[0])
    committed = st.committed_steps()
    assert torn_step not in committed, (torn_key, committed)
    assert not st.fs.exists(f"ckpts/{torn_key}")  # the half upload is no object
    newest = committed[-1]
    # `latest` names a committed step, never a newer one (it is written after the manifest:
    # a kill between the two leaves it one commit behind)
    latest_then = json.loads(st.fs.cat_file(st.path("latest")))["step"]
    assert latest_then in committed
    ls = _cli("ls", url)
    assert ls.returncode == 0, ls.stderr
    listed = [int(line.split()[0]) for line in ls.stdout.splitlines()[1:]]
    assert listed == committed and torn_step not in listed
    ver = _cli("verify", url)
    assert ver.returncode == 0, ver.stdout + ver.stderr
    assert all(line.endswith(": ok") for line in ver.stdout.splitlines()), ver.stdout
    loaded = flashckpt.load(url)
    assert loaded.step == newest
    assert any(u["Key"] == torn_key for u in uploads())  # still open: nobody completed it

    # export from S3, and it holds what load read
    out = tmp_path / "export.safetensors"
    ex = _cli("export", url, "--to", str(out))
    assert ex.returncode == 0, ex.stderr
    exported = safetensors.torch.load_file(str(out))
    model = loaded.state["model"]
    assert sorted(exported) == sorted(model)
    assert all(torch.equal(exported[k], model[k]) for k in model)

    # the rerun: shared memory is gone (a new machine), so it resumes from S3
    for n in os.listdir(env.shm_dir):
        os.unlink(os.path.join(env.shm_dir, n))
    (tmp_path / "report.txt").unlink(missing_ok=True)
    p = _trainer(env, tmp_path, "b", "--steps", str(newest + 3), "--every", "3")
    _, err = p.communicate(timeout=240)
    assert p.returncode == 0, err.decode()[-3000:]
    start, source = (tmp_path / "report.txt").read_text().split()[:2]
    assert int(start) == newest and source == "storage", (start, source)
    after = st.committed_steps()
    assert after[-1] == newest + 3
    assert json.loads(st.fs.cat_file(st.path("latest")))["step"] == after[-1] > latest_then
    # the retention after those commits aborted the orphaned upload (older than the newest)
    assert [u["Key"] for u in uploads() if _upload_step(u) < after[-1]] == []


def test_store_killed_mid_persist_then_back_loses_nothing(
    fc_env_private: FcEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The S3 server SIGKILLed while a shard's upload is open, and started again: training goes
    on meanwhile, the agent reports errors naming the bucket and the cause, retries, and commits
    again once the store is back; no step is committed torn, ``latest`` never moves backwards,
    every committed step verifies. The secret key appears in no log or error."""
    s3fs = pytest.importorskip("s3fs")
    env = fc_env_private
    server = SeaweedS3(tmp_path / "s3")
    server.start()
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        # fsspec caches filesystems by their arguments: not the session server's client
        s3fs.S3FileSystem.clear_instance_cache()
        url = "s3://ckpts/job/run"
        env.storage = url
        st = Storage(url)
        log = tmp_path / "a.log"
        p = _trainer(
            env, tmp_path, "a", "--steps", "100000", "--every", "20", "--step-sleep", "0.05"
        )
        try:
            before = _wait("a committed step", st.committed_steps, p)[-1]
            _wait(
                "an open multipart upload",
                lambda: [
                    u
                    for u in server.multipart_uploads("ckpts", "job/run/")
                    if _upload_step(u) > before
                ],
                p,
            )
            server.kill()
            # the trainer does not wait for the store: it goes on stepping
            steps_then = len(log.read_text().splitlines())
            _wait(
                "20 more training steps",
                lambda: len(log.read_text().splitlines()) > steps_then + 20,
                p,
            )
            agent_log = Path(agent_log_path(env.run_dir, env.job, env.node))
            _wait(
                "the agent's error naming the bucket",
                lambda: "persisting to s3://ckpts/job/run" in agent_log.read_text(),
                p,
            )
            server.restart()
            latest = json.loads(st.fs.cat_file(st.path("latest")))["step"]
            assert latest >= before
            _wait(
                "a commit after the store came back (latest moved on)",
                lambda: json.loads(st.fs.cat_file(st.path("latest")))["step"] > latest,
                p,
            )
        finally:
            kill_job_processes(env.job)
            p.wait(timeout=60)
        committed = st.committed_steps()
        newest = json.loads(st.fs.cat_file(st.path("latest")))["step"]
        assert newest in committed and newest > latest  # forward, to a committed step
        ver = _cli("verify", url)
        assert ver.returncode == 0, ver.stdout + ver.stderr
        assert all(line.endswith(": ok") for line in ver.stdout.splitlines()), ver.stdout
        logs = "".join(f.read_text(errors="replace") for f in Path(env.run_dir).rglob("*.log"))
        logs += p.stderr.read().decode(errors="replace") if p.stderr else ""
        assert "persisting to s3://ckpts/job/run" in logs
        assert server.secret_key not in logs
        errors = [line for line in logs.splitlines() if "persisting to s3://" in line]
        print("\n".join(errors[:3]))
    finally:
        server.close()
        s3fs.S3FileSystem.clear_instance_cache()  # no client of this server for later tests


def test_bad_credentials_fail_at_entry_naming_the_bucket_never_the_secret(
    s3_server: SeaweedS3, s3_prefix: str, fc_env: FcEnv, tmp_path: Path
) -> None:
    """A wrong secret key fails ``checkpointing(...)`` on entry (before a snapshot), with an
    error naming the storage URL (the bucket) and the store's answer; the secret is in no output
    or log."""
    env = {
        **os.environ,
        **s3_server.env(),
        "AWS_SECRET_ACCESS_KEY": "wrong-" + s3_server.secret_key,
    }
    fc_env.storage = f"{s3_prefix}/run"
    log = tmp_path / "bad.log"
    r = subprocess.run(
        tinytrain_command(fc_env, log, "--steps", "3", "--width", "8"),
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert r.returncode != 0
    assert "StorageUnavailableError" in r.stderr
    assert f"storage {fc_env.storage} cannot keep checkpoints" in r.stderr
    assert "signature" in r.stderr  # the store's answer: the key does not match
    assert not log.exists() or not log.read_text()  # not a step ran
    logs = r.stdout + r.stderr
    run_files = [f for f in Path(fc_env.run_dir).rglob("*") if f.is_file()]
    logs += "".join(f.read_text(errors="replace") for f in run_files)
    assert s3_server.secret_key not in logs


def test_two_machines_mirror_to_s3_and_load_reads_it_back(
    s3_server: SeaweedS3, s3_prefix: str, s3_env: dict, fc_env: FcEnv, tmp_path: Path
) -> None:
    """Two machines (two node agents, a rank each, gloo) persisting to a local disk root and
    mirroring to S3: every mirrored step is committed there with both machines' parts and
    verifies; ``flashckpt.load`` reads the same model from S3 as from the disk."""
    mirror_url = f"{s3_prefix}/mirror"
    init, out = tmp_path / "init", tmp_path / "out"
    worker = Path(__file__).resolve().parents[1] / "support" / "_mirror_worker.py"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(worker),
                *("--rank", str(rank), "--storage", fc_env.storage, "--mirror", mirror_url),
                *("--job", fc_env.job, "--run-dir", fc_env.run_dir),
                *("--init-file", str(init), "--out", str(out)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    try:
        errs = [p.communicate(timeout=300)[1].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errs
    mirror = Storage(mirror_url)
    _wait("step 7 committed in the S3 mirror", lambda: 7 in mirror.committed_steps())
    mirrored = mirror.committed_steps()
    # the 1st and every 2nd persisted step, and the exit's 7 (a newer marked step makes the
    # mirror skip an older one still waiting: which of 3 and 5 made it depends on the load)
    assert mirrored[0] == 1 and mirrored[-1] == 7 and set(mirrored) <= {1, 3, 5, 7}
    for step in mirrored:
        m = mirror.manifest(step)
        assert m.nodes == ("n0", "n1") and sorted(m.ranks) == [0, 1]
        assert mirror.check_step(step).status == "ok"
    ver = _cli("verify", mirror_url)
    assert ver.returncode == 0, ver.stdout + ver.stderr
    assert ver.stdout.count(": ok") == len(mirrored), ver.stdout
    full = flashckpt.load(mirror_url)
    local = flashckpt.load(fc_env.storage, step=7)
    assert full.step == 7 and sorted(full.ranks) == [0, 1]
    for k, v in local.state["model"].items():
        assert torch.equal(full.state["model"][k], v), k


def test_another_job_on_the_same_s3_root_is_refused(
    s3_server: SeaweedS3, s3_prefix: str, s3_env: dict, fc_env: FcEnv, tmp_path: Path
) -> None:
    """The storage-owner check between jobs works on S3: a second job started on a root a first
    job committed to is refused at entry, naming the root and the fix."""
    url = f"{s3_prefix}/run"
    fc_env.storage = url
    a = subprocess.run(
        tinytrain_command(fc_env, tmp_path / "a.log", "--steps", "3", "--every", "3"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert a.returncode == 0, a.stderr[-3000:]
    assert Storage(url).committed_steps()
    other = FcEnv(
        job=fc_env.job + "b",
        node=fc_env.node,
        run_dir=fc_env.run_dir,
        storage=url,
        storage_path=fc_env.storage_path,
    )
    b = subprocess.run(
        tinytrain_command(other, tmp_path / "b.log", "--steps", "3", "--every", "3"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    try:
        assert b.returncode != 0
        assert url in b.stderr and "takeover=True" in b.stderr, b.stderr[-3000:]
    finally:
        kill_job_processes(other.job)

"""A worker killed by a signal is reported as killed by that signal (issue 30).

The pre-warmed worker's stub (:mod:`flashckpt.elastic.launch.prewarm`) stands in for the worker
towards torch: it must end by the worker's signal, so torch reports ``-9`` for a SIGKILL (an OOM
kill) rather than exit code 1 and a traceback of the stub's own.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from elasticcluster import cluster_env

from flashckpt.testing.elastic import kill_job


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV])
def test_the_stub_ends_by_the_workers_signal(signum: int) -> None:
    # The stub installs relay handlers for SIGTERM & co before it learns the status: they must
    # not swallow the signal it ends by.
    code = textwrap.dedent(
        f"""
        import signal
        from flashckpt.elastic.launch.prewarm import exit_with_status
        signal.signal(signal.SIGTERM, lambda *a: None)
        exit_with_status(-{int(signum)})
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=cluster_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signum, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_stopping_signal_is_an_exit_code_not_a_frozen_stub() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from flashckpt.elastic.launch.prewarm import exit_with_status; exit_with_status(-19)",
        ],
        env=cluster_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 128 + 19, proc.stderr


@pytest.mark.slow
@pytest.mark.etcd
def test_a_sigkilled_worker_is_reported_as_killed_by_sigkill(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    tag = f"fckill-{uuid.uuid4().hex[:10]}"
    run_dir = Path("/tmp") / tag  # short: the agent's socket path has a length limit
    cmd = [
        sys.executable,
        "-m",
        "flashckpt",
        "run",
        "--standalone",
        "--rdzv-id",
        tag,
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--run-dir",
        str(run_dir),
        "--shm-dir",
        f"/dev/shm/{tag}",
        str(script),
    ]
    log = tmp_path / "launcher.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=cluster_env(), start_new_session=True
        )
    try:
        code = proc.wait(timeout=120)
    finally:
        kill_job([proc], tag)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(f"/dev/shm/{tag}", ignore_errors=True)
    out = log.read_text(errors="replace")
    assert code == 1, out
    assert "Errno 22" not in out and "Traceback" not in out, out
    # The launcher's failure line: the worker's status is the signal, not exit code 1.
    assert "rank 0: exit code -9 (Signal 9 (SIGKILL)" in out, out

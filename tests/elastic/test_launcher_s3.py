"""``flashckpt run --storage s3://...`` against a real S3 server (SeaweedFS,
tests/support/s3fixtures.py): the machine dies whole (launcher, node agent and both ranks
SIGKILLed) and its shared memory is wiped, as on a replaced machine; the rerun resumes from S3
and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _cluster import SimCluster, assert_same_model

from flashckpt.format.storage import Storage
from flashckpt.testing.s3 import SeaweedS3

STEPS = 24
WORKER_ARGS = ["--steps", str(STEPS), "--every", "3"]
PACED = [*WORKER_ARGS, "--step-sleep", "0.1"]

pytestmark = [pytest.mark.slow]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SimCluster]:
    c = SimCluster(tmp_path, None, nnodes="1", nproc=2, worker_args=PACED)
    yield c
    c.close()


@pytest.mark.timeout(300)
def test_launcher_storage_s3_resumes_a_wiped_machine_from_s3_bitwise(
    s3_server: SeaweedS3,
    s3_prefix: str,
    s3_env: dict,
    reference_model: dict[str, torch.Tensor],
    cluster: SimCluster,
) -> None:
    """Standalone launcher, 2 ranks, ``--storage s3://ckpts/<test>/run``: once S3 holds a
    committed step the whole machine is SIGKILLed (a rank among its processes) and its shm
    directory deleted; a new launcher of the same job resumes both ranks from S3 at the newest
    committed step (not memory, not 0), runs to the end, and the final model is bitwise the
    uninterrupted run's; ``latest`` names a committed step that is the job's last."""
    url = f"{s3_prefix}/run"
    cluster.storage = url
    st = Storage(url)
    cluster.start("solo")
    cluster.wait_for("a step committed in S3", lambda: bool(cluster.committed()), 180)
    assert max(cluster.steps()) < STEPS - 6, "training ran out before the kill"
    killed_at = time.time()
    assert len(cluster.machines["solo"].kill()) >= 4  # launcher, agent, 2 ranks (+ etcd)
    newest = st.committed_steps()[-1]
    shm = cluster.shm_root / "solo"
    assert any(shm.iterdir()), "the machine kept no snapshot in memory: nothing to wipe"
    shutil.rmtree(shm)

    cluster.start("solo")
    assert cluster.wait_exit("solo", 240) == 0, cluster.logs()
    resumed = cluster.restored_since(killed_at)
    assert sorted(e["rank"] for e in resumed) == [0, 1], resumed
    assert {(e["restored_from"], e["start_step"]) for e in resumed} == {("storage", newest)}, (
        resumed,
        newest,
    )
    assert_same_model(cluster.out, reference_model)
    committed = st.committed_steps()
    assert committed[-1] == STEPS
    assert st.manifest(STEPS).ranks and sorted(st.manifest(STEPS).ranks) == [0, 1]

"""Storage features on a real S3 server (SeaweedFS, tests/support/s3fixtures.py) that
``test_s3.py`` does not run: resharding restore from ``s3://`` with the machine's memory gone.

(The launcher's ``--storage s3://`` is ``tests/elastic/test_launcher_s3.py``; ``flashckpt
ls``/``verify``/``export`` and ``flashckpt.load`` on S3 are in ``test_s3.py``.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fchelpers import FcEnv, kill_job_processes
from shardruns import assert_same_state, losses, reference
from shardruns import run as run_shards

from flashckpt.format.storage import Storage
from flashckpt.offline.reading import load_full
from flashckpt.testing.s3 import SeaweedS3

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_fsdp2_saved_by_2_ranks_to_s3_resumes_on_3_resharded_from_s3_with_memory_gone(
    s3_server: SeaweedS3, s3_prefix: str, s3_env: dict, fc_env: FcEnv, tmp_path: Path
) -> None:
    """FSDP2 on 2 ranks persists to S3 (a shard per rank); every process of the job is killed
    and its shared memory wiped; 3 ranks resume from S3, each reassembling its new piece from
    the 2 saved ones: the gathered model and optimizer state equal the saver's bitwise, the
    losses go on as the unsharded reference's, and ``load_full`` of the S3 step gathers
    the same full model."""
    url = f"{s3_prefix}/run"
    fc_env.storage = url
    run_shards(fc_env, tmp_path, "w2", 2, 6)
    st = Storage(url)
    assert st.committed_steps()[-1] == 6
    m = st.manifest(6)
    assert sorted(m.ranks) == [0, 1] and len(m.shards) == 2, m.shards

    # the machine's memory gone: its agent killed, its segments deleted
    kill_job_processes(fc_env.job)
    left = [n for n in os.listdir(fc_env.shm_dir) if n.startswith(f"fc.{fc_env.job}")]
    for n in left:
        os.unlink(os.path.join(fc_env.shm_dir, n))

    run_shards(fc_env, tmp_path, "w3", 3, 9)
    report = sorted((tmp_path / "report.txt").read_text().splitlines())
    assert report == ["0 0 None", "0 6 storage", "1 0 None", "1 6 storage", "2 6 storage"]
    # what 3 ranks reassembled from S3 is what 2 ranks held at step 6 (the file:// or DCP
    # resharding gives exactly this too: the saver's state)
    saved_path = tmp_path / "w2.log.final.safetensors"
    assert_same_state(saved_path, tmp_path / "w3.log.restored.safetensors")
    got = losses(tmp_path / "w2.log") | losses(tmp_path / "w3.log")
    ref = reference(9)
    assert sorted(got) == list(range(9))
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=1e-5, abs=1e-7), step

    # the offline reader gathers the sharded step from S3 whole
    saved = safetensors.torch.load_file(str(saved_path))
    full = load_full(url, step=6).state["model"]
    model = {k.removeprefix("model/"): v for k, v in saved.items() if k.startswith("model/")}
    assert sorted(full) == sorted(model)
    for k, v in model.items():
        assert torch.equal(full[k], v), k

"""The S3 multipart write path when the store fails in the middle (issue 41, "I/O errors stay
I/O errors on every write path, the buffers freed at once"), and an upload a killed writer left
open (issue 43): against the real S3 server, through the fault proxy
(flashckpt/testing/s3proxy.py)."""

from __future__ import annotations

import gc
import mmap
import tracemalloc
import uuid

import pytest

from flashckpt.format.objstore import PART
from flashckpt.format.storage import Storage
from flashckpt.testing.s3 import SeaweedS3
from flashckpt.testing.s3proxy import S3FaultProxy

pytestmark = pytest.mark.slow


def test_a_part_upload_failing_midway_is_an_oserror_and_frees_every_part(
    s3_server: SeaweedS3,
) -> None:
    """A shard of two parts written through ``Storage.write_buffer`` (the node agent's call)
    while the store answers the 2nd part upload with 500 InternalError, then resets the
    connection of the 2nd part upload: each surfaces as the storage error (an ``OSError``
    naming the cause; the reset's botocore error kept as ``__cause__``), not ``BufferError``;
    the error held keeps no part buffer alive (tracemalloc) and the shard's mapping closes at
    once; the upload is aborted and no object appears. Once the store heals, an upload the
    killed writer left open on the same key is aborted by the next write of it, which commits."""
    with S3FaultProxy(s3_server.endpoint) as proxy:
        opts = {
            "key": s3_server.access_key,
            "secret": s3_server.secret_key,
            "client_kwargs": {"endpoint_url": proxy.endpoint, "region_name": s3_server.region},
            # one try per request: the fault is what the write sees, not botocore's retries
            "config_kwargs": {"retries": {"max_attempts": 1}},
            "skip_instance_cache": True,
        }
        url = f"s3://ckpts/w-{uuid.uuid4().hex[:10]}"
        st = Storage(url, storage_options=opts)
        path = st.path("step-000000001", "shard-n0.bin")
        bucket, key = "ckpts", path.partition("/")[2]
        size = PART + (3 << 20)  # two parts: 32 MiB and 3 MiB (and the head)
        shard = mmap.mmap(-1, size)
        shard[:] = bytes(range(256)) * (size // 256)
        head = b"H" * 4096

        def write() -> OSError:
            view = memoryview(shard)
            try:
                with pytest.raises(OSError) as got:
                    st.write_buffer(path, head, view)
            finally:
                view.release()
            return got.value

        # -- 500 on the 2nd part ------------------------------------------------------------
        st.fs.pipe_file(st.path("warm"), b"w")  # the client made, its models loaded
        proxy.fail(500, op="UploadPart", after=1)
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            err = write()
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        assert not isinstance(err, BufferError)
        assert "internal error" in str(err).lower(), repr(err)
        # the error held here keeps neither part (32 MiB and 3 MiB copies) alive
        assert held < (2 << 20), held
        assert proxy.faulted >= 1 and proxy.counts["AbortMultipartUpload"] >= 1

        # -- the connection reset on the 2nd part --------------------------------------------
        proxy.reset(op="UploadPart", after=1)
        err = write()
        assert isinstance(err, ConnectionError), repr(err)
        assert path in str(err) and "ConnectionClosedError" in str(err), str(err)
        assert type(err.__cause__).__name__ == "ConnectionClosedError"
        proxy.heal()

        shard_closes = shard.close  # no view of the shard survives either failure
        shard_closes()
        assert not st.fs.exists(path)
        fs = s3_server.filesystem()
        assert (
            fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads", []) == []
        ), "a failed write left its upload open"

        # -- an upload a killed writer left open, then the next write of that step -----------
        left = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        fs.call_s3(
            "upload_part",
            Bucket=bucket,
            Key=key,
            UploadId=left,
            PartNumber=1,
            Body=b"x" * (5 << 20),
        )
        data = bytearray(b"d" * (PART + 4096))
        rec = st.write_buffer(path, head, memoryview(data))
        assert rec.size == len(head) + len(data)
        assert fs.cat_file(f"ckpts/{key}") == head + bytes(data)
        uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
        assert uploads.get("Uploads", []) == [], uploads


def test_an_absent_bucket_is_refused_at_entry_and_not_created(s3_server: SeaweedS3) -> None:
    """The entry probe (``probe_storage``'s round trip) refuses a bucket that does not exist,
    naming it and the fix, and does not create it (SeaweedFS would on the first PUT); a wrong
    endpoint is reported as the connection failure it is, not as a missing bucket."""
    from flashckpt.format.storage_owner import probe_round_trip

    name = f"nosuch-{uuid.uuid4().hex[:8]}"
    opts = {**s3_server.storage_options(), "skip_instance_cache": True}
    st = Storage(f"s3://{name}/run", storage_options=opts)
    got = probe_round_trip(st, st.path(".probe"))
    assert got is not None and f"the bucket {name!r} does not exist" in got, got
    assert "create it" in got
    assert name not in {b.rstrip("/") for b in s3_server.filesystem().ls("", detail=False)}
    wrong = {
        **opts,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }
    st = Storage("s3://ckpts/run", storage_options=wrong)
    got = probe_round_trip(st, st.path(".probe"))
    assert got is not None and "Could not connect" in got and "does not exist" not in got, got

"""The S3 server the object-storage tests run against (flashckpt/testing/s3.py), and what the
commit protocol relies on from an object store (docs/persistence.md, "What the store must
provide"): checked on the real server, so a store that breaks them fails here first."""

from __future__ import annotations

import os
import uuid

import pytest

from flashckpt.format.storage import Storage
from flashckpt.testing.s3 import SeaweedS3


def test_store_contract_the_commit_protocol_relies_on(s3_server: SeaweedS3, s3_env: dict) -> None:
    """Read-after-write of a PUT (a new object is readable and listed at once, also by another
    client), an overwrite seen whole by the next read, a delete seen by the next listing, a
    multipart upload invisible until completed, and ``If-None-Match: *`` (s3fs ``mode="xb"``)
    refusing to replace an object; flashckpt's ``Storage`` seeing another client's writes."""
    fs = s3_server.filesystem()
    other = s3_server.filesystem()  # a second client: another process's view
    prefix = f"ckpts/contract-{uuid.uuid4().hex[:8]}"

    # read-after-write of a new object, and list-after-write, from another client
    fs.pipe_file(f"{prefix}/step-000000001/manifest.json", b'{"a": 1}')
    assert other.cat_file(f"{prefix}/step-000000001/manifest.json") == b'{"a": 1}'
    assert other.ls(prefix, detail=False) == [f"{prefix}/step-000000001"]
    # an overwrite is seen whole by the next read
    fs.pipe_file(f"{prefix}/latest", b"x" * 100)
    fs.pipe_file(f"{prefix}/latest", b"y" * 7)
    assert other.cat_file(f"{prefix}/latest") == b"y" * 7
    # a delete is seen by the next listing and read
    fs.rm(f"{prefix}/step-000000001/manifest.json")
    assert not other.exists(f"{prefix}/step-000000001/manifest.json")
    listed = other.find(prefix)
    assert f"{prefix}/step-000000001/manifest.json" not in listed
    assert f"{prefix}/latest" in listed
    # (SeaweedFS may keep the emptied "directory" listed a while: flashckpt counts a step
    # directory without a manifest as not committed, never the other way.)

    # a multipart upload: no object until completed, listed as an upload meanwhile
    key = f"{prefix.split('/', 1)[1]}/step-000000002/shard.safetensors"
    up = fs.call_s3("create_multipart_upload", Bucket="ckpts", Key=key)
    part = os.urandom(5 << 20)
    etag = fs.call_s3(
        "upload_part", Bucket="ckpts", Key=key, UploadId=up["UploadId"], PartNumber=1, Body=part
    )["ETag"]
    assert not other.exists(f"ckpts/{key}")
    assert [u["Key"] for u in s3_server.multipart_uploads("ckpts", key)] == [key]
    fs.call_s3(
        "complete_multipart_upload",
        Bucket="ckpts",
        Key=key,
        UploadId=up["UploadId"],
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]},
    )
    assert other.cat_file(f"ckpts/{key}") == part
    assert s3_server.multipart_uploads("ckpts", key) == []

    # If-None-Match: * (exclusive create): the second create of a key is refused
    with fs.open(f"{prefix}/owner", "xb") as f:
        f.write(b"first")
    with pytest.raises(OSError, match="pre-conditions"), fs.open(f"{prefix}/owner", "xb") as f:
        f.write(b"second")
    assert other.cat_file(f"{prefix}/owner") == b"first"

    # and flashckpt's Storage reaches it from the standard environment variables alone, and
    # sees what another client committed after its own first listing (no listing cache)
    st = Storage(f"s3://{prefix}")
    assert st.fs.cat_file(f"{prefix}/owner") == b"first"
    assert st.committed_steps() == []
    other.pipe_file(f"{prefix}/step-000000003/manifest.json", b"{}")
    assert st.committed_steps() == [3]

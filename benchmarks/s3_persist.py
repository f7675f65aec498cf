"""Persisting a shard to S3: flashckpt's shard write against what the store takes.

A real S3 server on loopback (SeaweedFS, ``flashckpt.testing.s3``); the same bytes (``--gib``
GiB, in memory) uploaded, in interleaved rounds (the machine is shared, so each round runs every
variant once, in turn):

- ``product``: the node agent's shard write, ``Storage.write_buffer`` (head + data from a
  memoryview, hashed as it goes), to ``s3://ckpts/...``;
- ``plain``: one plain ``s3fs`` upload (``fs.open(key, "wb").write(data)``);
- ``limit``: a parallel multipart upload straight through the S3 API (``--parts`` MiB parts,
  ``--concurrency`` at a time): the store's best;
- ``read-product`` / ``read-plain``: reading the object back with ``Storage.read_file`` (what
  restore does, checking the hash) and with one plain ``s3fs`` ``cat_file``.

torch DCP's ``async_save`` through fsspec (the peer the issue names) is not measured yet.

Output: JSON with every round's seconds, medians, MB/s and the ratios to ``limit``. Example::

    python benchmarks/s3_persist.py --gib 1 --rounds 3 --out benchmarks/runs/s3-persist.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine_info, median

from flashckpt.format.manifest import FileEntry
from flashckpt.format.storage import Storage
from flashckpt.testing.s3 import SeaweedS3


def _limit(fs: Any, key: str, data: memoryview, part: int, concurrency: int) -> None:
    """A parallel multipart upload of ``data`` to ``ckpts/key`` through s3fs's client."""

    async def run() -> None:
        s3 = await fs.get_s3()
        up = await s3.create_multipart_upload(Bucket="ckpts", Key=key)
        sem = asyncio.Semaphore(concurrency)

        async def one(n: int, off: int) -> dict[str, Any]:
            async with sem:
                r = await s3.upload_part(
                    Bucket="ckpts",
                    Key=key,
                    UploadId=up["UploadId"],
                    PartNumber=n,
                    Body=bytes(data[off : off + part]),
                )
                return {"PartNumber": n, "ETag": r["ETag"]}

        parts = await asyncio.gather(
            *(one(i + 1, off) for i, off in enumerate(range(0, len(data), part)))
        )
        await s3.complete_multipart_upload(
            Bucket="ckpts", Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts}
        )

    from fsspec.asyn import sync

    sync(fs.loop, run)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="bytes per upload, GiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parts", type=int, default=32, help="limit: part size, MiB")
    p.add_argument("--concurrency", type=int, default=8, help="limit: parts in flight")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    n = int(a.gib * (1 << 30))
    buf = mmap.mmap(-1, n)
    rnd = os.urandom(1 << 20)
    for off in range(0, n, 1 << 20):
        buf[off : off + (1 << 20)] = rnd[: min(1 << 20, n - off)]
    data = memoryview(buf)
    head = b"\0" * 4096
    times: dict[str, list[float]] = {
        k: [] for k in ("product", "plain", "limit", "read-product", "read-plain")
    }
    with tempfile.TemporaryDirectory(prefix="s3bench") as tmp, SeaweedS3(tmp) as server:
        os.environ.update(server.env())
        fs = server.filesystem()
        st = Storage("s3://ckpts/bench")
        load0 = os.getloadavg()
        for r in range(a.rounds):
            t = time.perf_counter()
            rec = st.write_buffer(st.step_path(r, "shard-00000-of-00001.safetensors"), head, data)
            times["product"].append(time.perf_counter() - t)
            t = time.perf_counter()
            with fs.open(f"ckpts/plain/{r}", "wb") as f:
                f.write(data)
            times["plain"].append(time.perf_counter() - t)
            t = time.perf_counter()
            _limit(fs, f"limit/{r}", data, a.parts << 20, a.concurrency)
            times["limit"].append(time.perf_counter() - t)
            # restore's read: checked against the manifest's size and hash
            # (read_file looks up the file's entry only)
            manifest = SimpleNamespace(
                files={"shard-00000-of-00001.safetensors": FileEntry(rec.size, rec.xxh3_64)}
            )
            t = time.perf_counter()
            st.read_file(r, "shard-00000-of-00001.safetensors", manifest)  # type: ignore[arg-type]
            times["read-product"].append(time.perf_counter() - t)
            t = time.perf_counter()
            fs.cat_file(f"ckpts/plain/{r}")
            times["read-plain"].append(time.perf_counter() - t)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
            fs.rm(f"ckpts/plain/{r}")
            fs.rm(f"ckpts/limit/{r}")
            st.fs.rm(st.step_path(r), recursive=True)
        load1 = os.getloadavg()
    med = {k: median(v) for k, v in times.items()}
    out = {
        "benchmark": "s3_persist",
        "bytes": n,
        "rounds": a.rounds,
        "limit_settings": {"part_mib": a.parts, "concurrency": a.concurrency},
        "seconds": times,
        "median_s": med,
        "mb_per_s": {k: n / v / 1e6 for k, v in med.items() if v},
        "ratio_to_limit": {
            k: med[k] / med["limit"] for k in ("product", "plain") if med[k] and med["limit"]
        },
        "ratio_read_product_to_plain": (
            med["read-product"] / med["read-plain"] if med["read-plain"] else None
        ),
        "loadavg_before_after": [load0, load1],
        "machine": machine_info(),
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

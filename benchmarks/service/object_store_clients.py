"""Upload and download of one large object with obstore and with boto3, against a local S3 server.

    python benchmarks/object_store_clients.py --endpoint http://127.0.0.1:PORT --mib 100 --runs 3

Both clients stream from and to a file on disk (multipart upload, parts of 8 MiB); the numbers are the median
wall time of `--runs` runs each. Start the server first, e.g. `python -m moto.server -H 127.0.0.1 -p PORT`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

PART_BYTES = 8 * 1024 * 1024


def _obstore(endpoint: str, bucket: str):
    from obstore.store import S3Store

    store = S3Store(
        bucket, endpoint=endpoint, region="us-east-1", access_key_id="test", secret_access_key="test",
        client_options={"allow_http": True},
    )  # fmt: skip
    import obstore

    def upload(path: Path, key: str) -> None:
        with open(path, "rb") as handle:
            obstore.put(store, key, handle, chunk_size=PART_BYTES, max_concurrency=4)

    def download(key: str, path: Path) -> None:
        with open(path, "wb") as handle:
            for chunk in obstore.get(store, key).stream(min_chunk_size=PART_BYTES):
                handle.write(chunk)

    return upload, download


def _boto3(endpoint: str, bucket: str):
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
        aws_secret_access_key="test",
    )  # fmt: skip
    config = TransferConfig(multipart_chunksize=PART_BYTES, max_concurrency=4)

    def upload(path: Path, key: str) -> None:
        client.upload_file(str(path), bucket, key, Config=config)

    def download(key: str, path: Path) -> None:
        client.download_file(bucket, key, str(path), Config=config)

    return upload, download


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--bucket", default="fusetune-bench")
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    import boto3

    boto3.client(
        "s3", endpoint_url=args.endpoint, region_name="us-east-1", aws_access_key_id="test",
        aws_secret_access_key="test",
    ).create_bucket(Bucket=args.bucket)  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "source.bin"
        source.write_bytes(os.urandom(args.mib * 1024 * 1024))
        for name, factory in (("obstore", _obstore), ("boto3", _boto3)):
            upload, download = factory(args.endpoint, args.bucket)
            up, down = [], []
            for run in range(args.runs):
                key = f"{name}/{run}.bin"
                start = time.perf_counter()
                upload(source, key)
                up.append(time.perf_counter() - start)
                target = Path(scratch) / f"{name}-{run}.bin"
                start = time.perf_counter()
                download(key, target)
                down.append(time.perf_counter() - start)
                assert target.stat().st_size == source.stat().st_size
                target.unlink()
            print(
                f"{name:8s} {args.mib} MiB: upload {statistics.median(up):.2f} s "
                f"({args.mib / statistics.median(up):.0f} MiB/s), download {statistics.median(down):.2f} s "
                f"({args.mib / statistics.median(down):.0f} MiB/s); runs up {[round(t, 2) for t in up]} "
                f"down {[round(t, 2) for t in down]}"
            )


if __name__ == "__main__":
    main()

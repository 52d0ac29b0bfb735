"""The S3 test server and the latency proxy in tests/objectstore.py work as the object-storage tests assume."""

from __future__ import annotations

import collections
import time

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from tests.objectstore import LatencyProxy, S3Server


def test_server_round_trips_parquet(s3_server: S3Server) -> None:
    s3_server.make_bucket("round-trip")
    fs = s3_server.filesystem()
    table = pa.table({"id": pa.array(range(1000), pa.int64()), "name": [f"row {i}" for i in range(1000)]})
    pq.write_table(table, "round-trip/x/part.parquet", filesystem=fs, row_group_size=100)

    infos = fs.get_file_info(pafs.FileSelector("round-trip/x", recursive=True))
    assert [(info.path, info.type) for info in infos] == [("round-trip/x/part.parquet", pafs.FileType.File)]
    assert infos[0].size > 0
    assert pq.read_table("round-trip/x/part.parquet", filesystem=fs).equals(table)
    assert pq.ParquetFile(fs.open_input_file("round-trip/x/part.parquet")).num_row_groups == 10


def test_latency_proxy_delays_and_counts_requests(s3_server: S3Server) -> None:
    s3_server.make_bucket("proxied")
    with s3_server.filesystem().open_output_stream("proxied/blob") as out:
        out.write(b"x" * 1000)
    delay = 0.05
    with LatencyProxy(s3_server.host, s3_server.port, delay=delay) as proxy:
        fs = s3_server.filesystem(endpoint=proxy.endpoint)
        start = time.monotonic()
        info = fs.get_file_info("proxied/blob")
        elapsed = time.monotonic() - start
        assert info.size == 1000
        # The request goes one way and the response comes back the other, each held for the delay.
        assert elapsed >= 2 * delay
        assert proxy.requests == collections.Counter(HEAD=1)
        assert proxy.connections == 1

        proxy.reset()
        with fs.open_input_stream("proxied/blob") as stream:
            assert stream.read() == b"x" * 1000
        assert proxy.requests == collections.Counter(HEAD=1, GET=1)

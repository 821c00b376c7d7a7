"""Shuffled reads of a parquet file through the data source: each row group kept decoded (the
default cache) against a cache of none, which decodes a row's whole group for every row (what
reading by row group costs without one). Writes a synthetic file of `--rows` rows holding a
`--kb` kB image each, in groups of `--group` rows, then reads them once in a shuffled order.

    python bench/parquet_rows.py [--rows 2000] [--kb 100] [--group 1000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxvrl.data.sources import ParquetSource


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--kb", type=int, default=100)
    ap.add_argument("--group", type=int, default=1000)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.parquet")
        images = [[{"bytes": rng.bytes(a.kb * 1000), "path": None}] for _ in range(a.rows)]
        table = pa.table({"images": images, "problem": [f"q{i}" for i in range(a.rows)]})
        pq.write_table(table, path, row_group_size=a.group)
        order = [int(i) for i in rng.permutation(a.rows)]
        print(f"{a.rows} rows of {a.kb} kB, row groups of {a.group}, one shuffled epoch")
        times = {}
        for name, cache in (("kept groups (default)", 1 << 30), ("no cache", 0)):
            src = ParquetSource(path, cache_bytes=cache)
            start = time.perf_counter()
            for i in order:
                src[i]
            times[name] = (time.perf_counter() - start) / a.rows * 1000
            print(f"  {name}: {times[name]:.2f} ms a row")
        ratio = times["no cache"] / times["kept groups (default)"]
        print(f"  kept groups are {ratio:.0f}x faster")


if __name__ == "__main__":
    main()

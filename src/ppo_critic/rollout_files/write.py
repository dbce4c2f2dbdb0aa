"""Per-token values written back (`ppo-critic values`): one row per input row, the whole file or nothing."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

from ppo_critic.rollout_files.read import file_format, import_parquet
from ppo_critic.run.files import write_with


def write_values(path: str | os.PathLike, values: Sequence[Sequence[float]], replace: bool = True) -> None:
    """Atomically write one `{"row": i, "values": [...]}` row per input row as `.jsonl` or `.parquet`; `replace=False`
    refuses a `path` another writer created meanwhile (`run.files.write_with`)."""
    writer = _write_jsonl if file_format(os.fspath(path)) == ".jsonl" else _write_parquet
    rows = _value_rows(values)
    write_with(path, lambda tmp: writer(str(tmp), rows), replace)


def _value_rows(values: Sequence[Sequence[float]]) -> list[list[float]]:
    rows = []
    for i, row in enumerate(values):
        floats = [float(v) for v in row]
        bad = [j for j, v in enumerate(floats) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"values[{i}] has {len(bad)} NaN/Inf value(s) (first at position {bad[0]})")
        rows.append(floats)
    return rows


def _write_jsonl(path: str, rows: list[list[float]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"row": i, "values": row}) + "\n")


def _write_parquet(path: str, rows: list[list[float]]) -> None:
    import pyarrow as pa

    pq = import_parquet()
    table = pa.table(
        {
            "row": pa.array(range(len(rows)), type=pa.int64()),
            "values": pa.array(rows, type=pa.list_(pa.float64())),
        }
    )
    pq.write_table(table, path)

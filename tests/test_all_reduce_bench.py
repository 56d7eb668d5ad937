"""``bench/all_reduce_bench.py`` where it cannot run (too few GPUs: one line, status 2,
no file) and its table; the timing itself runs on a GPU host only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import all_reduce_bench


def test_too_few_gpus_is_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = tmp_path / "ar.json"
    assert all_reduce_bench.main(["--world-sizes", str(have + 1), "--out", str(out)]) == 2
    assert all_reduce_bench.main(["--world-sizes", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("need 2 or more CUDA GPUs" in line for line in err)
    assert not out.exists()


def test_table_marks_what_did_not_run() -> None:
    row = {"rows": 64, "hidden": 8192, "bytes": 64 * 8192 * 2, "nccl_graph_us": 12.34, "nccl_eager_us": 30.0,
           "one_shot_graph_us": 6.5, "one_shot_eager_us": 15.25}
    big = {"rows": 256, "hidden": 8192, "bytes": 256 * 8192 * 2, "nccl_graph_us": 40.0, "nccl_eager_us": 55.0}
    lines = all_reduce_bench.table({"runs": [{"world_size": 4, "rows": [row, big]}]}).splitlines()
    assert lines[2] == "| 4 | 64 x 8192 (1024 KiB) | 6.5 µs | 12.3 µs | 15.2 µs | 30.0 µs |"
    assert lines[3] == "| 4 | 256 x 8192 (4096 KiB) | - | 40.0 µs | - | 55.0 µs |"

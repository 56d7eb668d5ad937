"""bench/kernel_profile.py's trace arithmetic on a hand-made chrome trace: kinds by kernel
name, busy and idle time, gaps by their neighbours, matmul time by launching operator and
shapes (CUDA-graph launches under ``graph``), and the side-by-side table."""

from __future__ import annotations

import json

from bench.kernel_profile import compare, kind_of, matmul_by_shape, summarize


def _kernel(name: str, ts: float, dur: float, ext: int | None = None) -> dict:
    args = {} if ext is None else {"External id": ext}
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": args}


def test_kinds_follow_the_kernel_names() -> None:
    assert kind_of("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "matmul"
    assert kind_of("_gemv_kernel") == "matmul"
    assert kind_of("_paged_attn_kernel") == "attention"
    assert kind_of("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>") == "attention"
    assert kind_of("_add_rms_norm_kernel") == "norm"
    assert kind_of("triton_poi_fused_mul_silu_slice_1") == "activation"
    assert kind_of("_rotary_kernel") == "rotary"
    assert kind_of("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert kind_of("triton_poi_fused_3") == "other"


def test_summary_sums_busy_idle_kinds_and_shapes() -> None:
    events = [
        {"cat": "cpu_op", "name": "aten::mm", "args": {"External id": 7, "Input Dims": [[16, 64], [64, 32]]}},
        _kernel("nvjet_a_TNN", 0.0, 1000.0, ext=7),
        _kernel("nvjet_a_TNN", 1500.0, 1000.0, ext=7),  # 500 us idle before it
        _kernel("_paged_attn_kernel", 2502.0, 400.0),  # 2 us: under the gap threshold
        _kernel("nvjet_b_TNT", 2932.0, 100.0),  # 30 us; launched by a graph replay: no operator
        {"cat": "cpu_op", "name": "aten::add", "ts": 0.0, "dur": 999.0, "args": {"External id": 8}},
    ]
    res = summarize(events, min_gap_us=5.0, top=10)
    assert res["gpu_span_ms"] == 3.03
    assert res["gpu_busy_ms"] == 2.5
    assert res["gaps_ms"] == 0.53  # 500 + 30 us; the 2-us one left out
    assert res["kinds_ms"] == {"matmul": 2.1, "attention": 0.4}
    assert res["gaps_by_neighbours_ms"] == [["nvjet_a_TNN", "nvjet_a_TNN", 0.5, 1, 0.5],
                                            ["_paged_attn_kernel", "nvjet_b_TNT", 0.03, 1, 0.03]]
    by_shape = matmul_by_shape(events, sorted((e for e in events if e["cat"] == "kernel"), key=lambda e: e["ts"]))
    assert by_shape == [["aten::mm", json.dumps([[16, 64], [64, 32]]), 2.0, 2, ["nvjet_a_TNN"]],
                        ["graph", "", 0.1, 1, ["nvjet_b_TNT"]]]


def test_a_trace_without_gpu_events_says_so_and_compares(tmp_path) -> None:
    assert summarize([{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}], 5.0, 10) == {
        "error": "no GPU events in the trace"}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"engine": "inferq", "wall_ms": 10.0, "kinds_ms": {"matmul": 5.0}}))
    b.write_text(json.dumps({"engine": "vllm", "wall_ms": 9.0, "kinds_ms": {"matmul": 4.0, "other": 1.0}}))
    table = compare([str(a), str(b)])
    assert "| | inferq | vllm |" in table
    assert "| wall ms (profiled) | 10.0 | 9.0 |" in table
    assert "| matmul | 5.0 | 4.0 |" in table
    assert "| other | 0.0 | 1.0 |" in table
    assert "| GPU busy ms | - | - |" in table

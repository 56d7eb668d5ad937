"""Time the Triton paged attention (and the PyTorch reference) on Qwen2.5-7B head shapes.

Decode: batch 1..128 at context 320 and 2048; prefill: one sequence of 512 and 2048 new
tokens. Each timing replays a CUDA graph of several calls, each over its own set of
blocks so that the KV read comes from HBM, not L2 (the sets together span > 4x L2).
Reports bytes moved and achieved bandwidth against a device copy measured in the same
run, and attention FLOP/s. Writes JSON to --out.

Run: python bench/kernel_bench.py --out bench/results/kernels_h100.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.gpu_facts import num_sms
from kernels.paged_attention import _attention_config, paged_attention, paged_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 28, 4, 128, 16
DTYPE = torch.bfloat16


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy, counting bytes read plus written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) * 1e-3) / 1e9


def build(seqs: list[tuple[int, int]], num_sets: int) -> dict:
    """num_sets disjoint copies of the batch's block tables over one pool."""
    nbs = [-(-s // BLOCK_SIZE) for _, s in seqs]
    per_set = sum(nbs)
    pool = per_set * num_sets
    k_cache = torch.randn(pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(pool, device="cuda").int()
    tables = []
    for s in range(num_sets):
        t = torch.zeros(len(seqs), max(nbs), dtype=torch.int32, device="cuda")
        o = s * per_set
        for i, n in enumerate(nbs):
            t[i, :n] = perm[o : o + n]
            o += n
        tables.append(t)
    q_lens = [a for a, _ in seqs]
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([s for _, s in seqs], dtype=torch.int32, device="cuda")
    return {
        "q": q,
        "k": k_cache,
        "v": v_cache,
        "tables": tables,
        "qsl": qsl,
        "seq_lens": seq_lens,
        "out": torch.empty_like(q),
        "max_q": max(q_lens),
        "max_s": max(s for _, s in seqs),
    }


def time_graph(fn_list, reps: int = 20) -> float:
    """Mean seconds per call of a CUDA graph replaying every fn in fn_list once."""
    for fn in fn_list:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fn_list:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3 / (reps * len(fn_list))


def time_eager(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def bench_case(kind: str, seqs: list[tuple[int, int]], copy_gbs: float, l2_bytes: int, with_ref: bool) -> dict:
    elt = torch.finfo(DTYPE).bits // 8
    kv_bytes = sum(s for _, s in seqs) * NUM_KV_HEADS * HEAD_DIM * 2 * elt
    qo_bytes = 2 * sum(a for a, _ in seqs) * NUM_HEADS * HEAD_DIM * elt
    moved = kv_bytes + qo_bytes
    num_sets = max(1, min(400, math.ceil(4 * l2_bytes / kv_bytes)))
    b = build(seqs, num_sets)
    scale = HEAD_DIM**-0.5

    def call(tables):
        return lambda: paged_attention(
            b["q"],
            b["k"],
            b["v"],
            tables,
            b["qsl"],
            b["seq_lens"],
            scale,
            b["out"],
            max_query_len=b["max_q"],
            max_seq_len=b["max_s"],
        )

    t = time_graph([call(t) for t in b["tables"]])
    # Causal attention FLOPs: 2 matmuls x 2 flops x visible (query, key) pairs x heads x head_dim.
    pairs = sum(sum(s - a + j + 1 for j in range(a)) for a, s in seqs)
    flops = 4 * pairs * NUM_HEADS * HEAD_DIM
    cfg = _attention_config(
        DTYPE,
        NUM_HEADS // NUM_KV_HEADS,
        len(seqs),
        NUM_KV_HEADS,
        b["max_q"],
        b["max_s"],
        num_sms(torch.device("cuda")),
    )
    row = {
        "kind": kind,
        "batch": len(seqs),
        "query_len": seqs[0][0],
        "context": seqs[0][1],
        "triton_us": round(t * 1e6, 2),
        "bytes_moved": moved,
        "achieved_gbs": round(moved / t / 1e9, 1),
        "frac_of_copy_bw": round(moved / t / 1e9 / copy_gbs, 3),
        "tflops": round(flops / t / 1e12, 2),
        "num_splits": cfg["NUM_SPLITS"],
        "block_m": cfg["BLOCK_M"],
        "l2_sets": num_sets,
    }
    if with_ref:
        ref = time_eager(
            lambda: paged_attention_ref(
                b["q"], b["k"], b["v"], b["tables"][0], b["qsl"], b["seq_lens"], scale, b["out"]
            )
        )
        row["torch_ref_us"] = round(ref * 1e6, 1)
        row["speedup_vs_ref"] = round(ref / t, 1)
        out = torch.empty_like(b["q"])
        paged_attention(
            b["q"],
            b["k"],
            b["v"],
            b["tables"][0],
            b["qsl"],
            b["seq_lens"],
            scale,
            out,
            max_query_len=b["max_q"],
            max_seq_len=b["max_s"],
        )
        ref_out = paged_attention_ref(b["q"], b["k"], b["v"], b["tables"][0], b["qsl"], b["seq_lens"], scale)
        row["rel_err_vs_ref"] = float(f"{((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item():.2e}")
    print(json.dumps(row), flush=True)
    b.clear()  # frees the buffers before the next case
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/kernels_h100.json")
    ap.add_argument("--no-ref", action="store_true", help="skip timing the PyTorch reference")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    copy_gbs = copy_bandwidth_gbs()
    print(
        f"device {props.name}, {props.multi_processor_count} SMs, L2 {l2_bytes >> 20} MiB, "
        f"copy {copy_gbs:.0f} GB/s (read + write)",
        flush=True,
    )
    rows = []
    for context in (320, 2048):
        for batch in (1, 8, 32, 64, 128):
            rows.append(bench_case("decode", [(1, context)] * batch, copy_gbs, l2_bytes, not args.no_ref))
    rows.append(bench_case("decode", [(1, 8192)], copy_gbs, l2_bytes, not args.no_ref))
    for n in (512, 2048):
        rows.append(bench_case("prefill", [(n, n)], copy_gbs, l2_bytes, not args.no_ref))
    rows.append(bench_case("mixed", [(512, 1024)] + [(1, 2048)] * 31, copy_gbs, l2_bytes, not args.no_ref))
    result = {
        "device": props.name,
        "num_sms": props.multi_processor_count,
        "copy_gbs": round(copy_gbs, 1),
        "torch": torch.__version__,
        "dtype": str(DTYPE),
        "num_heads": NUM_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "block_size": BLOCK_SIZE,
        "timing": "CUDA-graph replay, KV sets spanning > 4x L2; torch_ref_us is eager wall time",
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

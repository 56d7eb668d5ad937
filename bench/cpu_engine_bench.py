"""CPU benchmark of the in-house engine's parts on SmolLM2-135M-Instruct (float32).

Sections (``--sections``, comma-separated; default all):
  hw       float32 rate of a 2048 x 576 x 3072 matrix product (GFLOP/s) and copy
           bandwidth (GB/s, read + write): the state of a shared machine at run time.
  linear   ``F.linear`` (MKL, repacks the weight per call) against the oneDNN-prepacked
           weight of ``worker/models/linear.py`` for the model's four projection shapes
           and the tied LM head, at 1, 16, 64, 256 and 2048 rows: ms per call.
  attention  one layer's decode attention, SmolLM2's heads (9 query, 3 KV, 64 dims),
           block size 16, batch 1 and 16 at 64, 320 and 1024 context tokens: the PyTorch
           reference (``index_select`` gather + SDPA) against the C++ kernel of
           ``kernels/cpu_attention.py``, ms per call and the kernel's K/V read rate (GB/s).
  elementwise  SiLU-and-mul ([rows, 2 x 1536]), residual add + RMSNorm ([rows, 576]) and
           rotary (9 + 3 heads of 64, strided in a QKV row) at 16 and 2048 rows: the
           PyTorch reference against the public wrapper (the C++ kernel on CPU), ms.
  engine   the offline engine on 16 prompts of 256 random tokens, 64 output tokens
           (greedy, ignore_eos): the two 2048-token prefill steps (ms each), the median
           decode step (ms, batch 16) and output tok/s: on the PyTorch reference kernels
           with weights packed for no step (MKL only), for steps of up to 256 rows and for
           all steps, then all packed with the C++ CPU kernels (attention, RMSNorm,
           rotary, SiLU-and-mul); and the limit that ``choose_max_rows`` picks here.

Run: python -m bench.cpu_engine_bench --out bench/results/cpu_engine.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from datetime import date
from typing import Any

import torch
import torch.nn.functional as F

from bench.host import cpu_description
from worker.models import linear as linear_mod

MODEL = "SmolLM2-135M-Instruct"
ROWS = (1, 16, 64, 256, 2048)
#: (name, out_features, in_features) of SmolLM2-135M's weights.
SHAPES = (("qkv_proj", 960, 576), ("o_proj", 576, 576), ("gate_up_proj", 3072, 576),
          ("down_proj", 576, 1536), ("lm_head", 49152, 576))


def _time_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of ``fn`` over ``repeat`` calls after one warm-up, ms."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def bench_hw() -> dict[str, float]:
    a, b = torch.randn(2048, 576), torch.randn(3072, 576)
    ms = _time_ms(lambda: F.linear(a, b), 10)
    src = torch.randn(64 * 1024 * 1024)
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src), 5)
    return {"gemm_gflops": 2 * 2048 * 576 * 3072 / ms / 1e6, "copy_gb_s": 2 * src.numel() * 4 / copy_ms / 1e6}


def bench_linear() -> list[dict[str, Any]]:
    rows_out = []
    for name, n, k in SHAPES:
        weight = torch.randn(n, k)
        packed = linear_mod.pack_weight(weight)
        for m in ROWS:
            x = torch.randn(m, k)
            repeat = 5 if m * n >= 2048 * 3072 else 20
            mkl = _time_ms(lambda x=x, w=weight: F.linear(x, w), repeat)
            onednn = _time_ms(lambda x=x, p=packed.tensor: linear_mod.packed_linear(x, p), repeat)
            rows_out.append({"weight": name, "out": n, "in": k, "rows": m, "mkl_ms": mkl, "onednn_packed_ms": onednn,
                             "speedup": mkl / onednn})
            print(json.dumps(rows_out[-1]), flush=True)
    return rows_out


def bench_attention() -> list[dict[str, Any]]:
    rows_out = []
    for batch in (1, 16):
        for ctx in (64, 320, 1024):
            rows_out.append(_attention_case(batch, ctx))
            print(json.dumps(rows_out[-1]), flush=True)
    return rows_out


def _attention_case(batch: int, ctx: int) -> dict[str, Any]:
    """One layer's decode attention for ``batch`` sequences of ``ctx`` tokens each."""
    from kernels import cpu_attention
    from kernels.paged_attention import paged_attention_ref

    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    num_blocks = -(-ctx // block_size)
    pool = batch * num_blocks + 1
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(pool)[:batch * num_blocks].view(batch, num_blocks).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    idx = torch.arange(batch, dtype=torch.int32)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    ref = _time_ms(lambda: paged_attention_ref(q, k_cache, v_cache, tables, qsl, seq_lens, scale), 50)
    kernel = _time_ms(lambda: cpu_attention.decode_attention(out, q, k_cache, v_cache, tables, seq_lens,
                                                             idx, idx, scale), 50)
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * 4
    return {"batch": batch, "context": ctx, "reference_ms": ref, "kernel_ms": kernel, "speedup": ref / kernel,
            "kernel_kv_gb_s": kv_bytes / kernel / 1e6}


def bench_elementwise() -> list[dict[str, Any]]:
    rows_out = []
    for rows in (16, 2048):
        for name, (ref, kernel) in _elementwise_cases(rows).items():
            ref_ms, kernel_ms = _time_ms(ref, 20), _time_ms(kernel, 20)
            rows_out.append({"op": name, "rows": rows, "reference_ms": ref_ms, "kernel_ms": kernel_ms,
                             "speedup": ref_ms / kernel_ms})
            print(json.dumps(rows_out[-1]), flush=True)
    return rows_out


def _elementwise_cases(rows: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """(reference, wrapper) calls of each element-wise op on ``rows`` rows of SmolLM2's shapes."""
    from kernels.fused_add_rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref
    from kernels.rotary import rotary, rotary_ref
    from kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

    gate_up = torch.randn(rows, 2 * 1536)
    hidden, residual, weight = torch.randn(rows, 576), torch.randn(rows, 576), torch.rand(576)
    qkv = torch.randn(rows, 15 * 64)
    q, k = qkv[:, :576].view(rows, 9, 64), qkv[:, 576:768].view(rows, 3, 64)
    table, positions = torch.randn(4096, 64), torch.randint(0, 4096, (rows,))
    return {"silu_and_mul": (lambda: silu_and_mul_ref(gate_up), lambda: silu_and_mul(gate_up)),
            "fused_add_rms_norm": (lambda: fused_add_rms_norm_ref(hidden, residual, weight, 1e-5),
                                   lambda: fused_add_rms_norm(hidden, residual, weight, 1e-5)),
            "rotary": (lambda: rotary_ref(positions, q, k, table, table),
                       lambda: rotary(positions, q, k, table, table))}


def _chosen_max_rows() -> int | str:
    """What ``choose_max_rows`` picks here for SmolLM2's MLP weight (gate_up, 3072 x 576)."""
    rows = linear_mod.choose_max_rows(torch.randn(3072, 576))
    return "all" if rows == linear_mod.UNLIMITED_ROWS else rows


def bench_engine(max_rows: int, attention_backend: str = "auto") -> dict[str, Any]:
    """The offline engine with its weights packed for steps of up to ``max_rows`` rows
    (0: ``F.linear`` everywhere) and the given attention backend (``torch``: the PyTorch
    reference for attention and the element-wise ops; ``auto``: the C++ CPU kernels)."""
    from shared.sampling import SamplingParams
    from worker.llm import LLM

    engine = LLM(MODEL, dtype="float32", max_num_seqs=16, attention_backend=attention_backend).engine
    engine.runner.model.prepack_for_cpu(max_rows)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    for i in range(16):
        engine.add_request(f"r{i}", [rng.randrange(100, 49152) for _ in range(256)], params)
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t) * 1e3)
    return {"packed_max_rows": "all" if max_rows == linear_mod.UNLIMITED_ROWS else max_rows,
            "attention_backend": engine.runner.backend.name, "prefill_ms": steps[:2],
            "decode_median_ms": statistics.median(steps[2:]), "total_s": sum(steps) / 1e3, "output_tok_s": 16 * 64 / (sum(steps) / 1e3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="hw,linear,attention,elementwise,engine")
    p.add_argument("--out", default="bench/results/cpu_engine.json")
    args = p.parse_args()
    sections = set(args.sections.split(","))
    result: dict[str, Any] = {"date": date.today().isoformat(), "machine": cpu_description(),
                              "torch": torch.__version__, "threads": torch.get_num_threads(), "model": MODEL}
    if "hw" in sections:
        result["hw"] = bench_hw()
        print(json.dumps(result["hw"]), flush=True)
    if "linear" in sections:
        result["linear"] = bench_linear()
    if "attention" in sections:
        result["attention"] = bench_attention()
    if "elementwise" in sections:
        result["elementwise"] = bench_elementwise()
    if "engine" in sections:
        result["packed_max_rows_chosen"] = _chosen_max_rows()
        result["engine"] = [bench_engine(rows, "torch") for rows in (0, linear_mod.PACKED_MAX_ROWS)]
        result["engine"] += [bench_engine(linear_mod.UNLIMITED_ROWS, backend) for backend in ("torch", "auto")]
        for row in result["engine"]:
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

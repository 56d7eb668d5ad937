"""The memory-bound kernels of an FP8 prefill step, against their bfloat16 forms and the
copy rate: the SwiGLU that quantizes for ``down_proj`` (``silu_and_mul_fp8``) and the
residual add + RMSNorm that quantizes for ``qkv_proj`` / ``gate_up_proj``
(``fused_add_rms_norm_fp8``), on one prefill step of ``--rows`` tokens of ``--model``'s
dims. Each figure is a CUDA-graph replay of 20 calls over inputs larger than L2 (µs per
call; ``bench.attn_sweep.time_us``); "of copy" is bytes read + written over the time, over the copy rate measured in
the same run.

``--sweep`` times launch variants (the group kernels' ``GROUPS_PER_PROGRAM`` x
``GROUP_KERNEL_WARPS``, the norms' warps; bit for bit the same results) and prints the
fastest of each kernel.

    python bench/fp8_elementwise_bench.py --sweep --out bench/results/fp8_elementwise_h100.json

Needs CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable
from datetime import date
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels.fused_add_rms_norm as norm_module
from bench.attn_sweep import time_us
from bench.kernel_bench import copy_bandwidth_gbs
from kernels import fp8_quant
from kernels.fused_add_rms_norm import fused_add_rms_norm, fused_add_rms_norm_fp8
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_fp8
from shared.model_source import DUMMY_CONFIGS


def alternating(fn: Callable[[Any], object], inputs: list[Any]) -> Callable[[], object]:
    """``fn`` on each of ``inputs`` in turn, one per call (a graph of several calls then
    reads them all: together larger than L2)."""
    it = itertools.cycle(inputs)
    return lambda: fn(next(it))


def kernels(rows: int, hidden: int, inter: int) -> dict[str, tuple[Callable[[], object], int]]:
    """``{name: (call, bytes moved)}``: each kernel over two input sets in turn, together
    larger than L2."""
    dev, dt = "cuda", torch.bfloat16
    gate_up = [torch.randn(rows, 2 * inter, device=dev, dtype=dt) for _ in range(2)]
    xr = [(torch.randn(rows, hidden, device=dev, dtype=dt), torch.randn(rows, hidden, device=dev, dtype=dt))
          for _ in range(2)]
    w = torch.randn(hidden, device=dev, dtype=dt)
    act_in, act_out_bf16, act_out_fp8 = rows * 2 * inter * 2, rows * inter * 2, rows * inter * (1 + 4 / 128)
    norm_in, norm_out_bf16, norm_out_fp8 = 2 * rows * hidden * 2, 2 * rows * hidden * 2, rows * hidden * (3 + 4 / 128)
    return {
        "silu_and_mul": (alternating(silu_and_mul, gate_up), act_in + act_out_bf16),
        "silu_and_mul_fp8": (alternating(lambda g: silu_and_mul_fp8(g, pad_rows_to=16), gate_up),
                             act_in + act_out_fp8),
        "fused_add_rms_norm": (alternating(lambda t: fused_add_rms_norm(*t, w, 1e-6), xr), norm_in + norm_out_bf16),
        "fused_add_rms_norm_fp8": (alternating(lambda t: fused_add_rms_norm_fp8(*t, w, 1e-6, pad_rows_to=16), xr),
                                   norm_in + norm_out_fp8),
    }


def measure(calls: dict, copy_gbs: float, names: list[str] | None = None) -> dict[str, dict]:
    out = {}
    for name, (fn, nbytes) in calls.items():
        if names is None or name in names:
            us = time_us(fn, reps=20)
            out[name] = {"us": round(us, 1), "gb_s": round(nbytes / us / 1e3, 1),
                         "of_copy": round(nbytes / us / 1e3 / copy_gbs, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-7B", choices=sorted(DUMMY_CONFIGS))
    ap.add_argument("--rows", type=int, default=4096, help="tokens of the prefill step")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cfg = DUMMY_CONFIGS[args.model]
    copy_gbs = copy_bandwidth_gbs()
    calls = kernels(args.rows, cfg["hidden_size"], cfg["intermediate_size"])
    res: dict = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(), "model": args.model,
                 "rows": args.rows, "copy_gb_s": round(copy_gbs, 1), "default": measure(calls, copy_gbs)}
    print(json.dumps(res), flush=True)
    if args.sweep:
        base = (fp8_quant.GROUPS_PER_PROGRAM, fp8_quant.GROUP_KERNEL_WARPS)
        sweep = []
        for groups, warps in itertools.product((4, 8, 16, 32), (2, 4, 8)):
            fp8_quant.GROUPS_PER_PROGRAM, fp8_quant.GROUP_KERNEL_WARPS = groups, warps
            r = measure(calls, copy_gbs, ["silu_and_mul_fp8"])["silu_and_mul_fp8"]
            sweep.append({"kernel": "silu_and_mul_fp8", "groups": groups, "warps": warps} | r)
        fp8_quant.GROUPS_PER_PROGRAM, fp8_quant.GROUP_KERNEL_WARPS = base
        base_warps = norm_module._num_warps
        for warps in (4, 8, 16, 32):
            norm_module._num_warps = lambda block, w=warps: w  # type: ignore[assignment]
            for name, r in measure(calls, copy_gbs, ["fused_add_rms_norm", "fused_add_rms_norm_fp8"]).items():
                sweep.append({"kernel": name, "warps": warps} | r)
        norm_module._num_warps = base_warps
        res["sweep"] = sweep
        for name in ("silu_and_mul_fp8", "fused_add_rms_norm", "fused_add_rms_norm_fp8"):
            best = min((r for r in sweep if r["kernel"] == name), key=lambda r: r["us"])
            print(f"best {name}: {best}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

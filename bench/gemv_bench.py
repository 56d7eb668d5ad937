"""Time ``kernels/gemv.py`` (the weight-streaming product of few rows by a 16-bit weight)
against ``F.linear`` (cuBLAS) on Qwen2.5-7B's four projections, on one GPU.

For each projection (qkv [4608, 3584] with bias, o [3584, 3584], gate_up [37888, 3584],
down [3584, 18944]) and ``--rows`` rows: enough distinct bfloat16 weights to exceed 256 MiB
(more than the L2 cache, so every product reads its weight from memory, as a model's
layers do), one CUDA graph of one product per weight, ms per product; then the same for
every ``LaunchConfig`` of the grid below through ``gemv.gemv``, best first, each with its
largest difference from ``F.linear``'s output. Fractions are of the measured copy rate
(``bench.engine_bench.copy_bandwidth_bps``). ``kernels/gemv.py``'s ``PLAN`` is the best
single configuration over the four projections.

    python bench/gemv_bench.py --rows 1 --out bench/results/s19/gemv16_m1.json

Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from datetime import date

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.engine_bench import copy_bandwidth_bps
from bench.fp8_gemm_bench import graph_ms
from kernels import gemv
from kernels.fp8_gemv import LaunchConfig

SHAPES = {"qkv": (4608, 3584, True), "o": (3584, 3584, False), "gate_up": (37888, 3584, False),
          "down": (3584, 18944, False)}
#: ``LaunchConfig`` fields swept (``num_warps`` 4, the operands unswapped).
GRID = {"block_n": (32, 64, 128), "num_stages": (3, 4, 5), "tma": (False, True), "programs_per_sm": (1, 2, 4, 8)}
#: Weight bytes per projection timed, so that the set exceeds the L2 cache.
MIN_BYTES = 256 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy = copy_bandwidth_bps()
    res = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "rows": args.rows, "copy_bps": copy, "plan": dataclasses.asdict(gemv.PLAN), "shapes": {}}
    for name, (n, k, has_bias) in SHAPES.items():
        copies = max(2, -(-MIN_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if has_bias else None
        x = torch.randn(args.rows, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, weights[0], bias).float()
        weight_bytes = n * k * 2

        def frac(ms: float, nbytes: int = weight_bytes) -> float:
            return round(nbytes / (ms / 1e3) / copy, 3)

        ms = graph_ms(lambda ws=weights, b=bias, x=x: [F.linear(x, w, b) for w in ws]) / copies
        row = {"copies": copies, "f_linear_ms": round(ms, 4), "f_linear_of_copy": frac(ms), "configs": []}
        for values in itertools.product(*GRID.values()):
            config = LaunchConfig(num_warps=4, **dict(zip(GRID, values)))
            err = (gemv.gemv(x, weights[0], bias, config).float() - ref).abs().max().item()
            ms = graph_ms(lambda ws=weights, b=bias, x=x, c=config: [gemv.gemv(x, w, b, c) for w in ws]) / copies
            row["configs"].append({**dict(zip(GRID, values)), "ms": round(ms, 4), "of_copy": frac(ms),
                                   "max_abs_diff": round(err, 4)})
        row["configs"].sort(key=lambda c: c["ms"])
        plan_ms = graph_ms(lambda ws=weights, b=bias, x=x: [gemv.gemv(x, w, b) for w in ws]) / copies
        row["plan_ms"], row["plan_of_copy"] = round(plan_ms, 4), frac(plan_ms)
        res["shapes"][name] = row
        print(f"{name}: F.linear {row['f_linear_ms']} ms ({row['f_linear_of_copy']}), PLAN {row['plan_ms']} ms "
              f"({row['plan_of_copy']}), best {row['configs'][0]}", flush=True)
        del weights
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

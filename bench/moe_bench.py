"""Time one Qwen3-30B-A3B MoE layer (``kernels/fused_moe.py``, bfloat16) on CUDA against
the floor of the bytes it must read: the weights of the experts its tokens chose, over
the device copy bandwidth measured in the same run (``bench.engine_bench``).

Each timing replays a CUDA graph of ``LAYERS`` calls, each on its own copy of the expert
weights (together well over L2), as a decode step runs every layer once. ``--sweep``
also times each ``(BLOCK_M, BLOCK_N, BLOCK_K)`` of ``CANDIDATES`` at each size (to choose
``kernels.fused_moe.SMALL_BLOCKS`` / ``LARGE_BLOCKS``). Writes JSON.

Run: python -m bench.moe_bench --sweep --out bench/results/moe_h100.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.engine_bench import copy_bandwidth_bps
from kernels import fused_moe
from kernels.fused_moe import block_sizes, fused_moe_triton
from shared.model_source import DUMMY_CONFIGS
from worker.models.config import ModelConfig
from worker.models.moe import select_experts

LAYERS = 8
TOKENS = (1, 8, 64, 256, 2048)
CANDIDATES = ((16, 32, 64), (16, 64, 64), (16, 64, 128), (16, 128, 64), (32, 64, 64), (64, 64, 64),
              (64, 128, 64), (128, 128, 64))


def time_layer_ms(cfg: ModelConfig, num_tokens: int, weights: list[tuple[torch.Tensor, torch.Tensor]],
                  repeat: int = 20) -> tuple[float, int]:
    """``(ms per layer, distinct experts per layer on average)`` for ``num_tokens`` tokens
    routed at random (softmax of Gaussian logits, top-k)."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, cfg.hidden_size, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(LAYERS, num_tokens, cfg.num_experts, device="cuda", generator=gen).bfloat16()
    routes = [select_experts(logits[n], cfg.num_experts_per_tok, cfg.norm_topk_prob) for n in range(LAYERS)]
    run = [lambda w=w, r=r: fused_moe_triton(x, w[0], w[1], r[0], r[1]) for w, r in zip(weights, routes)]
    for f in run:
        f()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in run:
            f()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        graph.replay()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / repeat / LAYERS * 1e3
    distinct = sum(r[1].unique().numel() for r in routes) / LAYERS
    return ms, round(distinct)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="time every block-size candidate too")
    args = ap.parse_args()
    cfg = ModelConfig.from_hf(DUMMY_CONFIGS["Qwen3-30B-A3B"])
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    weights = [(torch.randn(e, 2 * i, h, device="cuda").bfloat16() * 0.02,
                torch.randn(e, h, i, device="cuda").bfloat16() * 0.02) for _ in range(LAYERS)]
    copy_bps = copy_bandwidth_bps()
    expert_bytes = 3 * h * i * 2
    rows = []
    small, large = fused_moe.SMALL_BLOCKS, fused_moe.LARGE_BLOCKS
    for t in TOKENS:
        ms, distinct = time_layer_ms(cfg, t, weights)
        floor_ms = distinct * expert_bytes / copy_bps * 1e3
        rows.append({"tokens": t, "distinct_experts": distinct, "layer_ms": round(ms, 4),
                     "floor_ms": round(floor_ms, 4), "frac_of_floor": round(floor_ms / ms, 3),
                     "tflops": round(2 * t * cfg.num_experts_per_tok * 3 * h * i / ms / 1e9, 1)})
        print(rows[-1], flush=True)
        if args.sweep:
            chosen = block_sizes(t * cfg.num_experts_per_tok, e)
            times = {}
            for blocks in CANDIDATES:
                fused_moe.SMALL_BLOCKS = fused_moe.LARGE_BLOCKS = blocks
                times[str(blocks)] = round(time_layer_ms(cfg, t, weights)[0], 4)
            fused_moe.SMALL_BLOCKS, fused_moe.LARGE_BLOCKS = small, large
            rows[-1]["sweep_ms"] = times
            print(f"  sweep (chosen {chosen}): {times}", flush=True)
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "config": "Qwen3-30B-A3B MoE layer, bf16", "copy_bps": copy_bps, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

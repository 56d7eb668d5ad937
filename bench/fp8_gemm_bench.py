"""Time FP8 linear products on Qwen2.5-7B's projection shapes against bf16, on one GPU.

Per layer the four projections (qkv [4608, 3584], o [3584, 3584], gate_up [37888, 3584],
down [3584, 18944]) at M = 1, 64, 2048 tokens, over 4 layers' worth of distinct weights
(more than the L2 cache), each timing a replayed CUDA graph of the 16 products:
  bf16          ``F.linear``
  fp8_channel   ``worker.models.fp8.fp8_linear``: per-token activation quantization
                (``kernels/fp8_quant.py``) + ``torch._scaled_mm`` row-wise
  fp8_channel_mm_only   the ``_scaled_mm`` alone (activations quantized beforehand)
  fp8_block     ``torch._scaled_mm`` with 1x128 activation and 128x128 weight scales
                (DeepSeek-V3's layout), where this PyTorch build has it
Reports ms per layer and the weight bandwidth achieved (weight bytes / time).

Run: python bench/fp8_gemm_bench.py --out bench/results/fp8_gemm_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from datetime import date
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.fp8_quant import quantize_rows
from worker.models.fp8 import fp8_linear

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
NUM_LAYERS = 4
BLOCK = 128


def graph_ms(fn: Callable[[], Any], replays: int = 20) -> float:
    """Mean GPU time of ``fn`` captured into a CUDA graph, ms per call."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def block_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> E4M3 and scales ``[N / 128, K / 128]`` per 128x128 block."""
    n, k = w.shape
    blocks = w.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, k)
    return q, scale


def group_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> E4M3 and scales ``[M, K / 128]`` per 1x128 group."""
    m, k = x.shape
    groups = x.float().view(m, k // BLOCK, BLOCK)
    scale = groups.abs().amax(dim=2).clamp(min=1e-12) / 448.0
    return (groups / scale[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k), scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,2048")
    ap.add_argument("--out", default="bench/results/fp8_gemm_h100.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    res: dict[str, Any] = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "shapes": SHAPES, "num_layers": NUM_LAYERS, "rows": {}}
    layers = [{name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for name, (n, k) in SHAPES.items()}
              for _ in range(NUM_LAYERS)]
    bf16_bytes = sum(w.numel() * 2 for w in layers[0].values())
    fp8 = [{name: quantize_rows(w) for name, w in layer.items()} for layer in layers]
    blocks = [{name: block_quant(w) for name, w in layer.items()} for layer in layers]
    for m in (int(r) for r in args.rows.split(",")):
        xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for name, (_, k) in SHAPES.items()}
        xq = {name: quantize_rows(x) for name, x in xs.items()}
        xg = {name: group_quant(x) for name, x in xs.items()}
        variants: dict[str, Callable[[], Any]] = {
            "bf16": lambda xs=xs: [F.linear(xs[n], layer[n]) for layer in layers for n in SHAPES],
            "fp8_channel": lambda xs=xs: [fp8_linear(xs[n], *layer[n][:1], layer[n][1].view(-1))
                                    for layer in fp8 for n in SHAPES],
            "fp8_channel_mm_only": lambda xq=xq: [
                torch._scaled_mm(xq[n][0], layer[n][0].T, scale_a=xq[n][1], scale_b=layer[n][1].view(1, -1),
                                 out_dtype=torch.bfloat16) for layer in fp8 for n in SHAPES],
            # Block scales: activations [M, K/128] and weights [K/128, N/128] as the
            # transposed operand wants them, both "outer-dim-major" (column-major).
            "fp8_block": lambda xg=xg: [
                torch._scaled_mm(xg[n][0], layer[n][0].T, scale_a=xg[n][1].t().contiguous().t(),
                                 scale_b=layer[n][1].t(), out_dtype=torch.bfloat16)
                for layer in blocks for n in SHAPES],
        }
        row: dict[str, Any] = {}
        for name, fn in variants.items():
            try:
                ms = graph_ms(fn) / NUM_LAYERS
            except Exception as exc:  # noqa: BLE001 -- a layout this build lacks: record why
                row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                torch.cuda.synchronize()
                continue
            weight_bytes = bf16_bytes if name == "bf16" else bf16_bytes // 2
            row[name] = {"ms_per_layer": round(ms, 4), "weight_tb_s": round(weight_bytes / ms / 1e9, 2)}
        res["rows"][str(m)] = row
        print(m, json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

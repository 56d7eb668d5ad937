"""Time FP8 linear products on Qwen2.5-7B's projection shapes against bf16, on one GPU.

Per layer the four projections (qkv [4608, 3584], o [3584, 3584], gate_up [37888, 3584],
down [3584, 18944]) at M = 1, 16, 32, 64, 2048 tokens, over 4 layers' worth of distinct
weights (more than the L2 cache), each timing a replayed CUDA graph of the 16 products:
  bf16             ``F.linear``
  gemv_block       ``kernels/fp8_gemv.py`` (W8A16), 128x128 block scales (rows <= 64)
  gemv_channel     the same kernel with per-channel scales (rows <= 64)
  mm_block         1x128 activation quantization + ``torch._scaled_mm`` with 128x128
                   weight blocks (DeepSeek-V3's layout): the block layout's prefill path
  mm_channel       per-token activation quantization + ``torch._scaled_mm`` row-wise
  fp8_linear       ``worker.models.fp8.fp8_linear`` as served (block layout): the GEMV
                   up to ``GEMV_MAX_ROWS`` rows, ``mm_block`` above
  fp8_linear_two_launch_split_k   the same with every plan's split-K summed by a second
                   launch instead of in the kernel (``LaunchConfig.serial_split_k``)
Reports ms per layer, the weight bytes read per second and that rate as a fraction of
the measured copy bandwidth (``bench.engine_bench.copy_bandwidth_bps``, read + write),
and, for the GEMV, the same per projection. ``--sweep`` also times the GEMV's launch
configurations (``kernels.fp8_gemv.LaunchConfig``: ``SWEEP``) per projection and row count
(rows <= 64 of ``--rows``), best first, each with ``vs_mm`` (the faster ``_scaled_mm``
layout's time over the plan's: above 1 the plan wins), and per row count the best single
configuration over the four projections (``best_config``): what ``kernels.fp8_gemv.PLANS``
holds for that row bucket. ``--grid`` overrides ``SWEEP``'s fields (JSON), e.g.
``{"tma": [false, true]}``; from ``W8A8_MIN_ROWS`` rows the sweep times the W8A8 kernel.

Run: python bench/fp8_gemm_bench.py --out bench/results/fp8_gemm_h100.json [--sweep]
The decode step: python bench/engine_bench.py --sections decode,prefill --quantization fp8
--max-num-seqs 64 --no-fused-ab --out bench/results/engine_fp8_h100.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from datetime import date
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels.fp8_gemv as fp8_gemv_module
from bench.engine_bench import copy_bandwidth_bps
from kernels.fp8_gemv import MAX_ROWS, PLANS, LaunchConfig, block_rows, fp8_gemv, plan
from kernels.fp8_quant import quantize_groups, quantize_rows
from worker.models.fp8 import W8A8_MIN_ROWS, fp8_linear, quantize_weight

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
NUM_LAYERS = 4
#: ``LaunchConfig`` fields ``--sweep`` tries (every combination but 8 warps on 64 channels;
#: ``programs_per_sm`` only changes the split, so it costs no compile).
SWEEP = {"block_n": (64, 128, 256), "num_warps": (4, 8), "num_stages": (3, 4), "programs_per_sm": (1, 2, 4),
         "swap_ab": (False, True), "tma": (False,)}


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


def timed(fn: Callable[[], Any], weight_bytes: int, copy_bps: float, calls: int = NUM_LAYERS) -> dict[str, Any]:
    """``ms`` per call of ``fn`` (which makes ``calls`` calls), weight TB/s, fraction of copy."""
    try:
        ms = graph_ms(fn) / calls
    except Exception as exc:  # noqa: BLE001 -- a layout this build lacks: record why
        torch.cuda.synchronize()
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    bps = weight_bytes / (ms / 1e3)
    return {"ms": round(ms, 4), "weight_tb_s": round(bps / 1e12, 3), "of_copy": round(bps / copy_bps, 3)}


@contextlib.contextmanager
def two_launch_split_k() -> Iterator[None]:
    """Within the block, every plan of ``PLANS`` and ``W8A8_PLANS`` sums split-K by a
    second launch instead of the tile counters."""
    saved = {name: dict(getattr(fp8_gemv_module, name)) for name in ("PLANS", "W8A8_PLANS")}
    try:
        for name, table in saved.items():
            getattr(fp8_gemv_module, name).update(
                {rows: dataclasses.replace(c, serial_split_k=False) for rows, c in table.items()})
        yield
    finally:
        for name, table in saved.items():
            getattr(fp8_gemv_module, name).update(table)


def sweep_configs(grid: dict[str, tuple[Any, ...]] | None = None) -> list[LaunchConfig]:
    """The ``LaunchConfig``s of ``SWEEP``, its fields overridden by ``grid``."""
    grid = SWEEP | (grid or {})
    configs = [LaunchConfig(**dict(zip(grid, values, strict=True))) for values in itertools.product(*grid.values())]
    return [c for c in configs if not (c.num_warps == 8 and c.block_n < 128)]


def mm_ms(layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
          channels: list[dict[str, tuple[torch.Tensor, torch.Tensor]]], name: str, x: torch.Tensor,
          copy_bps: float) -> float:
    """ms of the faster ``_scaled_mm`` layout (quantization included) for one projection,
    the comparison of ``sweep``'s ``vs_mm`` (inf where neither runs)."""
    n, k = SHAPES[name]
    block = timed(lambda: [torch._scaled_mm(q, layer[name][0].T, scale_a=s, scale_b=layer[name][1].t(),
                                            out_dtype=torch.bfloat16)
                           for layer in layers for q, s in [quantize_groups(x, pad_rows_to=16,
                                                                            scales_column_major=True)]],
                  n * k, copy_bps)
    channel = timed(lambda: [torch._scaled_mm(q, layer[name][0].T, scale_a=s, scale_b=layer[name][1].view(1, -1),
                                              out_dtype=torch.bfloat16)
                             for layer in channels for q, s in [quantize_rows(x)]], n * k, copy_bps)
    return min(block.get("ms", float("inf")), channel.get("ms", float("inf")))


def w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, gemv_plan: Any = None) -> torch.Tensor:
    """The kernel on E4M3 input: ``x`` quantized per 1x128 group first (one more launch),
    its scales column-major as ``fp8_linear`` writes them."""
    q, s = quantize_groups(x, scales_column_major=True)
    return fp8_gemv(q, weight, weight_scale, gemv_plan=gemv_plan, x_scale=s)


def sweep(layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
          channels: list[dict[str, tuple[torch.Tensor, torch.Tensor]]], rows: list[int],
          copy_bps: float, a8: bool = False, grid: dict[str, tuple[Any, ...]] | None = None) -> dict[str, Any]:
    """Per projection and row count, the GEMV's time under each ``SWEEP`` configuration,
    best first; per row count the best single configuration over the four projections.
    ``a8``: the W8A8 kernel on group-quantized input (``w8a8``), its quantization timed."""
    gemv = w8a8 if a8 else fp8_gemv
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = sweep_configs(grid)
    out: dict[str, Any] = {}
    for m in rows:
        totals = dict.fromkeys(configs, 0.0)
        mm_total = 0.0
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            mm = mm_ms(layers, channels, name, x, copy_bps)
            mm_total += mm
            results = []
            for c in configs:
                p = plan(m, n, k, sms, c)
                r = timed(lambda p=p, x=x, name=name: [gemv(x, *layer[name], gemv_plan=p) for layer in layers],
                          n * k, copy_bps)
                totals[c] += r.get("ms", float("inf"))
                results.append(c.__dict__ | {"split": p.split} | r | ({"vs_mm": round(mm / r["ms"], 3)} if "ms" in r else {}))
            results.sort(key=lambda r: r.get("ms", float("inf")))
            out[f"{m}/{name}"] = results
            print(m, name, f"mm {mm:.4f} ms", json.dumps(results[:3]), flush=True)
        best = min(configs, key=totals.__getitem__)
        fp8_bytes = sum(n * k for n, k in SHAPES.values())
        default = PLANS[block_rows(m)]
        out[f"{m}/best_config"] = best.__dict__ | {
            "ms_per_layer": round(totals[best], 4), "of_copy": round(fp8_bytes / (totals[best] / 1e3) / copy_bps, 3),
            "mm_ms_per_layer": round(mm_total, 4), "default_ms_per_layer": round(totals[default], 4)
            if default in totals else None}
        print(m, "best single config:", json.dumps(out[f"{m}/best_config"]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,32,64,2048")
    ap.add_argument("--sweep", action="store_true", help="also time GEMV launch configurations (a few minutes on an H100)")
    ap.add_argument("--w8a8", action="store_true", help="sweep W8A8 below W8A8_MIN_ROWS rows too (from there it always does)")
    ap.add_argument("--grid", default="", help='JSON overriding SWEEP\'s fields, e.g. {"tma": [false, true]}')
    ap.add_argument("--out", default="bench/results/fp8_gemm_h100.json")
    args = ap.parse_args()
    grid = {k: tuple(v) for k, v in json.loads(args.grid).items()} if args.grid else None
    torch.manual_seed(0)
    copy_bps = copy_bandwidth_bps()
    res: dict[str, Any] = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "shapes": SHAPES, "num_layers": NUM_LAYERS,
                           "copy_tb_s": round(copy_bps / 1e12, 3), "rows": {}}
    bf16 = [{name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for name, (n, k) in SHAPES.items()}
            for _ in range(NUM_LAYERS)]
    fp8_bytes = sum(n * k for n, k in SHAPES.values())
    blocks = [{name: quantize_weight(w, "block") for name, w in layer.items()} for layer in bf16]
    channels = [{name: quantize_weight(w, "channel") for name, w in layer.items()} for layer in bf16]
    rows = [int(r) for r in args.rows.split(",")]
    for m in rows:
        xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for name, (_, k) in SHAPES.items()}
        variants: dict[str, Callable[[], Any]] = {
            "bf16": lambda xs=xs: [F.linear(xs[n], layer[n]) for layer in bf16 for n in SHAPES],
            "mm_block": lambda xs=xs: [
                torch._scaled_mm(q, layer[n][0].T, scale_a=s, scale_b=layer[n][1].t(), out_dtype=torch.bfloat16)
                for layer in blocks for n in SHAPES
                for q, s in [quantize_groups(xs[n], pad_rows_to=16, scales_column_major=True)]],
            "mm_channel": lambda xs=xs: [
                torch._scaled_mm(q, layer[n][0].T, scale_a=s, scale_b=layer[n][1].view(1, -1),
                                 out_dtype=torch.bfloat16)
                for layer in channels for n in SHAPES for q, s in [quantize_rows(xs[n])]],
            "fp8_linear": lambda xs=xs: [fp8_linear(xs[n], *layer[n]) for layer in blocks for n in SHAPES],
        }
        if m <= MAX_ROWS:
            variants["gemv_block"] = lambda xs=xs: [fp8_gemv(xs[n], *layer[n]) for layer in blocks for n in SHAPES]
            variants["w8a8_block"] = lambda xs=xs: [w8a8(xs[n], *layer[n]) for layer in blocks for n in SHAPES]
            variants["gemv_channel"] = lambda xs=xs: [fp8_gemv(xs[n], *layer[n]) for layer in channels
                                                      for n in SHAPES]
        row: dict[str, Any] = {}
        for name, fn in variants.items():
            row[name] = timed(fn, 2 * fp8_bytes if name == "bf16" else fp8_bytes, copy_bps)
        if m <= MAX_ROWS:  # split-K summed by a second launch, as before the tile counters
            with two_launch_split_k():
                row["fp8_linear_two_launch_split_k"] = timed(variants["fp8_linear"], fp8_bytes, copy_bps)
        if m <= MAX_ROWS:
            row["gemv_block_per_projection"] = {
                n: timed(lambda n=n, x=xs[n]: [fp8_gemv(x, *layer[n]) for layer in blocks], k * nn, copy_bps)
                for n, (nn, k) in SHAPES.items()}
        res["rows"][str(m)] = row
        print(m, json.dumps(row), flush=True)
        save(res, args.out)
    if args.sweep:  # saved after each row count: a run cut short keeps what it timed
        res["sweep"] = {}
        for m in (m for m in rows if m <= MAX_ROWS):
            res["sweep"] |= sweep(blocks, channels, [m], copy_bps, a8=args.w8a8 or m >= W8A8_MIN_ROWS, grid=grid)
            save(res, args.out)


def save(res: dict[str, Any], path: str) -> None:
    """Write ``res`` as JSON to ``path``."""
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

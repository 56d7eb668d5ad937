"""Sweep the launch config of the Triton paged-attention kernel at a few points, timed as
CUDA-graph replays so host launch cost is excluded. Qwen2.5-7B head shape. Prints the
best config per point.

- decode (default): tile, warps, stages, splits at batch/context points;
- ``--prefill``: the prefill launch (``BLOCK_M`` rows of packed query heads, tile, warps,
  stages) on whole prompts: 2 x 2,048 and 8 x 512 tokens, as the engine benchmark's
  prefill steps.

    python -m bench.attn_sweep --out bench/results/attn_sweep_h100.json
    python -m bench.attn_sweep --prefill --out bench/results/attn_sweep_prefill_h100.json
    python -m bench.attn_sweep --prefill --default-only   # the default config alone: a kernel A/B
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

import kernels.paged_attention as pa


def time_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(5):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / (5 * reps)


def time_config(cfg: dict, call: functools.partial, out: torch.Tensor, ref: torch.Tensor, reps: int = 20) -> dict:
    """``{"us", "rel_err"}`` of ``call`` (a ``paged_attention`` call writing ``out``) under
    the launch config ``cfg`` in place of ``_attention_config``'s, or ``{"error"}`` when
    it does not compile or fit."""
    base_cfg = pa._attention_config
    pa._attention_config = lambda *a: cfg
    try:
        us = time_us(call, reps=reps)
        return {"us": us, "rel_err": ((out.float() - ref).norm() / ref.norm()).item()}
    except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit
        return {"error": repr(exc)[:80]}
    finally:
        pa._attention_config = base_cfg


def prefill_sweep(default_only: bool = False) -> list[dict]:
    """The prefill launch's configs on whole prompts (no earlier context), best first per
    point; ``default_only``: just the config ``_attention_config`` picks (a kernel A/B)."""
    nh, nkv, d, bs = 28, 4, 128, 16
    dev, dt = "cuda", torch.bfloat16
    results = []
    for num_prompts, length in ((2, 2048), (8, 512)):
        blocks_per_seq = length // bs
        num_blocks = num_prompts * blocks_per_seq * 2
        kc = torch.randn(num_blocks, bs, nkv, d, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        tables = torch.randperm(num_blocks, device=dev)[:num_prompts * blocks_per_seq].view(num_prompts, -1).int()
        q = torch.randn(num_prompts * length, nh, d, device=dev, dtype=dt)
        qsl = torch.arange(0, num_prompts * length + 1, length, device=dev, dtype=torch.int32)
        lens = torch.full((num_prompts,), length, device=dev, dtype=torch.int32)
        out = torch.empty_like(q)
        ref = pa.paged_attention_ref(q.float(), kc.float(), vc.float(), tables, qsl, lens, d ** -0.5)
        default = pa._attention_config(dt, nh // nkv, num_prompts, nkv, length, length, pa._num_sms(q.device))
        rows = []
        call = functools.partial(pa.paged_attention, q, kc, vc, tables, qsl, lens, d ** -0.5, out,
                                 max_query_len=length, max_seq_len=length)
        grid = [(default["BLOCK_M"], default["TILE"], default["num_warps"], default["num_stages"])] if default_only \
            else itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
        for block_m, tile, warps, stages in grid:
            cfg = dict(default, BLOCK_M=block_m, BLOCK_Q=block_m // (nh // nkv), TILE=tile, num_warps=warps,
                       num_stages=stages)
            r = time_config(cfg, call, out, ref, reps=5)
            if "us" in r:
                r["us"] = round(r["us"], 1)
            rows.append({"block_m": block_m, "tile": tile, "warps": warps, "stages": stages} | r)
        ok = sorted((r for r in rows if "us" in r and r["rel_err"] < 1e-2), key=lambda r: r["us"])
        cur = next((r for r in ok if r["block_m"] == default["BLOCK_M"] and r["tile"] == default["TILE"]
                    and r["warps"] == default["num_warps"] and r["stages"] == default["num_stages"]), None)
        flops = 4 * num_prompts * length * (length + 1) / 2 * nh * d  # causal QK^T and PV
        point = {"num_prompts": num_prompts, "prompt_len": length, "default": cur, "best": ok[0],
                 "best_tflops": round(flops / ok[0]["us"] / 1e6, 1), "top5": ok[:5], "errors": len(rows) - len(ok)}
        print(json.dumps({k: v for k, v in point.items() if k != "top5"}), flush=True)
        results.append(point)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--prefill", action="store_true", help="sweep the prefill launch instead (module docstring)")
    ap.add_argument("--default-only", action="store_true", help="with --prefill: time only the default config")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.prefill:
        results = prefill_sweep(args.default_only)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        return
    nh, nkv, d, bs = 28, 4, 128, 16
    dev, dt = "cuda", torch.bfloat16
    results = []
    for batch, ctx in ((1, 330), (8, 330), (64, 330), (128, 330), (64, 2048), (1, 4096)):
        blocks_per_seq = -(-ctx // bs)
        # Each call reads its own blocks, spread over a cache >> L2 so L2 does not flatter.
        num_blocks = batch * blocks_per_seq * 4
        kc = torch.randn(num_blocks, bs, nkv, d, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        tables = torch.randperm(num_blocks, device=dev)[:batch * blocks_per_seq].view(batch, blocks_per_seq).int()
        q = torch.randn(batch, nh, d, device=dev, dtype=dt)
        qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        out = torch.empty_like(q)
        ref = pa.paged_attention_ref(q.float(), kc.float(), vc.float(), tables, qsl, lens, d ** -0.5)
        default = pa._attention_config(dt, nh // nkv, batch, nkv, 1, ctx, pa._num_sms(q.device))
        rows = []
        call = functools.partial(pa.paged_attention, q, kc, vc, tables, qsl, lens, d ** -0.5, out,
                                 max_query_len=1, max_seq_len=ctx)
        for tile, warps, stages, splits in itertools.product((32, 64, 128), (4, 8), (2, 3), (1, 2, 4, 8)):
            if splits > 1 and -(-ctx // tile) < splits:
                continue
            cfg = dict(default, TILE=tile, num_warps=warps, num_stages=stages, NUM_SPLITS=splits)
            r = time_config(cfg, call, out, ref)
            if "us" in r:
                r["us"] = round(r["us"], 2)
            rows.append({"tile": tile, "warps": warps, "stages": stages, "splits": splits} | r)
        ok = [r for r in rows if "us" in r and r["rel_err"] < 1e-2]
        best = min(ok, key=lambda r: r["us"])
        cur = next((r for r in ok if r["tile"] == default["TILE"] and r["warps"] == default["num_warps"]
                    and r["stages"] == default["num_stages"] and r["splits"] == default["NUM_SPLITS"]), None)
        kv_bytes = batch * ctx * nkv * d * 2 * 2
        point = {"batch": batch, "ctx": ctx, "default": cur, "best": best, "kv_bytes": kv_bytes,
                 "best_gbps": round(kv_bytes / best["us"] / 1e3, 1), "top5": sorted(ok, key=lambda r: r["us"])[:5]}
        print(json.dumps({k: v for k, v in point.items() if k != "top5"}), flush=True)
        results.append(point)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

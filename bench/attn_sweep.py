"""Sweep the launch config of the Triton paged-attention kernel at a few points, timed as
CUDA-graph replays so host launch cost is excluded. Qwen2.5-7B head shape. Prints the
best config per point.

- decode (default): tile, warps, stages, splits at ``DECODE_POINTS`` (batch, context),
  or ``--points``; each point's best config with its KV read rate (``best_gbps``);
- ``--prefill``: the prefill launch (packed query heads or one head per program,
  ``BLOCK_M`` rows, tile, warps, stages) at ``PREFILL_POINTS``: whole prompts as the engine
  benchmark's prefill steps, a 30,000-token prompt, a long prompt's second chunk and
  shared-prefix questions; ``--short``: a few configs instead of the grid;
  ``--new-kv``: each config also with the chunk's keys read from the step's ``key``/
  ``value`` rows (``new``), through TMA descriptors (``new_tma``), and with the
  compiler's warp specialization (``new_tma_ws``), beside the block-table gather
  (``cache``).

    python -m bench.attn_sweep --out bench/results/attn_sweep_h100.json
    python -m bench.attn_sweep --prefill --out bench/results/attn_sweep_prefill_h100.json
    python -m bench.attn_sweep --prefill --default-only   # the default config alone: a kernel A/B
    python -m bench.attn_sweep --prefill --short --new-kv   # where the chunk's keys come from
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

import kernels.paged_attention as pa
from kernels.gpu_facts import num_sms


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
    pa._attention_config = lambda *a, **kw: cfg
    try:
        us = time_us(call, reps=reps)
        return {"us": us, "rel_err": ((out.float() - ref).norm() / ref.norm()).item()}
    except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit
        return {"error": repr(exc)[:80]}
    finally:
        pa._attention_config = base_cfg


#: Decode points (batch, context tokens): small batches, and the 256-sequence steps of
#: the offline short workload (256 + 32 keys) and of served prompt-heavy traffic.
DECODE_POINTS = ((1, 330), (8, 330), (64, 330), (128, 330), (64, 2048), (1, 4096), (256, 288), (256, 1000),
                 (256, 2000))
#: ``--prefill`` points: (prompts, query tokens each, cached context tokens each). Whole
#: prompts as the engine benchmark's prefill steps, one 30,000-token prompt (issue goal:
#: its prefill in 1.0 s on an H200), a chunk of a long prompt over its first chunk, and
#: shared-prefix questions (100 tokens over a 2,000-token cached prefix).
PREFILL_POINTS = ((2, 2048, 0), (8, 512, 0), (1, 30000, 0), (1, 13616, 16384), (64, 100, 2000))

#: Above this many query x key pairs the float32 reference is too slow: outputs are
#: compared with the default config's instead.
_REF_PAIRS = 2 ** 26


#: ``--new-kv`` sources of a chunk's keys: (name, key/value passed, NEW_KV_TMA, WARP_SPEC).
KEY_SOURCES = (("cache", False, False, False), ("new", True, False, False), ("new_tma", True, True, False),
               ("new_tma_ws", True, True, True))


def prefill_sweep(default_only: bool = False, points: tuple = PREFILL_POINTS, full: bool = True,
                  new_kv: bool = False, out_path: str = "") -> list[dict]:
    """The prefill launch's configs at ``points``, best first per point; ``default_only``:
    just the config ``_attention_config`` picks (a kernel A/B). ``full``: the whole grid
    (GQA-packed or one head per program, ``BLOCK_M``, tile, warps, stages), else a short
    list around the default. ``new_kv``: each config under every ``KEY_SOURCES`` entry
    (the step's keys are also written to the cache, so every source gives one result).
    ``out_path``: the results so far are written there after each point."""
    nh, nkv, d, bs = 28, 4, 128, 16
    dev, dt = "cuda", torch.bfloat16
    results = []
    for num_prompts, qlen, ctx in points:
        length = qlen + ctx
        blocks_per_seq = -(-length // bs)
        num_blocks = num_prompts * blocks_per_seq * 2
        kc = torch.randn(num_blocks, bs, nkv, d, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        tables = torch.randperm(num_blocks, device=dev)[:num_prompts * blocks_per_seq].view(num_prompts, -1).int()
        q = torch.randn(num_prompts * qlen, nh, d, device=dev, dtype=dt)
        qsl = torch.arange(0, num_prompts * qlen + 1, qlen, device=dev, dtype=torch.int32)
        lens = torch.full((num_prompts,), length, device=dev, dtype=torch.int32)
        out = torch.empty_like(q)
        # This step's keys and values, as views of a qkv-like buffer, also in the cache.
        qkv = torch.randn(num_prompts * qlen, (nh + 2 * nkv) * d, device=dev, dtype=dt)
        key = qkv[:, nh * d:(nh + nkv) * d].view(-1, nkv, d)
        value = qkv[:, (nh + nkv) * d:].view(-1, nkv, d)
        pos = ctx + torch.arange(qlen, device=dev)
        slots = (tables[:, pos // bs].long() * bs + pos % bs).reshape(-1)
        kc.view(-1, nkv, d)[slots] = key
        vc.view(-1, nkv, d)[slots] = value
        # The engine passes this step's key/value: the default is the config for that.
        default = pa._attention_config(dt, nh // nkv, num_prompts, nkv, qlen, length, num_sms(q.device),
                                       new_kv=True)
        call = functools.partial(pa.paged_attention, q, kc, vc, tables, qsl, lens, d ** -0.5, out,
                                 max_query_len=qlen, max_seq_len=length)
        new_call = functools.partial(call, key=key, value=value)
        if num_prompts * qlen * length <= _REF_PAIRS:
            ref = pa.paged_attention_ref(q.float(), kc.float(), vc.float(), tables, qsl, lens, d ** -0.5)
        else:
            call()
            ref = out.float().clone()
        if default_only:
            grid = [(default["PACK_HEADS"], default["BLOCK_M"], default["TILE"], default["num_warps"],
                     default["num_stages"])]
        elif full:
            grid = [(True, 128, 64, 8, st) for st in (2, 3)] + list(
                itertools.product((False,), (64, 128), (64, 128), (4, 8), (2, 3, 4)))
        else:
            grid = [(True, 128, 64, 8, 2), (True, 128, 64, 8, 3)] + [(False, 128, t, 8, st) for t in (64, 128)
                                                                     for st in ((2, 3, 4) if new_kv else (2, 3))]
        rows = []
        flags = (default["NEW_KV"], default["NEW_KV"] and default["NEW_KV_TMA"],
                 default["NEW_KV"] and default["NEW_KV_TMA"] and default["WARP_SPEC"])
        default_source = next(src for src in KEY_SOURCES if tuple(src[1:]) == flags)
        sources = KEY_SOURCES if new_kv else (default_source,)
        for (pack, block_m, tile, warps, stages), (source, pass_kv, tma, ws) in itertools.product(grid, sources):
            cfg = dict(default, BLOCK_M=block_m, BLOCK_Q=block_m // (nh // nkv) if pack else block_m, TILE=tile,
                       num_warps=warps, num_stages=stages, PACK_HEADS=pack, NUM_SPLITS=1, NEW_KV=pass_kv,
                       NEW_KV_TMA=tma, WARP_SPEC=ws)
            r = time_config(cfg, new_call, out, ref, reps=5 if qlen * length < 2 ** 27 else 2)
            if "us" in r:
                r["us"] = round(r["us"], 1)
            rows.append({"pack": pack, "block_m": block_m, "tile": tile, "warps": warps, "stages": stages,
                         "source": source} | r)
        ok = sorted((r for r in rows if "us" in r and r["rel_err"] < 1e-2), key=lambda r: r["us"])
        cur = next((r for r in ok if r["source"] == default_source[0] and r["pack"] == default["PACK_HEADS"]
                    and r["block_m"] == default["BLOCK_M"] and r["tile"] == default["TILE"]
                    and r["warps"] == default["num_warps"] and r["stages"] == default["num_stages"]), None)
        # Causal pairs: each query sees the context and the chunk's keys up to itself.
        pairs = num_prompts * (qlen * ctx + qlen * (qlen + 1) / 2)
        flops = 4 * pairs * nh * d  # QK^T and PV
        point = {"num_prompts": num_prompts, "query_len": qlen, "context_len": ctx, "default": cur,
                 "best": ok[0] if ok else None, "default_tflops": round(flops / cur["us"] / 1e6, 1) if cur else None,
                 "best_tflops": round(flops / ok[0]["us"] / 1e6, 1) if ok else None, "top5": ok[:5],
                 "best_by_source": {name: min((r for r in ok if r["source"] == name), key=lambda r: r["us"],
                                              default=None) for name, *_ in sources},
                 "errors": [r for r in rows if r not in ok][:4]}
        print(json.dumps({k: v for k, v in point.items() if k != "top5"}), flush=True)
        results.append(point)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)
    return results


def parse_points(text: str) -> tuple[tuple[int, ...], ...]:
    """``--points``: comma-separated points of ``x``-separated ints (``256x288,1x4096``);
    empty for ""."""
    return tuple(tuple(int(x) for x in p.split("x")) for p in text.split(",")) if text else ()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--prefill", action="store_true", help="sweep the prefill launch instead (module docstring)")
    ap.add_argument("--default-only", action="store_true", help="with --prefill: time only the default config")
    ap.add_argument("--short", action="store_true", help="with --prefill: a short list of configs, not the grid")
    ap.add_argument("--new-kv", action="store_true",
                    help="with --prefill: every config with each source of the chunk's keys (KEY_SOURCES)")
    ap.add_argument("--points", default="",
                    help="BATCHxCONTEXT,... instead of DECODE_POINTS (e.g. 256x288); with --prefill: "
                         "PROMPTSxQUERYxCONTEXT,... instead of PREFILL_POINTS (e.g. 1x30000x0)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.prefill:
        points = parse_points(args.points) or PREFILL_POINTS
        prefill_sweep(args.default_only, points, full=not args.short, new_kv=args.new_kv, out_path=args.out)
        return
    nh, nkv, d, bs = 28, 4, 128, 16
    dev, dt = "cuda", torch.bfloat16
    results = []
    points = parse_points(args.points) or DECODE_POINTS
    for batch, ctx in points:
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
        default = pa._attention_config(dt, nh // nkv, batch, nkv, 1, ctx, num_sms(q.device))
        rows = []
        call = functools.partial(pa.paged_attention, q, kc, vc, tables, qsl, lens, d ** -0.5, out,
                                 max_query_len=1, max_seq_len=ctx)
        for tile, warps, stages, splits in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4, 8)):
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

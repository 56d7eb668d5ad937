"""End-to-end benchmark of the in-house engine on one CUDA device, with dummy weights.

Sections (``--sections``, comma-separated; default all):
  hw       device copy bandwidth (read + write counted, as gpu/decode_floor.py) and the
           bf16 rate of an 8192^3 matrix product.
  decode   engine decode step time at batch 1, 8, 32, 64, 128 (context ~320 tokens),
           CUDA graphs on, vs the roofline (weight bytes + KV bytes read) / copy
           bandwidth; eager at batch 1 and 64; fused ops all vs none vs each one
           left out (graphs recaptured) at batch 1 and 64.
  prefill  prefill tokens/s for 512- and 2048-token prompts vs the matmul rate
           (2 * params * tokens FLOPs).
  serve    1,000 requests of 256 random tokens, 64 output tokens, ignore_eos, all
           submitted at once: output tokens/s.
  prefix   32 requests sharing a 1,000-token prefix (primed by one request), TTFT with
           prefix caching on vs off.
  profile  torch.profiler tables of a decode step (batch 1 and 64) and of a 2048-token
           prefill, written beside --out.
  hf       Hugging Face generate on the same config with random weights (bf16, sdpa),
           256 in / 64 out at batch 1 and 64 (runs last: the engine is freed first).

Run: python bench/engine_bench.py --model Qwen2.5-7B --out bench/results/engine_h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import sys
import time
from datetime import date
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shared.model_source import DUMMY_CONFIGS
from shared.sampling import SamplingParams
from worker.engine.engine import LLMEngine
from worker.llm import LLM

DECODE_BATCHES = (1, 8, 32, 64, 128)
CONTEXT = 320
ALL_SECTIONS = "hw,decode,prefill,serve,prefix,profile,hf"


def copy_bandwidth_bps() -> float:
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (s.elapsed_time(e) / 1e3)


def matmul_flops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (s.elapsed_time(e) / 1e3)


def rand_prompt(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def decode_step_ms(engine: LLMEngine, batch: int, steps: int, rng: random.Random, vocab: int,
                   max_tokens: int = 1000) -> float:
    """Mean wall time (ms) of an engine step with ``batch`` sequences decoding at ~CONTEXT
    tokens: random prompts prefilled first, three warm-up steps, then ``steps`` timed; the
    requests are aborted after."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    ids = [f"dec-{batch}-{i}-{rng.random()}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, rand_prompt(CONTEXT, vocab, rng), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in (*engine.scheduler.waiting,
                                                                     *engine.scheduler.running)):
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    # With async scheduling each call returns with the next step in flight, and the first
    # call found its step already done (the synchronize above): wait for the last one, so
    # ``steps`` steps of GPU time are in the span.
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return dt * 1e3


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(0)
        self.res: dict[str, Any] = {"model": args.model, "date": date.today().isoformat(),
                                    "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "max_num_seqs": args.max_num_seqs}
        self.llm: LLM | None = None

    # -- helpers -------------------------------------------------------------------
    def build(self) -> LLM:
        t0 = time.perf_counter()
        llm = LLM(model=self.args.model, load_format="dummy", max_num_seqs=self.args.max_num_seqs,
                  max_model_len=4096, max_num_batched_tokens=4096, mixed_cuda_graphs=self.args.mixed_cuda_graphs,
                  kv_cache_dtype=self.args.kv_cache_dtype, quantization=self.args.quantization)
        runner = llm.engine.runner
        model = runner.model
        cfg = model.config
        emb = model.embed_tokens.weight
        # Bytes a decode step reads: every weight once, except the embedding table
        # (rows only) unless it doubles as the LM head.
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        params = sum(p.numel() for p in model.parameters())
        if model.lm_head is not None:
            weight_bytes -= emb.numel() * emb.element_size()
            params -= emb.numel()
        self.weight_bytes, self.params = weight_bytes, params
        self.kv_bytes_per_token = cfg.kv_bytes_per_token(runner.kv_caches[0][0].element_size())
        self.vocab = cfg.vocab_size
        self.res["engine"] = {"build_s": round(time.perf_counter() - t0, 2),
                              "graph_capture_s": round(runner.capture_time_s, 2),
                              "graph_memory_gib": round(runner.graph_memory_bytes / 2**30, 2),
                              "graph_buckets": runner.graphs.buckets if runner.graphs else None,
                              "mixed_graph_buckets": runner.mixed.buckets if runner.mixed else None,
                              "num_kv_blocks": runner.num_blocks, "kv_cache_dtype": self.args.kv_cache_dtype,
                              "quantization": self.args.quantization,
                              "weight_bytes": weight_bytes,
                              "params_excl_embedding": params, "backend": runner.backend.name,
                              "fused_ops": sorted(runner.backend.fused_ops)}
        print(f"engine built in {self.res['engine']['build_s']} s, graphs captured in "
              f"{self.res['engine']['graph_capture_s']} s", flush=True)
        return llm

    def decode_step_ms(self, batch: int, steps: int = 30) -> float:
        """Mean wall time of an engine step with ``batch`` sequences decoding at ~CONTEXT."""
        assert self.llm is not None
        return decode_step_ms(self.llm.engine, batch, steps, self.rng, self.vocab)

    def floor_ms(self, batch: int) -> float:
        ctx = CONTEXT + 18
        return (self.weight_bytes + batch * ctx * self.kv_bytes_per_token) / self.res["hw"]["copy_bps"] * 1e3

    # -- sections ------------------------------------------------------------------
    def hw(self) -> None:
        bw, fl = copy_bandwidth_bps(), matmul_flops()
        self.res["hw"] = {"copy_bps": bw, "matmul_flops": fl}
        print(f"copy {bw / 1e12:.2f} TB/s, bf16 matmul {fl / 1e12:.0f} TFLOP/s", flush=True)

    def decode(self) -> None:
        assert self.llm is not None
        runner = self.llm.engine.runner
        rows = []
        for b in DECODE_BATCHES:
            if b > self.args.max_num_seqs:
                continue
            ms = self.decode_step_ms(b)
            floor = self.floor_ms(b)
            rows.append({"batch": b, "mode": "graph", "step_ms": round(ms, 3), "floor_ms": round(floor, 3),
                         "frac_of_floor": round(floor / ms, 3), "tok_s": round(b / ms * 1e3, 1)})
            print(rows[-1], flush=True)
        engine = self.llm.engine
        settings = engine.engine_settings
        engine.engine_settings = dataclasses.replace(settings, async_scheduling=False)
        for b in (1, 64):  # graphs without async scheduling: the host's share of a step
            if b <= self.args.max_num_seqs:
                ms = self.decode_step_ms(b)
                floor = self.floor_ms(b)
                rows.append({"batch": b, "mode": "graph_sync", "step_ms": round(ms, 3), "floor_ms": round(floor, 3),
                             "frac_of_floor": round(floor / ms, 3), "tok_s": round(b / ms * 1e3, 1)})
                print(rows[-1], flush=True)
        engine.engine_settings = settings
        graphs = runner.graphs
        runner.graphs = None
        for b in (1, 64):
            if b <= self.args.max_num_seqs:
                ms = self.decode_step_ms(b, steps=10)
                floor = self.floor_ms(b)
                rows.append({"batch": b, "mode": "eager", "step_ms": round(ms, 3), "floor_ms": round(floor, 3),
                             "frac_of_floor": round(floor / ms, 3), "tok_s": round(b / ms * 1e3, 1)})
                print(rows[-1], flush=True)
        runner.graphs = graphs
        self.res["decode"] = rows
        if graphs is None or runner.backend.name != "triton" or not self.args.fused_ab:
            return
        # Fused ops A/B: recapture with a subset, time batch 1 and 64.
        backend = runner.backend
        full = backend.fused_ops
        variants = {"none": frozenset()} | {f"without_{op}": full - {op} for op in sorted(full)}
        ab = []
        for name, ops in variants.items():
            backend.fused_ops = ops
            graphs.capture()
            for b in (1, 64):
                if b <= self.args.max_num_seqs:
                    ab.append({"variant": name, "batch": b, "step_ms": round(self.decode_step_ms(b), 3)})
                    print(ab[-1], flush=True)
        backend.fused_ops = full
        graphs.capture()
        self.res["fused_ops_ab"] = ab

    def prefill(self) -> None:
        assert self.llm is not None
        rows = []
        params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
        for length, n in ((512, 16), (2048, 8)):
            self.llm.generate([rand_prompt(length, self.vocab, self.rng) for _ in range(2)], params)  # warm-up
            prompts = [rand_prompt(length, self.vocab, self.rng) for _ in range(n)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            tok_s = n * length / dt
            frac = 2 * self.params * tok_s / self.res["hw"]["matmul_flops"]
            rows.append({"prompt_len": length, "num_prompts": n, "tok_s": round(tok_s), "frac_of_matmul": round(frac, 3)})
            print(rows[-1], flush=True)
        self.res["prefill"] = rows

    def serve(self) -> None:
        assert self.llm is not None
        n, plen, olen = 1000, 256, 64
        prompts = [rand_prompt(plen, self.vocab, self.rng) for _ in range(n)]
        params = SamplingParams(max_tokens=olen, ignore_eos=True, temperature=0.0)
        self.llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        runner = self.llm.engine.runner
        before = (runner.num_eager_steps, runner.mixed.num_replays if runner.mixed else 0)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        assert all(len(o.token_ids) == olen for o in outs)
        # Share of the bf16 matmul rate: 2 * params FLOPs per token computed (prompt and
        # output tokens; attention FLOPs left out).
        frac = 2 * self.params * n * (plen + olen) / dt / self.res["hw"]["matmul_flops"]
        self.res["serve"] = {"num_requests": n, "prompt_len": plen, "output_len": olen, "wall_s": round(dt, 2),
                             "output_tok_s": round(n * olen / dt), "total_tok_s": round(n * (plen + olen) / dt),
                             "frac_of_matmul": round(frac, 3), "mixed_cuda_graphs": runner.mixed is not None,
                             "eager_steps": runner.num_eager_steps - before[0],
                             "mixed_graph_steps": (runner.mixed.num_replays if runner.mixed else 0) - before[1]}
        print(self.res["serve"], flush=True)

    def _ttft(self, prompts: list[list[int]]) -> dict[str, float]:
        assert self.llm is not None
        engine = self.llm.engine
        params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
        t0 = time.perf_counter()
        ids = [f"pfx-{i}-{self.rng.random()}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, params)
        first: dict[str, float] = {}
        cached = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.new_token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter() - t0
                    cached += out.num_cached_tokens
        ttfts = sorted(first.values())
        return {"mean_ms": round(sum(ttfts) / len(ttfts) * 1e3, 2), "p50_ms": round(ttfts[len(ttfts) // 2] * 1e3, 2),
                "max_ms": round(ttfts[-1] * 1e3, 2), "num_cached_tokens": cached}

    def prefix(self) -> None:
        assert self.llm is not None
        bm = self.llm.engine.scheduler.block_manager
        out = {}
        for on in (True, False):
            bm.reset_prefix_cache()
            bm.enable_prefix_caching = on
            shared = rand_prompt(1000, self.vocab, self.rng)
            self._ttft([shared + rand_prompt(24, self.vocab, self.rng)])  # prime the cache
            # Warm-up round first: short queries over a long cached context compile
            # their own Triton specialisation (about a second, once per process).
            for _ in range(2):
                out["on" if on else "off"] = self._ttft([shared + rand_prompt(24, self.vocab, self.rng)
                                                         for _ in range(32)])
        bm.enable_prefix_caching = True
        out["ttft_saving"] = round(1 - out["on"]["mean_ms"] / out["off"]["mean_ms"], 3)
        self.res["prefix"] = out
        print(out, flush=True)

    def profile(self) -> None:
        assert self.llm is not None
        from torch.profiler import ProfilerActivity, profile

        base = os.path.splitext(self.args.out)[0]
        for label, fn in (("decode_b1", lambda: self.decode_step_ms(1, steps=10)),
                          ("decode_b64", lambda: self.decode_step_ms(64, steps=10)),
                          ("prefill_2048", lambda: self.llm.generate(  # type: ignore[union-attr]
                              [rand_prompt(2048, self.vocab, self.rng) for _ in range(2)],
                              SamplingParams(max_tokens=1, ignore_eos=True)))):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
            path = f"{base}_profile_{label}.txt"
            with open(path, "w") as f:
                f.write(table)
            print(f"--- profile {label} -> {path}\n{table[:6000]}", flush=True)

    def hf(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.llm = None
        gc.collect()
        torch.cuda.empty_cache()
        cfg_dict = dict(DUMMY_CONFIGS[self.args.model])
        cfg = AutoConfig.for_model("qwen2" if cfg_dict.pop("attention_bias", False) else "llama", **cfg_dict)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
        vocab = cfg.vocab_size
        rows = []
        for batch in (1, 64):
            ids = torch.tensor([rand_prompt(256, vocab, self.rng) for _ in range(batch)], device="cuda")
            kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=64, min_new_tokens=64, **kw)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            assert out.shape[1] == 256 + 64
            rows.append({"batch": batch, "prompt_len": 256, "output_len": 64, "wall_s": round(dt, 2),
                         "output_tok_s": round(batch * 64 / dt, 1)})
            print("hf", rows[-1], flush=True)
        self.res["hf_generate"] = rows


def print_table(res: dict[str, Any]) -> None:
    print(f"\n## {res['model']} on {res['device']}, {res['date']} (torch {res['torch']})")
    if "hw" in res:
        print(f"copy {res['hw']['copy_bps'] / 1e12:.2f} TB/s, bf16 matmul {res['hw']['matmul_flops'] / 1e12:.0f} TFLOP/s")
    if "decode" in res:
        print("| batch | mode | step ms | floor ms | of floor | tok/s |\n| --- | --- | --- | --- | --- | --- |")
        for r in res["decode"]:
            print(f"| {r['batch']} | {r['mode']} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | "
                  f"{r['frac_of_floor']:.0%} | {r['tok_s']:,.0f} |")
    for r in res.get("fused_ops_ab", []):
        print(f"fused A/B {r['variant']:>20s} batch {r['batch']:3d}: {r['step_ms']:.2f} ms")
    for r in res.get("prefill", []):
        print(f"prefill {r['prompt_len']}: {r['tok_s']:,} tok/s ({r['frac_of_matmul']:.0%} of matmul rate)")
    if "serve" in res:
        s = res["serve"]
        print(f"serve 1000 x 256/64: {s['output_tok_s']:,} output tok/s ({s['wall_s']} s, "
              f"{s.get('frac_of_matmul', 0):.0%} of the matmul rate, mixed-step graphs {s.get('mixed_cuda_graphs')})")
    if "prefix" in res:
        p = res["prefix"]
        print(f"prefix TTFT mean: on {p['on']['mean_ms']} ms, off {p['off']['mean_ms']} ms "
              f"(saving {p['ttft_saving']:.0%}, cached tokens {p['on']['num_cached_tokens']})")
    for r in res.get("hf_generate", []):
        print(f"HF generate batch {r['batch']}: {r['output_tok_s']} output tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-7B", choices=sorted(DUMMY_CONFIGS))
    ap.add_argument("--sections", default=ALL_SECTIONS)
    ap.add_argument("--out", default="bench/results/engine_h100.json")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--mixed-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="capture CUDA graphs of steps that carry prefill chunks (off: they run eagerly)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                    help="KV cache element type (fp8: float8 e4m3)")
    ap.add_argument("--quantization", default="none", choices=("none", "fp8"),
                    help="linear weights in FP8 (worker/models/fp8.py)")
    ap.add_argument("--without-fused", default="",
                    help="comma list of the Triton backend's fused ops to leave off in every section "
                         "(e.g. fp8_out), for an A/B of the whole engine")
    ap.add_argument("--no-fused-ab", dest="fused_ab", action="store_false",
                    help="skip the fused-ops A/B of the decode section (5 recaptures)")
    args = ap.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if args.without_fused:
        from worker.models.attention import TritonAttentionBackend

        # Before the engine is built, so that every graph is captured without them.
        dropped = {op.strip() for op in args.without_fused.split(",")}
        TritonAttentionBackend.ALL_FUSED_OPS = TritonAttentionBackend.ALL_FUSED_OPS - dropped
    bench = Bench(args)
    bench.hw()  # every section needs the rates
    if any(s in sections for s in ("decode", "prefill", "serve", "prefix", "profile")):
        bench.llm = bench.build()
    for name in ("decode", "prefill", "serve", "prefix", "profile", "hf"):
        if name in sections:
            try:
                getattr(bench, name)()
            except Exception as exc:  # noqa: BLE001 -- keep the other sections' results
                import traceback

                traceback.print_exc()
                bench.res[f"{name}_error"] = repr(exc)
            with open(args.out, "w") as f:
                json.dump(bench.res, f, indent=1)
    print_table(bench.res)


if __name__ == "__main__":
    main()

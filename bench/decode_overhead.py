"""Where a graph decode step's wall time goes: GPU replay alone vs the host work around
it (schedule, input fill, sampling + the one sync, scheduler update), at one batch size.

    python -m bench.decode_overhead --model Qwen2.5-7B --batch 64
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from shared.sampling import SamplingParams
from worker.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen2.5-7B")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", default="", help="path prefix for kernel tables of the graph replay")
    args = ap.parse_args()
    llm = LLM(model=args.model, load_format="dummy", max_num_seqs=args.batch, max_model_len=4096,
              max_num_batched_tokens=4096)
    engine, runner = llm.engine, llm.engine.runner
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0.0)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(args.context)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    res: dict[str, float] = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    res["engine_step_ms"] = (time.perf_counter() - t0) / args.steps * 1e3

    # Phases of one step, each timed with the GPU idle at its start.
    sched, fill, replay, sample, update = [], [], [], [], []
    graphs = runner.graphs
    assert graphs is not None
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = engine.scheduler.schedule()
        t1 = time.perf_counter()
        batch = out.scheduled
        bs = runner.block_size
        ids, pos, slots, tables, lens = [], [], [], [], []
        for item in batch:
            req = item.request
            p = req.num_computed_tokens
            ids.append(req.token_ids[p]); pos.append(p); slots.append(req.block_table[p // bs] * bs + p % bs)
            tables.append(req.block_table); lens.append(p + 1)
        graphs.inputs.fill(ids, pos, slots, tables, lens)
        t2 = time.perf_counter()
        logits = graphs.run(len(batch), max(lens))
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        reqs = [i.request for i in batch]
        tokens = runner.sampler(logits, [r.request_id for r in reqs], [r.sampling for r in reqs],
                                [r.token_ids for r in reqs], [r.num_prompt_tokens for r in reqs])
        t4 = time.perf_counter()
        engine.scheduler.update(out, tokens)
        t5 = time.perf_counter()
        sched.append(t1 - t); fill.append(t2 - t1); replay.append(t3 - t2); sample.append(t4 - t3)
        update.append(t5 - t4)
    for name, xs in (("schedule_ms", sched), ("fill_ms", fill), ("replay_gpu_ms", replay),
                     ("sample_ms", sample), ("update_ms", update)):
        res[name] = sum(xs) / len(xs) * 1e3
    # Replay alone, back to back (the GPU's own time for the step).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        graphs.run(args.batch, args.context + 10)
    torch.cuda.synchronize()
    res["replay_back_to_back_ms"] = (time.perf_counter() - t0) / args.steps * 1e3
    # The split-KV hint: the largest context tier instead of the one that fits.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        graphs.run(args.batch, graphs.max_seq_len)
    torch.cuda.synchronize()
    res["replay_back_to_back_ms_largest_tier"] = (time.perf_counter() - t0) / args.steps * 1e3
    res["graph_capture_s"] = graphs.capture_time_s
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graphs.run(args.batch, args.context + 10)
            torch.cuda.synchronize()
        with open(f"{args.profile}_startup.txt", "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    # Recapture after real steps ran (does capture-time state change the replay?).
    for k in range(2):
        graphs.capture()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            graphs.run(args.batch, args.context + 10)
        torch.cuda.synchronize()
        res[f"replay_back_to_back_ms_recapture{k + 1}"] = (time.perf_counter() - t0) / args.steps * 1e3
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for label in ("now", "fresh"):
            if label == "fresh":
                graphs.capture()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    graphs.run(args.batch, args.context + 10)
                torch.cuda.synchronize()
            with open(f"{args.profile}_{label}.txt", "w") as f:
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    print(json.dumps({k: round(v, 3) for k, v in res.items()}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""CPU benchmark of structured outputs on SmolLM2-135M-Instruct (float32).

Sections (``--sections``, comma-separated; default all):
  grammar  the grammar engines on SmolLM2's vocabulary (49,152 tokens), for llguidance
           and, where it imports, xgrammar: tokenizer set-up (once per model, ms),
           compile time of a typical JSON schema (an object with nested objects, an array
           of enums, bounded numbers and patterns; cold, ms) and the token mask along a
           valid 50-token answer (per token: median, p90, mean and max, microseconds), one matcher
           at a time; for llguidance also the batch fill of 16 matchers in its threads
           (``fill_next_token_bitmask_par``, per step) and a deep copy of a compiled
           grammar (what ``worker/structured/cache.py`` does per request). This is the
           measured choice (docs/benchmarks.md, "Structured outputs").
  engine   the offline engine, 16 chat prompts at concurrency 16 (``max_num_seqs`` 16),
           ``OUTPUT_TOKENS`` output tokens each (greedy, ignore_eos), every request
           constrained by a JSON schema that cannot end before ``OUTPUT_TOKENS`` (an array
           with ``minItems``), against the same requests unconstrained: output tok/s
           (output tokens over the wall time of ``generate``, prefill included), and the
           host time spent filling masks and on the device applying them. Runs alternate,
           best of ``--repeat`` each (the host is shared: the load average is recorded).

Run: python -m bench.structured_bench --out bench/results/structured_cpu.json
On a GPU (docs/operations.md, "On a GPU machine without a package index"): python -m bench.structured_bench
--sections engine --dummy-model Qwen2.5-7B --tokenizer-dir .tokenizer --out $OUT/structured_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

from bench.host import cpu_description

MODEL = "SmolLM2-135M-Instruct"
#: A typical response_format schema: nested object, array of enums, bounded numbers, a pattern.
SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "address", "tags", "score"],
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
}
#: A valid answer to SCHEMA, whose tokens the mask is timed along.
ANSWER = {"address": {"city": "San Francisco", "zip": "94103"}, "age": 42, "name": "Ada Lovelace Byron",
          "score": 0.875, "tags": ["red", "blue", "green"]}
OUTPUT_TOKENS = 64
NUM_PROMPTS = 16
#: The engine section's schema: typical fields, then an array that needs more than
#: OUTPUT_TOKENS tokens, so constrained requests run exactly as long as unconstrained ones.
LONG_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": OUTPUT_TOKENS}},
}


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _summary_us(times_s: list[float]) -> dict[str, float]:
    us = [t * 1e6 for t in times_s]
    p90 = statistics.quantiles(us, n=10)[-1]
    return {"median_us": statistics.median(us), "p90_us": p90, "mean_us": statistics.fmean(us), "max_us": max(us)}


def bench_llguidance(hf_tokenizer: Any, vocab_size: int, answer_ids: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    from shared.grammars import grammar_for
    from shared.sampling import StructuredOutput

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
    tokenizer_ms = _ms(t0)
    grammar = grammar_for(StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA, sort_keys=True)))
    t0 = time.perf_counter()
    compiled = llguidance.LLMatcher(tok, grammar, log_level=0)
    compile_ms = _ms(t0)
    bitmask = lt.allocate_token_bitmask(NUM_PROMPTS, vocab_size)
    t0 = time.perf_counter()
    matcher = compiled.deep_copy()
    copy_us = _ms(t0) * 1e3
    times = []
    for token in answer_ids:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - t0)
        assert matcher.consume_token(token), matcher.get_error()
    executor = llguidance.LLExecutor()
    matchers = [compiled.deep_copy() for _ in range(NUM_PROMPTS)]
    batch_times = []
    for token in answer_ids:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        batch_times.append(time.perf_counter() - t0)
        for m in matchers:
            m.consume_token(token)
    return {"engine": "llguidance", "version": llguidance.__version__, "tokenizer_ms": tokenizer_ms,
            "compile_ms": compile_ms, "first_mask_us": times[0] * 1e6, "deep_copy_us": copy_us,
            "mask_per_token": _summary_us(times[1:]), "batch16_fill_per_step": _summary_us(batch_times[1:])}


def bench_xgrammar(hf_tokenizer: Any, vocab_size: int, answer_ids: list[int], eos: int) -> dict[str, Any]:
    try:
        import xgrammar as xgr
    except ImportError as exc:
        return {"engine": "xgrammar", "error": f"does not import: {exc}"}
    from importlib.metadata import version

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
    tokenizer_ms = _ms(t0)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA, sort_keys=True), any_whitespace=False,
                                            separators=(",", ":"))  # compact, as vLLM asks for it
    compile_ms = _ms(t0)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    times = []
    for token in answer_ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - t0)
        assert matcher.accept_token(token)
    return {"engine": "xgrammar", "version": version("xgrammar"), "tokenizer_ms": tokenizer_ms,
            "compile_ms": compile_ms, "first_mask_us": times[0] * 1e6, "mask_per_token": _summary_us(times[1:])}


def bench_grammar() -> list[dict[str, Any]]:
    from shared.model_source import resolve_model
    from shared.tokenizer_loader import load_tokenizer

    source = resolve_model(MODEL)
    hf = load_tokenizer(source.path)
    vocab_size = int(source.config["vocab_size"])
    # The answer as the compact JSON both engines enforce, in the schema's key order.
    answer_ids = list(hf.encode(json.dumps(ANSWER, sort_keys=True, separators=(",", ":"))))
    rows = [bench_llguidance(hf, vocab_size, answer_ids),
            bench_xgrammar(hf, vocab_size, answer_ids, int(hf.eos_token_id))]
    for row in rows:
        row["answer_tokens"] = len(answer_ids)
    return rows


class _MaskTimer:
    """Wraps ``GrammarMasks.mask`` and ``apply_token_bitmask_`` to sum their wall time, ms."""

    def __init__(self, engine: Any) -> None:
        import worker.engine.sampler as sampler_mod

        self.fill_ms = self.apply_ms = 0.0
        masks = engine.runner.grammar_masks
        fill, apply = masks.mask, sampler_mod.apply_token_bitmask_

        def timed_fill(grammars: Any) -> Any:
            t0 = time.perf_counter()
            out = fill(grammars)
            self.fill_ms += _ms(t0)
            return out

        def timed_apply(logits: torch.Tensor, mask: Any) -> None:
            t0 = time.perf_counter()
            apply(logits, mask)
            self.apply_ms += _ms(t0)

        masks.mask = timed_fill
        sampler_mod.apply_token_bitmask_ = timed_apply  # type: ignore[assignment]


def bench_engine(repeat: int, model: str = MODEL, **settings: Any) -> dict[str, Any]:
    """The engine section (module docstring) on ``model`` (default float32 on the CPU;
    ``settings`` are ``LLM`` keywords, e.g. a dummy GPU model's ``load_format``)."""
    from shared.sampling import SamplingParams, StructuredOutput
    from worker.llm import LLM

    llm = LLM(model, max_num_seqs=NUM_PROMPTS, **({"dtype": "float32"} | settings))
    timer = _MaskTimer(llm.engine)
    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe person number {i} as JSON, with many tags."}],
        add_generation_prompt=True, tokenize=True)["input_ids"] for i in range(NUM_PROMPTS)]
    structured = StructuredOutput(kind="json_schema", spec=json.dumps(LONG_SCHEMA, sort_keys=True))
    kinds = {"unconstrained": SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True),
             "json_schema": SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True,
                                           structured=structured)}
    llm.generate(prompts[:2], list(kinds.values()))  # warm-up: kernels, tokenizer, compiled grammar
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(repeat):
        for kind, params in kinds.items():
            timer.fill_ms = timer.apply_ms = 0.0
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall_s = time.perf_counter() - t0
            num_tokens = sum(len(o.token_ids) for o in outs)
            assert num_tokens == NUM_PROMPTS * OUTPUT_TOKENS, num_tokens
            if kind == "json_schema":  # every output is a prefix of a valid answer
                assert all(o.text.startswith('{"age":') for o in outs), outs[0].text
            runs[kind].append({"output_tok_s": num_tokens / wall_s, "wall_s": wall_s,
                               "mask_fill_ms": timer.fill_ms, "mask_apply_ms": timer.apply_ms})
            print(json.dumps({kind: runs[kind][-1]}), flush=True)
    best = {kind: max(r, key=lambda x: x["output_tok_s"]) for kind, r in runs.items()}
    return {"num_prompts": NUM_PROMPTS, "output_tokens": OUTPUT_TOKENS, "threads": torch.get_num_threads(),
            "runs": runs, "best": best,
            "ratio_constrained_over_unconstrained": best["json_schema"]["output_tok_s"]
            / best["unconstrained"]["output_tok_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="grammar,engine")
    p.add_argument("--repeat", type=int, default=2, help="engine runs of each kind (best counts)")
    p.add_argument("--out", default="bench/results/structured_cpu.json")
    p.add_argument("--dummy-model", help="engine section on this named dummy config (bench/model_folder.py), "
                   "with --tokenizer-dir's files beside it, in the device's default dtype (a GPU run)")
    p.add_argument("--tokenizer-dir", type=Path, help="with --dummy-model: the default model's tokenizer files")
    args = p.parse_args()
    sections = set(args.sections.split(","))
    result: dict[str, Any] = {"date": date.today().isoformat(), "machine": cpu_description(),
                              "torch": torch.__version__, "model": MODEL,
                              "load_average_at_start": os.getloadavg()[0]}
    if "grammar" in sections:
        result["grammar"] = bench_grammar()
        for row in result["grammar"]:
            print(json.dumps(row), flush=True)
    if "engine" in sections and args.dummy_model:
        import tempfile

        from bench.model_folder import build_model_folder

        with tempfile.TemporaryDirectory() as tmp:
            folder = build_model_folder(args.dummy_model, Path(tmp), args.tokenizer_dir)[0]
            result["engine"] = bench_engine(args.repeat, str(folder), load_format="dummy", dtype="auto")
        result["model"] = f"{args.dummy_model} (dummy weights, {MODEL}'s tokenizer)"
        if torch.cuda.is_available():
            result["machine"] = torch.cuda.get_device_name()
        print(json.dumps(result["engine"]["best"]), flush=True)
    elif "engine" in sections:
        result["engine"] = bench_engine(args.repeat)
        print(json.dumps(result["engine"]["best"]), flush=True)
    result["load_average_at_end"] = os.getloadavg()[0]  # other processes on the shared host
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

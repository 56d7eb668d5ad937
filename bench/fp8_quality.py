"""Quality of FP8 weights (``--quantization fp8``) on the default model, on CPU.

Perplexity of SmolLM2-135M-Instruct (real weights, float32) on a fixed ~2,000-token
text (``bench.fp8_kv_quality.fixed_text``), scored in one prefill through prompt
logprobs, with float32 weights and with FP8 ones: the CPU reference of the FP8 path
(``worker/models/fp8.py``: the linear weights rounded through E4M3 with per-output-channel
scales at load and stored back in float32, the activations rounded through E4M3 per
token in each product), and with the FP8 weights alone (activations unrounded). Also
records the mean |relative error| of the FP8 weights.

Run: python bench/fp8_quality.py --out bench/results/fp8_quality_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.fp8_kv_quality import fixed_text, perplexity
from worker.llm import LLM


def build(quantization: str) -> LLM:
    """The default model in float32 on CPU with the reference attention and ``quantization``."""
    return LLM(dtype="float32", device="cpu", attention_backend="torch", quantization=quantization, max_num_seqs=1,
               enable_prefix_caching=False)  # the same prompt is scored twice on one engine


def mean_weight_rel_error(ref: LLM, fp8: LLM) -> float:
    """Mean over the FP8 linears of ``|w_fp8 - w| / |w|`` (elements with ``w != 0``)."""
    ref_params = dict(ref.engine.runner.model.named_parameters())
    errors = []
    for name, module in fp8.engine.runner.model.named_modules():
        if getattr(module, "fp8_reference", False):
            w = ref_params[f"{name}.weight"].detach()
            nonzero = w != 0
            errors.append(((module.weight.detach() - w).abs()[nonzero] / w.abs()[nonzero]).mean().item())
    return sum(errors) / len(errors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-tokens", type=int, default=2000)
    ap.add_argument("--out", default="bench/results/fp8_quality_cpu.json")
    args = ap.parse_args()
    res: dict[str, Any] = {"date": date.today().isoformat(), "torch": torch.__version__,
                           "model": "SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu"}
    ref = build("none")
    ids = ref.encode(fixed_text())[:args.num_tokens]
    res["num_tokens"] = len(ids)
    res["ppl_float32_weights"] = perplexity(ref, ids)
    fp8 = build("fp8")
    res["ppl_fp8_weights"] = perplexity(fp8, ids)
    res["ppl_rel_change"] = res["ppl_fp8_weights"] / res["ppl_float32_weights"] - 1.0
    res["mean_weight_rel_error"] = mean_weight_rel_error(ref, fp8)
    # The FP8 weights alone: activations left unrounded (the CUDA path rounds them).
    for module in fp8.engine.runner.model.modules():
        if getattr(module, "fp8_reference", False):
            module.fp8_reference = False
    res["ppl_fp8_weights_only"] = perplexity(fp8, ids)
    res["ppl_rel_change_weights_only"] = res["ppl_fp8_weights_only"] / res["ppl_float32_weights"] - 1.0
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

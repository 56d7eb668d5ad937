"""Quality of FP8 weights (``--quantization fp8``) on the default model, on CPU.

Perplexity of SmolLM2-135M-Instruct (real weights, float32) on a fixed ~2,000-token
text (``bench.fp8_kv_quality.fixed_text``), scored in one prefill through prompt
logprobs, with float32 weights and with FP8 ones through the CPU reference of the FP8
path (``worker/models/fp8.py``: the linear weights rounded through E4M3 at load and
stored back in float32), for each weight layout (``fp8.FP8_SCHEMES``):

- ``block`` (the default: 128x128 block scales, built with ``quantization="fp8"``) and
  ``channel`` (per output channel; converted in place on a float32 engine);
- each with the inputs of every product rounded as CUDA's prefill path rounds them
  (``fp8.round_inputs``: per 1x128 group for ``block``, per token for ``channel``), and
  with the weights alone (inputs unrounded: what CUDA's decode path, ``kernels/fp8_gemv.py``,
  computes).

Also records the mean |relative error| of the FP8 weights of each layout.

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
from bench.fp8_kv_quality import build, fixed_text, perplexity
from worker.llm import LLM
from worker.models.fp8 import FP8_SCHEMES
from worker.models.linear import Linear
from worker.models.loader import fp8_linears


def reference_linears(llm: LLM) -> list[Linear]:
    """The linears of ``llm`` that hold an FP8 reference weight (``Linear.dequantize_fp8``)."""
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.fp8_reference]


def to_reference(llm: LLM, scheme: str) -> None:
    """Convert ``llm``'s float32 FP8-eligible linears in place into the FP8 reference of
    ``scheme`` (and repack the CPU weights)."""
    model = llm.engine.runner.model
    for m in fp8_linears(model):
        m.to_fp8(scheme)
        m.dequantize_fp8(torch.float32)
    if model.packed_max_rows is not None:
        model.prepack_for_cpu(model.packed_max_rows)


def mean_weight_rel_error(ref: dict[str, torch.Tensor], fp8: LLM) -> float:
    """Mean over the FP8 linears of ``|w_fp8 - w| / |w|`` (elements with ``w != 0``);
    ``ref`` maps parameter names to the float32 weights."""
    errors = []
    for name, module in fp8.engine.runner.model.named_modules():
        if isinstance(module, Linear) and module.fp8_reference:
            w = ref[f"{name}.weight"]
            nonzero = w != 0
            errors.append(((module.weight.detach() - w).abs()[nonzero] / w.abs()[nonzero]).mean().item())
    return sum(errors) / len(errors)


def score(llm: LLM, ids: list[int], ppl_ref: float, prefix: str, res: dict[str, Any]) -> None:
    """Perplexity of ``llm`` with rounded inputs and with the weights alone, into ``res``."""
    res[f"ppl_{prefix}"] = perplexity(llm, ids)
    res[f"ppl_rel_change_{prefix}"] = res[f"ppl_{prefix}"] / ppl_ref - 1.0
    for m in reference_linears(llm):  # inputs unrounded from now on
        m.fp8_reference = False
    res[f"ppl_{prefix}_weights_only"] = perplexity(llm, ids)
    res[f"ppl_rel_change_{prefix}_weights_only"] = res[f"ppl_{prefix}_weights_only"] / ppl_ref - 1.0
    print(json.dumps({k: v for k, v in res.items() if prefix in k}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-tokens", type=int, default=2000)
    ap.add_argument("--out", default="bench/results/fp8_quality_cpu.json")
    args = ap.parse_args()
    res: dict[str, Any] = {"date": date.today().isoformat(), "torch": torch.__version__,
                           "model": "SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu",
                           "default_scheme": FP8_SCHEMES[0]}
    llm = build()
    ids = llm.encode(fixed_text())[:args.num_tokens]
    res["num_tokens"] = len(ids)
    ppl_ref = res["ppl_float32_weights"] = perplexity(llm, ids)
    weights = {n: p.detach().clone() for n, p in llm.engine.runner.model.named_parameters()}
    to_reference(llm, "channel")  # the engine holds float32 weights until here
    res["mean_weight_rel_error_channel"] = mean_weight_rel_error(weights, llm)
    score(llm, ids, ppl_ref, "channel", res)
    del llm
    served = build(quantization="fp8")  # the default layout, as --quantization fp8 loads it
    assert all(m.fp8_block_scales for m in reference_linears(served)), "the default layout is not block"
    res["mean_weight_rel_error_block"] = mean_weight_rel_error(weights, served)
    score(served, ids, ppl_ref, "block", res)
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

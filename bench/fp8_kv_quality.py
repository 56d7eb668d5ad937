"""Quality of the fp8 KV cache (``--kv-cache-dtype fp8``) on the default model, on CPU.

Perplexity of SmolLM2-135M-Instruct (real weights, float32) on a fixed ~2,000-token
text, scored in one prefill through prompt logprobs, with a float32 KV cache and with an
fp8 one (e4m3, scale 1.0; the reference attention reads the quantized cache back, see
``kernels/paged_attention.py``). Also records the largest |K| and |V| written to the cache,
which is what the fixed scale of 1.0 must keep inside e4m3's ±448.

Run: python bench/fp8_kv_quality.py --out bench/results/fp8_kv_quality_cpu.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
from datetime import date
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shared.sampling import SamplingParams
from worker.llm import LLM
from worker.models.attention import TorchAttentionBackend

# English prose with some code: the docstrings of these standard-library modules and of
# their public functions and classes, in this order (fixed for a given Python version).
_TEXT_MODULES = ("argparse", "json", "heapq", "difflib", "textwrap", "shlex", "csv", "string", "fractions")


def fixed_text() -> str:
    """A fixed text of about 6,000 words from standard-library docstrings (see above)."""
    import importlib

    parts = []
    for name in _TEXT_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(getattr(module, "__all__", [])):
            doc = inspect.getdoc(getattr(module, attr, None))
            if doc and callable(getattr(module, attr)):
                parts.append(doc)
    return "\n\n".join(p for p in parts if p)


class _AbsMaxBackend(TorchAttentionBackend):
    """The reference backend, recording the largest |K| and |V| it writes."""

    def __init__(self) -> None:
        self.k_max = self.v_max = 0.0

    def __call__(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None):  # type: ignore[no-untyped-def]
        self.k_max = max(self.k_max, k.abs().max().item())
        self.v_max = max(self.v_max, v.abs().max().item())
        return super().__call__(q, k, v, k_cache, v_cache, meta, scale, sliding_window)


def perplexity(llm: LLM, prompt_ids: list[int]) -> float:
    """``exp`` of the mean negative log-likelihood of ``prompt_ids[1:]``, one prefill."""
    out = llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs is not None
    return math.exp(-sum(e.logprob for e in out.prompt_logprobs) / len(out.prompt_logprobs))


def build(kv_cache_dtype: str, **kwargs: Any) -> LLM:
    """The default model in float32 on CPU with the reference attention and ``kv_cache_dtype``."""
    return LLM(dtype="float32", device="cpu", attention_backend="torch", kv_cache_dtype=kv_cache_dtype,
               max_num_seqs=1, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-tokens", type=int, default=2000)
    ap.add_argument("--out", default="bench/results/fp8_kv_quality_cpu.json")
    args = ap.parse_args()
    res: dict[str, Any] = {"date": date.today().isoformat(), "torch": torch.__version__,
                           "model": "SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu"}
    ref = build("auto")
    ids = ref.encode(fixed_text())[:args.num_tokens]
    res["num_tokens"] = len(ids)
    recorder = _AbsMaxBackend()
    ref.engine.runner.backend = recorder
    res["ppl_float32_cache"] = perplexity(ref, ids)
    res["max_abs_k"], res["max_abs_v"] = round(recorder.k_max, 3), round(recorder.v_max, 3)
    del ref
    res["ppl_fp8_cache"] = perplexity(build("fp8"), ids)
    res["ppl_rel_change"] = res["ppl_fp8_cache"] / res["ppl_float32_cache"] - 1.0
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

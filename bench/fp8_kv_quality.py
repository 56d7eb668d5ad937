"""Quality of the fp8 KV cache (``--kv-cache-dtype fp8``) on the default model, on CPU.

Perplexity of SmolLM2-135M-Instruct (real weights, float32) on a fixed ~2,000-token
text, scored in one prefill through prompt logprobs, with a float32 KV cache and with an
fp8 one as served: each layer's mean key subtracted before the write and K/V scales of
1.0 unless values come near e4m3's 448 (``KV_SCALE_HEADROOM``), calibrated at load on the
engine's built-in text
(``worker/engine/kv_calibration.py``, not this text); the reference attention reads the
quantized cache back (``kernels/paged_attention.py``). Also records the largest |K| and
|V| written to the float32 cache.

Variants, set on the same engine by replacing its layers' ``KVQuant`` (the encoding is
the only difference):
- ``k_bias_amax_scales``: the same calibration with scales of ``amax / 448`` (vLLM's
  ``calculate_kv_scales``) instead of the served ones (1.0 unless values come near 448);
- ``uncalibrated``: no bias and scales of 1.0 (vLLM's default; served before issue 16's
  seventh session).

Capacity: KV blocks that fit ``kv_cache_bytes`` for a bfloat16 model with a bfloat16 cache
and with an fp8 one (``engine.num_kv_blocks``), the fp8 side less the calibration's
per-layer K bias buffers (float32 ``[num_kv_heads, head_dim]``), which also take memory.

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
from shared.settings import EngineSettings
from worker.engine.engine import num_kv_blocks
from worker.engine.kv_calibration import calibrate_kv_cache, kv_calibration_ids
from worker.llm import LLM
from worker.models.attention import KVQuant, TorchAttentionBackend

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

    def __call__(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None,  # type: ignore[no-untyped-def]
                 kv_quant=None):
        self.k_max = max(self.k_max, k.abs().max().item())
        self.v_max = max(self.v_max, v.abs().max().item())
        return super().__call__(q, k, v, k_cache, v_cache, meta, scale, sliding_window, kv_quant)


def perplexity(llm: LLM, prompt_ids: list[int]) -> float:
    """``exp`` of the mean negative log-likelihood of ``prompt_ids[1:]``, one prefill."""
    out = llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs is not None
    return math.exp(-sum(e.logprob for e in out.prompt_logprobs) / len(out.prompt_logprobs))


def build(**kwargs: Any) -> LLM:
    """The default model in float32 on CPU with the reference attention, one sequence and
    no prefix caching (the same prompt is scored more than once), plus ``kwargs`` (e.g.
    ``kv_cache_dtype``, ``quantization``); shared by bench/fp8_quality.py."""
    return LLM(**{"dtype": "float32", "device": "cpu", "attention_backend": "torch", "max_num_seqs": 1,
                  "enable_prefix_caching": False, **kwargs})


def set_encoding(llm: LLM, quants: list[KVQuant | None]) -> None:
    """Give layer ``i`` of ``llm``'s model the fp8 encoding ``quants[i]`` (``None``: no bias,
    scales of 1.0)."""
    for layer, q in zip(llm.engine.runner.model.layers, quants, strict=True):
        layer.self_attn.kv_quant = q


def capacity(llm: LLM, kv_cache_bytes: int = 2**30) -> dict[str, Any]:
    """Blocks of a bfloat16 and of an fp8 cache in ``kv_cache_bytes`` for ``llm``'s model
    (the fp8 side less its K bias buffers) and their ratio (the goal: >= 1.9)."""
    cfg, cpu = llm.engine.model_config, torch.device("cpu")
    bf16 = num_kv_blocks(cfg, EngineSettings(kv_cache_bytes=kv_cache_bytes), torch.bfloat16, cpu)
    bias_bytes = sum(layer.self_attn.kv_quant.k_bias.nbytes for layer in llm.engine.runner.model.layers)
    fp8 = num_kv_blocks(cfg, EngineSettings(kv_cache_bytes=kv_cache_bytes - bias_bytes, kv_cache_dtype="fp8"),
                        torch.bfloat16, cpu)
    return {"kv_cache_bytes": kv_cache_bytes, "k_bias_bytes": bias_bytes, "blocks_bf16": bf16, "blocks_fp8": fp8,
            "ratio": fp8 / bf16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-tokens", type=int, default=2000)
    ap.add_argument("--out", default="bench/results/fp8_kv_quality_cpu.json")
    args = ap.parse_args()
    res: dict[str, Any] = {"date": date.today().isoformat(), "torch": torch.__version__,
                           "model": "SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu"}
    ref = build(kv_cache_dtype="auto")
    ids = ref.encode(fixed_text())[:args.num_tokens]
    res["num_tokens"] = len(ids)
    recorder = _AbsMaxBackend()
    ref.engine.runner.backend = recorder
    res["ppl_float32_cache"] = perplexity(ref, ids)
    res["max_abs_k"], res["max_abs_v"] = round(recorder.k_max, 3), round(recorder.v_max, 3)
    del ref
    fp8 = build(kv_cache_dtype="fp8")
    served = [layer.self_attn.kv_quant for layer in fp8.engine.runner.model.layers]
    assert all(q is not None for q in served), "the engine did not calibrate the fp8 cache"
    res["ppl_fp8_cache"] = perplexity(fp8, ids)
    res["ppl_rel_change"] = res["ppl_fp8_cache"] / res["ppl_float32_cache"] - 1.0
    print("served", res["ppl_fp8_cache"], res["ppl_rel_change"], flush=True)
    res["served_encoding"] = {"k_scale": [round(q.k_scale, 5) for q in served if q],
                              "v_scale": [round(q.v_scale, 5) for q in served if q],
                              "max_abs_k_bias": round(max(q.k_bias.abs().max().item() for q in served if q), 3)}
    served_scales = [(q.k_scale, q.v_scale) for q in served if q]
    runner, es = fp8.engine.runner, fp8.engine.engine_settings
    cal_ids = kv_calibration_ids(fp8.source, es, runner.cfg.vocab_size, runner.max_model_len)
    amax = calibrate_kv_cache(runner.model, runner.kv_caches, cal_ids, runner.device, exact_scales=True)
    variants: dict[str, list[KVQuant | None]] = {
        "k_bias_amax_scales": list(amax), "uncalibrated": [None] * len(served)}
    res["variants"] = {}
    for name, quants in variants.items():
        set_encoding(fp8, quants)
        ppl = perplexity(fp8, ids)
        res["variants"][name] = {"ppl": ppl, "rel_change": ppl / res["ppl_float32_cache"] - 1.0}
        print(name, res["variants"][name], flush=True)
    set_encoding(fp8, served)
    for q, (k_scale, v_scale) in zip(served, served_scales):  # amax's are the served objects
        assert q is not None
        q.k_scale, q.v_scale = k_scale, v_scale
    res["capacity"] = capacity(fp8)
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

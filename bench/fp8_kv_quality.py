"""Quality of the fp8 KV cache (``--kv-cache-dtype fp8``) on the default model, on CPU.

Perplexity of SmolLM2-135M-Instruct (real weights, float32) on a fixed ~2,000-token
text, scored in one prefill through prompt logprobs, with a float32 KV cache and with an
fp8 one (e4m3, scale 1.0; the reference attention reads the quantized cache back, see
``kernels/paged_attention.py``). Also records the largest |K| and |V| written to the cache,
which is what the fixed scale of 1.0 must keep inside e4m3's ±448.

Also scores calibrated alternatives the engine does not serve yet (issue 16; simulated by
a backend wrapper that knows the layer by its call order), calibrated on the 512 tokens
of the text that follow the scored ones:
- ``amax``: a K and a V scale per layer, ``amax / 448`` of the calibration prefill (as
  vLLM's ``calculate_kv_scales``);
- ``k_smooth``: each layer's mean K vector per KV head subtracted before the K write
  (scale 1.0). Exact for softmax attention: it shifts every logit of a query by the same
  ``q . mean``, so nothing is added back on read; it removes the large common part of K
  that e4m3's 3 mantissa bits otherwise round (SageAttention's K smoothing, Zhang et al. 2024);
- ``k_smooth_amax``: both.

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
from kernels.fp8_quant import FP8_MAX
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


class _CalibrationBackend(TorchAttentionBackend):
    """The reference backend, recording per layer ``amax |K|``, ``amax |V|`` and the sum and
    count of K vectors (``[num_kv_heads, head_dim]``); the layer is the call index modulo
    ``num_layers`` (one forward calls every layer once, in order)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers, self.calls = num_layers, 0
        self.k_amax, self.v_amax = [0.0] * num_layers, [0.0] * num_layers
        self.k_sum: list[torch.Tensor | float] = [0.0] * num_layers
        self.k_count = [0] * num_layers

    def __call__(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None):  # type: ignore[no-untyped-def]
        i = self.calls % self.num_layers
        self.calls += 1
        self.k_amax[i] = max(self.k_amax[i], k.abs().max().item())
        self.v_amax[i] = max(self.v_amax[i], v.abs().max().item())
        self.k_sum[i] = self.k_sum[i] + k.float().sum(0)
        self.k_count[i] += k.shape[0]
        return super().__call__(q, k, v, k_cache, v_cache, meta, scale, sliding_window)


class _CalibratedBackend(TorchAttentionBackend):
    """The reference backend with per-layer K/V scales and an optional K bias ``[H, D]``
    per layer subtracted before the write (layers by call order, as above)."""

    def __init__(self, k_scales: list[float], v_scales: list[float], k_bias: list[torch.Tensor] | None) -> None:
        self.k_scales, self.v_scales, self.k_bias, self.calls = k_scales, v_scales, k_bias, 0

    def __call__(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None):  # type: ignore[no-untyped-def]
        i = self.calls % len(self.k_scales)
        self.calls += 1
        self.k_scale, self.v_scale = self.k_scales[i], self.v_scales[i]
        if self.k_bias is not None:
            k = k - self.k_bias[i].to(k.dtype)
        return super().__call__(q, k, v, k_cache, v_cache, meta, scale, sliding_window)


def calibrated_variants(cal: _CalibrationBackend) -> dict[str, _CalibratedBackend]:
    """The calibrated backends of the module docstring, from a calibration recording."""
    n = cal.num_layers
    ones, k_amax = [1.0] * n, [a / FP8_MAX for a in cal.k_amax]
    v_amax = [a / FP8_MAX for a in cal.v_amax]
    mean = [s / c for s, c in zip(cal.k_sum, cal.k_count, strict=True)]  # type: ignore[operator]
    return {"amax": _CalibratedBackend(k_amax, v_amax, None), "k_smooth": _CalibratedBackend(ones, ones, mean),
            "k_smooth_amax": _CalibratedBackend(k_amax, v_amax, mean)}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-tokens", type=int, default=2000)
    ap.add_argument("--out", default="bench/results/fp8_kv_quality_cpu.json")
    args = ap.parse_args()
    res: dict[str, Any] = {"date": date.today().isoformat(), "torch": torch.__version__,
                           "model": "SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu"}
    ref = build(kv_cache_dtype="auto")
    all_ids = ref.encode(fixed_text())
    ids, calibration_ids = all_ids[:args.num_tokens], all_ids[args.num_tokens:args.num_tokens + 512]
    cal = _CalibrationBackend(len(ref.engine.runner.model.layers))
    ref.engine.runner.backend = cal
    perplexity(ref, calibration_ids)
    res["num_tokens"] = len(ids)
    recorder = _AbsMaxBackend()
    ref.engine.runner.backend = recorder
    res["ppl_float32_cache"] = perplexity(ref, ids)
    res["max_abs_k"], res["max_abs_v"] = round(recorder.k_max, 3), round(recorder.v_max, 3)
    del ref
    fp8 = build(kv_cache_dtype="fp8")
    res["ppl_fp8_cache"] = perplexity(fp8, ids)
    res["ppl_rel_change"] = res["ppl_fp8_cache"] / res["ppl_float32_cache"] - 1.0
    res["calibrated"] = {"calibration_tokens": len(calibration_ids)}
    for name, backend in calibrated_variants(cal).items():
        fp8.engine.runner.backend = backend
        ppl = perplexity(fp8, ids)
        res["calibrated"][name] = {"ppl": ppl, "rel_change": ppl / res["ppl_float32_cache"] - 1.0}
        print(name, res["calibrated"][name], flush=True)
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

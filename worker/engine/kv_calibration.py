"""Calibration of an fp8 KV cache's encoding, once at load (``--kv-cache-dtype fp8``).

For every layer it sets the layer's ``KVQuant`` (``worker/models/attention.py``):
- ``k_bias``, the mean key of each KV head over the calibration prefill, which the cache
  write subtracts before quantizing (``kernels/kv_cache_write.py``). Keys share a large
  common part (a few channels far from zero in every token); e4m3 keeps 3 mantissa bits
  of each entry, so that part costs the small differences between keys, which are what
  attention ranks by. Subtracting one vector from every key leaves softmax attention
  unchanged (SageAttention's K smoothing, Zhang et al., 2024);
- ``k_scale`` and ``v_scale`` from ``amax`` of ``K - k_bias`` and of ``V`` over the same
  prefill: 1.0 unless the values come near e4m3's 448 (``KV_SCALE_HEADROOM``).

Calibration tokens: ``CALIBRATION_TEXT`` (English prose with numbers, about 375 tokens,
built in so that every deployment of a model calibrates the same way) tokenized with the
model's tokenizer, at most ``MAX_CALIBRATION_TOKENS``; keys of real text are what the
cache will hold. The text is prose only: the same text with an indented code block gave
mean keys that raised SmolLM2's fp8 perplexity (+6.1% against +0.4%; the runs of
indentation tokens have atypical keys), so a changed text must be measured again
(``bench/fp8_kv_quality.py``). A model without a tokenizer (dummy weights, whose statistics mean
nothing anyway) gets ids at a fixed stride through the vocabulary (``strided_ids``): the
same on every tensor-parallel rank, which must run the same prefill.

The prefill runs the model with ``_RecordingBackend``: exact causal attention over this
prefill's unquantized K/V, never the paged cache, so no block is used and nothing is left
behind. It runs before the CUDA graphs are captured (``ModelRunner.__init__``).
Quality: docs/benchmarks.md, "FP8 KV cache"; docs/operations.md, "FP8 KV cache".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels.kv_cache_write import FP8_E4M3_MAX
from shared.tokenizer_loader import load_tokenizer
from worker.models.attention import DEFAULT_KV_SCALE, AttentionMetadata, KVQuant

if TYPE_CHECKING:
    from shared.model_source import ModelSource
    from shared.settings import EngineSettings
    from worker.models.llama import KVCache, LlamaForCausalLM

log = logging.getLogger(__name__)

#: A scale grows past 1.0 only where the calibration's largest |K - k_bias| or |V| comes
#: within this factor of e4m3's 448 (it never shrinks below 1.0): e4m3's relative
#: precision is the same over its normal range (2**-6 to 448), so a scale matters only
#: where values would be clamped. Measured on SmolLM2 (docs/benchmarks.md, "FP8 KV cache"):
#: with this calibration, scales of ``amax / 448`` (vLLM's) give +3.8% perplexity against
#: +0.77% with 1.0, served values past the calibration's range being clamped.
KV_SCALE_HEADROOM = 16.0
#: Most tokens of the calibration prefill (SmolLM2-135M: 512 tokens measured as enough,
#: docs/benchmarks.md, "FP8 KV cache"); also capped by ``max_model_len``.
MAX_CALIBRATION_TOKENS = 512

CALIBRATION_TEXT = """\
The committee met on a grey Tuesday morning to review the plans for the new library. \
Its members had read the architect's report, which proposed a building of three floors \
around an open courtyard, with reading rooms facing north for an even light and the \
archives below ground, where the temperature stays between 16 and 18 degrees all year. \
The cost was estimated at 4.2 million, about 15% above the budget agreed last spring.

"We can save most of the difference," said the treasurer, "if the courtyard is covered \
with glass instead of the copper roof in the drawings." Others were not convinced: glass \
lets in heat in summer, and the archives would then need more cooling, which costs money \
every year rather than once. After an hour of discussion they asked the architect for two \
versions of the plan and a table of the running costs of each over twenty years.

In the second half of the nineteenth century, railways changed how people thought about \
time. Before them, each town kept its own local time, set by the sun at noon, so that \
clocks in two cities a hundred miles apart might differ by several minutes. Timetables \
made this impossible to ignore, and in 1847 most British railway companies adopted \
Greenwich Mean Time. Standard time zones followed in North America in 1883, and an \
international conference in Washington a year later chose Greenwich as the prime meridian.

Water boils at 100 degrees Celsius at sea level, but at lower temperatures on a \
mountain, where the air pressure is lower: at 3,000 metres it boils at about 90 degrees, \
which is why pasta takes longer to cook there. A pressure cooker works the other way \
round, raising the boiling point to about 120 degrees so that food cooks faster.
"""


def strided_ids(vocab_size: int, num_tokens: int) -> list[int]:
    """``num_tokens`` ids at a fixed prime stride through ``[0, vocab_size)``: the
    calibration prefill of a model without a tokenizer."""
    return [(1 + 7919 * i) % vocab_size for i in range(num_tokens)]


def default_calibration_ids(vocab_size: int, max_model_len: int) -> list[int]:
    """The calibration prefill without a tokenizer: ``strided_ids`` of at most
    ``MAX_CALIBRATION_TOKENS`` and ``max_model_len`` tokens."""
    return strided_ids(vocab_size, min(MAX_CALIBRATION_TOKENS, max_model_len))


def kv_calibration_ids(source: ModelSource, settings: EngineSettings, vocab_size: int,
                       max_model_len: int) -> list[int]:
    """The calibration prefill's token ids (module docstring), or ``[]`` unless
    ``settings.kv_cache_dtype`` is ``fp8``: at most ``MAX_CALIBRATION_TOKENS`` and
    ``max_model_len`` tokens."""
    if settings.kv_cache_dtype != "fp8":
        return []
    if source.path is None or not source.has_tokenizer:
        return default_calibration_ids(vocab_size, max_model_len)
    num_tokens = min(MAX_CALIBRATION_TOKENS, max_model_len)
    tokenizer = load_tokenizer(source.path)
    return [i for i in tokenizer.encode(CALIBRATION_TEXT) if i < vocab_size][:num_tokens]


class _Stats:
    """One layer's calibration statistics: per channel (``[Hkv, D]`` float32) the mean,
    least and largest key, and ``amax |V|`` (a 0-d tensor)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        k = k.float()
        self.k_mean, self.k_min, self.k_max = k.mean(0), k.amin(0), k.amax(0)
        self.v_amax = v.float().abs().amax()


class _RecordingBackend:
    """An attention backend for one prefill of one sequence: records each layer's K/V
    statistics (the layer is known by its ``kv_quant``) and attends exactly over this
    prefill's K/V, without reading or writing the paged cache."""

    name = "kv-calibration"
    fused_ops: frozenset[str] = frozenset()  # plain PyTorch ops, on any device

    def __init__(self) -> None:
        self.stats: dict[int, tuple[KVQuant, _Stats]] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, sliding_window: int | None = None, kv_quant: KVQuant | None = None) -> torch.Tensor:
        assert kv_quant is not None, "calibration gives every layer a KVQuant first"
        assert id(kv_quant) not in self.stats, "one prefill: each layer is called once"
        self.stats[id(kv_quant)] = (kv_quant, _Stats(k, v))
        pos = torch.arange(q.shape[0], device=q.device)
        mask = pos[:, None] >= pos[None, :]
        if sliding_window is not None:
            mask &= pos[:, None] - pos[None, :] < sliding_window
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return o[0].transpose(0, 1)


def _scale(amax: float, exact: bool = False) -> float:
    """``max(1.0, amax * KV_SCALE_HEADROOM / 448)`` (see ``KV_SCALE_HEADROOM``), or with
    ``exact`` vLLM's ``amax / 448`` (1.0 for 0)."""
    if exact:
        return amax / FP8_E4M3_MAX if amax > 0 else DEFAULT_KV_SCALE
    return max(DEFAULT_KV_SCALE, amax * KV_SCALE_HEADROOM / FP8_E4M3_MAX)


@torch.no_grad()
def calibrate_kv_cache(model: LlamaForCausalLM, kv_caches: list[KVCache], token_ids: Sequence[int],
                       device: torch.device, exact_scales: bool = False) -> list[KVQuant]:
    """Give every attention layer of ``model`` its fp8 ``KVQuant`` from one prefill of
    ``token_ids`` (module docstring). A layer that already has one is recalibrated in
    place (its ``k_bias`` tensor keeps its address); call it before any CUDA-graph capture
    and before the cache holds any request's K/V.

    Args:
        model: the model (or one tensor-parallel rank's shard: every rank calls this with
            the same ids, in lockstep).
        kv_caches: the model's caches (passed through to the forward; not touched).
        token_ids: 1 to ``max_model_len`` ids (``kv_calibration_ids``).
        device: the model's device.
        exact_scales: scales of ``amax / 448`` as vLLM's ``calculate_kv_scales`` (not
            served: ``KV_SCALE_HEADROOM``; bench/fp8_kv_quality.py compares them).

    Returns:
        The layers' ``KVQuant``, in layer order.

    Raises:
        ValueError: ``token_ids`` is empty.
    """
    if not token_ids:
        raise ValueError("the fp8 KV cache calibration needs at least one token")
    t0 = time.perf_counter()
    attns = [layer.self_attn for layer in model.layers]
    for a in attns:
        if a.kv_quant is None:
            a.kv_quant = KVQuant.identity(a.num_kv_heads, a.head_dim, device)
    n = len(token_ids)
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=device)
    i32 = torch.zeros(1, dtype=torch.int32, device=device)
    meta = AttentionMetadata(slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
                             block_tables=i32.view(1, 1), query_start_loc=torch.tensor([0, n], dtype=torch.int32,
                                                                                       device=device),
                             seq_lens=i32 + n, max_query_len=n, max_seq_len=n, query_lens_cpu=[n], seq_lens_cpu=[n])
    recorder = _RecordingBackend()
    with torch.inference_mode():  # the KVQuant tensors stay normal ones (updatable outside it)
        model(ids, torch.arange(n, device=device), kv_caches, meta, recorder)  # type: ignore[arg-type]
    out = []
    for a in attns:
        q = a.kv_quant
        assert q is not None
        _, st = recorder.stats[id(q)]
        q.k_bias.copy_(st.k_mean)
        q.k_scale = _scale(torch.maximum(st.k_max - st.k_mean, st.k_mean - st.k_min).max().item(), exact_scales)
        q.v_scale = _scale(st.v_amax.item(), exact_scales)
        out.append(q)
    k_scales, v_scales = [q.k_scale for q in out], [q.v_scale for q in out]
    log.info("fp8 KV cache calibrated on %d tokens in %.2f s: |mean K| up to %.2f, k_scale %.4g-%.4g, "
             "v_scale %.4g-%.4g", n, time.perf_counter() - t0, max(q.k_bias.abs().max().item() for q in out),
             min(k_scales), max(k_scales), min(v_scales), max(v_scales))
    return out

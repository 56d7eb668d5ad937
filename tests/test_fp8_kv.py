"""FP8 KV cache (``--kv-cache-dtype fp8``) on CPU: the write quantizes (clamped to
±448), the reference attention dequantizes in its gather (decode, prefill with context,
a sliding window), twice the blocks fit in a bfloat16 model's memory, the ``cpu``
backend refuses fp8 while ``auto`` falls back to the reference, prefix caching still
hits, and the default model's perplexity stays within 2% of the float32 cache's."""

from __future__ import annotations

import pytest
import torch

from bench.fp8_kv_quality import fixed_text, perplexity
from kernels.kv_cache_write import FP8_E4M3_MAX, FP8_KV_DTYPE, kv_cache_write_ref, quantize_fp8
from kernels.paged_attention import paged_attention_ref
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, SettingsError
from worker.engine.engine import num_kv_blocks
from worker.models.attention import TorchAttentionBackend, select_backend
from worker.models.config import ModelConfig

BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 4, 2, 4, 16
K_SCALE, V_SCALE = 0.5, 0.25
QUALITY_TOKENS = 300


def test_write_quantizes_clamps_and_skips_padding() -> None:
    g = torch.Generator().manual_seed(0)
    key = torch.randn(3, KV_HEADS, HEAD_DIM, generator=g) * 4
    value = torch.randn(3, KV_HEADS, HEAD_DIM, generator=g)
    key[0, 0, 0], value[0, 0, 0] = 1e4, -1e4  # beyond 448 * scale: clamped
    k_cache = torch.zeros(2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=FP8_KV_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    kv_cache_write_ref(key, value, k_cache, v_cache, torch.tensor([5, -1, 0]), k_scale=K_SCALE, v_scale=V_SCALE)
    k_flat, v_flat = k_cache.view(-1, KV_HEADS, HEAD_DIM).float(), v_cache.view(-1, KV_HEADS, HEAD_DIM).float()
    assert torch.equal(k_flat[5], quantize_fp8(key[0], K_SCALE).float())
    assert torch.equal(v_flat[0], quantize_fp8(value[2], V_SCALE).float())
    assert k_flat[5, 0, 0] == FP8_E4M3_MAX and v_flat[5, 0, 0] == -FP8_E4M3_MAX
    assert not k_flat[[1, 2, 3, 4, 6, 7]].any()  # padding (slot -1) wrote nothing
    # Entries are x / scale: dequantized, within e4m3's rounding (half of 2**-3 relative).
    assert torch.allclose(k_flat[5, 1:] * K_SCALE, key[0, 1:], rtol=2**-4, atol=2**-9 * K_SCALE)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_reference_attends_to_the_dequantized_cache(sliding_window: int | None) -> None:
    """Decode tokens, a prefill chunk after cached context and a fresh prefill (given its
    unquantized key/value, which an fp8 cache must not use) in one call: equal to the
    same attention over a float32 cache holding ``entry * scale``."""
    g = torch.Generator().manual_seed(1)
    num_blocks = 16
    k_cache = (torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g) * 3).to(FP8_KV_DTYPE)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(FP8_KV_DTYPE)
    q_lens, seq_lens = [1, 6, 7, 1], [9, 14, 7, 3]
    tables = torch.randperm(num_blocks, generator=g)[:16].view(4, 4).int()
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=g)
    key = torch.randn(sum(q_lens), KV_HEADS, HEAD_DIM, generator=g)  # not the cache's contents
    args = (tables, starts, torch.tensor(seq_lens, dtype=torch.int32), HEAD_DIM ** -0.5)
    out = paged_attention_ref(q, k_cache, v_cache, *args, key=key, value=key, sliding_window=sliding_window,
                              k_scale=K_SCALE, v_scale=V_SCALE)
    want = paged_attention_ref(q, k_cache.float() * K_SCALE, v_cache.float() * V_SCALE, *args,
                               sliding_window=sliding_window)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_fp8_holds_twice_the_tokens_of_bfloat16() -> None:
    cfg = ModelConfig.from_hf({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 512,
                               "vocab_size": 1000})
    cpu = torch.device("cpu")
    memory = {"kv_cache_bytes": 64 * 1024**2}
    bf16 = num_kv_blocks(cfg, EngineSettings(**memory), torch.bfloat16, cpu)
    fp8 = num_kv_blocks(cfg, EngineSettings(kv_cache_dtype="fp8", **memory), torch.bfloat16, cpu)
    assert fp8 >= 1.9 * bf16 and fp8 == 2 * bf16


def test_cpu_backend_refuses_fp8_and_auto_falls_back_to_the_reference() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="cpu attention backend has no fp8"):
        select_backend("cpu", cpu, "fp8")
    assert isinstance(select_backend("auto", cpu, "fp8"), TorchAttentionBackend)
    with pytest.raises(SettingsError, match="must be one of auto, fp8"):
        EngineSettings(kv_cache_dtype="fp8_e5m2")


@pytest.fixture(scope="module")
def fp8_engine(smollm_source):
    """The default model (real weights, float32, CPU) with an fp8 cache in the default
    float32 cache's bytes."""
    from bench.fp8_kv_quality import build

    return build(kv_cache_dtype="fp8", enable_prefix_caching=True)


@pytest.mark.slow
def test_engine_fp8_cache_quality_and_prefix_caching(offline, fp8_engine) -> None:
    """Against the session's default engine (float32 cache; its prompt-logprob prefill
    takes the same reference attention)."""
    ref, fp8 = offline, fp8_engine
    k_cache = fp8.engine.runner.kv_caches[0][0]
    assert k_cache.dtype == FP8_KV_DTYPE and fp8.engine.runner.num_blocks == 4 * ref.engine.runner.num_blocks
    ids = ref.encode(fixed_text())[:QUALITY_TOKENS]
    ppl_ref, ppl_fp8 = perplexity(ref, ids), perplexity(fp8, ids)
    assert ppl_fp8 != ppl_ref  # the cache really is quantized
    print(f"perplexity float32 cache {ppl_ref:.4f}, fp8 cache {ppl_fp8:.4f}")
    assert abs(ppl_fp8 / ppl_ref - 1) < 0.02, (ppl_ref, ppl_fp8)
    # Greedy decoding through the cache; a second run of the prompt hits the prefix cache
    # and decodes the same tokens.
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    first = fp8.generate([ids[:100]], greedy)[0].token_ids
    hits = fp8.engine.scheduler.block_manager.num_prefix_hits
    assert fp8.generate([ids[:100]], greedy)[0].token_ids == first
    assert fp8.engine.scheduler.block_manager.num_prefix_hits > hits

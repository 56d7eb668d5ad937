"""FP8 KV cache (``--kv-cache-dtype fp8``) on CPU: the write quantizes (clamped to
±448), the reference attention dequantizes in its gather (decode, prefill with context,
a sliding window), twice the blocks fit in a bfloat16 model's memory, the ``cpu``
backend refuses fp8 while ``auto`` falls back to the reference, prefix caching still
hits, and the default model's perplexity stays within 2% of the float32 cache's. The K
bias: the write subtracts it, the calibration at load sets it to the mean key, and a
model whose keys share a large offset keeps its float32 logits only with it."""

from __future__ import annotations

import pytest
import torch

from bench.fp8_kv_quality import fixed_text, perplexity
from kernels.kv_cache_write import FP8_E4M3_MAX, FP8_KV_DTYPE, kv_cache_write_ref, quantize_fp8
from kernels.paged_attention import paged_attention_ref
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, SettingsError
from worker.engine.engine import num_kv_blocks
from worker.engine.model_runner import ModelRunner
from worker.models.attention import AttentionMetadata, KVQuant, TorchAttentionBackend, select_backend
from worker.models.config import ModelConfig
from worker.models.loader import build_model

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


def test_write_subtracts_k_bias_and_bounds_the_error() -> None:
    """Keys with a large common offset (40, as a few channels of real keys): with the
    offset as ``k_bias`` the rounding error is e4m3's relative bound on ``k - bias``, far
    below what the same keys lose without it."""
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(KV_HEADS, HEAD_DIM, generator=g) + 40.0
    key = bias + torch.randn(6, KV_HEADS, HEAD_DIM, generator=g)
    slots = torch.arange(6)
    caches = [torch.zeros(2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=FP8_KV_DTYPE) for _ in range(4)]
    kv_cache_write_ref(key, key, caches[0], caches[1], slots, k_bias=bias)
    kv_cache_write_ref(key, key, caches[2], caches[3], slots)
    k_biased = caches[0].view(-1, KV_HEADS, HEAD_DIM)[:6].float()
    assert torch.equal(k_biased, quantize_fp8(key - bias, 1.0).float())
    assert torch.equal(caches[1], caches[3])  # V takes no bias
    err_biased = (k_biased - (key - bias)).abs().max().item()
    err_plain = (caches[2].view(-1, KV_HEADS, HEAD_DIM)[:6].float() - key).abs().max().item()
    assert err_biased <= 2**-4 * (key - bias).abs().max().item() < 0.5 < err_plain, (err_biased, err_plain)
    with pytest.raises(ValueError, match="k_bias must be"):
        kv_cache_write_ref(key, key, caches[0], caches[1], slots, k_bias=bias.double())
    with pytest.raises(ValueError, match="fp8 cache only"):
        kv_cache_write_ref(key, key, key.new_zeros(2, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
                           key.new_zeros(2, BLOCK_SIZE, KV_HEADS, HEAD_DIM), slots, k_bias=bias)


# A tiny random Llama whose keys share a large offset: K's projection bias is 40 on the
# lowest-frequency rotary pair of every head (rope_theta 1e6: those channels turn by less
# than 1e-3 rad over the test's positions, so the offset survives the rotation), and the
# queries weigh those channels (bias 3), so their rounding shows in the logits.
TINY = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256, "attention_bias": True,
        "rope_theta": 1e6, "max_position_embeddings": 128}
K_OFFSET, Q_OFFSET = 40.0, 3.0


def _tiny_runner(kv_cache_dtype: str) -> ModelRunner:
    cfg = ModelConfig.from_hf(TINY)
    model = build_model(cfg, None, True, torch.float32, torch.device("cpu"), 128, seed=3)
    with torch.no_grad():
        for layer in model.layers:
            a = layer.self_attn
            k_bias = a.qkv_proj.bias[a.q_size:a.q_size + a.kv_size].view(a.num_kv_heads, a.head_dim)
            k_bias[:, [a.head_dim // 2 - 1, a.head_dim - 1]] += K_OFFSET
            q_bias = a.qkv_proj.bias[:a.q_size].view(a.num_heads, a.head_dim)
            q_bias[:, [a.head_dim // 2 - 1, a.head_dim - 1]] += Q_OFFSET  # queries that read those channels
    settings = EngineSettings(kv_cache_dtype=kv_cache_dtype, attention_backend="torch", block_size=16,
                              num_kv_blocks=8)
    return ModelRunner(model, settings, 8, 128, torch.float32, torch.device("cpu"))


def _prefill_then_decode(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits ``[2, vocab]`` of the prefill's last token and of one decode step after it,
    one sequence in blocks 0.. of the runner's cache."""
    rows = []
    for start, end in ((0, len(ids) - 1), (len(ids) - 1, len(ids))):
        n = end - start
        meta = AttentionMetadata(slot_mapping=torch.arange(start, end), block_tables=torch.arange(8).int()[None],
                                 query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                                 seq_lens=torch.tensor([end], dtype=torch.int32), max_query_len=n, max_seq_len=end,
                                 query_lens_cpu=[n], seq_lens_cpu=[end])
        hidden = runner.model(torch.tensor(ids[start:end]), torch.arange(start, end), runner.kv_caches, meta,
                              runner.backend)
        rows.append(runner.model.compute_logits(hidden[-1:])[0])
    return torch.stack(rows)


@pytest.fixture(scope="module")
def tiny_runners() -> tuple[ModelRunner, ModelRunner]:
    return _tiny_runner("auto"), _tiny_runner("fp8")


def test_calibration_sets_the_mean_key_and_keeps_the_logits(tiny_runners) -> None:
    ref, fp8 = tiny_runners
    assert all(layer.self_attn.kv_quant is None for layer in ref.model.layers)  # float32 cache: untouched
    quants = [layer.self_attn.kv_quant for layer in fp8.model.layers]
    for q in quants:
        assert q is not None and q.k_bias.dtype == torch.float32 and q.k_bias.shape == (KV_HEADS, HEAD_DIM)
        lowest = q.k_bias[:, [HEAD_DIM // 2 - 1, HEAD_DIM - 1]]
        assert (lowest - K_OFFSET).abs().max() < 5 and q.k_bias[:, 0].abs().max() < 5, q.k_bias
        assert q.k_scale == q.v_scale == 1.0  # far inside e4m3's range: no scale needed
    ids = [(7 * i + 3) % 256 for i in range(40)]
    want = _prefill_then_decode(ref, ids)
    got = _prefill_then_decode(fp8, ids)
    err = (got - want).abs().max().item() / want.abs().max().item()
    biases = [q.k_bias.clone() for q in quants if q is not None]
    for q in quants:  # sabotage: no offset, the same scales
        assert q is not None
        q.k_bias.zero_()
    err_no_bias = (_prefill_then_decode(fp8, ids) - want).abs().max().item() / want.abs().max().item()
    for q, b in zip(quants, biases):
        assert q is not None
        q.k_bias.copy_(b)
    print(f"logits vs float32 cache: {err:.4f} with the K bias, {err_no_bias:.4f} without")
    assert err < 0.02 < err_no_bias, (err, err_no_bias)


def test_calibration_scales_grow_only_near_e4m3s_range(tiny_runners) -> None:
    from worker.engine.kv_calibration import KV_SCALE_HEADROOM, calibrate_kv_cache, strided_ids

    _, fp8 = tiny_runners
    a = fp8.model.layers[0].self_attn
    assert isinstance(a.kv_quant, KVQuant)
    before = a.kv_quant.k_bias
    with torch.no_grad():
        v = a.qkv_proj.bias[a.q_size + a.kv_size:]
        saved = v.clone()
        v.add_(100.0)  # |V| past 448 / KV_SCALE_HEADROOM
        try:
            quants = calibrate_kv_cache(fp8.model, fp8.kv_caches, strided_ids(256, 64), torch.device("cpu"))
        finally:
            v.copy_(saved)
    assert quants[0].k_bias is before  # recalibrated in place: the graphs' address holds
    v_amax = 100.0 + saved.abs().max().item()  # V of every token is about the bias: |V| <= 100 + 1
    assert 100.0 * KV_SCALE_HEADROOM / 448 < quants[0].v_scale < (v_amax + 1) * KV_SCALE_HEADROOM / 448
    assert quants[0].k_scale == quants[1].v_scale == 1.0
    # Restore the module fixture's calibration (the runner's: max_model_len 128 strided ids).
    calibrate_kv_cache(fp8.model, fp8.kv_caches, strided_ids(256, 128), torch.device("cpu"))
    assert quants[0].v_scale == 1.0


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

"""The prefill launch reading each chunk's own keys from this step's ``key``/``value``
rows (``paged_attention(..., key=, value=)``) against the reference over the cache.

The cache slots of every prefill chunk's new tokens are NaN-poisoned: a launch that reads
them from the cache instead of from ``key``/``value`` fails. Decode tokens (a mixed
batch's second launch) read the cache, as the engine writes it first. Runs on CUDA
(marked ``cuda``) or, with ``TRITON_INTERPRET=1`` and Triton installed, on CPU.
"""

from __future__ import annotations

import pytest
import torch

import kernels.paged_attention as pa
from tests.triton_target import DEV, INTERPRET, KERNEL_TEST_MARKS

pytestmark = KERNEL_TEST_MARKS

DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _batch(seqs: list[tuple[int, int]], num_kv_heads: int, qpk: int, head_dim: int, block_size: int,
           dtype: torch.dtype, num_pad_tokens: int = 0, seed: int = 0) -> dict:
    """A paged batch whose new tokens' K/V are both in ``key``/``value`` and in the cache
    (``cache``), and a copy of the cache with prefill chunks' new slots NaN (``poisoned``)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for _, s in seqs]
    pool = sum(blocks) + 3
    perm = torch.randperm(pool, generator=gen)
    tables = torch.zeros(len(seqs), max(blocks) + 1, dtype=torch.int32)
    o = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[o:o + n].int()
        o += n
    num_tokens = sum(q for q, _ in seqs) + num_pad_tokens
    k_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen)
    # key/value as views of one qkv-like buffer, as the model passes them.
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim + 8, generator=gen)
    key = kv[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    row = 0
    for i, (q_len, s_len) in enumerate(seqs):
        for j in range(q_len):
            pos = s_len - q_len + j
            slot = (int(tables[i, pos // block_size]), pos % block_size)
            k_cache[slot], v_cache[slot] = key[row + j], value[row + j]
            fill = float("nan") if q_len > 1 else None
            poisoned_k[slot] = key[row + j] if fill is None else fill
            poisoned_v[slot] = value[row + j] if fill is None else fill
        row += q_len
    qsl = torch.tensor([0] + torch.tensor([q for q, _ in seqs]).cumsum(0).tolist(), dtype=torch.int32)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).to(DEV)

    return {"q": dev(torch.randn(num_tokens, num_kv_heads * qpk, head_dim, generator=gen)),
            "cache": (dev(k_cache), dev(v_cache)), "poisoned": (dev(poisoned_k), dev(poisoned_v)),
            "kv": dev(kv), "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "tables": tables.to(DEV), "qsl": qsl.to(DEV),
            "seq_lens": torch.tensor([s for _, s in seqs], dtype=torch.int32, device=DEV),
            "num_real": sum(q for q, _ in seqs), "max_q": max(q for q, _ in seqs), "max_s": max(s for _, s in seqs)}


def _key_value(b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    n, h, d = b["kv"].shape[0], b["num_kv_heads"], b["head_dim"]
    return b["kv"][:, :h * d].view(n, h, d), b["kv"][:, h * d:2 * h * d].view(n, h, d)


SEQS = {
    "fresh": [(300, 300), (77, 77)],
    "chunks": [(70, 200), (130, 130), (33, 97)],  # contexts of 130 and 64 keys: partial and whole tiles
    "mixed": [(40, 40), (17, 50), (1, 30), (33, 33), (1, 5)],
    "one": [(257, 257)],
}
#: Prefill launch configs forced over ``_attention_config``'s choice (``None``: its own).
VARIANTS = {
    "default": None,
    "one_head": {"PACK_HEADS": False, "BLOCK_M": 32, "BLOCK_Q": 32, "TILE": 32},
    "tma": {"NEW_KV_TMA": True},
    "one_head_tma": {"PACK_HEADS": False, "BLOCK_M": 64, "BLOCK_Q": 64, "TILE": 64, "NEW_KV_TMA": True},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(SEQS))
def test_chunks_read_their_keys_from_key_value(case: str, variant: str, dtype: torch.dtype,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    force = VARIANTS[variant]
    if force is not None:
        base = pa._attention_config
        monkeypatch.setattr(pa, "_attention_config",
                            lambda *a, **kw: dict(base(*a, **kw), **force) if a[4] > 1 else base(*a, **kw))
    b = _batch(SEQS[case], 2, 3, 32, 16, dtype, num_pad_tokens=5, seed=len(case))
    key, value = _key_value(b)
    scale = 32 ** -0.5
    meta = (b["tables"], b["qsl"], b["seq_lens"])
    out = torch.full_like(b["q"], float("nan"))
    if INTERPRET:  # paged_attention itself takes the reference for CPU tensors
        pa._paged_attention_triton(b["q"], *b["poisoned"], *meta, scale, out, b["max_q"], b["max_s"],
                                   new_kv=pa._new_kv(b["q"], b["poisoned"][0], key, value))
    else:
        pa.paged_attention(b["q"], *b["poisoned"], *meta, scale, out, max_query_len=b["max_q"],
                           max_seq_len=b["max_s"], key=key, value=value)
    ref = pa.paged_attention_ref(b["q"].float(), b["cache"][0].float(), b["cache"][1].float(), *meta, scale)
    n = b["num_real"]
    assert not out[:n].isnan().any()
    assert ((out[:n].float() - ref[:n]).norm() / ref[:n].norm()).item() < TOL[dtype]
    assert out[n:].isnan().all(), "padding rows are left unwritten"


def _attend(b: dict, cache: tuple[torch.Tensor, torch.Tensor], key: torch.Tensor | None,
            value: torch.Tensor | None) -> torch.Tensor:
    out = torch.full_like(b["q"], float("nan"))
    meta = (b["tables"], b["qsl"], b["seq_lens"])
    if INTERPRET:  # paged_attention itself takes the reference for CPU tensors
        pa._paged_attention_triton(b["q"], *cache, *meta, 0.2, out, b["max_q"], b["max_s"],
                                   new_kv=pa._new_kv(b["q"], cache[0], key, value))
    else:
        pa.paged_attention(b["q"], *cache, *meta, 0.2, out, max_query_len=b["max_q"], max_seq_len=b["max_s"],
                           key=key, value=value)
    return out


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("case", ["chunks", "mixed"])
def test_same_tiles_and_order_as_the_cache_path(case: str, tma: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a chunk's keys from key/value keeps the cache path's key tiles (one across
    the context's end reads both sources) and their order: the same sums, so the same
    result (bit for bit in the interpreter; within float32 rounding compiled)."""
    base = pa._attention_config
    monkeypatch.setattr(pa, "_attention_config", lambda *a, **kw: dict(base(*a, **kw), NEW_KV_TMA=tma))
    b = _batch(SEQS[case], 2, 3, 32, 16, torch.float32, seed=7)
    key, value = _key_value(b)
    via_cache = _attend(b, b["cache"], None, None)
    via_rows = _attend(b, b["poisoned"], key, value)
    n = b["num_real"]
    assert not via_rows[:n].isnan().any()
    if INTERPRET:
        assert torch.equal(via_rows[:n], via_cache[:n])
    else:  # compiled, the two loads may contract multiply-adds differently (H200: not bit-equal)
        torch.testing.assert_close(via_rows[:n], via_cache[:n], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(INTERPRET, reason="paged_attention_fp8_out takes the reference for CPU tensors")
def test_the_fp8_output_path_reads_key_value_too() -> None:
    b = _batch(SEQS["chunks"], 2, 4, 128, 16, torch.float32 if INTERPRET else torch.bfloat16)
    key, value = _key_value(b)
    meta = (b["tables"], b["qsl"], b["seq_lens"])
    hints = {"max_query_len": b["max_q"], "max_seq_len": b["max_s"]}
    got, got_scale = pa.paged_attention_fp8_out(b["q"], *b["poisoned"], *meta, 0.1, **hints, key=key, value=value)
    n, heads = b["num_real"], b["q"].shape[1]
    ref = pa.paged_attention_ref(b["q"].float(), b["cache"][0].float(), b["cache"][1].float(), *meta, 0.1)[:n]
    # Each head row is one E4M3 group: dequantize it with its scale.
    deq = got[:n].float().view(n, heads, 128) * got_scale[:n, :, None]
    assert not deq.isnan().any()
    assert ((deq - ref).norm() / ref.norm()).item() < 0.05

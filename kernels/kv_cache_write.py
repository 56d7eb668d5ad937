"""Write new keys and values into the paged KV cache through the slot mapping
(vLLM's ``reshape_and_cache``).

FP8 cache (``float8_e4m3fn``, ``--kv-cache-dtype fp8``): each value is stored as
``clamp(x / scale, -448, 448)`` rounded to nearest even (448 is e4m3's largest finite
value), with one per-tensor scale for K and one for V; readers multiply by the same scale
(``kernels/paged_attention.py``). vLLM's ``reshape_and_cache_flash`` with ``fp8`` does the
same.

K bias (fp8 only): an optional ``[num_kv_heads, head_dim]`` float32 vector per layer is
subtracted from every key before it is quantized, ``clamp((k - k_bias) / k_scale)``; the
engine sets it to the layer's mean key (``worker/engine/kv_calibration.py``). Readers do
not add it back: softmax attention is unchanged when every key of a query moves by the
same vector (``q . (k - c) = q . k - q . c``, one shift for every logit of the query), so
only the rounding error changes, and e4m3's 3 mantissa bits no longer spend themselves on
the large part that all keys share. See docs/operations.md, "FP8 KV cache".
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value: stored values are clamped to it


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``clamp(x / scale, ±448)`` as ``float8_e4m3fn`` (any float ``x``, same shape)."""
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def check_kv_write_args(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        k_bias: torch.Tensor | None = None) -> None:
    """Validate shapes and dtypes of a KV-cache write (``k_bias``: see ``kv_cache_write_ref``).

    Raises:
        ValueError: on any mismatch.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)} / {tuple(value.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}")
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != key {tuple(key.shape[1:])}")
    if k_cache.dtype != v_cache.dtype or value.dtype != key.dtype or (
            key.dtype != k_cache.dtype and k_cache.dtype != FP8_KV_DTYPE):
        raise ValueError(f"dtype mismatch: key {key.dtype}, cache {k_cache.dtype} (an fp8 cache takes any float)")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if k_bias is not None:
        if k_cache.dtype != FP8_KV_DTYPE:
            raise ValueError(f"k_bias is for an fp8 cache only, got a {k_cache.dtype} cache")
        if k_bias.shape != key.shape[1:] or k_bias.dtype != torch.float32 or not k_bias.is_contiguous() \
                or k_bias.device != key.device:
            raise ValueError(f"k_bias must be contiguous float32 [num_kv_heads, head_dim] = {tuple(key.shape[1:])} "
                             f"on {key.device}, got {k_bias.dtype} {tuple(k_bias.shape)} on {k_bias.device}")


def kv_cache_write_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor, has_padding: bool = True,
                       k_scale: float = 1.0, v_scale: float = 1.0, k_bias: torch.Tensor | None = None) -> None:
    """PyTorch reference: ``cache.view(-1, H, D)[slot] = key`` for every slot >= 0.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype (any float
            dtype for an fp8 cache).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in
            place; the model's dtype or ``float8_e4m3fn`` (quantized, see the module docstring).
        slot_mapping: ``[num_tokens]`` int32/int64; slot ``-1`` marks a padding token
            (CUDA-graph padding) that is not written.
        has_padding: ``False`` when the caller knows every slot is >= 0 (skips a check
            that costs a reduction per layer on CPU).
        k_scale, v_scale: the fp8 cache's per-tensor scales (ignored for other dtypes).
        k_bias: ``None`` or ``[num_kv_heads, head_dim]`` float32 on key's device, fp8 cache
            only: subtracted from every key before it is quantized (module docstring).

    Raises:
        ValueError: shapes or dtypes do not match (``check_kv_write_args``).
    """
    check_kv_write_args(key, value, k_cache, v_cache, slot_mapping, k_bias)
    if k_cache.dtype == FP8_KV_DTYPE:  # CPU has no fp8 index_copy_: copy the bytes
        if k_bias is not None:
            key = key.float() - k_bias
        key, value = quantize_fp8(key, k_scale).view(torch.uint8), quantize_fp8(value, v_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    if has_padding:
        valid = slots >= 0
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


# --------------------------------------------------------------------------------------
# Triton implementation (CUDA): one program per token copies all its KV heads.
# --------------------------------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the wrapper falls back to the reference.
    triton = None

if triton is not None:

    @triton.jit
    def _kv_cache_write_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        k_scale, v_scale, k_bias_ptr,
        FP8: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ):
        tok = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
        if slot < 0:  # padding token (CUDA-graph bucket): leave the cache alone
            return
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        idx = tl.arange(0, BLOCK)
        h = idx // HEAD_DIM
        d = idx % HEAD_DIM
        mask = idx < NUM_KV_HEADS * HEAD_DIM
        t64 = tok.to(tl.int64)
        k = tl.load(key_ptr + t64 * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + t64 * stride_vt + h * stride_vh + d, mask=mask)
        if FP8:  # quantize: x / scale clamped to e4m3's range, round to nearest even
            k = k.to(tl.float32)
            if HAS_BIAS:  # contiguous [NUM_KV_HEADS, HEAD_DIM]: element h * HEAD_DIM + d is idx
                k = k - tl.load(k_bias_ptr + idx, mask=mask, other=0.0)
            k = tl.minimum(tl.maximum(k / k_scale, -448.0), 448.0).to(k_cache_ptr.dtype.element_ty)
            v = tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -448.0), 448.0).to(v_cache_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d, k, mask=mask)
        tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d, v, mask=mask)


def kv_cache_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0, k_bias: torch.Tensor | None = None) -> None:
    """Write ``key``/``value`` into the caches at ``slot_mapping`` (slot -1 skipped),
    quantized to fp8 with ``k_scale``/``v_scale`` (keys less ``k_bias`` when given) when
    the caches are ``float8_e4m3fn``.

    Triton on CUDA (one launch, no host sync, CUDA-graph safe); the reference elsewhere.
    Same arguments as ``kv_cache_write_ref``; key and value may be strided views (e.g.
    slices of a fused QKV output) as long as head_dim is contiguous.

    Raises:
        ValueError: shapes, dtypes or strides do not match.
    """
    check_kv_write_args(key, value, k_cache, v_cache, slot_mapping, k_bias)
    if triton is None or not key.is_cuda:
        kv_cache_write_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale,
                           k_bias=k_bias)
        return
    _kv_cache_write_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_bias)


def _kv_cache_write_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           k_scale: float, v_scale: float, k_bias: torch.Tensor | None) -> None:
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, strides {t.stride()}")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(num_kv_heads * head_dim)
    _kv_cache_write_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        float(k_scale), float(v_scale), key if k_bias is None else k_bias,  # key: a pointer never read
        FP8=k_cache.dtype == FP8_KV_DTYPE, HAS_BIAS=k_bias is not None,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK=block, BLOCK_SIZE=k_cache.shape[1],
        num_warps=4 if block <= 1024 else 8,
    )

"""Fused Triton ops against their PyTorch references (``cuda`` tests) and the
references against the unfused model code (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.fused_add_rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref
from kernels.rotary import rotary, rotary_ref
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def test_references_match_plain_ops() -> None:
    x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.rand(64)
    out, s = fused_add_rms_norm_ref(x, r, w, 1e-6)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(out, F.rms_norm(x + r, (64,), w, 1e-6))
    g = torch.randn(3, 16)
    torch.testing.assert_close(silu_and_mul_ref(g), F.silu(g[:, :8]) * g[:, 8:])
    with pytest.raises(ValueError):
        silu_and_mul_ref(torch.randn(3, 7))
    with pytest.raises(ValueError):
        fused_add_rms_norm_ref(x, r[:, :32], w, 1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 3584), (130, 4096), (3, 100)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_add_rms_norm(dtype: torch.dtype, shape: tuple[int, int], with_residual: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    r = torch.randn(shape, device="cuda", dtype=dtype) if with_residual else None
    w = torch.rand(shape[1], device="cuda", dtype=dtype) + 0.5
    out, s = fused_add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_s = fused_add_rms_norm_ref(x, r, w, 1e-6)
    torch.testing.assert_close(s, ref_s, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out, ref_out, atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (9, 2 * 18944), (64, 2 * 100)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(28, 4, 128), (9, 3, 64), (32, 8, 64)])
def test_rotary_on_fused_qkv_views(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    h, kvh, d = heads
    t, max_pos = 37, 4096
    qkv = torch.randn(t, (h + 2 * kvh) * d, device="cuda", dtype=dtype)
    q, k, _ = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k = q.view(t, h, d), k.view(t, kvh, d)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), 1e-4 ** (torch.arange(0, d, 2) / d))
    emb = torch.cat([freqs, freqs], dim=-1).cuda()
    cos, sin = emb.cos(), emb.sin()
    pos = torch.randint(0, max_pos, (t,), device="cuda")
    ref_q, ref_k = rotary_ref(pos, q.clone(), k.clone(), cos, sin)
    qkv_before = qkv.clone()
    out_q, out_k = rotary(pos, q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(out_q, ref_q, atol=TOL[dtype] * 2, rtol=TOL[dtype])
    torch.testing.assert_close(out_k, ref_k, atol=TOL[dtype] * 2, rtol=TOL[dtype])
    torch.testing.assert_close(qkv[:, (h + kvh) * d:], qkv_before[:, (h + kvh) * d:], atol=0, rtol=0)

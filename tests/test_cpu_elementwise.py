"""The CPU C++ kernels for SiLU-and-mul, residual add + RMSNorm and rotary (the public
wrappers in kernels/, which take them on CPU) against their PyTorch references."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels import cpu_extension
from kernels.fused_add_rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref
from kernels.rotary import rotary, rotary_ref
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler on this machine")

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@pytest.fixture(autouse=True)
def _built() -> None:
    assert cpu_extension.available(), "the CPU kernels must build where g++ exists"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (37, 100), (2048, 1536), (0, 8)])
def test_silu_and_mul(rows, inter, dtype) -> None:
    x = (torch.randn(rows, 2 * inter) * 4).to(dtype)  # gates far into both tails
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOL[dtype])


def test_silu_and_mul_saturates_without_overflow() -> None:
    x = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    out = silu_and_mul(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (300, 576), (5, 100)])
def test_fused_add_rms_norm(rows, hidden, with_residual, dtype) -> None:
    x = torch.randn(rows, hidden).to(dtype)
    residual = torch.randn(rows, hidden).to(dtype) if with_residual else None
    weight = torch.rand(hidden).to(dtype) + 0.5
    out, res = fused_add_rms_norm(x, residual, weight, 1e-5)
    want_out, want_res = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(res, want_res, **TOL[dtype])
    torch.testing.assert_close(out, want_out, **TOL[dtype])
    if not with_residual:
        assert res is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_slices_of_a_fused_qkv(dtype) -> None:
    """q and k as the model passes them: strided views of one QKV output, rotated in place."""
    tokens, heads, kv_heads, dim = 13, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    freqs = torch.outer(torch.arange(100.0), 1.0 / (10000 ** (torch.arange(0, dim, 2) / dim)))
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    positions = torch.randint(0, 100, (tokens,))
    want_q, want_k = rotary_ref(positions, q.clone(), k.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    got_q, got_k = rotary(positions, q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # V untouched


def test_kernels_reject_bad_arguments() -> None:
    ext = cpu_extension.load()
    x = torch.randn(4, 10)
    with pytest.raises(RuntimeError, match="dtype"):
        ext.silu_and_mul(torch.empty(4, 5, dtype=torch.float64), x)
    with pytest.raises(RuntimeError, match="weight"):
        ext.fused_add_rms_norm(torch.empty_like(x), torch.empty_like(x), x, None, torch.ones(3), 1e-5)
    with pytest.raises(RuntimeError, match="int64"):
        ext.rotary(torch.zeros(4, dtype=torch.int32), torch.randn(4, 2, 8), torch.randn(4, 1, 8),
                   torch.randn(10, 8), torch.randn(10, 8))

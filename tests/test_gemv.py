"""``kernels/gemv.py``: the weight-streaming product of few rows by a 16-bit weight, on
CUDA (marked ``cuda``) or, with ``TRITON_INTERPRET=1``, through Triton's interpreter on
CPU (float32 there); and ``worker.models.linear.linear`` taking it for decode-sized
products on CUDA. Argument checks and ``takes``: ``tests/test_gemv_args.py`` (CPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from kernels import gemv
from kernels.fp8_gemv import LaunchConfig
from tests.triton_target import DEV, INTERPRET, KERNEL_TEST_MARKS

pytestmark = KERNEL_TEST_MARKS
DTYPE = torch.float32 if INTERPRET else torch.bfloat16


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("k", [300, 1100])
def test_gemv_matches_f_linear(rows: int, k: int) -> None:
    """200 output channels (a partial 64-channel tile); K of 300 (one slice) and 1,100
    (split in two, the last slice partial, K not a multiple of 128); with and without
    bias; the weight read by loads and by TMA; twice (the split-K tile counters are back
    at zero after each launch)."""
    torch.manual_seed(rows * k)
    n = 200
    w = (torch.randn(n, k) * 0.05).to(DEV, DTYPE)
    x = torch.randn(rows, k).to(DEV, DTYPE)
    tol = {} if DTYPE == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for with_bias, tma in itertools.product((False, True), (False, True)):
        b = torch.randn(n).to(DEV, DTYPE) if with_bias else None
        ref = (x.float() @ w.float().T + (b.float() if b is not None else 0)).to(DTYPE)
        config = LaunchConfig(block_n=64, num_warps=4, num_stages=3, programs_per_sm=2, tma=tma)
        for _ in range(2):
            out = gemv.gemv(x, w, b, config)
            assert out.shape == (rows, n) and out.dtype == DTYPE
            torch.testing.assert_close(out, ref, **tol)


@pytest.mark.skipif(INTERPRET, reason="cuBLAS beside the kernel: CUDA only")
def test_linear_takes_gemv_up_to_max_rows_on_cuda() -> None:
    """``linear`` on CUDA: up to ``MAX_ROWS`` rows of a bfloat16 weight it returns
    ``gemv``'s bits, above that ``F.linear``'s (cuBLAS); and ``GEMV_ON = False`` turns
    the GEMV off."""
    from worker.models import linear as lin

    torch.manual_seed(0)
    w = torch.randn(3584, 1024, device="cuda", dtype=torch.bfloat16) * 0.03
    b = torch.randn(3584, device="cuda", dtype=torch.bfloat16)
    for rows in (1, gemv.MAX_ROWS):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(lin.linear(x, w, b), gemv.gemv(x, w, b))
        torch.testing.assert_close(lin.linear(x, w, b), F.linear(x, w, b), rtol=2e-2, atol=2e-2)
    x = torch.randn(gemv.MAX_ROWS + 1, 1024, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(lin.linear(x, w, b), F.linear(x, w, b))
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    lin.GEMV_ON = False
    try:
        assert torch.equal(lin.linear(x, w, b), F.linear(x, w, b))
    finally:
        lin.GEMV_ON = True

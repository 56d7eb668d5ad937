"""Where a Triton kernel test runs: on CUDA (marked ``cuda``, skipped without a GPU), or,
with ``TRITON_INTERPRET=1`` and Triton installed, on CPU tensors through Triton's
interpreter (slowly; it computes bfloat16 wrongly, so such tests keep to float32 there).
A test module sets ``pytestmark = KERNEL_TEST_MARKS`` and puts its tensors on ``DEV``."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.paged_attention import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
KERNEL_TEST_MARKS = (
    [pytest.mark.skipif(triton is None, reason="needs the triton package")] if INTERPRET
    else [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)

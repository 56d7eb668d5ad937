"""``kernels/gemv.py``'s argument checks and ``takes``, on CPU (no Triton needed): the
kernel itself is ``tests/test_gemv.py``."""

from __future__ import annotations

import pytest
import torch

from kernels import gemv


def test_gemv_refuses_bad_arguments_and_takes_only_cuda_products() -> None:
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    for x, weight, bias in ((torch.zeros(1, 16, dtype=torch.bfloat16), w, None),  # K differs
                            (torch.zeros(gemv.MAX_ROWS + 1, 32, dtype=torch.bfloat16), w, None),  # too many rows
                            (torch.zeros(0, 32, dtype=torch.bfloat16), w, None),  # no rows
                            (torch.zeros(1, 32, dtype=torch.float16), w, None),  # dtypes differ
                            (torch.zeros(1, 32, dtype=torch.bfloat16), w, torch.zeros(7, dtype=torch.bfloat16))):
        with pytest.raises(ValueError):
            gemv.gemv(x, weight, bias)
    assert not gemv.takes(torch.zeros(1, 32, dtype=torch.bfloat16), w)  # on CPU: F.linear

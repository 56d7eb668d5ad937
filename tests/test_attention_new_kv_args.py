"""``paged_attention``'s ``key``/``value`` arguments are checked on every device."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention


def _call(key: torch.Tensor | None, value: torch.Tensor | None) -> torch.Tensor:
    q = torch.randn(5, 4, 16)
    cache = torch.randn(2, 16, 2, 16)
    return paged_attention(q, cache, cache.clone(), torch.tensor([[0]], dtype=torch.int32),
                           torch.tensor([0, 5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32), 0.25,
                           max_query_len=5, max_seq_len=5, key=key, value=value)


@pytest.mark.parametrize("key, value, match", [
    (torch.randn(5, 2, 16), None, "come together"),
    (torch.randn(4, 2, 16), torch.randn(4, 2, 16), r"must be \(5, 2, 16\)"),
    (torch.randn(5, 2, 16).double(), torch.randn(5, 2, 16).double(), "must be"),
    (torch.randn(5, 16, 2).transpose(1, 2), torch.randn(5, 2, 16), "contiguous in head_dim"),
])
def test_bad_key_value_are_refused(key: torch.Tensor, value: torch.Tensor | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _call(key, value)


def test_good_key_value_are_taken() -> None:
    assert _call(torch.randn(5, 2, 16), torch.randn(5, 2, 16)).shape == (5, 4, 16)

"""Prepacked oneDNN linears on CPU (``worker/models/linear.py``) against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.models.config import ModelConfig
from worker.models.linear import (
    PACKED_MAX_ROWS,
    UNLIMITED_ROWS,
    Linear,
    choose_max_rows,
    onednn_linear_available,
)
from worker.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 7, 16, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1])
@pytest.mark.parametrize("max_rows", [PACKED_MAX_ROWS, UNLIMITED_ROWS])
def test_packed_linear_matches_f_linear(rows: int, dtype: torch.dtype, tol: float, max_rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(96, 160, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=gen))
        layer.bias.copy_(torch.randn(160, generator=gen))
    layer.prepack(max_rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    ref = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    torch.testing.assert_close(layer(x).double(), ref, rtol=tol, atol=tol * 10)
    # A strided input (a column slice, as the model's split outputs are) works too.
    wide = torch.randn(rows, 192, generator=gen).to(dtype)[:, ::2]
    torch.testing.assert_close(layer(wide).double(), F.linear(wide.double(), layer.weight.double(),
                                                              layer.bias.double()), rtol=tol, atol=tol * 10)


def test_packed_weight_is_used_up_to_its_row_limit(monkeypatch) -> None:
    layer = Linear(16, 8, bias=False)
    layer.prepack(4)
    calls = []
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(a[0].shape[0]) or torch.zeros(a[0].shape[0], 8))
    layer(torch.randn(4, 16))
    layer(torch.randn(5, 16))
    assert calls == [5]  # 4 rows went through oneDNN, 5 through F.linear


def test_choose_max_rows_picks_one_of_the_two_limits() -> None:
    assert choose_max_rows(torch.randn(64, 32), rows=300) in (PACKED_MAX_ROWS, UNLIMITED_ROWS)


def test_model_prepack_covers_every_linear_and_the_tied_head() -> None:
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=64, tie_word_embeddings=True, eos_token_ids=(0,))
    model = LlamaForCausalLM(cfg, 64)
    hidden = torch.randn(3, 32)
    before = model.compute_logits(hidden)
    assert model.prepack_for_cpu() == 2 * 4 + 1  # qkv, o, gate_up, down per layer + LM head
    assert model.packed_max_rows in (PACKED_MAX_ROWS, UNLIMITED_ROWS)
    assert all(m.packed is not None and m.packed.max_rows == model.packed_max_rows
               for m in model.modules() if isinstance(m, Linear))
    assert model.logits_packed.max_rows == model.packed_max_rows
    torch.testing.assert_close(model.compute_logits(hidden), before, rtol=1e-4, atol=1e-4)

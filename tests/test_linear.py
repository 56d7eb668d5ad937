"""Prepacked oneDNN linears on CPU (``worker/models/linear.py``) against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.models.config import ModelConfig
from worker.models.linear import PACKED_MAX_ROWS, Linear, onednn_linear_available
from worker.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 7, 16, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1])
def test_packed_linear_matches_f_linear(rows: int, dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(96, 160, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=gen))
        layer.bias.copy_(torch.randn(160, generator=gen))
    layer.prepack()
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    ref = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    torch.testing.assert_close(layer(x).double(), ref, rtol=tol, atol=tol * 10)
    # A strided input (a column slice, as the model's split outputs are) works too.
    wide = torch.randn(rows, 192, generator=gen).to(dtype)[:, ::2]
    torch.testing.assert_close(layer(wide).double(), F.linear(wide.double(), layer.weight.double(),
                                                              layer.bias.double()), rtol=tol, atol=tol * 10)


def test_model_prepack_covers_every_linear_and_the_tied_head() -> None:
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=64, tie_word_embeddings=True, eos_token_ids=(0,))
    model = LlamaForCausalLM(cfg, 64)
    hidden = torch.randn(3, 32)
    before = model.compute_logits(hidden)
    assert model.prepack_for_cpu() == 2 * 4 + 1  # qkv, o, gate_up, down per layer + LM head
    assert all(m.packed is not None for m in model.modules() if isinstance(m, Linear))
    torch.testing.assert_close(model.compute_logits(hidden), before, rtol=1e-4, atol=1e-4)

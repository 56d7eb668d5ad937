"""Prepacked oneDNN linears on CPU (``worker/models/linear.py``) against ``F.linear``, the
per-dtype probe that picks the packed path only where it works on this CPU, and the row
limit that ``choose_max_rows`` picks from (injected) timings."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from worker.models import linear as linear_mod
from worker.models.config import ModelConfig
from worker.models.linear import (
    PACKED_MAX_ROWS,
    UNLIMITED_ROWS,
    Linear,
    choose_max_rows,
    onednn_linear_available,
    pack_weight,
    packable_layers,
    packed_linear,
    packed_linear_error,
    time_products_ms,
)
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import build_model

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="PyTorch built without oneDNN")
_BF16_ERROR = packed_linear_error(torch.bfloat16)
needs_packed_bf16 = pytest.mark.skipif(
    _BF16_ERROR is not None, reason=f"this CPU cannot run oneDNN's packed bfloat16 linear: {_BF16_ERROR}")
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                   tie_word_embeddings=True)
NUM_TINY_WEIGHTS = 2 * 4 + 1  # qkv, o, gate_up, down per layer + the tied LM head


@pytest.fixture()
def fresh_probe():
    """Forget the probe's cached answers before and after the test (it patches what they
    depend on)."""
    packed_linear_error.cache_clear()
    yield
    packed_linear_error.cache_clear()


@needs_onednn
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4),
                                       pytest.param(torch.bfloat16, 2e-2, marks=needs_packed_bf16)])
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


@needs_onednn
def test_packed_weight_is_used_up_to_its_row_limit(monkeypatch) -> None:
    layer = Linear(16, 8, bias=False)
    layer.prepack(4)
    calls = []
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(a[0].shape[0]) or torch.zeros(a[0].shape[0], 8))
    layer(torch.randn(4, 16))
    layer(torch.randn(5, 16))
    assert calls == [5]  # 4 rows went through oneDNN, 5 through F.linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_agrees_with_packing_on_this_cpu(dtype: torch.dtype) -> None:
    """The cached answer is what packing and multiplying in ``dtype`` actually does here."""
    error = packed_linear_error(dtype)
    try:
        packed_linear(torch.ones(3, 32, dtype=dtype), pack_weight(torch.ones(16, 32, dtype=dtype)).tensor)
    except RuntimeError as exc:
        assert error is not None and error == str(exc).strip().splitlines()[0][:300]
    else:
        assert error is None
    assert packed_linear_error(dtype) is error  # cached


def test_probe_refuses_other_dtypes() -> None:
    assert "float16" in packed_linear_error(torch.float16)


def test_failing_probe_leaves_every_layer_on_f_linear_with_one_log_line(monkeypatch, caplog, fresh_probe) -> None:
    """Where packing raises (as the bfloat16 reorder does on CPUs without AVX-512), the
    model loads unpacked and the loader says why in one line."""
    def reorder_fails(weight: torch.Tensor, max_rows: int = PACKED_MAX_ROWS):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw\n"
                           "Exception raised from reorder at aten/src/ATen/native/mkldnn/Linear.cpp:1")

    monkeypatch.setattr(linear_mod, "pack_weight", reorder_fails)
    caplog.set_level(logging.INFO, logger="worker.models.loader")
    model = build_model(TINY, None, True, torch.float32, torch.device("cpu"), 64)
    assert packable_layers(model) == []
    assert model.logits_packed is None and model.packed_max_rows is None
    assert all(m.packed is None for m in model.modules() if isinstance(m, Linear))
    hidden = torch.randn(3, 32)
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.embed_tokens.weight))
    records = [r.getMessage() for r in caplog.records if r.name == "worker.models.loader"]
    assert records == [("CPU linears in torch.float32: F.linear, since the prepacked oneDNN path does not work "
                        "here: mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")]


def test_bf16_model_takes_the_path_the_probe_allows(caplog) -> None:
    """On a CPU without AVX-512 the bfloat16 model loads on F.linear; with it, packed."""
    caplog.set_level(logging.INFO, logger="worker.models.loader")
    model = build_model(TINY, None, True, torch.bfloat16, torch.device("cpu"), 64)
    num_packed = sum(m.packed is not None for m in model.modules() if isinstance(m, Linear))
    assert num_packed == (0 if _BF16_ERROR else NUM_TINY_WEIGHTS - 1)
    hidden = torch.randn(3, 32).bfloat16()
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.embed_tokens.weight).float(),
                               rtol=2e-2, atol=2e-2)
    [line] = [r.getMessage() for r in caplog.records if r.name == "worker.models.loader"]
    assert "torch.bfloat16" in line and (_BF16_ERROR or "prepacked for oneDNN") in line


@pytest.mark.parametrize("mkl_ms,onednn_ms,expected", [(2.0, 1.0, UNLIMITED_ROWS), (1.0, 2.0, PACKED_MAX_ROWS),
                                                       (1.0, 1.0, PACKED_MAX_ROWS)])
def test_choose_max_rows_follows_the_faster_product(mkl_ms: float, onednn_ms: float, expected: int) -> None:
    weight = torch.randn(64, 32)
    seen = []

    def timer(w: torch.Tensor, rows: int) -> tuple[float, float]:
        seen.append((w, rows))
        return mkl_ms, onednn_ms

    assert choose_max_rows(weight, rows=300, timer=timer) == expected
    assert len(seen) == 1 and seen[0][0] is weight and seen[0][1] == 300


@needs_onednn
def test_time_products_ms_times_both_products() -> None:
    times = time_products_ms(torch.randn(64, 32), 300)
    assert len(times) == 2 and all(isinstance(t, float) and t > 0 for t in times)


@needs_onednn
@pytest.mark.parametrize("mkl_ms,onednn_ms,expected", [(2.0, 1.0, UNLIMITED_ROWS), (1.0, 2.0, PACKED_MAX_ROWS)])
def test_model_prepack_covers_every_linear_and_the_tied_head(monkeypatch, caplog, mkl_ms: float, onednn_ms: float,
                                                             expected: int) -> None:
    monkeypatch.setattr(linear_mod, "time_products_ms", lambda weight, rows: (mkl_ms, onednn_ms))
    model = LlamaForCausalLM(TINY, 64)
    hidden = torch.randn(3, 32)
    before = model.compute_logits(hidden)
    assert model.prepack_for_cpu() == NUM_TINY_WEIGHTS
    assert model.packed_max_rows == expected
    assert all(m.packed is not None and m.packed.max_rows == expected
               for m in model.modules() if isinstance(m, Linear))
    assert model.logits_packed.max_rows == expected
    torch.testing.assert_close(model.compute_logits(hidden), before, rtol=1e-4, atol=1e-4)
    # The loader's one line names the limit the timings chose.
    caplog.set_level(logging.INFO, logger="worker.models.loader")
    build_model(TINY, None, True, torch.float32, torch.device("cpu"), 64)
    [line] = [r.getMessage() for r in caplog.records if r.name == "worker.models.loader"]
    rows = "all" if expected == UNLIMITED_ROWS else f"up to {PACKED_MAX_ROWS}"
    assert line.startswith(f"CPU linears in torch.float32: {NUM_TINY_WEIGHTS} weights prepacked for oneDNN, "
                           f"used for steps of {rows} rows")


@pytest.mark.slow
def test_real_model_serves_in_bfloat16_on_this_cpu(smollm_source) -> None:
    """``--dtype bfloat16`` on CPU loads and generates, whichever linear path this CPU allows."""
    from shared.sampling import SamplingParams
    from worker.llm import LLM

    llm = LLM(dtype="bfloat16", num_kv_blocks=64, max_num_seqs=4)
    [out] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    model = llm.engine.runner.model
    assert (model.packed_max_rows is None) == (_BF16_ERROR is not None)

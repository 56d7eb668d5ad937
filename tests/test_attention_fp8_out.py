"""The paged attention with its output quantized for an FP8 ``o_proj``
(``kernels.paged_attention.paged_attention_fp8_out``): bit for bit the attention's output
in ``q``'s dtype then ``quantize_groups`` with one group per head row, for each of the
kernel's launch shapes (a prefill launch, the mixed batch's two launches, split-KV decode
through the reduce launch, a full decode batch without splits), with padded rows; and a
model whose ``o_proj`` is FP8 gives the same logits with the fused output as with the two
launches in turn.

CUDA only; with ``TRITON_INTERPRET=1`` and Triton installed the kernel cases run on CPU
tensors through Triton's interpreter in float32 (it computes bfloat16 wrongly).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels.paged_attention as attention_module
from kernels.fp8_quant import quantize_groups
from kernels.paged_attention import (
    _paged_attention_triton,
    group_outputs,
    paged_attention,
    paged_attention_fp8_out,
)
from tests.test_sliding_window import _paged_batch
from tests.triton_target import DEV, INTERPRET, KERNEL_TEST_MARKS

pytestmark = KERNEL_TEST_MARKS

CASES = {  # (query_len, seq_len) per sequence
    "prefill": [(70, 70), (9, 40)],
    "mixed": [(33, 90), (1, 500), (64, 64), (1, 3)],
    "decode_split": [(1, 300), (1, 7), (1, 129)],
    "decode_full": [(1, 20 + 7 * i) for i in range(140)],
}


def _kernel_args(b: dict, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """``_paged_batch``'s tensors on ``DEV`` in ``dtype`` as the attention takes them
    (q, the caches, block tables, query_start_loc, seq_lens), and its two length hints."""
    args = (b["q"].to(DEV, dtype), b["k_cache"].to(DEV, dtype), b["v_cache"].to(DEV, dtype),
            b["block_tables"].to(DEV), b["query_start_loc"].to(DEV), b["seq_lens"].to(DEV))
    return args, max(b["q_lens"]), max(b["s_lens"])


def _quantized(b: dict, dtype: torch.dtype, pad_rows_to: int) -> tuple[torch.Tensor, torch.Tensor]:
    args, max_query_len, max_seq_len = _kernel_args(b, dtype)
    q = args[0]
    scale = q.shape[-1] ** -0.5
    if not INTERPRET:
        return paged_attention_fp8_out(*args, scale, max_query_len=max_query_len, max_seq_len=max_seq_len,
                                       pad_rows_to=pad_rows_to)
    # The public wrapper sends CPU tensors to the reference: launch the kernels directly.
    t, h, d = q.shape
    out, out_scale = group_outputs(t, h * d, d, pad_rows_to, True, q.device)
    _paged_attention_triton(*args, scale, out[:t].view(t, h, d), max_query_len, max_seq_len,
                            out_scale=out_scale[:t])
    return out, out_scale


def _two_launches(b: dict, dtype: torch.dtype, pad_rows_to: int) -> tuple[torch.Tensor, torch.Tensor]:
    args, max_query_len, max_seq_len = _kernel_args(b, dtype)
    q = args[0]
    t, h, d = q.shape
    out = torch.empty_like(q)
    if INTERPRET:
        _paged_attention_triton(*args, d ** -0.5, out, max_query_len, max_seq_len)
        return _interpreted_quantize_groups(out.view(t, h * d), d, pad_rows_to)
    paged_attention(*args, d ** -0.5, out, max_query_len=max_query_len, max_seq_len=max_seq_len)
    return quantize_groups(out.view(t, h * d), d, pad_rows_to, True)


def _interpreted_quantize_groups(x: torch.Tensor, group: int, pad_rows_to: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_groups``' kernel launched on CPU tensors (the wrapper would send them to
    the reference): the interpreter's float-to-E4M3 conversion differs from PyTorch's
    (values that round up into the next binade come out halved), so the kernel under
    test is held to the same interpreter's group kernel."""
    from kernels.fp8_quant import FP8_MAX, MIN_AMAX, _quantize_groups_kernel, group_grid

    q, scale = group_outputs(x.shape[0], x.shape[1], group, pad_rows_to, True, x.device)
    grid, groups, _ = group_grid(q.shape[0], scale.shape[1])
    _quantize_groups_kernel[grid](x, q, scale, x.shape[0], scale.shape[1], x.stride(0), q.stride(0),
                                  scale.stride(0), scale.stride(1), GROUP=group, GROUPS=groups, QMAX=FP8_MAX,
                                  AMIN=MIN_AMAX)
    return q, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_kv_heads,qpk,head_dim", [(4, 7, 128), (2, 4, 64)])
def test_quantized_output_is_attention_then_quantize_groups(case: str, num_kv_heads: int, qpk: int,
                                                           head_dim: int, dtype: torch.dtype) -> None:
    if INTERPRET and dtype != torch.float32:
        pytest.skip("Triton's interpreter computes bfloat16 wrongly")
    if INTERPRET and case == "decode_full":
        pytest.skip("140 sequences: too slow for the interpreter")
    b = _paged_batch(CASES[case], num_kv_heads, qpk, head_dim, 16, None, seed=len(case))
    t = b["q"].shape[0]
    q8, scale = _quantized(b, dtype, 16)
    q8_ref, scale_ref = _two_launches(b, dtype, 16)
    rows = t + -t % 16
    assert q8.shape == (rows, num_kv_heads * qpk * head_dim) and q8.dtype == torch.float8_e4m3fn
    assert scale.shape == (rows, num_kv_heads * qpk) and scale.stride() == (1, rows)
    # Rows past the last token are padding, left unwritten by the attention.
    torch.testing.assert_close(scale[:t], scale_ref[:t], rtol=0, atol=0)
    assert torch.equal(q8[:t].float(), q8_ref[:t].float())
    assert scale[:t].min() > 0 and q8[:t].float().abs().amax(1).max() == 448.0


@pytest.mark.skipif(INTERPRET, reason="the model runs on CUDA")
def test_o_proj_takes_the_quantized_attention_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With FP8 block weights and head_dim 128, each layer's attention runs through
    ``paged_attention_fp8_out`` (its ``o_proj`` takes group-quantized input), bit for bit
    the attention and the quantizer as two launches (``check_fused_against_two_launches``)."""
    from tests.test_fp8_cuda import check_fused_against_two_launches

    def two_launches(q: torch.Tensor, *args: object, pad_rows_to: int = 1, **kwargs: object):
        o = paged_attention(q, *args, **kwargs)  # type: ignore[arg-type]
        t, h, d = q.shape
        return quantize_groups(o.reshape(t, h * d), d, pad_rows_to, True)

    check_fused_against_two_launches(tmp_path, 128, attention_module, "paged_attention_fp8_out", two_launches, 2,
                                     monkeypatch)

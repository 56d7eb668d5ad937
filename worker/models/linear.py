"""Linear layers whose weights can also be held prepacked for oneDNN on CPU.

On CPU, ``F.linear`` hands the weight to MKL's GEMM, which copies panels of it into its
blocked layout inside every call. A decode step multiplies a few rows (one per running
sequence) by every weight of the model, so that repacking doubles the memory traffic of a
step that is bound by memory traffic. ``Linear.prepack`` reorders its weight once into
oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the prepacking that
PyTorch's Inductor uses for CPU linears and vLLM's CPU backend does through its own
oneDNN binding); steps of up to ``PackedWeight.max_rows`` rows then multiply by the
packed copy.

Small steps (up to ``PACKED_MAX_ROWS`` rows) always gain. For prefill-sized steps the
winner depends on the CPU: on AMD EPYC oneDNN is 2-2.5x faster than MKL at 2048 rows (MKL
takes generic code paths on non-Intel CPUs), on the Xeon of an earlier machine MKL was
about 20% faster there. ``choose_max_rows`` therefore times one prefill-sized product both
ways when a model is packed (``LlamaForCausalLM.prepack_for_cpu``) and keeps MKL for big
steps only where MKL wins.
Measured with ``python -m bench.cpu_engine_bench`` (figures in ``docs/benchmarks.md``).

Not every CPU can run the packed path in every dtype: oneDNN's bfloat16 reorder needs
AVX-512 (bw, vl, dq) or AVX-NE-CONVERT, so on an AVX2-only CPU (many AMD EPYC hosts) it
raises. ``packed_linear_error`` probes each dtype once per process (pack a small weight,
run one product) and ``packable_layers`` keeps only the layers whose dtype passed; the
others stay on ``F.linear``.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kernels import gemv
from kernels.fused_add_rms_norm import fused_add_rms_norm_fp8
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_fp8
from worker.models.fp8 import (
    FP8_DTYPE,
    FP8_SCHEMES,
    block_input_padding,
    block_product,
    dequantize_weight,
    fp8_linear,
    quantize_weight,
    round_inputs,
    takes_group_quantized_input,
)

#: Whether CUDA products of few rows by 16-bit weights take ``kernels/gemv.py`` (False:
#: ``F.linear``, cuBLAS; for A/B runs, set before the CUDA graphs are captured).
GEMV_ON = True
#: Rows (tokens) up to which a packed weight is always used.
PACKED_MAX_ROWS = 256
#: No row limit: the packed weight is used for every step.
UNLIMITED_ROWS = sys.maxsize
#: Rows of the prefill-sized product that ``choose_max_rows`` times.
CALIBRATION_ROWS = 2048
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class PackedWeight:
    """A oneDNN-blocked copy of a weight and the most rows it is used for."""

    #: opaque ``mkldnn`` tensor from ``torch.ops.mkldnn._reorder_linear_weight``
    tensor: torch.Tensor
    #: steps with more rows (tokens) than this use ``F.linear``
    max_rows: int = PACKED_MAX_ROWS


def onednn_linear_available() -> bool:
    """Whether this PyTorch build has oneDNN and the prepacked-linear operators."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


@functools.cache
def packed_linear_error(dtype: torch.dtype) -> str | None:
    """Why the packed oneDNN path cannot run in ``dtype`` here (this PyTorch build and CPU),
    or ``None`` where it works. Probed once per dtype and process: packs an ``[8, 16]``
    weight and checks one product against ``F.linear``. Never raises."""
    if dtype not in _PACKED_DTYPES:
        return f"oneDNN prepacking is used for float32 and bfloat16 only, not {dtype}"
    if not onednn_linear_available():
        return "this PyTorch build lacks oneDNN's prepacked-linear operators"
    weight = torch.arange(8 * 16, dtype=torch.float32).remainder(7).sub(3).view(8, 16).to(dtype)
    x = torch.ones(2, 16, dtype=dtype)
    try:
        out = packed_linear(x, pack_weight(weight).tensor)
    except RuntimeError as exc:  # e.g. "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        lines = str(exc).strip().splitlines()
        return lines[0][:300] if lines else type(exc).__name__
    if not torch.equal(out, F.linear(x, weight)):  # small integers: exact in both dtypes
        return "the probe product differs from F.linear"
    return None


def pack_weight(weight: torch.Tensor, max_rows: int = PACKED_MAX_ROWS) -> PackedWeight:
    """oneDNN-blocked copy of ``weight [out, in]`` (float32 or bfloat16, CPU)."""
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), max_rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [rows, in] @ weight.T + bias`` through the oneDNN-blocked ``packed`` weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [rows, in]``: through ``packed`` (``pack_weight``
    of ``weight``) when there is one and ``rows <= packed.max_rows`` (CPU); on CUDA, up to
    ``gemv.MAX_ROWS`` rows of a 16-bit weight through the weight-streaming ``gemv``
    (``gemv.takes``; decode steps); else ``F.linear``."""
    if packed is not None and x.dim() == 2 and x.shape[0] <= packed.max_rows:
        return packed_linear(x, packed.tensor, bias)
    if GEMV_ON and gemv.takes(x, weight):
        return gemv.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def _median_ms(fn: Callable[[], object], repeat: int = 3) -> float:
    """Median wall time of ``fn()`` over ``repeat`` calls after one warm-up, ms."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def time_products_ms(weight: torch.Tensor, rows: int) -> tuple[float, float]:
    """``(F.linear ms, packed ms)``: median wall times of a ``rows``-row product with
    ``weight [out, in]`` through MKL and through its packed copy (3 runs after a warm-up
    each, on the calling thread)."""
    packed = pack_weight(weight).tensor
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    return _median_ms(lambda: F.linear(x, weight)), _median_ms(lambda: packed_linear(x, packed))


def choose_max_rows(weight: torch.Tensor, rows: int = CALIBRATION_ROWS,
                    timer: Callable[[torch.Tensor, int], tuple[float, float]] | None = None) -> int:
    """The row limit for packed weights on this CPU: ``UNLIMITED_ROWS`` when a ``rows``-row
    product with ``weight [out, in]`` is faster through the packed copy than through MKL,
    else ``PACKED_MAX_ROWS``. ``timer`` (default ``time_products_ms``) gives the two times.
    Costs 8 such products (about 0.2 s for SmolLM2's MLP weight on 2 cores)."""
    mkl_ms, onednn_ms = (timer or time_products_ms)(weight, rows)
    return UNLIMITED_ROWS if onednn_ms < mkl_ms else PACKED_MAX_ROWS


class RMSNormLike(Protocol):
    """What ``Linear.forward_add_rms_norm`` needs of a norm (``worker.models.llama.RMSNorm``):
    its weight ``[in_features]``, eps, offset (0: Llama's ``x * weight``), and its call."""

    weight: torch.Tensor
    eps: float
    offset: float

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...


class Linear(nn.Linear):
    """``nn.Linear`` that uses a prepacked oneDNN weight on CPU once ``prepack`` has been
    called (after the weights are loaded; call again if they change), and that can hold
    its weight in FP8 (``to_fp8``; ``worker/models/fp8.py``)."""

    packed: PackedWeight | None = None
    #: ``dequantize_fp8`` ran: the weight is on the E4M3 grid in the model dtype, and
    #: inputs are rounded through E4M3 (the CPU reference of the FP8 path).
    fp8_reference: bool = False
    #: The reference's weight had 128x128 block scales: inputs are rounded per 1x128
    #: group, else per token (``fp8.round_inputs``).
    fp8_block_scales: bool = False

    def prepack(self, max_rows: int = PACKED_MAX_ROWS) -> None:
        self.packed = pack_weight(self.weight, max_rows)

    @property
    def is_fp8(self) -> bool:
        """Whether the weight is stored in FP8 (with a float32 ``weight_scale``)."""
        return self.weight.dtype == FP8_DTYPE

    def to_fp8(self, scheme: str = FP8_SCHEMES[0]) -> None:
        """Quantize the weight to E4M3 (``fp8.quantize_weight``): the ``weight`` parameter
        becomes ``[out, in]`` float8_e4m3fn and a ``weight_scale`` parameter float32 holds
        the scales, ``[ceil(out / 128), ceil(in / 128)]`` for ``block``, ``[out]`` for
        ``channel`` (parameters, so the checkpoint loader fills and checks them like any other).

        Raises:
            ValueError: an unknown ``scheme``.
        """
        q, scale = quantize_weight(self.weight.detach(), scheme)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.packed = None

    def dequantize_fp8(self, dtype: torch.dtype) -> None:
        """Turn an FP8 weight back into ``dtype`` (its values stay on the E4M3 grid times
        their scale) and round inputs through E4M3 from now on: the reference path."""
        assert self.is_fp8, "dequantize_fp8 needs to_fp8 first"
        weight = dequantize_weight(self.weight, self.weight_scale, dtype)
        self.fp8_block_scales = self.weight_scale.dim() == 2
        del self.weight_scale
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.fp8_reference = True

    def takes_quantized_input(self, rows: int) -> bool:
        """Whether a product of ``rows`` rows runs on 1x128-group-quantized input
        (``fp8.takes_group_quantized_input``): a caller that can quantize the input as it
        computes it then calls ``forward_quantized``, with rows padded to a multiple of
        ``fp8.block_input_padding(rows)``."""
        return self.is_fp8 and takes_group_quantized_input(rows, self.weight, self.weight_scale)

    def forward_quantized(self, q: torch.Tensor, scale: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """This product on input already quantized per 1x128 group (``q [R', in_features]``
        E4M3, ``scale [R', in_features / 128]`` float32 column-major, ``R' >= rows``; as
        ``fp8.block_product``): ``[rows, out_features]`` in ``dtype``. Only where
        ``takes_quantized_input(rows)``."""
        return block_product(q, scale, self.weight, self.weight_scale, rows, self.bias, dtype)

    def forward_silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(silu_and_mul(gate_up))`` (``gate_up [T, 2 * in_features]``); a product that
        ``fp8_linear`` would run on group-quantized input gets it from
        ``silu_and_mul_fp8``, which quantizes as it computes (no bfloat16 intermediate)."""
        rows = gate_up.shape[0]
        if self.takes_quantized_input(rows):
            q, scale = silu_and_mul_fp8(gate_up, pad_rows_to=block_input_padding(rows))
            return self.forward_quantized(q, scale, rows, gate_up.dtype)
        return self(silu_and_mul(gate_up))

    def forward_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                             norm: RMSNormLike) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(x + residual)), x + residual)`` for a pre-norm block's first
        product (``x``, ``residual``: ``[T, in_features]``; ``residual`` None at the
        first layer). A product that ``fp8_linear`` would run on group-quantized input
        gets it from ``fused_add_rms_norm_fp8``, which quantizes the norm's output as it
        computes it (no bfloat16 intermediate, no quantizer launch); otherwise the norm
        runs fused with the add (``norm(x, residual, fused=True)``) and then this product."""
        rows = x.shape[0]
        if norm.offset == 0.0 and x.dim() == 2 and self.takes_quantized_input(rows):
            q, scale, residual = fused_add_rms_norm_fp8(x, residual, norm.weight, norm.eps,
                                                        pad_rows_to=block_input_padding(rows))
            return self.forward_quantized(q, scale, rows, x.dtype), residual
        h, residual = norm(x, residual, fused=True)
        return self(h), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_fp8:
            return fp8_linear(x, self.weight, self.weight_scale, self.bias)
        if self.fp8_reference:
            x = round_inputs(x, self.fp8_block_scales)
        return linear(x, self.weight, self.bias, self.packed)


def packable_layers(model: nn.Module) -> list[Linear]:
    """The ``Linear`` layers of ``model`` on CPU in a dtype whose packed path works here
    (``packed_linear_error`` is ``None``): float32 or bfloat16, none without oneDNN."""
    return [m for m in model.modules() if isinstance(m, Linear)
            and m.weight.device.type == "cpu" and packed_linear_error(m.weight.dtype) is None]

"""Linear layers whose weights can also be held prepacked for oneDNN on CPU.

On CPU, ``F.linear`` hands the weight to MKL's GEMM, which repacks it into its blocked
layout on every call. A decode step multiplies a few rows (one per running sequence) by
every weight of the model, so that repacking doubles the memory traffic of a step that
is bound by memory traffic. ``prepack_for_cpu`` reorders each weight once into oneDNN's
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the prepacking that
PyTorch's Inductor uses for CPU linears and vLLM's CPU backend does through its own
oneDNN binding); steps of up to ``PACKED_MAX_ROWS`` rows then multiply by the packed copy.
Bigger prefill steps keep MKL, which is as fast or faster there.

Measured on this 2-core Xeon (AVX-512, float32, weight 3072 x 576, 2 threads): 16 rows
2.0 -> 1.06 ms, 64 rows 3.2 -> 2.8 ms, 256 rows 7.2 -> 6.7 ms, 2048 rows 49 -> 59 ms
(``/tmp`` micro-benchmark recorded in ``docs/benchmarks.md``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: Most rows (tokens) for which the packed weight is used; bigger steps use MKL.
PACKED_MAX_ROWS = 256
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_linear_available() -> bool:
    """Whether this PyTorch build has oneDNN and the prepacked-linear operators."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN-blocked copy (an opaque ``mkldnn`` tensor) of ``weight [out, in]`` on CPU."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [rows, in]``, through ``packed`` (``pack_weight``
    of ``weight``) when there is one and ``rows <= PACKED_MAX_ROWS``."""
    if packed is not None and x.dim() == 2 and x.shape[0] <= PACKED_MAX_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` that uses a prepacked oneDNN weight for small CPU steps once
    ``prepack`` has been called (after the weights are loaded; call again if they change)."""

    packed: torch.Tensor | None = None

    def prepack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def prepack_for_cpu(model: nn.Module) -> int:
    """Prepack every ``Linear`` of a CPU model in float32 or bfloat16; returns how many
    were packed (0 on other devices and dtypes, or without oneDNN). Costs a second copy
    of those weights in memory (bytes: the same as the weights)."""
    if not onednn_linear_available():
        return 0
    layers = [m for m in model.modules() if isinstance(m, Linear)
              and m.weight.device.type == "cpu" and m.weight.dtype in _PACKED_DTYPES]
    for m in layers:
        m.prepack()
    return len(layers)

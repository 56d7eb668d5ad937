"""What a kernel boundary costs inside a CUDA graph, with and without programmatic
dependent launch (PDL: a kernel launched with ``launch_pdl`` may start while the one
before it drains, and waits with ``gdc_wait`` before it reads what that one wrote).

Two chains, each captured into one CUDA graph and replayed:
- 12 x 28 = 336 small elementwise kernels over 3,584 float32 values (a decode step's
  norms, rotary and such, one boundary each);
- 28 x (3 small kernels + one kernel streaming a 32 MB int8 weight), the weight read
  before ``gdc_wait`` when ``prefetch`` is set (a GEMV whose weight does not depend on the
  kernel before it).
Both chains are checked to compute the same values with PDL as without.

    python bench/pdl_probe.py --out bench/results/pdl_probe_h100.json

Needs CUDA (SM90+ for PDL) and Triton. Source: Triton's tutorial 11, "Programmatic
Dependent Launch"; CUDA's programming guide, the section of the same name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.fp8_gemm_bench import graph_ms

#: Small kernels per layer and layers, as a 28-layer decode step.
SMALL_PER_LAYER, NUM_LAYERS = 12, 28


@triton.jit
def _small(x_ptr, y_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * 1.0001 + 1.0, mask=m)


@triton.jit
def _stream(w_ptr, x_ptr, y_ptr, K, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    if USE_PDL and not PREFETCH:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        acc += tl.load(w_ptr + row * K + k0 + offs).to(tl.float32)
    if USE_PDL and PREFETCH:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + (offs % 16)).to(tl.float32)
    tl.store(y_ptr + row, tl.sum(acc * x))


def chain(bufs: list[torch.Tensor], weight: torch.Tensor | None, pdl: bool, prefetch: bool, small: int) -> None:
    """One pass of the chain: ``small`` small kernels per layer, then the weight stream."""
    kw = {"launch_pdl": True} if pdl else {}
    n = bufs[0].numel()
    for _ in range(NUM_LAYERS):
        for i in range(small):
            _small[(triton.cdiv(n, 1024),)](bufs[i % 2], bufs[(i + 1) % 2], n, BLOCK=1024, USE_PDL=pdl, **kw)
        if weight is not None:
            _stream[(weight.shape[0],)](weight, bufs[0], bufs[1], weight.shape[1], BLOCK_K=512, USE_PDL=pdl,
                                        PREFETCH=prefetch, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/pdl_probe_h100.json")
    args = ap.parse_args()
    bufs = [torch.randn(3584, device="cuda"), torch.randn(3584, device="cuda")]
    weight = torch.randint(-100, 100, (2048, 16384), dtype=torch.int8, device="cuda")  # 32 MB
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "date": date.today().isoformat(),
                              "torch": torch.__version__, "triton": triton.__version__}
    for pdl in (False, True):
        ms = graph_ms(lambda pdl=pdl: chain(bufs, None, pdl, False, SMALL_PER_LAYER))
        res[f"small_chain_pdl{int(pdl)}_ms"] = ms
        print(f"{SMALL_PER_LAYER * NUM_LAYERS} small kernels, pdl={pdl}: {ms:.3f} ms, "
              f"{ms * 1000 / (SMALL_PER_LAYER * NUM_LAYERS):.2f} us a kernel", flush=True)
    for pdl, prefetch in ((False, False), (True, False), (True, True)):
        ms = graph_ms(lambda pdl=pdl, prefetch=prefetch: chain(bufs, weight, pdl, prefetch, 3))
        res[f"stream_chain_pdl{int(pdl)}_prefetch{int(prefetch)}_ms"] = ms
        print(f"{NUM_LAYERS} x (3 small + 32 MB stream), pdl={pdl}, prefetch={prefetch}: {ms:.3f} ms", flush=True)
    outs = []
    for pdl in (False, True):
        fresh = [torch.ones(3584, device="cuda"), torch.zeros(3584, device="cuda")]
        chain(fresh, weight, pdl, pdl, SMALL_PER_LAYER)
        torch.cuda.synchronize()
        outs.append(torch.cat(fresh))
    res["same_values_with_pdl"] = bool(torch.equal(outs[0], outs[1]))
    print("same values with PDL:", res["same_values_with_pdl"])
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

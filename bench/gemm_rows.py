"""How cuBLAS's speed per row of a prefill-sized product depends on the row count: each
of Qwen2.5-7B's four projections (``bench/gemv_bench.py``'s ``SHAPES``) through
``F.linear`` at every ``--rows`` count, bfloat16, as one CUDA graph of ``--reps``
products (``bench/fp8_gemm_bench.py``'s ``graph_ms``), µs per product and ns per row,
and the step-sized total per row (the four products of a layer). A row count where the
library's heuristic picks a slower tile shows as a step up in ns per row. Also the LM
head's logits in float32 two ways: ``F.linear`` then ``.float()``, and one
``torch.mm(..., out_dtype=torch.float32)`` (where this torch has it on CUDA).

    python bench/gemm_rows.py --rows 16384,16256,16128,15872,12288,8192 --out gemm_rows.json

Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.fp8_gemm_bench import graph_ms
from bench.gemv_bench import SHAPES
from shared.model_source import DUMMY_CONFIGS

#: The LM head's shape, ``[vocab_size, hidden_size]``, of the model whose projections SHAPES holds.
LM_HEAD = (DUMMY_CONFIGS["Qwen2.5-7B"]["vocab_size"], DUMMY_CONFIGS["Qwen2.5-7B"]["hidden_size"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16384,16256,16128,15872,12288,8192")
    ap.add_argument("--lm-head-rows", default="1,64,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    weights = {name: (torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02,
                      torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None)
               for name, (n, k, bias) in SHAPES.items()}
    rows_list = [int(r) for r in args.rows.split(",")]
    table = []
    for m in rows_list:
        entry = {"rows": m}
        layer_us = 0.0
        for name, (w, b) in weights.items():
            x = torch.randn(m, w.shape[1], device=dev, dtype=torch.bfloat16)
            us = graph_ms(lambda x=x, w=w, b=b: F.linear(x, w, b), args.reps) * 1e3
            entry[name] = {"us": round(us, 1), "ns_per_row": round(us * 1e3 / m, 2)}
            layer_us += us
            del x
        entry["layer_ns_per_row"] = round(layer_us * 1e3 / m, 2)
        table.append(entry)
        print(json.dumps(entry))
    head = torch.randn(*LM_HEAD, device=dev, dtype=torch.bfloat16) * 0.02
    lm = []
    for m in (int(r) for r in args.lm_head_rows.split(",")):
        h = torch.randn(m, LM_HEAD[1], device=dev, dtype=torch.bfloat16)
        entry = {"rows": m, "linear_then_float_us": round(graph_ms(lambda h=h: F.linear(h, head).float(),
                                                                    args.reps) * 1e3, 1)}
        try:
            out = torch.mm(h, head.t(), out_dtype=torch.float32)
            ref = F.linear(h, head).float()
            entry["mm_out_dtype_us"] = round(graph_ms(lambda h=h: torch.mm(h, head.t(), out_dtype=torch.float32),
                                                      args.reps) * 1e3, 1)
            entry["argmax_equal"] = bool((out.argmax(-1) == ref.argmax(-1)).all())
            entry["max_abs_diff"] = float((out - ref).abs().max())
        except (RuntimeError, TypeError) as exc:
            entry["mm_out_dtype_error"] = str(exc).splitlines()[0][:200]
        lm.append(entry)
        print(json.dumps(entry))
    res = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "reps": args.reps, "projections": table, "lm_head": lm}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

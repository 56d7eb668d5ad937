"""inferq's offline engine for ``bench/side_by_side.py``: the same spec, method and
result as ``bench/vllm_offline_child.py`` (which documents them), run on
``worker.llm.LLM``'s engine, driven step by step as ``bench/product_bench.py``'s offline
child drives it. Settings as ``inferq serve`` builds them: the spec's over ``INFERQ_*``
variables over the defaults.

    python -m bench.inferq_offline_child SPEC.json
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.host import cpu_description
from bench.vllm_offline_child import Generate, Generation, read_spec, run_all


def inferq_generate(engine: Any) -> Generate:
    """``Generate`` over an ``LLMEngine``: every prompt added at once, then ``step()``
    until none is left, the tokens of each step timed when it returns."""
    from shared.sampling import SamplingParams

    ids = itertools.count()

    def generate(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> Generation:
        start_s = time.perf_counter()
        index: dict[str, int] = {}
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            rid = f"sbs-{next(ids)}"
            engine.add_request(rid, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
            index[rid] = i
        lens = [0] * len(prompts)
        timeline = []
        while engine.has_unfinished_requests():
            num_tokens = 0
            for out in engine.step():
                lens[index[out.request_id]] += len(out.new_token_ids)
                num_tokens += len(out.new_token_ids)
            if num_tokens:
                timeline.append((time.perf_counter(), num_tokens))
        return Generation(start_s, time.perf_counter(), lens, timeline)

    return generate


def main(argv: Sequence[str]) -> int:
    """Build the engine as ``argv[0]`` (the spec) says and run it; exits 2 with one line
    when the spec cannot be read."""
    spec = read_spec(argv, "python -m bench.inferq_offline_child SPEC.json")
    if spec is None:
        return 2
    import torch

    from shared.settings import EngineSettings, ModelSettings, build
    from worker.llm import LLM, offline_defaults

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = spec["engine"]
    model = build(ModelSettings, {"model": spec["model_dir"], "load_format": "dummy", "device": spec["device"],
                                  "max_model_len": engine["max_model_len"], "seed": spec.get("seed", 0)})
    # The offline LLM's own defaults, as LLM() takes them; INFERQ_* variables still win.
    engine_settings = build(EngineSettings, {"max_num_seqs": engine["max_num_seqs"],
                                             "enable_prefix_caching": engine["enable_prefix_caching"]},
                            defaults=offline_defaults(model.device))
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(model), **dataclasses.asdict(engine_settings))
    build_s = time.perf_counter() - t0
    device = llm.engine.device
    info = {"versions": {"torch": torch.__version__},
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description(),
            "dtype": str(llm.engine.dtype), "build_s": build_s, "backend": llm.engine.runner.backend.name}
    return run_all(spec, "inferq", inferq_generate(llm.engine), info)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

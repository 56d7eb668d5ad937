"""One offline engine run of ``bench/side_by_side.py``: read a JSON spec, build the engine
once, run its workloads, write a JSON result. This file runs vLLM's ``vllm.LLM`` and holds
the method both offline children share (``run_all``); ``bench/inferq_offline_child.py``
runs inferq's engine through the same functions. It imports only vLLM (inside ``main``)
and the standard library, because it runs under vLLM's own ``PYTHONPATH``, where inferq's
packages are not: ``python3 -P bench/vllm_offline_child.py SPEC.json``.

The spec (JSON):

- ``model_dir``: a Hugging Face folder (``config.json`` with ``architectures``, tokenizer
  files); weights are random (``load_format="dummy"``).
- ``engine``: ``max_num_seqs``, ``max_model_len`` (tokens), ``enable_prefix_caching``;
  everything else stays at the engine's defaults. ``device`` and ``seed`` beside it.
- ``warmup``: ``{"prompts": [[ids]], "max_tokens": n}``, run once before the timed runs.
- ``runs``: a list of ``{"workload", "kind", "prompts": [[ids]], "max_tokens": [n]}``;
  ``kind`` ``batch`` submits every prompt at once and times until the last one ends;
  ``kind`` ``decode`` (one prompt, ``repeats``) times batch-1 decode.
- ``deadline_s`` (optional): a ``time.perf_counter`` value after which no run starts.
- ``result``: where to write the result.

Every request is greedy with ``ignore_eos``, so it yields exactly its ``max_tokens``.

The result (rewritten after every run, so a killed child keeps what it measured):
``engine``, ``versions``, ``device_name``, ``dtype``, ``build_s`` (engine start, s), ``runs``
(workload -> figures, below), ``errors`` and ``skipped`` (workload -> why) and ``done``. Times ending
in ``_s`` are seconds; ``start_s``/``end_s`` are ``time.perf_counter`` values, which on
Linux read the system-wide monotonic clock and so compare with the parent's.

- ``batch``: ``num_requests``, ``expected_output_tokens``, ``total_output_tokens``,
  ``num_incomplete`` (requests with fewer tokens than asked), ``wall_s``, ``output_tok_s``
  (output tokens / wall time), ``timeline`` (``t_s`` after the start and ``tokens`` that
  arrived then) and ``timeline_kind``: ``step`` (per engine step) or ``finish`` (all at
  the end, where vLLM's engine loop could not be driven directly).
- ``decode``: per repeat the time of the prompt with 1 output token (``first_s``: prefill
  and one token) and with all of them (``full_s``); ``ms_per_output_token`` is the median
  over repeats of ``(full_s - first_s) / (output_len - 1)``: decode alone, the prefill
  left out (the TPOT definition of ``vllm bench serve``, taken offline).
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Figures of the warm-up are not kept.
WARMUP = "warmup"


@dataclass(slots=True)
class Generation:
    """What one ``generate`` call saw: perf_counter start and end (s), output tokens per
    request (in prompt order) and the timeline as (perf_counter time, tokens that arrived)."""

    start_s: float
    end_s: float
    output_lens: list[int]
    timeline: list[tuple[float, int]] = field(default_factory=list)
    timeline_kind: str = "step"


#: ``generate(prompts, max_tokens) -> Generation``: one engine's way to run a batch.
Generate = Callable[[Sequence[Sequence[int]], Sequence[int]], Generation]


def batch_figures(gen: Generation, max_tokens: Sequence[int]) -> dict[str, Any]:
    """The ``batch`` figures of one generation (module docstring)."""
    wall_s = max(gen.end_s - gen.start_s, 1e-9)
    total = sum(gen.output_lens)
    return {"kind": "batch", "num_requests": len(max_tokens), "expected_output_tokens": sum(max_tokens),
            "total_output_tokens": total,
            "num_incomplete": sum(got < want for got, want in zip(gen.output_lens, max_tokens, strict=True)),
            "start_s": gen.start_s, "end_s": gen.end_s, "wall_s": wall_s, "output_tok_s": total / wall_s,
            "timeline": {"t_s": [t - gen.start_s for t, _ in gen.timeline], "tokens": [n for _, n in gen.timeline]},
            "timeline_kind": gen.timeline_kind}


def ms_per_output_token(first_s: float, full_s: float, output_len: int) -> float:
    """Batch-1 decode time per token, ms: the run with ``output_len`` tokens less the run
    with one (prefill and first token), over the ``output_len - 1`` tokens between.

    Raises:
        ValueError: ``output_len`` below 2 (no decode step to time).
    """
    if output_len < 2:
        raise ValueError(f"decode needs at least 2 output tokens, got {output_len}")
    return (full_s - first_s) * 1000.0 / (output_len - 1)


def decode_figures(generate: Generate, prompt: Sequence[int], output_len: int, repeats: int) -> dict[str, Any]:
    """Time batch-1 decode ``repeats`` times (module docstring, ``decode``)."""
    rows = []
    last: Generation | None = None
    for _ in range(repeats):
        first = generate([prompt], [1])
        last = generate([prompt], [output_len])
        rows.append({"first_s": first.end_s - first.start_s, "full_s": last.end_s - last.start_s,
                     "output_tokens": last.output_lens[0]})
    assert last is not None
    figures = batch_figures(last, [output_len])
    figures.update(kind="decode", prompt_len=len(prompt), output_len=output_len, repeats=rows,
                   ms_per_output_token=statistics.median(
                       ms_per_output_token(r["first_s"], r["full_s"], output_len) for r in rows))
    return figures


def run_all(spec: dict[str, Any], engine: str, generate: Generate, info: dict[str, Any]) -> int:
    """The warm-up, then every run of ``spec``; the result is written after each.
    ``info``: ``versions``, ``device_name``, ``dtype``, ``build_s`` of the engine.
    Returns 0 when every run succeeded, else 1 (the failures are in ``errors``)."""
    result: dict[str, Any] = {"engine": engine, **info, "runs": {}, "errors": {}, "skipped": {}, "done": False}
    out = Path(spec["result"])

    def save() -> None:  # whole or not at all: the parent may read it after a kill
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps(result))
        partial.replace(out)

    warm = spec.get("warmup")
    if warm and warm["prompts"]:
        generate(warm["prompts"], [warm["max_tokens"]] * len(warm["prompts"]))
    save()
    for run in spec["runs"]:
        name = run["workload"]
        if time.perf_counter() > spec.get("deadline_s", float("inf")):
            result["skipped"][name] = "the parent's time budget ran out before it"
            continue
        try:
            if run["kind"] == "decode":
                result["runs"][name] = decode_figures(generate, run["prompts"][0], run["max_tokens"][0],
                                                      int(run.get("repeats", 1)))
            else:
                result["runs"][name] = batch_figures(generate(run["prompts"], run["max_tokens"]), run["max_tokens"])
        except Exception as exc:  # noqa: BLE001 - one workload failing must not lose the others
            traceback.print_exc()
            result["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
        save()
    result["done"] = True
    save()
    return 1 if result["errors"] else 0


# -- vLLM ---------------------------------------------------------------------------------------
def vllm_generate(llm: Any) -> Generate:
    """``Generate`` over ``llm`` (a ``vllm.LLM``): the requests go straight to its engine
    (``llm.llm_engine.add_request``, outputs as deltas) and its ``step()`` loop runs here,
    which is ``LLM.generate``'s own loop, so that tokens are timed per step. Where that API
    differs (another vLLM version), ``LLM.generate`` runs instead and the timeline holds
    the end only (``timeline_kind`` ``finish``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    ids = itertools.count()
    direct = True

    def params(n: int, kind: Any) -> Any:
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, output_kind=kind)

    def by_generate(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> Generation:
        start_s = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                            [params(n, RequestOutputKind.FINAL_ONLY) for n in max_tokens], use_tqdm=False)
        end_s = time.perf_counter()
        lens = [len(o.outputs[0].token_ids) for o in outs]
        return Generation(start_s, end_s, lens, [(end_s, sum(lens))], "finish")

    def by_steps(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> Generation:
        engine = llm.llm_engine
        start_s = time.perf_counter()
        index: dict[str, int] = {}
        for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            rid = f"sbs-{next(ids)}"
            engine.add_request(rid, {"prompt_token_ids": list(p)}, params(n, RequestOutputKind.DELTA))
            index[rid] = i
        lens = [0] * len(prompts)
        timeline = []
        while engine.has_unfinished_requests():
            outs = engine.step()
            num_tokens = 0
            for o in outs:
                k = len(o.outputs[0].token_ids) if o.outputs else 0
                lens[index[o.request_id]] += k
                num_tokens += k
            if num_tokens:
                timeline.append((time.perf_counter(), num_tokens))
        return Generation(start_s, time.perf_counter(), lens, timeline)

    def generate(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> Generation:
        nonlocal direct
        if direct:
            try:
                return by_steps(prompts, max_tokens)
            except (TypeError, AttributeError) as exc:  # an engine API of another version
                if llm.llm_engine.has_unfinished_requests():
                    raise
                print(f"vllm_offline_child: driving llm_engine failed ({exc}); timing LLM.generate instead",
                      file=sys.stderr, flush=True)
                direct = False
        return by_generate(prompts, max_tokens)

    return generate


def vllm_info(llm: Any, build_s: float) -> dict[str, Any]:
    """Versions, device and dtype of a built ``vllm.LLM`` (what cannot be read is ``unknown``)."""
    import importlib.metadata

    import vllm

    try:
        from vllm.platforms import current_platform

        device_name = str(current_platform.get_device_name())
    except Exception:  # noqa: BLE001 - a name is nice to have, never worth failing the run
        device_name = "unknown"
    try:
        dtype = str(llm.llm_engine.model_config.dtype)
    except AttributeError:
        dtype = "unknown"
    return {"versions": {"vllm": vllm.__version__, "torch": importlib.metadata.version("torch")},
            "device_name": device_name, "dtype": dtype, "build_s": build_s}


def read_spec(argv: Sequence[str], usage: str) -> dict[str, Any] | None:
    """The spec of a child's command line (``argv``: one JSON file's path), or None after
    one line on stderr (``usage`` when the arguments are wrong, else why the file cannot
    be read): the child then exits 2."""
    if len(argv) != 1:
        print(f"usage: {usage}", file=sys.stderr)
        return None
    try:
        return dict(json.loads(Path(argv[0]).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        print(f"{usage.split()[-2]}: cannot read the spec {argv[0]}: {exc}", file=sys.stderr)
        return None


def main(argv: Sequence[str]) -> int:
    """``vllm_offline_child.py SPEC.json``: build ``vllm.LLM`` as the spec says and run it.
    Exits 2 with one line when the spec is missing or does not parse."""
    spec = read_spec(argv, "vllm_offline_child.py SPEC.json")
    if spec is None:
        return 2
    from vllm import LLM

    engine = spec["engine"]
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], load_format="dummy", max_num_seqs=engine["max_num_seqs"],
              max_model_len=engine["max_model_len"], enable_prefix_caching=engine["enable_prefix_caching"],
              seed=spec.get("seed", 0))
    return run_all(spec, "vllm", vllm_generate(llm), vllm_info(llm, time.perf_counter() - t0))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

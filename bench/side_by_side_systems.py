"""The four systems of ``bench/side_by_side.py``: start one with a workload group's engine
settings, run its workloads, stop it, and hand back what it measured.

- ``inferq-offline``: ``bench/inferq_offline_child.py`` in a subprocess.
- ``vllm-offline``: ``bench/vllm_offline_child.py`` (``vllm.LLM``) in a subprocess.
- ``inferq-serve``: ``inferq serve`` as ``bench/product_bench.py`` starts it.
- ``vllm-serve``: ``python -m vllm.entrypoints.openai.api_server``.

Both served systems get the same load client (``bench.loadgen``: streamed
``/v1/completions`` with token-id prompts, ``ignore_eos``, greedy), from
``client_processes`` processes. vLLM runs under its own ``PYTHONPATH`` (the ``vllm_site``
folder alone, never beside inferq's packages) with the offline variables of ``VLLM_ENV``,
started with ``python -P`` from the work folder, so that neither the repository nor the
current folder is on its path; it runs in a session of its own, which is stopped whole.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen.config import BenchConfig
from bench.loadgen.dataset import SampleRequest
from bench.loadgen.multiproc import run_split
from bench.loadgen.report import BenchResult
from bench.loadgen.runner import drive, make_result
from bench.procs import ROOT, free_port, spawn, stop
from bench.product_bench import serve_argv, tail, wait_ready
from bench.side_by_side_workloads import OFFLINE, SERVE, Workload
from shared.lifecycle import parent_death_preexec

SYSTEMS = ("inferq-offline", "vllm-offline", "inferq-serve", "vllm-serve")
MODE = {"inferq-offline": OFFLINE, "vllm-offline": OFFLINE, "inferq-serve": SERVE, "vllm-serve": SERVE}
ENGINE = {"inferq-offline": "inferq", "vllm-offline": "vllm", "inferq-serve": "inferq", "vllm-serve": "vllm"}
#: What vLLM needs on a GPU machine without network: no hub, no usage report, and its
#: sampler without flashinfer (not carried there; without this the engine core dies).
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_USE_FLASHINFER_SAMPLER": "0"}
#: Served warm-up after each start: this many prompts of a workload's first request length, this many tokens.
WARMUP_PROMPTS, WARMUP_OUTPUT_LEN = 8, 4


@dataclass(frozen=True, slots=True)
class Context:
    """What every system start needs: the model folder, where specs and logs go, the
    device (inferq's ``--device``), vLLM's site folder, serve's gateway processes (0:
    serve's default), the load client's processes, the seed and the time limits (s)."""

    model_dir: Path
    work_dir: Path
    log_dir: Path
    device: str
    vllm_site: Path
    gateway_workers: int
    client_processes: int
    seed: int
    start_timeout_s: float
    run_timeout_s: float
    #: ``INFERQ_*`` settings for inferq's offline child and ``serve`` (the command line's
    #: inferq flags: ``product_bench.passthrough_env``), e.g. ``--itl-target-ms 30``.
    inferq_env: dict[str, str] = field(default_factory=dict)


def vllm_site_problem(site: Path) -> str | None:
    """Why vLLM cannot run from ``site`` (None when it holds a ``vllm`` package)."""
    if not site.is_dir():
        return f"--vllm-site {site} does not exist"
    if not (site / "vllm" / "__init__.py").is_file():
        return f"--vllm-site {site} holds no vllm package"
    return None


def vllm_env(site: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of a vLLM process: ``environ`` with ``PYTHONPATH`` = ``site``
    alone and ``VLLM_ENV``."""
    return {**environ, "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1", **VLLM_ENV}


def start_session(argv: Sequence[str], log: Path, env: Mapping[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    """``argv`` in a session of its own (so that its whole tree can be stopped), output
    appended to ``log``, SIGTERM when this process dies."""
    with open(log, "ab") as out:
        return subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=parent_death_preexec(signal.SIGTERM))  # noqa: PLW1509


def stop_session(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> int:
    """SIGTERM to the session of ``proc``, SIGKILL to what is left after ``timeout_s``
    seconds; returns when none of it runs (its GPU memory is free). Returns the leader's
    exit code."""
    def signal_all(sig: int) -> bool:
        try:
            os.killpg(proc.pid, sig)
            return True
        except ProcessLookupError:
            return False

    signal_all(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + timeout_s
    while signal_all(0) and time.monotonic() < deadline:  # children the leader left behind
        time.sleep(0.2)
    if signal_all(signal.SIGKILL):
        time.sleep(1.0)
    return int(proc.returncode)


# -- offline ------------------------------------------------------------------------------------
def offline_spec(workloads: Sequence[Workload], settings: Mapping[str, Any], ctx: Context, result: Path,
                 deadline_s: float) -> dict[str, Any]:
    """The children's spec (``bench/vllm_offline_child.py``) for ``workloads`` under
    ``settings``; the warm-up sends a few prompts of the first length and one of the
    longest, so that the first timed long prefill compiles nothing."""
    runs = [{"workload": w.name, "kind": "decode" if w.decode_repeats else "batch",
             "prompts": [r.prompt for r in w.requests], "max_tokens": [r.max_tokens for r in w.requests],
             "repeats": w.decode_repeats} for w in workloads]
    first = workloads[0].requests[0].prompt
    longest = max((r.prompt for w in workloads for r in w.requests), key=len)
    return {"model_dir": str(ctx.model_dir), "device": ctx.device, "seed": ctx.seed, "engine": dict(settings),
            "warmup": {"prompts": [first] * WARMUP_PROMPTS + [longest], "max_tokens": WARMUP_OUTPUT_LEN},
            "runs": runs, "deadline_s": deadline_s, "result": str(result)}


def run_offline(system: str, workloads: Sequence[Workload], settings: Mapping[str, Any], ctx: Context,
                deadline_s: float) -> dict[str, Any]:
    """Run ``workloads`` in one offline child of ``system``; returns its result (whatever
    it wrote before ending, with ``exit_code``; ``error`` when it failed).
    ``deadline_s`` (perf_counter): the child starts no workload after it."""
    tag = f"{system}-{'-'.join(w.name for w in workloads)}"
    spec_path, result_path = ctx.work_dir / f"{tag}.spec.json", ctx.work_dir / f"{tag}.result.json"
    log = ctx.log_dir / f"{tag}.log"
    spec_path.write_text(json.dumps(offline_spec(workloads, settings, ctx, result_path, deadline_s)))
    timeout_s = max(deadline_s - time.perf_counter(), 0.0) + ctx.start_timeout_s + ctx.run_timeout_s
    if ENGINE[system] == "vllm":
        proc = start_session([sys.executable, "-P", str(ROOT / "bench" / "vllm_offline_child.py"), str(spec_path)],
                             log, vllm_env(ctx.vllm_site, os.environ), ctx.work_dir)
    else:
        proc = spawn(["-m", "bench.inferq_offline_child", str(spec_path)], log, ctx.inferq_env, die_with_parent=True)
    error = None
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        error = f"passed {timeout_s:.0f} s"
    finally:
        code = stop_session(proc) if ENGINE[system] == "vllm" else stop(proc, timeout_s=30)
    result = json.loads(result_path.read_text()) if result_path.exists() else {"runs": {}, "errors": {}}
    if code != 0 and error is None:
        error = f"exited {code}"
    if error is not None:
        result["error"] = f"{system} {error}: {tail(log)}"
    result["exit_code"] = code
    return dict(result)


# -- served -------------------------------------------------------------------------------------
@contextmanager
def serving(system: str, settings: Mapping[str, Any], ctx: Context) -> Iterator[tuple[str, str | None]]:
    """Start ``system`` (``inferq-serve`` or ``vllm-serve``) under ``settings`` and wait
    until it serves; yields ``(base URL, vLLM's version or None)``; stops it (all of it).

    Raises:
        RuntimeError: it exited or was not ready within ``ctx.start_timeout_s``.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = ctx.log_dir / f"{system}-{settings['max_model_len']}-{int(settings['enable_prefix_caching'])}.log"
    if ENGINE[system] == "vllm":
        caching = "--enable-prefix-caching" if settings["enable_prefix_caching"] else "--no-enable-prefix-caching"
        argv = [sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", str(ctx.model_dir),
                "--served-model-name", ctx.model_dir.name, "--host", "127.0.0.1", "--port", str(port),
                "--load-format", "dummy", "--max-num-seqs", str(settings["max_num_seqs"]),
                "--max-model-len", str(settings["max_model_len"]), caching, "--seed", str(ctx.seed),
                "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
        proc = start_session(argv, log, vllm_env(ctx.vllm_site, os.environ), ctx.work_dir)
        try:
            wait_ready(proc, url, log, ctx.start_timeout_s, path="/v1/models", name="vLLM's api_server")
            yield url, server_version(url)
        finally:
            stop_session(proc)
        return
    env = {**ctx.inferq_env, "INFERQ_MAX_MODEL_LEN": str(settings["max_model_len"]),
           "INFERQ_METRICS_PORT": str(free_port()),
           "INFERQ_ENABLE_PREFIX_CACHING": "true" if settings["enable_prefix_caching"] else "false"}
    args = argparse.Namespace(device=ctx.device, gateway_workers=ctx.gateway_workers)
    proc = spawn(serve_argv(args, ctx.model_dir, settings["max_num_seqs"], port), log, env, die_with_parent=True)
    try:
        wait_ready(proc, url, log, ctx.start_timeout_s)
        yield url, None
    finally:
        stop(proc, timeout_s=60)


def server_version(url: str) -> str | None:
    """vLLM's version from its server's ``GET /version`` (None where it does not answer)."""
    try:
        return str(httpx.get(f"{url}/version", timeout=5, trust_env=False).json()["version"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def client_config(url: str, ctx: Context, num_requests: int, concurrency: int) -> BenchConfig:
    """The load client's settings: the model by its folder's name, greedy, ``ignore_eos``,
    at most ``concurrency`` streams, each request allowed ``ctx.run_timeout_s``."""
    return BenchConfig(base_url=url, model=ctx.model_dir.name, num_prompts=num_requests,
                       max_concurrency=concurrency, ignore_eos=True, seed=ctx.seed, show_progress=False,
                       timeout_s=ctx.run_timeout_s)


def drive_served(url: str, workload: Workload, ctx: Context) -> BenchResult:
    """Send ``workload`` to ``url`` at its concurrency and send times, from up to
    ``ctx.client_processes`` processes; returns the client's result (records in the
    requests' order)."""
    requests = [SampleRequest(r.prompt, len(r.prompt), r.max_tokens) for r in workload.requests]
    offsets_s = [r.offset_s for r in workload.requests]
    cfg = client_config(url, ctx, len(requests), workload.concurrency)
    num_processes = min(ctx.client_processes, workload.concurrency)
    if num_processes > 1:
        return run_split(cfg, num_processes, requests, offsets_s)[0]
    model, outputs, start_s, end_s = asyncio.run(drive(cfg, requests, offsets_s=offsets_s))
    return make_result(cfg, model, None, outputs, end_s - start_s)


def warm_up(url: str, workloads: Sequence[Workload], ctx: Context) -> None:
    """A few requests through a fresh server (``WARMUP_PROMPTS`` of the first prompt and
    one of the longest, ``WARMUP_OUTPUT_LEN`` tokens each), not measured.

    Raises:
        RuntimeError: one of them failed (the server cannot run the workloads).
    """
    first = workloads[0].requests[0].prompt
    longest = max((r.prompt for w in workloads for r in w.requests), key=len)
    requests = [SampleRequest(p, len(p), WARMUP_OUTPUT_LEN) for p in [first] * WARMUP_PROMPTS + [longest]]
    cfg = client_config(url, ctx, len(requests), len(requests))
    _, outputs, _, _ = asyncio.run(drive(cfg, requests))
    errors = sorted({o.error for o in outputs if not o.success})
    if errors:
        raise RuntimeError(f"warm-up failed: {errors[0]}")

"""Run one benchmark: build prompts, send them on the arrival schedule, and collect the result.

Requests leave at their arrival times whatever the concurrency; ``max_concurrency`` then holds
each one at a semaphore before it is sent (as ``vllm bench serve`` does), so with a cap the
offered rate can exceed what is sent. TTFT therefore excludes time spent waiting for the cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.loadgen.arrivals import arrival_offsets_s
from bench.loadgen.client import RequestOutput, build_payload, first_model_id, send_request
from bench.loadgen.config import CHAT_ENDPOINT, BenchConfig
from bench.loadgen.dataset import SampleRequest, Tokenizer, sample_random_requests
from bench.loadgen.metrics import compute_metrics
from bench.loadgen.report import BenchResult, now_date

__all__ = ["BenchResult", "drive", "make_result", "run_benchmark"]


def load_tokenizer(name_or_path: str) -> Any:
    """Hugging Face tokenizer from a folder or hub id (imported lazily: transformers is slow to load)."""
    from shared.tokenizer_loader import load_tokenizer as load

    return load(name_or_path)


def build_requests(cfg: BenchConfig, tokenizer: Tokenizer | None = None) -> list[SampleRequest]:
    """The run's random prompts: text with a tokenizer (given, or loaded from ``cfg.tokenizer``), ids without.

    Raises ``ValueError`` for the chat endpoint without a tokenizer (chat messages must be text).
    """
    if tokenizer is None and cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer is None and cfg.endpoint == CHAT_ENDPOINT:
        raise ValueError("the chat endpoint needs a tokenizer (--tokenizer) to build text prompts")
    return sample_random_requests(
        num_prompts=cfg.num_prompts,
        input_len=cfg.random_input_len,
        output_len=cfg.random_output_len,
        range_ratio=cfg.random_range_ratio,
        seed=cfg.seed,
        tokenizer=tokenizer,
        token_id_low=cfg.random_token_id_low,
        token_id_high=cfg.random_token_id_high,
    )


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int) -> Iterator[Any]:
    """Yields ``advance()``: a rich progress bar when ``enabled``, else a no-op."""
    if not enabled:
        yield lambda: None
        return
    columns = (TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        task_id = progress.add_task("requests", total=total)
        yield lambda: progress.advance(task_id)


async def drive(cfg: BenchConfig, requests: list[SampleRequest], model: str | None = None,
                on_request_done: Callable[[], None] | None = None,
                offsets_s: Sequence[float] | None = None) -> tuple[str, list[RequestOutput], float, float]:
    """Send ``requests`` to ``cfg.urls`` (round-robin) on the arrival schedule, at most
    ``cfg.max_concurrency`` at once, and collect what each measured. ``offsets_s``: each
    request's send time in seconds after the start, non-decreasing, in place of the
    schedule of ``cfg.request_rate_per_s`` (a workload that starts one group of streams
    before another).

    Returns ``(model, outputs, start_s, end_s)``; the times are ``time.perf_counter`` (on
    Linux the system-wide monotonic clock, so times of several client processes compare).
    Raises ``ValueError`` for ``offsets_s`` of another length or out of order, and
    ``httpx.HTTPError``/``RuntimeError`` only when ``model`` is None and the model list
    cannot be read; request failures are recorded per request.
    """
    if offsets_s is None:
        offsets_s = arrival_offsets_s(len(requests), cfg.request_rate_per_s, cfg.burstiness, cfg.seed).tolist()
    if len(offsets_s) != len(requests) or any(b < a for a, b in itertools.pairwise(offsets_s)):
        raise ValueError("offsets_s needs one non-decreasing send time per request")
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # trust_env=False: an HTTP(S)_PROXY meant for the internet must not sit between us and the server.
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits, trust_env=False) as client:
        model = model or cfg.model or await first_model_id(client, cfg.base_url, headers)
        semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

        bar = progress_bar(cfg.show_progress and on_request_done is None, len(requests))
        with bar as advance:
            done = on_request_done or advance

            async def one(request: SampleRequest, url: str) -> RequestOutput:
                payload = build_payload(cfg.endpoint, model, request, cfg.ignore_eos)
                async with semaphore or contextlib.nullcontext():
                    out = await send_request(client, url, payload, request.prompt_len, headers)
                done()
                return out

            start_s = time.perf_counter()
            tasks = []
            urls = itertools.cycle(cfg.urls)
            for request, offset_s in zip(requests, offsets_s, strict=True):
                delay_s = start_s + offset_s - time.perf_counter()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                tasks.append(asyncio.create_task(one(request, next(urls))))
            outputs = list(await asyncio.gather(*tasks))
            end_s = time.perf_counter()
    return model, outputs, start_s, end_s


def make_result(cfg: BenchConfig, model: str, tokenizer: Tokenizer | None, outputs: list[RequestOutput],
                duration_s: float) -> BenchResult:
    """The run's ``BenchResult`` from every request's record and the run's length (s, > 0)."""
    metrics = compute_metrics(outputs, duration_s, cfg.percentiles, cfg.goodput_slos_ms)
    return BenchResult(
        date=now_date(),
        endpoint_type=cfg.endpoint_type,
        label=cfg.label,
        model_id=model,
        tokenizer_id=cfg.tokenizer or getattr(tokenizer, "name_or_path", None) or model,
        num_prompts=cfg.num_prompts,
        request_rate_per_s=cfg.request_rate_per_s,
        burstiness=cfg.burstiness,
        max_concurrency=cfg.max_concurrency,
        percentiles=cfg.percentiles,
        metrics=metrics,
        outputs=outputs,
    )


async def run_benchmark(
    cfg: BenchConfig, *, tokenizer: Tokenizer | None = None, on_request_done: Callable[[], None] | None = None
) -> BenchResult:
    """Drive ``cfg.urls`` (round-robin) with ``cfg.num_prompts`` streaming requests and return the measured result.

    ``tokenizer`` (optional) is an already loaded tokenizer to build prompts with instead of
    loading ``cfg.tokenizer``, e.g. to reuse one across a sweep. ``on_request_done`` (optional)
    is called as each request ends, in place of the run's own progress bar (a sweep draws its
    own bars). Raises ``ValueError`` as ``build_requests`` does, and ``httpx.HTTPError``/``RuntimeError``
    only when ``cfg.model`` is None and the model list cannot be read; request failures are
    recorded per request, not raised.
    """
    if tokenizer is None and not cfg.tokenizer and cfg.endpoint == CHAT_ENDPOINT:
        raise ValueError("the chat endpoint needs a tokenizer (--tokenizer) to build text prompts")
    requests = await asyncio.to_thread(build_requests, cfg, tokenizer)
    model, outputs, start_s, end_s = await drive(cfg, requests, on_request_done=on_request_done)
    return make_result(cfg, model, tokenizer, outputs, end_s - start_s)

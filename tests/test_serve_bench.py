"""Tests for the load generator (bench/): a real uvicorn server streams known chunks with known
sleeps, and the benchmark's measurements are checked against them; metric math is checked on
hand-made records; a sweep runs against a real gateway with a `sim` worker and writes JSON and
PNG plots."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # repo root, for `pytest` without pythonpath
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from typer.testing import CliRunner

from bench.loadgen.arrivals import arrival_offsets_s
from bench.loadgen.client import RequestOutput
from bench.loadgen.config import CHAT_ENDPOINT, BenchConfig
from bench.loadgen.dataset import sample_random_requests
from bench.loadgen.metrics import compute_metrics
from bench.loadgen.multiproc import concurrency_shares, run_split
from bench.loadgen.runner import build_requests, run_benchmark
from bench.loadgen.sweep import SweepPlan
from bench.serve_bench import app as cli_app
from bench.serve_bench import expand_multi_value_args, parse_goodput

pytestmark = pytest.mark.timeout(30)

TTFT_SLEEP_S = 0.05  # server waits this long before the first chunk
ITL_SLEEP_S = 0.02  # and this long before each later chunk
MODEL_ID = "fake/tiny-model"


# ---------------------------------------------------------------- fake OpenAI-like server


class FakeServer:
    """Streams ``max_tokens`` tokens. The URL prefix picks a scenario:
    ``ok`` (one token per chunk), ``multi`` (two tokens per chunk), ``nousage`` (no usage chunk),
    ``fail3`` (every third request gets HTTP 500)."""

    def __init__(self) -> None:
        self.app = FastAPI()
        self.payloads: dict[str, list[dict]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)
        self.app.get("/{scenario}/v1/models")(self.models)
        self.app.post("/{scenario}/v1/completions")(self.completions)
        self.app.post("/{scenario}/v1/chat/completions")(self.completions)

    async def models(self, scenario: str) -> dict:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    async def completions(self, scenario: str, request: Request) -> Response:
        body = await request.json()
        self.payloads[scenario].append(body)
        self.counts[scenario] += 1
        if scenario == "fail3" and self.counts[scenario] % 3 == 0:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        chat = "messages" in body
        per_chunk = 2 if scenario == "multi" else 1
        return StreamingResponse(
            self.stream(body["max_tokens"], per_chunk, chat, scenario != "nousage"), media_type="text/event-stream"
        )

    @staticmethod
    async def stream(num_tokens: int, per_chunk: int, chat: bool, usage: bool) -> AsyncIterator[str]:
        await asyncio.sleep(TTFT_SLEEP_S)
        sent = 0
        while sent < num_tokens:
            if sent:
                await asyncio.sleep(ITL_SLEEP_S)
            n = min(per_chunk, num_tokens - sent)
            text = "tok " * n
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            sent += n
        if usage:
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': num_tokens}})}\n\n"
        yield "data: [DONE]\n\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeServer, str]]:
    fake = FakeServer()
    port = free_port()
    config = uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", ws="none")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline_s = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline_s, "fake server did not start"
        time.sleep(0.01)
    yield fake, f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(timeout=5)


def cfg_for(base_url: str, scenario: str, **kw: Any) -> BenchConfig:
    defaults: dict[str, Any] = {
        "base_url": f"{base_url}/{scenario}",
        "random_input_len": 16,
        "random_output_len": 6,
        "num_prompts": 8,
        "max_concurrency": 4,
        "show_progress": False,
        "seed": 1,
    }
    return BenchConfig(**(defaults | kw))


# ---------------------------------------------------------------- end-to-end against the server


def test_split_client_sends_every_prompt_once_and_merges_the_records(server: tuple[FakeServer, str]) -> None:
    """Three client processes (bench.loadgen.multiproc): together they send the run's
    prompts exactly once each, and the merged result counts all of them."""
    fake, base_url = server
    cfg = cfg_for(base_url, "split", ignore_eos=True, num_prompts=10, max_concurrency=5, model=MODEL_ID)
    result, cpu_s = run_split(cfg, 3)
    m = result.metrics
    assert (m.completed, m.failed, m.total_output_tokens) == (10, 0, 60)
    sent = sorted(tuple(body["prompt"]) for body in fake.payloads["split"])
    assert sent == sorted(tuple(r.prompt) for r in build_requests(cfg))
    starts = [o.start_s for o in result.outputs]
    assert m.duration_s >= max(o.start_s + o.latency_s for o in result.outputs) - min(starts) > 0
    assert cpu_s > 0
    assert concurrency_shares(5, 3) == [2, 2, 1] and concurrency_shares(None, 2) == [None, None]
    with pytest.raises(ValueError, match="less than 3 client processes"):
        concurrency_shares(2, 3)


async def test_counts_and_latencies(server: tuple[FakeServer, str]) -> None:
    fake, base_url = server
    result = await run_benchmark(cfg_for(base_url, "ok", ignore_eos=True, percentiles=(50.0, 99.0)))
    m = result.metrics
    assert result.model_id == MODEL_ID  # discovered from /v1/models
    assert (m.completed, m.failed) == (8, 0)
    assert m.output_lens == [6] * 8 and m.total_output_tokens == 48
    assert m.total_input_tokens == 16 * 8
    # What the server received: token-id prompts, greedy, streamed with usage, ignore_eos.
    body = fake.payloads["ok"][0]
    assert (
        isinstance(body["prompt"], list)
        and len(body["prompt"]) == 16
        and all(isinstance(t, int) for t in body["prompt"])
    )
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 6 and body["temperature"] == 0.0 and body["ignore_eos"] is True
    assert body["model"] == MODEL_ID
    # Lower bounds only: the server's sleeps make each time at least this long; a loaded
    # host only makes it longer (no wall-clock ceiling in a test).
    for out in result.outputs:
        assert out.ttft_s >= TTFT_SLEEP_S
        assert len(out.itls_s) == 5  # one gap per chunk after the first (one gap may be short: chunks read late)
        assert out.latency_s >= TTFT_SLEEP_S + 5 * ITL_SLEEP_S
        assert out.latency_s == pytest.approx(out.ttft_s + sum(out.itls_s))  # start, first chunk, gaps, last chunk
        assert out.generated_text == "tok " * 6
    # The summaries are of exactly these records.
    ok = result.outputs
    assert m.latency["ttft"].mean_ms == pytest.approx(1000 * np.mean([o.ttft_s for o in ok]))
    assert m.latency["itl"].median_ms == pytest.approx(1000 * np.median([g for o in ok for g in o.itls_s]))
    assert m.latency["tpot"].mean_ms == pytest.approx(1000 * np.mean([(o.latency_s - o.ttft_s) / 5 for o in ok]))
    assert m.latency["e2el"].mean_ms == pytest.approx(1000 * np.mean([o.latency_s for o in ok]))
    # Concurrency 4: exactly 4 requests in flight at the peak (the first four start in one
    # event-loop pass, before any chunk arrives), never more.
    assert max_in_flight(ok) == 4
    assert m.duration_s >= 2 * (TTFT_SLEEP_S + 5 * ITL_SLEEP_S)  # 8 requests, 4 at a time: two waves
    assert math.isclose(m.request_throughput, 8 / m.duration_s)
    assert math.isclose(m.total_token_throughput, (48 + 128) / m.duration_s)


def max_in_flight(outputs: list[RequestOutput]) -> int:
    """Most requests whose [start, last chunk] intervals overlap (a request holds its
    concurrency slot at least that long)."""
    return max(sum(o.start_s <= t <= o.start_s + o.latency_s for o in outputs) for t in (o.start_s for o in outputs))


async def test_multi_token_chunks_and_missing_usage(server: tuple[FakeServer, str]) -> None:
    _, base_url = server
    multi = await run_benchmark(cfg_for(base_url, "multi", random_output_len=8, num_prompts=3))
    for out in multi.outputs:
        assert out.output_tokens == 8  # from usage, not the 4 chunks
        assert len(out.itls_s) == 3  # one ITL per chunk, as vLLM counts
    # TPOT spreads the 3 gaps over 7 tokens after the first.
    assert multi.metrics.latency["tpot"].mean_ms < multi.metrics.latency["itl"].mean_ms
    nousage = await run_benchmark(cfg_for(base_url, "nousage", random_output_len=5, num_prompts=3))
    assert nousage.metrics.output_lens == [5, 5, 5]  # falls back to content chunks


async def test_server_errors_counted(server: tuple[FakeServer, str]) -> None:
    _, base_url = server
    result = await run_benchmark(cfg_for(base_url, "fail3", num_prompts=9, max_concurrency=3))
    m = result.metrics
    assert (m.completed, m.failed) == (6, 3)
    errors = [o.error for o in result.outputs if o.error]
    assert len(errors) == 3 and all(e.startswith("HTTP 500") and "boom" in e for e in errors)
    assert sorted(m.output_lens).count(0) == 3
    assert m.total_output_tokens == 6 * 6


async def test_unreachable_server_fails_every_request() -> None:
    cfg = BenchConfig(
        base_url=f"http://127.0.0.1:{free_port()}",
        model="m",
        random_input_len=4,
        random_output_len=2,
        num_prompts=3,
        show_progress=False,
        timeout_s=5.0,
    )
    result = await run_benchmark(cfg)
    assert (result.metrics.completed, result.metrics.failed) == (0, 3)
    assert all("Connect" in o.error for o in result.outputs)
    assert result.metrics.latency["ttft"].mean_ms == 0.0


async def test_poisson_send_times_follow_schedule(server: tuple[FakeServer, str]) -> None:
    """Checked by order and by causality, not by lateness (a loaded host may be late)."""
    _, base_url = server
    cfg = cfg_for(base_url, "ok", num_prompts=20, random_output_len=2, max_concurrency=None, request_rate_per_s=40.0)
    result = await run_benchmark(cfg)
    expected_s = arrival_offsets_s(20, 40.0, 1.0, cfg.seed)
    assert expected_s[-1] > 0.2  # the seeded schedule spreads the 20 arrivals out
    assert result.metrics.completed == 20
    starts_s = [o.start_s for o in result.outputs]
    assert starts_s == sorted(starts_s)  # sent in the schedule's order
    # Never early: the run cannot end before the last arrival's time plus its answer.
    last = result.outputs[-1]
    assert last.latency_s >= TTFT_SLEEP_S + ITL_SLEEP_S
    assert result.metrics.duration_s >= expected_s[-1] + last.latency_s
    assert result.to_dict()["request_rate"] == 40.0


def test_arrival_statistics() -> None:
    offsets_s = arrival_offsets_s(4000, 50.0, 1.0, seed=7)
    gaps_s = np.diff(offsets_s)
    assert offsets_s[0] == 0.0 and np.all(gaps_s > 0)
    assert abs(gaps_s.mean() - 1 / 50) < 0.05 / 50  # mean gap 1/rate within 5%
    assert abs(gaps_s.std() / gaps_s.mean() - 1.0) < 0.06  # exponential: CV = 1
    assert np.array_equal(offsets_s, arrival_offsets_s(4000, 50.0, 1.0, seed=7))  # seeded
    smooth_s = np.diff(arrival_offsets_s(4000, 50.0, 4.0, seed=7))  # gamma(4): CV = 1/2
    assert abs(smooth_s.std() / smooth_s.mean() - 0.5) < 0.05
    assert np.all(arrival_offsets_s(5, math.inf, 1.0, seed=0) == 0.0)


# ---------------------------------------------------------------- metric math on hand-made records


def record(ttft_s: float, latency_s: float, tokens: int, itls_s: list[float], prompt_len: int = 10) -> RequestOutput:
    return RequestOutput(
        prompt_len=prompt_len, output_tokens=tokens, ttft_s=ttft_s, itls_s=itls_s, latency_s=latency_s, success=True
    )


def test_metric_math() -> None:
    outputs = [
        record(0.1, 1.0, 10, [0.1] * 9),  # tpot (1.0-0.1)/9 = 100 ms
        record(0.2, 0.6, 5, [0.1] * 4),  # tpot 0.4/4 = 100 ms
        record(0.3, 0.3, 1, []),  # one token: no tpot
        record(0.4, 2.4, 11, [0.2] * 10),  # tpot 2.0/10 = 200 ms
        RequestOutput(prompt_len=99, error="HTTP 500: x"),
    ]
    m = compute_metrics(
        outputs, duration_s=2.0, percentiles=(50.0, 99.0, 99.9), goodput_slos_ms={"ttft": 250, "tpot": 150}
    )
    assert (m.completed, m.failed) == (4, 1)
    assert m.total_input_tokens == 40  # failed request's prompt not counted
    assert m.output_lens == [10, 5, 1, 11, 0] and m.total_output_tokens == 27
    assert m.request_throughput == 2.0 and m.output_throughput == 13.5 and m.total_token_throughput == 33.5
    ttft = m.latency["ttft"]
    assert ttft.mean_ms == pytest.approx(250.0) and ttft.median_ms == pytest.approx(250.0)
    assert ttft.std_ms == pytest.approx(math.sqrt((150**2 + 50**2 + 50**2 + 150**2) / 4))
    assert ttft.percentiles_ms[99.0] == pytest.approx(300 + 0.97 * 100)  # linear interpolation
    assert ttft.percentiles_ms[50.0] == pytest.approx(250.0)
    tpot = m.latency["tpot"]
    assert tpot.mean_ms == pytest.approx(400 / 3) and tpot.median_ms == pytest.approx(100.0)
    itl = m.latency["itl"]  # pooled over requests: 13 gaps of 100 ms, 10 of 200 ms
    assert itl.mean_ms == pytest.approx((13 * 100 + 10 * 200) / 23) and itl.median_ms == pytest.approx(100.0)
    assert m.latency["e2el"].mean_ms == pytest.approx(1075.0)
    # Good: ttft <= 250 ms and tpot <= 150 ms -> requests 1 and 2 (request 3 misses ttft, 4 both).
    assert m.request_goodput == pytest.approx(2 / 2.0)


async def test_result_json_field_names(server: tuple[FakeServer, str], tmp_path: Path) -> None:
    _, base_url = server
    result = await run_benchmark(
        cfg_for(base_url, "ok", num_prompts=2, percentiles=(90.0, 99.9), goodput_slos_ms={"e2el": 10_000}, label="t")
    )
    data = json.loads(result.to_json())
    expected = {
        "date",
        "endpoint_type",
        "backend",
        "label",
        "model_id",
        "tokenizer_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "generated_texts",
        "errors",
    }
    for name in ("ttft", "tpot", "itl", "e2el"):
        expected |= {f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", f"p90_{name}_ms", f"p99.9_{name}_ms"}
    assert expected <= set(data)
    assert data["request_rate"] == "inf" and data["max_concurrency"] == 4 and data["backend"] == "openai"
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert len(data["itls"]) == 2 and data["errors"] == ["", ""]
    path = result.save(tmp_path)
    assert path.name.startswith("t-infqps-concurrency4-tiny-model-") and json.loads(path.read_text()) == data


def test_cli_writes_result(server: tuple[FakeServer, str], tmp_path: Path) -> None:
    _, base_url = server
    argv = expand_multi_value_args(
        [
            "--base-url",
            f"{base_url}/ok",
            "--num-prompts",
            "3",
            "--random-input-len",
            "8",
            "--random-output-len",
            "3",
            "--max-concurrency",
            "2",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "r.json",
            "--no-progress",
            "--goodput",
            "ttft:5000",
            "tpot:1000",
            "--percentiles",
            "50,99",
        ]
    )
    assert argv.count("--goodput") == 2
    outcome = CliRunner().invoke(cli_app, argv)
    assert outcome.exit_code == 0, outcome.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["completed"] == 3 and data["total_output_tokens"] == 9 and "p50_ttft_ms" in data
    # Every request is well inside ttft 5 s and tpot 1 s: all of them are good.
    assert data["request_goodput"] == pytest.approx(data["request_throughput"]) and data["request_throughput"] > 0
    assert parse_goodput(["ttft:500,e2el:1e4"]) == {"ttft": 500.0, "e2el": 10000.0}


# ---------------------------------------------------------------- dataset


class WordTokenizer:
    """Tokens are words; some words contain a space, so decode -> encode does not round-trip."""

    def __init__(self) -> None:
        self.all_special_ids = [0]
        singles = [f"w{i}" for i in range(60)]
        self.vocab = ["<s>", *singles, *(f"{a} {b}" for a, b in zip(singles[::5], singles[1::5], strict=False))]
        self.ids = {w: i for i, w in enumerate(self.vocab)}

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.ids[w] for w in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(self.vocab[i] for i in token_ids)


def test_random_dataset_lengths() -> None:
    tok = WordTokenizer()
    reqs = sample_random_requests(num_prompts=50, input_len=20, output_len=10, range_ratio=0.5, seed=3, tokenizer=tok)
    for r in reqs:
        assert isinstance(r.prompt, str) and 10 <= r.prompt_len <= 30 and 5 <= r.expected_output_len <= 15
        assert len(tok.encode(r.prompt)) == r.prompt_len  # recorded length is the real one
        assert "<s>" not in r.prompt.split()  # no special tokens
    assert sum(r.prompt_len == 20 for r in reqs) >= 1
    exact = sample_random_requests(num_prompts=20, input_len=25, output_len=4, range_ratio=0.0, seed=4, tokenizer=tok)
    assert all(r.prompt_len == 25 for r in exact)  # trimming/extending reaches the target
    assert len({r.prompt_len for r in reqs}) > 5  # range ratio spreads lengths
    ids = sample_random_requests(num_prompts=4, input_len=7, output_len=3, range_ratio=0.0, seed=3)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 7 == r.prompt_len for r in ids)
    assert all(1000 <= t < 32000 for r in ids for t in r.prompt if isinstance(t, int))
    again = sample_random_requests(num_prompts=4, input_len=7, output_len=3, range_ratio=0.0, seed=3)
    assert [r.prompt for r in ids] == [r.prompt for r in again]


async def test_chat_endpoint(server: tuple[FakeServer, str]) -> None:
    fake, base_url = server
    cfg = cfg_for(base_url, "chat", endpoint=CHAT_ENDPOINT, random_input_len=12, num_prompts=4, random_output_len=3)
    with pytest.raises(ValueError, match="tokenizer"):
        await run_benchmark(cfg)  # chat messages must be text
    result = await run_benchmark(cfg, tokenizer=WordTokenizer())
    assert result.metrics.completed == 4 and result.metrics.output_lens == [3] * 4
    assert result.to_dict()["endpoint_type"] == "openai-chat"
    assert result.to_dict()["input_lens"] == [12] * 4
    assert all(o.ttft_s >= TTFT_SLEEP_S and len(o.itls_s) == 2 for o in result.outputs)
    content = fake.payloads["chat"][0]["messages"][0]["content"]
    assert isinstance(content, str) and len(content.split()) == 12


@pytest.mark.slow
def test_prompts_with_real_tokenizer(smollm_source) -> None:
    cfg = BenchConfig(tokenizer=str(smollm_source.path), random_input_len=64, random_output_len=4, num_prompts=8)
    requests = build_requests(cfg)
    assert all(isinstance(r.prompt, str) for r in requests)
    assert sum(r.prompt_len == 64 for r in requests) >= 6  # exact nearly always; recorded as sent
    assert all(abs(r.prompt_len - 64) <= 2 for r in requests)


# ---------------------------------------------------------------- sweeps

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk; asserts the file is a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def invoke(args: list[str]) -> None:
    outcome = CliRunner().invoke(cli_app, expand_multi_value_args(args))
    assert outcome.exit_code == 0, outcome.output + repr(outcome.exception)


@pytest.fixture()
def sim_gateway(tmp_path: Path) -> Iterator[str]:
    """URL of a real gateway with one `sim` worker (5 ms steps) behind an embedded Redis."""
    from bench.procs import free_port, start, stop, wait_for_gateway, wait_for_workers
    from shared.embedded_redis import EmbeddedRedis

    log = tmp_path / "procs.log"
    with EmbeddedRedis() as server:
        worker = start("worker", server.url, "--backend", "sim", "--sim-step-time-ms", "5", "--worker-id", "sim-1",
                       log_path=log)
        port = free_port()
        gateway = start("gateway", server.url, "--port", str(port), "--log-level", "warning", log_path=log)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_workers(server.url, 1, [worker], timeout_s=60)
            wait_for_gateway(url, gateway, timeout_s=60)
            yield url
        finally:
            stop(gateway)  # after serving SSE streams it exits -15 on SIGTERM (clean shutdown, then re-raised)
            assert stop(worker) == 0, log.read_text()[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_concurrency_sweep_against_sim_server(sim_gateway: str, tmp_path: Path) -> None:
    num_prompts, output_len = 6, 5
    invoke(["--base-url", sim_gateway, "--concurrency", "1,4", "--num-prompts", str(num_prompts),
            "--random-input-len", "8", "--random-output-len", str(output_len), "--ignore-eos", "--no-progress",
            "--goodput", "ttft:10000", "tpot:5000", "--percentiles", "50,99", "--result-dir", str(tmp_path),
            "--label", "t"])
    out_dir = tmp_path / "t-concurrency"
    summary = json.loads((out_dir / "sweep.json").read_text())
    assert summary["sweep_axis"] == "max_concurrency" and summary["sweep_values"] == ["1", "4"]
    assert summary["goodput_slos_ms"] == {"ttft": 10000.0, "tpot": 5000.0} and summary["request_rate"] == "inf"
    for value, row in zip((1, 4), summary["points"], strict=True):
        point = json.loads((out_dir / f"concurrency-{value}.json").read_text())
        assert row["result_file"] == f"concurrency-{value}.json" and row["sweep_value"] == str(value)
        assert point["max_concurrency"] == value == row["max_concurrency"]
        assert (point["completed"], point["failed"]) == (num_prompts, 0), point["errors"]
        assert point["output_lens"] == [output_len] * num_prompts  # ignore_eos: every request runs to max_tokens
        assert point["total_output_tokens"] == num_prompts * output_len == row["total_output_tokens"]
        assert point["total_input_tokens"] == num_prompts * 8 and len(point["ttfts"]) == num_prompts
        assert all(0 < t < point["duration"] for t in point["ttfts"])
        assert all(len(gaps) <= output_len - 1 for gaps in point["itls"])
        assert row["output_throughput"] == pytest.approx(num_prompts * output_len / point["duration"])
        assert row["request_goodput"] == pytest.approx(row["request_throughput"])  # generous SLO: all good
        assert {"p50_ttft_ms", "p99_itl_ms", "mean_tpot_ms"} <= set(row) and "ttfts" not in row
    assert summary["plots"] == ["throughput.png", "ttft.png", "itl.png", "goodput.png"]
    for name in summary["plots"]:
        width, height = png_size(out_dir / name)
        assert width > 100 and height > 100 and (out_dir / name).stat().st_size > 1000


def test_rate_sweep_writes_points_and_plots(server: tuple[FakeServer, str], tmp_path: Path) -> None:
    _, base_url = server
    invoke(["--base-url", f"{base_url}/ok", "--request-rate", "50,inf", "--num-prompts", "4",
            "--random-input-len", "4", "--random-output-len", "3", "--result-dir", str(tmp_path)])
    out_dir = tmp_path / "sweep-rate"
    summary = json.loads((out_dir / "sweep.json").read_text())
    assert summary["sweep_axis"] == "request_rate" and summary["sweep_values"] == ["50", "inf"]
    assert [row["request_rate"] for row in summary["points"]] == [50.0, "inf"]
    assert all(row["completed"] == 4 and row["request_goodput"] is None for row in summary["points"])
    assert summary["plots"] == ["throughput.png", "ttft.png", "itl.png"]  # no --goodput: no goodput plot
    assert {p.name for p in out_dir.glob("rate-*.json")} == {"rate-50.json", "rate-inf.json"}
    assert all(png_size(out_dir / name)[0] > 0 for name in summary["plots"])


def test_sweep_arguments_rejected() -> None:
    both = CliRunner().invoke(cli_app, ["--concurrency", "1,2", "--request-rate", "1,2"])
    assert both.exit_code != 0 and "not both" in both.output
    fractional = CliRunner().invoke(cli_app, ["--concurrency", "1,2.5"])
    assert fractional.exit_code != 0
    with pytest.raises(AssertionError):
        SweepPlan("request_rate", (1.0, 1.0))


async def test_requests_round_robin_over_base_urls(server: tuple[FakeServer, str]) -> None:
    fake, base_url = server
    cfg = cfg_for(base_url, "rr1", extra_base_urls=(f"{base_url}/rr2",), num_prompts=6, random_output_len=2)
    result = await run_benchmark(cfg)
    assert result.metrics.completed == 6 and (fake.counts["rr1"], fake.counts["rr2"]) == (3, 3)

"""``/metrics`` of a real gateway and a real worker after real requests (SmolLM2 on CPU,
real redis-server): every family exists and the counts match what was sent. Also the
gateway's queue reading (depth, pending, redelivered) against a real Redis."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import exported_names as gateway_names
from gateway.queue_metrics import queue_totals, read_queue
from shared.keys import CONSUMER_GROUP
from tests import processes
from worker.metrics import exported_names as worker_names

MODEL = "SmolLM2-135M-Instruct"
# The same long prompt three times: the second and third find its full blocks cached.
PREFIX = "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly. " * 3
NUM_KV_BLOCKS = 200  # of 16 tokens: room for the 8 short requests, and a count no default gives


@dataclass
class Stack:
    url: str
    worker_metrics_url: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm_source) -> Iterator[Stack]:
    from shared.embedded_redis import EmbeddedRedis

    logs = tmp_path_factory.mktemp("logs")
    server = EmbeddedRedis().start()
    port, metrics_port = processes.free_port(), processes.free_port()
    worker = processes.start("worker", server.url, "--max-num-seqs", "8", "--num-kv-blocks", str(NUM_KV_BLOCKS),
                             "--worker-id", "w-metrics",
                             "--metrics-port", str(metrics_port), log_path=logs / "worker.log")
    gateway = processes.start("gateway", server.url, "--port", str(port), log_path=logs / "gateway.log")
    try:
        url = f"http://127.0.0.1:{port}"
        processes.wait_for_gateway(url, gateway)
        processes.wait_for_workers(server.url, 1, [worker])
        yield Stack(url, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        worker_rc = processes.stop(worker)  # everything stops before the status is judged
        processes.stop(gateway)
        server.close()
        assert worker_rc == 0, (logs / "worker.log").read_text()[-3000:]


def scrape(url: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """Family name (``_total`` kept on counters) -> its samples (name, labels, value)."""
    text = httpx.get(url, timeout=10).text
    families = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        families[name] = [(s.name, s.labels, s.value) for s in family.samples]
    return families


def value(families: dict, family: str, sample: str | None = None, **labels: str) -> float:
    """Sum of the samples named ``sample`` (default: the family) whose labels include ``labels``."""
    sample = sample or family
    return sum(v for name, got, v in families[family] if name == sample and labels.items() <= got.items())


def send_requests(url: str) -> list[dict]:
    """Three completions of one prompt, two chats, one stream; returns each usage."""
    usages = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(3):
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": PREFIX, "max_tokens": 6 + i,
                                                      "temperature": 0})
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        for question in ("What is 2 + 2?", "Name a colour."):
            r = client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 8,
                "temperature": 0})
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        with client.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 8, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        usages.append(chunks[-1]["usage"])
        r = client.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404
    return usages


@pytest.mark.slow
def test_gateway_and_worker_metrics_match_the_requests(stack: Stack) -> None:
    usages = send_requests(stack.url)
    n = len(usages)
    label = {"model_name": MODEL}
    # The queue gauges refresh about once a second: wait for an idle reading.
    deadline = time.monotonic() + 10
    while True:
        gw = scrape(f"{stack.url}/metrics")
        idle = gw.get("inferq:num_pending_entries") and value(gw, "inferq:num_pending_entries", **label) == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.3)

    assert set(gateway_names()) <= set(gw), set(gateway_names()) - set(gw)
    assert value(gw, "inferq:request_success_total", **label) == n
    assert value(gw, "inferq:request_success_total", finished_reason="length") >= 1
    assert value(gw, "inferq:prompt_tokens_total", **label) == sum(u["prompt_tokens"] for u in usages)
    assert value(gw, "inferq:generation_tokens_total", **label) == sum(u["completion_tokens"] for u in usages)
    for histogram in ("inferq:time_to_first_token_seconds", "inferq:e2e_request_latency_seconds"):
        assert value(gw, histogram, f"{histogram}_count", **label) == n
        assert 0 < value(gw, histogram, f"{histogram}_sum", **label) < 120 * n
    tpot = "inferq:time_per_output_token_seconds"
    assert value(gw, tpot, f"{tpot}_count") == sum(1 for u in usages if u["completion_tokens"] > 1)
    itl = "inferq:inter_token_latency_seconds"
    assert 1 <= value(gw, itl, f"{itl}_count") <= sum(u["completion_tokens"] - 1 for u in usages)
    assert value(gw, "inferq:requests_rejected_total", reason="unknown_model") == 1
    assert value(gw, "inferq:request_errors_total") == 0
    assert value(gw, "inferq:failovers_total", **label) == 0
    assert value(gw, "inferq:num_requests_in_flight", **label) == 0
    assert value(gw, "inferq:queue_depth", **label) == 0
    assert value(gw, "inferq:num_pending_entries", **label) == 0
    assert value(gw, "inferq:num_redelivered_entries", **label) == 0
    assert value(gw, "inferq:queue_metrics_errors_total", **label) == 0

    wk = scrape(stack.worker_metrics_url)
    assert set(worker_names()) <= set(wk), set(worker_names()) - set(wk)
    wlabel = {"model_name": MODEL, "worker_id": "w-metrics"}
    assert value(wk, "inferq:num_requests_running", **wlabel) == 0
    assert value(wk, "inferq:num_requests_waiting", **wlabel) == 0
    # Idle: every block is free again (cached prefix blocks count as free) out of the configured pool.
    assert value(wk, "inferq:kv_cache_usage_perc", **wlabel) == 0.0
    assert value(wk, "inferq:kv_cache_num_blocks", **wlabel) == NUM_KV_BLOCKS
    assert value(wk, "inferq:num_preemptions_total", **wlabel) == 0
    queries = value(wk, "inferq:prefix_cache_queries_total", **wlabel)
    hits = value(wk, "inferq:prefix_cache_hits_total", **wlabel)
    assert queries >= sum(u["prompt_tokens"] for u in usages[1:3])  # at least the repeated prompts
    assert 0 < hits <= queries  # the repeated prompt's full blocks were found
    assert value(wk, "inferq:num_reclaimed_total", **wlabel) == 0
    assert value(wk, "inferq:engine_steps_total", **wlabel) >= max(u["completion_tokens"] for u in usages)
    assert value(wk, "inferq:engine_busy_seconds_total", **wlabel) > 0  # the steps took time


async def test_read_queue_counts_queued_pending_and_redelivered(redis_server) -> None:
    import redis.asyncio as aioredis

    from shared.keys import Keys

    client = aioredis.from_url(redis_server.url)
    stream = Keys().requests_stream("m")

    async def read_totals(client, _stream):  # the model's streams, here only the base one
        return queue_totals(await read_queue(client, Keys(), "m"))

    try:
        assert await read_totals(client, stream) == (0, 0, 0)  # no stream, no group
        for i in range(4):
            await client.xadd(stream, {"m": str(i)})
        assert await read_totals(client, stream) == (4, 0, 0)  # no group yet: all queued
        await client.xgroup_create(stream, CONSUMER_GROUP, id="0")
        reply = await client.xreadgroup(CONSUMER_GROUP, "dead", {stream: ">"}, count=2)
        first_id = reply[0][1][0][0]
        assert await read_totals(client, stream) == (2, 2, 0)
        await client.xclaim(stream, CONSUMER_GROUP, "alive", 0, [first_id])  # a reclaim: delivered twice
        assert await read_totals(client, stream) == (2, 2, 1)
    finally:
        await client.aclose()

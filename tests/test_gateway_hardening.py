"""Issue 19's gateway hardening: cheap checks before expensive work (the prompt's character
bound, list limits, strict types), auth that never 500s, /metrics behind the API key, the
request-id pattern matched whole, and prompt encoding that never stalls other streams.

In-process tests use the harness (gateway_harness.py: real Redis, uvicorn, a
FakeWorker) with a tokenizer that counts encodes; the stream-gap test starts a real
gateway and a ``--backend sim`` worker as processes."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import signal
import threading
import time
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from gateway.errors import OpenAIError
from gateway.handlers import make_request_id
from gateway.schemas import MAX_NUM_MESSAGES, MAX_NUM_STOP_TOKEN_IDS, MAX_STOP_STRING_CHARS
from gateway.tokenize import TokenizerWorker, max_token_chars
from shared.settings import GatewaySettings
from tests import processes
from tests.gateway_harness import ANSWER, MODEL

pytestmark = pytest.mark.timeout(120)


class _CountingBackend:
    """A Rust tokenizer that counts encodes (everything else passes through)."""

    def __init__(self, backend: Any, owner: CountingTokenizer) -> None:
        self._backend, self._owner = backend, owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def encode_batch(self, *args: Any, **kwargs: Any) -> Any:
        self._owner.num_encodes += 1
        return self._backend.encode_batch(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self._owner.num_encodes += 1
        return self._backend.encode(*args, **kwargs)


class CountingTokenizer:
    """The real SmolLM2 tokenizer; ``num_encodes`` counts every encode asked of it."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.num_encodes = 0
        self.backend_tokenizer = _CountingBackend(tok.backend_tokenizer, self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __len__(self) -> int:
        return len(self._tok)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.num_encodes += 1
        return self._tok(*args, **kwargs)

    def apply_chat_template(self, *args: Any, tokenize: bool = True, **kwargs: Any) -> Any:
        self.num_encodes += int(tokenize)
        return self._tok.apply_chat_template(*args, tokenize=tokenize, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(source):
    from transformers import AutoTokenizer

    return CountingTokenizer(AutoTokenizer.from_pretrained(source.path))


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


# -- the character bound -------------------------------------------------------------------

def test_character_bound_never_exceeds_the_token_count(tokenizer):
    limit, _ = max_token_chars(tokenizer)
    assert limit == max(len(s) for s in tokenizer.get_vocab())  # byte-level BPE, no normalizer
    longest = max(tokenizer.get_vocab(), key=len)
    rng = random.Random(0)
    texts = [
        tokenizer.convert_tokens_to_string([longest]) * 50,  # the longest token, over and over: tight
        "#" * 10_000, " " * 10_000, "\n" * 5000 + "x",
        "".join(chr(rng.randrange(32, 0x2FFFF)) for _ in range(5000)).encode("utf-8", "replace").decode(),
        "The capital of France is Paris. " * 300, "<|im_start|>user\nhi<|im_end|>" * 100,
    ]
    for text in texts:
        num_tokens = len(tokenizer._tok(text)["input_ids"])
        assert num_tokens >= math.ceil(len(text) / limit), (text[:40], num_tokens)
    tight = len(tokenizer._tok(texts[0])["input_ids"])
    assert tight <= 2 * math.ceil(len(texts[0]) / limit)  # the bound is near the truth, not vacuous


async def test_encode_matches_hugging_face_and_shares_one_tokenizer(tokenizer):
    worker = TokenizerWorker(tokenizer._tok, num_encode_threads=4)
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> 😀"}]
        ref = tokenizer._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if hasattr(ref, "keys") else ref
        assert await worker.chat_prompt(messages, 2048) == list(ref)
        texts = [f"{i} Paris, 日本語 <|endoftext|> " * (200 + i) for i in range(16)]
        # Sixteen encodes at once on four threads sharing one Rust tokenizer: no "Already borrowed".
        got = await asyncio.gather(*(worker.completion_prompt(t, 100_000) for t in texts))
        assert got == [tokenizer._tok(t)["input_ids"] for t in texts]
    finally:
        worker.close()


async def test_huge_prompt_is_refused_without_tokenizing(harness, tokenizer):
    tokenizer.num_encodes = 0
    prompt = "hello " * (4 * 1024**2 // 6 - 20)  # just under the 4 MiB body limit; max_model_len 256
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert "characters" in _error(r, 400, "prompt")["message"]
    r = await harness.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}]})
    assert "characters" in _error(r, 400, "messages")["message"]
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 300})
    _error(r, 400, "prompt")
    assert tokenizer.num_encodes == 0
    assert harness.worker.requests == []
    # Just under the bound, the prompt is tokenized, and its token count decides.
    limit = harness.app.state.inferq.tokenizer.max_token_chars
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (255 * limit)})
    assert "characters" not in _error(r, 400, "prompt")["message"] and tokenizer.num_encodes == 1
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ANSWER


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(tokenize_timeout_s=0.5, num_tokenizer_threads=1)])
async def test_encode_past_its_time_budget_is_503_and_blocks_nobody(harness, tokenizer):
    tokenizer.num_encodes = 0
    release = threading.Event()
    real = tokenizer.backend_tokenizer.encode_batch

    def slow_encode(texts: list[str], **kwargs: Any) -> Any:
        if texts[0].startswith("slow"):
            release.wait(10)
        return real(texts, **kwargs)
    tokenizer.backend_tokenizer.encode_batch = slow_encode
    try:
        r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "slow prompt"})
        assert _error(r, 503, "prompt")["code"] == "tokenize_timeout"
        # The one encode thread is still busy: a queued encode also times out (it is dropped,
        # not run later), while output detokenization has its own thread.
        r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "queued"})
        assert _error(r, 503, "prompt")["code"] == "tokenize_timeout"
        r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3]})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ANSWER
    finally:
        release.set()
        del tokenizer.backend_tokenizer.encode_batch
    await asyncio.sleep(0.2)
    assert tokenizer.num_encodes == 1  # the slow one finished; the queued one never ran
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 200 and tokenizer.num_encodes == 2, r.text


# -- strict types and list limits ----------------------------------------------------------

@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [True, 2]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "16"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "true"}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": "s" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "s" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [1] * (MAX_NUM_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * (MAX_NUM_MESSAGES + 1)},
     "messages"),
])
async def test_bad_types_and_lists_are_400_naming_the_field(harness, path, extra, param):
    r = await harness.http.post(path, json={"model": MODEL, **extra})
    _error(r, 400, param)
    assert harness.worker.requests == []


async def test_limits_themselves_are_allowed(harness):
    stops = ["zz" * (MAX_STOP_STRING_CHARS // 2)] * 3 + ["q"]
    r = await harness.http.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "stop": stops, "stop_token_ids": [7] * MAX_NUM_STOP_TOKEN_IDS,
        "temperature": 1, "stream": False})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ANSWER
    sampling = harness.worker.requests[-1].sampling
    assert sampling.temperature == 1.0 and sampling.top_k == -1 and len(sampling.stop_token_ids) == 256


# -- request ids ---------------------------------------------------------------------------

def _request(headers: list[tuple[bytes, bytes]]) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers})


@pytest.mark.parametrize("value", [b"abc\n", b"abc\r", b"\nabc", b"ab c", b"x" * 129, b"", "é".encode("latin-1"),
                                   "ключ".encode()])
def test_bad_request_id_is_400(value: bytes):
    with pytest.raises(OpenAIError) as info:
        make_request_id(_request([(b"x-request-id", value)]), "cmpl-")
    assert info.value.status == 400 and info.value.param == "X-Request-Id"


def test_good_request_id_is_kept():
    assert make_request_id(_request([(b"x-request-id", b"a.B_9:-" + b"x" * 121)]), "cmpl-") == \
        "cmpl-a.B_9:-" + "x" * 121


async def test_request_id_pattern_is_one_fact(harness):
    doc = (await harness.http.get("/openapi.json")).json()
    [param] = doc["paths"]["/v1/completions"]["post"]["parameters"]
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                                headers={"X-Request-Id": "bad id"})
    assert param["schema"]["pattern"].strip("^$") in _error(r, 400, "X-Request-Id")["message"]


# -- auth ----------------------------------------------------------------------------------

KEYED = [GatewaySettings(api_keys=("k1", "sk-ключ-unused"), request_timeout_s=10.0)]


@pytest.mark.parametrize("gateway_settings", KEYED)
@pytest.mark.parametrize("authorization", [
    "Bearer ключ".encode(), "Bearer k1é".encode(), b"Bearer \xe9\xff", "Bearer sk-ключ-unused".encode(), b"Bearer",
    b"Basic k1", b"bearer\tk1", b"k1", b"Bearer k1 k1", b"Bearer \x7f",
])
async def test_malformed_or_non_ascii_credentials_are_401_never_500(harness, caplog, authorization: bytes):
    caplog.set_level(logging.WARNING)
    headers = {"Authorization": authorization}
    if b"\x7f" in authorization:
        # DEL is no field-value character (RFC 9110, 5.5): uvicorn's httptools parser
        # answers 400 before the app sees the request.
        for r in (await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers),
                  await harness.http.get("/v1/models", headers=headers)):
            assert r.status_code == 400, r.text
        assert harness.worker.requests == []
        return
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
    assert _error(r, 401, None)["code"] == "invalid_api_key"
    for path in ("/v1/models", "/metrics"):
        _error(await harness.http.get(path, headers=headers), 401, None)
    assert [rec for rec in caplog.records if rec.levelno >= logging.ERROR] == []
    assert harness.worker.requests == []


@pytest.mark.parametrize("gateway_settings", KEYED)
async def test_metrics_need_the_key_health_does_not(harness):
    _error(await harness.http.get("/metrics"), 401, None)
    r = await harness.http.get("/metrics", headers={"Authorization": "Bearer k1"})
    assert r.status_code == 200 and "inferq:requests_rejected_total" in r.text
    assert (await harness.http.get("/health")).status_code == 200
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                                headers={"Authorization": "Bearer  k1"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ANSWER


# -- no head-of-line blocking: real processes ----------------------------------------------

#: The issue's bound on the largest gap between a stream's chunks while big prompts arrive.
MAX_GAP_S = 0.25


def _post_big_prompts(url: str, bodies: list[bytes], answers: list[httpx.Response]) -> None:
    with httpx.Client(timeout=60, trust_env=False) as client:
        for body in bodies:
            answers.append(client.post(f"{url}/v1/completions", content=body,
                                       headers={"Content-Type": "application/json"}))


@pytest.mark.slow
def test_big_prompts_do_not_stall_a_running_stream(tmp_path, smollm_tokenizer):
    from shared.embedded_redis import EmbeddedRedis

    max_model_len = 8192  # the model's own limit
    server = EmbeddedRedis().start()
    worker = gateway = None
    try:
        worker = processes.start("worker", server.url, "--backend", "sim", "--sim-step-time-ms", "5",
                                 "--worker-id", "sim-0", "--max-model-len", str(max_model_len),
                                 log_path=tmp_path / "worker.log")
        port = processes.free_port()
        # One encode thread, so the prompts below queue behind each other; a budget that a
        # loaded CI host cannot overrun, so each is refused for its length, not its time.
        gateway = processes.start("gateway", server.url, "--port", str(port), "--max-model-len", str(max_model_len),
                                  "--num-tokenizer-threads", "1", "--tokenize-timeout-s", "120",
                                  log_path=tmp_path / "gateway.log")
        url = f"http://127.0.0.1:{port}"
        processes.wait_for_gateway(url, gateway)
        processes.wait_for_workers(server.url, 1, [worker])
        # Several MB each, just under the body limit, refused by the character bound ...
        huge = [json.dumps({"model": MODEL, "prompt": "hello " * (4 * 1024**2 // 6 - 20)}).encode()] * 3
        # ... and just under the bound: tokenized (seconds each, over a million tokens), then
        # refused by their token count.
        max_chars = (max_model_len - 1) * max_token_chars(smollm_tokenizer)[0]
        text = "日本語のテキスト" * (max_chars // 8)
        tokenized = [json.dumps({"model": MODEL, "prompt": text}, ensure_ascii=False).encode()] * 2
        gaps_s, answers = asyncio.run(_stream_while_posting(url, huge + tokenized, max_model_len - 16))
    finally:
        for proc in (gateway, worker):
            if proc is not None:
                processes.stop(proc, signal.SIGKILL)
        server.close()
    assert len(answers) == 5 and all(a.status_code == 400 for a in answers), [a.text[:200] for a in answers]
    messages = [a.json()["error"]["message"] for a in answers]
    assert all("characters" in m for m in messages[:3]), messages
    assert all("tokens;" in m and "characters" not in m for m in messages[3:]), messages
    print("GAPS", len(gaps_s), sorted(gaps_s)[-5:])
    assert max(gaps_s) < MAX_GAP_S, f"largest gap {max(gaps_s):.3f} s over {len(gaps_s)} chunks"


async def _stream_while_posting(url: str, bodies: list[bytes],
                                max_tokens: int) -> tuple[list[float], list[httpx.Response]]:
    """Stream one long completion; once its first chunk is in, post ``bodies`` from a
    thread. Returns the gaps between chunks while the posts ran, and their answers."""
    answers: list[httpx.Response] = []
    gaps_s: list[float] = []
    poster: threading.Thread | None = None
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client, \
            client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        last_s = None
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            now_s = time.monotonic()
            if poster is None:
                poster = threading.Thread(target=_post_big_prompts, args=(url, bodies, answers))
                poster.start()
            elif poster.is_alive():
                gaps_s.append(now_s - last_s)
            else:
                break  # every post answered while the stream ran
            last_s = now_s
    assert poster is not None
    poster.join(60)
    assert not poster.is_alive() and gaps_s
    return gaps_s, answers

"""Text Generation Inference's routes (gateway/tgi.py) and ``POST /v1/generate``
(gateway/generate_api.py) at the gateway: the gateway under uvicorn with the fake worker
and a real Redis (fixtures: gateway_harness.py), so the request each route puts on
the queue can be read back. The parameters' mapping onto ``SamplingParams``, TGI's
answers and error bodies, and the completions pipeline applying to them: auth, priority
classes, rate limits, queue limits, stop strings, metrics. The same routes on the real
model through ``huggingface_hub``: tests/test_tgi_e2e.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from schemathesis import GenerationMode

from gateway.tgi_schemas import TgiInfo
from shared import protocol
from shared.protocol import GenerateRequest, TokenBatch, TokenLogprobs, TokenOutput
from shared.settings import GatewaySettings
from tests.gateway_harness import ANSWER, MODEL, FakeWorker, sse_events
from tests.test_gateway_fuzz import _schema as openapi_schema
from tests.test_gateway_fuzz import fuzz

pytestmark = pytest.mark.timeout(90)

PROMPT = "The capital of France:"
#: The harness's ``--max-model-len``.
MAX_MODEL_LEN = 256


def tgi(inputs: str = PROMPT, **parameters: object) -> dict[str, object]:
    return {"inputs": inputs, "parameters": parameters}


def answer_ids(tokenizer) -> list[int]:
    """What the fake worker sends: the answer's tokens, then EOS."""
    return [*tokenizer.encode(ANSWER, add_special_tokens=False), tokenizer.eos_token_id]


def check_tgi_error(r, status: int, error_type: str, names: str | None = None) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type, body
    if names is not None:
        assert names in body["error"], body
    return body["error"]


# -- TGI: answers ---------------------------------------------------------------------------

async def test_generate_is_greedy_unless_it_samples_and_fills_the_context_by_default(harness, tokenizer):
    http, worker = harness.http, harness.worker
    r = await http.post("/generate", json=tgi(max_new_tokens=20))
    assert r.status_code == 200, r.text
    assert r.json() == {"generated_text": ANSWER}  # no details unless asked; no prompt unless asked
    num_prompt = len(tokenizer(PROMPT)["input_ids"])
    assert r.headers["x-prompt-tokens"] == str(num_prompt)
    assert r.headers["x-generated-tokens"] == str(len(answer_ids(tokenizer)))
    req = worker.requests[-1]
    assert req.request_id.startswith("tgi-") and req.request_id == r.headers["x-request-id"]
    assert req.prompt_token_ids == tokenizer(PROMPT)["input_ids"]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.seed, s.logprobs, s.prompt_logprobs) == (20, 0.0, None, None, None)
    # Without max_new_tokens the output may fill the context, as TGI's does.
    r = await http.post("/generate", json=tgi(seed=5))
    assert r.status_code == 200, r.text
    s = worker.requests[-1].sampling
    assert s.max_tokens == MAX_MODEL_LEN - num_prompt and s.temperature == 0.0 and s.seed is None  # greedy: no seed
    # A sampling parameter makes it sample (TGI's rule); every one maps over.
    r = await http.post("/generate", json=tgi(top_k=5, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.5,
                                              seed=7, stop=["never"], max_new_tokens=9))
    assert r.status_code == 200, r.text
    s = worker.requests[-1].sampling
    assert (s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.frequency_penalty, s.seed, s.max_tokens) == (
        1.0, 5, 0.9, 1.1, 0.5, 7, 9)
    r = await http.post("/generate", json=tgi(do_sample=True, temperature=0.5, typical_p=1.0))
    assert r.status_code == 200, r.text
    assert worker.requests[-1].sampling.temperature == 0.5
    # A body without parameters samples, as TGI's default parameters do.
    r = await http.post("/generate", json={"inputs": PROMPT})
    assert r.status_code == 200, r.text
    assert worker.requests[-1].sampling.temperature == 1.0


def logprob_of(token_id: int) -> float:
    """The logprob ``answer_with_logprobs`` gives a token (made up, but one per id)."""
    return -token_id / 100_000


async def answer_with_logprobs(req: GenerateRequest, w: FakeWorker) -> None:
    """The fake worker's answer with logprobs when asked (as a real worker sends them):
    each token's and its ``logprobs`` top alternatives (the token, then token id 1),
    and the prompt's on the first entry."""
    ids = answer_ids(w.tok)
    num_top = req.sampling.logprobs
    for i, t in enumerate(ids):
        logprobs = None if num_top is None else [
            TokenLogprobs(logprob_of(t), [(t, logprob_of(t)), (1, -9.0)][:num_top])]
        prompt = None
        if i == 0 and req.sampling.prompt_logprobs is not None:
            prompt = [TokenLogprobs(logprob_of(p)) for p in req.prompt_token_ids[1:]]
        out = TokenOutput(request_id=req.request_id, attempt=req.attempt, first_index=i, token_ids=[t],
                          finish_reason="stop" if i == len(ids) - 1 else None,
                          num_prompt_tokens=len(req.prompt_token_ids), logprobs=logprobs, prompt_logprobs=prompt)
        await w.client.publish(req.reply_channel, protocol.encode(TokenBatch(worker_id="w1", outputs=[out])))


async def test_generate_details_tokens_seed_and_prefill(harness, tokenizer):
    http, worker = harness.http, harness.worker
    worker.behavior = answer_with_logprobs
    r = await http.post("/generate", json=tgi(max_new_tokens=20, do_sample=True, details=True, top_n_tokens=2,
                                              decoder_input_details=True))
    assert r.status_code == 200, r.text
    body = r.json()
    s = worker.requests[-1].sampling
    assert s.logprobs == 2 and s.prompt_logprobs == 0  # details ask the worker for logprobs
    assert s.seed is not None and body["details"]["seed"] == s.seed  # a sampled request reports its seed
    details = body["details"]
    ids = answer_ids(tokenizer)
    assert details["finish_reason"] == "eos_token" and details["generated_tokens"] == len(ids)
    tokens = details["tokens"]
    assert [t["id"] for t in tokens] == ids
    assert [t["logprob"] for t in tokens] == [logprob_of(t) for t in ids]
    texts = [t["text"] for t in tokens]
    assert "".join(texts) == body["generated_text"] == ANSWER
    assert texts == [tokenizer.decode([t]) for t in ids[:-1]] + [""]  # each its own; EOS adds no text
    assert [t["special"] for t in tokens] == [False] * (len(ids) - 1) + [True]
    assert [[top["id"] for top in tops] for tops in details["top_tokens"]] == [[t, 1] for t in ids]
    assert details["top_tokens"][0][1] == {"id": 1, "text": tokenizer.decode([1]), "logprob": -9.0, "special": True}
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    prefill = details["prefill"]
    assert [p["id"] for p in prefill] == prompt_ids and "".join(p["text"] for p in prefill) == PROMPT
    assert [p["logprob"] for p in prefill] == [None] + [logprob_of(p) for p in prompt_ids[1:]]
    # Greedy: no seed, and none sent; prefill and top tokens only when asked.
    r = await http.post("/generate", json=tgi(max_new_tokens=20, details=True))
    assert r.json()["details"]["seed"] is None and worker.requests[-1].sampling.seed is None
    assert r.json()["details"]["prefill"] == [] and "top_tokens" not in r.json()["details"]


async def test_tokens_without_logprobs_from_the_worker(harness, tokenizer):
    """A worker that sends no logprobs (the fake one does not): the ids still come (from
    the output the pipeline consumed), logprobs are null, and the text of tokens that
    arrived together goes with the last one that is not special."""
    r = await harness.http.post("/generate", json=tgi(max_new_tokens=20, details=True))
    assert r.status_code == 200, r.text
    tokens = r.json()["details"]["tokens"]
    assert [t["id"] for t in tokens] == answer_ids(tokenizer)
    assert all(t["logprob"] is None for t in tokens)
    assert [t["text"] for t in tokens] == [""] * (len(tokens) - 2) + [ANSWER, ""]


async def test_a_stop_sequence_ends_the_text_with_it(harness):
    r = await harness.http.post("/generate", json=tgi(max_new_tokens=20, stop=["capital"], details=True))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["generated_text"] == " Paris is the capital"  # TGI keeps the stop sequence
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert "".join(t["text"] for t in body["details"]["tokens"]) == body["generated_text"]
    await harness.worker.wait_for_abort(harness.worker.requests[-1].request_id)  # the pipeline's stop strings


async def test_generate_stream_events(harness, tokenizer):
    r = await harness.http.post("/generate_stream", json=tgi(max_new_tokens=20, details=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = [json.loads(e) for e in sse_events(r.text)]  # TGI sends no [DONE]
    ids = answer_ids(tokenizer)
    assert [e["index"] for e in events] == list(range(1, len(ids) + 1))
    assert [e["token"]["id"] for e in events] == ids
    assert "".join(e["token"]["text"] for e in events) == ANSWER
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    num_prompt = len(tokenizer(PROMPT)["input_ids"])
    assert events[-1]["generated_text"] == ANSWER
    assert events[-1]["details"] == {"finish_reason": "eos_token", "generated_tokens": len(ids), "seed": None,
                                     "input_length": num_prompt}
    assert events[-1]["token"]["special"] is True
    # With the worker's logprobs: each token's, and its top tokens.
    harness.worker.behavior = answer_with_logprobs
    r = await harness.http.post("/generate_stream", json=tgi(max_new_tokens=20, details=True, top_n_tokens=1))
    events = [json.loads(e) for e in sse_events(r.text)]
    assert [e["token"]["logprob"] for e in events] == [logprob_of(t) for t in ids]
    assert [e["top_tokens"] for e in events] == [[{**e["token"], "text": tokenizer.decode([e["token"]["id"]])}]
                                                 for e in events]
    assert [e["token"]["text"] for e in events] == [tokenizer.decode([t]) for t in ids[:-1]] + [""]
    # Without details: no details, no logprobs asked.
    r = await harness.http.post("/generate_stream", json=tgi(max_new_tokens=20, return_full_text=True))
    events = [json.loads(e) for e in sse_events(r.text)]
    assert events[-1]["details"] is None and events[-1]["generated_text"] == PROMPT + ANSWER
    assert harness.worker.requests[-1].sampling.logprobs is None


async def test_the_compat_route_answers_a_list_or_a_stream_with_the_prompt(harness):
    r = await harness.http.post("/", json=tgi(max_new_tokens=20))
    assert r.status_code == 200, r.text
    assert r.json() == [{"generated_text": PROMPT + ANSWER}]  # TGI's default there: the full text
    r = await harness.http.post("/", json=tgi(max_new_tokens=20, return_full_text=False))
    assert r.json() == [{"generated_text": ANSWER}]
    r = await harness.http.post("/", json={**tgi(max_new_tokens=20, return_full_text=False), "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e) for e in sse_events(r.text)]
    assert events[-1]["generated_text"] == ANSWER


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(request_timeout_s=1.0)])
async def test_a_failure_once_a_stream_runs_is_its_last_event(harness, tokenizer):
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)

    async def stall(req: GenerateRequest, w: FakeWorker) -> None:
        await w.send(req, 0, ids[:2])  # then nothing: the request's deadline passes

    harness.worker.behavior = stall
    r = await harness.http.post("/generate_stream", json=tgi(max_new_tokens=20))
    assert r.status_code == 200, r.text
    events = [json.loads(e) for e in sse_events(r.text)]
    assert [e["token"]["id"] for e in events[:-1]] == ids[:2]
    assert set(events[-1]) == {"error", "error_type"} and events[-1]["error_type"] == "timeout", events[-1]
    check_tgi_error(await harness.http.post("/generate", json=tgi(max_new_tokens=20)), 504, "timeout", "deadline")


async def test_info(harness):
    r = await harness.http.get("/info")
    assert r.status_code == 200, r.text
    info = TgiInfo.model_validate(r.json()).model_dump()
    assert set(info) == set(r.json())
    assert info["model_id"] == MODEL and info["max_total_tokens"] == MAX_MODEL_LEN
    assert info["max_input_tokens"] == info["max_input_length"] == MAX_MODEL_LEN - 1
    assert info["max_stop_sequences"] == 4 and info["max_best_of"] == 1 and info["router"] == "inferq"


# -- TGI: refusals ------------------------------------------------------------------------

@pytest.mark.parametrize("body,names", [
    (tgi(typical_p=0.5), "typical_p"),
    (tgi(watermark=True), "watermark"),
    (tgi(truncate=10), "truncate"),
    (tgi(best_of=2, do_sample=True), "best_of"),
    (tgi(adapter_id="lora-1"), "adapter_id"),
    (tgi(temperature=0), "temperature"),
    (tgi(temperature=3.0), "temperature"),  # inferq's range is [0, 2]
    (tgi(top_k=0), "top_k"),
    (tgi(top_p=1.5), "top_p"),
    (tgi(max_new_tokens=0), "max_new_tokens"),
    (tgi(max_new_tokens=10**6), "max_new_tokens"),  # past the context
    (tgi(top_n_tokens=6, details=True), "top_n_tokens"),
    (tgi(seed=-1), "seed"),
    (tgi(max_new_tokens="8"), "max_new_tokens"),  # strict types
    (tgi(stop=["a", "b", "c", "d", "e"]), "stop"),
    (tgi(grammar={"type": "regex", "value": 5}), "grammar"),
    (tgi(grammar={"type": "regex", "value": "("}), "grammar"),
    (tgi(grammar={"type": "xml", "value": "x"}), "grammar"),
    (tgi(inputs=""), "inputs"),
    (tgi(inputs="hi " * 2000), "inputs"),  # past the context
    ({"parameters": {}}, "inputs"),
])
async def test_bad_parameters_are_tgi_422s_and_queue_nothing(harness, body, names):
    before = len(harness.worker.requests)
    check_tgi_error(await harness.http.post("/generate", json=body), 422, "validation", names)
    assert len(harness.worker.requests) == before


async def test_refusals_of_every_tgi_route(harness):
    http = harness.http
    check_tgi_error(await http.post("/generate", content=b"{not json"), 422, "validation")
    check_tgi_error(await http.post("/generate_stream", json=tgi(decoder_input_details=True)), 422, "validation",
                    "decoder_input_details")
    check_tgi_error(await http.post("/", json={**tgi(), "stream": "yes"}), 422, "validation", "stream")
    check_tgi_error(await http.post("/generate", json=tgi(), headers={"X-Request-Id": "bad id"}), 422,
                    "validation", "X-Request-Id")


async def test_a_grammar_reaches_the_worker(harness):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for grammar in ({"type": "json", "value": schema}, {"type": "json", "value": json.dumps(schema)},
                    {"type": "json_schema", "value": {"name": "a", "schema": schema}}):
        r = await harness.http.post("/generate", json=tgi(max_new_tokens=8, grammar=grammar))
        assert r.status_code == 200, r.text
        structured = harness.worker.requests[-1].sampling.structured
        assert structured is not None and structured.kind == "json_schema" and json.loads(structured.spec) == schema
    r = await harness.http.post("/generate", json=tgi(max_new_tokens=8, grammar={"type": "regex", "value": "[a-z]+"}))
    assert r.status_code == 200, r.text
    assert harness.worker.requests[-1].sampling.structured.kind == "regex"


# -- /v1/generate ---------------------------------------------------------------------------

async def test_v1_generate(harness, tokenizer):
    r = await harness.http.post("/v1/generate", json={"prompt": PROMPT, "max_new_tokens": 20, "temperature": 0,
                                                       "top_p": 0.5, "stop": ["never"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"request_id", "text", "generated_tokens", "latency_ms", "finish_reason", "model"}
    assert body["text"] == ANSWER and body["finish_reason"] == "stop" and body["model"] == MODEL
    assert body["generated_tokens"] == len(answer_ids(tokenizer))
    assert body["latency_ms"] > 0 and body["request_id"].startswith("gen-")
    req = harness.worker.requests[-1]
    assert req.request_id == body["request_id"] == r.headers["x-request-id"]
    assert (req.sampling.max_tokens, req.sampling.temperature, req.sampling.top_p) == (20, 0.0, 0.5)
    r = await harness.http.post("/v1/generate", json={"prompt": PROMPT, "model": MODEL})
    assert r.status_code == 200, r.text
    assert harness.worker.requests[-1].sampling.max_tokens == 64  # the default


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": 5}, 400, "prompt"),
    ({"max_new_tokens": 5}, 400, "prompt"),
    ({"prompt": "x", "max_new_tokens": 0}, 400, "max_new_tokens"),
    ({"prompt": "x", "max_new_tokens": 10**6}, 400, "max_new_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "stream": True}, 400, "stream"),
    ({"prompt": "x", "model": "no-such-model"}, 404, "model"),
])
async def test_v1_generate_errors_are_openai_errors(harness, body, status, param):
    before = len(harness.worker.requests)
    r = await harness.http.post("/v1/generate", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] in ("invalid_request_error", "not_found_error"), error
    assert len(harness.worker.requests) == before


# -- the pipeline's policies apply ----------------------------------------------------------

@pytest.mark.parametrize("gateway_settings", [GatewaySettings(api_keys=("sk-a",), request_timeout_s=10.0)])
async def test_keys_are_required_on_every_route(harness):
    http, key = harness.http, {"Authorization": "Bearer sk-a"}
    calls = [("POST", "/generate", tgi(max_new_tokens=4)), ("POST", "/generate_stream", tgi(max_new_tokens=4)),
             ("POST", "/", tgi(max_new_tokens=4)), ("GET", "/info", None)]
    before = len(harness.worker.requests)
    for method, path, body in calls:
        check_tgi_error(await http.request(method, path, json=body), 401, "authentication")
        check_tgi_error(await http.request(method, path, json=body, headers={"Authorization": "Bearer sk-b"}), 401,
                        "authentication")
    r = await http.post("/v1/generate", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert len(harness.worker.requests) == before
    for method, path, body in calls:
        r = await http.request(method, path, json=body, headers=key)
        assert r.status_code == 200, (path, r.text)
    assert (await http.post("/v1/generate", json={"prompt": "x"}, headers=key)).status_code == 200


async def test_priority_classes_apply(harness):
    http, worker = harness.http, harness.worker
    cases = [("/generate", tgi(max_new_tokens=4), {"X-Priority": "batch"}, 2),
             ("/generate_stream", tgi(max_new_tokens=4), {"X-Priority": "interactive"}, 0),
             ("/", tgi(max_new_tokens=4), {}, 1),
             ("/v1/generate", {"prompt": "x", "priority": -1}, {}, 0),
             ("/v1/generate", {"prompt": "x", "priority": -1}, {"X-Priority": "batch"}, 2)]
    for path, body, headers, rank in cases:
        r = await http.post(path, json=body, headers={**headers, "Authorization": "Bearer key-p"})
        assert r.status_code == 200, r.text
        assert worker.requests[-1].priority == rank, (path, headers)
    tenant = harness.app.state.inferq.tenants.key_tenant("key-p")
    text = harness.metrics()
    for cls, count in (("batch", 2), ("interactive", 2), ("default", 1)):
        assert (f'inferq:class_admitted_total{{model_name="{MODEL}",priority_class="{cls}",tenant="{tenant}"}} '
                f'{count}.0') in text
    check_tgi_error(await http.post("/generate", json=tgi(), headers={"X-Priority": "urgent"}), 422, "validation",
                    "X-Priority")


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(rate_limit_rpm=2, request_timeout_s=10.0)])
async def test_rate_limits_apply(harness):
    http, key = harness.http, {"Authorization": "Bearer key-r"}
    for path, body in (("/generate", tgi(max_new_tokens=4)), ("/v1/generate", {"prompt": "x"})):
        r = await http.post(path, json=body, headers=key)
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "2"
    before = len(harness.worker.requests)
    r = await http.post("/generate_stream", json=tgi(max_new_tokens=4), headers=key)
    check_tgi_error(r, 429, "overloaded", "Rate limit")
    assert int(r.headers["retry-after"]) > 0 and r.headers["x-ratelimit-remaining-requests"] == "0"
    r = await http.post("/v1/generate", json={"prompt": "x"}, headers=key)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
    assert len(harness.worker.requests) == before
    assert 'inferq:rate_limited_total{kind="requests",model_name="SmolLM2-135M-Instruct"} 2.0' in harness.metrics()


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(max_queue_len=0, request_timeout_s=10.0)])
async def test_a_full_queue_is_tgi_overloaded(harness):
    r = await harness.http.post("/generate", json=tgi(max_new_tokens=4))
    check_tgi_error(r, 429, "overloaded")
    assert "retry-after" in r.headers


async def test_openapi_documents_the_routes(harness):
    doc = (await harness.http.get("/openapi.json")).json()
    assert {"/generate", "/generate_stream", "/", "/info", "/v1/generate"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    for path, name in (("/generate", "TgiGenerateRequest"), ("/", "TgiCompatRequest"),
                       ("/v1/generate", "GenerateRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"} and name in schemas
    assert {"TgiParameters", "TgiGrammar"} <= set(schemas)
    assert set(doc["paths"]["/generate"]["post"]["responses"]) >= {"200", "401", "422", "424", "429"}
    # The POSTs skip FastAPI's router, as the OpenAI generation routes do (GatewayApp.serve_directly).
    assert {"/generate", "/generate_stream", "/", "/v1/generate"} <= set(harness.app._direct)


@pytest.mark.parametrize("path,mode", [
    ("/generate", GenerationMode.POSITIVE),
    ("/generate", GenerationMode.NEGATIVE),
    ("/", GenerationMode.POSITIVE),
    ("/v1/generate", GenerationMode.POSITIVE),
    ("/v1/generate", GenerationMode.NEGATIVE),
])
async def test_fuzz_the_published_schema(harness, path: str, mode: GenerationMode) -> None:
    """No 5xx, no hang, only documented answers; bodies that break the schema refused
    (tests/test_gateway_fuzz.py's checks)."""
    schema = await openapi_schema(harness.base_url)
    await asyncio.to_thread(fuzz, schema[path]["POST"], harness.base_url, mode)

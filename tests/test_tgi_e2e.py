"""Text Generation Inference's routes and ``POST /v1/generate`` on the real model, through
the client library TGI's users run: ``huggingface_hub.InferenceClient`` -> gateway
process -> Redis -> worker process (our engine, SmolLM2 float32 on CPU), the session's
stack (``smollm_stack``, tests/conftest.py). Greedy TGI output must be the text, tokens
and logprobs that ``/v1/completions`` gives for the same prompt. Parameters, refusals and
the pipeline's policies with a fake worker: tests/test_tgi_gateway.py."""

from __future__ import annotations

import httpx
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
NUM_TOKENS = 12
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def completion(url: str, prompt: str, **fields: object) -> dict:
    """The greedy ``/v1/completions`` answer (with each token's logprob)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "logprobs": 0, **fields}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_text_generation_details_equal_greedy_completions(smollm_stack, smollm_tokenizer) -> None:
    expected = completion(smollm_stack, PROMPT)
    choice = expected["choices"][0]
    client = InferenceClient(base_url=smollm_stack)
    out = client.text_generation(PROMPT, max_new_tokens=NUM_TOKENS, details=True, return_full_text=False,
                                 decoder_input_details=True)
    assert out.generated_text == choice["text"] and choice["finish_reason"] == "length"
    details = out.details
    assert details.finish_reason == "length" and details.generated_tokens == NUM_TOKENS
    assert details.seed is None  # greedy
    ids = [t.id for t in details.tokens]
    assert smollm_tokenizer.decode(ids) == out.generated_text
    assert "".join(t.text for t in details.tokens) == out.generated_text
    assert not any(t.special for t in details.tokens)
    assert [t.logprob for t in details.tokens] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-4)
    prompt_ids = smollm_tokenizer(PROMPT)["input_ids"]
    assert [p.id for p in details.prefill] == prompt_ids
    assert details.prefill[0].logprob is None and all(p.logprob < 0 for p in details.prefill[1:])


def test_text_generation_streams_the_same_text(smollm_stack) -> None:
    expected = completion(smollm_stack, PROMPT)["choices"][0]["text"]
    client = InferenceClient(base_url=smollm_stack)
    events = list(client.text_generation(PROMPT, max_new_tokens=NUM_TOKENS, stream=True, details=True))
    assert len(events) == NUM_TOKENS and [e.index for e in events] == list(range(1, NUM_TOKENS + 1))
    assert "".join(e.token.text for e in events) == expected
    assert all(e.token.logprob < 0 or e.token.logprob == 0 for e in events)  # details ask for logprobs
    last = events[-1]
    assert last.generated_text == PROMPT + expected  # POST / returns the prompt too unless told not to
    assert last.details.finish_reason == "length" and last.details.generated_tokens == NUM_TOKENS
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    texts = list(client.text_generation(PROMPT, max_new_tokens=NUM_TOKENS, stream=True))  # plain strings
    assert "".join(texts) == expected


def test_an_answer_ends_with_eos_or_a_stop_sequence(smollm_stack, smollm_tokenizer) -> None:
    r = httpx.post(f"{smollm_stack}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": QUESTION, "max_tokens": 32, "temperature": 0})
    answer = r.json()["choices"][0]["message"]["content"]
    assert r.json()["choices"][0]["finish_reason"] == "stop" and "Paris" in answer
    inputs = smollm_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    r = httpx.post(f"{smollm_stack}/generate", timeout=120, json={
        "inputs": inputs, "parameters": {"max_new_tokens": 32, "details": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["generated_text"] == answer and body["details"]["finish_reason"] == "eos_token"
    last = body["details"]["tokens"][-1]
    assert last["special"] and last["id"] in smollm_tokenizer.all_special_ids and last["text"] == ""
    end = answer.index("Paris") + len("Paris")
    client = InferenceClient(base_url=smollm_stack)
    events = list(client.text_generation(inputs, max_new_tokens=32, stop=["Paris"], details=True, stream=True,
                                         return_full_text=False))
    assert "".join(e.token.text for e in events) == events[-1].generated_text == answer[:end]
    assert events[-1].details.finish_reason == "stop_sequence"
    out = client.text_generation(inputs, max_new_tokens=32, stop=["Paris"], details=True, return_full_text=False)
    assert out.generated_text == answer[:end]  # TGI keeps the stop sequence
    assert out.details.finish_reason == "stop_sequence"
    assert "".join(t.text for t in out.details.tokens) == out.generated_text


def test_sampling_reports_its_seed_and_repeats_with_it(smollm_stack) -> None:
    client = InferenceClient(base_url=smollm_stack)
    first = client.text_generation(PROMPT, max_new_tokens=8, do_sample=True, temperature=1.5, details=True,
                                   return_full_text=False)
    assert first.details.seed is not None
    again = client.text_generation(PROMPT, max_new_tokens=8, temperature=1.5, seed=first.details.seed, details=True,
                                   return_full_text=False)
    assert again.generated_text == first.generated_text and again.details.seed == first.details.seed


def test_refusals_and_endpoint_info(smollm_stack) -> None:
    client = InferenceClient(base_url=smollm_stack)
    with pytest.raises(ValidationError, match="typical_p"):
        client.text_generation(PROMPT, max_new_tokens=4, typical_p=0.5)
    with pytest.raises(ValidationError, match="max_new_tokens"):
        client.text_generation(PROMPT, max_new_tokens=10**6)
    with pytest.raises(ValidationError, match="decoder_input_details"):  # refused before the stream starts
        client.text_generation(PROMPT, max_new_tokens=4, stream=True, details=True, decoder_input_details=True)
    # get_endpoint_info reads GET /info of a URL only under the "hf-inference" provider.
    info = InferenceClient(base_url=smollm_stack, provider="hf-inference").get_endpoint_info()
    assert info["model_id"] == MODEL and info["max_total_tokens"] == 8192 and info["max_input_tokens"] == 8191


def test_v1_generate_equals_greedy_completions(smollm_stack) -> None:
    expected = completion(smollm_stack, PROMPT)
    r = httpx.post(f"{smollm_stack}/v1/generate", timeout=120,
                   json={"prompt": PROMPT, "max_new_tokens": NUM_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == expected["choices"][0]["text"] and body["model"] == MODEL
    assert body["generated_tokens"] == expected["usage"]["completion_tokens"] == NUM_TOKENS
    assert body["finish_reason"] == "length" and body["latency_ms"] > 0

"""Unit tests of the gateway's pure parts: detokenizer, stop strings, output
processing, request schemas, context-length checks. No Redis, real tokenizer."""

from __future__ import annotations

import pytest

from gateway.detokenizer import StreamDetokenizer, WindowDetokenizer
from gateway.errors import OpenAIError
from gateway.handlers import resolve_max_tokens
from gateway.output import OutputProcessor
from gateway.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from gateway.stop import StopChecker


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from shared.model_source import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("SmolLM2-135M-Instruct").path)


def _stream_decode(tok, ids, prompt=()):
    """Per-token texts and the flush, of both detokenizers (which must agree)."""
    results = []
    for d in (WindowDetokenizer(tok, prompt), StreamDetokenizer(tok.backend_tokenizer, prompt)):
        results.append(([d.add(i) for i in ids], d.flush()))
    assert results[0] == results[1]
    return results[1]


@pytest.mark.parametrize("text", [" Paris is the capital.", "héllo 你好 🎉 done", "日本語のテキスト😀👍", "a\nb  c"])
def test_detokenizer_matches_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    parts, tail = _stream_decode(tok, ids, tok.encode("Hello:", add_special_tokens=False))
    assert "".join(parts) + tail == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in parts)


def test_detokenizer_holds_split_multibyte_character(tok):
    ids = tok.encode("🎉", add_special_tokens=False)
    # The emoji is split over several tokens, each of which alone is U+FFFD.
    assert len(ids) > 1 and all(tok.decode([i]) .endswith("\ufffd") for i in ids[:-1])
    parts, tail = _stream_decode(tok, ids)
    assert parts[:-1] == [""] * (len(ids) - 1)
    assert parts[-1] == "🎉" and tail == ""


def test_detokenizer_flushes_incomplete_character_at_end(tok):
    ids = tok.encode("🎉", add_special_tokens=False)[:1]
    parts, tail = _stream_decode(tok, ids)
    assert parts == [""] and tail.endswith("\ufffd")


def test_detokenizer_skips_eos(tok):
    ids = tok.encode(" Paris", add_special_tokens=False) + [tok.eos_token_id]
    parts, tail = _stream_decode(tok, ids)
    assert "".join(parts) + tail == " Paris"


def test_stop_checker_holds_back_partial_stop():
    s = StopChecker(["STOP"])
    assert s.add("abcST").text == "ab"  # "cST" could start "STOP"
    r = s.add("OPxyz")
    assert r.stopped and r.text == "c" and r.stop == "STOP"
    assert s.add("more").text == "" and s.flush() == ""


def test_stop_checker_earliest_match_and_flush():
    s = StopChecker(["xyz", "b"])
    r = s.add("aaxyzb")
    assert r.stopped and r.text == "aa" and r.stop == "xyz"
    s2 = StopChecker(["longstop"])
    released = s2.add("hello long").text
    assert released == "hel"
    assert s2.flush() == "lo long"


def test_stop_checker_without_stops_releases_all():
    s = StopChecker(["", ""])
    assert s.add("abc").text == "abc" and s.flush() == ""


def test_stop_checker_split_over_many_chunks():
    s = StopChecker(["</end>"])
    out = []
    for ch in "text </e</end> tail":
        r = s.add(ch)
        out.append(r.text)
        if r.stopped:
            break
    assert "".join(out) == "text </e"


def test_output_processor_counts_tokens_to_stop(tok):
    ids = tok.encode(" Paris is the capital.", add_special_tokens=False)
    p = OutputProcessor(tok, [], [" the"], {tok.eos_token_id})
    step = p.process(ids, None)
    assert step.text == " Paris is" and step.finish_reason == "stop" and step.stop_string == " the"
    assert p.num_output_tokens == 3  # " Paris", " is", " the"


def test_output_processor_hides_stop_token_and_flushes(tok):
    ids = tok.encode(" Paris is", add_special_tokens=False)
    stop_tok = tok.encode(" the", add_special_tokens=False)[0]
    p = OutputProcessor(tok, [], ["never"], {tok.eos_token_id, stop_tok})
    first = p.process(ids, None)
    last = p.process([stop_tok], "stop")
    assert first.text + last.text == " Paris is"
    assert last.finish_reason == "stop" and last.stop_string is None
    assert p.num_output_tokens == 3


def test_output_processor_length_keeps_non_hidden_last_token(tok):
    ids = tok.encode(" Paris is the", add_special_tokens=False)
    p = OutputProcessor(tok, [], [], {ids[-1]})
    step = p.process(ids, "length")  # hidden only when the worker stopped on it
    assert step.text == " Paris is the" and step.finish_reason == "length"


def _err(model, body: bytes) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        req = parse_body(model, body)
        req.check()
        req.sampling_params(16)
    return info.value


@pytest.mark.parametrize("body,param", [
    (b'{"model": "m", "prompt": "x", "temperature": 5}', "temperature"),
    (b'{"model": "m", "prompt": "x", "temperature": "hot"}', "temperature"),
    (b'{"model": "m", "prompt": "x", "top_p": 0}', "top_p"),
    (b'{"model": "m", "prompt": "x", "n": 0}', "n"),
    (b'{"model": "m", "prompt": "x", "logprobs": 6}', "logprobs"),
    (b'{"model": "m", "prompt": "x", "echo": 1}', "echo"),
    (b'{"model": "m", "prompt": [' + b'"a", ' * 32 + b'"a"]}', "prompt"),
    (b'{"model": "m", "prompt": ["a", "b", "c", "d", "e"], "n": 13}', "n"),
    (b'{"model": "m", "prompt": "x", "n": 2, "seed": 9223372036854775807}', "seed"),
    (b'{"model": "m"}', "prompt"),
    (b'{"prompt": "x"}', "model"),
    (b'{"model": "m", "prompt": "x", "min_tokens": 99}', "min_tokens"),
    (b'{"model": "m", "prompt": "x", "stop_token_ids": [-1]}', "stop_token_ids"),
])
def test_completion_validation_names_param(body, param):
    err = _err(CompletionRequest, body)
    assert err.status == 400 and err.param == param, err.message


@pytest.mark.parametrize("body,param", [
    (b'{"model": "m", "messages": []}', "messages"),
    (b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "messages"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}',
     "top_logprobs"),
])
def test_chat_validation_names_param(body, param):
    err = _err(ChatCompletionRequest, body)
    assert err.status == 400 and err.param == param, err.message


def test_invalid_json_is_400():
    err = _err(CompletionRequest, b'{"model": ')
    assert err.status == 400 and "JSON" in err.message


@pytest.mark.parametrize("prompt", ['"hi"', '["hi"]', "[1, 2, 3]", "[[1, 2, 3]]"])
def test_prompt_forms_accepted(prompt):
    req = parse_body(CompletionRequest, f'{{"model": "m", "prompt": {prompt}, "stop": "x"}}'.encode())
    req.check()
    assert req.stop_strings == ["x"]


def test_chat_content_parts_and_max_completion_tokens():
    req = parse_body(ChatCompletionRequest, b'{"model": "m", "max_tokens": 5, "max_completion_tokens": 7,'
                     b' "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
                     b' {"type": "text", "text": "b"}]}]}')
    assert req.messages[0].to_template() == {"role": "user", "content": "ab"}
    assert req.requested_max_tokens == 7


def test_resolve_max_tokens():
    assert resolve_max_tokens(None, 16, 10, 100, "prompt", "max_tokens") == 16
    assert resolve_max_tokens(None, None, 10, 100, "messages", "max_tokens") == 90
    with pytest.raises(OpenAIError) as info:
        resolve_max_tokens(95, None, 10, 100, "messages", "max_completion_tokens")
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(OpenAIError) as info:
        resolve_max_tokens(None, 16, 100, 100, "prompt", "max_tokens")
    assert info.value.param == "prompt"

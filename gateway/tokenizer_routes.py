"""vLLM's tokenizer endpoints, ``POST /tokenize`` and ``POST /detokenize``, with vLLM's
request and response shapes (``vllm/entrypoints/serve/tokenize/protocol.py``).

``/tokenize`` takes ``{"model", "prompt"}`` (special tokens added unless
``add_special_tokens: false``) or ``{"model", "messages"}`` (the chat template, with the
generation prompt unless ``add_generation_prompt: false``; no extra special tokens unless
``add_special_tokens: true``) and answers ``{"count", "max_model_len", "tokens"}``, plus
``token_strs`` when ``return_token_strs`` is true. ``/detokenize`` takes ``{"model",
"tokens"}`` and answers ``{"prompt"}``. ``model`` may be left out, as in vLLM. Nothing is
bounded by ``max_model_len`` (vLLM neither: the answer says it, for the client to compare);
the body limit bounds the work, which runs on the encode pool within its time budget.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from gateway.errors import OpenAIError
from gateway.handlers import check_auth, read_body
from gateway.schemas import MAX_NUM_MESSAGES, ChatMessage, Int64, parse_body
from gateway.state import GatewayState

_STRICT = ConfigDict(extra="ignore", strict=True)


class TokenizeRequest(BaseModel):
    """Body of ``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """Body of ``POST /detokenize``."""

    model_config = _STRICT
    model: str | None = None
    tokens: list[Int64]


def _check_model(state: GatewayState, model: str | None) -> None:
    if model is not None and model != state.served_model_name:
        raise OpenAIError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")


async def handle_tokenize(state: GatewayState, request: Request) -> Response:
    """Serve ``POST /tokenize``: 401, 413, 400 (body; neither or both of ``prompt`` and
    ``messages``; a template error), 404 (model), 503 (encode time budget)."""
    try:
        check_auth(state, request)
        req: TokenizeRequest = parse_body(TokenizeRequest, await read_body(request, state.settings.max_body_bytes))
        _check_model(state, req.model)
        tok = state.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            if len(req.messages) > MAX_NUM_MESSAGES:
                raise OpenAIError(400, f"messages takes at most {MAX_NUM_MESSAGES} messages", param="messages")
            ids = await tok.chat_prompt([m.to_template() for m in req.messages], None,
                                        add_generation_prompt=req.add_generation_prompt,
                                        add_special_tokens=bool(req.add_special_tokens))
        else:
            add_special = req.add_special_tokens is None or req.add_special_tokens
            ids = await tok.run_blocking(tok.encode, req.prompt, add_special, param="prompt")
    except OpenAIError as exc:
        return exc.response()
    body: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = tok.tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(body)


async def handle_detokenize(state: GatewayState, request: Request) -> Response:
    """Serve ``POST /detokenize``: 401, 413, 400 (body; a token id outside the
    vocabulary), 404 (model), 503 (encode time budget). Special tokens are kept in the
    text, as vLLM's ``/detokenize`` does."""
    try:
        check_auth(state, request)
        req: DetokenizeRequest = parse_body(DetokenizeRequest, await read_body(request, state.settings.max_body_bytes))
        _check_model(state, req.model)
        tok = state.tokenizer
        bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary [0, {tok.vocab_size})",
                              param="tokens")
        text = await tok.run_blocking(tok.tokenizer.decode, req.tokens, param="tokens", action="detokenizing")
    except OpenAIError as exc:
        return exc.response()
    return JSONResponse({"prompt": text})
